"""Conversion between Forge MoE models and Hugging Face's ``MixtralForCausalLM`` or
``Qwen3MoeForCausalLM``, both ways.

A Forge model has a Mixtral equivalent when every block is an MoE layer (``every_n_layers = 1``,
``first_moe_layer = 0``) with the ``softmax_topk`` router renormalising its weights, no shared
experts, RMSNorm and no QK-norm. With QK-norm its equivalent is Qwen3-MoE instead, which also
has dense blocks (``decoder_sparse_step`` and ``mlp_only_layers`` place them; ``intermediate_size``
is the dense blocks' SwiGLU, ``moe_intermediate_size`` an expert's) and a ``softmax_topk`` router
with or without renormalisation (``norm_topk_prob``). The capacity limit applies only in
training, so it does not stop a model from converting: Hugging Face, like Forge at evaluation,
routes every token.

Weights are written in each format's on-disk layout, which every transformers release reads
(Mixtral: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.<e>.w1/w2/w3``; Qwen3-MoE:
``mlp.gate`` and ``mlp.experts.<e>.gate_proj/up_proj/down_proj``); import also accepts the
fused in-memory layout of transformers 5 (``mlp.experts.gate_up_proj`` / ``down_proj``). The
balance loss coefficient maps as ``router_aux_loss_coef = balance_loss_weight / top_k``: both
formats' loss sums ``f_i`` over the ``top_k`` choices, Forge's averages them.

Everything outside the feed-forward (embeddings, attention, norms, head) is renamed by the
core's :func:`forge_lm.model.hf.rename_to_hf` / :func:`~forge_lm.model.hf.rename_from_hf`, as
for Llama and Qwen3; this module maps only the router, the experts and Qwen3-MoE's dense blocks.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from forge_lm.api import (
    QWEN3_ATTENTION_FIELDS,
    HFConfigReader,
    SwiGLU,
    decoder_config_fields,
    qwen3_attention_problems,
    rename_from_hf,
    rename_to_hf,
    swiglu_hidden,
    swiglu_options_for,
)
from forge_lm.errors import ForgeError
from forge_moe.layer import MoELayer
from forge_moe.routers import SoftmaxTopKRouter

_ROUTER = ("feed_forward.router.weight", "block_sparse_moe.gate.weight")  # (Forge, Mixtral) inside a block
_EXPERT_WEIGHTS = ("w1", "w2", "w3")  # the same names in Forge's stacked tensors and Mixtral's experts
_FORGE_EXPERTS = re.compile(r"feed_forward\.experts\.(w[123])")
_HF_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123])\.weight")
# Qwen3-MoE inside a block: one expert's matrices, the router, a dense block's SwiGLU.
_QWEN_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_QWEN_KINDS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Forge's stacked tensor -> Qwen's name
_QWEN_ROUTER = "mlp.gate.weight"
_QWEN_DENSE = {f"feed_forward.{forge}.weight": f"mlp.{hf}.weight" for forge, hf in _QWEN_KINDS.items()}


# -- export -------------------------------------------------------------------------------------


def _mixtral_problems(model: nn.Module, config: Any) -> list[str]:
    problems = []
    if config.norm != "rmsnorm":
        problems.append(f"[model] norm = '{config.norm}' (Mixtral uses 'rmsnorm')")
    if config.qk_norm:
        problems.append("[model] qk_norm = true (Mixtral has no QK-norm; its equivalent is Qwen3MoeForCausalLM)")
    if config.attention.name.rpartition(":")[2] != "gqa":
        # Mixtral's config has a sliding_window field, but Forge exports full causal attention only.
        problems.append(f"[model.attention] name = '{config.attention.name}' (the export writes 'gqa' attention)")
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
    sizes = read.decoder_sizes(explicit_head_dim=True)
    rope = read.table("rope_parameters")
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
        **({"head_dim": sizes["head_dim"]} if sizes["head_dim"] is not None else {}),
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
    return _moe_state_from_hf(state, range(n_layers), "MixtralForCausalLM", qwen=False)


def _moe_state_from_hf(
    state: dict[str, torch.Tensor], moe_layers: Any, architecture: str, *, qwen: bool
) -> dict[str, torch.Tensor]:
    """A Mixtral (``qwen`` False) or Qwen3-MoE state dict under Forge's names: routers and experts
    (per-expert matrices stacked, or the fused layout split), and Qwen3-MoE's dense blocks;
    refuses a checkpoint lacking the experts of a block of ``moe_layers``."""
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    routers = (_QWEN_ROUTER,) if qwen else (_ROUTER[1], "mlp.gate.weight")
    dense = {hf: forge for forge, hf in _QWEN_DENSE.items()} if qwen else {}
    qwen_kinds = {hf: forge for forge, hf in _QWEN_KINDS.items()}

    def moe_from_hf(index: int, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if name in routers:
            return {_ROUTER[0]: tensor}
        if name in dense:
            return {dense[name]: tensor}
        expert = (_QWEN_EXPERT if qwen else _HF_EXPERT).fullmatch(name)
        if expert is not None:  # one expert's matrix: kept until all are there, then stacked below
            kind = qwen_kinds[expert.group(2)] if qwen else expert.group(2)
            experts.setdefault((index, kind), {})[int(expert.group(1))] = tensor
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

    out = rename_from_hf(state, moe_from_hf, architecture=architecture)
    for (index, kind), by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ForgeError(f"layer {index}'s experts are not numbered 0..{len(by_expert) - 1}: {sorted(by_expert)}")
        shapes = {tuple(tensor.shape) for tensor in by_expert.values()}
        if len(shapes) > 1:
            raise ForgeError(f"layer {index}'s experts' {kind} weights differ in shape: {sorted(shapes)}.")
        out[f"layers.{index}.feed_forward.experts.{kind}"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    missing = [
        f"layers.{i}.feed_forward.experts.{kind}"
        for i in moe_layers
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


# -- Qwen3-MoE ----------------------------------------------------------------------------------


def _qwen3_moe_problems(model: nn.Module, config: Any) -> list[str]:
    problems = []
    if config.norm != "rmsnorm":
        problems.append(f"[model] norm = '{config.norm}' (Qwen3-MoE uses 'rmsnorm')")
    if not config.qk_norm:
        problems.append("[model] qk_norm = false (Qwen3-MoE normalises queries and keys; without it: Mixtral)")
    if config.attention.name.rpartition(":")[2] != "gqa":
        problems.append(f"[model.attention] name = '{config.attention.name}' (Qwen3-MoE uses 'gqa', full attention)")
    moe, dense = set(), set()
    for i, layer in enumerate(model.layers):
        ffn = layer.feed_forward
        if isinstance(ffn, SwiGLU):
            dense.add(ffn.w1.out_features)
        elif not isinstance(ffn, MoELayer):
            problems.append(f"layer {i}'s feed-forward is {type(ffn).__name__}, neither forge-moe's MoE nor SwiGLU")
        else:
            if not isinstance(ffn.router, SoftmaxTopKRouter):
                problems.append(f"layer {i}'s router is not softmax_topk")
            if ffn.shared is not None:
                problems.append(f"layer {i} has shared experts (n_shared_experts > 0)")
            moe.add((ffn.n_experts, ffn.top_k, ffn.experts.w1.shape[1], getattr(ffn.router, "renormalize", None)))
    if len(moe) > 1:
        problems.append(f"the MoE layers differ in (experts, top_k, hidden, renormalize): {sorted(moe)}")
    if len(dense) > 1:
        problems.append(f"the dense layers' SwiGLU hidden sizes differ: {sorted(dense)}")
    return problems


def to_qwen3_moe(model: nn.Module, config: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json dict, Qwen3-MoE state dict)`` of a Forge MoE model with QK-norm; a tied head
    is stored once. Dense blocks are placed by ``decoder_sparse_step`` (``every_n_layers`` when
    the first MoE block is ``every_n_layers - 1``, as Qwen counts) and ``mlp_only_layers``."""
    problems = _qwen3_moe_problems(model, config)
    if problems:
        raise ForgeError(
            "this MoE model has no Hugging Face Qwen3MoeForCausalLM equivalent: " + "; ".join(problems) + "."
        )
    moe_layers = [i for i, layer in enumerate(model.layers) if isinstance(layer.feed_forward, MoELayer)]
    first = model.layers[moe_layers[0]].feed_forward
    dense = [layer.feed_forward.w1.out_features for layer in model.layers if isinstance(layer.feed_forward, SwiGLU)]
    options = config.ffn.options  # a model without dense blocks: the dense size its options would give
    dense_hidden = dense[0] if dense else swiglu_hidden(config.dim, options.hidden_multiplier, options.multiple_of)
    every, start = options.every_n_layers, options.first_moe_layer
    step = every if start == every - 1 else 1
    mlp_only = [i for i in range(len(model.layers)) if (i + 1) % step == 0 and i not in moe_layers]
    hf_config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **decoder_config_fields(config, model.vocab_size, dense_hidden),
        **QWEN3_ATTENTION_FIELDS,
        "sliding_window": None,
        "decoder_sparse_step": step,
        "mlp_only_layers": mlp_only,
        "moe_intermediate_size": first.experts.w1.shape[1],
        "num_experts": first.n_experts,
        "num_experts_per_tok": first.top_k,
        "norm_topk_prob": first.router.renormalize,
        "output_router_logits": False,
        "router_aux_loss_coef": first.router.balance_loss_weight / first.top_k,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    state = rename_to_hf(model.state_dict(), _moe_to_qwen3, architecture="Qwen3MoeForCausalLM")
    if config.tie_embeddings:
        del state["lm_head.weight"]  # safetensors refuses shared tensors; transformers re-ties on load
    return hf_config, state


def _moe_to_qwen3(index: int, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The router, each expert's slice of the stacked expert tensors and a dense block's SwiGLU,
    under Qwen3-MoE's names."""
    if name == _ROUTER[0]:
        return {_QWEN_ROUTER: tensor}
    if name in _QWEN_DENSE:
        return {_QWEN_DENSE[name]: tensor}
    expert = _FORGE_EXPERTS.fullmatch(name)
    if expert is None:
        return None
    kind = _QWEN_KINDS[expert.group(1)]
    return {f"mlp.experts.{e}.{kind}.weight": tensor[e] for e in range(tensor.shape[0])}


def qwen3_moe_table(hf_config: dict[str, Any], tied: bool) -> tuple[dict[str, Any], list[int]]:
    """``([model] table, the MoE blocks' indices)`` equivalent to a Qwen3-MoE ``config.json``;
    refuses what Forge cannot express (naming the field), and a field that is missing or holds a
    wrong type or value."""
    read = HFConfigReader(hf_config, "Qwen3-MoE")
    sizes = read.decoder_sizes(explicit_head_dim=True)
    dim, n_layers, max_len = sizes["dim"], sizes["n_layers"], sizes["max_seq_len"]
    # config.json says num_experts (Qwen's files) or num_local_experts (transformers 5's save_pretrained)
    n_experts = read.positive_int("num_experts", None) or read.positive_int("num_local_experts", 128)
    top_k = read.positive_int("num_experts_per_tok", 8)
    if top_k > n_experts:
        raise read.refuse("num_experts_per_tok", f"num_experts_per_tok ({top_k}) exceeds num_experts ({n_experts})")
    expert_hidden = read.positive_int("moe_intermediate_size", 768)
    step = read.positive_int("decoder_sparse_step", 1)
    mlp_only = hf_config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise read.refuse("mlp_only_layers", f"mlp_only_layers is {str(mlp_only)[:60]}, not a list of layer indices")
    moe_layers = [i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0]
    aux_loss = read.non_negative_number("router_aux_loss_coef", 0.001)
    renormalize = read.flag("norm_topk_prob", False)
    rope_theta = read.rope_theta(10000.0)
    norm_eps = read.positive_number("rms_norm_eps", 1e-6)
    init_std = read.positive_number("initializer_range", 0.02)
    problems = []
    if hf_config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act '{hf_config['hidden_act']}' (Forge's experts use silu)")
    rope = read.table("rope_parameters")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or hf_config.get("rope_scaling"):
        problems.append(f"RoPE scaling '{hf_config.get('rope_scaling') or rope_type}' (Forge has plain RoPE)")
    problems += qwen3_attention_problems(read, n_layers, max_len, per_layer=False)
    layout = _moe_layout(moe_layers, n_layers)
    if layout is None:
        where = f"in layers {moe_layers}" if moe_layers else "in no layer"
        problems.append(
            f"decoder_sparse_step = {step} with mlp_only_layers = {sorted(mlp_only)} puts the MoE blocks {where}, "
            "which forge-moe's every_n_layers / first_moe_layer (every n-th block from one on) cannot express"
        )
    if problems:
        raise ForgeError("this Qwen3-MoE checkpoint cannot be imported: " + "; ".join(problems) + ".")
    every, first = layout
    dense = len(moe_layers) < n_layers
    return {
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": sizes["n_heads"],
        "n_kv_heads": sizes["n_kv_heads"],
        **({"head_dim": sizes["head_dim"]} if sizes["head_dim"] is not None else {}),
        "vocab_size": sizes["vocab_size"],
        "max_seq_len": max_len,
        "rope_theta": rope_theta,
        "norm": "rmsnorm",
        "norm_eps": norm_eps,
        "qk_norm": True,
        "tie_embeddings": tied,
        "init_std": init_std,
        "ffn": {
            "name": "moe",
            "n_experts": n_experts,
            "top_k": top_k,
            **_hidden_options(dim, sizes["hidden"] if dense else expert_hidden, expert_hidden),
            "n_shared_experts": 0,
            "every_n_layers": every,
            "first_moe_layer": first,
            "router": {
                "name": "softmax_topk",
                "balance_loss_weight": aux_loss * top_k,
                "z_loss_weight": 0.0,
                "renormalize": renormalize,
            },
        },
    }, moe_layers


def _moe_layout(moe_layers: list[int], n_layers: int) -> tuple[int, int] | None:
    """``(every_n_layers, first_moe_layer)`` that put MoE blocks exactly at ``moe_layers``, or None."""
    if not moe_layers:
        return None
    first = moe_layers[0]
    every = moe_layers[1] - first if len(moe_layers) > 1 else n_layers  # one MoE block: no second one in range
    return (every, first) if list(range(first, n_layers, every)) == moe_layers else None


def _hidden_options(dim: int, dense_hidden: int, expert_hidden: int) -> dict[str, Any]:
    """MoE options whose rounding gives exactly ``dense_hidden`` (dense blocks) and ``expert_hidden``
    (experts) for ``dim``: ``multiple_of`` the largest power of two up to 256 dividing both, the
    multipliers their ratios."""
    options = swiglu_options_for(dim, dense_hidden)
    multiple_of = options.multiple_of
    while expert_hidden % multiple_of:
        multiple_of //= 2
    multiplier, expert_multiplier = dense_hidden / dim, expert_hidden / dense_hidden
    if (
        swiglu_hidden(dim, multiplier, multiple_of) != dense_hidden
        or swiglu_hidden(dim, multiplier * expert_multiplier, multiple_of) != expert_hidden
    ):  # not seen for any size: swiglu_hidden rounds its quotient to 9 decimals
        raise ForgeError(f"intermediate sizes {dense_hidden} / {expert_hidden} cannot be expressed for dim {dim}.")
    return {"hidden_multiplier": multiplier, "multiple_of": multiple_of, "expert_multiplier": expert_multiplier}


def from_qwen3_moe(hf_config: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
    """``([model] table, Forge state dict)`` of a Qwen3-MoE model (``forge_lm_hf_import``)."""
    tied = "lm_head.weight" not in state or HFConfigReader(hf_config, "Qwen3-MoE").flag("tie_word_embeddings", False)
    table, moe_layers = qwen3_moe_table(hf_config, tied)  # checks the config's fields before the state is read
    return table, _moe_state_from_hf(state, moe_layers, "Qwen3MoeForCausalLM", qwen=True)
