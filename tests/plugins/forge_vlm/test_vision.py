"""The ViT tower against transformers' CLIP and SigLIP vision models (weights loaded from them,
fp32, every hidden state within 1e-5), its meta-device build, checkpoint loading and refusals."""

from __future__ import annotations

import pytest
import torch

from forge_lm.errors import ForgeError
from forge_lm.model.init import initialize, materialize
from forge_vlm.options import ViTOptions
from forge_vlm.vision import VisionTower, _rotate, hf_vision_state, options_from_hf_vision, rope_2d_tables

from .conftest import randomize, tiny_clip_vision, tiny_siglip_vision


def _reference(config):
    from transformers import CLIPVisionModel, SiglipVisionModel

    cls = SiglipVisionModel if "siglip" in config.model_type else CLIPVisionModel
    torch.manual_seed(0)
    return randomize(cls(config).eval())


def _tower_of(hf_model, config) -> VisionTower:
    options = options_from_hf_vision(config.to_dict(), feature_layer=-1, feature_select="full")
    tower = VisionTower(options)
    missing, unexpected = tower.load_state_dict(hf_vision_state(hf_model.state_dict(), "", options), strict=False)
    assert not unexpected
    assert not [m for m in missing if not m.startswith("rope_")]
    return tower.eval()


@pytest.mark.parametrize("config", [tiny_clip_vision(), tiny_siglip_vision()], ids=["clip", "siglip"])
def test_every_hidden_state_matches_transformers(config):
    hf_model = _reference(config)
    tower = _tower_of(hf_model, config)
    pixels = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(pixel_values=pixels, output_hidden_states=True).hidden_states
        got = tower.hidden_states(pixels)
    assert len(got) == len(expected) == config.num_hidden_layers + 1
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_llava_feature_selection_drops_the_class_token_of_the_chosen_layer():
    config = tiny_clip_vision(num_hidden_layers=3)
    hf_model = _reference(config)
    options = options_from_hf_vision(config.to_dict(), feature_layer=-2, feature_select="default")
    tower = VisionTower(options)
    tower.load_state_dict(hf_vision_state(hf_model.state_dict(), "", options))
    assert len(tower.blocks) == 2  # the last block cannot change layer -2's features: not built
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
        got = tower(pixels)
    assert got.shape == (2, options.tokens_per_image, 32) == (2, 16, 32)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_meta_build_then_materialize_equals_a_direct_build():
    options = ViTOptions(image_size=16, patch_size=4, width=32, depth=2, heads=4, positions="rope2d")
    direct = VisionTower(options)
    direct.config = _Stds()
    initialize(direct, seed=3)
    with torch.device("meta"):
        meta = VisionTower(options)
    meta.config = _Stds()
    materialize(meta, torch.device("cpu"), seed=3)
    for (name, a), (_, b) in zip(direct.state_dict().items(), meta.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    pixels = torch.randn(1, 3, 16, 16)
    torch.testing.assert_close(direct(pixels), meta(pixels))


class _Stds:
    init_std = 0.02
    n_layers = 2


def test_rope2d_scores_depend_on_relative_position_only():
    options = ViTOptions(image_size=16, patch_size=4, width=32, depth=1, heads=2, positions="rope2d", class_token=False)
    cos, sin = rope_2d_tables(options)
    q = torch.randn(1, 1, 1, 16).expand(1, 1, 16, 16)
    k = torch.randn(1, 1, 1, 16).expand(1, 1, 16, 16)
    scores = _rotate(q, cos, sin)[0, 0] @ _rotate(k, cos, sin)[0, 0].T  # [16 positions, 16 positions]
    grid = options.grid

    def at(r, c):
        return r * grid + c

    # (0,0)->(1,2) and (2,1)->(3,3): the same offset, the same score; another offset, another score.
    torch.testing.assert_close(scores[at(0, 0), at(1, 2)], scores[at(2, 1), at(3, 3)])
    torch.testing.assert_close(scores[at(3, 0), at(1, 1)], scores[at(2, 2), at(0, 3)])
    assert not torch.isclose(scores[at(0, 0), at(1, 2)], scores[at(0, 0), at(2, 1)])


def test_checkpoint_on_disk_starts_the_tower_and_a_misfit_is_named(tmp_path):
    config = tiny_siglip_vision()
    hf_model = _reference(config)
    hf_model.save_pretrained(tmp_path / "siglip")
    options = options_from_hf_vision(config.to_dict(), feature_layer=-1, feature_select="full")
    tower = VisionTower(options, checkpoint=str(tmp_path / "siglip"))
    tower.config = _Stds()
    initialize(tower, seed=0)
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = hf_model(pixel_values=pixels, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(tower.eval()(pixels), expected, atol=1e-5, rtol=1e-5)

    wider = VisionTower(ViTOptions(**{**_fields(options), "width": 64}), checkpoint=str(tmp_path / "siglip"))
    wider.config = _Stds()
    with pytest.raises(ForgeError, match=r"does not fit \[model.vision\].*patch_embedding.weight \[32, 3, 4, 4\]"):
        initialize(wider, seed=0)
    with pytest.raises(ForgeError, match=r"holds no \*\.safetensors"):
        initialize(_with_checkpoint(options, tmp_path), seed=0)


def _fields(options: ViTOptions) -> dict:
    import attrs

    return attrs.asdict(options)


def _with_checkpoint(options: ViTOptions, path) -> VisionTower:
    tower = VisionTower(options, checkpoint=str(path))
    tower.config = _Stds()
    return tower


def test_images_of_the_wrong_size_or_mode_are_refused():
    tower = VisionTower(ViTOptions(image_size=16, patch_size=4, width=32, depth=1, heads=4))
    with pytest.raises(ForgeError, match=r"shape \[2, 3, 32, 32\].*\[num_images, 3, 16, 16\]"):
        tower(torch.zeros(2, 3, 32, 32))
    with pytest.raises(ForgeError, match=r"shape \[2, 1, 16, 16\]"):  # a greyscale image is 1 channel
        tower(torch.zeros(2, 1, 16, 16))
    with pytest.raises(ForgeError, match=r"dtype torch\.uint8"):
        tower(torch.zeros(2, 3, 16, 16, dtype=torch.uint8))
