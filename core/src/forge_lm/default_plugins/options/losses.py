"""Options of the built-in losses (:mod:`forge_lm.default_plugins.losses`).

Named by import path at registration, so that listing plugins imports none of them.
"""

from __future__ import annotations

import attrs

from forge_lm.validators import non_negative, positive


@attrs.define
class CrossEntropyOptions:
    # Weight of the z-loss, mean(logsumexp(logits)**2); PaLM used 1e-4. 0 turns it off.
    z_loss_weight: float = attrs.field(default=0.0, validator=non_negative)


@attrs.define
class ChunkedCrossEntropyOptions(CrossEntropyOptions):
    # Tokens per chunk: peak extra memory is about chunk_size * vocab fp32 values.
    chunk_size: int = attrs.field(default=4096, validator=positive)
