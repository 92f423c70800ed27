"""Active parameter counts and training FLOPs per token, against counts done by hand."""

from __future__ import annotations

import pytest
from torch import nn

from forge_lm.model.flops import active_parameter_count, flops_per_token

# The tiny model: dim 32, 2 layers, 4 heads of 8, 2 key/value heads, SwiGLU hidden 128
# (64 * ceil(8/3 * 32 / 64)), vocabulary 61.
PER_LAYER = (
    32 * 32  # wq
    + 2 * (32 * 16)  # wk, wv: 2 kv heads * 8
    + 32 * 32  # wo
    + 3 * 32 * 128  # w1, w3, w2
    + 2 * 32  # attention_norm, ffn_norm
)
HEAD = 61 * 32
ACTIVE = 2 * PER_LAYER + 32 + HEAD  # layers, final norm, head; never the embedding lookup


def test_hand_count_of_the_layers_is_what_the_formula_says():
    assert PER_LAYER == 15424
    assert ACTIVE == 32832


@pytest.mark.parametrize("tied", [True, False])
def test_active_parameters_exclude_the_embedding_and_count_a_tied_head_once(make_model, tied):
    model = make_model(n_kv_heads=2, tie_embeddings=tied)
    assert active_parameter_count(model) == ACTIVE
    total = sum(p.numel() for p in model.parameters())  # shared tensors are yielded once
    assert total == (ACTIVE if tied else ACTIVE + 61 * 32)


def test_qk_norm_scales_are_active_parameters(make_model):
    assert active_parameter_count(make_model(n_kv_heads=2, qk_norm=True)) == ACTIVE + 2 * 2 * 8


class Experts(nn.Module):
    """Stands in for a mixture of experts: 4 experts, a token visits 1."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(4))

    def active_parameter_count(self) -> int:
        return 64


def test_a_module_reporting_its_own_count_is_not_walked():
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8), Experts(), nn.Linear(8, 100, bias=False))
    assert active_parameter_count(model) == (64 + 8) + 64 + 800


def test_flops_per_token_is_6n_plus_12_layers_dim_seq(make_config):
    config = make_config(n_kv_heads=2)
    assert flops_per_token(config, ACTIVE, 16) == 6 * 32832 + 12 * 2 * 32 * 16 == 209280
    assert flops_per_token(config, 0, 1) == 768.0


def test_flops_per_token_of_a_built_model_match_the_hand_count(make_model):
    model = make_model(n_kv_heads=2)
    assert flops_per_token(model.config, active_parameter_count(model), 64) == pytest.approx(
        6 * ACTIVE + 12 * 2 * 32 * 64
    )
