"""Options of the built-in feed-forward layers (:mod:`forge_lm.default_plugins.feed_forwards`).

Named by import path at registration, so that listing plugins imports none of them.
"""

from __future__ import annotations

import attrs

from forge_lm.validators import positive


@attrs.define
class SwiGLUOptions:
    # hidden = multiple_of * ceil(hidden_multiplier * dim / multiple_of); 8/3 keeps the
    # parameter count of a 4x GELU MLP with three matrices instead of two.
    hidden_multiplier: float = attrs.field(default=8 / 3, validator=positive)
    multiple_of: int = attrs.field(default=64, validator=positive)
