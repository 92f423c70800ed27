"""Built-in feed-forward layers."""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_feed_forwards(register):
    register(
        "swiglu",
        "forge_lm.model.swiglu:build_swiglu",
        config="forge_lm.default_plugins.options.feed_forwards:SwiGLUOptions",
        description="SwiGLU MLP (Llama): down(silu(gate(x)) * up(x))",
    )
