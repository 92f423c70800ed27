"""The dense decoder-only transformer (Llama layout) and :func:`build_model`, its one constructor.

Layout: token embedding -> ``n_layers`` pre-norm blocks (``x + attention(norm(x))``, then
``x + feed_forward(norm(x))``) -> final norm -> output head. The feed-forward layer of every
block is a registered ``feed_forwards`` component, so plugins (mixture of experts, ...) change
it without touching this file. Parameter names follow Meta's Llama (``tok_embeddings``,
``layers.N.attention.wq``, ``layers.N.feed_forward.w1``, ``output``); :mod:`forge_lm.model.hf`
maps them onto Hugging Face's.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from forge_lm.config import ModelSection
from forge_lm.errors import ForgeError, PluginError
from forge_lm.model.attention import Attention, attention_mask, compute_dtype, positional_mask
from forge_lm.model.init import initialize
from forge_lm.model.kv_cache import KVCache
from forge_lm.model.linear import Linear
from forge_lm.model.norms import build_norm
from forge_lm.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from forge_lm.components import Initializer
    from forge_lm.distributed.context_parallel import ContextParallel


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

    def init_weights(self, init: Initializer) -> None:
        self.attention.init_weights(init)
        for norm in (self.attention_norm, self.ffn_norm):
            init.ones(norm.weight)
        # The layer's own init_weights(init) knows which of its projections write into the
        # residual stream; without one, the default rule (linear weights normal(0, std), biases 0).
        init.module(self.feed_forward)


class Transformer(nn.Module):
    """Decoder-only language model; build it with :func:`build_model` (the constructor allocates
    the parameters but leaves Forge's initialisation, :meth:`init_weights`, to it).

    ``forward(input_ids [B, T], document_ids [B, T] | None, kv_cache) -> logits [B, T, vocab]``.
    Weights are created in fp32; mixed precision is the caller's ``torch.autocast``, under which
    the logits come out in the autocast dtype (losses upcast them).
    """

    # Set by forge_lm.distributed.context_parallel.enable_context_parallel: this rank then holds
    # a slice of each sequence and its attention layers gather the group's keys and values.
    context_parallel: ContextParallel | None = None

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
        self.output = Linear(config.dim, vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one tensor, [vocab, dim], in both places

    @property
    def tied(self) -> bool:
        if self.output is None or self.tok_embeddings is None:  # a pipeline stage holds at most one of them
            return False
        return self.output.weight is self.tok_embeddings.weight

    def init_weights(self, init: Initializer) -> None:
        """Scaled init: matrices and the embedding ``normal(0, init_std)``, residual projections
        (attention ``wo``, the feed-forward's down projection) ``normal(0, init_std / sqrt(2 * n_layers))``
        (``init.residual_std``) so the residual stream's variance does not grow with depth (GPT-2),
        norm scales 1, the RoPE tables recomputed.

        Every value comes from ``init`` (:mod:`forge_lm.model.init`): it depends on the seed and the
        parameter's name only, so this model, a pipeline stage of it (the parts it holds) and any
        sharded layout start from the same weights.
        """
        if self.tok_embeddings is not None:
            init.normal(self.tok_embeddings.weight, init.std)
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in layers:
            layer.init_weights(init)
        if self.norm is not None:
            init.ones(self.norm.weight)
        if self.output is not None and not self.tied:
            init.normal(self.output.weight, init.std)
        self.rope.init_weights(init)

    def new_kv_cache(self, max_len: int | None = None) -> KVCache:
        """An empty cache for up to ``max_len`` tokens (default ``max_seq_len``)."""
        return KVCache(max_len if max_len is not None else self.config.max_seq_len)

    def forward(
        self,
        input_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` for ``input_ids`` ``[B, T]``.

        ``positions`` ``[T]``: the tokens' positions in their sequences, when they are not
        ``0 .. T-1`` (RoPE rotates by them and the causal mask compares them). Required under
        context parallelism, where ``input_ids`` (and ``document_ids``) are this rank's slice of
        the sequences (:meth:`ContextParallel.shard`) and keys come from the whole group.

        ``document_ids`` ``[B, T]`` (packed sequences): a token attends only to earlier tokens of
        its own document (through SDPA, FlexAttention or eager attention,
        ``[model] attention_backend``; under context parallelism always SDPA). ``kv_cache``: the
        tokens continue those already cached (positions start at ``kv_cache.length``) and their
        keys and values are added to it.

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
        if positions is not None or self.context_parallel is not None:
            mask, cos, sin = self._positional_attention(positions, document_ids, kv_cache, seq)
            is_causal = False
        else:
            # Built once here and shared by every layer: a dense mask or a FlexAttention BlockMask.
            device = input_ids.device
            mask, is_causal = attention_mask(
                document_ids, start, seq, device, self.config.attention_backend, compute_dtype(device)
            )
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

    def _positional_attention(
        self,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        kv_cache: KVCache | None,
        seq: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mask, cos, sin)`` for tokens at explicit ``positions``; under context parallelism
        the mask's keys are the group's, in the order the attention layers gather them. Always a
        dense SDPA mask (:func:`positional_mask`), whatever ``attention_backend`` says."""
        cp = self.context_parallel
        if positions is None:
            raise ForgeError(
                "under context parallelism the model takes this rank's slice of each sequence with its "
                "global positions: pass positions (ContextParallel.shard(batch) gives both)."
            )
        if kv_cache is not None:
            raise ForgeError("positions (and context parallelism) cannot be combined with a kv_cache.")
        if positions.shape != (seq,):
            raise ForgeError(
                f"positions must have shape [{seq}] (one per token of a row); got {tuple(positions.shape)}."
            )
        self._check_lengths(0, seq * (cp.size if cp is not None else 1))
        key_positions = cp.gather_ids(positions, dim=0) if cp is not None else positions
        key_documents = None
        if document_ids is not None:
            key_documents = cp.gather_ids(document_ids, dim=1) if cp is not None else document_ids
            # Decided on the whole sequences, so every rank of the group decides alike.
            if bool((key_documents == key_documents[:, :1]).all()):
                document_ids = key_documents = None
        cos, sin = self.rope.at(positions)
        return positional_mask(positions, key_positions, document_ids, key_documents), cos, sin

    def _check_lengths(self, start: int, seq: int) -> None:
        limit = self.config.max_seq_len
        if start + seq > limit:
            where = f"{start} cached + {seq} new tokens" if start else f"a sequence of {seq} tokens"
            raise ForgeError(
                f"{where} exceeds the model's max_seq_len ({limit}); shorten the input or raise "
                "[model] max_seq_len (RoPE tables are built up to it)."
            )


def build_model(
    config: ModelSection,
    vocab_size: int,
    registry: Any,
    *,
    seed: int | None = None,
    device: torch.device | str | None = None,
) -> Transformer:
    """The model of ``config`` with a ``vocab_size`` vocabulary, initialised from ``seed``.

    The feed-forward layer of block ``i`` is ``registry.resolve("feed_forwards", config.ffn.name)
    .build(options, config.dim, i)``; unset options (``ComponentConfig(name)`` built in code) mean
    the component's defaults.

    ``seed``: the run's seed; None takes ``torch.initial_seed()``, the seed ``torch.manual_seed``
    last set, so ``torch.manual_seed(s); build_model(...)`` is ``build_model(..., seed=s)``. Each
    value depends on the seed and its parameter's name only (:mod:`forge_lm.model.init`).
    ``device``: where the tensors are created (default: torch's default device). On ``"meta"``
    nothing is allocated or initialised: transform the model, then
    :func:`forge_lm.model.init.materialize` it (what a sharded run does).
    """
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ForgeError(f"vocab_size must be a positive integer, got {vocab_size!r}; set [model] vocab_size.")
    # Constructors draw default values from torch's global generator (nn.Linear's own init),
    # except on the meta device: fork it, so that what comes after the build draws the same
    # numbers whatever the layout.
    place = torch.device(device) if device is not None else None
    cuda = (
        [place.index if place.index is not None else torch.cuda.current_device()]
        if place and place.type == "cuda"
        else []
    )
    with torch.random.fork_rng(devices=cuda), place if place is not None else contextlib.nullcontext():
        model = _construct(config, vocab_size, registry)
    if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        initialize(model, torch.initial_seed() if seed is None else seed)
    return model


def _construct(config: ModelSection, vocab_size: int, registry: Any) -> Transformer:
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
