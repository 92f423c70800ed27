"""Tensor parallelism with sequence parallelism (Megatron-LM's layout) over the ``tp`` mesh.

One forward pass on ``tp`` ranks, for a batch ``[B, T]`` that every rank of the group reads:

- ``tok_embeddings``: the vocabulary (rows) is split; each rank looks up the tokens it holds
  and the partial sums are reduce-scattered along the sequence. From here on the residual
  stream is ``[B, T / tp, dim]`` on each rank, a plain tensor holding its slice of the
  sequence (sequence parallelism: norms and residual adds run on ``1 / tp`` of the tokens
  instead of being repeated on every rank).
- every block: ``attention_norm`` on the local tokens; its output is all-gathered to the full
  sequence; ``wq``/``wk``/``wv`` are split by heads (column parallel), so attention runs on
  this rank's heads over the whole sequence, and the RoPE tables and the document mask,
  built by the model for the full sequence, apply unchanged; ``wo`` is split by its input
  (row parallel) and its partial sums are reduce-scattered back to ``[B, T / tp, dim]``.
  ``ffn_norm`` and the feed-forward layer the same way, by the layer's own plan (below).
- ``norm`` on the local tokens; the ``output`` head is split by vocabulary: it gathers the
  sequence and computes this rank's slice of the vocabulary, a DTensor ``[B, T, vocab]``
  sharded on its last dimension. Inside :func:`loss_parallel_for`'s region (the training
  step, when the loss is a :class:`~forge_lm.losses.vocab_parallel.VocabParallelLoss`) the
  model returns that DTensor and the loss is computed on the slices (loss parallelism:
  all-reduces of ``[B, T]`` values instead of an all-gather of the logits, and no rank holds
  the full logits or their gradient). Everywhere else (evaluation, evaluators, generation, a
  pipeline's last stage, a loss that needs the whole vocabulary, such as the z-loss) the head
  gathers the logits and every rank returns the full ``[B, T, vocab]`` as a plain tensor,
  so those callers compute as in one process.

Per block that is two all-gathers and two reduce-scatters forward, and the same backward.
The gradient of every parameter is that of one process: split weights get the gradient of
their slice; the norm scales, replicated DTensors, get the partial gradients of each rank's
tokens summed over the group (DTensor reduces them).

Tied embeddings: the embedding ``[vocab, dim]`` split by rows and the head's ``[vocab, dim]``
weight split by output features are the same placement, ``Shard(0)`` over ``tp``, so one
DTensor serves both. ``parallelize_module`` replaces each module's parameter by a new one,
which would silently untie them; the transform ties them again to the embedding's DTensor.
A vocabulary that ``tp`` does not divide is split unevenly (DTensor pads the collectives);
the result is the same.

Feed-forward layers: the core knows only its own. A feed-forward module takes part by
defining ``tensor_parallel_plan() -> dict[str, ParallelStyle]`` for its submodules (see
:meth:`forge_lm.model.swiglu.SwiGLU.tensor_parallel_plan`). Its input arrives as a
replicated DTensor ``[B, T, dim]`` (the full sequence); its plan must return this rank's
slice of the sequence, ``[B, T / tp, dim]`` as a plain tensor (e.g. its last projection
``RowwiseParallel(output_layouts=Shard(1))``). A feed-forward without the method is refused
with a :class:`~forge_lm.errors.ConfigError` before anything is changed, and so is a plan
that splits a linear layer's features unevenly (a SwiGLU hidden size ``tp`` does not divide):
the next projection rebuilds its input from equal local slices. Heads, key/value heads and
``[train] seq_len`` are checked earlier, by :meth:`ParallelDims.check`.

Pipeline stages (a stage is the model with the other stages' parts set to ``None``): the
parts a stage holds are split as above, and the hidden state that travels between stages is
the full sequence ``[B, T, dim]``, the same on every ``tp`` rank, as without tensor
parallelism: a stage gathers its output and splits its input along the sequence.

Sequences: every forward pass splits the sequence in ``tp`` equal parts, so the model refuses
(:class:`~forge_lm.errors.ForgeError`) a length ``tp`` does not divide rather than fail
inside a collective; token-by-token generation therefore needs ``tp = 1``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from forge_lm.components import TensorParallelizable, TensorParallelModel
from forge_lm.config import model_options
from forge_lm.distributed.transforms import ModelTransform, TransformContext, transformer_blocks
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.losses.vocab_parallel import VocabParallelLoss

# Blocks are called as block(x, cos, sin, mask, is_causal, kv_cache) and call their attention
# the same way: only x is sharded; the RoPE tables, the mask and the cache describe the full
# sequence and stay as they are.
_UNSHARDED_ARGS = (None,) * 5


def _enabled(context: TransformContext) -> bool:
    return context.dims.tp > 1


# Whether the current forward is inside loss_parallel_for's region. A plain flag, not a
# context variable: the head's hook reads it in the thread that runs the step, and it is
# set and reset around that step only.
_keep_logits_split = False


@contextlib.contextmanager
def _split_logits_region() -> Iterator[None]:
    global _keep_logits_split
    if _keep_logits_split:
        raise ForgeError("loss_parallel_for's regions cannot be nested.")
    _keep_logits_split = True
    try:
        with loss_parallel():  # the loss's forward and its backward both run in here
            yield
    finally:
        _keep_logits_split = False


def loss_parallel_for(tp: int, loss_fn: Any) -> contextlib.AbstractContextManager:
    """The region to run a training step's forward, loss and backward in: with ``tp > 1`` and a
    :class:`~forge_lm.losses.vocab_parallel.VocabParallelLoss`, the model's head hands the
    loss its logits sharded on the vocabulary dimension and ``loss_parallel()`` computes the
    loss and its gradient on the shards; otherwise nothing changes (full logits)."""
    if tp > 1 and isinstance(loss_fn, VocabParallelLoss):
        return _split_logits_region()
    return contextlib.nullcontext()


def _full_logits(module: nn.Module, args: Any, logits: Any) -> Any:
    """The head's output outside loss_parallel_for's region: the logits gathered over the
    vocabulary, a plain tensor (the gradient of each rank's slice flows back to it)."""
    if _keep_logits_split or not isinstance(logits, DTensor):
        return logits
    return logits.redistribute(placements=(Replicate(),), async_op=True).to_local()


def _block_plan() -> dict[str, ParallelStyle]:
    unsharded = _UNSHARDED_ARGS
    return {
        "attention_norm": SequenceParallel(),
        # The gathered input stays a DTensor (use_local_output=False): the gradients of wq, wk
        # and wv then add up as partial sums and leave through one reduce-scatter. Attention
        # itself only reads its shape; the projections hand it plain tensors of local heads.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), *unsharded), desired_input_layouts=(Replicate(), *unsharded)
        ),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    }


def _layer_plans(blocks: list[nn.Module], context: TransformContext, kind: str) -> list[dict[str, ParallelStyle]]:
    """Each block's plan for its ``kind`` layer (``feed_forward`` or ``attention``), or a
    ConfigError for a layer that has none or that ``tp`` cannot split evenly."""
    tp = context.dims.tp
    section = "ffn" if kind == "feed_forward" else kind
    chosen = getattr(model_options(context.config), section, None)
    selected = f" '{chosen.name}'" if chosen is not None else ""
    noun = "feed-forward layer" if kind == "feed_forward" else "attention layer"
    plans = []
    for block in blocks:
        module = getattr(block, kind)
        layer = f"the {noun} {type(module).__name__} ([model.{section}]{selected})"
        if not isinstance(module, TensorParallelizable):
            raise ConfigError(
                f"[distributed] tp = {tp}: {layer} does not support tensor parallelism (it defines no "
                f"tensor_parallel_plan()); set [distributed] tp = 1 or use a {noun} that supports it."
            )
        plan = module.tensor_parallel_plan()
        for name, style in plan.items():
            size, what = _split_size(module.get_submodule(name), style)
            if size % tp:
                raise ConfigError(
                    f"[distributed] tp = {tp} must divide the sizes that tensor parallelism splits, but in "
                    f"{layer} {name} has {size} {what}; change the layer's options in [model.{section}] (for "
                    "swiglu: hidden_multiplier, multiple_of) or set another tp."
                )
        plans.append(plan)
    return plans


def _split_size(module: nn.Module, style: ParallelStyle) -> tuple[int, str]:
    """The size a style splits on a linear layer (0 when it splits none). It must be a multiple
    of tp: the projection after it rebuilds its input from the local slices assuming equal
    parts. (The vocabulary may be uneven: embedding and head are split as whole DTensors.)"""
    if isinstance(module, nn.Linear):
        if isinstance(style, ColwiseParallel):
            return module.out_features, "output features"
        if isinstance(style, RowwiseParallel):
            return module.in_features, "input features"
    return 0, ""


def _sequence_guard(tp: int) -> Callable[[nn.Module, tuple, dict], None]:
    """A forward pre-hook refusing sequences that ``tp`` does not divide: sequence parallelism
    splits them in equal parts, and unequal ones would fail deep inside (or hang) a collective."""

    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.ndim == 2 and ids.shape[1] % tp:
            raise ForgeError(
                f"with tensor parallelism (tp = {tp}) the model takes sequences whose length tp divides "
                f"(sequence parallelism splits them); got {ids.shape[1]} tokens. Pad the input, or use "
                "tp = 1 (token-by-token generation needs tp = 1)."
            )

    return check


def _stage_boundaries(model: nn.Module, blocks: list[nn.Module], mesh: Any) -> None:
    """Pipeline stages pass the full hidden state ``[B, T, dim]`` (the model derives the
    sequence length, the RoPE tables and the mask from it): a stage without the embedding
    splits its input along the sequence before its first block (a local slice, no
    communication), a stage without the head gathers its last block's output."""
    if not blocks:
        return
    if _module(model, "tok_embeddings") is None:
        to_sequence_split = PrepareModuleInput(
            input_layouts=(Replicate(), *_UNSHARDED_ARGS),
            desired_input_layouts=(Shard(1), *_UNSHARDED_ARGS),
            use_local_output=True,
        )
        parallelize_module(blocks[0], mesh, to_sequence_split)
    if _module(model, "output") is None:
        to_full_sequence = PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
        )
        parallelize_module(blocks[-1], mesh, to_full_sequence)


def _module(model: nn.Module, name: str) -> Any:
    return getattr(model, name, None)


def _apply(model: nn.Module, context: TransformContext) -> None:
    if not isinstance(model, TensorParallelModel):
        raise ConfigError(
            f"[distributed] tp = {context.dims.tp}: the model {type(model).__name__} declares no "
            "tensor_parallel_plan() (forge_lm.components.TensorParallelModel); set [distributed] tp = 1."
        )
    blocks = transformer_blocks(model)
    # Refuse before anything is changed.
    attention_plans = _layer_plans(blocks, context, "attention")
    ffn_plans = _layer_plans(blocks, context, "feed_forward")
    mesh = context.submesh("tp")
    embedding, output = _module(model, "tok_embeddings"), _module(model, "output")
    tied = embedding is not None and output is not None and output.weight is embedding.weight
    # A pipeline stage holds only some of the outer modules; the model's plan names those it has.
    parallelize_module(model, mesh, model.tensor_parallel_plan())
    for block, attention_plan, ffn_plan in zip(blocks, attention_plans, ffn_plans, strict=True):
        parallelize_module(block, mesh, _block_plan())
        parallelize_module(block.attention, mesh, attention_plan)
        parallelize_module(block.feed_forward, mesh, ffn_plan)
    _stage_boundaries(model, blocks, mesh)
    if output is not None:  # registered after the style's own hook, so it sees the split logits
        output.register_forward_hook(_full_logits)
    if tied:
        # Both modules got their own copy; one Shard(0) DTensor serves both (module docstring).
        output.weight = embedding.weight
    if embedding is not None:  # the module that takes token ids
        model.register_forward_pre_hook(_sequence_guard(context.dims.tp), with_kwargs=True)


def tensor_parallel_transform(options: object) -> ModelTransform:
    """The ``tensor_parallel`` transform (slot ``tensor_parallel``): on when [distributed] tp > 1."""
    return ModelTransform(slot="tensor_parallel", enabled=_enabled, apply=_apply)
