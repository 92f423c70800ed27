"""The run config: the core's sections, and component sections that plugins fill in.

A component section (``[optimizer]``, ``[data]``, ...) is a :class:`ComponentConfig`: its
``name`` selects a registered component and its other keys are that component's own options
class, so a plugin brings typed options without touching this file. A component-list field
(``metrics.backends``) selects several; each one's options live in a sub-table named after it
(``[metrics.jsonl]``).

No field's default is computed from another field here: values that depend on other fields
(``n_kv_heads`` defaulting to ``n_heads``) stay ``None`` in the config and are resolved by
properties, after every layer (defaults, file, command line) has been applied.
"""

from __future__ import annotations

from typing import Any

import attrs

from forge_lm.validators import FieldError, positive

CATEGORY = "forge_lm.category"  # attrs field metadata: the component category of the field
MANY = "forge_lm.many"  # attrs field metadata: the field selects a list of components


@attrs.frozen
class ComponentConfig:
    """A selected component: its registered ``name`` and its validated ``options`` object."""

    name: str
    options: Any = None


def component(category: str, default: str, doc: str) -> Any:
    """A config field selecting one component of ``category`` (default ``default``)."""
    return attrs.field(
        factory=lambda: ComponentConfig(default),
        metadata={CATEGORY: category, "doc": doc},
    )


def components(category: str, default: tuple[str, ...], doc: str) -> Any:
    """A config field selecting a list of components of ``category``."""
    return attrs.field(
        factory=lambda: [ComponentConfig(name) for name in default],
        metadata={CATEGORY: category, MANY: True, "doc": doc},
    )


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@attrs.frozen
class RunSection:
    name: str = attrs.field(default="forge", metadata=_doc("Run name; the run directory is <output_dir>/<name>."))
    output_dir: str = attrs.field(default="runs", metadata=_doc("Directory holding run directories."))
    seed: int = attrs.field(default=0, metadata=_doc("Seed of every random generator the run uses."))


@attrs.frozen
class ModelSection:
    dim: int = attrs.field(default=256, validator=positive, metadata=_doc("Hidden size."))
    n_layers: int = attrs.field(default=4, validator=positive, metadata=_doc("Transformer blocks."))
    n_heads: int = attrs.field(default=4, validator=positive, metadata=_doc("Attention (query) heads."))
    n_kv_heads: int | None = attrs.field(
        default=None, validator=positive, metadata=_doc("Key/value heads (grouped-query attention); unset = n_heads.")
    )
    vocab_size: int | None = attrs.field(
        default=None, validator=positive, metadata=_doc("Vocabulary size; unset = the tokenizer's.")
    )
    max_seq_len: int = attrs.field(
        default=2048, validator=positive, metadata=_doc("Longest sequence the model accepts.")
    )

    def __attrs_post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise FieldError("n_heads", f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise FieldError(
                "n_kv_heads", f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@attrs.frozen
class TrainSection:
    steps: int = attrs.field(default=100, validator=positive, metadata=_doc("Optimizer steps to run."))
    batch_size: int = attrs.field(default=8, validator=positive, metadata=_doc("Sequences per optimizer step."))
    seq_len: int = attrs.field(default=256, validator=positive, metadata=_doc("Tokens per training sequence."))


@attrs.frozen
class MetricsSection:
    interval: int = attrs.field(default=10, validator=positive, metadata=_doc("Log every this many steps."))
    backends: list[ComponentConfig] = components(
        "metrics_backends", ("console", "jsonl"), "Where metrics go; options in [metrics.<backend>]."
    )


@attrs.frozen
class ForgeConfig:
    """A whole run: every section, fully resolved."""

    run: RunSection = attrs.field(factory=RunSection)
    model: ModelSection = attrs.field(factory=ModelSection)
    train: TrainSection = attrs.field(factory=TrainSection)
    tokenizer: ComponentConfig = component("tokenizers", "bytes", "Text to token ids.")
    data: ComponentConfig = component("datasets", "synthetic", "Training data.")
    optimizer: ComponentConfig = component("optimizers", "adamw", "Optimizer.")
    scheduler: ComponentConfig = component("schedulers", "cosine", "Learning-rate schedule.")
    loss: ComponentConfig = component("losses", "cross_entropy", "Training loss.")
    metrics: MetricsSection = attrs.field(factory=MetricsSection)


def check_cross_section(config: ForgeConfig) -> list[tuple[str, str]]:
    """Rules that involve several sections: a list of (``[section] key``, message)."""
    problems = []
    if config.train.seq_len > config.model.max_seq_len:
        problems.append(
            (
                "[train] seq_len",
                f"{config.train.seq_len} exceeds [model] max_seq_len ({config.model.max_seq_len}); "
                "lower seq_len or raise max_seq_len",
            )
        )
    return problems
