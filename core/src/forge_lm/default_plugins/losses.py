"""Built-in losses."""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_losses(register):
    register(
        "cross_entropy",
        "forge_lm.losses.cross_entropy:build_cross_entropy",
        config="forge_lm.default_plugins.options.losses:CrossEntropyOptions",
        description="Next-token cross-entropy, computed in fp32, mean over non-ignored tokens; optional z-loss",
    )
    register(
        "chunked_cross_entropy",
        "forge_lm.losses.chunked_cross_entropy:build_chunked_cross_entropy",
        config="forge_lm.default_plugins.options.losses:ChunkedCrossEntropyOptions",
        description="cross_entropy computed per chunk of tokens and recomputed in backward: no full fp32 logits kept",
    )
