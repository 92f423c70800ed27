"""Hugging Face ``LlavaForConditionalGeneration`` to and from the ``llava`` family.

The language part goes through the core's Llama conversion (:mod:`forge_lm.model.hf`); the
vision tower (CLIP or SigLIP) through :func:`forge_vlm.vision.hf_vision_state`; the projector
keeps its names. Both naming schemes transformers uses are read (``model.language_model.*``,
``model.vision_tower.*`` in memory; ``language_model.model.*``, ``vision_tower.*`` in the
files ``save_pretrained`` writes); the export writes the second, as ``save_pretrained`` does.

The exported tower holds the blocks Forge built (those the features need) with
``vision_feature_layer = -1``: transformers computes the same features, without the blocks
after them that it would run for nothing. Refused, naming the setting: a list of feature
layers, a projector or tower activation Forge lacks, a 2-D rotary tower (Llava's towers have
learned positions), a language model other than the core's Llama.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from forge_lm.api import llama_export, llama_import
from forge_lm.errors import ForgeError
from forge_vlm.vision import hf_vision_state, options_from_hf_vision

_ACTIVATIONS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh"}
_HF_ACTIVATIONS = {forge: hf for hf, forge in _ACTIVATIONS.items()}


def _prefix_before(state: dict[str, torch.Tensor], suffix: str, what: str) -> str:
    found = [name[: -len(suffix)] for name in state if name.endswith(suffix)]
    if len(found) != 1:
        raise ForgeError(f"the checkpoint holds {len(found)} {what} ('...{suffix}'); a Llava holds one.")
    return found[0]


def from_llava(hf_config: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``([model] table, Forge state dict)`` of a Llava ``config.json`` and its weights."""
    text, vision = hf_config.get("text_config"), hf_config.get("vision_config")
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise ForgeError("config.json has no text_config and vision_config tables; it is not a complete Llava.")
    if text.get("model_type", "llama") != "llama":
        raise ForgeError(
            f"the Llava's text model is a '{text.get('model_type')}'; forge-vlm imports Llava with a Llama text model."
        )
    layer = hf_config.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ForgeError(f"vision_feature_layer = {layer!r}: forge-vlm takes the features of one layer (an integer).")
    select = hf_config.get("vision_feature_select_strategy", "default")
    if select not in ("default", "full"):
        raise ForgeError(f"vision_feature_select_strategy = {select!r}: 'default' or 'full'.")
    projector_act = hf_config.get("projector_hidden_act", "gelu")
    if projector_act not in _ACTIVATIONS:
        raise ForgeError(f"projector_hidden_act = {projector_act!r}: forge-vlm has {', '.join(_ACTIVATIONS)}.")
    image_token = hf_config.get("image_token_id", hf_config.get("image_token_index"))
    if not isinstance(image_token, int) or isinstance(image_token, bool) or image_token < 0:
        raise ForgeError(f"image_token_id = {image_token!r}: an id of the vocabulary.")
    options = options_from_hf_vision(vision, layer, select)

    text_prefix = _prefix_before(state, "embed_tokens.weight", "token embeddings")  # "language_model.model."
    head = [name for name in state if name.endswith("lm_head.weight")]
    text_state = {"model." + name[len(text_prefix) :]: t for name, t in state.items() if name.startswith(text_prefix)}
    if head:
        text_state["lm_head.weight"] = state[head[0]]
    text_table, language_state = llama_import({**text, "model_type": "llama"}, text_state)

    vision_prefix = _prefix_before(state, "embeddings.patch_embedding.weight", "vision towers")
    vision_state = hf_vision_state(state, vision_prefix, options)
    projector_prefix = _prefix_before(state, "multi_modal_projector.linear_1.weight", "projectors")
    projector_prefix += "multi_modal_projector."
    projector = {
        "projector." + name.removeprefix(projector_prefix): t
        for name, t in state.items()
        if name.startswith(projector_prefix)
    }
    table = {
        "name": "llava",
        "image_token_id": image_token,
        "projector_bias": bool(hf_config.get("multimodal_projector_bias", True)),
        "projector_activation": _ACTIVATIONS[projector_act],
        "language": {"name": "llama", **text_table},
        "vision": {k: v for k, v in attrs.asdict(options).items() if v is not None},
    }
    forge_state = {
        **{f"language.{name}": t for name, t in language_state.items()},
        **{f"vision.{name}": t for name, t in vision_state.items()},
        **projector,
    }
    return table, forge_state


def to_llava(model: Any, eos_id: int | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json dict, state dict)`` of a ``llava`` model, as ``save_pretrained`` writes a Llava."""
    options = model.config
    vision = options.vision
    if vision.positions != "learned":
        raise ForgeError(
            "[model.vision] positions = 'rope2d' has no Hugging Face Llava equivalent (CLIP and SigLIP towers learn "
            "their positions); keep this model in Forge's format."
        )
    answer = llama_export(model.language, model.language.config)
    if answer is None:
        raise ForgeError(
            f"the llava's language model ({type(model.language).__name__}, [model.language] name = "
            f"'{options.language.name}') is not the core's Llama; only a Llama language model exports to Llava."
        )
    text_config, text_state = answer
    siglip = not vision.class_token
    if siglip == vision.pre_norm or siglip != vision.patch_bias:
        raise ForgeError(
            "[model.vision] is neither CLIP's layout (class_token, pre_norm, no patch_bias) nor SigLIP's (none of "
            "the three but patch_bias); transformers has no such tower."
        )
    blocks = len(model.vision.blocks)
    vision_config = {
        "model_type": "siglip_vision_model" if siglip else "clip_vision_model",
        "hidden_size": vision.width,
        "intermediate_size": vision.hidden_dim,
        "num_hidden_layers": blocks,
        "num_attention_heads": vision.heads,
        "num_channels": vision.channels,
        "image_size": vision.image_size,
        "patch_size": vision.patch_size,
        "hidden_act": _HF_ACTIVATIONS[vision.activation],
        "layer_norm_eps": vision.norm_eps,
        **({"vision_use_head": False} if siglip else {}),
    }
    hf_config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": {k: v for k, v in text_config.items() if k != "architectures"},
        "vision_config": vision_config,
        "image_token_id": model.image_token_id,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": vision.feature_select,
        "projector_hidden_act": _HF_ACTIVATIONS[options.projector_activation],
        "multimodal_projector_bias": options.projector_bias,
        "image_seq_length": vision.tokens_per_image,
        "tie_word_embeddings": bool(text_config.get("tie_word_embeddings", False)),
        "torch_dtype": "float32",
    }
    state: dict[str, torch.Tensor] = {}
    for name, tensor in text_state.items():
        state[name.replace("model.", "language_model.model.", 1) if name.startswith("model.") else name] = tensor
    if "lm_head.weight" in state:
        state["language_model.lm_head.weight"] = state.pop("lm_head.weight")
    for name, tensor in model.vision.state_dict().items():
        if name.startswith("rope_"):
            continue
        hf_name = name.replace("blocks.", "encoder.layers.", 1) if name.startswith("blocks.") else name
        state[f"vision_tower.{hf_name}"] = tensor
    # Llava never reads the tower's final norm; written as the identity so that nothing loads at random.
    state["vision_tower.post_layernorm.weight"] = torch.ones(vision.width)
    state["vision_tower.post_layernorm.bias"] = torch.zeros(vision.width)
    for name, tensor in model.projector.state_dict().items():
        state[f"multi_modal_projector.{name}"] = tensor
    return hf_config, {name: tensor.detach().contiguous() for name, tensor in state.items()}
