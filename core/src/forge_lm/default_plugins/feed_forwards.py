"""Built-in feed-forward layers."""

from __future__ import annotations

import attrs

from forge_lm.hookspecs import hookimpl
from forge_lm.validators import positive

FORGE_LM_PLUGIN_API = ">=1,<2"


@attrs.define
class SwiGLUOptions:
    # hidden = multiple_of * ceil(hidden_multiplier * dim / multiple_of); 8/3 keeps the
    # parameter count of a 4x GELU MLP with three matrices instead of two.
    hidden_multiplier: float = attrs.field(default=8 / 3, validator=positive)
    multiple_of: int = attrs.field(default=64, validator=positive)


@hookimpl
def forge_lm_register_feed_forwards(register):
    register(
        "swiglu",
        "forge_lm.model.swiglu:build_swiglu",
        config=SwiGLUOptions,
        description="SwiGLU MLP (Llama): down(silu(gate(x)) * up(x))",
    )
