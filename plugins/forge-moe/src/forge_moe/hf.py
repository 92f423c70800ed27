"""Conversion between Forge MoE models and Hugging Face's ``MixtralForCausalLM``, both ways.

A Forge model has a Mixtral equivalent when every block is an MoE layer (``every_n_layers = 1``,
``first_moe_layer = 0``) with the ``softmax_topk`` router renormalising its weights, no shared
experts, RMSNorm and no QK-norm. The capacity limit applies only in training, so it does not
stop a model from converting: Mixtral, like Forge at evaluation, routes every token.

Weights are written in Mixtral's on-disk layout, which every transformers release reads
(``block_sparse_moe.gate`` and ``block_sparse_moe.experts.<e>.w1/w2/w3``); import also accepts
the fused in-memory layout of transformers 5 (``mlp.experts.gate_up_proj`` / ``down_proj``).
The balance loss coefficient maps as ``router_aux_loss_coef = balance_loss_weight / top_k``:
Mixtral's loss sums ``f_i`` over the ``top_k`` choices, Forge's averages them.

Everything outside the feed-forward (embeddings, attention, norms, head) is renamed by the
core's :func:`forge_lm.model.hf.rename_to_hf` / :func:`~forge_lm.model.hf.rename_from_hf`, as
for Llama; this module maps only the router and the experts.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from forge_lm.errors import ForgeError
from forge_lm.model.hf import decoder_config_fields, rename_from_hf, rename_to_hf, swiglu_options_for
from forge_moe.layer import MoELayer
from forge_moe.routers import SoftmaxTopKRouter

_ROUTER = ("feed_forward.router.weight", "block_sparse_moe.gate.weight")  # (Forge, Mixtral) inside a block
_EXPERT_WEIGHTS = ("w1", "w2", "w3")  # the same names in Forge's stacked tensors and Mixtral's experts
_FORGE_EXPERTS = re.compile(r"feed_forward\.experts\.(w[123])")
_HF_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123])\.weight")


# -- export -------------------------------------------------------------------------------------


def _mixtral_problems(model: nn.Module, config: Any) -> list[str]:
    problems = []
    if config.norm != "rmsnorm":
        problems.append(f"[model] norm = '{config.norm}' (Mixtral uses 'rmsnorm')")
    if config.qk_norm:
        problems.append("[model] qk_norm = true (Mixtral has no QK-norm)")
    shapes = set()
    for i, layer in enumerate(model.layers):
        ffn = layer.feed_forward
        if not isinstance(ffn, MoELayer):
            problems.append(f"layer {i} is dense (Mixtral needs every_n_layers = 1 and first_moe_layer = 0)")
            continue
        if not isinstance(ffn.router, SoftmaxTopKRouter) or not ffn.router.renormalize:
            problems.append(f"layer {i}'s router is not softmax_topk with renormalize = true")
        if ffn.shared is not None:
            problems.append(f"layer {i} has shared experts (n_shared_experts > 0)")
        shapes.add((ffn.n_experts, ffn.top_k, ffn.experts.w1.shape[1]))
    if len(shapes) > 1:
        problems.append(f"the MoE layers differ in (experts, top_k, hidden): {sorted(shapes)}")
    return problems


def to_mixtral(model: nn.Module, config: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json dict, Mixtral state dict)`` of a Forge MoE model; a tied head is stored once."""
    problems = _mixtral_problems(model, config)
    if problems:
        raise ForgeError(
            "this MoE model has no Hugging Face MixtralForCausalLM equivalent: " + "; ".join(problems) + "."
        )
    first = model.layers[0].feed_forward
    n_experts, top_k, hidden = first.n_experts, first.top_k, first.experts.w1.shape[1]
    hf_config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **decoder_config_fields(config, model.vocab_size, hidden),
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_local_experts": n_experts,
        "num_experts_per_tok": top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": first.router.balance_loss_weight / top_k,
        "router_jitter_noise": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    state = rename_to_hf(model.state_dict(), _moe_to_mixtral, architecture="MixtralForCausalLM")
    if config.tie_embeddings:
        del state["lm_head.weight"]  # safetensors refuses shared tensors; transformers re-ties on load
    return hf_config, state


# -- import -------------------------------------------------------------------------------------


def model_table(hf_config: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The ``[model]`` table (plain data, ``ffn`` included) equivalent to a Mixtral ``config.json``."""
    problems = []
    if hf_config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act '{hf_config['hidden_act']}' (Forge's experts use silu)")
    rope = hf_config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or hf_config.get("rope_scaling"):
        problems.append(f"RoPE scaling '{hf_config.get('rope_scaling') or rope_type}' (Forge has plain RoPE)")
    dim, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    max_len = hf_config.get("max_position_embeddings", 2048)
    if hf_config.get("head_dim") not in (None, dim // heads):
        problems.append(f"head_dim {hf_config['head_dim']} != hidden_size / num_attention_heads ({dim // heads})")
    window = hf_config.get("sliding_window")
    if window is not None and window < max_len:
        problems.append(f"sliding_window {window} (Forge attends to the whole sequence)")
    if hf_config.get("router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise {hf_config['router_jitter_noise']} (set it to 0 to import)")
    if problems:
        raise ForgeError("this Mixtral checkpoint cannot be imported: " + "; ".join(problems) + ".")
    hidden = hf_config["intermediate_size"]
    sizes = swiglu_options_for(dim, hidden)
    top_k = hf_config.get("num_experts_per_tok", 2)
    return {
        "dim": dim,
        "n_layers": hf_config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": hf_config.get("num_key_value_heads") or heads,
        "vocab_size": hf_config["vocab_size"],
        "max_seq_len": max_len,
        "rope_theta": float(rope.get("rope_theta", hf_config.get("rope_theta", 1e6))),
        "norm": "rmsnorm",
        "norm_eps": hf_config.get("rms_norm_eps", 1e-5),
        "qk_norm": False,
        "tie_embeddings": tied,
        "init_std": hf_config.get("initializer_range", 0.02),
        "ffn": {
            "name": "moe",
            "n_experts": hf_config.get("num_local_experts", 8),
            "top_k": top_k,
            "hidden_multiplier": sizes.hidden_multiplier,
            "multiple_of": sizes.multiple_of,
            "expert_multiplier": 1.0,
            "n_shared_experts": 0,
            "every_n_layers": 1,
            "first_moe_layer": 0,
            "router": {
                "name": "softmax_topk",
                "balance_loss_weight": float(hf_config.get("router_aux_loss_coef", 0.0)) * top_k,
                "z_loss_weight": 0.0,
                "renormalize": True,
            },
        },
    }


def _moe_to_mixtral(index: int, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The router, and each expert's slice of Forge's stacked expert tensors, under Mixtral's names."""
    if name == _ROUTER[0]:
        return {_ROUTER[1]: tensor}
    expert = _FORGE_EXPERTS.fullmatch(name)
    if expert is None:
        return None
    kind = expert.group(1)
    return {f"block_sparse_moe.experts.{e}.{kind}.weight": tensor[e] for e in range(tensor.shape[0])}


def from_mixtral_state(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """A Mixtral state dict (on-disk per-expert layout or transformers 5's fused layout) under Forge's names."""
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def moe_from_mixtral(index: int, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if name in (_ROUTER[1], "mlp.gate.weight"):
            return {_ROUTER[0]: tensor}
        expert = _HF_EXPERT.fullmatch(name)
        if expert is not None:  # one expert's matrix: kept until all are there, then stacked below
            experts.setdefault((index, expert.group(2)), {})[int(expert.group(1))] = tensor
            return {}
        if name == "mlp.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            return {"feed_forward.experts.w1": gate, "feed_forward.experts.w3": up}
        if name == "mlp.experts.down_proj":
            return {"feed_forward.experts.w2": tensor}
        return None

    out = rename_from_hf(state, moe_from_mixtral, architecture="MixtralForCausalLM")
    for (index, kind), by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ForgeError(f"layer {index}'s experts are not numbered 0..{len(by_expert) - 1}: {sorted(by_expert)}")
        out[f"layers.{index}.feed_forward.experts.{kind}"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    missing = [
        f"layers.{i}.feed_forward.experts.{kind}"
        for i in range(n_layers)
        for kind in _EXPERT_WEIGHTS
        if f"layers.{i}.feed_forward.experts.{kind}" not in out
    ]
    if missing:
        raise ForgeError(f"the checkpoint lacks expert weights: {', '.join(missing)}.")
    return out


def from_mixtral(hf_config: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
    """``([model] table, Forge state dict)`` of a Mixtral model (``forge_lm_hf_import``)."""
    tied = "lm_head.weight" not in state or bool(hf_config.get("tie_word_embeddings", False))
    return model_table(hf_config, tied), from_mixtral_state(state, hf_config["num_hidden_layers"])
