"""An inverse-square-root schedule whose warmup (option 'warmup', not 'warmup_steps') runs
step s at s / W: the first step is wasted at rate 0."""

import math

from kit_mutant_base import InverseSqrtOptions, lambda_schedule

CATEGORY = "schedulers"
EXPECTED_CHECK = "follows_the_documented_warmup"
OPTIONS = InverseSqrtOptions


def factor(step, warmup):
    return step / warmup if step < warmup else math.sqrt(warmup / step)  # bug: s, not s + 1


def factory(options, optimizer, total_steps):
    return lambda_schedule(options, optimizer, factor)
