"""Options of the built-in attention layers (:mod:`forge_lm.default_plugins.models`); the llama
family's are :class:`forge_lm.config.LlamaOptions`, the ``[model]`` section.

Named by import path at registration, so that listing plugins imports none of them.
"""

from __future__ import annotations

import attrs

from forge_lm.validators import positive


@attrs.define
class SlidingWindowOptions:
    window: int = attrs.field(default=4096, validator=positive)  # keys a query sees, itself included
