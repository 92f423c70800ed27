"""Built-in optimizers.

Each one splits the model's parameters by :func:`forge_lm.optim.param_groups.weight_decay_groups`:
weight matrices are decayed; biases, norm scales and (unless ``decay_embeddings``) embedding
tables, including a head tied to one, are not. Their options classes are in
:mod:`forge_lm.default_plugins.options.optimizers`, named by import path so that listing plugins
does not import them.
"""

from __future__ import annotations

from typing import Any

from forge_lm.errors import ConfigError
from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_optimizers(register):
    register(
        "adamw",
        "forge_lm.optim.adamw:build_adamw",
        config="forge_lm.default_plugins.options.optimizers:AdamWOptions",
        description="AdamW (torch.optim.AdamW); weight decay on weight matrices only",
    )
    register(
        "lion",
        "forge_lm.optim.lion:build_lion",
        config="forge_lm.default_plugins.options.optimizers:LionOptions",
        description="Lion (sign of interpolated momentum), decoupled weight decay on weight matrices only",
    )
    register(
        "schedule_free_adamw",
        "forge_lm.optim.schedule_free:build_schedule_free_adamw",
        config="forge_lm.default_plugins.options.optimizers:ScheduleFreeAdamWOptions",
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
    from forge_lm.default_plugins.options.optimizers import ScheduleFreeAdamWOptions  # a config is loaded: cheap

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
