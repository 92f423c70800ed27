"""Forge's dense model as Hugging Face's ``LlamaForCausalLM`` or ``Qwen3ForCausalLM``, both ways.

The layouts agree except for names: RoPE uses the same half-split convention (no permutation
of ``wq``/``wk`` rows) and grouped-query heads are grouped the same way. Only models with
RMSNorm and SwiGLU feed-forward layers in every block convert: without QK-norm as Llama, with
it as Qwen3, whose ``q_norm``/``k_norm`` are Forge's QK-norm (one RMSNorm scale over the head
size, shared by the heads, applied before RoPE) and whose ``head_dim`` is Forge's. The
conversions here answer the ``forge_lm_hf_export`` / ``forge_lm_hf_import`` hooks from the
core's built-in plugin ``core.hf_llama``, after every other plugin.

``transformers`` is needed only for :func:`to_hf_config`; it is imported inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from forge_lm.config import ComponentConfig, ModelSection, SwiGLUOptions
from forge_lm.errors import ForgeError
from forge_lm.model.hf.files import read_hf, write_hf
from forge_lm.model.hf.names import rename_from_hf, rename_to_hf
from forge_lm.model.hf_fields import CONFIG_FILE, HFConfigReader, listed, shown
from forge_lm.model.swiglu import SwiGLU

# Llama's own part: the SwiGLU feed-forward, inside block N.
_LLAMA_FFN_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}


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
            raise read.refuse("layer_types", f"layer_types is {shown(kinds)}, not a list")
        windowed = [str(i) for i, kind in enumerate(kinds) if kind != "full_attention"]
        if windowed:
            problems.append(
                f"layer_types is not 'full_attention' at layers {listed(windowed)} (Forge's gqa attention sees the "
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


# -- files ---------------------------------------------------------------------------------------


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
