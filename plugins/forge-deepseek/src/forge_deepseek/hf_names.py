"""Names and layouts shared by the Hugging Face conversion (:mod:`forge_deepseek.hf`) and the tests:
MLA's weights under ``DeepseekV3ForCausalLM``'s names, and the RoPE row permutation.

Kept free of the model code so that a test can load one HF attention layer into one MLA module.
"""

from __future__ import annotations

import torch

# Forge name <-> HF name inside a block ("layers.N." / "model.layers.N.").
MLA_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}


def deinterleave(rope_dim: int) -> torch.Tensor:
    """The row order that turns DeepSeek's interleaved RoPE pairs ``(x0, x1), (x2, x3), ...`` into
    the core's half-split pairs ``(x_i, x_{i + d/2})``: ``[0, 2, 4, ..., 1, 3, 5, ...]``.

    Rotating the permuted rows half-split gives exactly the outputs HF's interleaved rotation
    gives (it returns them half-split too), and a query and key permuted alike have the same
    dot product, so attention is unchanged."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


def mla_from_hf(
    hf: dict[str, torch.Tensor], *, n_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, interleaved: bool
) -> dict[str, torch.Tensor]:
    """One layer's MLA weights (HF names relative to the block) under Forge's names relative to the
    block; with ``interleaved`` (HF's ``rope_interleave``), the RoPE rows of the query and of the
    shared key are put in half-split order."""
    by_hf = {hf_name: forge for forge, hf_name in MLA_NAMES.items()}
    out = {by_hf[name]: tensor for name, tensor in hf.items() if name in by_hf}
    if not interleaved:
        return out
    for name in ("attention.wq.weight", "attention.wq_b.weight"):
        if name in out:
            weight = out[name]
            per_head = weight.view(n_heads, -1, weight.shape[-1])
            rope = per_head[:, qk_nope_head_dim:]
            order = deinterleave(rope.shape[1])
            fixed = torch.cat((per_head[:, :qk_nope_head_dim], rope[:, order]), dim=1)
            out[name] = fixed.reshape(weight.shape).contiguous()
    wkv_a = out["attention.wkv_a.weight"]
    order = deinterleave(wkv_a.shape[0] - kv_lora_rank)
    out["attention.wkv_a.weight"] = torch.cat((wkv_a[:kv_lora_rank], wkv_a[kv_lora_rank:][order]))
    return out
