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
from forge_lm.model.hf_fields import HFConfigReader
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
    """The ``[model]`` table (plain data, ``ffn`` included) equivalent to a Mixtral ``config.json``;
    refuses what Forge cannot express, and a field that is missing or holds a wrong type or value
    (naming it)."""
    read = HFConfigReader(hf_config, "Mixtral")
    sizes = read.decoder_sizes()
    rope = read.table("rope_parameters")
    head_dim = read.positive_int("head_dim", None)
    window = read.positive_int("sliding_window", None)
    n_experts = read.positive_int("num_local_experts", 8)
    top_k = read.positive_int("num_experts_per_tok", 2)
    if top_k > n_experts:
        problem = f"num_experts_per_tok ({top_k}) exceeds num_local_experts ({n_experts})"
        raise read.refuse("num_experts_per_tok", problem)
    jitter = read.non_negative_number("router_jitter_noise", 0.0)
    aux_loss = read.non_negative_number("router_aux_loss_coef", 0.0)
    rope_theta = read.rope_theta(1e6)
    norm_eps = read.positive_number("rms_norm_eps", 1e-5)
    init_std = read.positive_number("initializer_range", 0.02)
    problems = []
    if hf_config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act '{hf_config['hidden_act']}' (Forge's experts use silu)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or hf_config.get("rope_scaling"):
        problems.append(f"RoPE scaling '{hf_config.get('rope_scaling') or rope_type}' (Forge has plain RoPE)")
    dim, heads, max_len = sizes["dim"], sizes["n_heads"], sizes["max_seq_len"]
    if head_dim not in (None, dim // heads):
        problems.append(f"head_dim {head_dim} != hidden_size / num_attention_heads ({dim // heads})")
    if window is not None and window < max_len:
        problems.append(f"sliding_window {window} (Forge attends to the whole sequence)")
    if jitter:
        problems.append(f"router_jitter_noise {hf_config['router_jitter_noise']} (set it to 0 to import)")
    if problems:
        raise ForgeError("this Mixtral checkpoint cannot be imported: " + "; ".join(problems) + ".")
    options = swiglu_options_for(dim, sizes["hidden"])
    return {
        "dim": dim,
        "n_layers": sizes["n_layers"],
        "n_heads": heads,
        "n_kv_heads": sizes["n_kv_heads"],
        "vocab_size": sizes["vocab_size"],
        "max_seq_len": max_len,
        "rope_theta": rope_theta,
        "norm": "rmsnorm",
        "norm_eps": norm_eps,
        "qk_norm": False,
        "tie_embeddings": tied,
        "init_std": init_std,
        "ffn": {
            "name": "moe",
            "n_experts": n_experts,
            "top_k": top_k,
            "hidden_multiplier": options.hidden_multiplier,
            "multiple_of": options.multiple_of,
            "expert_multiplier": 1.0,
            "n_shared_experts": 0,
            "every_n_layers": 1,
            "first_moe_layer": 0,
            "router": {
                "name": "softmax_topk",
                "balance_loss_weight": aux_loss * top_k,
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
            if tensor.ndim != 3 or tensor.shape[1] % 2:
                raise ForgeError(
                    f"model.layers.{index}.{name} has shape {list(tensor.shape)}; the fused layout is "
                    "[experts, 2 * intermediate_size, hidden_size]."
                )
            gate, up = tensor.chunk(2, dim=1)
            return {"feed_forward.experts.w1": gate, "feed_forward.experts.w3": up}
        if name == "mlp.experts.down_proj":
            return {"feed_forward.experts.w2": tensor}
        return None

    out = rename_from_hf(state, moe_from_mixtral, architecture="MixtralForCausalLM")
    for (index, kind), by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ForgeError(f"layer {index}'s experts are not numbered 0..{len(by_expert) - 1}: {sorted(by_expert)}")
        shapes = {tuple(tensor.shape) for tensor in by_expert.values()}
        if len(shapes) > 1:
            raise ForgeError(f"layer {index}'s experts' {kind} weights differ in shape: {sorted(shapes)}.")
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
    tied = "lm_head.weight" not in state or HFConfigReader(hf_config, "Mixtral").flag("tie_word_embeddings", False)
    table = model_table(hf_config, tied)  # checks the config's fields before the state is read by them
    return table, from_mixtral_state(state, table["n_layers"])
