"""Llava interop: a tiny random transformers LlavaForConditionalGeneration (CLIP and SigLIP
towers, a Llama text model) imported gives transformers' logits within 1e-4 (fp32) for the same
pixel_values and ids; the imported model exported loads in transformers with the same logits."""

from __future__ import annotations

import pytest
import torch

from forge_lm.config import structure_config
from forge_lm.errors import ForgeError
from forge_lm.model import build_model
from forge_lm.model.hf import convert_from_hf, export_with_plugins

from .conftest import randomize, tiny_clip_vision, tiny_siglip_vision

IMAGE_TOKEN = 99


def _tiny_llava(vision, select: str, layer: int):
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=layer,
        vision_feature_select_strategy=select,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomize(LlavaForConditionalGeneration(config).eval(), seed=4)


def _inputs(tokens_per_image: int):
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, IMAGE_TOKEN, (2, 40), generator=generator)
    ids[0, 3 : 3 + tokens_per_image] = IMAGE_TOKEN  # one image in each row, at different places
    ids[1, 10 : 10 + tokens_per_image] = IMAGE_TOKEN
    pixels = torch.randn(2, 3, 16, 16, generator=generator)  # [num_images, C, H, W], as processors give them
    return ids, pixels


CASES = [
    pytest.param(tiny_clip_vision(num_hidden_layers=3), "default", -2, 16, id="clip"),
    pytest.param(tiny_siglip_vision(), "full", -1, 16, id="siglip"),
]


@pytest.mark.parametrize(("vision", "select", "layer", "tokens"), CASES)
def test_import_then_export_gives_transformers_logits(vision, select, layer, tokens, tmp_path, vlm_manager):
    from transformers import LlavaForConditionalGeneration

    reference = _tiny_llava(vision, select, layer)
    reference.save_pretrained(tmp_path / "hf")
    imported = convert_from_hf(vlm_manager, tmp_path / "hf")
    config = structure_config({"model": imported.table, "train": {"seq_len": 64}}, vlm_manager.registry)
    model = build_model(config.model, 100, vlm_manager.registry).eval()
    model.load_state_dict(imported.state)
    assert model.config.tokens_per_image == tokens
    ids, pixels = _inputs(tokens)
    with torch.no_grad():
        expected = reference(input_ids=ids, pixel_values=pixels).logits
        got = model(ids, pixel_values=pixels)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    out = export_with_plugins(vlm_manager, model, config.model.options, tmp_path / "exported")
    again = LlavaForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids, pixel_values=pixels).logits, got, atol=1e-4, rtol=1e-4)


def test_a_list_of_feature_layers_is_refused_naming_it(tmp_path, vlm_manager):
    reference = _tiny_llava(tiny_clip_vision(), "default", -2)
    reference.config.vision_feature_layer = [-2, -1]
    reference.save_pretrained(tmp_path / "hf")
    with pytest.raises(ForgeError, match=r"vision_feature_layer = \[-2, -1\]"):
        convert_from_hf(vlm_manager, tmp_path / "hf")
