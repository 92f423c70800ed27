"""Learning-rate schedules as multipliers of the peak rate, wrapped in ``LambdaLR``.

Step ``s`` is the index of the optimizer step about to run (0 for the first). Warmup is
linear and starts above zero: ``(s + 1) / warmup_steps`` for ``s < warmup_steps``. A decay
runs over the steps after warmup with progress ``p = (s - W) / (total_steps - W)``, which
is 0 on the first step after warmup and just below 1 on the last step of the run, so no step
of a run is wasted at the final rate of 0 when a schedule decays to zero.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from forge_lm.errors import ConfigError


def warmup_factor(step: int, warmup_steps: int) -> float | None:
    """The warmup multiplier at ``step``, or None once warmup is over."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return None


def decay_progress(step: int, start: int, total_steps: int) -> float:
    """How far ``step`` is into a decay that runs from ``start`` to the end of the run, in [0, 1]."""
    return min(1.0, max(0.0, (step - start) / max(1, total_steps - start)))


def constant_factor(step: int, warmup_steps: int) -> float:
    warm = warmup_factor(step, warmup_steps)
    return 1.0 if warm is None else warm


def cosine_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    warm = warmup_factor(step, warmup_steps)
    if warm is not None:
        return warm
    progress = decay_progress(step, warmup_steps, total_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def linear_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    warm = warmup_factor(step, warmup_steps)
    if warm is not None:
        return warm
    return 1.0 - (1.0 - min_ratio) * decay_progress(step, warmup_steps, total_steps)


def rex_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """REX (Chen et al. 2021, "REX: Revisiting Budgeted Training with an Improved Schedule").

    ``(1 - p) / (0.5 + 0.5 * (1 - p))``: it stays nearer the peak than a linear decay for
    most of the run and falls steeply at the end; floored at ``min_ratio``.
    """
    warm = warmup_factor(step, warmup_steps)
    if warm is not None:
        return warm
    remaining = 1.0 - decay_progress(step, warmup_steps, total_steps)
    return max(min_ratio, remaining / (0.5 + 0.5 * remaining))


def checked_total_steps(total_steps: int) -> int:
    """``total_steps``, which a decaying schedule needs to be at least 1."""
    if total_steps < 1:
        raise ConfigError(
            f"a decaying learning-rate schedule needs total_steps >= 1 (the run's length), got {total_steps}"
        )
    return total_steps


def build_constant(options: Any, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: constant_factor(step, options.warmup_steps))


def build_cosine(options: Any, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    total_steps = checked_total_steps(total_steps)
    return LambdaLR(
        optimizer, lambda step: cosine_factor(step, options.warmup_steps, total_steps, options.min_lr_ratio)
    )


def build_linear(options: Any, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    total_steps = checked_total_steps(total_steps)
    return LambdaLR(
        optimizer, lambda step: linear_factor(step, options.warmup_steps, total_steps, options.min_lr_ratio)
    )


def build_rex(options: Any, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    total_steps = checked_total_steps(total_steps)
    return LambdaLR(optimizer, lambda step: rex_factor(step, options.warmup_steps, total_steps, options.min_lr_ratio))
