"""Options of the built-in feed-forward layers (:mod:`forge_lm.default_plugins.feed_forwards`).

Named by import path at registration, so that listing plugins imports none of them.
:class:`SwiGLUOptions` is defined in :mod:`forge_lm.config`, a layer below the model, since the
core's Hugging Face conversion makes it too (as the llama family's
:class:`forge_lm.config.LlamaOptions` is); this is the path its registration names.
"""

from __future__ import annotations

from forge_lm.config import SwiGLUOptions

__all__ = ["SwiGLUOptions"]
