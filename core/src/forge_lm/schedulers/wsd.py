"""Warmup-stable-decay (WSD): warmup, the peak rate for most of the run, then a short cooldown.

The cooldown covers the last ``round(decay_fraction * total_steps)`` steps (never the warmup), going
from the peak to ``min_lr_ratio`` of it with one of three shapes of the cooldown progress
``p`` in [0, 1): ``"linear"`` (``1 - p``), ``"cosine"`` (``(1 + cos(pi p)) / 2``) or
``"sqrt"`` (``1 - sqrt(p)``, which Hägele et al. 2024, "Scaling Laws and Compute-Optimal
Training Beyond Fixed Training Durations", found best). Because the rate is flat until the
cooldown, a checkpoint from the stable phase can be cooled down later for any length of run.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from forge_lm.schedulers.lambdas import checked_total_steps, decay_progress, warmup_factor

COOLDOWNS = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}


def cooldown_start(warmup_steps: int, total_steps: int, decay_fraction: float) -> int:
    """The first step of the cooldown: ``decay_fraction`` of the run before its end, after warmup."""
    return max(warmup_steps, total_steps - round(decay_fraction * total_steps))


def wsd_factor(
    step: int, warmup_steps: int, total_steps: int, decay_fraction: float, cooldown: str, min_ratio: float
) -> float:
    warm = warmup_factor(step, warmup_steps)
    if warm is not None:
        return warm
    start = cooldown_start(warmup_steps, total_steps, decay_fraction)
    if step < start:
        return 1.0
    shape = COOLDOWNS[cooldown](decay_progress(step, start, total_steps))
    return min_ratio + (1.0 - min_ratio) * shape


def build_wsd(options: Any, optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    total_steps = checked_total_steps(total_steps)
    return LambdaLR(
        optimizer,
        lambda step: wsd_factor(
            step,
            options.warmup_steps,
            total_steps,
            options.decay_fraction,
            options.cooldown,
            options.min_lr_ratio,
        ),
    )
