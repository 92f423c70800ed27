"""Multi-head latent attention against transformers' ``DeepseekV3Attention``, and its latent KV cache."""

from __future__ import annotations

import pytest
import torch

from forge_deepseek.hf_names import mla_from_hf
from forge_deepseek.mla import MultiHeadLatentAttention
from forge_lm.model.attention import attention_mask
from forge_lm.model.kv_cache import KVCache
from forge_lm.model.rope import rope_tables

from .conftest import tiny_hf_config

SEQ = 12


def hf_attention_and_mla(**fields):
    """A random HF attention layer and an MLA module holding the same weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = tiny_hf_config(**fields)
    torch.manual_seed(0)
    hf = DeepseekV3Attention(config, layer_idx=0).eval()
    for parameter in hf.parameters():  # norm scales too: a scale of 1 would hide a misplaced norm
        torch.nn.init.normal_(parameter, std=0.3 if parameter.ndim > 1 else 1.0)
    mla = MultiHeadLatentAttention(
        config.hidden_size,
        config.num_attention_heads,
        0,
        q_lora_rank=config.q_lora_rank or 0,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        norm_eps=1e-6,
    ).eval()
    state = mla_from_hf(
        {f"self_attn.{k}": v for k, v in hf.state_dict().items()},
        n_heads=config.num_attention_heads,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        interleaved=config.rope_interleave,
    )
    mla.load_state_dict({k.removeprefix("attention."): v for k, v in state.items()}, strict=True)
    return config, hf, mla


def hf_forward(config, hf, x):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    positions = torch.arange(x.shape[1])[None]
    cos, sin = DeepseekV3RotaryEmbedding(config)(x, positions)
    causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    return hf(x, position_embeddings=(cos, sin), attention_mask=causal)[0]


@pytest.mark.parametrize("q_lora_rank", [48, None], ids=["q_lora", "plain_wq"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved_rope", "half_split_rope"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_mla_matches_hf_deepseek_v3_attention(q_lora_rank, interleaved, backend):
    config, hf, mla = hf_attention_and_mla(q_lora_rank=q_lora_rank, rope_interleave=interleaved)
    x = torch.randn(2, SEQ, config.hidden_size)
    cos, sin = rope_tables(mla.rope_dim, SEQ, 10000.0)
    mask, is_causal = attention_mask(None, 0, SEQ, x.device, backend)
    with torch.no_grad():
        ours = mla(x, cos, sin, mask, is_causal)
        theirs = hf_forward(config, hf, x)
    assert theirs.abs().max() > 0.1  # a real signal, not a vanishing one
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_mla_scale_is_one_over_sqrt_of_the_query_key_head_size():
    """Same weights, a wider RoPE part: a scale from the nope part alone (or from v_head_dim) would differ."""
    config, hf, mla = hf_attention_and_mla(qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=24)
    x = torch.randn(1, SEQ, config.hidden_size)
    cos, sin = rope_tables(mla.rope_dim, SEQ, 10000.0)
    with torch.no_grad():
        torch.testing.assert_close(mla(x, cos, sin, None, True), hf_forward(config, hf, x), rtol=0, atol=1e-5)


def test_kv_cache_decoding_equals_the_full_forward_and_caches_only_the_latent():
    config, _, mla = hf_attention_and_mla(kv_lora_rank=31)  # an odd latent width: padded by one column
    x = torch.randn(2, SEQ, config.hidden_size)
    cos, sin = rope_tables(mla.rope_dim, SEQ, 10000.0)
    with torch.no_grad():
        full = mla(x, cos, sin, None, True)
        cache = KVCache(SEQ)
        prefix = 5
        mask, is_causal = attention_mask(None, 0, prefix, x.device, "sdpa")
        steps = [mla(x[:, :prefix], cos[:prefix], sin[:prefix], mask, is_causal, cache)]
        cache.advance(prefix)
        for t in range(prefix, SEQ):
            mask, is_causal = attention_mask(None, t, 1, x.device, "sdpa")
            steps.append(mla(x[:, t : t + 1], cos[t : t + 1], sin[t : t + 1], mask, is_causal, cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    held = sum(t.numel() for t in (*cache._keys.values(), *cache._values.values()))
    assert held == 2 * SEQ * (31 + config.qk_rope_head_dim + 1)  # batch 2, the latent and one pad column


def test_every_parameter_gets_a_gradient():
    _, _, mla = hf_attention_and_mla()
    x = torch.randn(2, SEQ, 64, requires_grad=True)
    cos, sin = rope_tables(mla.rope_dim, SEQ, 10000.0)
    mla.train()(x, cos, sin, None, True).square().sum().backward()
    assert x.grad.abs().sum() > 0
    for name, parameter in mla.named_parameters():
        assert parameter.grad.abs().sum() > 0, name
