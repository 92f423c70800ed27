"""Built-in learning-rate schedules, each with linear warmup.

``constant`` and ``none`` are the same curve (warmup, then the optimizer's learning rate as
set) under two names that say different things in a config: ``constant`` is a schedule that
holds the peak; ``none`` means "no schedule", for optimizers that need none (such as
``schedule_free_adamw``) or that manage their own rate, with an optional warmup.
"""

from __future__ import annotations

import attrs

from forge_lm.components import WarmupOptions
from forge_lm.hookspecs import hookimpl
from forge_lm.validators import fraction, one_of

FORGE_LM_PLUGIN_API = ">=1,<2"


@attrs.define
class ConstantOptions(WarmupOptions):
    pass


@attrs.define
class CosineOptions(WarmupOptions):
    min_lr_ratio: float = attrs.field(default=0.1, validator=fraction)  # final lr / peak lr


@attrs.define
class LinearOptions(WarmupOptions):
    min_lr_ratio: float = attrs.field(default=0.0, validator=fraction)  # final lr / peak lr


@attrs.define
class WsdOptions(WarmupOptions):
    decay_fraction: float = attrs.field(default=0.2, validator=fraction)  # share of the run spent cooling down
    cooldown: str = attrs.field(default="sqrt", validator=one_of("sqrt", "linear", "cosine"))
    min_lr_ratio: float = attrs.field(default=0.0, validator=fraction)  # final lr / peak lr


@attrs.define
class RexOptions(WarmupOptions):
    min_lr_ratio: float = attrs.field(default=0.0, validator=fraction)  # floor, as a fraction of the peak


@hookimpl
def forge_lm_register_schedulers(register):
    register(
        "constant",
        "forge_lm.schedulers.lambdas:build_constant",
        config=ConstantOptions,
        description="Linear warmup, then the peak learning rate throughout",
    )
    register(
        "none",
        "forge_lm.schedulers.lambdas:build_constant",
        config=ConstantOptions,
        description="No schedule (e.g. for schedule_free_adamw): optional warmup, then the optimizer's lr as set",
    )
    register(
        "cosine",
        "forge_lm.schedulers.lambdas:build_cosine",
        config=CosineOptions,
        description="Linear warmup, then cosine decay to min_lr_ratio of the peak",
    )
    register(
        "linear",
        "forge_lm.schedulers.lambdas:build_linear",
        config=LinearOptions,
        description="Linear warmup, then linear decay to min_lr_ratio of the peak",
    )
    register(
        "wsd",
        "forge_lm.schedulers.wsd:build_wsd",
        config=WsdOptions,
        description="Warmup-stable-decay: the peak until the last decay_fraction of the run, then a cooldown",
    )
    register(
        "rex",
        "forge_lm.schedulers.lambdas:build_rex",
        config=RexOptions,
        description="Linear warmup, then the REX decay (1-p)/(0.5+0.5(1-p)), floored at min_lr_ratio",
    )
