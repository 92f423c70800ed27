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

import os
import re
import unicodedata
from typing import Any

import attrs

from forge_lm.validators import FieldError, between, finite, non_negative, one_of, positive

CATEGORY = "forge_lm.category"  # attrs field metadata: the component category of the field
MANY = "forge_lm.many"  # attrs field metadata: the field selects a list of components
ARRAY = "forge_lm.array"  # attrs field metadata: the field is an array of component tables
KEYED = "forge_lm.keyed"  # attrs field metadata: a table of entries keyed by user-chosen names (its class)
OPTIONS_OF = "forge_lm.options_of"  # attrs field metadata: options of always-present components, by name


@attrs.frozen
class ComponentConfig:
    """A selected component: its registered ``name`` and its validated ``options`` object.

    A config from the loader also carries the resolved registry entry, and ``chosen.build(*args)``
    is the one way to build a selected component: with its options and the category's factory
    arguments, a factory's failure reported as a PluginError naming the component and its
    plugin. Code holding only the config (a component whose options select another, such as an
    MoE layer and its router) builds it the same way. The entry is not part of the config's
    value: it is neither compared nor written out.
    """

    name: str
    options: Any = None
    component: Any = attrs.field(default=None, eq=False, repr=False)

    def build(self, *args: Any, **kwargs: Any) -> Any:
        """The component built with these options and the category's factory arguments."""
        if self.component is None:
            raise TypeError(f"component '{self.name}' was not resolved; load configs with forge_lm.config.load_config")
        return self.component.build_for_run(self.options, *args, **kwargs)


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


def component_array(category: str, doc: str) -> Any:
    """A config field holding an array of component tables (``[[data.sources]]``), each with
    its own ``name`` and options; for components that compose others (a data mixture)."""
    return attrs.field(factory=list, metadata={CATEGORY: category, ARRAY: True, "doc": doc})


def component_options(category: str, doc: str) -> Any:
    """A config field holding options of components that are all present at once (every
    registered model transform), one table per component it configures (``[transforms.<name>]``);
    a component without a table gets its default options."""
    return attrs.field(factory=dict, metadata={CATEGORY: category, OPTIONS_OF: True, "doc": doc})


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@attrs.frozen
class LlamaOptions:
    """Options of the built-in ``llama`` model family: the ``[model]`` section when ``name`` is
    ``"llama"`` (the default). Another family's options class must have ``vocab_size``,
    ``max_seq_len`` and ``init_std`` too."""

    dim: int = attrs.field(default=256, validator=positive, metadata=_doc("Hidden size."))
    n_layers: int = attrs.field(default=4, validator=positive, metadata=_doc("Transformer blocks."))
    n_heads: int = attrs.field(default=4, validator=positive, metadata=_doc("Attention (query) heads."))
    n_kv_heads: int | None = attrs.field(
        default=None, validator=positive, metadata=_doc("Key/value heads (grouped-query attention); unset = n_heads.")
    )
    head_dim: int | None = attrs.field(
        default=None,
        validator=positive,
        metadata=_doc(
            "Size of each attention head, even (RoPE turns pairs); unset = dim / n_heads. Set, the query heads "
            "together may be wider or narrower than dim (Qwen3: dim 1024, 16 heads of 128)."
        ),
    )
    vocab_size: int | None = attrs.field(
        default=None, validator=positive, metadata=_doc("Vocabulary size; unset = the tokenizer's.")
    )
    max_seq_len: int = attrs.field(
        default=2048, validator=positive, metadata=_doc("Longest sequence the model accepts.")
    )
    rope_theta: float = attrs.field(default=10000.0, validator=positive, metadata=_doc("RoPE base frequency."))
    norm: str = attrs.field(
        default="rmsnorm", validator=one_of("rmsnorm", "layernorm"), metadata=_doc("Normalisation layers.")
    )
    norm_eps: float = attrs.field(default=1e-5, validator=positive, metadata=_doc("Epsilon of every norm."))
    qk_norm: bool = attrs.field(default=False, metadata=_doc("Normalise queries and keys per head before RoPE."))
    attention_backend: str = attrs.field(
        default="auto",
        validator=one_of("auto", "sdpa", "flex", "eager"),
        metadata=_doc(
            "How attention applies the causal and packed-document masks: 'sdpa' "
            "(F.scaled_dot_product_attention; a dense [B, 1, T, T] mask for packed documents), "
            "'flex' (FlexAttention's block mask; compiled on CUDA; on CPU eager, much slower and without "
            "backward, so evaluation only), 'eager' (written out: one [T, T] score matrix per head, "
            "for short sequences), 'auto': flex on CUDA; on CPU eager up to 128 keys (512 in bf16), "
            "sdpa beyond. Context parallelism always uses sdpa."
        ),
    )
    tie_embeddings: bool = attrs.field(default=True, metadata=_doc("Output head shares the embedding matrix."))
    init_std: float = attrs.field(
        default=0.02, validator=positive, metadata=_doc("Init std; residual projections get init_std/sqrt(2*n_layers).")
    )
    ffn: ComponentConfig = component("feed_forwards", "swiglu", "Feed-forward layer; its factory sees the layer index.")
    attention: ComponentConfig = component(
        "attentions", "gqa", "Attention layer (grouped-query 'gqa', 'sliding_window', or a plugin's)."
    )

    def __attrs_post_init__(self) -> None:
        if self.head_dim is None and self.dim % self.n_heads:
            raise FieldError("n_heads", f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise FieldError(
                "n_kv_heads", f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})"
            )
        if self.head_size % 2:
            if self.head_dim is not None:
                raise FieldError("head_dim", f"must be even for RoPE, got {self.head_dim}")
            raise FieldError("n_heads", f"dim / n_heads = {self.head_size} must be even for RoPE")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_size(self) -> int:
        """Each attention head's size: ``head_dim`` if set, else ``dim // n_heads``."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads


ModelSection = LlamaOptions  # the name before model families; kept for code that builds one directly


@attrs.define
class SwiGLUOptions:
    """Options of the built-in ``swiglu`` feed-forward layer (``[model.ffn]``), registered by
    :mod:`forge_lm.default_plugins.feed_forwards` under the path
    ``forge_lm.default_plugins.options.feed_forwards:SwiGLUOptions``. Defined here, below the
    model, because the core's Hugging Face conversion (:mod:`forge_lm.model.hf.llama`) makes
    them from a ``config.json``."""

    # hidden = multiple_of * ceil(hidden_multiplier * dim / multiple_of); 8/3 keeps the
    # parameter count of a 4x GELU MLP with three matrices instead of two.
    hidden_multiplier: float = attrs.field(default=8 / 3, validator=positive)
    multiple_of: int = attrs.field(default=64, validator=positive)


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# Batches one evaluation may read. Every set's batches are read once at the start (a set too short
# fails there), so a count in the billions would hang the start instead of being refused.
MAX_EVAL_STEPS = 100_000


def _eval_steps(instance: Any, attribute: Any, value: int | None) -> None:
    if value is not None and value > MAX_EVAL_STEPS:
        raise FieldError(
            attribute.name,
            f"must be at most {MAX_EVAL_STEPS} (batches per evaluation, all read once when the run starts), "
            f"got {value!r}",
        )


def _device_name(instance: Any, attribute: Any, value: str) -> None:
    """The form of a device name; whether this machine has it is checked when a run starts."""
    if not _DEVICE.fullmatch(value):
        raise FieldError(attribute.name, f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")


def _run_directory(instance: Any, attribute: Any, value: str) -> None:
    """A path a run may be written into: not empty (an unset shell variable would put the run in
    the current directory) and not the file system's root."""
    if not value.strip():
        raise FieldError(
            attribute.name, "is empty; name the run directory (an unset shell variable in --train.output_dir=?)"
        )
    absolute = os.path.abspath(value)
    if os.path.dirname(absolute) == absolute:
        raise FieldError(attribute.name, f"is the file system's root ({value!r}); name a directory for the run")
    # Printed in every message about the run: a terminal escape in it would redraw the screen (a fake
    # error line), a NUL cannot be a path, and bytes that are not UTF-8 cannot be written into the run's files.
    if any(0xDC80 <= ord(char) <= 0xDCFF for char in value):
        raise FieldError(attribute.name, f"is not valid UTF-8 ({value!r}); name the run directory in UTF-8")
    if any(unicodedata.category(char) in ("Cc", "Cf", "Cs") and char != "\t" for char in value):  # a tab is harmless
        raise FieldError(
            attribute.name,
            f"holds a control character ({value!r}: a NUL, a terminal escape, a line break, ...); "
            "name the run directory without one",
        )


def _above_one(instance: Any, attribute: Any, value: Any) -> None:
    if not value > 1.0:
        raise FieldError(attribute.name, f"must be greater than 1, got {value!r}")


def _below_one(instance: Any, attribute: Any, value: Any) -> None:
    if not 0.0 < value < 1.0:
        raise FieldError(attribute.name, f"must be between 0 and 1 (exclusive), got {value!r}")


@attrs.frozen
class LossScaleSection:
    """The dynamic loss scaler of ``precision = "fp16"`` (named as ``torch.amp.GradScaler`` names them)."""

    init_scale: float = attrs.field(
        default=65536.0, validator=[finite, positive], metadata=_doc("The loss scale of the first step.")
    )
    growth_factor: float = attrs.field(
        default=2.0,
        validator=[finite, _above_one],
        metadata=_doc("The scale is multiplied by this after growth_interval steps without overflow."),
    )
    backoff_factor: float = attrs.field(
        default=0.5,
        validator=_below_one,
        metadata=_doc("The scale is multiplied by this at an overflow (the step is skipped)."),
    )
    growth_interval: int = attrs.field(
        default=2000, validator=positive, metadata=_doc("Steps in a row without overflow before the scale grows.")
    )


@attrs.frozen
class BatchRampSection:
    """``[train.batch_ramp]``: the global batch grows from ``start_batch_size`` to the configured one
    (batch_size x grad_accum_steps x data-parallel ranks) by adding micro-batches per step, so
    memory stays flat (forge_lm.train.batch_ramp). Unset ``start_batch_size``: no ramp."""

    start_batch_size: int | None = attrs.field(
        default=None,
        validator=positive,
        metadata=_doc(
            "Global batch of the first step, in sequences: a multiple of batch_size x data-parallel ranks, below "
            "the full batch; unset = no ramp."
        ),
    )
    increment: int | None = attrs.field(
        default=None,
        validator=positive,
        metadata=_doc(
            "Sequences the global batch grows by at each increase, a multiple of batch_size x data-parallel "
            "ranks that divides the growth; unset = batch_size x data-parallel ranks (one micro-batch per rank)."
        ),
    )
    ramp_steps: int = attrs.field(
        default=0,
        validator=non_negative,
        metadata=_doc("Optimizer steps over which the batch reaches the full size (set this or ramp_tokens)."),
    )
    ramp_tokens: int = attrs.field(
        default=0,
        validator=non_negative,
        metadata=_doc("Tokens trained over which the batch reaches the full size (set this or ramp_steps)."),
    )
    lr_scaling: str = attrs.field(
        default="none",
        validator=one_of("none", "linear", "sqrt"),
        metadata=_doc(
            "The learning rate of a smaller batch: 'none' as scheduled, 'linear' times batch / full batch, "
            "'sqrt' times its square root."
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.start_batch_size is None:
            return
        if (self.ramp_steps > 0) == (self.ramp_tokens > 0):
            both = "both are set" if self.ramp_steps else "neither is set"
            raise FieldError("ramp_steps", f"set exactly one of ramp_steps and ramp_tokens ({both})")


@attrs.frozen
class TrainSection:
    output_dir: str = attrs.field(
        default="runs/default",
        validator=_run_directory,
        metadata=_doc("The run directory: config, manifest, metrics, checkpoints (not empty, not '/')."),
    )
    max_steps: int = attrs.field(default=200, validator=positive, metadata=_doc("Optimizer steps to run."))
    seed: int = attrs.field(
        default=0,
        validator=between(-(2**31), 2**31 - 1),
        metadata=_doc("Seed of every random generator the run uses (a 32-bit integer)."),
    )
    batch_size: int = attrs.field(
        default=16, validator=positive, metadata=_doc("Sequences per micro-batch (per data-parallel rank).")
    )
    seq_len: int = attrs.field(default=128, validator=positive, metadata=_doc("Tokens per training sequence."))
    grad_accum_steps: int = attrs.field(
        default=1, validator=positive, metadata=_doc("Micro-batches per optimizer step.")
    )
    grad_clip: float = attrs.field(
        default=1.0, validator=non_negative, metadata=_doc("Clip the global gradient norm to this; 0 disables.")
    )
    device: str = attrs.field(
        default="auto",
        validator=_device_name,
        metadata=_doc("'auto' (CUDA if available), 'cpu', 'cuda' or 'cuda:N'."),
    )
    precision: str = attrs.field(
        default="auto",
        validator=one_of("auto", "fp32", "bf16", "fp16"),
        metadata=_doc(
            "Autocast dtype; weights stay fp32. 'auto': bf16 on CUDA, fp32 on CPU. 'fp16' scales the loss "
            "dynamically ([train.loss_scale]) and skips a step whose gradients overflow."
        ),
    )
    loss_scale: LossScaleSection = attrs.field(
        factory=LossScaleSection, metadata=_doc("The dynamic loss scaler of precision = 'fp16'.")
    )
    batch_ramp: BatchRampSection = attrs.field(
        factory=BatchRampSection,
        metadata=_doc("Grow the global batch from a start size to the full one ([train.batch_ramp]); off by default."),
    )
    compile: bool = attrs.field(
        default=False, metadata=_doc("torch.compile each transformer block (before FSDP2 wraps it).")
    )
    cpu_linear_kernel: str = attrs.field(
        default="auto",
        validator=one_of("auto", "onednn", "aten"),
        metadata=_doc(
            "Kernel of the model's fp32 linear layers on CPU: 'onednn' (about 2x MKL's sgemm on one AMD EPYC, "
            "slower on an Intel Xeon with AMX), 'aten' (torch's default, bitwise equal to a plain PyTorch model), "
            "'auto': oneDNN where it measured at least 1.1x faster on the model's own products on this host "
            "(cached per CPU, only when measured on an idle machine). CUDA, bf16 autocast and tensor-parallel "
            "layers always use torch's own."
        ),
    )
    cpu_keep_freed_memory: bool = attrs.field(
        default=True,
        metadata=_doc(
            "On CPU with glibc, keep freed memory in the process (malloc's own mappings off, its trim threshold "
            "raised), so that each step's activations do not page-fault in afresh; the process keeps its peak memory. "
            "Process-wide, for the rest of the process."
        ),
    )
    activation_checkpointing: str = attrs.field(
        default="none",
        validator=one_of("none", "full", "selective"),
        metadata=_doc(
            "Recompute activations in backward to save memory: 'full' recomputes every block, "
            "'selective' keeps matmul and attention outputs and recomputes the rest."
        ),
    )
    activation_offload: bool = attrs.field(
        default=False,
        metadata=_doc(
            "CUDA only: copy the activations the forward saves for backward to pinned host memory and back when "
            "backward needs them (torch.autograd.graph.save_on_cpu). With activation_checkpointing, only what "
            "checkpointing keeps of a block (its inputs) is offloaded."
        ),
    )
    memory_check: bool = attrs.field(
        default=True,
        metadata=_doc(
            "Refuse to start when the estimated memory per rank (weights, gradients, optimizer state, "
            "activations) exceeds what the device has free; false starts anyway."
        ),
    )


@attrs.frozen
class CompressionSection:
    """``[distributed.compression]``: the gradient reduction across HSDP's replicas (``dp_replicate``)
    as low-rank factors (PowerSGD, with error feedback); see docs/distributed.md."""

    method: str = attrs.field(
        default="none",
        validator=one_of("none", "powersgd"),
        metadata=_doc(
            "'powersgd': average the gradients across the dp_replicate ranks as rank-`rank` factors (needs "
            "dp_replicate >= 2; not with tp, pp, cp, ep or fp16); 'none': FSDP2's own all-reduce."
        ),
    )
    rank: int = attrs.field(
        default=4,
        validator=positive,
        metadata=_doc("Rank of the factors: a matrix sends (rows + columns) x rank numbers instead of rows x columns."),
    )
    warmup_steps: int = attrs.field(
        default=10,
        validator=non_negative,
        metadata=_doc("Optimizer steps reduced uncompressed first (torch's start_powerSGD_iter)."),
    )
    error_feedback: bool = attrs.field(
        default=True,
        metadata=_doc(
            "Add what compression left out of this rank's gradient to its next one (kept in the checkpoint)."
        ),
    )


@attrs.frozen
class DistributedSection:
    """How the ranks of a ``torchrun`` launch split the work: their product is the world size.

    Mesh dimensions, outermost first: pipeline (``pp``), replicated data parallel
    (``dp_replicate``), sharded data parallel (``dp_shard``), context parallel (``cp``: ranks
    that split each sequence and read the same batch), tensor parallel (``tp``). The
    expert-parallel degree ``ep`` divides ``dp_shard``: expert-parallel ranks are
    data-parallel ranks that also split the experts, so each reads its own data.
    """

    dp_replicate: int = attrs.field(
        default=1, validator=positive, metadata=_doc("Data-parallel replicas (HSDP when dp_shard > 1 too).")
    )
    dp_shard: int = attrs.field(
        default=-1, metadata=_doc("Ranks each FSDP2 shard group spans; -1 = the ranks the other degrees leave.")
    )
    tp: int = attrs.field(
        default=1, validator=positive, metadata=_doc("Tensor-parallel degree (with sequence parallel).")
    )
    pp: int = attrs.field(default=1, validator=positive, metadata=_doc("Pipeline stages."))
    cp: int = attrs.field(
        default=1,
        validator=positive,
        metadata=_doc(
            "Context-parallel degree: each sequence is split over this many ranks (zigzag chunks for causal "
            "balance), which read the same batch; FSDP2 shards over dp_shard x cp."
        ),
    )
    ep: int = attrs.field(
        default=1,
        validator=positive,
        metadata=_doc("Expert-parallel degree (a plugin's MoE layers); divides dp_shard."),
    )
    defer_grad_reduction: bool = attrs.field(
        default=False,
        metadata=_doc(
            "Under FSDP2 with grad_accum_steps > 1, keep full unsharded gradients on every rank until the step's "
            "last micro-batch and reduce once (less communication, more memory); false reduce-scatters after "
            "every micro-batch and keeps only this rank's shard."
        ),
    )
    cpu_offload: bool = attrs.field(
        default=False,
        metadata=_doc(
            "CUDA only: keep this rank's parameter shards, their gradients and the optimizer state in pinned host "
            "memory and run the optimizer step on the CPU (FSDP2's CPUOffloadPolicy; in one process FSDP2 runs over "
            "its one rank and offloads the whole model); the device holds the layers being computed and the "
            "activations."
        ),
    )
    pp_schedule: str = attrs.field(
        default="1f1b",
        validator=one_of("1f1b", "gpipe"),
        metadata=_doc("Pipeline schedule; its microbatches are [train] grad_accum_steps."),
    )
    reduce_dtype: str = attrs.field(
        default="fp32",
        validator=one_of("fp32", "bf16"),
        metadata=_doc(
            "Precision of FSDP2's gradient reduce-scatter and HSDP's all-reduce: 'bf16' sends half the bytes; "
            "no effect without data parallelism (one process, or tp/pp alone)."
        ),
    )
    compression: CompressionSection = attrs.field(
        factory=CompressionSection,
        metadata=_doc("Low-rank (PowerSGD) reduction across the dp_replicate ranks ([distributed.compression])."),
    )
    timeout: float = attrs.field(
        default=600.0,
        validator=positive,
        metadata=_doc(
            "Seconds a collective may wait for the other ranks before the run fails (the process group's "
            "timeout); raise it when a step can be slower than this, e.g. a first compile or a long checkpoint."
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise FieldError("dp_shard", f"must be -1 (the rest) or at least 1, got {self.dp_shard}")


EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_-]+")  # a set's name is part of its metric names


@attrs.frozen
class EvalSet:
    """One named validation set, ``[eval.datasets.<set name>]``: a dataset (``name`` and its
    options in the same table) and the two keys below, which the table reserves.

    Without a ``name`` the set is the run's own ``[data]`` (its name and options), so that a
    mixture's held-out split needs no copy of its sources.
    """

    dataset: ComponentConfig | None = attrs.field(
        default=None,
        metadata={
            CATEGORY: "datasets",
            "doc": "The dataset; unset = the run's [data].",
            "unset": "the set is the run's [data] as configured there",  # for the loader's messages
        },
    )
    split: str = attrs.field(
        default="eval",
        validator=one_of("eval", "train"),
        metadata=_doc(
            "The dataset's split to read: 'eval', its held-out part; 'train', the rest (with eval_fraction = 0, "
            "the whole dataset: a separate validation file)."
        ),
    )
    steps: int | None = attrs.field(
        default=None,
        validator=[positive, _eval_steps],
        metadata=_doc(f"Batches per evaluation of this set (at most {MAX_EVAL_STEPS}); unset = [eval] steps."),
    )


@attrs.frozen
class EvalSection:
    interval: int = attrs.field(
        default=100, validator=non_negative, metadata=_doc("Evaluate every this many steps (and at the end); 0 never.")
    )
    steps: int = attrs.field(
        default=4,
        validator=[positive, _eval_steps],
        metadata=_doc(f"Batches per evaluation (at most {MAX_EVAL_STEPS})."),
    )
    datasets: dict[str, EvalSet] = attrs.field(
        factory=dict,
        metadata={
            KEYED: EvalSet,
            "doc": (
                "Named validation sets, [eval.datasets.<set name>], each logged as eval/<set name>/loss and "
                "eval/<set name>/perplexity; they replace the default, the held-out split of [data] (eval/loss)."
            ),
        },
    )
    evaluators: list[ComponentConfig] = components(
        "evaluators",
        (),
        "What else runs on the live model at each evaluation (a plugin's benchmarks); options in [eval.<name>].",
    )

    def __attrs_post_init__(self) -> None:
        for name in self.datasets:
            if not EVAL_SET_NAME.fullmatch(name):
                raise FieldError(
                    "datasets",
                    f"the set name {name!r} may hold only letters, digits, '_' and '-' (and at least one): it "
                    "is part of the set's metric names, eval/<set name>/loss",
                )


@attrs.frozen
class KeepRange:
    """One retention rule by step range, ``[[checkpoint.keep]]``."""

    every: int = attrs.field(validator=positive, metadata=_doc("Keep every step divisible by this, forever."))
    until_step: int | None = attrs.field(
        default=None,
        validator=positive,
        metadata=_doc("The last step this rule covers (the earlier rules' steps excepted); unset = no end."),
    )


# A bucket and a prefix of plain segments: no credentials (user:password@), no query (?endpoint=),
# no empty, '.' or '..' segment, so that every key a run writes stays under the prefix.
_STORE_URL = re.compile(r"(s3|gs|gcs)://([a-z0-9][a-z0-9._-]{1,61}[a-z0-9])((/[A-Za-z0-9_.=+-]+)*)/?")


def _object_store_url(_: Any, attribute: Any, value: str | None) -> None:
    if value is None:
        return
    match = _STORE_URL.fullmatch(value)
    if match is None or any(part in (".", "..") for part in match.group(3).split("/")):
        raise FieldError(
            attribute.name,
            f"{value!r} is not an object-store URL: give s3://bucket/prefix or gs://bucket/prefix (a bucket name, "
            "then path segments of letters, digits and _.=+-; no credentials, query or '..'). Checkpoints on a "
            "local disk go to <train.output_dir>/checkpoints: leave dir unset",
        )


def _ranges_in_order(_: Any, attribute: Any, rules: list[KeepRange]) -> None:
    ends = [rule.until_step for rule in rules]
    if None in ends[:-1]:
        raise FieldError(attribute.name, "only the last [[checkpoint.keep]] rule may leave until_step unset")
    bounded = [end for end in ends if end is not None]
    if bounded != sorted(set(bounded)):
        raise FieldError(attribute.name, f"the rules' until_step must rise from one rule to the next, got {ends}")


@attrs.frozen
class GrowthSection:
    """``[checkpoint.growth]``: how ``init_from``'s weights fill a larger ``[model]``
    (:mod:`forge_lm.train.growth`). Each rule is off ("none") until set; a shape change no rule
    covers is refused before training, naming the tensors."""

    depth: str = attrs.field(
        default="none",
        validator=one_of("none", "copy", "zero"),
        metadata=_doc(
            "More layers than the source: the source's layers are spread evenly over the new ones (layer j "
            "takes source layer j * n_source // n_layers) and each new layer starts as a copy of the source "
            "layer below it; 'copy' keeps the copy whole, 'zero' zeroes the projections that write into the "
            "residual stream (attention out, FFN down), so each new layer is the identity and the grown model "
            "computes what the source did."
        ),
    )
    width: str = attrs.field(
        default="none",
        validator=one_of("none", "preserve"),
        metadata=_doc(
            "A wider feed-forward layer than the source (hidden_multiplier, multiple_of, a MoE layer's "
            "expert_multiplier or n_shared_experts): the source's weights fill the first hidden units, the "
            "new units start from this run's initialisation with their residual (down) projection zero, so "
            "the model computes what the source did. dim, heads, head size and vocabulary must be the "
            "source's (a wider residual stream changes every RMSNorm)."
        ),
    )
    experts: str = attrs.field(
        default="none",
        validator=one_of("none", "copy"),
        metadata=_doc(
            "More routed experts than the source (a MoE layer's n_experts, where its plugin supports growth): "
            "new expert e is a copy of source expert e mod n_source with noise, its router row a copy."
        ),
    )
    expert_noise: float = attrs.field(
        default=0.01,
        validator=[finite, non_negative],
        metadata=_doc(
            "Standard deviation of the Gaussian noise added to each new expert's weights, relative to the "
            "standard deviation of the source expert's weight it copies; 0 gives exact copies."
        ),
    )


@attrs.frozen
class CheckpointSection:
    interval: int = attrs.field(
        default=0,
        validator=non_negative,
        metadata=_doc("Save every this many steps (and at the end); 0 at the end only."),
    )
    keep_last_n: int = attrs.field(
        default=0,
        validator=non_negative,
        metadata=_doc(
            "Keep the newest n checkpoints, and those the rules below keep; 0 keeps all. The checkpoint "
            "'latest' names and one being written are never removed."
        ),
    )
    keep_every_n_steps: int = attrs.field(
        default=0,
        validator=non_negative,
        metadata=_doc("With keep_last_n: also keep every checkpoint whose step this divides, forever; 0 none."),
    )
    keep: list[KeepRange] = attrs.field(
        factory=list,
        validator=_ranges_in_order,
        metadata=_doc(
            "With keep_last_n: rules by step range, [[checkpoint.keep]] until_step = 10000, every = 1000, then "
            "every = 5000: a step belongs to the first rule whose until_step is at or above it, and is kept "
            "forever when that rule's every divides it."
        ),
    )
    keep_best_n: int = attrs.field(
        default=0,
        validator=non_negative,
        metadata=_doc(
            "With keep_last_n: also keep the n checkpoints with the best keep_best_metric at their step; a "
            "checkpoint saved without that metric (no evaluation at its step) is never one of them; on equal "
            "values the newer step wins."
        ),
    )
    keep_best_metric: str = attrs.field(
        default="eval/loss",
        metadata=_doc("The evaluation metric keep_best_n ranks by: eval/loss, eval/<set>/loss or an evaluator's key."),
    )
    keep_best_mode: str = attrs.field(
        default="min",
        validator=one_of("min", "max"),
        metadata=_doc("'min': lower keep_best_metric is better; 'max': higher is."),
    )
    dir: str | None = attrs.field(
        default=None,
        validator=_object_store_url,
        metadata=_doc(
            "Keep the checkpoints on an object store: s3://bucket/prefix (with s3fs: forge-lm[s3]) or "
            "gs://bucket/prefix (with gcsfs); the run directory keeps its lock, metrics, events and config. "
            "Credentials and the endpoint come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
            "AWS_ENDPOINT_URL, ...) or the library's own files, never from this config. Unset: "
            "<output_dir>/checkpoints."
        ),
    )
    async_save: bool = attrs.field(
        default=False, metadata=_doc("Write checkpoints in the background while training goes on.")
    )
    init_from: str | None = attrs.field(
        default=None,
        metadata=_doc(
            "Start a new run from these weights: a run directory, one of its checkpoints/step_<N> or a Hugging "
            "Face model directory (model only: the optimizer, schedule and data position start fresh; every "
            "shape must be [model]'s unless [checkpoint.growth] says how to grow it). A run with a checkpoint of "
            "its own resumes from it instead."
        ),
    )
    growth: GrowthSection = attrs.field(
        factory=GrowthSection,
        metadata=_doc("How init_from's weights fill a larger [model]: [checkpoint.growth] depth, width, experts."),
    )
    max_failed_saves: int = attrs.field(
        default=3,
        validator=positive,
        metadata=_doc(
            "Stop (exit 5) after this many checkpoint saves in a row failed (disk full, no permission); before "
            "that, a failed save is a warning and the next interval tries again. The final save and the save "
            "after a preemption signal are never retried: their failure stops the run at once."
        ),
    )


@attrs.frozen
class ResilienceSection:
    nan_policy: str = attrs.field(
        default="skip",
        validator=one_of("skip", "stop", "rollback"),
        metadata=_doc(
            "On a NaN/Inf loss or gradient: 'skip' the step, 'stop' the run, or 'rollback' to the newest "
            "checkpoint and go on past the bad batch."
        ),
    )
    max_bad_steps: int = attrs.field(
        default=3, validator=positive, metadata=_doc("Stop after this many bad steps in a row.")
    )
    signal_timeout: float = attrs.field(
        default=300.0,
        validator=positive,
        metadata=_doc("Seconds allowed to checkpoint after SIGTERM/SIGUSR1 before the process exits anyway."),
    )
    hang_timeout: float = attrs.field(
        default=480.0,
        validator=non_negative,
        metadata=_doc(
            "Seconds without progress (a training step, an evaluation or a checkpoint save finishing) after "
            "which every rank writes its Python stacks to <run>/hang/rank<R>.txt and exits 77; 0 turns it off. "
            "Keep it below [distributed] timeout, so that a rank stuck in a collective writes its stacks before "
            "the process group gives up."
        ),
    )
    health_check: bool = attrs.field(
        default=True,
        metadata=_doc(
            "Under torchrun, time an all-reduce across all ranks at start (and on GPU a matmul and free memory "
            "per device) and stop naming any rank that fails or is far slower than the others."
        ),
    )
    spike_policy: str = attrs.field(
        default="off",
        validator=one_of("off", "skip", "rollback"),
        metadata=_doc(
            "On a loss spike (spike_metric above mean + spike_sigmas x std of the last spike_window steps): 'skip' "
            "the step (no optimizer or scheduler update, its batches not trained on), 'rollback' to the newest "
            "checkpoint and go on past the batches read since, or 'off'."
        ),
    )
    spike_metric: str = attrs.field(
        default="loss",
        validator=one_of("loss", "grad_norm"),
        metadata=_doc("What is judged: the step's loss (the mean over the ranks) or its gradient norm (unclipped)."),
    )
    spike_window: int = attrs.field(
        default=50,
        validator=between(2, 100_000),
        metadata=_doc("Steps in the running window; a step is judged once the window is full."),
    )
    spike_sigmas: float = attrs.field(
        default=6.0,
        validator=positive,
        metadata=_doc("A spike is above the window's mean + this many (population) standard deviations."),
    )
    spike_warmup_steps: int = attrs.field(
        default=100,
        validator=non_negative,
        metadata=_doc("Steps 1 to this are neither judged nor put in the window (the loss falls fast early on)."),
    )
    max_spike_steps: int = attrs.field(
        default=5,
        validator=positive,
        metadata=_doc("Stop (exit 3) after this many spikes in a row: a loss that stays up is no spike."),
    )


@attrs.frozen
class MetricsSection:
    log_interval: int = attrs.field(
        default=10, validator=positive, metadata=_doc("Log every this many steps, and always the first and the last.")
    )
    peak_flops: float | None = attrs.field(
        default=None,
        validator=positive,
        metadata=_doc("Peak FLOP/s of one device for MFU; unset = known GPU table, or measured once on CPU."),
    )
    backends: list[ComponentConfig] = components(
        "metrics_backends", ("console", "jsonl"), "Where metrics go; options in [metrics.<backend>]."
    )


@attrs.frozen
class ProfilingSection:
    """torch.profiler over a window of optimizer steps, and CUDA allocator snapshots."""

    enabled: bool = attrs.field(default=False, metadata=_doc("Profile the window below; traces per rank."))
    start_step: int = attrs.field(
        default=5, validator=positive, metadata=_doc("The optimizer step at which the first window begins.")
    )
    warmup_steps: int = attrs.field(
        default=1, validator=non_negative, metadata=_doc("Steps profiled but discarded before each window.")
    )
    active_steps: int = attrs.field(default=3, validator=positive, metadata=_doc("Steps recorded per window."))
    repeat: int = attrs.field(
        default=1, validator=non_negative, metadata=_doc("Windows to record, back to back; 0 repeats to the end.")
    )
    record_shapes: bool = attrs.field(
        default=False, metadata=_doc("Record operator input shapes (larger traces; off keeps the defaults light).")
    )
    profile_memory: bool = attrs.field(
        default=False, metadata=_doc("Record tensor allocations per operator (larger traces, slower export).")
    )
    with_stack: bool = attrs.field(
        default=False,
        metadata=_doc(
            "Record Python stacks and write folded stacks for flamegraphs; off by default: it makes the trace "
            "several times larger and its export slower."
        ),
    )
    memory_snapshot_step: int = attrs.field(
        default=0,
        validator=non_negative,
        metadata=_doc(
            "CUDA only: record allocator history from the start and write a snapshot (for pytorch.org/memory_viz) "
            "after this step, or at an out-of-memory error before it; 0 off."
        ),
    )


@attrs.frozen
class ForgeConfig:
    """A whole run: every section, fully resolved."""

    model: ComponentConfig = component(
        "models", "llama", "Model family ('llama', or a plugin's); the section's other keys are its options."
    )
    train: TrainSection = attrs.field(factory=TrainSection)
    tokenizer: ComponentConfig = component("tokenizers", "bytes", "Text to token ids.")
    data: ComponentConfig = component("datasets", "python_stdlib", "Training (and held-out evaluation) data.")
    optimizer: ComponentConfig = component("optimizers", "adamw", "Optimizer.")
    scheduler: ComponentConfig = component("schedulers", "cosine", "Learning-rate schedule.")
    loss: ComponentConfig = component("losses", "cross_entropy", "Training loss.")
    eval: EvalSection = attrs.field(factory=EvalSection)
    checkpoint: CheckpointSection = attrs.field(factory=CheckpointSection)
    resilience: ResilienceSection = attrs.field(factory=ResilienceSection)
    metrics: MetricsSection = attrs.field(factory=MetricsSection)
    distributed: DistributedSection = attrs.field(factory=DistributedSection)
    profiling: ProfilingSection = attrs.field(factory=ProfilingSection)
    transforms: dict[str, ComponentConfig] = component_options(
        "model_transforms", "Options of model transforms, one table each: [transforms.<name>]."
    )


def check_cross_section(config: ForgeConfig) -> list[tuple[str, str]]:
    """Rules that involve several sections: a list of (``[section] key``, message)."""
    problems = []
    max_seq_len = model_options(config).max_seq_len
    if config.train.seq_len > max_seq_len:
        problems.append(
            (
                "[train] seq_len",
                f"{config.train.seq_len} exceeds [model] max_seq_len ({max_seq_len}); "
                "lower seq_len or raise max_seq_len",
            )
        )
    problems.extend(_batch_ramp_problems(config))
    if config.train.precision == "fp16" and config.distributed.pp > 1:
        problems.append(
            (
                "[train] precision",
                "'fp16' is not supported with pipeline parallelism yet (the pipeline schedule runs the backward "
                "itself and does not scale its loss); use 'bf16', or pp = 1",
            )
        )
    return problems


def _batch_ramp_problems(config: ForgeConfig) -> list[tuple[str, str]]:
    """What [train.batch_ramp] needs of [train] and [distributed] that is known before the launch
    (the data-parallel ranks are checked when the run starts: forge_lm.train.batch_ramp)."""
    ramp, train = config.train.batch_ramp, config.train
    if ramp.start_batch_size is None:
        return []
    problems = []
    for key in ("start_batch_size", "increment"):
        value = getattr(ramp, key)
        if value is not None and value % train.batch_size:
            problems.append(
                (
                    f"[train.batch_ramp] {key}",
                    f"{value} is not a multiple of [train] batch_size ({train.batch_size}): the batch grows by "
                    "whole micro-batches",
                )
            )
    if train.grad_accum_steps == 1:
        problems.append(
            (
                "[train.batch_ramp] start_batch_size",
                "a ramp grows the batch through micro-batches per step, but [train] grad_accum_steps is 1: set "
                "grad_accum_steps to the full batch's micro-batches per step",
            )
        )
    if config.distributed.pp > 1:
        problems.append(
            (
                "[train.batch_ramp] start_batch_size",
                "a batch ramp is not supported with pipeline parallelism (the schedule's micro-batches are fixed); "
                "leave start_batch_size unset, or pp = 1",
            )
        )
    return problems


def model_options(config: ForgeConfig) -> Any:
    """The ``[model]`` section's options: the selected family's options object (its defaults
    when the section was built in code without them)."""
    chosen = config.model
    if chosen.options is not None:
        return chosen.options
    if chosen.component is not None:
        return chosen.component.options_class()
    if chosen.name == "llama":
        return LlamaOptions()
    raise TypeError(f"model family '{chosen.name}' was not resolved; load configs with forge_lm.config.load_config")
