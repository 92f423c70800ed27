"""``[model] head_dim``: a head size set apart from ``dim / n_heads`` (Qwen3), in the options,
the attention layers, the FLOP count and the memory lower bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from forge_lm.config import ModelSection
from forge_lm.model.flops import active_parameter_count, flops_per_token
from forge_lm.model.linear import kernel
from forge_lm.model.memory import lower_bound
from forge_lm.validators import FieldError

from .conftest import VOCAB, tiny_fields


def test_head_size_is_head_dim_when_set_and_dim_over_n_heads_otherwise():
    assert ModelSection(**tiny_fields()).head_size == 8
    assert ModelSection(**tiny_fields(head_dim=16)).head_size == 16
    # with head_dim set, dim need not be a multiple of n_heads
    assert ModelSection(**tiny_fields(dim=30, head_dim=8)).head_size == 8


@pytest.mark.parametrize(
    ("head_dim", "message"), [(7, "head_dim: must be even for RoPE, got 7"), (0, "head_dim: must be > 0, got 0")]
)
def test_an_odd_or_non_positive_head_dim_is_refused_naming_it(head_dim, message):
    with pytest.raises(FieldError) as caught:
        ModelSection(**tiny_fields(head_dim=head_dim))
    assert str(caught.value) == message


def test_attention_projects_to_n_heads_times_head_dim_and_back_to_dim(make_model):
    model = make_model(head_dim=16, n_kv_heads=2, qk_norm=True)
    attention = model.layers[0].attention
    assert attention.wq.weight.shape == (4 * 16, 32)
    assert attention.wk.weight.shape == attention.wv.weight.shape == (2 * 16, 32)
    assert attention.wo.weight.shape == (32, 4 * 16)
    assert attention.q_norm.weight.shape == (16,)
    assert model.rope.cos.shape[-1] == 16


def test_lower_bound_counts_the_attention_of_an_explicit_head_size(make_model):
    model = make_model(head_dim=16, n_kv_heads=2, qk_norm=True)
    feed_forwards = sum(p.numel() for layer in model.layers for p in layer.feed_forward.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert lower_bound(model.config, VOCAB).parameters == total - feed_forwards


@pytest.mark.parametrize("head_dim", [None, 16, 4])
def test_flops_per_token_match_torchs_count_of_a_training_step(make_model, head_dim):
    """The attention term is 12 * n_layers * (n_heads * head_size) * T: torch's counter over a
    forward and backward agrees to the 6 FLOPs per norm scale it does not count."""
    model = make_model(head_dim=head_dim, n_kv_heads=2, attention_backend="eager").train()
    seq = 32
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    with kernel("aten"), FlopCounterMode(display=False) as counter:
        logits = model(ids)
        F.cross_entropy(logits.view(-1, VOCAB), ids.view(-1)).backward()
    counted = counter.get_total_flops() / seq
    vectors = sum(p.numel() for p in model.parameters() if p.ndim < 2)
    declared = flops_per_token(model.config, active_parameter_count(model), seq)
    assert declared == pytest.approx(counted + 6 * vectors, rel=1e-9)
