"""The llava family: image features land exactly at the image tokens (checked against the
tower and projector run by hand), bad input is refused naming the problem, a language family
without embed / forward_embeddings is refused naming it, training stages freeze their parts,
and the meta-device build equals a direct one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forge_lm.config import structure_config
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.model import build_model
from forge_lm.model.init import materialize

IMAGE = 63
MODEL = {
    "name": "llava",
    "image_token_id": IMAGE,
    "language": {"name": "llama", "dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 64, "max_seq_len": 64},
    "vision": {"image_size": 16, "patch_size": 8, "width": 32, "depth": 2, "heads": 4, "mlp_dim": 48},
}  # 4 patches + class token, the class token dropped: 4 image tokens per image


def _config(manager, **model):
    return structure_config({"model": {**MODEL, **model}, "train": {"seq_len": 32}}, manager.registry)


@pytest.fixture(scope="module")
def llava(vlm_manager):
    return build_model(_config(vlm_manager).model, 64, vlm_manager.registry, seed=0).eval()


def _ids(*image_starts_per_row):
    ids = torch.arange(40, 40 + 16).repeat(len(image_starts_per_row), 1) % 60
    for row, starts in enumerate(image_starts_per_row):
        for start in starts:
            ids[row, start : start + 4] = IMAGE
    return ids


def test_features_replace_the_image_token_embeddings_in_order(llava):
    ids = _ids([2], [5, 10])
    pixels = torch.randn(2, 2, 3, 16, 16)
    mask = torch.tensor([[True, False], [True, True]])
    with torch.no_grad():
        got = llava(ids, pixel_values=pixels, image_mask=mask)
        features = llava.projector(llava.vision(pixels[mask]))  # the three real images, in order
        h = llava.language.tok_embeddings(ids)
        h[0, 2:6], h[1, 5:9], h[1, 10:14] = features[0], features[1], features[2]
        expected = llava.language.forward_embeddings(h)
        # the processors' layout (images concatenated over the batch) gives the same logits
        flat = llava(ids, pixel_values=pixels[mask])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(flat, got)


def test_text_only_batches_are_the_language_model_alone(llava):
    ids = _ids([])
    with torch.no_grad():
        torch.testing.assert_close(llava(ids), llava.language(ids))


def test_bad_input_is_refused_naming_the_problem(llava):
    with pytest.raises(ForgeError, match="more images than image markers: 2 images"):
        llava(_ids([2]), pixel_values=torch.randn(2, 3, 16, 16))
    with pytest.raises(ForgeError, match="image markers without an image: 1 images"):
        llava(_ids([2, 8]), pixel_values=torch.randn(1, 3, 16, 16))
    with pytest.raises(ForgeError, match=r"4 image tokens .* but no pixel_values"):
        llava(_ids([2]))
    with pytest.raises(ForgeError, match=r"pixel_values of shape \[1, 3, 32, 32\]"):
        llava(_ids([2]), pixel_values=torch.randn(1, 3, 32, 32))
    with pytest.raises(ForgeError, match=r"pixel_values of shape \[1, 4, 16, 16\]"):  # RGBA: 4 channels
        llava(_ids([2]), pixel_values=torch.randn(1, 4, 16, 16))


def test_a_language_family_that_cannot_run_from_embeddings_is_refused_naming_it(vlm_manager, monkeypatch):
    from forge_lm.model import transformer

    class Opaque(nn.Module):  # a third party's family without embed / forward_embeddings
        def __init__(self, options):
            super().__init__()
            self.config = options
            self.w = nn.Linear(2, 2)

        def forward(self, input_ids, document_ids=None): ...

        def init_weights(self, init): ...

    monkeypatch.setattr(transformer, "build_llama", lambda options, context: Opaque(options))
    with pytest.raises(ConfigError, match=r"\[model.language\] name = 'llama'.*\(Opaque\) has no embed"):
        build_model(_config(vlm_manager).model, 64, vlm_manager.registry)


def test_training_stages_freeze_their_part_and_the_optimizer_skips_it(vlm_manager):
    config = structure_config(
        {"model": {**MODEL, "freeze_language": True, "freeze_vision": True}, "train": {"seq_len": 32}},
        vlm_manager.registry,
    )
    model = build_model(config.model, 64, vlm_manager.registry, seed=0)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name for name, _ in model.named_parameters() if name.startswith("projector.")}
    optimizer = config.optimizer.build(model)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.projector.parameters()}


def test_meta_build_then_materialize_equals_a_direct_build(vlm_manager, llava):
    meta = build_model(_config(vlm_manager).model, 64, vlm_manager.registry, seed=0, device="meta")
    materialize(meta, torch.device("cpu"), seed=0)
    ids, pixels = _ids([1]), torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(meta.eval()(ids, pixel_values=pixels), llava(ids, pixel_values=pixels))


def test_pipeline_and_context_parallel_are_refused_for_llava_naming_the_family(vlm_manager):
    from forge_lm.model.capabilities import missing_capabilities

    model = build_model(_config(vlm_manager).model, 64, vlm_manager.registry, device="meta")
    config = _config(vlm_manager)

    class Dims:
        tp, pp, cp = 1, 2, 2

    problems = "; ".join(missing_capabilities(model, config, Dims()))
    assert "pp = 2 passes only activations between stages, and the model's forward takes the batch's" in problems
    assert "cp = 2 passes only token slices" in problems
