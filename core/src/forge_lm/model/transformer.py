"""The decoder-only transformer (Llama layout), the ``llama`` model family, and
:func:`build_model`, the one way to construct any family's model.

Layout: token embedding -> ``n_layers`` pre-norm blocks (``x + attention(norm(x))``, then
``x + feed_forward(norm(x))``) -> final norm -> output head. The attention and the
feed-forward layer of every block are registered ``attentions`` and ``feed_forwards``
components, so plugins (mixture of experts, latent attention, ...) change them without
touching this file; a plugin's model family may subclass :class:`Transformer` and keep every
capability the training path asks of a model (:mod:`forge_lm.components`). Parameter names
follow Meta's Llama (``tok_embeddings``, ``layers.N.attention.wq``, ``layers.N.feed_forward.w1``,
``output``); :mod:`forge_lm.model.hf` maps them onto Hugging Face's.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from forge_lm.components import (
    AttentionSpec,
    ContextParallelAttention,
    ModelContext,
    RotaryAttention,
)
from forge_lm.config import ComponentConfig, LlamaOptions, ModelSection
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

    def __init__(
        self, config: ModelSection, layer_index: int, feed_forward: nn.Module, attention: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.attention_norm = build_norm(config.norm, config.dim, config.norm_eps)
        if attention is None:
            attention = Attention(
                config.dim,
                config.n_heads,
                config.kv_heads,
                layer_index,
                qk_norm=config.qk_norm,
                norm_eps=config.norm_eps,
            )
        self.attention = attention
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
        init.module(self.attention)
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

    # Set by set_context_parallel (which forge_lm.distributed.context_parallel.enable_context_parallel
    # calls): this rank then holds a slice of each sequence and its attention layers gather the
    # group's keys and values.
    context_parallel: ContextParallel | None = None

    def __init__(
        self,
        config: ModelSection,
        vocab_size: int,
        feed_forwards: Sequence[nn.Module],
        attentions: Sequence[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        if len(feed_forwards) != config.n_layers:
            raise ForgeError(
                f"the model has {config.n_layers} layers but got {len(feed_forwards)} feed-forward layers."
            )
        if attentions is not None and len(attentions) != config.n_layers:
            raise ForgeError(f"the model has {config.n_layers} layers but got {len(attentions)} attention layers.")
        self.config = config
        self.vocab_size = vocab_size
        self.tok_embeddings = nn.Embedding(vocab_size, config.dim)
        per_layer = attentions if attentions is not None else [None] * config.n_layers
        self.layers = nn.ModuleList(
            Block(config, i, ffn, attention)
            for i, (ffn, attention) in enumerate(zip(feed_forwards, per_layer, strict=True))
        )
        self.rope = RotaryEmbedding(self._rope_dim(), config.max_seq_len, config.rope_theta)
        self.norm = build_norm(config.norm, config.dim, config.norm_eps)
        self.output = Linear(config.dim, vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one tensor, [vocab, dim], in both places

    @property
    def tied(self) -> bool:
        if self.output is None or self.tok_embeddings is None:  # a pipeline stage holds at most one of them
            return False
        return self.output.weight is self.tok_embeddings.weight

    def _rope_dim(self) -> int:
        """The RoPE tables' width: the head size, or what the attention layers declare
        (:class:`~forge_lm.components.RotaryAttention`); one table serves every layer."""
        dims = {
            layer.attention.rope_dim if isinstance(layer.attention, RotaryAttention) else self.config.head_size
            for layer in self.layers
        }
        if len(dims) > 1:
            raise ForgeError(f"the attention layers want RoPE tables of different widths {sorted(dims)}; use one kind.")
        return dims.pop() if dims else self.config.head_size

    # -- the capabilities the training path asks a model for (forge_lm.components) ----------

    def blocks(self) -> list[nn.Module]:
        """The blocks in order (a pipeline stage: the ones it holds)."""
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        return [block for block in layers if block is not None]

    def wrap_blocks(self, wrap: Callable[[int, nn.Module], nn.Module]) -> None:
        """Replace each block ``i`` by ``wrap(i, block)`` (:class:`~forge_lm.components.WrapsBlocks`):
        a module called as the block is, returning the hidden state. Keys (global indices) are kept."""
        if isinstance(self.layers, nn.ModuleDict):
            for key in list(self.layers.keys()):
                self.layers[key] = _wrapped(wrap, int(key), self.layers[key])
        else:
            self.layers = nn.ModuleList(_wrapped(wrap, i, block) for i, block in enumerate(self.layers))

    def set_context_parallel(self, context_parallel: ContextParallel | None) -> None:
        """Attend across ``context_parallel``'s group, or within this rank's tokens again (None)
        (:class:`~forge_lm.components.ContextParallelModel`): the model then takes a slice of each
        sequence with its ``positions``, and the attention layer of every block it holds (a
        pipeline stage: its own) gathers the group's keys and values. Refused, naming the layer,
        when a block's attention does not declare ``context_parallel``
        (:class:`~forge_lm.components.ContextParallelAttention`); nothing is set then."""
        attentions = [getattr(block, "attention", None) for block in self.blocks()]
        if context_parallel is not None:
            lacking = sorted({type(a).__name__ for a in attentions if not isinstance(a, ContextParallelAttention)})
            if lacking:
                raise ForgeError(
                    f"context parallelism: the blocks' attention layer {', '.join(lacking)} does not gather keys and "
                    "values across ranks (it declares no context_parallel attribute, ContextParallelAttention)."
                )
        for attention in attentions:
            if isinstance(attention, ContextParallelAttention):
                attention.context_parallel = context_parallel
        self.context_parallel = context_parallel

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """How ``tp`` splits the modules outside the blocks (those this model or stage holds):
        the embedding by vocabulary rows, the final norm over the sequence, the head by
        vocabulary (see :mod:`forge_lm.distributed.tensor_parallel`)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # The logits stay split over the vocabulary, a DTensor: a loss inside loss_parallel_for's
            # region takes them so; the transform's hook gathers them for every other caller.
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }
        return {name: style for name, style in plan.items() if getattr(self, name, None) is not None}

    def keep_stage(self, stage: int, stages: int) -> None:
        """Keep the parts pipeline stage ``stage`` of ``stages`` holds: its consecutive blocks
        (``layers`` becomes a ``ModuleDict`` keyed by their global indices, so parameter names
        stay the full model's), the embedding on the first stage, the final norm and the head
        on the last."""
        from forge_lm.distributed.pipeline import stage_layers

        kept = stage_layers(len(self.layers), stages, stage)
        self.layers = nn.ModuleDict({str(i): self.layers[i] for i in kept})
        if stage > 0:
            self.tok_embeddings = None
        if stage < stages - 1:
            self.norm = None
            self.output = None

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6 * active parameters`` (forward and backward of every
        weight matmul) plus attention's score and value products over the causal half of a
        sequence (:func:`forge_lm.model.flops.flops_per_token`)."""
        from forge_lm.model.flops import active_parameter_count, flops_per_token

        return flops_per_token(self.config, active_parameter_count(self), seq_len)

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
        for layer in self.blocks():
            layer.init_weights(init)
        if self.norm is not None:
            init.ones(self.norm.weight)
        if self.output is not None and not self.tied:
            init.normal(self.output.weight, init.std)
        self.rope.init_weights(init)

    @property
    def max_seq_len(self) -> int:
        """[model] max_seq_len, the longest sequence it takes (:class:`~forge_lm.components.GenerationLimits`)."""
        return self.config.max_seq_len

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
        h = self.tok_embeddings(input_ids) if embeds else input_ids  # [B, T, dim]
        return self._run_blocks(h, input_ids, document_ids, kv_cache, positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings ``[B, T, dim]`` of ``input_ids`` ``[B, T]``: what :meth:`forward`
        runs the blocks on, for a model that places other embeddings among them (images)."""
        if self.tok_embeddings is None:
            raise ForgeError("this pipeline stage holds no token embedding; only the first stage embeds.")
        if input_ids.ndim != 2:
            raise ForgeError(f"input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}.")
        return self.tok_embeddings(input_ids)

    def forward_embeddings(
        self,
        embeddings: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` from the embeddings ``[B, T, dim]`` on: the blocks, the final norm and
        the head (a stage before the last: the hidden state). The arguments are :meth:`forward`'s."""
        if embeddings.ndim != 3:
            raise ForgeError(f"embeddings must be [batch, seq, dim]; got shape {tuple(embeddings.shape)}.")
        return self._run_blocks(embeddings, embeddings, document_ids, kv_cache, positions)

    def _run_blocks(
        self,
        h: torch.Tensor,
        input_ids: torch.Tensor,
        document_ids: torch.Tensor | None,
        kv_cache: KVCache | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """The blocks, final norm and head on ``h``. ``input_ids`` gives the batch and sequence
        sizes and the device that positions and masks take: the token ids ``forward`` embedded,
        whose sequence is whole where tensor parallelism hands ``h`` to the blocks as this rank's
        slice of it (sequence parallelism), or ``h`` itself."""
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
            cos, sin = self.rope(start, seq)  # [T, rope_dim] each
        masks = {None: (mask, is_causal)}

        def mask_for(layer: nn.Module) -> tuple[Any, bool]:
            # A windowed layer's mask is built once per forward for its window and shared by
            # every layer with that window. The attribute is WindowedAttention's whole protocol;
            # getattr asks what isinstance would, without a runtime protocol check per layer.
            window = getattr(layer.attention, "window", None)
            if window not in masks:
                masks[window] = self._windowed_mask(window, input_ids, document_ids, positions, kv_cache, start, seq)
            return masks[window]

        for layer in self.blocks():
            h = layer(h, cos, sin, *mask_for(layer), kv_cache)
        if kv_cache is not None:
            kv_cache.advance(seq)
        if self.output is None:  # a pipeline stage before the last: the next stage goes on from h
            return h
        return self.output(self.norm(h))  # [B, T, vocab]

    def _windowed_mask(
        self,
        window: int,
        input_ids: torch.Tensor,
        document_ids: torch.Tensor | None,
        positions: torch.Tensor | None,
        kv_cache: KVCache | None,
        start: int,
        seq: int,
    ) -> tuple[Any, bool]:
        """``(mask, is_causal)`` for layers whose queries see only ``window`` keys."""
        if positions is not None or self.context_parallel is not None:
            mask, _, _ = self._positional_attention(positions, document_ids, kv_cache, seq, window)
            return mask, False
        device = input_ids.device
        return attention_mask(
            document_ids, start, seq, device, self.config.attention_backend, compute_dtype(device), window=window
        )

    def _positional_attention(
        self,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        kv_cache: KVCache | None,
        seq: int,
        window: int | None = None,
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
        return positional_mask(positions, key_positions, document_ids, key_documents, window), cos, sin

    def _check_lengths(self, start: int, seq: int) -> None:
        limit = self.config.max_seq_len
        if start + seq > limit:
            where = f"{start} cached + {seq} new tokens" if start else f"a sequence of {seq} tokens"
            raise ForgeError(
                f"{where} exceeds the model's max_seq_len ({limit}); shorten the input or raise "
                "[model] max_seq_len (RoPE tables are built up to it)."
            )


def _wrapped(wrap: Callable[[int, nn.Module], nn.Module], index: int, block: nn.Module) -> nn.Module:
    wrapped = wrap(index, block)
    if not isinstance(wrapped, nn.Module):
        got = type(wrapped).__name__
        raise ForgeError(f"wrap_blocks: the wrapper of block {index} is {got}, not a torch.nn.Module.")
    return wrapped


def build_model(
    config: ComponentConfig | LlamaOptions,
    vocab_size: int,
    registry: Any,
    *,
    seed: int | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """The model ``config`` describes, with a ``vocab_size`` vocabulary, initialised from ``seed``.

    ``config``: the ``[model]`` section (a :class:`~forge_lm.config.ComponentConfig` naming a
    registered model family and holding its options), or the options of the built-in ``llama``
    family alone. The family's factory builds the module (for ``llama``, :func:`build_llama`);
    unset options (``ComponentConfig(name)`` built in code) mean the family's defaults.

    ``seed``: the run's seed; None takes ``torch.initial_seed()``, the seed ``torch.manual_seed``
    last set, so ``torch.manual_seed(s); build_model(...)`` is ``build_model(..., seed=s)``. Each
    value depends on the seed and its parameter's name only (:mod:`forge_lm.model.init`).
    ``device``: where the tensors are created (default: torch's default device). On ``"meta"``
    nothing is allocated or initialised: transform the model, then
    :func:`forge_lm.model.init.materialize` it (what a sharded run does).
    """
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ForgeError(f"vocab_size must be a positive integer, got {vocab_size!r}; set [model] vocab_size.")
    family, options = _family(config, registry)
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
        context = ModelContext(vocab_size=vocab_size, registry=registry)
        # A plugin's family failing is reported naming it; the core's own raises what torch
        # raised (an allocation that overflows), which the memory estimate falls back from.
        build = family.build if family.plugin.builtin else family.build_for_run
        model = build(options, context)
    _check_model(model, family)
    if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        initialize(model, torch.initial_seed() if seed is None else seed)
    return model


def _family(config: ComponentConfig | LlamaOptions, registry: Any) -> tuple[Any, Any]:
    """The registered family ``config`` selects and its options."""
    if isinstance(config, LlamaOptions):
        return registry.resolve("models", "llama"), config
    if not isinstance(config, ComponentConfig):
        raise TypeError(f"build_model takes the [model] section (a ComponentConfig) or LlamaOptions, not {config!r}")
    family = config.component if config.component is not None else registry.resolve("models", config.name)
    return family, config.options if config.options is not None else family.options_class()


def _check_model(model: object, family: Any) -> None:
    from forge_lm.components import LanguageModel

    if not isinstance(model, nn.Module) or not isinstance(model, LanguageModel):
        got = type(model).__name__
        raise PluginError(
            f"model family '{family.name}' from {family.plugin.label} returned {got}, not a torch.nn.Module with "
            "forward(input_ids, document_ids=None) and init_weights(init) (forge_lm.components.LanguageModel). "
            f"This is a bug in {family.plugin.distribution}: report it to its authors, or choose another [model] name."
        )
    if not hasattr(model, "config"):
        raise PluginError(
            f"model family '{family.name}' from {family.plugin.label} returned a {type(model).__name__} without a "
            "'config' attribute; the model must keep its options there (init_std, max_seq_len are read from it)."
        )


def build_llama(options: LlamaOptions, context: ModelContext) -> Transformer:
    """The ``llama`` family's factory: a :class:`Transformer` whose blocks' attention and
    feed-forward layers are the components ``[model.attention]`` and ``[model.ffn]`` select,
    built once per layer index (a factory may build a different layer per index: MoE every
    n-th layer)."""
    feed_forwards = build_layers(options.ffn, context.registry, "feed_forwards", options.dim, options.n_layers)
    spec = attention_spec(options)
    attentions = build_layers(options.attention, context.registry, "attentions", spec, options.n_layers)
    return Transformer(options, context.vocab_size, feed_forwards, attentions)


def attention_spec(options: LlamaOptions) -> AttentionSpec:
    """The sizes an attention factory builds to, from the ``llama`` family's options."""
    return AttentionSpec(
        dim=options.dim,
        n_heads=options.n_heads,
        n_kv_heads=options.kv_heads,
        head_dim=options.head_size,
        n_layers=options.n_layers,
        max_seq_len=options.max_seq_len,
        rope_theta=options.rope_theta,
        norm_eps=options.norm_eps,
        qk_norm=options.qk_norm,
        backend=options.attention_backend,
    )


def build_layers(chosen: ComponentConfig, registry: Any, category: str, sizes: Any, n_layers: int) -> list[nn.Module]:
    """One module per layer index from the component ``chosen`` selects (``[model.ffn]``,
    ``[model.attention]``): ``factory(options, sizes, layer_index)``, each result checked to
    be a module. For a family that builds its blocks from the same components."""
    from forge_lm.plugins._categories import singular

    component = chosen.component if chosen.component is not None else registry.resolve(category, chosen.name)
    options = chosen.options if chosen.options is not None else component.options_class()
    layers = [component.build(options, sizes, i) for i in range(n_layers)]
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            noun = singular(category)
            raise PluginError(
                f"{noun} '{chosen.name}' from {component.plugin.label} returned {type(layer).__name__} for layer {i}, "
                "not a torch.nn.Module; its factory must return a module mapping [batch, seq, dim] to the same shape."
            )
    return layers
