"""Causal self-attention with grouped-query heads, optional QK-norm and RoPE, and its masks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from forge_lm.model.kv_cache import KVCache
from forge_lm.model.norms import RMSNorm
from forge_lm.model.rope import apply_rope

if TYPE_CHECKING:
    from forge_lm.components import Initializer
    from forge_lm.distributed.context_parallel import ContextParallel


class Attention(nn.Module):
    """``wq``/``wk``/``wv`` project to ``n_heads`` query and ``n_kv_heads`` key/value heads; ``wo`` projects back.

    With ``n_kv_heads < n_heads`` (grouped-query attention) each key/value head serves
    ``n_heads / n_kv_heads`` consecutive query heads, the layout of HF Llama. No biases.

    Under context parallelism (``context_parallel`` set, see
    :mod:`forge_lm.distributed.context_parallel`) ``x`` is this rank's slice of the sequence: the
    keys and values of the whole group are gathered before attending, and ``mask`` is over the
    gathered keys.
    """

    context_parallel: ContextParallel | None = None

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, layer_index: int, qk_norm: bool = False, norm_eps: float = 1e-5
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.layer_index = layer_index  # its slot in a KV cache
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)  # writes into the residual stream
        # QK-norm: one RMSNorm scale over head_dim, shared by all heads, applied before RoPE.
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``x`` ``[batch, seq, dim]`` -> ``[batch, seq, dim]``; ``cos``/``sin`` ``[seq, head_dim]`` for its positions.

        ``mask`` (True = may attend) and ``is_causal`` come from :func:`attention_mask`.
        """
        batch, seq, _ = x.shape
        # Head counts come from the projections' outputs, not from n_heads / n_kv_heads: under
        # tensor parallelism wq/wk/wv hold this rank's heads only (n_heads / tp and n_kv_heads / tp).
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # [B, H, T, Dh]
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # [B, KV, T, Dh]
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # [B, KV, T, Dh]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_index, k, v)  # [B, KV, S, Dh], S = cached + T
        if self.context_parallel is not None:  # after RoPE (global positions), before repeat_kv (fewer heads)
            k, v = self.context_parallel.gather(k, dim=2), self.context_parallel.gather(v, dim=2)  # [B, KV, T*cp, Dh]
        # The group size n_heads / n_kv_heads is the same on local heads (tp divides both).
        k, v = repeat_kv(k, self.n_heads // self.n_kv_heads), repeat_kv(v, self.n_heads // self.n_kv_heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)  # [B, H, T, Dh]
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, init: Initializer) -> None:
        """Projections ``normal(0, init.std)``, the residual projection ``wo``
        ``normal(0, init.residual_std)``, the QK-norm scales 1."""
        for linear in (self.wq, self.wk, self.wv):
            init.normal(linear.weight, init.std)
        init.normal(self.wo.weight, init.residual_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                init.ones(norm.weight)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, KV, S, Dh]`` -> ``[B, KV * groups, S, Dh]``: key/value head ``j`` serves query heads ``j*groups ...``.

    Explicit rather than SDPA's ``enable_gqa`` so that every SDPA backend (and a custom mask) accepts it.
    """
    if groups == 1:
        return x
    batch, heads, seq, head_dim = x.shape
    return x[:, :, None].expand(batch, heads, groups, seq, head_dim).reshape(batch, heads * groups, seq, head_dim)


def attention_mask(
    document_ids: torch.Tensor | None, start: int, length: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """``(mask, is_causal)`` for SDPA, for ``length`` queries at positions ``[start, start + length)``.

    - No documents, no cached prefix: plain causal attention (``is_causal``, no mask tensor, so
      SDPA can use its fused kernels).
    - ``document_ids`` ``[B, T]`` (packed sequences): a boolean ``[B, 1, T, T]`` mask where query
      ``i`` sees key ``j`` iff ``j <= i`` and both belong to the same document. Every query sees
      at least itself, so no row is empty. RoPE is relative, so documents need no position reset.
      When every row holds one document the mask is plain causal attention, and is dropped so
      that SDPA can use its fused causal kernels (documents much longer than a sequence, the
      common case, make most batches like that).
    - A cached prefix (``start > 0``): one new token sees every key (no mask); several new tokens
      get a ``[T, start + T]`` mask where query ``i`` sees keys ``j <= start + i`` (SDPA's
      ``is_causal`` would align the triangle to the top-left corner instead).
    """
    if document_ids is not None and not bool((document_ids == document_ids[:, :1]).all()):
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        same_document = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
        return (same_document & causal)[:, None], False
    if start == 0:
        return None, True
    if length == 1:
        return None, False
    query_pos = torch.arange(start, start + length, device=device)[:, None]
    key_pos = torch.arange(start + length, device=device)[None, :]
    return key_pos <= query_pos, False


def positional_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    query_documents: torch.Tensor | None,
    key_documents: torch.Tensor | None,
) -> torch.Tensor:
    """A boolean SDPA mask (True = may attend) from global positions: query ``i`` sees key ``j``
    iff ``key_positions[j] <= query_positions[i]`` and, with documents ``[B, Tq]``/``[B, Tk]``,
    both belong to the same one. ``[Tq, Tk]``, or ``[B, 1, Tq, Tk]`` with documents. Each query
    sees at least its own key, so no row is empty. For tokens held in any order, such as a
    context-parallel rank's slice and the keys gathered from its group."""
    causal = key_positions[None, :] <= query_positions[:, None]  # [Tq, Tk]
    if query_documents is None or key_documents is None:
        return causal
    same_document = query_documents[:, :, None] == key_documents[:, None, :]  # [B, Tq, Tk]
    return (same_document & causal)[:, None]
