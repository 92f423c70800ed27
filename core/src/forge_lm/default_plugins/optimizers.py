"""Built-in optimizers.

Each one splits the model's parameters by :func:`forge_lm.optim.param_groups.weight_decay_groups`:
weight matrices are decayed; biases, norm scales and (unless ``decay_embeddings``) embedding
tables, including a head tied to one, are not.
"""

from __future__ import annotations

from typing import Any

import attrs

from forge_lm.components import LearningRateOptions
from forge_lm.errors import ConfigError
from forge_lm.hookspecs import hookimpl
from forge_lm.validators import FieldError, non_negative, one_of, positive

FORGE_LM_PLUGIN_API = ">=1,<2"

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
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.95), validator=_adam_betas)
    eps: float = attrs.field(default=1e-8, validator=positive)
    weight_decay: float = attrs.field(default=0.1, validator=non_negative)
    decay_embeddings: bool = False  # by default embeddings, like norms and biases, are not decayed
    # torch's update kernel: "auto" is "fused" where torch has one for the parameters' device
    # (CPU, CUDA), else torch's own choice (forge_lm.optim.adamw.implementation_flags).
    implementation: str = attrs.field(default="auto", validator=one_of(*ADAMW_IMPLEMENTATIONS))


@attrs.define
class LionOptions(LearningRateOptions):
    # Lion's sign update moves every coordinate by lr, so it wants a smaller lr than AdamW and
    # a larger decay (Chen et al. 2023: 3-10x each); these keep AdamW's lr * weight_decay.
    lr: float = attrs.field(default=1e-4, validator=positive)
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.99), validator=_momentum_betas)
    weight_decay: float = attrs.field(default=0.3, validator=non_negative)
    decay_embeddings: bool = False


@attrs.define
class ScheduleFreeAdamWOptions(LearningRateOptions):
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.95), validator=_momentum_betas)
    eps: float = attrs.field(default=1e-8, validator=positive)
    weight_decay: float = attrs.field(default=0.1, validator=non_negative)
    decay_embeddings: bool = False
    # The optimizer's own linear warmup; a scheduler's warmup (scheduler "none") is equivalent.
    # Set one of the two: they multiply.
    warmup_steps: int = attrs.field(default=0, validator=non_negative)


@hookimpl
def forge_lm_register_optimizers(register):
    register(
        "adamw",
        "forge_lm.optim.adamw:build_adamw",
        config=AdamWOptions,
        description="AdamW (torch.optim.AdamW); weight decay on weight matrices only",
    )
    register(
        "lion",
        "forge_lm.optim.lion:build_lion",
        config=LionOptions,
        description="Lion (sign of interpolated momentum), decoupled weight decay on weight matrices only",
    )
    register(
        "schedule_free_adamw",
        "forge_lm.optim.schedule_free:build_schedule_free_adamw",
        config=ScheduleFreeAdamWOptions,
        description="Schedule-Free AdamW: no lr decay needed; has train()/eval() to swap in the averaged weights",
    )


# Schedulers that hold the peak learning rate after their warmup: the only ones schedule-free
# AdamW can run under (it replaces the decay; both are "constant" curves, see schedulers.py).
_FLAT_SCHEDULERS = ("constant", "none")


@hookimpl
def forge_lm_configure(config):
    check_schedule_free(config)


def check_schedule_free(config: Any) -> None:
    """``schedule_free_adamw`` under a decaying schedule, or with two warmups, is refused.

    Schedule-free averaging takes the place of a learning-rate decay, so a decay on top of it
    (the default ``cosine``) changes what the optimizer computes; and the optimizer's own
    warmup and a scheduler's warmup multiply (both scale the same ``lr``), so with both set
    the first updates are far smaller than either warmup intends.
    """
    optimizer, scheduler = getattr(config, "optimizer", None), getattr(config, "scheduler", None)
    if scheduler is None or not isinstance(getattr(optimizer, "options", None), ScheduleFreeAdamWOptions):
        return  # not a run config (plugins' own checks and tests call configure with others)
    if scheduler.name not in _FLAT_SCHEDULERS:
        raise ConfigError(
            f"[scheduler] name: '{scheduler.name}' decays the learning rate, but [optimizer] name = "
            f"'{optimizer.name}' is schedule-free and needs no decay (and its warmup would multiply with the "
            'scheduler\'s); set [scheduler] name = "none" (or "constant") and give the warmup to one of '
            "[optimizer] warmup_steps or [scheduler] warmup_steps."
        )
    scheduler_warmup = getattr(scheduler.options, "warmup_steps", 0)
    if optimizer.options.warmup_steps and scheduler_warmup:
        raise ConfigError(
            f"[optimizer] warmup_steps = {optimizer.options.warmup_steps} and [scheduler] warmup_steps = "
            f"{scheduler_warmup} are two warmups, and they multiply; set one of them to 0."
        )
