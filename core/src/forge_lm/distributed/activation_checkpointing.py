"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

- ``full``: a block keeps only its input; backward reruns the whole block.
- ``selective``: a block also keeps the outputs of its matrix multiplications and of
  attention (the expensive operations) and reruns only the cheap element-wise ones (norms,
  activations, RoPE, residual adds): most of the memory saving at a fraction of the
  recomputation.

The block keeps its parameter names (the block's own ``forward`` calls
``torch.utils.checkpoint``; no wrapper module is inserted), so checkpoints and FSDP2 units are
the same with and without it. Results are identical: recomputation replays the same operations.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from forge_lm.distributed.transforms import ModelTransform, TransformContext, transformer_blocks

_aten = torch.ops.aten
# Operations whose outputs selective checkpointing keeps: recomputing them would cost as much
# as the forward pass.
SAVED_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.linear.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)


def _selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[object, object]:
    return create_selective_checkpoint_contexts(_selective_policy)


def checkpointed(forward, mode: str):
    """``forward`` run under activation checkpointing ``mode`` ('full' or 'selective')."""
    context_fn = selective_contexts if mode == "selective" else None

    @functools.wraps(forward)
    def run(*args: object) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation and generation: nothing to save
            return forward(*args)
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **extra)

    return run


def _enabled(context: TransformContext) -> bool:
    return context.config.train.activation_checkpointing != "none"


def _apply(model: nn.Module, context: TransformContext) -> None:
    mode = context.config.train.activation_checkpointing
    for block in transformer_blocks(model):
        block.forward = checkpointed(block.forward, mode)


def activation_checkpointing_transform(options: object) -> ModelTransform:
    """The ``activation_checkpointing`` transform: on when [train] activation_checkpointing is set."""
    return ModelTransform(slot="activation_checkpointing", enabled=_enabled, apply=_apply)
