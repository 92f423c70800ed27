"""Forge plugin module of forge-moe (entry point ``moe`` in the group ``forge_lm``).

Kept free of heavy imports: Forge imports this module to list plugins and validate configs.
It holds the hook implementations; the options classes live in :mod:`forge_moe.options` (named
by import path, so that listing plugins does not import them), the torch code in
:mod:`forge_moe.layer`, :mod:`forge_moe.experts`, :mod:`forge_moe.routers` and
:mod:`forge_moe.hf`, and the expert-parallel transform in :mod:`forge_moe.expert_parallel`,
imported only when a run builds a component, applies its transforms or converts a model.
"""

from __future__ import annotations

import sys
from typing import Any

from forge_lm import hookimpl
from forge_lm.errors import ConfigError

FORGE_LM_PLUGIN_API = ">=1.2,<2"  # 1.1: transform slots named by role; 1.2: options classes named by path

MOE_NAME = "moe"


@hookimpl
def forge_lm_register_feed_forwards(register):
    register(
        MOE_NAME,
        "forge_moe.layer:build_moe",
        config="forge_moe.options:MoEOptions",
        description="Mixture of SwiGLU experts every n-th layer (router, shared experts, capacity); SwiGLU elsewhere",
    )


@hookimpl
def forge_lm_register_routers(register):
    register(
        "softmax_topk",
        "forge_moe.routers:build_softmax_topk",
        config="forge_moe.options:SoftmaxTopKOptions",
        description="Softmax top-k, renormalised weights, Switch balance loss (Mixtral)",
    )
    register(
        "sigmoid_topk",
        "forge_moe.routers:build_sigmoid_topk",
        config="forge_moe.options:SigmoidTopKOptions",
        description="Sigmoid top-k with a no-gradient balancing bias (DeepSeek-V3), optional sequence balance loss",
    )


@hookimpl
def forge_lm_register_model_transforms(register):
    register(
        "expert_parallel",
        "forge_moe.expert_parallel:expert_parallel_transform",
        description="experts split over the ep ranks, tokens exchanged by all-to-all ([distributed] ep > 1)",
    )
    register(
        "moe_load_sync",
        "forge_moe.expert_parallel:load_sync_transform",
        description="routers' expert load summed over the data-parallel ranks before no-gradient updates",
    )


@hookimpl
def forge_lm_configure(config):
    from forge_lm.api import model_options
    from forge_moe.options import MoEOptions  # a config is loaded: its schema is imported already

    model = model_options(config)
    ffn = _selected_ffn(config)
    if ffn is not None and isinstance(ffn.options, MoEOptions) and ffn.options.first_moe_layer >= model.n_layers:
        raise ConfigError(
            f"[model.ffn] first_moe_layer: {ffn.options.first_moe_layer} leaves no MoE layer in a model of "
            f'{model.n_layers} layers; lower it, or use name = "swiglu" for a dense model.'
        )
    check_router(config)
    check_expert_parallel(config)


def check_router(config: Any) -> None:
    """Refuses the router settings that leave the router's weight matrix nothing to learn from.

    With ``top_k = 1`` a weight normalised over the chosen experts is ``w / w = 1`` for every
    token: the layer's output carries no gradient to the router, so only a router loss can
    train it (a z-loss only pulls the logits towards 0, so it does not count).
    """
    from forge_moe.options import MoEOptions, SigmoidTopKOptions, SoftmaxTopKOptions

    ffn = _selected_ffn(config)
    if ffn is None or not isinstance(ffn.options, MoEOptions) or ffn.options.top_k != 1:
        return
    router = ffn.options.router
    if isinstance(router.options, SoftmaxTopKOptions) and router.options.renormalize:
        raise ConfigError(
            "[model.ffn.router] renormalize = true with [model.ffn] top_k = 1: each token's one combine "
            "weight is then p / p = 1, so the router gets no gradient from the layer's output (only from "
            "its balance loss); set renormalize = false (the weight is the chosen expert's softmax "
            "probability, as in Switch Transformer), or top_k >= 2."
        )
    if isinstance(router.options, SigmoidTopKOptions) and router.options.sequence_balance_loss_weight == 0:
        raise ConfigError(
            "[model.ffn.router] sequence_balance_loss_weight = 0 with [model.ffn] top_k = 1 and the "
            "sigmoid_topk router: each token's one normalised weight is then s / s = 1, so the router's "
            "weight matrix gets no gradient from the layer's output and, without the sequence balance loss, "
            "learns nothing (the bias alone moves); set sequence_balance_loss_weight > 0 (e.g. 1e-4), or "
            "top_k >= 2."
        )


def check_expert_parallel(config: Any) -> None:
    """``[distributed] ep`` must split every MoE layer's experts evenly (checked again by the transform)."""
    ep = config.distributed.ep
    if ep == 1:
        return
    from forge_moe.options import MoEOptions

    ffn = _selected_ffn(config)
    if ffn is None or not isinstance(ffn.options, MoEOptions):
        chosen = f"[model.ffn] name = '{ffn.name}'" if ffn is not None else f"[model] name = '{config.model.name}'"
        raise ConfigError(
            f"[distributed] ep = {ep} splits the experts of forge-moe's MoE layers, but {chosen} has none; set "
            "ep = 1, or use [model.ffn] name = 'moe'."
        )
    if ffn.options.n_experts % ep:
        raise ConfigError(
            f"[model.ffn] n_experts = {ffn.options.n_experts} cannot be split evenly over [distributed] ep = {ep} "
            "expert-parallel ranks; choose an ep that divides n_experts (each rank owns n_experts / ep experts)."
        )


def _selected_ffn(config: Any) -> Any:
    """``[model.ffn]`` of the run's model family, or None for a family without one."""
    from forge_lm.api import model_options

    return getattr(model_options(config), "ffn", None)


def _built_moe_layers() -> Any:
    """forge_moe.layer if it was imported (no MoE layer can exist otherwise), else None."""
    return sys.modules.get("forge_moe.layer")


@hookimpl
def forge_lm_step_end(context):
    layer = _built_moe_layers()
    if layer is not None:
        layer.after_optimizer_step(context.model)


@hookimpl
def forge_lm_step_skipped(context):
    # A skipped non-finite step has no step_end: without this, the bad batch's expert counts
    # would stay in the routers' pending load and skew the next bias update.
    layer = _built_moe_layers()
    if layer is not None:
        layer.step_skipped(context.model)


@hookimpl
def forge_lm_plot_panels(keys):
    from forge_moe.plot import moe_panels

    return moe_panels(keys)


@hookimpl
def forge_lm_hf_export(model, config):
    layer = _built_moe_layers()
    if layer is None or not any(isinstance(m, layer.MoELayer) for m in model.modules()):
        return None
    from forge_lm.api import Transformer

    if type(model) is not Transformer:  # another family's model (a subclass included) converts itself
        return None
    from forge_moe import hf

    # With QK-norm the model's Hugging Face equivalent is Qwen3-MoE; without it, Mixtral.
    return hf.to_qwen3_moe(model, config) if getattr(config, "qk_norm", False) else hf.to_mixtral(model, config)


@hookimpl
def forge_lm_hf_import(hf_config, state):
    kind = hf_config.get("model_type")
    if kind not in ("mixtral", "qwen3_moe"):
        return None
    from forge_moe import hf

    return hf.from_qwen3_moe(hf_config, state) if kind == "qwen3_moe" else hf.from_mixtral(hf_config, state)
