"""The swiglu feed-forward component: its hidden-size rounding, its function and its init."""

from __future__ import annotations

import pytest
import torch

from forge_lm.default_plugins.options.feed_forwards import SwiGLUOptions
from forge_lm.model.init import initialize
from forge_lm.model.swiglu import SwiGLU, build_swiglu, swiglu_hidden


@pytest.mark.parametrize(
    ("dim", "multiplier", "multiple_of", "hidden"),
    [
        (32, 8 / 3, 64, 128),  # 85.3 -> 2 multiples of 64
        (4096, 8 / 3, 256, 11008),  # Llama-7B: 10922.7 -> 43 * 256
        (768, 8 / 3, 64, 2048),  # exactly 32 multiples: no rounding up
        (100, 4.0, 1, 400),
        (100, 2.5, 48, 288),  # 250 -> 6 * 48
        (400, 1.1, 8, 440),  # 1.1 * 400 / 8 is 55.00000000000001 in floats; the formula means 55
    ],
)
def test_hidden_size_is_the_multiplier_rounded_up_to_a_multiple(dim, multiplier, multiple_of, hidden):
    assert swiglu_hidden(dim, multiplier, multiple_of) == hidden


def test_the_factory_builds_gate_up_and_down_projections_of_the_rounded_size():
    layer = build_swiglu(SwiGLUOptions(hidden_multiplier=2.5, multiple_of=48), 100, 3)
    assert layer.w1.weight.shape == (288, 100)
    assert layer.w3.weight.shape == (288, 100)
    assert layer.w2.weight.shape == (100, 288)
    assert build_swiglu(SwiGLUOptions(), 96, 0).w1.out_features == 256  # defaults: 8/3 * 96 = 256 exactly


def test_forward_is_down_of_silu_gate_times_up_without_biases():
    torch.manual_seed(0)
    layer = SwiGLU(8, 16)
    x = torch.randn(2, 3, 8)
    w1, w2, w3 = (layer.w1.weight.double(), layer.w2.weight.double(), layer.w3.weight.double())
    gate = x.double() @ w1.T
    expected = ((gate * torch.sigmoid(gate)) * (x.double() @ w3.T)) @ w2.T
    assert torch.allclose(layer(x).double(), expected, atol=1e-6)
    assert all(m.bias is None for m in (layer.w1, layer.w2, layer.w3))


def test_init_weights_gives_the_down_projection_the_residual_std():
    layer = SwiGLU(256, 512)
    initialize(layer, seed=0, std=0.02, residual_std=0.005)  # runs layer.init_weights(init)
    for weight, std in ((layer.w1.weight, 0.02), (layer.w3.weight, 0.02), (layer.w2.weight, 0.005)):
        assert abs(weight.std().item() - std) < 0.02 * std  # 131072 samples: sampling error ~0.2%
        assert abs(weight.mean().item()) < 0.02 * std
