"""Conversion between Forge's dense model and Hugging Face's ``LlamaForCausalLM`` or
``Qwen3ForCausalLM``, both ways, and the weight renaming every Hugging Face decoder of Forge's
shape shares.

The layouts agree except for names: RoPE uses the same half-split convention (no permutation
of ``wq``/``wk`` rows) and grouped-query heads are grouped the same way. Only models with
RMSNorm and SwiGLU feed-forward layers in every block convert: without QK-norm as Llama, with
it as Qwen3, whose ``q_norm``/``k_norm`` are Forge's QK-norm (one RMSNorm scale over the head
size, shared by the heads, applied before RoPE) and whose ``head_dim`` is Forge's.

:func:`rename_to_hf` and :func:`rename_from_hf` rename what Llama, Qwen3 and the MoE formats
(through forge-moe) share: embeddings, attention (QK-norm included), norms, head and the
per-layer prefixes; each format passes a function for its own feed-forward weights. ``forge
export-hf`` and ``forge import-hf`` convert only through the ``forge_lm_hf_export`` /
``forge_lm_hf_import`` hooks (:func:`export_with_plugins`, :func:`import_with_plugins`); the
conversions here answer them from the core's built-in plugin ``core.hf_llama``, after every
other plugin.

``transformers`` is needed only for :func:`to_hf_config`; export and import need ``safetensors``
(the core's ``hf`` extra). Both are imported inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from forge_lm.config import ComponentConfig, ModelSection
from forge_lm.default_plugins.feed_forwards import SwiGLUOptions
from forge_lm.errors import ForgeError
from forge_lm.model.hf_fields import CONFIG_FILE, HFConfigReader
from forge_lm.model.swiglu import SwiGLU
from forge_lm.plugins import PluginHookFailed
from forge_lm.run_links import LinkInRunDir

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"  # sharded checkpoints, as save_pretrained writes them

# Forge name <-> HF name of what every decoder of Forge's shape shares: outside the blocks,
# and inside block N (after the prefixes "layers.N." and "model.layers.N.").
_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # QK-norm (Qwen3)
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Llama's own part: the SwiGLU feed-forward, inside block N.
_LLAMA_FFN_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_FORGE_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_IGNORED = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")  # old checkpoints kept it

FeedForwardRenamer = Callable[[int, str, torch.Tensor], dict[str, torch.Tensor] | None]
"""``(block index, name inside the block, tensor) -> {name inside the block on the other side:
tensor}``, or None for a name the format does not know. It may return several tensors (one
stacked Forge tensor is one HF tensor per expert, and back) or none yet (it keeps the pieces
and the caller assembles them after the renaming)."""


# -- renaming shared by every format --------------------------------------------------------


def rename_to_hf(
    state: Mapping[str, torch.Tensor], feed_forward: FeedForwardRenamer, *, architecture: str
) -> dict[str, torch.Tensor]:
    """``state`` (a Forge state dict) under the Hugging Face names of ``architecture``
    (``"LlamaForCausalLM"``, for messages): the shared parts renamed here, each block's other
    weights (its feed-forward) by ``feed_forward``. Tensors are passed on, not copied; a name
    that neither knows is refused."""
    return _rename(
        state,
        feed_forward,
        (_GLOBAL_NAMES, _BLOCK_NAMES, _FORGE_LAYER, "model.layers"),
        lambda name: f"parameter '{name}' has no Hugging Face {architecture} counterpart.",
    )


def rename_from_hf(
    state: Mapping[str, torch.Tensor], feed_forward: FeedForwardRenamer, *, architecture: str
) -> dict[str, torch.Tensor]:
    """A Hugging Face ``architecture`` state dict under Forge's names: the inverse of
    :func:`rename_to_hf`. RoPE's cached ``inv_freq`` (kept by old checkpoints) is skipped.

    Without ``lm_head.weight`` (tied checkpoints omit it) the head is the embedding tensor,
    which loads correctly into tied and untied Forge models alike.
    """
    out = _rename(
        {name: tensor for name, tensor in state.items() if not _HF_IGNORED.fullmatch(name)},
        feed_forward,
        (_FORGE_GLOBAL_NAMES, _FORGE_BLOCK_NAMES, _HF_LAYER, "layers"),
        lambda name: f"weight '{name}' is not part of a {architecture} that Forge can import.",
    )
    if "tok_embeddings.weight" not in out:
        raise ForgeError(f"the checkpoint has no model.embed_tokens.weight; it is not a complete {architecture}.")
    out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


_FORGE_GLOBAL_NAMES = {hf: forge for forge, hf in _GLOBAL_NAMES.items()}
_FORGE_BLOCK_NAMES = {hf: forge for forge, hf in _BLOCK_NAMES.items()}


def _rename(
    state: Mapping[str, torch.Tensor],
    feed_forward: FeedForwardRenamer,
    names: tuple[dict[str, str], dict[str, str], re.Pattern[str], str],
    refusal: Callable[[str], str],
) -> dict[str, torch.Tensor]:
    """One direction of the renaming; ``names`` is (outside the blocks, inside a block, the
    pattern of a block's name with its index, the other side's block prefix)."""
    global_names, block_names, layer, prefix = names
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in global_names:
            out[global_names[name]] = tensor
            continue
        match = layer.fullmatch(name)
        renamed = None
        if match is not None:
            index, inside = int(match.group(1)), match.group(2)
            renamed = {block_names[inside]: tensor} if inside in block_names else feed_forward(index, inside, tensor)
        if renamed is None:
            raise ForgeError(refusal(name))
        out.update({f"{prefix}.{index}.{other}": other_tensor for other, other_tensor in renamed.items()})
    return out


def _llama_ffn_to_hf(index: int, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    return {_LLAMA_FFN_NAMES[name]: tensor} if name in _LLAMA_FFN_NAMES else None


_LLAMA_FFN_FROM_HF = {hf: forge for forge, hf in _LLAMA_FFN_NAMES.items()}


def _llama_ffn_from_hf(index: int, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    return {_LLAMA_FFN_FROM_HF[name]: tensor} if name in _LLAMA_FFN_FROM_HF else None


# -- configs ------------------------------------------------------------------------------------


def _dense_problems(config: ModelSection, name: str) -> list[str]:
    """The settings of ``config`` that the dense Hugging Face decoder ``name`` cannot express,
    QK-norm aside (Llama has none, Qwen3 always has it)."""
    problems = []
    if config.norm != "rmsnorm":
        problems.append(f"[model] norm = '{config.norm}' ({name} uses 'rmsnorm')")
    if config.ffn.name.rpartition(":")[2] != "swiglu":
        problems.append(f"[model.ffn] name = '{config.ffn.name}' ({name} uses 'swiglu')")
    if config.attention.name.rpartition(":")[2] != "gqa":
        attention = config.attention.name
        problems.append(f"[model.attention] name = '{attention}' ({name} uses 'gqa', full causal attention)")
    return problems


def check_llama_compatible(config: ModelSection) -> None:
    """Raise a :class:`ForgeError` naming every setting that Hugging Face Llama cannot express."""
    problems = _dense_problems(config, "Llama")
    if config.qk_norm:
        problems.insert(
            0,
            "[model] qk_norm = true (Llama has no QK-norm; such a model's equivalent is Qwen3ForCausalLM, which "
            "forge export-hf writes)",
        )
    if problems:
        raise ForgeError(
            "this model has no Hugging Face LlamaForCausalLM equivalent: " + "; ".join(problems) + ". "
            "Only rmsnorm + gqa + swiglu models convert (with qk_norm = true as Qwen3ForCausalLM); keep them in "
            "Forge's own checkpoint format."
        )


def check_qwen3_compatible(config: ModelSection) -> None:
    """Raise a :class:`ForgeError` naming every setting that Hugging Face Qwen3 cannot express."""
    problems = _dense_problems(config, "Qwen3")
    if not config.qk_norm:
        problems.insert(0, "[model] qk_norm = false (Qwen3 always normalises queries and keys; the model is a Llama)")
    if problems:
        raise ForgeError(
            "this model has no Hugging Face Qwen3ForCausalLM equivalent: " + "; ".join(problems) + ". "
            "Only rmsnorm + qk_norm + gqa + swiglu models convert to Qwen3."
        )


def decoder_config_fields(config: ModelSection, vocab_size: int, ffn_hidden: int) -> dict[str, Any]:
    """The ``config.json`` fields every Hugging Face decoder of Forge's shape shares (Llama,
    and Mixtral through forge-moe): sizes, heads, norm, RoPE, tying."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps,
        # transformers >= 5 reads rope_parameters; earlier releases read rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": "float32",
    }


def hf_config_dict(
    config: ModelSection,
    vocab_size: int,
    ffn_hidden: int,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of the equivalent ``LlamaForCausalLM`` (written without needing transformers)."""
    check_llama_compatible(config)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_config_fields(config, vocab_size, ffn_hidden),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


# The config.json fields of Forge's attention in Qwen3 and Qwen3-MoE: no biases, no sliding
# window (every layer attends to the whole sequence).
QWEN3_ATTENTION_FIELDS = {"attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False}


def qwen3_config_dict(
    config: ModelSection,
    vocab_size: int,
    ffn_hidden: int,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of the equivalent ``Qwen3ForCausalLM`` (a model with QK-norm)."""
    check_qwen3_compatible(config)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **decoder_config_fields(config, vocab_size, ffn_hidden),
        **QWEN3_ATTENTION_FIELDS,
        "sliding_window": None,
        "max_window_layers": config.n_layers,
        "layer_types": ["full_attention"] * config.n_layers,
        "rope_scaling": None,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def to_hf_config(config: ModelSection, vocab_size: int, ffn_hidden: int, **token_ids: int | None) -> Any:
    """A ``transformers.LlamaConfig`` for ``config`` (``token_ids``: optional ``bos_id``, ``eos_id``)."""
    import transformers

    fields = hf_config_dict(config, vocab_size, ffn_hidden, **token_ids)
    for key in ("architectures", "model_type", "rope_theta", "rope_scaling", "torch_dtype"):
        fields.pop(key)
    return transformers.LlamaConfig(**fields)


def model_section_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``ModelSection(**fields)`` equivalent to a Llama ``config.json``; refuses what Forge cannot
    express, and a field that is missing or holds a wrong type or value (naming it)."""
    kind = hf_config.get("model_type")
    if kind != "llama":
        raise ForgeError(f"config.json has model_type '{kind}'; only Hugging Face Llama ('llama') models import.")
    return _dense_section_fields(HFConfigReader(hf_config, "Llama"), qk_norm=False)


def qwen3_section_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``ModelSection(**fields)`` equivalent to a Qwen3 ``config.json`` (QK-norm on, its
    ``head_dim``), refusing what Forge cannot express as :func:`model_section_fields` does."""
    kind = hf_config.get("model_type")
    if kind != "qwen3":
        raise ForgeError(f"config.json has model_type '{kind}'; this reads Hugging Face Qwen3 ('qwen3') models.")
    return _dense_section_fields(HFConfigReader(hf_config, "Qwen3"), qk_norm=True)


def qwen3_attention_problems(read: HFConfigReader, n_layers: int, max_seq_len: int, *, per_layer: bool) -> list[str]:
    """What Forge's attention cannot express in a Qwen3 (``per_layer``: its ``layer_types`` or
    ``max_window_layers`` choose the windowed layers) or Qwen3-MoE (every layer windowed)
    ``config.json``: attention biases, and sliding-window layers whose window is shorter than
    the longest sequence."""
    problems = []
    if read.flag("attention_bias", False):
        problems.append("attention_bias = true (Forge's attention has no biases)")
    kinds = read.config.get("layer_types") if per_layer else None
    if kinds is not None:
        if not isinstance(kinds, list):
            raise read.refuse("layer_types", f"layer_types is {_shown(kinds)}, not a list")
        windowed = [str(i) for i, kind in enumerate(kinds) if kind != "full_attention"]
        if windowed:
            problems.append(
                f"layer_types is not 'full_attention' at layers {_listed(windowed)} (Forge's gqa attention sees the "
                "whole sequence in every layer)"
            )
        return problems
    window = read.positive_int("sliding_window", None) if read.flag("use_sliding_window", False) else None
    first = read.non_negative_number("max_window_layers", 28) if per_layer else 0
    if window is not None and window < max_seq_len and first < n_layers:
        problems.append(
            f"use_sliding_window = true with sliding_window {window} from layer {int(first)} on (Forge's gqa attention "
            "sees the whole sequence in every layer)"
        )
    return problems


def _dense_section_fields(read: HFConfigReader, *, qk_norm: bool) -> dict[str, Any]:
    """The fields shared by :func:`model_section_fields` (Llama) and :func:`qwen3_section_fields`."""
    hf_config = read.config
    sizes = read.decoder_sizes(explicit_head_dim=True)
    rope = read.table("rope_parameters")
    fields = {
        "rope_theta": read.rope_theta(10000.0),
        "norm_eps": read.positive_number("rms_norm_eps", 1e-6),
        "init_std": read.positive_number("initializer_range", 0.02),
        "tie_embeddings": read.flag("tie_word_embeddings", False),
    }
    problems = []
    if hf_config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act '{hf_config['hidden_act']}' (Forge's swiglu uses silu)")
    for key in ("mlp_bias",) if qk_norm else ("attention_bias", "mlp_bias"):  # Qwen3's attention_bias: below
        if hf_config.get(key):
            problems.append(f"{key} = true (Forge's layers have no biases)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or hf_config.get("rope_scaling"):
        problems.append(f"RoPE scaling '{hf_config.get('rope_scaling') or rope_type}' (Forge has plain RoPE)")
    if qk_norm:
        problems += qwen3_attention_problems(read, sizes["n_layers"], sizes["max_seq_len"], per_layer=True)
    if problems:
        raise ForgeError(f"this {read.architecture} checkpoint cannot be imported: " + "; ".join(problems) + ".")
    dim = sizes["dim"]
    return {
        "dim": dim,
        "n_layers": sizes["n_layers"],
        "n_heads": sizes["n_heads"],
        "n_kv_heads": sizes["n_kv_heads"],
        **({"head_dim": sizes["head_dim"]} if sizes["head_dim"] is not None else {}),
        "vocab_size": sizes["vocab_size"],
        "max_seq_len": sizes["max_seq_len"],
        "rope_theta": fields["rope_theta"],
        "norm": "rmsnorm",
        "norm_eps": fields["norm_eps"],
        "qk_norm": qk_norm,
        "tie_embeddings": fields["tie_embeddings"],
        "init_std": fields["init_std"],
        "ffn": ComponentConfig("swiglu", swiglu_options_for(dim, sizes["hidden"])),
    }


def swiglu_options_for(dim: int, hidden: int) -> SwiGLUOptions:
    """SwiGLU options whose rounding gives exactly ``hidden`` for ``dim``: multiplier ``hidden / dim``,
    ``multiple_of`` the largest power of two up to 256 dividing ``hidden``."""
    multiple_of = 256
    while hidden % multiple_of:
        multiple_of //= 2
    return SwiGLUOptions(hidden_multiplier=hidden / dim, multiple_of=multiple_of)


# -- state dicts --------------------------------------------------------------------------------


def swiglu_hidden_of(model: nn.Module) -> int:
    """The SwiGLU hidden size shared by every block of ``model``; refuses other feed-forward layers."""
    sizes = set()
    for i, layer in enumerate(model.layers):
        ffn = layer.feed_forward
        if not isinstance(ffn, SwiGLU):
            raise ForgeError(
                f"layer {i}'s feed-forward is {type(ffn).__name__}, not SwiGLU; only swiglu models convert to "
                "Hugging Face Llama."
            )
        sizes.add(ffn.w1.out_features)
    if len(sizes) != 1:
        raise ForgeError(f"the blocks' SwiGLU hidden sizes differ ({sorted(sizes)}); Llama needs one size.")
    return sizes.pop()


def to_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under ``LlamaForCausalLM``'s names (``lm_head.weight`` included even when tied,
    as in the HF model's own state dict); tensors are shared with the model, not copied."""
    check_llama_compatible(model.config)
    swiglu_hidden_of(model)
    return rename_to_hf(model.state_dict(), _llama_ffn_to_hf, architecture="LlamaForCausalLM")


def from_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict under Forge's names, ready for ``Transformer.load_state_dict``.

    Without ``lm_head.weight`` (tied checkpoints omit it) the head is the embedding tensor, which
    loads correctly into tied and untied Forge models alike.
    """
    return rename_from_hf(state, _llama_ffn_from_hf, architecture="LlamaForCausalLM")


# -- the core's answers to the conversion hooks (default_plugins/hf_llama.py) ---------------------


def dense_export(
    model: nn.Module, config: ModelSection, *, bos_id: int | None = None, eos_id: int | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """The core's dense model as Hugging Face knows it: :func:`qwen3_export` with QK-norm,
    :func:`llama_export` without; None for a model that is not the core's dense model."""
    if getattr(config, "qk_norm", False):
        return qwen3_export(model, config, bos_id=bos_id, eos_id=eos_id)
    return llama_export(model, config, bos_id=bos_id, eos_id=eos_id)


def _is_core_dense(model: nn.Module) -> bool:
    """Whether ``model`` is the core's own Transformer with SwiGLU in every block; another
    family (a subclass of Transformer included) converts itself through its plugin."""
    from forge_lm.model.transformer import Transformer

    return type(model) is Transformer and all(isinstance(layer.feed_forward, SwiGLU) for layer in model.layers)


def _dense_state(model: nn.Module, config: ModelSection, architecture: str) -> dict[str, torch.Tensor]:
    """``model``'s weights under ``architecture``'s names, a tied head stored once, as the
    embedding: safetensors refuses shared tensors, and transformers re-ties on load."""
    state = rename_to_hf(model.state_dict(), _llama_ffn_to_hf, architecture=architecture)
    if config.tie_embeddings:
        del state["lm_head.weight"]
    return state


def llama_export(
    model: nn.Module, config: ModelSection, *, bos_id: int | None = None, eos_id: int | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """``(config.json dict, LlamaForCausalLM state dict)`` of a model whose every block has the
    core's SwiGLU feed-forward, or None for any other model (another plugin's to convert).

    A model that has those blocks but something Llama cannot express (LayerNorm, QK-norm) is
    refused with a :class:`ForgeError` naming each setting.
    """
    if not _is_core_dense(model):
        return None
    check_llama_compatible(config)
    hf_config = hf_config_dict(config, model.vocab_size, swiglu_hidden_of(model), bos_id=bos_id, eos_id=eos_id)
    return hf_config, _dense_state(model, config, "LlamaForCausalLM")


def qwen3_export(
    model: nn.Module, config: ModelSection, *, bos_id: int | None = None, eos_id: int | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """``(config.json dict, Qwen3ForCausalLM state dict)`` of the core's dense model with
    QK-norm, or None for a model that is not the core's dense model; what Qwen3 cannot express
    (LayerNorm, a sliding window) is refused naming each setting."""
    if not _is_core_dense(model):
        return None
    hf_config = qwen3_config_dict(config, model.vocab_size, swiglu_hidden_of(model), bos_id=bos_id, eos_id=eos_id)
    return hf_config, _dense_state(model, config, "Qwen3ForCausalLM")


def dense_import(
    hf_config: dict[str, Any], state: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """:func:`llama_import` or :func:`qwen3_import`, by the checkpoint's ``model_type``; None
    for any other model type."""
    if hf_config.get("model_type") == "qwen3":
        return qwen3_import(hf_config, state)
    return llama_import(hf_config, state)


def llama_import(
    hf_config: dict[str, Any], state: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """``([model] table as plain data, Forge state dict)`` of a ``model_type = "llama"``
    checkpoint, or None for any other model type. A Llama that Forge cannot express, or a
    ``config.json`` missing fields or holding wrong types, is refused with a :class:`ForgeError`."""
    if hf_config.get("model_type") != "llama":
        return None
    return _dense_import(model_section_fields, hf_config, state, "Llama")


def qwen3_import(
    hf_config: dict[str, Any], state: dict[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """As :func:`llama_import`, for a ``model_type = "qwen3"`` checkpoint (``Qwen3ForCausalLM``)."""
    if hf_config.get("model_type") != "qwen3":
        return None
    return _dense_import(qwen3_section_fields, hf_config, state, "Qwen3")


def _dense_import(
    section_fields: Callable[[dict[str, Any]], dict[str, Any]],
    hf_config: dict[str, Any],
    state: dict[str, torch.Tensor],
    name: str,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    try:
        fields = section_fields(hf_config)  # checks each field it reads, naming it
    except (LookupError, TypeError, ValueError, ArithmeticError, AttributeError) as exc:  # what a check missed
        raise ForgeError(
            f"{CONFIG_FILE} does not describe a {name} model Forge can import: {type(exc).__name__}: {exc}"
        ) from None
    if "lm_head.weight" not in state:
        fields["tie_embeddings"] = True
    ffn = fields.pop("ffn")
    from forge_lm.config import to_data

    table = {**fields, "ffn": {"name": ffn.name, **to_data(ffn.options)}}
    return table, rename_from_hf(state, _llama_ffn_from_hf, architecture=f"{name}ForCausalLM")


# -- files --------------------------------------------------------------------------------------


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ForgeError(
            "Hugging Face export and import need the safetensors package: pip install 'forge-lm[hf]'"
        ) from exc
    return safetensors.torch


def write_hf(out_dir: str | Path, hf_config: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    """Write a Hugging Face model directory: ``config.json`` and ``model.safetensors``.

    Neither is written through a link: a link at either name is refused (before anything is
    written), and the weights are written beside their place and renamed over it."""
    st = _safetensors()
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in state.items()}
    out = make_export_dir(out_dir)
    refuse_export_links(out, (CONFIG_FILE, WEIGHTS_FILE))
    write_export_file(out / CONFIG_FILE, (json.dumps(hf_config, indent=2) + "\n").encode("utf-8"))
    fd, partial = tempfile.mkstemp(prefix=f".{WEIGHTS_FILE}.", suffix=".partial", dir=out)
    os.close(fd)
    try:
        st.save_file(tensors, partial, metadata={"format": "pt"})
        os.chmod(partial, _new_file_mode())  # safetensors writes 0600; give it config.json's usual mode
        os.replace(partial, out / WEIGHTS_FILE)  # replaces the name: never writes through what was there
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
    return out


def check_export_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a path, refused when it is there and is not a directory."""
    out = Path(out_dir)
    if os.path.lexists(out) and not out.is_dir():
        raise ForgeError(
            f"'{out}' exists and is not a directory; give a directory to export into (a new one, or one of yours "
            "that holds no export)."
        )
    return out


def make_export_dir(out_dir: str | Path) -> Path:
    """``out_dir``, created if missing; a path that is there and is not a directory is refused."""
    out = check_export_dir(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:  # a level above it is a file
        raise ForgeError(f"cannot create the export directory '{out}': {exc.strerror}: '{exc.filename}'.") from None
    return out


def write_export_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` without following a link there (``O_NOFOLLOW``, as
    :func:`forge_lm.run_links.open_to_write`), a new file getting the mode ``open()`` gives one:
    an export is the user's files, not a run's."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    with os.fdopen(os.open(path, flags, 0o666), "wb") as file:
        file.write(data)


def refuse_export_links(out: Path, names: Iterable[str]) -> None:
    """Refuse (:class:`LinkInRunDir`, exit 2) the first of ``out``'s entries ``names`` that is a link."""
    for name in sorted(set(names)):
        path = out / name
        if os.path.islink(path):
            try:
                target = f" (to '{os.readlink(path)}')"
            except OSError:
                target = ""
            raise LinkInRunDir(
                f"'{path}' is a symbolic link{target}; an export does not write through links, so that it never "
                f"writes outside '{out}'. Remove the link, or export into another directory."
            )


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 less the process's umask."""
    try:  # Linux reports the umask without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read it by setting it, then put it back
    os.umask(mask)
    return 0o666 & ~mask


def read_hf(hf_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json as a dict, Hugging Face state dict)`` of a model directory."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ForgeError(f"'{hf_dir}' has no {CONFIG_FILE}; give a directory written by save_pretrained or export_hf.")
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ForgeError(f"'{config_path}' is not a JSON object; it is not a model's config.")
    return config, _read_weights(hf_dir)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ForgeError(f"'{path}' is not valid JSON: {exc}") from None


def _checked_conversion(converted: Any, hook: str, shape: str, plugin: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``plugin``'s conversion hook returned, if it has the documented shape."""
    if not (
        isinstance(converted, tuple)
        and len(converted) == 2
        and all(isinstance(part, dict) and all(isinstance(k, str) for k in part) for part in converted)
    ):
        raise ForgeError(
            f"{plugin.label} returned {type(converted).__name__} from {hook}, not {shape}. This is a bug in the "
            f"plugin: report it to its authors, or run without it (--block-plugin {plugin.name})."
        )
    return converted


def _first_answer(manager: Any, hook: str, **kwargs: Any) -> tuple[Any, Any] | None:
    """``(plugin, result)`` of the first plugin whose ``hook`` answers, as ``manager.call_first``
    asks them (a converter's :class:`ForgeError` passes through), or None."""
    results = manager._call_each(hook, lambda _: kwargs, first=True, passes=(ForgeError,))
    return results[0] if results else None


def _askers(manager: Any, hook: str) -> str:
    """The plugins implementing ``hook``, in the order they are asked, for messages."""
    names = [impl.plugin_name for impl in reversed(getattr(manager.hook, hook).get_hookimpls())]
    return ", ".join(manager.plugin(name).label for name in names) or "none"


def export_with_plugins(
    manager: Any, model: nn.Module, config: ModelSection, out_dir: str | Path, *, eos_id: int | None = None
) -> Path:
    """Export through the first plugin that converts ``model`` (``forge_lm_hf_export``; the
    core's Llama conversion is asked last). Refuses a model that no installed plugin converts."""
    answer = _first_answer(manager, "forge_lm_hf_export", model=model, config=config)
    if answer is None:
        ffn = getattr(config, "ffn", None)
        made_of = (
            f"its feed-forward is [model.ffn] name = '{ffn.name}'"
            if ffn is not None
            else f"it is a {type(model).__name__} of another model family"
        )
        raise ForgeError(
            f"this model has no Hugging Face equivalent that an installed plugin writes: {made_of}, and no "
            "plugin's forge_lm_hf_export converts it (asked: "
            f"{_askers(manager, 'forge_lm_hf_export')}). Keep it in Forge's own checkpoint format, or install "
            "the plugin that converts such models."
        )
    plugin, converted = answer
    hf_config, state = _checked_conversion(converted, "forge_lm_hf_export", "(config.json dict, HF state dict)", plugin)
    return write_hf(out_dir, {**hf_config, "eos_token_id": eos_id}, state)


# What a [model] table from forge_lm_hf_import must state itself (Forge's defaults are no
# model's sizes): each a positive integer.
IMPORTED_SIZES = ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len")


def sized_table(table: dict[str, Any]) -> dict[str, Any]:
    """The table of an imported ``[model]`` that states the sizes: the table itself, or, for a
    family that nests its language model (a vision-language model's ``[model.language]``) and
    states none of them at its own level, that one."""
    nested = table.get("language")
    if isinstance(nested, dict) and not any(key in table for key in IMPORTED_SIZES):
        return nested
    return table


@dataclass(frozen=True)
class HFImport:
    """A Hugging Face model directory converted by a plugin's ``forge_lm_hf_import``: the
    ``[model]`` table, the Forge state dict, the plugin that converted it (its ``label`` and
    ``name`` for messages) and the ``config.json`` it was read from."""

    table: dict[str, Any]
    state: dict[str, torch.Tensor]
    plugin: Any
    config_path: Path


def convert_from_hf(manager: Any, hf_dir: str | Path) -> HFImport:
    """The model of ``hf_dir`` through the first plugin that understands its model type
    (``forge_lm_hf_import``; the core's Llama conversion is asked last). Refuses a model type
    that no installed plugin imports, and a plugin's answer that is not a usable table and
    state dict (naming the plugin)."""
    hf_config, hf_state = read_hf(hf_dir)
    try:
        answer = _first_answer(manager, "forge_lm_hf_import", hf_config=hf_config, state=hf_state)
    except PluginHookFailed:
        raise
    except ForgeError as exc:
        # A converter sees the contents of the directory, not where it is: name it here.
        raise ForgeError(f"'{hf_dir}': {exc}") from None
    config_path = Path(hf_dir) / CONFIG_FILE
    if answer is None:
        from forge_lm.plugins._hints import KNOWN_HF_MODEL_TYPES

        kind = hf_config.get("model_type")
        provider = KNOWN_HF_MODEL_TYPES.get(kind) if isinstance(kind, str) else None
        fix = (
            f"The package {provider} converts it: pip install {provider} (or enable it if it is installed)"
            if provider is not None
            else "Install the plugin that converts that model type"
        )
        raise ForgeError(
            f"'{config_path}' has model_type {kind!r}, which no installed plugin imports (asked: "
            f"{_askers(manager, 'forge_lm_hf_import')}). {fix}; forge list-plugins shows what is installed."
        )
    plugin, converted = answer
    table, state = _checked_conversion(converted, "forge_lm_hf_import", "([model] table, Forge state dict)", plugin)
    sizes = sized_table(table)
    problems = [f"no {key}" for key in IMPORTED_SIZES if key not in sizes]
    problems += [
        f"{key} = {_shown(sizes[key])}, not a positive integer"
        for key in (*IMPORTED_SIZES, "n_kv_heads")
        if key in sizes and not (key == "n_kv_heads" and sizes[key] is None) and not _positive_int(sizes[key])
    ]
    not_tensors = [name for name, value in state.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        problems.append(f"state entries that are not tensors: {_listed(not_tensors)}")
    if problems:
        raise ForgeError(
            f"{plugin.label} converted '{config_path}' with forge_lm_hf_import into an unusable [model] table or "
            f"state dict: {'; '.join(problems)}. This is a bug in the plugin: report it to its authors, or run "
            f"without it (--block-plugin {plugin.name})."
        )
    return HFImport(table, state, plugin, config_path)


def import_with_plugins(manager: Any, hf_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``([model] table, Forge state dict)`` of ``hf_dir``, as :func:`convert_from_hf` converts it."""
    imported = convert_from_hf(manager, hf_dir)
    return imported.table, imported.state


def state_mismatches(expected: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> list[str]:
    """How ``state`` differs from ``expected`` (a built model's state dict) in names and shapes,
    one line each; empty when it loads into that model."""
    problems = [f"{name} is missing" for name in expected if name not in state]
    problems += [f"{name} is not a weight of the model" for name in state if name not in expected]
    problems += [
        f"{name} is {list(state[name].shape)}, the model's is {list(tensor.shape)}"
        for name, tensor in expected.items()
        if name in state and state[name].shape != tensor.shape
    ]
    return problems


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _listed(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    st = _safetensors()
    try:
        return st.load_file(path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for a damaged file
        raise ForgeError(f"'{path}' is not a readable safetensors file: {exc}") from None


def export_hf(
    model: nn.Module,
    config: ModelSection,
    out_dir: str | Path,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face Llama model: ``out_dir/config.json`` and ``model.safetensors``.

    Loadable with ``transformers.LlamaForCausalLM.from_pretrained(out_dir)``. A tied head is
    stored once (as the embedding), as Hugging Face does. Returns ``out_dir``. Refuses a model
    without a Llama equivalent, naming each setting in the way.
    """
    check_llama_compatible(config)  # names the [model] settings, before any layer is looked at
    converted = llama_export(model, config, bos_id=bos_id, eos_id=eos_id)
    if converted is None:
        swiglu_hidden_of(model)  # raises, naming the first block whose feed-forward is not SwiGLU
    return write_hf(out_dir, *converted)


def load_hf(hf_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a Hugging Face Llama directory: ``(ModelSection fields, Forge state dict)``.

    Reads ``config.json`` and ``model.safetensors`` (or the shards of
    ``model.safetensors.index.json``). Build the model with
    ``build_model(ModelSection(**fields), fields["vocab_size"], registry)`` and load the state.
    """
    hf_config, state = read_hf(hf_dir)
    fields = model_section_fields(hf_config)
    if "lm_head.weight" not in state:
        fields["tie_embeddings"] = True
    return fields, from_hf_state_dict(state)


def _read_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    if (hf_dir / WEIGHTS_FILE).is_file():
        return _load_safetensors(hf_dir / WEIGHTS_FILE)
    index = hf_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        listing = _read_json(index)
        weight_map = listing.get("weight_map") if isinstance(listing, dict) else None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ForgeError(f"'{index}' has no weight_map of tensor names to shard files.")
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            path = hf_dir / shard
            # A shard is a file of this directory: never a path out of it, never a link.
            if Path(shard).name != shard or shard.startswith(".") or path.is_symlink() or not path.is_file():
                raise ForgeError(f"'{index}' names the shard {shard!r}, which is not a file in '{hf_dir}'.")
            state.update(_load_safetensors(path))
        return state
    raise ForgeError(
        f"'{hf_dir}' has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}; only safetensors weights import "
        "(re-save a .bin checkpoint with save_pretrained(safe_serialization=True))."
    )
