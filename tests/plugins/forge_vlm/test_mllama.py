"""The cross_attention family: at zero gates it is its language model, images reach the text
only through markers, decoding with the cache gives the full forward's logits, and a meta build
initialises like a plain one."""

from __future__ import annotations

import pytest
import torch

from forge_lm.config import structure_config
from forge_lm.model import build_model
from forge_vlm.cross_attention import GatedCrossAttention

VOCAB, MARK = 64, 63

VISION = {
    "image_size": 16,
    "patch_size": 4,
    "width": 32,
    "depth": 2,
    "global_depth": 1,
    "heads": 4,
    "mlp_dim": 48,
    "max_num_tiles": 4,
    "aspect_ratios": [[1, 1], [1, 2], [2, 1], [2, 2]],
    "intermediate_layers": [0],
}
VIT = {"image_size": 16, "patch_size": 4, "width": 32, "depth": 2, "heads": 4, "mlp_dim": 48}  # tower = "vit"
LANGUAGE = {"name": "llama", "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32}


def table(**fields) -> dict:
    return {"name": "cross_attention", "language": LANGUAGE, "vision": VISION, "every_n_blocks": 2, **fields}


@pytest.fixture(scope="module")
def manager():
    from forge_lm.plugins import PluginManager, PluginSettings

    return PluginManager(PluginSettings(allow=("vlm",)))


def build(manager, seed: int = 0, device=None, **fields):
    config = structure_config({"model": table(**fields), "train": {"seq_len": 32}}, manager.registry)
    return build_model(config.model, VOCAB, manager.registry, seed=seed, device=device)


def open_gates(model, value: float = 0.8) -> None:
    with torch.no_grad():
        for layer in model.cross_layers():
            layer.attn_gate.fill_(value)
            layer.ffn_gate.fill_(-value)


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MARK, (2, 12), generator=generator)
    ids[0, 2] = ids[1, 0] = ids[1, 6] = MARK  # row 0: one image; row 1: two
    pixels = torch.randn(2, 2, 3, 16, 16, generator=generator)
    image_mask = torch.tensor([[True, False], [True, True]])
    return ids, pixels, image_mask


def test_fresh_model_is_exactly_its_language_model(manager):
    model = build(manager).eval()
    language = build_model(
        structure_config({"model": LANGUAGE, "train": {"seq_len": 32}}, manager.registry).model,
        VOCAB,
        manager.registry,
    ).eval()
    plain = {name.replace("block.", ""): t for name, t in model.language.state_dict().items() if "cross_" not in name}
    language.load_state_dict(plain, strict=True)
    ids, pixels, image_mask = batch()
    with torch.no_grad():
        assert torch.equal(model(ids, pixel_values=pixels, image_mask=image_mask), language(ids))
        assert torch.equal(model(ids), language(ids))
    assert len(model.cross_layers()) == 2


def test_images_reach_only_the_text_after_their_marker(manager):
    model = build(manager).eval()
    open_gates(model)
    ids, pixels, image_mask = batch()
    other = pixels.clone()
    other[0, 0] += 1.0  # row 0's only image changes
    with torch.no_grad():
        a = model(ids, pixel_values=pixels, image_mask=image_mask)
        b = model(ids, pixel_values=other, image_mask=image_mask)
        text = model(ids)
    assert torch.equal(a[0, :2], b[0, :2])  # before row 0's marker: untouched
    assert not torch.allclose(a[0, 2:], b[0, 2:], atol=1e-4)
    assert torch.equal(a[1], b[1])  # row 1 never sees row 0's image
    assert torch.equal(a[0, :2], text[0, :2])  # text before any marker: the language model's logits


@pytest.mark.parametrize("tower", [{}, {"tower": "vit", "vision": VIT}], ids=["mllama", "vit"])
def test_four_d_pixel_values_in_batch_order_give_the_same_logits(manager, tower):
    model = build(manager, **tower).eval()
    open_gates(model)
    ids, pixels, image_mask = batch()
    with torch.no_grad():
        five = model(ids, pixel_values=pixels, image_mask=image_mask)
        four = model(ids, pixel_values=pixels[image_mask])
    torch.testing.assert_close(four, five, rtol=0, atol=1e-6)


def test_decoding_with_the_cache_gives_the_full_forwards_logits(manager):
    model = build(manager).eval()
    open_gates(model)
    ids, pixels, image_mask = batch()
    ids, pixels = ids[1:], pixels[1:]
    with torch.no_grad():
        full = model(ids, pixel_values=pixels, image_mask=image_mask[1:])
        cache = model.new_kv_cache(32)
        steps = [model(ids[:, :8], pixel_values=pixels, image_mask=image_mask[1:], kv_cache=cache)]
        steps += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_meta_build_initialises_as_a_plain_build(manager):
    from forge_lm.model.init import materialize

    plain = build(manager, seed=4)
    meta = build(manager, seed=4, device="meta")
    materialize(meta, torch.device("cpu"), 4)
    ours, theirs = plain.state_dict(), meta.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    gates = [layer.attn_gate for layer in meta.cross_layers()]
    assert all(float(gate.detach()) == 0.0 for gate in gates)


def test_activation_checkpointing_gives_the_same_gradients(manager):
    from forge_lm.distributed.activation_checkpointing import checkpointed

    ids, pixels, image_mask = batch()
    grads = []
    for mode in ("none", "full"):
        model = build(manager, seed=1)
        open_gates(model)
        if mode != "none":
            for block in model.blocks():
                block.forward = checkpointed(block.forward, mode)
        model(ids, pixel_values=pixels, image_mask=image_mask).float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert any("vision." in name for name in grads[0])  # the image path is trained
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-6)


def test_freeze_language_keeps_the_cross_attention_layers_trainable(manager):
    model = build(manager, freeze_language=True, freeze_vision=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable
    assert all("cross_" in n or n.startswith("projector.") for n in trainable)
    assert all(p.requires_grad for layer in model.cross_layers() for p in layer.parameters())
    assert isinstance(model.cross_layers()[0], GatedCrossAttention)
