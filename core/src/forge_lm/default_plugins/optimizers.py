"""Built-in optimizers."""

from __future__ import annotations

import attrs

from forge_lm.components import LearningRateOptions
from forge_lm.hookspecs import hookimpl
from forge_lm.validators import non_negative, positive

FORGE_LM_PLUGIN_API = ">=1,<2"


@attrs.define
class AdamWOptions(LearningRateOptions):
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = attrs.field(default=1e-8, validator=positive)
    weight_decay: float = attrs.field(default=0.1, validator=non_negative)
    decay_embeddings: bool = False  # by default embeddings, like norms and biases, are not decayed


@hookimpl
def forge_lm_register_optimizers(register):
    register(
        "adamw",
        "forge_lm.optim.adamw:build_adamw",
        config=AdamWOptions,
        description="AdamW (torch.optim.AdamW); weight decay on weight matrices only",
    )
