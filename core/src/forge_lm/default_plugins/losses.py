"""Built-in losses."""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_losses(register):
    register(
        "cross_entropy",
        "forge_lm.losses.cross_entropy:build_cross_entropy",
        description="Next-token cross-entropy, computed in fp32, mean over non-ignored tokens",
    )
