"""Forge plugin module of forge-deepseek (entry point ``deepseek`` in the group ``forge_lm``).

Kept free of heavy imports: Forge imports this module to list plugins and validate configs.
It holds the options classes and the hook implementations; the torch code lives in
:mod:`forge_deepseek.mla`, :mod:`forge_deepseek.model` and :mod:`forge_deepseek.mtp`, and the
Hugging Face conversion in :mod:`forge_deepseek.hf`, imported only when a run builds a model or
converts one.
"""

from __future__ import annotations

import sys
from typing import Any

import attrs

from forge_lm import hookimpl
from forge_lm.api import ComponentConfig, LlamaOptions, component
from forge_lm.errors import ConfigError
from forge_lm.validators import FieldError, non_negative, positive

FORGE_LM_PLUGIN_API = ">=1,<2"

FAMILY = "deepseek_v3"


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


@hookimpl
def forge_lm_register_attentions(register):
    register(
        "mla",
        "forge_deepseek.mla:build_mla",
        config=MLAOptions,
        description="Multi-head latent attention (DeepSeek-V2/V3): low-rank KV latent, decoupled RoPE key",
    )


@hookimpl
def forge_lm_register_models(register):
    register(
        FAMILY,
        "forge_deepseek.model:build_deepseek_v3",
        config=DeepseekV3Options,
        description="DeepSeek-V3: MLA, dense then MoE blocks (forge-moe), multi-token prediction",
    )


def _moe_options() -> type | None:
    module = sys.modules.get("forge_moe.plugin")
    return getattr(module, "MoEOptions", None)


@hookimpl
def forge_lm_configure(config):
    options = config.model.options
    check_mla_sizes(options)
    if not isinstance(options, DeepseekV3Options):
        return
    if options.mtp_depth and config.distributed.pp > 1:
        raise ConfigError(
            f"[distributed] pp = {config.distributed.pp} cannot split a deepseek_v3 model with [model] mtp_depth = "
            f"{options.mtp_depth}: its MTP modules need the embedding (first stage) and the output head (last "
            "stage) together; set mtp_depth = 0, or pp = 1."
        )
    moe = _moe_options()
    ffn = options.ffn.options
    if moe is None or not isinstance(ffn, moe):
        return
    if ffn.first_moe_layer not in (0, options.n_dense_layers) or ffn.every_n_layers != 1:
        raise ConfigError(
            f"[model.ffn] first_moe_layer = {ffn.first_moe_layer}, every_n_layers = {ffn.every_n_layers}: the "
            f"deepseek_v3 family places its MoE layers itself (every block from [model] n_dense_layers = "
            f"{options.n_dense_layers} on); leave both unset, and set n_dense_layers instead."
        )


def check_mla_sizes(options: Any) -> None:
    """Refuses ``[model]`` keys that MLA would silently ignore, in any family that selects it."""
    attention = getattr(options, "attention", None)
    if attention is None or not isinstance(attention.options, MLAOptions):
        return
    if getattr(options, "qk_norm", False):
        raise ConfigError(
            "[model] qk_norm = true has no effect with [model.attention] name = 'mla', which normalises its "
            "compressed query and key/value latents (q_norm, kv_norm) instead; set qk_norm = false."
        )
    n_kv_heads = getattr(options, "n_kv_heads", None)
    if n_kv_heads not in (None, options.n_heads):
        raise ConfigError(
            f"[model] n_kv_heads = {n_kv_heads} has no effect with [model.attention] name = 'mla': every head "
            "gets its own keys and values, expanded from one shared latent (kv_lora_rank sets the cache's size); "
            "leave n_kv_heads unset."
        )


def _model_module() -> Any:
    """forge_deepseek.model if it was imported (no deepseek_v3 model can exist otherwise), else None."""
    return sys.modules.get("forge_deepseek.model")


@hookimpl(tryfirst=True)  # before forge-moe's, which would take the model for a Mixtral and refuse it
def forge_lm_hf_export(model, config):
    module = _model_module()
    if module is None or not isinstance(model, module.DeepseekV3):
        return None
    from forge_deepseek import hf

    return hf.to_deepseek_v3(model)


@hookimpl
def forge_lm_hf_import(hf_config, state):
    if hf_config.get("model_type") != "deepseek_v3":
        return None
    from forge_deepseek import hf

    return hf.from_deepseek_v3(hf_config, state)
