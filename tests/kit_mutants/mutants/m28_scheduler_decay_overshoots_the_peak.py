"""An inverse-square-root decay counted from the end of the warmup: right after it the rate
jumps to sqrt(W) times the peak."""

import math

from kit_mutant_base import InverseSqrtOptions, lambda_schedule

CATEGORY = "schedulers"
EXPECTED_CHECK = "stays_within_zero_and_the_peak"
OPTIONS = InverseSqrtOptions


def factor(step, warmup):
    return (step + 1) / warmup if step < warmup else math.sqrt(warmup) / math.sqrt(step - warmup + 1)  # bug


def factory(options, optimizer, total_steps):
    return lambda_schedule(options, optimizer, factor)
