"""Options of ``[optimizer] name = "muon"``.

Named by import path in :mod:`forge_optim_muon.plugin`'s registration, so that listing plugins
imports neither this module nor :mod:`forge_lm.components`, which it builds on.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from forge_lm.components import LearningRateOptions
from forge_lm.validators import FieldError, non_negative, one_of, positive

QUINTIC = (3.4445, -4.7750, 2.0315)  # Keller Jordan's Newton-Schulz coefficients, as torch.optim.Muon's


def _momentum(instance: Any, attribute: Any, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise FieldError(attribute.name, f"must be in [0, 1), got {value!r}")


def _betas(instance: Any, attribute: Any, value: tuple[float, float]) -> None:
    if not (0.0 <= value[0] < 1.0 and 0.0 <= value[1] < 1.0):
        raise FieldError(attribute.name, f"must be [beta1, beta2], each in [0, 1), got {list(value)!r}")


def _ns_steps(instance: Any, attribute: Any, value: int) -> None:
    if not 1 <= value <= 100:
        raise FieldError(attribute.name, f"must be between 1 and 100, got {value!r}")


def _patterns(instance: Any, attribute: Any, value: list[str]) -> None:
    for pattern in value:
        if not pattern.strip():
            raise FieldError(attribute.name, "patterns must not be empty")


@attrs.define
class MuonOptions(LearningRateOptions):
    """Options of ``[optimizer] name = "muon"``; see the plugin's README for the rule that splits parameters."""

    # State tensors per parameter, for Forge's memory estimate (forge_lm.components.DeclaresOptimizerStates):
    # momentum on hidden matrices, AdamW's two moments elsewhere: at most 2.
    FORGE_LM_OPTIMIZER_STATES: ClassVar[float] = 2

    # Muon, for hidden weight matrices.
    lr: float = attrs.field(default=0.02, validator=positive)
    momentum: float = attrs.field(default=0.95, validator=_momentum)
    nesterov: bool = True
    weight_decay: float = attrs.field(default=0.0, validator=non_negative)  # decoupled: p *= 1 - lr * weight_decay
    # "original": lr * sqrt(max(1, rows / cols)) (Keller Jordan); "match_rms_adamw": lr * 0.2 * sqrt(max(rows, cols))
    # (Moonshot), whose updates have AdamW's RMS, so AdamW's lr and weight decay carry over.
    update_scale: str = attrs.field(default="original", validator=one_of("original", "match_rms_adamw"))
    ns_coefficients: tuple[float, float, float] = QUINTIC
    ns_steps: int = attrs.field(default=5, validator=_ns_steps)
    ns_eps: float = attrs.field(default=1e-7, validator=positive)  # the Frobenius norm is clamped to at least this
    # "auto": bfloat16 (accurate enough) where the hardware multiplies it: CUDA, CPUs with AVX-512 BF16 or AMX;
    # float32 elsewhere (CPUs without them emulate bf16 matmuls, slowly).
    ns_dtype: str = attrs.field(default="auto", validator=one_of("auto", "bfloat16", "float32"))
    # AdamW, for embeddings, the output head, norms, biases and router gates. Follows the schedule like lr.
    adamw_lr: float = attrs.field(default=3e-3, validator=positive)
    adamw_betas: tuple[float, float] = attrs.field(default=(0.9, 0.95), validator=_betas)
    adamw_eps: float = attrs.field(default=1e-8, validator=positive)
    adamw_weight_decay: float = attrs.field(default=0.1, validator=non_negative)  # on the head and router matrices
    decay_embeddings: bool = False
    # Overrides of the rule: fnmatch patterns of parameter names (as model.named_parameters() gives them).
    muon_params: list[str] = attrs.field(factory=list, validator=_patterns)
    adamw_params: list[str] = attrs.field(factory=list, validator=_patterns)
    # Sharded (FSDP2, HSDP, tensor-parallel) matrices are gathered whole for Newton-Schulz in groups
    # of at most this many MiB (fp32 updates), one group at a time: the step's extra memory scales
    # with a group, not the model. Larger groups mean fewer, larger collectives and batches, and
    # keep more ranks busy (each group's matrices are split over the ranks).
    gather_bucket_mb: float = attrs.field(default=512.0, validator=positive)

    def __attrs_post_init__(self) -> None:
        both = sorted(set(self.muon_params) & set(self.adamw_params))
        if both:
            raise FieldError("adamw_params", f"{both!r} also in muon_params; a parameter goes to one side only")
