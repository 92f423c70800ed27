"""Options of forge-deepseek's components: the ``mla`` attention and the ``deepseek_v3`` family.

Named by import path in :mod:`forge_deepseek.plugin`'s registrations, so that listing plugins
imports neither this module nor Forge's config schema (``DeepseekV3Options`` extends
``forge_lm.api.LlamaOptions``).
"""

from __future__ import annotations

import attrs

from forge_lm.api import ComponentConfig, LlamaOptions, component
from forge_lm.validators import FieldError, non_negative, positive


@attrs.define
class MLAOptions:
    """``[model.attention]`` with ``name = "mla"``. Unset sizes follow the model's ``head_dim``
    (``dim / n_heads``) in DeepSeek-V3's proportions (128 / 64 / 128, latent 512)."""

    q_lora_rank: int = attrs.field(default=0, validator=non_negative)  # 0: queries by one matrix wq
    kv_lora_rank: int | None = attrs.field(default=None, validator=positive)  # unset: 4 * head_dim
    qk_nope_head_dim: int | None = attrs.field(default=None, validator=positive)  # unset: head_dim
    qk_rope_head_dim: int | None = attrs.field(default=None, validator=positive)  # unset: head_dim / 2
    v_head_dim: int | None = attrs.field(default=None, validator=positive)  # unset: head_dim

    def __attrs_post_init__(self) -> None:
        if self.qk_rope_head_dim is not None and self.qk_rope_head_dim % 2:
            raise FieldError("qk_rope_head_dim", f"must be even (RoPE turns pairs), got {self.qk_rope_head_dim}")

    def sizes(self, head_dim: int) -> dict[str, int]:
        """The module's sizes for a model whose ``dim / n_heads`` is ``head_dim``."""
        rope = self.qk_rope_head_dim if self.qk_rope_head_dim is not None else max(2, head_dim // 2 // 2 * 2)
        return {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank if self.kv_lora_rank is not None else 4 * head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim if self.qk_nope_head_dim is not None else head_dim,
            "qk_rope_head_dim": rope,
            "v_head_dim": self.v_head_dim if self.v_head_dim is not None else head_dim,
        }


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@attrs.frozen
class DeepseekV3Options(LlamaOptions):
    """``[model]`` with ``name = "deepseek_v3"``: the ``llama`` options (sizes, norms, RoPE) with
    DeepSeek-V3's defaults (MLA, MoE, untied head, eps 1e-6) and its own fields."""

    norm_eps: float = attrs.field(default=1e-6, validator=positive, metadata=_doc("Epsilon of every norm."))
    tie_embeddings: bool = attrs.field(default=False, metadata=_doc("Output head shares the embedding matrix."))
    ffn: ComponentConfig = component(
        "feed_forwards", "moe", "Feed-forward layer: forge-moe's 'moe' (dense SwiGLU in the first n_dense_layers)."
    )
    attention: ComponentConfig = component("attentions", "mla", "Attention layer: 'mla' (multi-head latent).")
    n_dense_layers: int = attrs.field(
        default=1,
        validator=non_negative,
        metadata=_doc("Blocks 0 .. n_dense_layers - 1 have a dense SwiGLU; the rest MoE (HF first_k_dense_replace)."),
    )
    mtp_depth: int = attrs.field(
        default=1,
        validator=non_negative,
        metadata=_doc("Multi-token prediction modules: module k predicts token t + 1 + k (0: none)."),
    )
    mtp_loss_weight: float = attrs.field(
        default=0.3,
        validator=non_negative,
        metadata=_doc("The MTP loss is mtp_loss_weight times the mean of the modules' cross-entropies."),
    )

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.n_dense_layers > self.n_layers:
            raise FieldError("n_dense_layers", f"must be at most n_layers ({self.n_layers}), got {self.n_dense_layers}")
