"""Conversion between the ``cross_attention`` family (with Mllama's vision tower and a ``llama``
language model) and Hugging Face's ``MllamaForConditionalGeneration``, both ways.

Names: the vision tower's as :data:`VISION_NAMES` and :data:`VISION_LAYER_NAMES` map them; the
language model's blocks are Llama's (``model.language_model.layers.<j>``, where ``j`` counts
self- and cross-attention layers together); each cross-attention layer is Mllama's
``MllamaCrossAttentionDecoderLayer`` at its combined index (:data:`CROSS_NAMES`); the projector
is ``model.multi_modal_projector`` (a directory from ``save_pretrained`` has the older names,
``language_model.model.*``, ``vision_model.*``: both are read). Mllama's embedding has ``vocab_size + 8`` rows, its head
``vocab_size``: the 8 rows past the vocabulary (the image marker 128256 among them) are the
family's ``extra_embeddings``.

Behaviour: transformers' Mllama lets text that sees no image yet attend to every image state
(only the feed-forward part is masked); an import sets ``empty_rows = "attend_all"`` so the
logits agree. An export writes the weights whatever ``empty_rows`` is; with ``"zero"`` (Meta's
reference) transformers' logits differ for text before a row's first image marker (and the
text after it, through self-attention) — the README states it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from forge_lm.errors import ForgeError

VISION_NAMES = {
    "patch_embedding.weight": "patch_embedding.weight",
    "class_embedding": "class_embedding",
    "pre_tile.embedding.weight": "pre_tile_positional_embedding.embedding.weight",
    "pre_tile.gate": "pre_tile_positional_embedding.gate",
    "post_tile.embedding.weight": "post_tile_positional_embedding.embedding.weight",
    "post_tile.gate": "post_tile_positional_embedding.gate",
    "positions.gate": "gated_positional_embedding.gate",
    "positions.embedding": "gated_positional_embedding.embedding",
    "positions.tile_embedding.weight": "gated_positional_embedding.tile_embedding.weight",
    "norm_pre.weight": "layernorm_pre.weight",
    "norm_pre.bias": "layernorm_pre.bias",
    "norm_post.weight": "layernorm_post.weight",
    "norm_post.bias": "layernorm_post.bias",
}
VISION_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention_norm.bias": "input_layernorm.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.bias": "post_attention_layernorm.bias",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "fc1.weight": "mlp.fc1.weight",
    "fc1.bias": "mlp.fc1.bias",
    "fc2.weight": "mlp.fc2.weight",
    "fc2.bias": "mlp.fc2.bias",
    "attn_gate": "gate_attn",
    "ffn_gate": "gate_ffn",
}
_VISION_STACKS = {"layers": "transformer.layers", "global_layers": "global_transformer.layers"}


def _inverse(names: dict[str, str]) -> dict[str, str]:
    return {theirs: ours for ours, theirs in names.items()}


def vision_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tower's state dict (Forge's names inside the tower) under ``MllamaVisionModel``'s."""
    return _renamed(
        state, _VISION_STACKS, VISION_LAYER_NAMES, VISION_NAMES,
        "the vision tower's '{}' has no name in Hugging Face's MllamaVisionModel.",
    )  # fmt: skip


def vision_from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``MllamaVisionModel``'s state dict under the names of :class:`~forge_vlm.mllama_vision.MllamaVisionTower`."""
    return _renamed(
        state, _inverse(_VISION_STACKS), _inverse(VISION_LAYER_NAMES), _inverse(VISION_NAMES),
        "the vision weight '{}' is not part of an Mllama vision tower Forge can import.",
    )  # fmt: skip


def _renamed(
    state: dict[str, torch.Tensor],
    stacks: dict[str, str],
    layer_names: dict[str, str],
    names: dict[str, str],
    unknown: str,
) -> dict[str, torch.Tensor]:
    """``state`` renamed one way: a layer's weight by its stack (``stacks``), index and name in
    the layer (``layer_names``), any other weight by ``names``; a name in none is ``unknown``."""
    pattern = re.compile(rf"({'|'.join(map(re.escape, stacks))})\.(\d+)\.(.+)")
    out = {}
    for name, tensor in state.items():
        layer = pattern.fullmatch(name)
        if layer is not None and layer.group(3) in layer_names:
            out[f"{stacks[layer.group(1)]}.{layer.group(2)}.{layer_names[layer.group(3)]}"] = tensor
        elif name in names:
            out[names[name]] = tensor
        else:
            raise ForgeError(unknown.format(name))
    return out


# -- the whole model --------------------------------------------------------------------------

_SELF_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
CROSS_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "wq.weight": "cross_attn.q_proj.weight",
    "wk.weight": "cross_attn.k_proj.weight",
    "wv.weight": "cross_attn.v_proj.weight",
    "wo.weight": "cross_attn.o_proj.weight",
    "q_norm.weight": "cross_attn.q_norm.weight",
    "k_norm.weight": "cross_attn.k_norm.weight",
    "attn_gate": "cross_attn_attn_gate",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "ffn_gate": "cross_attn_mlp_gate",
}
_TEXT = "model.language_model."
EXTRA_ROWS = 8  # Mllama's embedding rows past the vocabulary


def _language_layers(model: Any) -> list[tuple[str, str]]:
    """``(Forge prefix, "self" | "cross")`` of each layer of the language model in Mllama's
    combined order: a wrapped block's layers before it, the block, its layers after it."""
    from forge_vlm.cross_attention import CrossAttendingBlock

    out = []
    for i, block in enumerate(model.language.blocks()):
        if isinstance(block, CrossAttendingBlock):
            out += [(f"language.layers.{i}.cross_before.{k}.", "cross") for k in range(len(block.cross_before))]
            out.append((f"language.layers.{i}.block.", "self"))
            out += [(f"language.layers.{i}.cross_after.{k}.", "cross") for k in range(len(block.cross_after))]
        else:
            out.append((f"language.layers.{i}.", "self"))
    return out


def _export_problems(model: Any) -> list[str]:
    from forge_lm.api import Attention, SwiGLU, Transformer

    problems = []
    if model.config.tower != "mllama":
        problems.append(f"its vision tower is tower = {model.config.tower!r}, not Mllama's ('mllama')")
    language = model.language
    if type(language) is not Transformer:
        problems.append(f"the language model is {type(language).__name__}, not the core's llama")
        return problems
    config = language.config
    if config.norm != "rmsnorm" or config.qk_norm:
        problems.append("the language model needs norm = 'rmsnorm' and no qk_norm")
    for block in language.blocks():
        inner = getattr(block, "block", block)
        if type(inner.attention) is not Attention or not isinstance(inner.feed_forward, SwiGLU):
            problems.append("every language block needs gqa attention and a SwiGLU feed-forward")
            break
    if model.config.extra_token_ids not in (0, EXTRA_ROWS):
        problems.append(f"extra_token_ids = {model.config.extra_token_ids} (Mllama has 8 rows past the vocabulary)")
    return problems


def to_mllama(model: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json dict, state dict)`` of a ``cross_attention`` model as ``MllamaForConditionalGeneration``."""
    problems = _export_problems(model)
    if problems:
        raise ForgeError("this cross_attention model has no Hugging Face Mllama form: " + "; ".join(problems) + ".")
    from forge_vlm.cross_attention import combined_indices

    options, language = model.config, model.language
    config = language.config
    state = model.state_dict()
    out = {f"model.vision_model.{name}": t for name, t in vision_to_hf(model.vision.state_dict()).items()}
    out["model.multi_modal_projector.weight"] = state["projector.weight"]
    out["model.multi_modal_projector.bias"] = state["projector.bias"]
    extra = state.get("extra_embeddings.weight")
    if extra is None:  # rows past the vocabulary that no id of this model reaches: zeros
        extra = state["language.tok_embeddings.weight"].new_zeros(EXTRA_ROWS, config.dim)
    out[f"{_TEXT}embed_tokens.weight"] = torch.cat([state["language.tok_embeddings.weight"], extra])
    out[f"{_TEXT}norm.weight"] = state["language.norm.weight"]
    out["lm_head.weight"] = state["language.output.weight"].clone()
    for j, (prefix, kind) in enumerate(_language_layers(model)):
        names = _SELF_NAMES if kind == "self" else CROSS_NAMES
        for ours, theirs in names.items():
            out[f"{_TEXT}layers.{j}.{theirs}"] = state[prefix + ours]
    vision = options.vision
    blocks = language.blocks()
    ffn = getattr(blocks[0], "block", blocks[0]).feed_forward
    hf_config = {
        "architectures": ["MllamaForConditionalGeneration"],
        "model_type": "mllama",
        "image_token_index": model.image_token_id,
        "text_config": {
            "model_type": "mllama_text_model",
            "vocab_size": model.vocab_size,
            "hidden_size": config.dim,
            "num_hidden_layers": len(blocks) + len(model.places),
            "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.kv_heads,
            "intermediate_size": ffn.w1.out_features,
            "rms_norm_eps": config.norm_eps,
            "max_position_embeddings": config.max_seq_len,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "cross_attention_layers": combined_indices(model.places),
            "tie_word_embeddings": False,
            "initializer_range": config.init_std,
            # The tokenizer's ids are export-hf's to name; a padding id past the embedding would fail to load.
            "eos_token_id": None,
            "pad_token_id": None,
        },
        "vision_config": {
            "model_type": "mllama_vision_model",
            "hidden_size": vision.width,
            "num_hidden_layers": vision.depth,
            "num_global_layers": vision.global_depth,
            "attention_heads": vision.heads,
            "intermediate_size": vision.mlp_dim,
            "vision_output_dim": vision.output_dim,
            "image_size": vision.image_size,
            "patch_size": vision.patch_size,
            "num_channels": vision.channels,
            "norm_eps": vision.norm_eps,
            "max_num_tiles": vision.max_num_tiles,
            "intermediate_layers_indices": list(vision.intermediate_layers),
            "supported_aspect_ratios": [list(r) for r in vision.aspect_ratios],
        },
    }
    return hf_config, {name: tensor.detach() for name, tensor in out.items()}


def _field(table: dict[str, Any], key: str, where: str) -> Any:
    if key not in table:
        raise ForgeError(f"config.json has no {where}.{key}; it is not a complete Mllama config.")
    return table[key]


def mllama_table(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` table (``name = "cross_attention"``) of an Mllama ``config.json``."""
    from forge_lm.api import swiglu_options_for, to_data

    text, vision = hf_config.get("text_config") or {}, hf_config.get("vision_config") or {}
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise ForgeError("config.json's text_config and vision_config must be tables.")
    rope = text.get("rope_parameters") or {"rope_type": "default", "rope_theta": text.get("rope_theta", 500000.0)}
    if rope.get("rope_type", "default") != "default":
        raise ForgeError(f"RoPE scaling '{rope.get('rope_type')}' cannot be imported (Forge has plain RoPE).")
    if text.get("hidden_act", "silu") != "silu" or vision.get("hidden_act", "gelu") != "gelu":
        raise ForgeError("only silu (text) and gelu (vision) activations import.")
    dim = _field(text, "hidden_size", "text_config")
    cross = list(text.get("cross_attention_layers") or [])
    ffn = swiglu_options_for(dim, _field(text, "intermediate_size", "text_config"))
    language = {
        "name": "llama",
        "dim": dim,
        "n_layers": _field(text, "num_hidden_layers", "text_config") - len(cross),
        "n_heads": _field(text, "num_attention_heads", "text_config"),
        "n_kv_heads": text.get("num_key_value_heads"),
        "vocab_size": _field(text, "vocab_size", "text_config"),
        "max_seq_len": _field(text, "max_position_embeddings", "text_config"),
        "rope_theta": float(rope.get("rope_theta", 500000.0)),
        "norm": "rmsnorm",
        "norm_eps": float(text.get("rms_norm_eps", 1e-5)),
        "tie_embeddings": False,
        "init_std": float(text.get("initializer_range", 0.02)),
        "ffn": {"name": "swiglu", **to_data(ffn)},
    }
    vision_table = {
        "image_size": _field(vision, "image_size", "vision_config"),
        "patch_size": _field(vision, "patch_size", "vision_config"),
        "channels": vision.get("num_channels", 3),
        "width": _field(vision, "hidden_size", "vision_config"),
        "depth": _field(vision, "num_hidden_layers", "vision_config"),
        "global_depth": vision.get("num_global_layers", 8),
        "heads": _field(vision, "attention_heads", "vision_config"),
        "mlp_dim": _field(vision, "intermediate_size", "vision_config"),
        "norm_eps": float(vision.get("norm_eps", 1e-5)),
        "max_num_tiles": vision.get("max_num_tiles", 4),
        "aspect_ratios": vision.get("supported_aspect_ratios") or [list(r) for r in _default_ratios()],
        "intermediate_layers": list(vision.get("intermediate_layers_indices") or [3, 7, 15, 23, 30]),
    }
    return {
        "name": "cross_attention",
        "language": language,
        "vision": vision_table,
        "image_token_id": hf_config.get("image_token_index", 128256),
        "cross_attention_layers": cross,
        "empty_rows": "attend_all",  # transformers' Mllama: see the module docstring
        "extra_token_ids": EXTRA_ROWS,
    }


def _default_ratios() -> tuple[tuple[int, int], ...]:
    from forge_vlm.mllama_options import MLLAMA_ASPECT_RATIOS

    return MLLAMA_ASPECT_RATIOS


# save_pretrained writes Mllama's weights under its older names (transformers renames them when
# loading): those prefixes, and the names a loaded model's state_dict() has.
_SAVED_PREFIXES = {
    "language_model.model.": "model.language_model.",
    "language_model.lm_head.": "lm_head.",
    "vision_model.": "model.vision_model.",
    "multi_modal_projector.": "model.multi_modal_projector.",
}


def _loaded_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under the names of a loaded model, whichever of the two schemes it uses."""
    if f"{_TEXT}embed_tokens.weight" in state:
        return state
    out = {}
    for name, tensor in state.items():
        prefix = next((p for p in _SAVED_PREFIXES if name.startswith(p)), None)
        out[_SAVED_PREFIXES[prefix] + name[len(prefix) :] if prefix is not None else name] = tensor
    return out


def from_mllama(hf_config: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
    """``([model] table, Forge state dict)`` of an ``MllamaForConditionalGeneration`` (its state
    dict as a loaded model has it, or as ``save_pretrained`` writes it)."""
    from forge_vlm.cross_attention import placement

    state = _loaded_names(state)
    table = mllama_table(hf_config)
    language, vocab = table["language"], table["language"]["vocab_size"]
    places = placement(language["n_layers"], None, table["cross_attention_layers"])
    vision = {
        name[len("model.vision_model.") :]: t for name, t in state.items() if name.startswith("model.vision_model.")
    }
    out = {f"vision.{name}": t for name, t in vision_from_hf(vision).items()}
    embed = _weight(state, f"{_TEXT}embed_tokens.weight")
    if embed.shape[0] != vocab + EXTRA_ROWS:
        raise ForgeError(f"embed_tokens has {embed.shape[0]} rows; Mllama's has vocab_size + 8 = {vocab + EXTRA_ROWS}.")
    out["language.tok_embeddings.weight"] = embed[:vocab]
    out["extra_embeddings.weight"] = embed[vocab:]
    out["language.norm.weight"] = _weight(state, f"{_TEXT}norm.weight")
    out["language.output.weight"] = state.get("lm_head.weight", embed[:vocab])
    out["projector.weight"] = _weight(state, "model.multi_modal_projector.weight")
    out["projector.bias"] = _weight(state, "model.multi_modal_projector.bias")
    wrapped = {block for block, _ in places}
    combined = sorted(table["cross_attention_layers"])
    self_index, cross_seen = 0, {block: {"before": 0, "after": 0} for block in wrapped}
    for j in range(language["n_layers"] + len(combined)):
        theirs = f"{_TEXT}layers.{j}."
        if j in combined:
            block, where = places[combined.index(j)]
            prefix = f"language.layers.{block}.cross_{where}.{cross_seen[block][where]}."
            cross_seen[block][where] += 1
            names = CROSS_NAMES
        else:
            block = self_index
            self_index += 1
            prefix = f"language.layers.{block}." + ("block." if block in wrapped else "")
            names = _SELF_NAMES
        for ours, hf_name in names.items():
            out[prefix + ours] = _weight(state, theirs + hf_name)
    return table, out


def _weight(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise ForgeError(f"the checkpoint has no '{name}'; it is not a complete MllamaForConditionalGeneration.")
    return state[name]
