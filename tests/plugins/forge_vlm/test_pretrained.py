"""``forge_lm.load_pretrained`` of a llava run (the 12-step configs/vlm_debug.toml run):
``model(input_ids, pixel_values=images)`` with images laid out as transformers' processors give
them (``[num_images, C, H, W]``, the image token at each feature position) gives the logits of
the tower, projector and language model run by hand, of the training batches' layout, and of
transformers' Llava loading the run's ``forge export-hf`` (which load_pretrained reads too)."""

from __future__ import annotations

import pytest
import torch

import forge_lm
from forge_lm.cli._main import main

IMAGE_TOKEN, TOKENS_PER_IMAGE = 259, 16


@pytest.fixture(scope="module")
def loaded(trained_debug_run, vlm_manager):
    model, tokenizer = forge_lm.load_pretrained(trained_debug_run, plugins=vlm_manager)
    return model, tokenizer


@pytest.fixture(scope="module")
def inputs():
    """Two rows, one image each at different places; images as a processor gives them."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 40), generator=generator)
    ids[0, 2 : 2 + TOKENS_PER_IMAGE] = IMAGE_TOKEN
    ids[1, 20 : 20 + TOKENS_PER_IMAGE] = IMAGE_TOKEN
    return ids, torch.randn(2, 3, 16, 16, generator=generator)


def test_the_loaded_model_takes_images_as_processors_give_them(loaded, inputs):
    model, tokenizer = loaded
    assert not model.training
    assert tokenizer.decode(tokenizer.encode("a cat")) == "a cat"
    ids, pixels = inputs
    with torch.no_grad():
        got = model(ids, pixel_values=pixels)
        features = model.projector(model.vision(pixels))  # [2, 16, dim]: the tower and projector by hand
        h = model.language.embed(ids)
        h[0, 2:18], h[1, 20:36] = features[0], features[1]
        expected = model.language.forward_embeddings(h)
        # the training batches' layout: [B, max_images, C, H, W] with a mask of real images
        slots, mask = torch.stack([pixels, torch.zeros_like(pixels)], 1), torch.tensor([[True, False]] * 2)
        batched = model(ids, pixel_values=slots, image_mask=mask)
        other = model(ids, pixel_values=-pixels)  # other images: other logits after them
    assert got.shape == (2, 40, 260)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(batched, got)
    assert not torch.allclose(other[0, 18:], got[0, 18:])
    torch.testing.assert_close(other[1, :20], got[1, :20])  # causal: the text before row 1's image is unchanged


def test_the_exported_run_gives_the_same_logits_in_transformers(
    trained_debug_run, loaded, inputs, tmp_path, vlm_manager
):
    from transformers import LlavaForConditionalGeneration

    model, _ = loaded
    ids, pixels = inputs
    assert main(["export-hf", str(trained_debug_run), str(tmp_path / "hf"), "--plugins=vlm"]) == 0
    reference = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    again, _ = forge_lm.load_pretrained(tmp_path / "hf", plugins=vlm_manager)  # the export read back
    with torch.no_grad():
        expected = reference(input_ids=ids, pixel_values=pixels).logits
        got = model(ids, pixel_values=pixels)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(again(ids, pixel_values=pixels), expected, atol=1e-4, rtol=1e-4)
