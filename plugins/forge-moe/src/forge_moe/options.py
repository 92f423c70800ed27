"""Options of forge-moe's components: the ``moe`` feed-forward layer and its routers.

Named by import path in :mod:`forge_moe.plugin`'s registrations, so that listing plugins imports
neither this module nor Forge's config schema (``forge_lm.api.component`` loads it).
"""

from __future__ import annotations

import attrs

from forge_lm.api import ComponentConfig, component
from forge_lm.validators import FieldError, non_negative, one_of, positive


@attrs.define
class MoEOptions:
    """``[model.ffn]`` with ``name = "moe"``; the router's own options go in ``[model.ffn.router]``."""

    n_experts: int = attrs.field(default=8, validator=positive)  # routed experts per MoE layer
    top_k: int = attrs.field(default=2, validator=positive)  # experts each token visits
    # Dense layers: hidden = multiple_of * ceil(hidden_multiplier * dim / multiple_of), as swiglu.
    hidden_multiplier: float = attrs.field(default=8 / 3, validator=positive)
    multiple_of: int = attrs.field(default=64, validator=positive)
    # Expert hidden size: the same rule with hidden_multiplier * expert_multiplier (fine-grained
    # experts: e.g. 0.25 with 4x the experts and 4x top_k keeps the active size).
    expert_multiplier: float = attrs.field(default=1.0, validator=positive)
    # Always-on experts, each of the expert hidden size (built as one SwiGLU N times as wide).
    n_shared_experts: int = attrs.field(default=0, validator=non_negative)
    # None: no token dropping. Else each expert takes at most ceil(capacity_factor * tokens * top_k / n_experts)
    # assignments per forward in training (first choices first, then token order).
    capacity_factor: float | None = attrs.field(default=None, validator=positive)
    every_n_layers: int = attrs.field(default=1, validator=positive)  # MoE in every n-th block ...
    first_moe_layer: int = attrs.field(default=0, validator=non_negative)  # ... starting at this block index
    expert_kernel: str = attrs.field(default="auto", validator=one_of("auto", "grouped_mm", "padded", "loop"))
    router: ComponentConfig = component(
        "routers", "softmax_topk", "Router of the MoE layers; its options in [model.ffn.router]."
    )

    def __attrs_post_init__(self) -> None:
        if self.top_k > self.n_experts:
            raise FieldError("top_k", f"must be at most n_experts ({self.n_experts}), got {self.top_k}")

    def is_moe_layer(self, layer_index: int) -> bool:
        """Block ``i`` is MoE iff ``i >= first_moe_layer`` and ``(i - first_moe_layer) % every_n_layers == 0``."""
        offset = layer_index - self.first_moe_layer
        return offset >= 0 and offset % self.every_n_layers == 0


@attrs.define
class SoftmaxTopKOptions:
    balance_loss_weight: float = attrs.field(default=0.01, validator=non_negative)  # Switch E * sum_i f_i * P_i
    z_loss_weight: float = attrs.field(default=0.0, validator=non_negative)  # mean logsumexp(logits)^2
    renormalize: bool = True  # combine weights: chosen probabilities / their sum (Mixtral); false: raw softmax


@attrs.define
class SigmoidTopKOptions:
    # Per optimizer step: bias += rate * sign(mean load - load), from the step's assignment counts.
    bias_update_rate: float = attrs.field(default=1e-3, validator=non_negative)
    sequence_balance_loss_weight: float = attrs.field(default=0.0, validator=non_negative)  # DeepSeek-V3 alpha
    z_loss_weight: float = attrs.field(default=0.0, validator=non_negative)
