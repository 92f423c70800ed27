"""Gated cross-attention (Llama 3.2 Vision, "Mllama"), and the join that inserts such layers
between the blocks of any language family.

:class:`GatedCrossAttention` is a generic component: text (the queries) attends to the states
of any encoder (keys and values), ``[B, S, D_enc]``, through grouped-query attention with a
per-head RMSNorm on queries and keys, then a SwiGLU feed-forward, each added to the residual
stream through ``tanh(gate)``. Both gates start at zero, so a fresh layer is the identity and a
model that gains such layers starts from its language model's function.

:func:`join_cross_attention` places the layers: every ``k`` blocks, or at Mllama's explicit
``cross_attention_layers`` (indices in the combined list of self- and cross-attention layers).
It wraps blocks of a family that declares :class:`~forge_lm.components.WrapsBlocks` (Forge's
``llama`` does): the wrapped block runs its cross-attention layers before or after itself,
reading the encoder states of the current forward from a shared :class:`CrossAttentionFeed`.
The block stays the unit FSDP2 shards and activation checkpointing reruns (a rerun reads the
same feed: it is replaced only by the next forward).

Masks (:func:`marker_visibility`): a text token sees the sources (images) of its own document
whose marker is at or before it. A row that sees nothing gets a zero output from both parts
(Meta's reference and Mllama's ``full_text_row_masked_out_mask``); ``empty_rows =
"attend_all"`` reproduces transformers' Mllama instead, whose attention part lets such rows
attend to every state of the batch row (only the feed-forward part is masked there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from forge_lm.api import Linear, RMSNorm, SwiGLU, repeat_kv
from forge_lm.errors import ForgeError

if TYPE_CHECKING:
    from forge_lm.components import Initializer

EMPTY_ROWS = ("zero", "attend_all")


class GatedCrossAttention(nn.Module):
    """``h = x + tanh(attn_gate) * attend(norm(x), states)``, then
    ``h + tanh(ffn_gate) * seen * ffn(norm(h))``, where ``seen`` is 1 for rows that see some state.

    ``x`` ``[B, T, dim]``; ``states`` ``[B, S, encoder_dim]``; ``mask`` ``[B, T, S]`` boolean
    (True: may attend), or None (every row sees every state). Queries have ``n_heads`` heads,
    keys and values ``n_kv_heads`` (each serves ``n_heads / n_kv_heads`` consecutive query
    heads), all of size ``head_dim``; no positions (the states are a set, not a sequence)."""

    def __init__(
        self,
        dim: int,
        encoder_dim: int,
        n_heads: int,
        n_kv_heads: int,
        ffn_hidden: int,
        *,
        head_dim: int | None = None,
        norm_eps: float = 1e-5,
        empty_rows: str = "zero",
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ForgeError(f"cross-attention: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads}).")
        if empty_rows not in EMPTY_ROWS:
            raise ForgeError(f"cross-attention: empty_rows must be one of {EMPTY_ROWS}, got {empty_rows!r}.")
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = head_dim if head_dim is not None else dim // n_heads
        self.empty_rows = empty_rows
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.wq = Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = Linear(encoder_dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = Linear(encoder_dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = Linear(n_heads * self.head_dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, norm_eps)
        self.k_norm = RMSNorm(self.head_dim, norm_eps)
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.feed_forward = SwiGLU(dim, ffn_hidden)
        self.ffn_gate = nn.Parameter(torch.zeros(1))

    def keys_values(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (normed) and values of ``states`` ``[B, S, encoder_dim]``: ``[B, KV, S, Dh]``
        each. Computed once per set of states (a decoding cache keeps them)."""
        batch, length, _ = states.shape
        k = self.wk(states).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(states).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return self.k_norm(k), v

    def forward(
        self,
        x: torch.Tensor,
        states: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        *,
        keys_values: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``x`` with the layer's two gated residual updates; ``keys_values`` (from
        :meth:`keys_values`) instead of ``states`` skips their projection."""
        if keys_values is None:
            if states is None:
                raise ForgeError("cross-attention needs the encoder states (or their cached keys and values).")
            keys_values = self.keys_values(states)
        k, v = keys_values
        batch, seq, _ = x.shape
        if mask is not None and mask.shape != (batch, seq, k.shape[2]):
            raise ForgeError(
                f"cross-attention mask {tuple(mask.shape)} must be [batch, text, states] = {(batch, seq, k.shape[2])}."
            )
        q = self.wq(self.attention_norm(x)).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        q = self.q_norm(q)  # [B, H, T, Dh]
        groups = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        seen = None
        attn_mask = None
        if mask is not None:
            seen = mask.any(dim=-1, keepdim=True)  # [B, T, 1]: rows that see some state
            # A row that sees nothing attends to every state (SDPA would give NaN on an empty
            # row); its result is then zeroed, or kept as transformers' Mllama does.
            attn_mask = (mask | ~seen)[:, None]  # [B, 1, T, S]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [B, H, T, Dh]
        out = self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        if seen is not None and self.empty_rows == "zero":
            out = out * seen.to(out.dtype)
        h = x + torch.tanh(self.attn_gate) * out
        ffn = self.feed_forward(self.ffn_norm(h))
        if seen is not None:
            ffn = ffn * seen.to(ffn.dtype)
        return h + torch.tanh(self.ffn_gate) * ffn

    def init_weights(self, init: Initializer) -> None:
        """Projections ``normal(0, init.std)`` (``wo`` and the feed-forward's down projection
        ``init.residual_std``), norm scales 1, both gates 0: the layer starts as the identity."""
        for weight in (self.wq.weight, self.wk.weight, self.wv.weight):
            init.normal(weight, init.std)
        init.normal(self.wo.weight, init.residual_std)
        for norm in (self.attention_norm, self.q_norm, self.k_norm, self.ffn_norm):
            init.ones(norm.weight)
        init.module(self.feed_forward)
        init.zeros(self.attn_gate)
        init.zeros(self.ffn_gate)


# -- what a forward feeds the layers ----------------------------------------------------------


class CrossAttentionFeed:
    """What the cross-attention layers of one model read in a forward: the encoder states
    ``[B, S, D_enc]`` and the mask ``[B, T, S]`` (or None: every row sees every state), or a
    decoding cache holding the keys and values computed at the prefill. None of them: the
    layers are skipped (a text-only forward is the language model alone).

    Set by the model before each forward and left in place after it, so that activation
    checkpointing's rerun in backward reads the same tensors."""

    def __init__(self) -> None:
        self.states: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def set(
        self,
        states: torch.Tensor | None,
        mask: torch.Tensor | None,
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.states, self.mask, self.cache = states, mask, cache

    def run(self, index: int, layer: GatedCrossAttention, x: torch.Tensor) -> torch.Tensor:
        """Cross-attention layer number ``index`` on ``x``, from the states or the cache."""
        if self.states is not None:
            keys_values = layer.keys_values(self.states)
            if self.cache is not None:  # a prefill: keep them for the tokens decoded next
                self.cache[index] = keys_values
        elif self.cache is not None and index in self.cache:
            keys_values = self.cache[index]
        else:
            return x
        return layer(x, mask=self.mask, keys_values=keys_values)


class CrossAttendingBlock(nn.Module):
    """A block of the language family with cross-attention layers run before and/or after it.

    Called as the block is (the hidden state first, the family's other arguments passed on),
    it returns what the block returns; ``attention`` and ``feed_forward`` are the block's, for
    the model's masks and the capability checks that look at them."""

    def __init__(
        self,
        block: nn.Module,
        feed: CrossAttentionFeed,
        before: list[tuple[int, GatedCrossAttention]],
        after: list[tuple[int, GatedCrossAttention]],
    ) -> None:
        super().__init__()
        self.block = block
        self.cross_before = nn.ModuleList(layer for _, layer in before)
        self.cross_after = nn.ModuleList(layer for _, layer in after)
        # The layers' numbers in the feed's cache (not modules: a plain attribute).
        self.before_indices = [index for index, _ in before]
        self.after_indices = [index for index, _ in after]
        self._feed = feed

    @property
    def attention(self) -> Any:
        return getattr(self.block, "attention", None)

    @property
    def feed_forward(self) -> Any:
        return getattr(self.block, "feed_forward", None)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        for index, layer in zip(self.before_indices, self.cross_before, strict=True):
            x = self._feed.run(index, layer, x)
        x = self.block(x, *args, **kwargs)
        for index, layer in zip(self.after_indices, self.cross_after, strict=True):
            x = self._feed.run(index, layer, x)
        return x

    def init_weights(self, init: Initializer) -> None:
        init.module(self.block)
        for layer in [*self.cross_before, *self.cross_after]:
            init.module(layer)


# -- placement --------------------------------------------------------------------------------


def placement(n_blocks: int, every: int | None, combined: list[int] | None) -> list[tuple[int, str]]:
    """Where each cross-attention layer runs, in order: ``(block index, "before" | "after")``.

    ``every = k``: after blocks ``k-1, 2k-1, ...``. ``combined``: Mllama's
    ``cross_attention_layers``, indices into the list of ``n_blocks + len(combined)`` layers in
    which the cross-attention layers stand among the blocks."""
    if combined is None:
        if every is None or every < 1:
            raise ForgeError(f"cross-attention: every_n_blocks must be >= 1, got {every}.")
        return [(i, "after") for i in range(every - 1, n_blocks, every)]
    total = n_blocks + len(combined)
    if len(set(combined)) != len(combined) or any(not 0 <= c < total for c in combined):
        raise ForgeError(
            f"cross_attention_layers {combined} must be distinct indices below {total} "
            f"({n_blocks} blocks + {len(combined)} cross-attention layers)."
        )
    places = []
    for rank, c in enumerate(sorted(combined)):
        blocks_before = c - rank  # self-attention blocks that precede this layer
        places.append((blocks_before - 1, "after") if blocks_before > 0 else (0, "before"))
    return places


def combined_indices(places: list[tuple[int, str]]) -> list[int]:
    """Mllama's ``cross_attention_layers`` of :func:`placement`'s result (its inverse)."""
    out = []
    for rank, (block, where) in enumerate(places):
        out.append(rank + (block + 1 if where == "after" else block))
    return out


def join_cross_attention(
    language: nn.Module, layers: list[GatedCrossAttention], places: list[tuple[int, str]], family: str
) -> CrossAttentionFeed:
    """Insert ``layers`` into ``language`` (a model of family ``family``) at ``places``
    (:func:`placement`), numbered in that order; returns the feed their forwards read.

    The family must declare :class:`~forge_lm.components.ShardedByBlocks` and
    :class:`~forge_lm.components.WrapsBlocks`; one that does not is refused, named."""
    from forge_lm.components import ShardedByBlocks, WrapsBlocks

    if not isinstance(language, ShardedByBlocks) or not isinstance(language, WrapsBlocks):
        raise ForgeError(
            f"cross-attention layers cannot join the language family '{family}' ({type(language).__name__}): it does "
            "not declare blocks() and wrap_blocks(wrap) (forge_lm.components.ShardedByBlocks, WrapsBlocks), so there "
            "is no place between its blocks to insert them. Choose a family that does ([model.language] name = "
            "'llama'), or add those methods to it."
        )
    n_blocks = len(language.blocks())
    if any(block >= n_blocks for block, _ in places):
        raise ForgeError(f"cross-attention placement {places} reaches past the language model's {n_blocks} blocks.")
    feed = CrossAttentionFeed()
    by_block: dict[int, dict[str, list[tuple[int, GatedCrossAttention]]]] = {}
    for index, ((block, where), layer) in enumerate(zip(places, layers, strict=True)):
        by_block.setdefault(block, {"before": [], "after": []})[where].append((index, layer))

    def wrap(index: int, block: nn.Module) -> nn.Module:
        if index not in by_block:
            return block
        return CrossAttendingBlock(block, feed, by_block[index]["before"], by_block[index]["after"])

    language.wrap_blocks(wrap)
    return feed


# -- masks ------------------------------------------------------------------------------------


def marker_visibility(
    input_ids: torch.Tensor,
    marker_id: int,
    source_mask: torch.Tensor,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, T, M]`` boolean: token ``t`` of row ``b`` sees source ``j`` (an image).

    Source ``j`` of a row (``source_mask`` ``[B, M]``, True for a real one, real ones first)
    belongs to the row's ``j``-th ``marker_id`` token; a token sees it when that marker stands
    at or before the token in the token's own document (``document_ids`` ``[B, T]``). A row
    whose markers and real sources differ in number is refused."""
    batch, seq = input_ids.shape
    markers = input_ids == marker_id  # [B, T]
    counts, real = markers.sum(dim=1), source_mask.sum(dim=1)
    if not torch.equal(counts, real):
        row = int((counts != real).nonzero()[0, 0])
        raise ForgeError(
            f"row {row} has {int(counts[row])} image markers (id {marker_id}) but {int(real[row])} images; each "
            "image needs one marker, in the order of the images."
        )
    max_sources = source_mask.shape[1]
    # The j-th marker's position in each row (seq where there is none: seen by no token).
    ordinal = markers.cumsum(dim=1) - 1  # [B, T]: the index of the last marker so far
    positions = torch.full((batch, max_sources + 1), seq, dtype=torch.long, device=input_ids.device)
    slot = torch.where(markers, ordinal, max_sources)  # non-markers write into a spare column
    token = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    positions.scatter_(1, slot, token)
    positions = positions[:, :max_sources]  # [B, M]
    sees = positions[:, None, :] <= token[:, :, None]  # [B, T, M]
    if document_ids is not None:
        source_doc = document_ids.gather(1, positions.clamp(max=seq - 1))  # [B, M]
        sees = sees & (source_doc[:, None, :] == document_ids[:, :, None])
    return sees & source_mask[:, None, :].bool()
