"""``[checkpoint.growth] experts = "copy"``: forge-moe grows its expert axis when ``init_from``
weights fill a model with more experts; the core's width rule then grows the experts' hidden
size. Checked against the source model's own tensors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from forge_lm.config._schema import GrowthSection
from forge_lm.errors import ConfigError
from forge_lm.train.growth import grow

LAYER = "layers.{}.feed_forward."


def _grow(small, big, **rules):
    return grow(small.state_dict(), big, get_model_state_dict(big), GrowthSection(**rules), 0, "small")


def test_new_experts_are_noisy_copies_with_copied_router_rows_and_wider_hidden_units(make_moe_model):
    small = make_moe_model(ffn={"n_experts": 2, "top_k": 2})
    big = make_moe_model(ffn={"n_experts": 4, "top_k": 2, "expert_multiplier": 2.0}, seed=1)
    growth = _grow(small, big, experts="copy", expert_noise=0.1, width="preserve")
    source = small.state_dict()
    hidden = source[LAYER.format(0) + "experts.w1"].shape[1]
    assert (
        growth.weights[LAYER.format(0) + "experts.w1"].shape == big.state_dict()[LAYER.format(0) + "experts.w1"].shape
    )
    assert growth.weights[LAYER.format(0) + "experts.w1"].shape[1] > hidden
    for layer in range(2):
        prefix = LAYER.format(layer)
        for name in ("experts.w1", "experts.w3", "experts.w2"):
            src, got = source[prefix + name], growth.weights[prefix + name]
            corner = got[:, :hidden, :] if name != "experts.w2" else got[:, :, :hidden]
            assert torch.equal(corner[:2], src)  # the trained experts keep their places
            ratio = (corner[2:] - src).std(dim=(1, 2)) / src.std(dim=(1, 2))  # new expert e copies e mod 2
            assert torch.all((ratio > 0.09) & (ratio < 0.11)), ratio
        # New hidden units add nothing: the down projection's new columns are zero.
        assert torch.count_nonzero(growth.weights[prefix + "experts.w2"][:, :, hidden:]) == 0
        router = source[prefix + "router.weight"]
        assert torch.equal(growth.weights[prefix + "router.weight"], router[[0, 1, 0, 1]])
    how = {entry.name: entry.how for entry in growth.entries}
    assert how[LAYER.format(1) + "router.weight"] == how[LAYER.format(1) + "experts.w2"] == "grown"
    assert how["tok_embeddings.weight"] == "copied"


def test_without_noise_new_experts_are_exact_copies(make_moe_model):
    small = make_moe_model(ffn={"n_experts": 2, "top_k": 1, "router": {"renormalize": False}})
    big = make_moe_model(ffn={"n_experts": 6, "top_k": 1, "router": {"renormalize": False}}, seed=1)
    weights = _grow(small, big, experts="copy", expert_noise=0.0).weights
    for name in ("experts.w1", "experts.w2", "router.weight"):
        src = small.state_dict()[LAYER.format(0) + name]
        assert torch.equal(weights[LAYER.format(0) + name], src[[0, 1, 0, 1, 0, 1]])


def test_more_experts_without_the_rule_or_fewer_experts_are_refused(make_moe_model):
    small = make_moe_model(ffn={"n_experts": 4, "top_k": 2})
    with pytest.raises(ConfigError, match=r"4 experts but \[model.ffn\] n_experts is 8: set \[checkpoint.growth\] "):
        _grow(small, make_moe_model(ffn={"n_experts": 8, "top_k": 2}))
    with pytest.raises(ConfigError, match=r"4 experts but \[model.ffn\] n_experts is 2: growth only adds experts"):
        _grow(small, make_moe_model(ffn={"n_experts": 2, "top_k": 2}), experts="copy")
