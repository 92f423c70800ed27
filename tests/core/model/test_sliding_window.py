"""The ``sliding_window`` attention: each query sees its ``window`` most recent keys, itself
included, on every mask path (SDPA, eager, FlexAttention, packed documents, a KV cache, explicit
positions), checked against attention written out with a dense window mask."""

from __future__ import annotations

import pytest
import torch

from forge_lm.components import AttentionSpec, WindowedAttention
from forge_lm.config import ComponentConfig, LlamaOptions, load_config
from forge_lm.model import build_model
from forge_lm.model.attention import SlidingWindowAttention, attention_mask, positional_mask
from forge_lm.model.rope import apply_rope, rope_tables

from .conftest import VOCAB, tiny_fields

SEQ = 12


def reference_attention(layer: SlidingWindowAttention, x: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + window mask) v with the layer's weights, written out in float64."""
    batch, seq, _ = x.shape
    x = x.double()
    heads, kv_heads, head_dim = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q = (x @ layer.wq.weight.double().T).view(batch, seq, heads, head_dim).transpose(1, 2)
    k = (x @ layer.wk.weight.double().T).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    v = (x @ layer.wv.weight.double().T).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    cos, sin = (t.double() for t in rope_tables(head_dim, seq, 10000.0))
    q, k = apply_rope(q, cos, sin).double(), apply_rope(k, cos, sin).double()
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    allowed = ((j <= i) & (i - j < layer.window)).expand(batch, seq, seq)
    if documents is not None:
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])
    scores = (q @ k.transpose(-1, -2)) / head_dim**0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(batch, seq, -1) @ layer.wo.weight.double().T


def make_layer(window: int) -> SlidingWindowAttention:
    torch.manual_seed(0)
    layer = SlidingWindowAttention(32, 4, 2, 0, window=window)
    for linear in (layer.wq, layer.wk, layer.wv, layer.wo):
        torch.nn.init.normal_(linear.weight, std=0.2)
    return layer.eval()


DOCUMENTS = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex"])
@pytest.mark.parametrize("documents", [None, DOCUMENTS], ids=["causal", "documents"])
@pytest.mark.parametrize("window", [1, 3, 5])
def test_sliding_window_attention_equals_the_written_out_window(backend, documents, window):
    layer = make_layer(window)
    x = torch.randn(2, SEQ, 32)
    mask, is_causal = attention_mask(documents, 0, SEQ, x.device, backend, window=window)
    cos, sin = rope_tables(layer.head_dim, SEQ, 10000.0)
    with torch.no_grad():
        out = layer(x, cos, sin, mask, is_causal, None)
    expected = reference_attention(layer, x, documents)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


def test_a_window_of_the_whole_sequence_is_plain_causal_attention():
    mask, is_causal = attention_mask(None, 0, SEQ, torch.device("cpu"), "sdpa", window=SEQ)
    assert (mask, is_causal) == (None, True)  # SDPA's fused causal kernel stays in use


def test_positional_masks_take_the_window_too():
    positions = torch.tensor([4, 5, 6, 7])
    keys = torch.arange(8)
    mask = positional_mask(positions, keys, None, None, window=3)
    expected = (keys[None, :] <= positions[:, None]) & (positions[:, None] - keys[None, :] < 3)
    assert torch.equal(mask, expected)
    assert mask.sum(dim=1).tolist() == [3, 3, 3, 3]


@pytest.fixture
def window_models(manager):
    """The same tiny llama weights with gqa and with a 4-token sliding window."""
    fields = tiny_fields(n_kv_heads=2)
    dense = build_model(LlamaOptions(**fields), VOCAB, manager.registry, seed=1).eval()
    windowed_options = LlamaOptions(**fields, attention=ComponentConfig("sliding_window"))
    windowed = build_model(windowed_options, VOCAB, manager.registry, seed=1).eval()
    return dense, windowed


def test_the_layers_declare_their_window_and_the_weights_are_those_of_gqa(window_models, manager):
    dense, windowed = window_models
    assert all(isinstance(block.attention, WindowedAttention) for block in windowed.blocks())
    assert windowed.layers[0].attention.window == 4096  # the default: no option needed
    for (name, a), (_, b) in zip(dense.state_dict().items(), windowed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        assert torch.equal(dense(ids), windowed(ids))  # a window longer than the sequence hides nothing


def test_a_short_window_changes_only_the_tokens_beyond_it(manager):
    fields = tiny_fields(n_kv_heads=2, n_layers=1)
    dense = build_model(LlamaOptions(**fields), VOCAB, manager.registry, seed=1).eval()
    attention = ComponentConfig(
        "sliding_window", manager.registry.resolve("attentions", "sliding_window").options_class(4)
    )
    windowed = build_model(LlamaOptions(**fields, attention=attention), VOCAB, manager.registry, seed=1).eval()
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        a, b = dense(ids), windowed(ids)
    torch.testing.assert_close(a[:, :4], b[:, :4], atol=1e-6, rtol=0)  # within the window: the same keys
    assert (a[:, 4:] - b[:, 4:]).abs().amax(dim=-1).min() > 1e-4  # beyond it: fewer keys


def test_decoding_with_a_kv_cache_equals_the_full_forward(manager):
    attention = ComponentConfig(
        "sliding_window", manager.registry.resolve("attentions", "sliding_window").options_class(3)
    )
    model = build_model(LlamaOptions(**tiny_fields(attention=attention)), VOCAB, manager.registry, seed=2).eval()
    ids = torch.randint(0, VOCAB, (1, 11))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache()
        steps = [model(ids[:, :5], kv_cache=cache)]
        steps += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(5, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_explicit_positions_give_the_same_logits(manager):
    attention = ComponentConfig(
        "sliding_window", manager.registry.resolve("attentions", "sliding_window").options_class(3)
    )
    model = build_model(LlamaOptions(**tiny_fields(attention=attention)), VOCAB, manager.registry, seed=2).eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, positions=torch.arange(9)), model(ids), atol=1e-5, rtol=1e-5)


def test_the_name_alone_selects_it_from_the_command_line(manager):
    config = load_config(None, ["--model.attention.name=sliding_window"], manager.registry)
    assert config.model.options.attention.options.window == 4096
    config = load_config(
        None, ["--model.attention.name=sliding_window", "--model.attention.window=64"], manager.registry
    )
    assert config.model.options.attention.options.window == 64


def test_the_attention_spec_carries_the_family_sizes():
    from forge_lm.model.transformer import attention_spec

    spec = attention_spec(LlamaOptions(**tiny_fields(n_kv_heads=2)))
    assert spec == AttentionSpec(
        dim=32, n_heads=4, n_kv_heads=2, head_dim=8, n_layers=2, max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5
    )
