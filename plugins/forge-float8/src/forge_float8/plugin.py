"""Forge plugin module of forge-float8 (entry point ``float8`` in the group ``forge_lm``).

Registers the ``float8`` model transform (options in ``[transforms.float8]``) and checks its
settings against the rest of the run config. Kept free of heavy imports: Forge imports this
module to list plugins and validate configs, and torchao (which imports torch and loads
kernels) is imported only when a run applies the transform (:mod:`forge_float8.convert`).
"""

from __future__ import annotations

from typing import Any

from forge_lm import hookimpl
from forge_lm.errors import ConfigError

FORGE_LM_PLUGIN_API = ">=1.2,<2"  # 1.1: transform slots named by role; 1.2: options named by path

NAME = "float8"


@hookimpl
def forge_lm_register_model_transforms(register):
    register(
        NAME,
        "forge_float8.convert:float8_transform",
        config="forge_float8.options:Float8Options",
        description="float8 matmuls in Linear layers with torchao ([transforms.float8] enabled = true)",
    )


def float8_options(config: Any) -> Any:
    """This plugin's options (a :class:`forge_float8.options.Float8Options`) in ``config`` when it
    has a ``[transforms.float8]`` table, else None.

    Found by type, not by key: the table may be spelled ``[transforms."forge-float8:float8"]``.
    """
    from forge_float8.options import Float8Options  # a config is loaded: cheap now

    for chosen in config.transforms.values():
        if isinstance(chosen.options, Float8Options):
            return chosen.options
    return None


@hookimpl
def forge_lm_configure(config):
    options = float8_options(config)
    if options is None:
        return
    # Checked even while disabled: switching `enabled` on later must not reveal an old mistake.
    if options.fsdp_float8_all_gather and options.recipe != "tensorwise":
        raise ConfigError(
            f'[transforms.float8] fsdp_float8_all_gather = true needs recipe = "tensorwise", got '
            f'"{options.recipe}": torchao gathers float8 weights with one scale per tensor only. Set recipe = '
            '"tensorwise", or fsdp_float8_all_gather = false (FSDP2 then gathers the weights in their '
            "training precision and casts them to float8 after the gather)."
        )
    if not options.enabled:
        return
    if config.train.precision == "fp16":
        raise ConfigError(
            "[transforms.float8] enabled = true with [train] precision = 'fp16': forge-float8 does not support fp16. "
            "torchao's float8 training takes bf16 or fp32 as its high precision, and the float8 casts have not been "
            "run under fp16 autocast with Forge's loss scaling. Set precision = 'bf16' (float8 needs an Ada or "
            "Hopper GPU, which has bf16), or enabled = false."
        )
    if config.distributed.tp > 1:
        raise ConfigError(
            f"[transforms.float8] enabled = true with [distributed] tp = {config.distributed.tp}: forge-float8 "
            "does not support tensor parallelism yet (its float8 layers replace the Linear layers, dropping the "
            "input and output layouts tensor parallelism gave them). Set tp = 1 (FSDP2 and pipeline parallelism "
            "work with float8), or enabled = false."
        )
