"""Multi-head latent attention (MLA), as DeepSeek-V2 and DeepSeek-V3 define it.

Keys and values of every head are reconstructed from one small latent per token:

- ``c_kv = kv_norm(wkv_a(x)[:kv_lora_rank])`` ``[B, T, kv_lora_rank]`` (RMSNorm'd), and
  ``k_pe = rope(wkv_a(x)[kv_lora_rank:])`` ``[B, T, qk_rope_head_dim]``, one RoPE key shared by
  all heads (the "decoupled" key: RoPE cannot be folded into a low-rank projection);
- per head, ``k = [k_nope, k_pe]`` and ``v`` from ``wkv_b(c_kv)``;
- queries ``[q_nope, rope(q_pe)]`` from ``wq(x)``, or through a low-rank bottleneck
  ``wq_b(q_norm(wq_a(x)))`` when ``q_lora_rank > 0``;
- softmax scale ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (Hugging Face's, without
  YaRN's extra factor, which Forge does not implement), output ``wo`` over ``n_heads * v_head_dim``.

A KV cache holds only ``c_kv`` and ``k_pe`` (``kv_lora_rank + qk_rope_head_dim`` values per
token and layer, against ``2 * n_heads * head_dim`` for multi-head attention); each decoding
step expands them again with ``wkv_b``. The expansion is the plain form of MLA (the
absorbed-weight form, which folds ``wkv_b`` into the query and output, is a decoding
optimisation that changes no result). RoPE uses the core's half-split layout; checkpoints in
DeepSeek's interleaved layout are permuted on import (:mod:`forge_deepseek.hf`).

Context parallelism and tensor parallelism are not supported: this module has no
``context_parallel`` attribute, and its projections are not the ``wq``/``wk``/``wv`` the
core's tensor-parallel plan splits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from forge_lm.api import Linear, RMSNorm, apply_rope, check_flex_backward, eager_attention, flex_function

if TYPE_CHECKING:
    from forge_deepseek.options import MLAOptions
    from forge_lm.api import KVCache
    from forge_lm.components import AttentionSpec, Initializer


class MultiHeadLatentAttention(nn.Module):
    """``forward(x [B, T, dim], cos, sin, mask, is_causal, kv_cache) -> [B, T, dim]``, the core's
    attention call; ``cos``/``sin`` are ``[T, rope_dim]`` tables (``rope_dim = qk_rope_head_dim``)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        layer_index: int,
        *,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index  # its slot in a KV cache
        self.n_heads, self.kv_lora_rank = n_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_dim = qk_rope_head_dim  # the size of the RoPE tables the model hands this layer
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank:
            self.wq = None
            self.wq_a = Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.wq_b = Linear(q_lora_rank, n_heads * qk_head_dim, bias=False)
        else:
            self.wq = Linear(dim, n_heads * qk_head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)  # latent + the shared RoPE key
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.wkv_b = Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = Linear(n_heads * v_head_dim, dim, bias=False)  # writes into the residual stream

    def init_weights(self, init: Initializer) -> None:
        """Projections ``normal(0, init.std)``, ``wo`` ``normal(0, init.residual_std)``, norm scales 1."""
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                init.normal(linear.weight, init.std)
        init.normal(self.wo.weight, init.residual_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                init.ones(norm.weight)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, dim] -> [B, H, T, qk_nope + qk_rope]`` before RoPE."""
        batch, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        return q.view(batch, seq, self.n_heads, -1).transpose(1, 2)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache keeps per token: ``c_kv`` ``[B, T, kv_lora_rank]`` and the rotated
        shared key ``k_pe`` ``[B, T, qk_rope_head_dim]``."""
        c_kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_norm(c_kv), apply_rope(k_pe[:, None], cos, sin)[:, 0]

    def expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B, H, S, qk_nope + qk_rope]`` and values ``[B, H, S, v_head_dim]`` of the latent."""
        batch, keys, _ = c_kv.shape
        kv = self.wkv_b(c_kv).view(batch, keys, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe[:, None].expand(batch, self.n_heads, keys, self.qk_rope_head_dim)
        return torch.cat((k_nope, k_pe), dim=-1), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | None,
        is_causal: bool,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q_nope, q_pe = self.queries(x).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat((q_nope, apply_rope(q_pe, cos, sin)), dim=-1)  # [B, H, T, Dqk]
        c_kv, k_pe = self.latent(x, cos, sin)
        if kv_cache is not None:
            c_kv, k_pe = cache_latent(kv_cache, self.layer_index, c_kv, k_pe)  # every cached token's latent
        k, v = self.expand(c_kv, k_pe)
        out = attend(q, k, v, mask, is_causal)  # [B, H, T, Dv]
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None, is_causal: bool
) -> torch.Tensor:
    """Scaled dot-product attention in the form the core's mask takes (see
    :func:`forge_lm.model.attention.attention_mask`); scale ``1 / sqrt(q.shape[-1])`` in all
    three, which is MLA's ``1 / sqrt(qk_nope + qk_rope)``. Values may be narrower than keys."""
    if isinstance(mask, BlockMask):
        check_flex_backward(q)
        return flex_function(q.device)(q, k, v, block_mask=mask)
    if mask is not None and mask.is_floating_point():
        return eager_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def cache_latent(
    kv_cache: KVCache, layer: int, c_kv: torch.Tensor, k_pe: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the new tokens' latent in the core's :class:`~forge_lm.model.kv_cache.KVCache`;
    returns the latent of every cached token, the new ones included.

    The core's cache holds two tensors of one shape per layer (keys and values,
    ``[B, heads, S, head_dim]``). The latent ``[c_kv, k_pe]`` is one row per token, so it is
    stored as one "head" split across the two tensors, each holding half of the row (a zero
    column pads an odd width): exactly the latent's size, nothing per head.
    """
    rank = c_kv.shape[-1]
    row = torch.cat((c_kv, k_pe), dim=-1)[:, None]  # [B, 1, T, rank + rope]
    width = row.shape[-1]
    if width % 2:
        row = F.pad(row, (0, 1))
    first, second = row.chunk(2, dim=-1)
    first, second = kv_cache.update(layer, first, second)
    row = torch.cat((first, second), dim=-1)[:, 0, :, :width]  # [B, S, rank + rope]
    return row[..., :rank], row[..., rank:]


def build_mla(options: MLAOptions, spec: AttentionSpec, layer_index: int) -> MultiHeadLatentAttention:
    """Factory of the ``mla`` attention component (options: ``forge_deepseek.options.MLAOptions``;
    ``spec`` a :class:`forge_lm.components.AttentionSpec`; ``n_kv_heads`` and ``qk_norm`` do not
    apply: every head has its own keys and values, expanded from one shared latent)."""
    return MultiHeadLatentAttention(
        spec.dim, spec.n_heads, layer_index, norm_eps=spec.norm_eps, **options.sizes(spec.head_dim)
    )
