"""The cross_attention family with forge-vlm's ViT (``[model] tower = "vit"``): the cross-attention
layers read the projected ViT features of each image, seen by the text from its marker on
(against the tower, the projector and the masks computed by hand; test_mllama checks both pixel
layouts); what the ViT cannot take, [model.vision] keys of the other tower and an Mllama export
are refused, named."""

from __future__ import annotations

import pytest
import torch

from forge_lm.config import load_config, structure_config
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.model import build_model
from forge_vlm.hf_mllama import to_mllama
from forge_vlm.options import ViTOptions
from forge_vlm.vision import VisionTower

from .test_mllama import LANGUAGE, VIT, VOCAB, batch, open_gates

STATES = 16  # 4 x 4 patches; the class token dropped (feature_select "default")


def build(manager, **fields):
    table = {"name": "cross_attention", "tower": "vit", "language": LANGUAGE, "vision": VIT, "every_n_blocks": 2}
    config = structure_config({"model": {**table, **fields}, "train": {"seq_len": 32}}, manager.registry)
    return build_model(config.model, VOCAB, manager.registry, seed=0).eval()


@pytest.fixture(scope="module")
def model(vlm_manager):
    model = build(vlm_manager)
    open_gates(model)
    return model


def test_the_tower_is_the_vit_of_model_vision(model):
    assert isinstance(model.vision, VisionTower)
    assert model.config.vision == ViTOptions(**VIT)
    assert model.projector.in_features == 32  # the ViT's width
    assert all(block in model.blocks() for block in model.vision.blocks)  # FSDP2 and checkpointing units


def test_text_attends_to_the_projected_vit_features_from_its_marker_on(model):
    ids, pixels, image_mask = batch()  # row 0: one image (marker at 2); row 1: two (markers at 0 and 6)
    with torch.no_grad():
        got = model(ids, pixel_values=pixels, image_mask=image_mask)
        # By hand: every slot's features through the tower and projector, and who sees what.
        states = model.projector(model.vision(pixels.flatten(0, 1))).reshape(2, 2 * STATES, -1)
        markers = [[2], [0, 6]]
        visible = torch.zeros(2, ids.shape[1], 2 * STATES, dtype=torch.bool)
        for row, places in enumerate(markers):
            for image, place in enumerate(places):
                visible[row, place:, image * STATES : (image + 1) * STATES] = True
        model.feed.set(states, visible)
        expected = model.language(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    with torch.no_grad():
        text = model(ids)
    assert torch.equal(got[0, :2], text[0, :2])  # before row 0's marker: the language model alone
    assert not torch.allclose(got[0, 2:], text[0, 2:], atol=1e-4)


def test_tiles_and_images_of_another_size_are_refused(model):
    ids, pixels, image_mask = batch()
    with pytest.raises(ForgeError, match="the ViT tower \\(tower = 'vit'\\) takes one tile per image"):
        model(ids, pixel_values=pixels[:, :, None], aspect_ratio_ids=image_mask.long(), aspect_ratio_mask=None)
    with pytest.raises(ForgeError, match=r"the vision tower takes images \[num_images, 3, 16, 16\]"):
        model(ids, pixel_values=pixels[..., :8, :8], image_mask=image_mask)


def test_the_other_towers_keys_and_an_unknown_tower_are_named(vlm_manager):
    with pytest.raises(ConfigError, match=r"\[model.vision\] global_depth: unknown key for model family "):
        load_config(
            None,
            ["--model.name=cross_attention", "--model.tower=vit", "--model.vision.global_depth=2"],
            vlm_manager.registry,
        )
    with pytest.raises(ConfigError, match="with tower = 'vit'"):
        load_config(
            None,
            ["--model.name=cross_attention", "--model.tower=vit", "--model.vision.global_depth=2"],
            vlm_manager.registry,
        )
    with pytest.raises(ConfigError, match=r"\[model\] tower: must be one of 'mllama', 'vit', got 'clip'"):
        load_config(None, ["--model.name=cross_attention", "--model.tower=clip"], vlm_manager.registry)
    with pytest.raises(ConfigError, match=r"\[model.vision\] patch_size: image_size \(16\) must be divisible"):
        load_config(
            None,
            [
                "--model.name=cross_attention",
                "--model.tower=vit",
                "--model.vision.image_size=16",
                "--model.vision.patch_size=5",
            ],
            vlm_manager.registry,
        )


def test_a_vit_model_has_no_mllama_form(model):
    with pytest.raises(ForgeError, match="its vision tower is tower = 'vit', not Mllama's"):
        to_mllama(model)
