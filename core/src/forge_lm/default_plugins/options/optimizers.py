"""Options of the built-in optimizers (:mod:`forge_lm.default_plugins.optimizers`).

Named by import path at registration, so that listing plugins imports none of them, nor
:mod:`forge_lm.components`, which they build on.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from forge_lm.components import LearningRateOptions
from forge_lm.validators import FieldError, non_negative, one_of, positive

# AdamW's update kernels in torch (its ``fused`` and ``foreach`` flags), and "auto".
ADAMW_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")


def _momentum_betas(instance: Any, attribute: Any, value: tuple[float, float]) -> None:
    """Both betas in [0, 1), the first above 0 (schedule-free divides by it; Lion needs momentum)."""
    if not (0.0 < value[0] < 1.0 and 0.0 <= value[1] < 1.0):
        raise FieldError(
            attribute.name, f"must be [beta1, beta2] with 0 < beta1 < 1 and 0 <= beta2 < 1, got {list(value)!r}"
        )


def _adam_betas(instance: Any, attribute: Any, value: tuple[float, float]) -> None:
    """Both betas in [0, 1): beta1 = 0 is Adam without momentum; 1 would never forget."""
    if not all(0.0 <= beta < 1.0 for beta in value):
        raise FieldError(attribute.name, f"must be [beta1, beta2] with both in [0, 1), got {list(value)!r}")


@attrs.define
class AdamWOptions(LearningRateOptions):
    # State tensors per parameter (forge_lm.components.DeclaresOptimizerStates): exp_avg, exp_avg_sq.
    FORGE_LM_OPTIMIZER_STATES: ClassVar[float] = 2

    betas: tuple[float, float] = attrs.field(default=(0.9, 0.95), validator=_adam_betas)
    eps: float = attrs.field(default=1e-8, validator=positive)
    weight_decay: float = attrs.field(default=0.1, validator=non_negative)
    decay_embeddings: bool = False  # by default embeddings, like norms and biases, are not decayed
    # torch's update kernel: "auto" is "fused" where torch has one for the parameters' device
    # (CPU, CUDA), else torch's own choice (forge_lm.optim.adamw.implementation_flags).
    implementation: str = attrs.field(default="auto", validator=one_of(*ADAMW_IMPLEMENTATIONS))


@attrs.define
class LionOptions(LearningRateOptions):
    FORGE_LM_OPTIMIZER_STATES: ClassVar[float] = 1  # exp_avg

    # Lion's sign update moves every coordinate by lr, so it wants a smaller lr than AdamW and
    # a larger decay (Chen et al. 2023: 3-10x each); these keep AdamW's lr * weight_decay.
    lr: float = attrs.field(default=1e-4, validator=positive)
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.99), validator=_momentum_betas)
    weight_decay: float = attrs.field(default=0.3, validator=non_negative)
    decay_embeddings: bool = False


@attrs.define
class ScheduleFreeAdamWOptions(LearningRateOptions):
    FORGE_LM_OPTIMIZER_STATES: ClassVar[float] = 2  # z, exp_avg_sq

    betas: tuple[float, float] = attrs.field(default=(0.9, 0.95), validator=_momentum_betas)
    eps: float = attrs.field(default=1e-8, validator=positive)
    weight_decay: float = attrs.field(default=0.1, validator=non_negative)
    decay_embeddings: bool = False
    # The optimizer's own linear warmup; a scheduler's warmup (scheduler "none") is equivalent.
    # Set one of the two: they multiply.
    warmup_steps: int = attrs.field(default=0, validator=non_negative)
