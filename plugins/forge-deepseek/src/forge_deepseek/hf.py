"""Conversion between ``deepseek_v3`` models and Hugging Face's ``DeepseekV3ForCausalLM``, both ways.

Layouts and names:

- attention: MLA's weights under HF's names (:data:`forge_deepseek.hf_names.MLA_NAMES`). Forge
  rotates RoPE pairs half-split; a checkpoint with ``rope_interleave = true`` (DeepSeek's own,
  and HF's default) has the RoPE rows of its query and shared-key projections reordered on
  import (:func:`~forge_deepseek.hf_names.deinterleave`); export writes ``rope_interleave =
  false`` and the rows as they are.
- feed-forward: blocks before ``first_k_dense_replace`` are ``mlp.gate_proj/up_proj/down_proj``;
  MoE blocks ``mlp.gate.weight`` (router), ``mlp.gate.e_score_correction_bias`` (forge-moe's
  ``expert_bias``), ``mlp.experts.<e>.gate_proj/up_proj/down_proj`` (the on-disk layout; import
  also reads transformers 5's fused ``mlp.experts.gate_up_proj``/``down_proj``) and
  ``mlp.shared_experts.*``.
- routing: forge-moe's ``sigmoid_topk`` is HF's router with one expert group
  (``n_group = topk_group = 1``), ``norm_topk_prob = true``. HF multiplies the routed experts'
  weights by ``routed_scaling_factor``; import folds that factor into every routed expert's
  down projection (the layer's output is linear in it, so the logits are unchanged), and export
  writes ``routed_scaling_factor = 1.0``. Group-limited routing (``topk_group < n_group``) and
  un-normalised weights are refused. The router's training settings (bias update rate,
  sequence balance loss weight) have no HF field: export drops them, import takes forge-moe's
  defaults.
- multi-token prediction: HF's ``DeepseekV3ForCausalLM`` has no MTP modules (it ignores their
  weights on load). Export writes them as DeepSeek's checkpoints do, module ``k`` under
  ``model.layers.<n_layers + k>.``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, the
  block's own weights under the usual block names, and copies of the shared embedding and head
  (``embed_tokens``, ``shared_head.head``); ``num_nextn_predict_layers = mtp_depth``. Import
  reads the modules whose weights are present (``mtp_depth`` = their number), so an export
  imports back whole; a checkpoint without them imports with ``mtp_depth = 0``.
- RoPE scaling (YaRN) and its softmax-scale factor are refused: Forge has plain RoPE.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from forge_deepseek.hf_names import MLA_NAMES, mla_from_hf
from forge_deepseek.mla import MultiHeadLatentAttention
from forge_lm.api import HFConfigReader, SwiGLU, swiglu_hidden
from forge_lm.errors import ForgeError
from forge_moe.layer import MoELayer
from forge_moe.routers import SigmoidTopKRouter

_GLOBAL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_BLOCK = {
    **MLA_NAMES,
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight"}
_MTP |= {"norm.weight": "shared_head.norm.weight"}
_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Forge's stacked tensor -> HF's per expert
# What an MTP layer holds besides a block: its own weights (_MTP) and copies of the shared embedding and head.
_MTP_ONLY = {*_MTP.values(), "embed_tokens.weight", "shared_head.head.weight"}


# -- export -------------------------------------------------------------------------------------


def _block_to_hf(prefix: str, block: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in block.state_dict().items():
        expert = re.fullmatch(r"feed_forward\.experts\.(w[123])", name)
        if expert is not None:
            kind = _EXPERTS[expert.group(1)]
            out |= {f"{prefix}mlp.experts.{e}.{kind}.weight": tensor[e] for e in range(tensor.shape[0])}
        elif name in _BLOCK:
            out[f"{prefix}{_BLOCK[name]}"] = tensor
        else:
            raise ForgeError(f"the deepseek_v3 export has no Hugging Face name for '{name}' of a block.")
    return out


def _export_problems(model: nn.Module) -> tuple[list[str], int]:
    """What keeps ``model`` from ``DeepseekV3ForCausalLM``, and its number of leading dense blocks."""
    problems, shapes, n_dense = [], set(), 0
    config = model.config
    if config.norm != "rmsnorm":
        problems.append(f"[model] norm = '{config.norm}' (DeepSeek-V3 uses 'rmsnorm')")
    blocks = [*model.blocks(), *(module.block for module in model.mtp)]
    for i, block in enumerate(blocks):
        attention, ffn = block.attention, block.feed_forward
        if not isinstance(attention, MultiHeadLatentAttention):
            problems.append(f"block {i}'s attention is {type(attention).__name__}, not mla")
        else:
            shapes.add(("attention", *_mla_sizes(attention).values()))
        if isinstance(ffn, SwiGLU) and i < config.n_layers:
            if i != n_dense:
                problems.append(f"block {i} is dense after an MoE block (dense blocks must come first)")
            n_dense += 1
            shapes.add(("dense", ffn.w1.out_features))
        elif isinstance(ffn, MoELayer):
            if not isinstance(ffn.router, SigmoidTopKRouter):
                problems.append(f"block {i}'s router is {type(ffn.router).__name__}, not sigmoid_topk")
            shapes.add(("moe", *_moe_sizes(ffn).values()))
        else:
            problems.append(f"block {i}'s feed-forward is {type(ffn).__name__}, neither SwiGLU nor forge-moe's MoE")
    kinds = [shape[0] for shape in shapes]
    repeated = sorted({kind for kind in kinds if kinds.count(kind) > 1})
    problems += [f"the blocks' {kind} layers differ in size" for kind in repeated]
    return problems, n_dense


def _mla_sizes(attention: MultiHeadLatentAttention) -> dict[str, Any]:
    return {
        "num_attention_heads": attention.n_heads,
        "q_lora_rank": attention.wq_a.out_features if attention.wq_a is not None else None,
        "kv_lora_rank": attention.kv_lora_rank,
        "qk_nope_head_dim": attention.qk_nope_head_dim,
        "qk_rope_head_dim": attention.qk_rope_head_dim,
        "v_head_dim": attention.v_head_dim,
    }


def _moe_sizes(ffn: MoELayer) -> dict[str, int]:
    hidden = ffn.experts.w1.shape[1]
    shared = ffn.shared.w1.out_features if ffn.shared is not None else 0
    return {
        "n_routed_experts": ffn.n_experts,
        "num_experts_per_tok": ffn.top_k,
        "moe_intermediate_size": hidden,
        "n_shared_experts": shared // hidden,
    }


def to_deepseek_v3(model: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json dict, state dict)`` of a ``deepseek_v3`` model (``forge_lm_hf_export``)."""
    problems, n_dense = _export_problems(model)
    if problems:
        raise ForgeError(
            "this deepseek_v3 model has no Hugging Face DeepseekV3ForCausalLM equivalent: " + "; ".join(problems) + "."
        )
    config, blocks = model.config, model.blocks()
    moe = next((block.feed_forward for block in blocks if isinstance(block.feed_forward, MoELayer)), None)
    moe_sizes = _moe_sizes(moe) if moe is not None else {}
    dense_hidden = blocks[0].feed_forward.w1.out_features if n_dense else moe_sizes["moe_intermediate_size"]
    if moe is None:  # HF always reads the MoE fields; with no MoE block they describe nothing
        moe_sizes = {"n_routed_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": 1, "n_shared_experts": 0}
    hf_config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": model.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": dense_hidden,
        "num_hidden_layers": config.n_layers,
        "num_key_value_heads": config.n_heads,  # MLA: every head has its own keys and values
        **_mla_sizes(blocks[0].attention),
        **moe_sizes,
        "first_k_dense_replace": n_dense,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": model.tied,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_interleave": False,  # Forge's half-split RoPE
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": len(model.mtp),
        "bos_token_id": None,
    }
    state = {hf: model.state_dict()[forge] for forge, hf in _GLOBAL.items()}
    if not model.tied:  # safetensors refuses shared tensors; transformers re-ties on load
        state["lm_head.weight"] = model.output.weight
    for i, block in enumerate(blocks):
        state |= _block_to_hf(f"model.layers.{i}.", block)
    for k, module in enumerate(model.mtp):
        prefix = f"model.layers.{config.n_layers + k}."
        state |= {prefix + hf: module.state_dict()[forge] for forge, hf in _MTP.items()}
        state |= _block_to_hf(prefix, module.block)
        # DeepSeek's checkpoints give every MTP layer its own copy of the shared embedding and head.
        state[prefix + "embed_tokens.weight"] = model.tok_embeddings.weight.detach().clone()
        state[prefix + "shared_head.head.weight"] = model.output.weight.detach().clone()
    return hf_config, {name: tensor.detach() for name, tensor in state.items()}


# -- import -------------------------------------------------------------------------------------


def _power_of_two_dividing(*sizes: int) -> int:
    multiple_of = 256
    while any(size % multiple_of for size in sizes):
        multiple_of //= 2
    return multiple_of


def ffn_table(dim: int, dense_hidden: int, expert_hidden: int) -> dict[str, Any]:
    """forge-moe options whose rounding gives exactly ``dense_hidden`` (dense blocks) and
    ``expert_hidden`` (experts) for ``dim``: ``multiple_of`` a power of two dividing both, the
    multipliers their ratios, nudged down where a float product lands just above a multiple."""
    multiple_of = _power_of_two_dividing(dense_hidden, expert_hidden)
    hidden_multiplier = dense_hidden / dim
    while swiglu_hidden(dim, hidden_multiplier, multiple_of) > dense_hidden:
        hidden_multiplier = math.nextafter(hidden_multiplier, 0.0)
    expert_multiplier = expert_hidden / dense_hidden
    while swiglu_hidden(dim, hidden_multiplier * expert_multiplier, multiple_of) > expert_hidden:
        expert_multiplier = math.nextafter(expert_multiplier, 0.0)
    if (
        swiglu_hidden(dim, hidden_multiplier, multiple_of) != dense_hidden
        or swiglu_hidden(dim, hidden_multiplier * expert_multiplier, multiple_of) != expert_hidden
    ):
        raise ForgeError(f"intermediate sizes {dense_hidden} / {expert_hidden} cannot be expressed for dim {dim}.")
    return {"hidden_multiplier": hidden_multiplier, "multiple_of": multiple_of, "expert_multiplier": expert_multiplier}


def _refusals(hf_config: dict[str, Any], read: HFConfigReader) -> list[str]:
    problems = []
    if hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method", "?")
        problems.append(f"quantized weights (quantization_config, {method}): dequantize them first")
    rope = read.table("rope_parameters")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or hf_config.get("rope_scaling"):
        problems.append(f"RoPE scaling '{hf_config.get('rope_scaling') or rope_type}' (Forge has plain RoPE)")
    if hf_config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act '{hf_config['hidden_act']}' (Forge's SwiGLU uses silu)")
    if hf_config.get("attention_bias"):
        problems.append("attention_bias = true (Forge's projections have no bias)")
    n_group, topk_group = hf_config.get("n_group") or 1, hf_config.get("topk_group") or 1
    if topk_group < n_group:
        problems.append(f"group-limited routing (topk_group {topk_group} < n_group {n_group})")
    if hf_config.get("norm_topk_prob", True) is False:
        problems.append("norm_topk_prob = false (forge-moe's sigmoid router normalises the chosen weights)")
    return problems


def model_table(hf_config: dict[str, Any], tied: bool, mtp_depth: int) -> dict[str, Any]:
    """The ``[model]`` table (``name = "deepseek_v3"``) of a DeepSeek-V3 ``config.json``."""
    read = HFConfigReader(hf_config, "DeepseekV3")
    sizes = read.decoder_sizes()
    problems = _refusals(hf_config, read)
    if problems:
        raise ForgeError("this DeepSeek-V3 checkpoint cannot be imported: " + "; ".join(problems) + ".")
    dim = sizes["dim"]
    n_experts = read.positive_int("n_routed_experts", 256)
    top_k = read.positive_int("num_experts_per_tok", 8)
    expert_hidden = read.positive_int("moe_intermediate_size", 2048)
    q_lora_rank = hf_config.get("q_lora_rank")
    return {
        "name": "deepseek_v3",
        "dim": dim,
        "n_layers": sizes["n_layers"],
        "n_heads": sizes["n_heads"],
        "vocab_size": sizes["vocab_size"],
        "max_seq_len": sizes["max_seq_len"],
        "rope_theta": read.rope_theta(10000.0),
        "norm": "rmsnorm",
        "norm_eps": read.positive_number("rms_norm_eps", 1e-6),
        "tie_embeddings": tied,
        "init_std": read.positive_number("initializer_range", 0.02),
        "n_dense_layers": min(hf_config.get("first_k_dense_replace") or 0, sizes["n_layers"]),
        "mtp_depth": mtp_depth,
        "attention": {
            "name": "mla",
            "q_lora_rank": q_lora_rank or 0,
            "kv_lora_rank": read.positive_int("kv_lora_rank", 512),
            "qk_nope_head_dim": read.positive_int("qk_nope_head_dim", 128),
            "qk_rope_head_dim": read.positive_int("qk_rope_head_dim", 64),
            "v_head_dim": read.positive_int("v_head_dim", 128),
        },
        "ffn": {
            "name": "moe",
            "n_experts": n_experts,
            "top_k": top_k,
            **ffn_table(dim, sizes["hidden"], expert_hidden),
            "n_shared_experts": hf_config.get("n_shared_experts") or 0,
            "router": {"name": "sigmoid_topk"},
        },
    }


def _split_layers(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """``(global tensors, {layer index: its tensors by name inside the layer})``."""
    globals_, layers = {}, {}
    for name, tensor in state.items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match is None:
            globals_[name] = tensor
        else:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    return globals_, layers


def _block_from_hf(
    hf: dict[str, torch.Tensor], table: dict[str, Any], *, interleaved: bool, scale: float
) -> dict[str, torch.Tensor]:
    """One block's weights (HF names inside the layer) under Forge's names inside the block;
    ``scale`` (the routed scaling factor) multiplies the routed experts' down projections."""
    attention = table["attention"]
    out = mla_from_hf(
        hf,
        n_heads=table["n_heads"],
        kv_lora_rank=attention["kv_lora_rank"],
        qk_nope_head_dim=attention["qk_nope_head_dim"],
        interleaved=interleaved,
    )
    by_hf = {hf_name: forge for forge, hf_name in _BLOCK.items() if not forge.startswith("attention.")}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in hf.items():
        expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if name in MLA_NAMES.values() or name in _MTP_ONLY or name.endswith("rotary_emb.inv_freq"):
            continue  # converted above, or by the caller; RoPE tables follow from the config
        if name in by_hf:
            out[by_hf[name]] = tensor
        elif expert is not None:
            experts.setdefault(expert.group(2), {})[int(expert.group(1))] = tensor
        elif name == "mlp.experts.gate_up_proj":  # transformers 5's fused in-memory layout
            experts["gate_proj"], experts["up_proj"] = (dict(enumerate(half)) for half in tensor.chunk(2, dim=1))
        elif name == "mlp.experts.down_proj":
            experts["down_proj"] = dict(enumerate(tensor))
        else:  # a weight this conversion would drop: refuse rather than import a different model
            raise ForgeError(
                f"a block weight '{name}' has no Forge equivalent (quantized checkpoints, with their "
                "weight_scale_inv tensors, are not read; dequantize them to bf16 or fp32 first)."
            )
    for forge_kind, hf_kind in _EXPERTS.items():
        if hf_kind in experts:
            by_expert = experts[hf_kind]
            stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
            out[f"feed_forward.experts.{forge_kind}"] = stacked * scale if forge_kind == "w2" else stacked
    return out


def from_deepseek_v3(hf_config: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
    """``([model] table, Forge state dict)`` of a ``DeepseekV3ForCausalLM`` (``forge_lm_hf_import``)."""
    read = HFConfigReader(hf_config, "DeepseekV3")
    n_layers = read.decoder_sizes()["n_layers"]
    globals_, layers = _split_layers(state)
    mtp_layers = sorted(i for i in layers if i >= n_layers and "eh_proj.weight" in layers[i])
    tied = "lm_head.weight" not in globals_ or read.flag("tie_word_embeddings", False)
    table = model_table(hf_config, tied, len(mtp_layers))
    block = {
        "interleaved": hf_config.get("rope_interleave", True) is not False,  # HF's default: interleaved
        "scale": float(hf_config.get("routed_scaling_factor") or 1.0),
    }
    out = {forge: globals_[hf] for forge, hf in _GLOBAL.items() if hf in globals_}
    # A tied model's state dict names the one tensor twice.
    out["output.weight"] = out.get("tok_embeddings.weight") if tied else globals_["lm_head.weight"]
    for i in range(n_layers):
        out |= {f"layers.{i}.{name}": t for name, t in _block_from_hf(layers.get(i, {}), table, **block).items()}
    for k, i in enumerate(mtp_layers):
        hf = layers[i]
        out |= {f"mtp.{k}.{forge}": hf[name] for forge, name in _MTP.items() if name in hf}
        out |= {f"mtp.{k}.block.{name}": t for name, t in _block_from_hf(hf, table, **block).items()}
    return table, out
