"""Forge plugin module of forge-deepseek (entry point ``deepseek`` in the group ``forge_lm``).

Kept free of heavy imports: Forge imports this module to list plugins and validate configs.
It holds the hook implementations; the options classes live in :mod:`forge_deepseek.options`
(named by import path, so that listing plugins does not import them), the torch code in
:mod:`forge_deepseek.mla`, :mod:`forge_deepseek.model` and :mod:`forge_deepseek.mtp`, and the
Hugging Face conversion in :mod:`forge_deepseek.hf`, imported only when a run builds a model or
converts one.
"""

from __future__ import annotations

import sys
from typing import Any

from forge_lm import hookimpl
from forge_lm.errors import ConfigError

FORGE_LM_PLUGIN_API = ">=1.2,<2"  # 1.2: options classes named by import path

FAMILY = "deepseek_v3"


@hookimpl
def forge_lm_register_attentions(register):
    register(
        "mla",
        "forge_deepseek.mla:build_mla",
        config="forge_deepseek.options:MLAOptions",
        description="Multi-head latent attention (DeepSeek-V2/V3): low-rank KV latent, decoupled RoPE key",
    )


@hookimpl
def forge_lm_register_models(register):
    register(
        FAMILY,
        "forge_deepseek.model:build_deepseek_v3",
        config="forge_deepseek.options:DeepseekV3Options",
        description="DeepSeek-V3: MLA, dense then MoE blocks (forge-moe), multi-token prediction",
    )


def _moe_options() -> type | None:
    """forge-moe's MoEOptions if its module was imported (no MoE layer's options exist otherwise)."""
    module = sys.modules.get("forge_moe.options")
    return getattr(module, "MoEOptions", None)


@hookimpl
def forge_lm_configure(config):
    from forge_deepseek.options import DeepseekV3Options  # a config is loaded: its schema is imported already

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
    from forge_deepseek.options import MLAOptions

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
