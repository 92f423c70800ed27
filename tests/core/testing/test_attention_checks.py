"""The kit's attention checks: each deliberately broken layer fails the check for its defect; and
the built-in ``gqa`` layer against attention written out by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from forge_lm import hookimpl
from forge_lm.components import AttentionSpec
from forge_lm.default_plugins.options.models import SlidingWindowOptions
from forge_lm.model.attention import Attention, SlidingWindowAttention, attention_mask, build_gqa
from forge_lm.model.init import initialize
from forge_lm.model.rope import rope_tables
from forge_lm.testing import check_component, component_checks


def _register(manager, name: str, factory, config=None):
    class Layers:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_register_attentions(self, register):
            register(name, factory, config=config, description="broken on purpose")

    info = manager.add_plugin(Layers(), "layers", distribution="forge-layers", version="9.9")
    assert info.status == "ok", info.reason


def _layer(cls: type[Attention], **kwargs):
    def factory(options, spec: AttentionSpec, layer_index: int) -> Attention:
        extra = {"window": options.window} if options is not None and hasattr(options, "window") else {}
        return cls(spec.dim, spec.n_heads, spec.n_kv_heads, layer_index, **{**extra, **kwargs})

    return factory


def _failure(manager, name: str, check: str, **extras) -> str:
    checks = {c.id.rsplit(":", 1)[1]: c for c in component_checks("attentions", name, manager=manager, **extras)}
    with pytest.raises(AssertionError) as caught:
        checks[check]()
    return str(caught.value)


def test_the_unbroken_layers_pass_every_check(manager):
    _register(manager, "sound", _layer(Attention))
    check_component("attentions", "sound", manager=manager)


class _IgnoresTheMask(Attention):
    def forward(self, x, cos, sin, mask, is_causal, kv_cache=None):
        return super().forward(x, cos, sin, None, False, kv_cache)


def test_layer_ignoring_its_mask_fails_the_causality_check(manager):
    _register(manager, "unmasked", _layer(_IgnoresTheMask))
    message = _failure(manager, "unmasked", "no_output_depends_on_a_later_position")
    assert message.startswith(
        "attention layer 'unmasked' with the sdpa backend's masks looks ahead: the outputs at (query, later position) "
        "[[0, 1], [0, 2], [0, 3], [0, 4], [0, 5]] change when the input at the later position does (120 pairs); "
        "the kit expects no query to see a later key"
    )


class _OwnWindow(SlidingWindowAttention):
    """Applies its window itself (as a custom kernel would), one key too wide."""

    def forward(self, x, cos, sin, mask, is_causal, kv_cache=None):
        start = kv_cache.length if kv_cache is not None else 0
        query = torch.arange(start, start + x.shape[1])[:, None]
        key = torch.arange(start + x.shape[1])[None, :]
        own = (key <= query) & (query - key <= self.window)  # should be < self.window
        return super().forward(x, cos, sin, own, False, kv_cache)


def test_window_off_by_one_fails_the_window_check(manager):
    _register(manager, "wide", _layer(_OwnWindow), SlidingWindowOptions)
    message = _failure(manager, "wide", "query_sees_exactly_its_window_of_keys", options={"window": 4})
    assert message.startswith(
        "attention layer 'wide' with the sdpa backend's masks, window = 4: query i must see exactly keys i - 3 to i; "
        "it misses (query, key) [] and sees [[4, 0], [5, 1], [6, 2], [7, 3], [8, 4]] beyond them (0 and 12 pairs); "
        "the kit expects neither"
    )


def test_factory_passing_another_window_fails_the_window_check(manager):
    def narrower(options, spec, layer_index):
        return SlidingWindowAttention(spec.dim, spec.n_heads, spec.n_kv_heads, layer_index, window=options.window - 1)

    _register(manager, "narrow", narrower, SlidingWindowOptions)
    message = _failure(manager, "narrow", "query_sees_exactly_its_window_of_keys", options={"window": 4})
    assert message == (
        "attention layer 'narrow' declares window = 3 but its options say window = 4; the kit expects the layer's "
        "window to be the configured one"
    )


class _DropoutAlwaysOn(Attention):
    def forward(self, x, cos, sin, mask, is_causal, kv_cache=None):
        return F.dropout(super().forward(x, cos, sin, mask, is_causal, kv_cache), p=0.1)


def test_layer_with_dropout_left_on_fails_the_determinism_check(manager):
    _register(manager, "dropout", _layer(_DropoutAlwaysOn))
    message = _failure(manager, "dropout", "forward_is_deterministic_in_eval_mode")
    assert message.startswith("attention layer 'dropout': in eval mode two passes over the same input give outputs")


class _TorchInit(Attention):
    def init_weights(self, init):
        super().init_weights(init)
        nn.init.xavier_uniform_(self.wq.weight)


def test_layer_initialising_with_torch_nn_init_fails_the_seed_check(manager):
    _register(manager, "xavier", _layer(_TorchInit))
    message = _failure(manager, "xavier", "initial_weights_depend_on_the_seed_only")
    assert message.startswith(
        "attention layer 'xavier': initialised twice with seed=1 it gets different weights: wq.weight (up to "
    )


class _RandomBias(Attention):
    """A bias drawn in the constructor, which init_weights keeps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bias = nn.Parameter(0.1 * torch.randn(self.wo.out_features))

    def forward(self, x, cos, sin, mask, is_causal, kv_cache=None):
        return super().forward(x, cos, sin, mask, is_causal, kv_cache) + self.bias

    def init_weights(self, init):
        super().init_weights(init)
        init.copy(self.bias, self.bias.detach().clone())


def test_layer_drawing_in_its_constructor_fails_the_meta_build_check(manager):
    _register(manager, "randn", _layer(_RandomBias))
    message = _failure(manager, "randn", "meta_build_initialises_to_the_plain_build")
    assert message.startswith(
        "attention layer 'randn': built on the meta device and initialised with seed=1, the layer differs from the "
        "one built in memory at bias (up to "
    )


class _Unused(Attention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = nn.Parameter(torch.ones(()))

    def init_weights(self, init):
        super().init_weights(init)
        init.ones(self.gate)


def test_layer_with_an_unused_parameter_fails_the_gradient_check(manager):
    _register(manager, "unused", _layer(_Unused))
    message = _failure(manager, "unused", "every_parameter_gets_a_gradient")
    assert message == (
        "attention layer 'unused': 1 of 5 trainable parameters receive no gradient: ['gate']; the kit expects every "
        "trainable parameter to get one"
    )


class _DropsTheFirstKey:
    """A KV cache as a layer might misuse it: the oldest key and value cut off each update."""

    def __init__(self, cache):
        self.cache = cache

    def update(self, layer, keys, values):
        keys, values = self.cache.update(layer, keys, values)
        return keys[:, :, 1:], values[:, :, 1:]


class _ForgetfulDecoder(Attention):
    def forward(self, x, cos, sin, mask, is_causal, kv_cache=None):
        if kv_cache is not None and x.shape[1] == 1:
            kv_cache = _DropsTheFirstKey(kv_cache)
        return super().forward(x, cos, sin, mask, is_causal, kv_cache)


def test_layer_dropping_decoded_tokens_fails_the_decoding_check(manager):
    _register(manager, "forgetful", _layer(_ForgetfulDecoder))
    message = _failure(manager, "forgetful", "cached_decoding_matches_the_full_pass")
    assert message.startswith(
        "attention layer 'forgetful' with the sdpa backend's masks: with a KV cache (prefill of 8 positions, then one "
        "at a time) the outputs at positions [8, 9, 10, 11, 12, 13, 14, 15] differ from the full pass's by up to "
    )


# -- gqa against attention written out ------------------------------------------------------


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE by its definition: pair (i, i + D/2) of each head turns by position * theta^(-2i/D)."""
    half = x.shape[-1] // 2
    angle = positions[:, None].double() * theta ** (-2.0 * torch.arange(half).double() / x.shape[-1])
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * angle.cos() - second * angle.sin(), first * angle.sin() + second * angle.cos()), -1)


def _softmax_attention(layer: Attention, x: torch.Tensor, theta: float) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + causal mask) V per head, key/value head h // group serving
    query head h, in float64 from the layer's weights."""
    batch, seq, _ = x.shape
    heads, kv_heads, head_dim = layer.n_heads, layer.n_kv_heads, layer.head_dim
    x = x.double()
    q = (x @ layer.wq.weight.double().T).view(batch, seq, heads, head_dim).transpose(1, 2)
    k = (x @ layer.wk.weight.double().T).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    v = (x @ layer.wv.weight.double().T).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(seq)
    q, k = _rotate(q, positions, theta), _rotate(k, positions, theta)
    serving = torch.arange(heads) // (heads // kv_heads)
    k, v = k[:, serving], v[:, serving]  # [B, H, T, Dh]
    future = torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(batch, seq, heads * head_dim)
    return out @ layer.wo.weight.double().T


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_gqa_matches_softmax_attention_written_out(backend, kv_heads):
    spec = AttentionSpec(32, 4, kv_heads, 8, n_layers=2, max_seq_len=32, rope_theta=500.0, backend=backend)
    layer = build_gqa(None, spec, 0)
    initialize(layer, seed=0, std=0.3)  # wide enough that the softmax is far from uniform
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(8, 12, 500.0)
    mask, is_causal = attention_mask(None, 0, 12, x.device, backend)
    with torch.no_grad():
        out = layer(x, cos, sin, mask, is_causal, None)
    expected = _softmax_attention(layer, x, 500.0)
    assert expected.abs().max() > 1.0  # a test that would see a wrong head mapping or scale
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
