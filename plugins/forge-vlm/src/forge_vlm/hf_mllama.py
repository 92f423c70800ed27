"""Conversion between the ``cross_attention`` family (with Mllama's vision tower and a ``llama``
language model) and Hugging Face's ``MllamaForConditionalGeneration``, both ways.

Names: the vision tower's as :data:`VISION_NAMES` and :data:`VISION_LAYER_NAMES` map them; the
language model's blocks are Llama's (``model.language_model.layers.<j>``, where ``j`` counts
self- and cross-attention layers together); each cross-attention layer is Mllama's
``MllamaCrossAttentionDecoderLayer`` at its combined index (:data:`CROSS_NAMES`); the projector
is ``model.multi_modal_projector``. Mllama's embedding has ``vocab_size + 8`` rows, its head
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
    out = {}
    for name, tensor in state.items():
        layer = re.fullmatch(r"(layers|global_layers)\.(\d+)\.(.+)", name)
        if layer is not None and layer.group(3) in VISION_LAYER_NAMES:
            out[f"{_VISION_STACKS[layer.group(1)]}.{layer.group(2)}.{VISION_LAYER_NAMES[layer.group(3)]}"] = tensor
        elif name in VISION_NAMES:
            out[VISION_NAMES[name]] = tensor
        else:
            raise ForgeError(f"the vision tower's '{name}' has no name in Hugging Face's MllamaVisionModel.")
    return out


def vision_from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``MllamaVisionModel``'s state dict under the names of :class:`~forge_vlm.mllama_vision.MllamaVisionTower`."""
    stacks, layer_names, names = _inverse(_VISION_STACKS), _inverse(VISION_LAYER_NAMES), _inverse(VISION_NAMES)
    out = {}
    for name, tensor in state.items():
        layer = re.fullmatch(r"(transformer\.layers|global_transformer\.layers)\.(\d+)\.(.+)", name)
        if layer is not None and layer.group(3) in layer_names:
            out[f"{stacks[layer.group(1)]}.{layer.group(2)}.{layer_names[layer.group(3)]}"] = tensor
        elif name in names:
            out[names[name]] = tensor
        else:
            raise ForgeError(f"the vision weight '{name}' is not part of an Mllama vision tower Forge can import.")
    return out
