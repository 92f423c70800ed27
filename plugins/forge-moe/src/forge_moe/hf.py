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
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from forge_lm.errors import ForgeError
from forge_lm.model.hf import decoder_config_fields, swiglu_options_for
from forge_moe.layer import MoELayer
from forge_moe.routers import SoftmaxTopKRouter

_GLOBAL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",
}
_EXPERT_WEIGHTS = ("w1", "w2", "w3")  # the same names in Forge's stacked tensors and Mixtral's experts
_FORGE_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123])\.weight")
_HF_IGNORED = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


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
    state = {}
    for name, tensor in model.state_dict().items():
        if name in _GLOBAL:
            state[_GLOBAL[name]] = tensor
            continue
        match = _FORGE_LAYER.fullmatch(name)
        if match is None:
            raise ForgeError(f"parameter '{name}' has no Mixtral counterpart.")
        index, rest = match.groups()
        prefix = f"model.layers.{index}"
        if rest in _LAYER:
            state[f"{prefix}.{_LAYER[rest]}"] = tensor
        elif rest.removeprefix("feed_forward.experts.") in _EXPERT_WEIGHTS:
            kind = rest.rpartition(".")[2]
            for e in range(n_experts):
                state[f"{prefix}.block_sparse_moe.experts.{e}.{kind}.weight"] = tensor[e]
        else:
            raise ForgeError(f"parameter '{name}' has no Mixtral counterpart.")
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


def from_mixtral_state(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """A Mixtral state dict (on-disk per-expert layout or transformers 5's fused layout) under Forge's names."""
    forge_global = {hf: forge for forge, hf in _GLOBAL.items()}
    forge_layer = {hf: forge for forge, hf in _LAYER.items()}
    forge_layer["mlp.gate.weight"] = "feed_forward.router.weight"
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if _HF_IGNORED.fullmatch(name):
            continue
        if name in forge_global:
            out[forge_global[name]] = tensor
            continue
        match = _HF_LAYER.fullmatch(name)
        if match is None:
            raise ForgeError(f"weight '{name}' is not part of a MixtralForCausalLM that Forge can import.")
        index, rest = int(match.group(1)), match.group(2)
        prefix = f"layers.{index}.feed_forward.experts"
        expert = _HF_EXPERT.fullmatch(rest)
        if rest in forge_layer:
            out[f"layers.{index}.{forge_layer[rest]}"] = tensor
        elif expert is not None:
            experts.setdefault((index, expert.group(2)), {})[int(expert.group(1))] = tensor
        elif rest == "mlp.experts.gate_up_proj":
            out[f"{prefix}.w1"], out[f"{prefix}.w3"] = tensor.chunk(2, dim=1)
        elif rest == "mlp.experts.down_proj":
            out[f"{prefix}.w2"] = tensor
        else:
            raise ForgeError(f"weight '{name}' is not part of a MixtralForCausalLM that Forge can import.")
    for (index, kind), by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ForgeError(f"layer {index}'s experts are not numbered 0..{len(by_expert) - 1}: {sorted(by_expert)}")
        out[f"layers.{index}.feed_forward.experts.{kind}"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    if "tok_embeddings.weight" not in out:
        raise ForgeError("the checkpoint has no model.embed_tokens.weight; it is not a complete MixtralForCausalLM.")
    out.setdefault("output.weight", out["tok_embeddings.weight"])
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
