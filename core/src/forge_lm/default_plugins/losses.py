"""Built-in losses."""

from __future__ import annotations

import attrs

from forge_lm.hookspecs import hookimpl
from forge_lm.validators import non_negative, positive

FORGE_LM_PLUGIN_API = ">=1,<2"


@attrs.define
class CrossEntropyOptions:
    # Weight of the z-loss, mean(logsumexp(logits)**2); PaLM used 1e-4. 0 turns it off.
    z_loss_weight: float = attrs.field(default=0.0, validator=non_negative)


@attrs.define
class ChunkedCrossEntropyOptions(CrossEntropyOptions):
    # Tokens per chunk: peak extra memory is about chunk_size * vocab fp32 values.
    chunk_size: int = attrs.field(default=4096, validator=positive)


@hookimpl
def forge_lm_register_losses(register):
    register(
        "cross_entropy",
        "forge_lm.losses.cross_entropy:build_cross_entropy",
        config=CrossEntropyOptions,
        description="Next-token cross-entropy, computed in fp32, mean over non-ignored tokens; optional z-loss",
    )
    register(
        "chunked_cross_entropy",
        "forge_lm.losses.chunked_cross_entropy:build_chunked_cross_entropy",
        config=ChunkedCrossEntropyOptions,
        description="cross_entropy computed per chunk of tokens and recomputed in backward: no full fp32 logits kept",
    )
