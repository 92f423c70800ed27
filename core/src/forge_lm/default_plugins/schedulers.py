"""Built-in learning-rate schedules, each with linear warmup.

``constant`` and ``none`` are the same curve (warmup, then the optimizer's learning rate as
set) under two names that say different things in a config: ``constant`` is a schedule that
holds the peak; ``none`` means "no schedule", for optimizers that need none (such as
``schedule_free_adamw``) or that manage their own rate, with an optional warmup. The options
classes are in :mod:`forge_lm.default_plugins.options.schedulers`, named by import path.
"""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_schedulers(register):
    register(
        "constant",
        "forge_lm.schedulers.lambdas:build_constant",
        config="forge_lm.default_plugins.options.schedulers:ConstantOptions",
        description="Linear warmup, then the peak learning rate throughout",
    )
    register(
        "none",
        "forge_lm.schedulers.lambdas:build_constant",
        config="forge_lm.default_plugins.options.schedulers:ConstantOptions",
        description="No schedule (e.g. for schedule_free_adamw): optional warmup, then the optimizer's lr as set",
    )
    register(
        "cosine",
        "forge_lm.schedulers.lambdas:build_cosine",
        config="forge_lm.default_plugins.options.schedulers:CosineOptions",
        description="Linear warmup, then cosine decay to min_lr_ratio of the peak",
    )
    register(
        "linear",
        "forge_lm.schedulers.lambdas:build_linear",
        config="forge_lm.default_plugins.options.schedulers:LinearOptions",
        description="Linear warmup, then linear decay to min_lr_ratio of the peak",
    )
    register(
        "wsd",
        "forge_lm.schedulers.wsd:build_wsd",
        config="forge_lm.default_plugins.options.schedulers:WsdOptions",
        description="Warmup-stable-decay: the peak until the last decay_fraction of the run, then a cooldown",
    )
    register(
        "rex",
        "forge_lm.schedulers.lambdas:build_rex",
        config="forge_lm.default_plugins.options.schedulers:RexOptions",
        description="Linear warmup, then the REX decay (1-p)/(0.5+0.5(1-p)), floored at min_lr_ratio",
    )
