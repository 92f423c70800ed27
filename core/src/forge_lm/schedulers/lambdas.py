"""Learning-rate schedules as multipliers of the peak rate, wrapped in ``LambdaLR``.

Step ``s`` is the index of the optimizer step about to run (0 for the first). Warmup is
linear and starts above zero: ``(s + 1) / warmup_steps`` for ``s < warmup_steps``.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_factor(step: int, warmup_steps: int) -> float | None:
    """The warmup multiplier at ``step``, or None once warmup is over."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return None


def constant_factor(step: int, warmup_steps: int) -> float:
    warm = warmup_factor(step, warmup_steps)
    return 1.0 if warm is None else warm


def cosine_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    warm = warmup_factor(step, warmup_steps)
    if warm is not None:
        return warm
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_constant(options, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: constant_factor(step, options.warmup_steps))


def build_cosine(options, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    return LambdaLR(
        optimizer, lambda step: cosine_factor(step, options.warmup_steps, total_steps, options.min_lr_ratio)
    )
