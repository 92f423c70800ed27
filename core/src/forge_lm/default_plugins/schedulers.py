"""Built-in learning-rate schedules, each with linear warmup."""

from __future__ import annotations

import attrs

from forge_lm.components import WarmupOptions
from forge_lm.hookspecs import hookimpl
from forge_lm.validators import fraction

FORGE_LM_PLUGIN_API = ">=1,<2"


@attrs.define
class ConstantOptions(WarmupOptions):
    pass


@attrs.define
class CosineOptions(WarmupOptions):
    min_lr_ratio: float = attrs.field(default=0.1, validator=fraction)  # final lr / peak lr


@hookimpl
def forge_lm_register_schedulers(register):
    register(
        "constant",
        "forge_lm.schedulers.lambdas:build_constant",
        config=ConstantOptions,
        description="Linear warmup, then the peak learning rate throughout",
    )
    register(
        "cosine",
        "forge_lm.schedulers.lambdas:build_cosine",
        config=CosineOptions,
        description="Linear warmup, then cosine decay to min_lr_ratio of the peak",
    )
