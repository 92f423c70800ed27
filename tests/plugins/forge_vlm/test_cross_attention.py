"""The gated cross-attention layer against transformers' Mllama layer, its identity at zero
gates, the marker masks against a loop, and the join into any family that can wrap its blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forge_lm.config import LlamaOptions
from forge_lm.errors import ForgeError
from forge_lm.model import build_model
from forge_lm.model.init import initialize
from forge_vlm.cross_attention import (
    CrossAttendingBlock,
    GatedCrossAttention,
    combined_indices,
    join_cross_attention,
    marker_visibility,
    placement,
)

DIM, HEADS, KV_HEADS, HIDDEN = 32, 4, 2, 48


def layer(empty_rows: str = "zero", gates: float = 0.0, seed: int = 0) -> GatedCrossAttention:
    torch.manual_seed(seed)
    out = GatedCrossAttention(DIM, DIM, HEADS, KV_HEADS, HIDDEN, norm_eps=1e-5, empty_rows=empty_rows)
    initialize(out, seed, std=0.1, residual_std=0.05)
    with torch.no_grad():
        out.attn_gate.fill_(gates)
        out.ffn_gate.fill_(-gates)
        for norm in (out.attention_norm, out.q_norm, out.k_norm, out.ffn_norm):
            norm.weight.uniform_(0.5, 1.5)
    return out


def mask(batch: int = 2, seq: int = 6, states: int = 10) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    out = torch.rand(batch, seq, states, generator=generator) > 0.4
    out[0, 0] = False  # a row that sees nothing
    out[1, 3] = False
    return out


def hf_layer(ours: GatedCrossAttention):
    """transformers' MllamaCrossAttentionDecoderLayer holding ``ours``'s weights."""
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig
    from transformers.models.mllama.modeling_mllama import MllamaCrossAttentionDecoderLayer

    config = MllamaTextConfig(
        hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=HIDDEN
    )
    config._attn_implementation = "eager"
    theirs = MllamaCrossAttentionDecoderLayer(config, 0).eval()
    names = {
        "cross_attn.q_proj.weight": ours.wq.weight,
        "cross_attn.k_proj.weight": ours.wk.weight,
        "cross_attn.v_proj.weight": ours.wv.weight,
        "cross_attn.o_proj.weight": ours.wo.weight,
        "cross_attn.q_norm.weight": ours.q_norm.weight,
        "cross_attn.k_norm.weight": ours.k_norm.weight,
        "input_layernorm.weight": ours.attention_norm.weight,
        "post_attention_layernorm.weight": ours.ffn_norm.weight,
        "mlp.gate_proj.weight": ours.feed_forward.w1.weight,
        "mlp.up_proj.weight": ours.feed_forward.w3.weight,
        "mlp.down_proj.weight": ours.feed_forward.w2.weight,
        "cross_attn_attn_gate": ours.attn_gate,
        "cross_attn_mlp_gate": ours.ffn_gate,
    }
    theirs.load_state_dict({name: tensor.detach().clone() for name, tensor in names.items()}, strict=True)
    return theirs


def hf_forward(theirs, x: torch.Tensor, states: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

    # Mllama's mask is [B, T, images, tiles], repeated over each tile's states: one state per "tile" here.
    additive, rows = _prepare_cross_attention_mask(visible[..., None].long(), 1, torch.float32)
    return theirs(
        x,
        cross_attention_states=states,
        cross_attention_mask=additive,
        attention_mask=None,
        full_text_row_masked_out_mask=rows,
    )


def test_fresh_layer_is_exactly_the_identity():
    ours = layer(gates=0.0)
    x, states = torch.randn(2, 6, DIM), torch.randn(2, 10, DIM)
    assert torch.equal(ours(x, states, mask()), x)
    assert torch.equal(ours(x, states), x)


def ours_and_theirs(empty_rows: str) -> tuple[torch.Tensor, ...]:
    """``(our output, transformers', input, mask)`` of one layer with open gates."""
    ours = layer(empty_rows, gates=0.7)
    x, states, visible = torch.randn(2, 6, DIM), torch.randn(2, 10, DIM), mask()
    with torch.no_grad():
        return ours(x, states, visible), hf_forward(hf_layer(ours), x, states, visible), x, visible


def test_matches_transformers_mllama_layer_with_attend_all_rows():
    got, expected, x, _ = ours_and_theirs("attend_all")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(got, x, atol=1e-3)  # the gates let the layer change its input


def test_zero_rows_match_transformers_where_rows_see_something_and_are_untouched_elsewhere():
    got, expected, x, visible = ours_and_theirs("zero")
    sees = visible.any(-1)
    torch.testing.assert_close(got[sees], expected[sees], rtol=0, atol=1e-5)
    assert torch.equal(got[~sees], x[~sees])  # Meta's reference: no image yet, no change


def test_cached_keys_values_give_the_same_output():
    ours = layer(gates=0.5)
    x, states, visible = torch.randn(2, 6, DIM), torch.randn(2, 10, DIM), mask()
    with torch.no_grad():
        cached = ours(x, mask=visible, keys_values=ours.keys_values(states))
        torch.testing.assert_close(cached, ours(x, states, visible))


def test_encoder_width_may_differ_from_the_text_width():
    wide = GatedCrossAttention(DIM, 24, HEADS, KV_HEADS, HIDDEN)
    assert wide(torch.randn(1, 3, DIM), torch.randn(1, 5, 24)).shape == (1, 3, DIM)


def test_bad_mask_shape_is_named():
    with pytest.raises(ForgeError, match=r"mask \(2, 6, 9\) must be \[batch, text, states\]"):
        layer()(torch.randn(2, 6, DIM), torch.randn(2, 10, DIM), torch.ones(2, 6, 9, dtype=torch.bool))


# -- masks ----------------------------------------------------------------------------------------

MARK = 9


def visibility_by_loop(ids, images, documents):
    batch, seq = ids.shape
    out = torch.zeros(batch, seq, images.shape[1], dtype=torch.bool)
    for b in range(batch):
        marks = [t for t in range(seq) if ids[b, t] == MARK]
        for j, where in enumerate(marks):
            for t in range(where, seq):
                out[b, t, j] = bool(images[b, j]) and (documents is None or documents[b, t] == documents[b, where])
    return out


def test_marker_visibility_matches_a_loop_with_packed_documents():
    ids = torch.tensor([[MARK, 1, 2, MARK, 3, 4, 5, 6], [1, 2, MARK, 3, MARK, MARK, 4, 5]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    images = torch.tensor([[True, True, False], [True, True, True]])
    got = marker_visibility(ids, MARK, images, documents)
    assert torch.equal(got, visibility_by_loop(ids, images, documents))
    assert not got[0, 6:].any()  # document 2 has no image: it sees none of the others'
    assert not got[1, :2].any()  # text before the row's first marker sees nothing
    assert torch.equal(marker_visibility(ids, MARK, images), visibility_by_loop(ids, images, None))


def test_markers_and_images_must_agree_in_number():
    ids = torch.tensor([[MARK, 1, MARK, 2]])
    with pytest.raises(ForgeError, match=r"row 0 has 2 image markers \(id 9\) but 1 images"):
        marker_visibility(ids, MARK, torch.tensor([[True, False]]))


# -- placement and the join ----------------------------------------------------------------------


def test_placement_every_k_and_mllama_indices_round_trip():
    assert placement(8, 4, None) == [(3, "after"), (7, "after")]
    # Mllama 11B: 32 self-attention blocks, cross-attention at these combined indices.
    mllama = [3, 8, 13, 18, 23, 28, 33, 38]
    places = placement(32, None, mllama)
    assert places[:2] == [(2, "after"), (6, "after")]
    assert combined_indices(places) == mllama
    assert combined_indices(placement(2, None, [0, 3])) == [0, 3]
    with pytest.raises(ForgeError, match="distinct indices below 4"):
        placement(2, None, [0, 4])


def tiny_llama(manager) -> nn.Module:
    options = LlamaOptions(dim=DIM, n_layers=4, n_heads=HEADS, n_kv_heads=KV_HEADS, max_seq_len=32, vocab_size=50)
    return build_model(options, 50, manager.registry, seed=3)


@pytest.fixture(scope="module")
def manager():
    from forge_lm.plugins import PluginManager, PluginSettings

    return PluginManager(PluginSettings(allow=()))


def cross_layers(count: int, gates: float) -> list[GatedCrossAttention]:
    return [layer(gates=gates, seed=10 + i) for i in range(count)]


def test_joined_llama_with_zero_gates_gives_exactly_the_language_models_logits(manager):
    plain, joined = tiny_llama(manager), tiny_llama(manager)
    feed = join_cross_attention(joined, cross_layers(2, 0.0), placement(4, 2, None), "llama")
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    feed.set(torch.randn(2, 10, DIM), mask())
    with torch.no_grad():
        assert torch.equal(joined(ids), plain(ids))
    wrapped = [b for b in joined.blocks() if isinstance(b, CrossAttendingBlock)]
    assert wrapped == [joined.layers[1], joined.layers[3]]
    assert "layers.1.cross_after.0.wq.weight" in dict(joined.named_parameters())


def test_joined_llama_runs_its_layers_between_the_blocks(manager):
    """Open gates: the logits are what running the blocks and layers in order by hand gives."""
    joined = tiny_llama(manager)
    layers = cross_layers(2, 0.6)
    feed = join_cross_attention(joined, layers, placement(4, None, [0, 3]), "llama")
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    states, visible = torch.randn(2, 10, DIM), mask()
    feed.set(states, visible)
    with torch.no_grad():
        got = joined(ids)
        cos, sin = joined.rope(0, 6)
        h = layers[0](joined.tok_embeddings(ids), states, visible)  # combined index 0: before block 0
        blocks = [b.block if isinstance(b, CrossAttendingBlock) else b for b in joined.blocks()]
        for i, block in enumerate(blocks):
            h = block(h, cos, sin, None, True, None)
            if i == 1:  # combined index 3: after blocks 0 and 1 and the first layer
                h = layers[1](h, states, visible)
        expected = joined.output(joined.norm(h))
        feed.set(None, None)
        text_only = joined(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(got, text_only, atol=1e-3)


def test_a_family_that_cannot_wrap_its_blocks_is_refused_by_name():
    class Opaque(nn.Module):
        def blocks(self):
            return [nn.Linear(2, 2)]

    with pytest.raises(ForgeError, match=r"cannot join the language family 'opaque' \(Opaque\).*WrapsBlocks"):
        join_cross_attention(Opaque(), cross_layers(1, 0.0), [(0, "after")], "opaque")
