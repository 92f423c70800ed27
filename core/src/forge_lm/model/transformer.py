"""The dense decoder-only transformer (Llama layout) and :func:`build_model`, its one constructor.

Layout: token embedding -> ``n_layers`` pre-norm blocks (``x + attention(norm(x))``, then
``x + feed_forward(norm(x))``) -> final norm -> output head. The feed-forward layer of every
block is a registered ``feed_forwards`` component, so plugins (mixture of experts, ...) change
it without touching this file. Parameter names follow Meta's Llama (``tok_embeddings``,
``layers.N.attention.wq``, ``layers.N.feed_forward.w1``, ``output``); :mod:`forge_lm.model.hf`
maps them onto Hugging Face's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from forge_lm.config import ModelSection
from forge_lm.errors import ForgeError, PluginError
from forge_lm.model.attention import Attention, attention_mask
from forge_lm.model.kv_cache import KVCache
from forge_lm.model.norms import build_norm
from forge_lm.model.rope import RotaryEmbedding


class Block(nn.Module):
    """One pre-norm transformer block: attention, then the feed-forward layer, each on a residual."""

    def __init__(self, config: ModelSection, layer_index: int, feed_forward: nn.Module) -> None:
        super().__init__()
        self.attention_norm = build_norm(config.norm, config.dim, config.norm_eps)
        self.attention = Attention(
            config.dim, config.n_heads, config.kv_heads, layer_index, qk_norm=config.qk_norm, norm_eps=config.norm_eps
        )
        self.ffn_norm = build_norm(config.norm, config.dim, config.norm_eps)
        self.feed_forward = feed_forward

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        # x: [batch, seq, dim] throughout
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, is_causal, kv_cache)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self, std: float, residual_std: float) -> None:
        self.attention.init_weights(std, residual_std)
        for norm in (self.attention_norm, self.ffn_norm):
            nn.init.ones_(norm.weight)
        init = getattr(self.feed_forward, "init_weights", None)
        if callable(init):  # the layer knows which of its projections write into the residual stream
            init(std, residual_std)
        else:
            for module in self.feed_forward.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, mean=0.0, std=std)


class Transformer(nn.Module):
    """Decoder-only language model; build it with :func:`build_model`.

    ``forward(input_ids [B, T], document_ids [B, T] | None, kv_cache) -> logits [B, T, vocab]``.
    Weights are created in fp32; mixed precision is the caller's ``torch.autocast``, under which
    the logits come out in the autocast dtype (losses upcast them).
    """

    def __init__(self, config: ModelSection, vocab_size: int, feed_forwards: Sequence[nn.Module]) -> None:
        super().__init__()
        if len(feed_forwards) != config.n_layers:
            raise ForgeError(
                f"the model has {config.n_layers} layers but got {len(feed_forwards)} feed-forward layers."
            )
        self.config = config
        self.vocab_size = vocab_size
        self.tok_embeddings = nn.Embedding(vocab_size, config.dim)
        self.rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
        self.layers = nn.ModuleList(Block(config, i, ffn) for i, ffn in enumerate(feed_forwards))
        self.norm = build_norm(config.norm, config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one tensor, [vocab, dim], in both places
        self.init_weights()

    @property
    def tied(self) -> bool:
        if self.output is None or self.tok_embeddings is None:  # a pipeline stage holds at most one of them
            return False
        return self.output.weight is self.tok_embeddings.weight

    def init_weights(self) -> None:
        """Scaled init: matrices and the embedding ``normal(0, init_std)``, residual projections
        (attention ``wo``, the feed-forward's down projection) ``normal(0, init_std / sqrt(2 * n_layers))``
        so the residual stream's variance does not grow with depth (GPT-2), norm scales 1.

        Draws in a fixed order (embedding, layers in order, head), so ``torch.manual_seed`` makes
        it deterministic.
        """
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for layer in self.layers:
            layer.init_weights(std, residual_std)
        nn.init.ones_(self.norm.weight)
        if not self.tied:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)
        self.rope.reset_tables()

    def new_kv_cache(self, max_len: int | None = None) -> KVCache:
        """An empty cache for up to ``max_len`` tokens (default ``max_seq_len``)."""
        return KVCache(max_len if max_len is not None else self.config.max_seq_len)

    def forward(
        self,
        input_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` for ``input_ids`` ``[B, T]``.

        ``document_ids`` ``[B, T]`` (packed sequences): a token attends only to earlier tokens of
        its own document. ``kv_cache``: the tokens continue those already cached (positions
        start at ``kv_cache.length``) and their keys and values are added to it.

        A pipeline stage (:mod:`forge_lm.distributed.pipeline`) is this model with the parts
        other stages hold set to ``None`` and ``layers`` a ``ModuleDict`` of its own blocks:
        without ``tok_embeddings`` the input is the previous stage's hidden state
        ``[B, T, dim]``; without ``output`` (and ``norm``) the result is the hidden state.
        """
        embeds = self.tok_embeddings is not None
        if input_ids.ndim != (2 if embeds else 3):
            expected = "[batch, seq]" if embeds else "a hidden state [batch, seq, dim]"
            raise ForgeError(f"input_ids must be {expected}; got shape {tuple(input_ids.shape)}.")
        seq = input_ids.shape[1]
        start = kv_cache.length if kv_cache is not None else 0
        self._check_lengths(start, seq)
        if kv_cache is not None:
            kv_cache.check_room(seq)
        if document_ids is not None:
            if kv_cache is not None:
                raise ForgeError("document_ids and kv_cache cannot be combined; decode one document at a time.")
            if document_ids.shape != input_ids.shape[:2]:
                raise ForgeError(
                    f"document_ids {tuple(document_ids.shape)} must have the shape of input_ids "
                    f"{tuple(input_ids.shape[:2])}."
                )
        mask, is_causal = attention_mask(document_ids, start, seq, input_ids.device)
        cos, sin = self.rope(start, seq)  # [T, head_dim] each
        h = self.tok_embeddings(input_ids) if embeds else input_ids  # [B, T, dim]
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in layers:
            h = layer(h, cos, sin, mask, is_causal, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(seq)
        if self.output is None:  # a pipeline stage before the last: the next stage goes on from h
            return h
        return self.output(self.norm(h))  # [B, T, vocab]

    def _check_lengths(self, start: int, seq: int) -> None:
        limit = self.config.max_seq_len
        if start + seq > limit:
            where = f"{start} cached + {seq} new tokens" if start else f"a sequence of {seq} tokens"
            raise ForgeError(
                f"{where} exceeds the model's max_seq_len ({limit}); shorten the input or raise "
                "[model] max_seq_len (RoPE tables are built up to it)."
            )


def build_model(config: ModelSection, vocab_size: int, registry: Any) -> Transformer:
    """The model of ``config`` with a ``vocab_size`` vocabulary, initialised (seed first for determinism).

    The feed-forward layer of block ``i`` is ``registry.resolve("feed_forwards", config.ffn.name)
    .build(options, config.dim, i)``; unset options (``ComponentConfig(name)`` built in code) mean
    the component's defaults.
    """
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ForgeError(f"vocab_size must be a positive integer, got {vocab_size!r}; set [model] vocab_size.")
    component = registry.resolve("feed_forwards", config.ffn.name)
    options = config.ffn.options if config.ffn.options is not None else component.options_class()
    feed_forwards = [component.build(options, config.dim, i) for i in range(config.n_layers)]
    for i, ffn in enumerate(feed_forwards):
        if not isinstance(ffn, nn.Module):
            raise PluginError(
                f"feed-forward '{config.ffn.name}' returned {type(ffn).__name__} for layer {i}, not a "
                "torch.nn.Module; its factory must return a module mapping [batch, seq, dim] to the same shape."
            )
    return Transformer(config, vocab_size, feed_forwards)
