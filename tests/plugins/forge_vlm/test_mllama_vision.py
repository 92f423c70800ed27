"""Mllama's tiled vision tower against transformers' MllamaVisionModel (tiny random config, fp32)."""

from __future__ import annotations

import pytest
import torch

from forge_lm.errors import ForgeError
from forge_lm.model.init import initialize
from forge_vlm.hf_mllama import vision_from_hf, vision_to_hf
from forge_vlm.mllama_options import MllamaVisionOptions
from forge_vlm.mllama_vision import MllamaVisionTower

ATOL = 1e-5
RATIOS = ((1, 1), (1, 2), (2, 1), (2, 2))


def tiny_options() -> MllamaVisionOptions:
    # 16 / 4: 16 patches + the class token = 17 positions, padded to 24 (Mllama pads to 8).
    return MllamaVisionOptions(
        image_size=16,
        patch_size=4,
        width=32,
        depth=3,
        global_depth=2,
        heads=4,
        mlp_dim=48,
        max_num_tiles=4,
        aspect_ratios=RATIOS,
        intermediate_layers=(2, 0),
    )


def hf_tower(options: MllamaVisionOptions):
    from transformers import MllamaVisionConfig, MllamaVisionModel

    config = MllamaVisionConfig(
        hidden_size=options.width,
        num_hidden_layers=options.depth,
        num_global_layers=options.global_depth,
        attention_heads=options.heads,
        intermediate_size=options.mlp_dim,
        vision_output_dim=options.output_dim,
        image_size=options.image_size,
        patch_size=options.patch_size,
        max_num_tiles=options.max_num_tiles,
        intermediate_layers_indices=list(options.intermediate_layers),
        supported_aspect_ratios=[list(r) for r in options.aspect_ratios],
    )
    config._attn_implementation = "eager"
    return MllamaVisionModel(config).eval()


@pytest.fixture(scope="module")
def towers():
    """Forge's tower with random weights (gates opened) and transformers' holding the same."""
    options = tiny_options()
    torch.manual_seed(0)
    ours = MllamaVisionTower(options)
    initialize(ours, 0, std=0.2, residual_std=0.1)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "gate" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.2)
            elif name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    theirs = hf_tower(options)
    theirs.load_state_dict(vision_to_hf(ours.state_dict()), strict=True)
    return ours.eval(), theirs


def inputs(images: int = 3):
    generator = torch.Generator().manual_seed(2)
    pixels = torch.randn(images, 4, 3, 16, 16, generator=generator)
    ids = torch.tensor([1, 4, 2][:images])  # 1 tile, 4 tiles, 2 tiles
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]][:images])
    return pixels, ids, mask


def test_matches_transformers_mllama_vision_model(towers):
    ours, theirs = towers
    pixels, ids, mask = inputs()
    with torch.no_grad():
        got = ours(pixels, ids, mask)
        # transformers takes [batch, images, tiles, C, H, W]: one batch row holding all three.
        expected = theirs(pixels[None], ids[None], mask[None]).last_hidden_state[0]
    assert got.shape == (3, 4, 17, 32 * 3)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


def test_names_round_trip_through_transformers(towers):
    ours, theirs = towers
    back = vision_from_hf(theirs.state_dict())
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in ours.state_dict().items())


def test_wrong_tile_layout_is_named(towers):
    ours, _ = towers
    pixels, ids, mask = inputs()
    with pytest.raises(ForgeError, match=r"pixel_values \[images, 4, 3, 16, 16\]"):
        ours(pixels[:, :2], ids, mask)
    with pytest.raises(ForgeError, match=r"aspect_ratio_ids must be 0 \.\. 4"):
        ours(pixels, torch.tensor([1, 5, 2]), mask)
