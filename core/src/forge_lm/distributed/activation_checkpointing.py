"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

- ``full``: a block keeps only its input; backward reruns the whole block.
- ``selective``: a block also keeps the outputs of the operations that are expensive to rerun
  (:func:`saved_ops`: matrix multiplications, grouped expert GEMMs, attention kernels, float8
  GEMMs and collectives) and reruns only the cheap element-wise ones (norms, activations, RoPE,
  residual adds): most of the memory saving at a fraction of the recomputation, and backward
  issues no communication a second time.

The policy sees operations at the dispatcher, below autograd: composite operations such as
``aten.linear`` or ``aten.matmul`` never reach it, only what they decompose into (``mm``,
``addmm``, ``bmm``), so the saved list names those.

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

# (namespace, operator) of every operation selective checkpointing keeps. Looked up by name:
# an operator this torch build lacks (``_grouped_mm`` before 2.8, say) is simply left out.
_SAVED_OPERATORS = (
    # matrix multiplications, as the dispatcher sees them (nn.Linear arrives as mm / addmm)
    ("aten", "mm"),
    ("aten", "addmm"),
    ("aten", "bmm"),
    ("aten", "_grouped_mm"),  # the MoE experts' packed GEMMs
    ("aten", "_scaled_mm"),  # float8
    ("aten", "_scaled_grouped_mm"),
    # Forge's fp32 CPU linear product (forge_lm.model.linear), an opaque custom op
    ("forge", "onednn_linear"),
    # fused attention kernels (F.scaled_dot_product_attention picks one per device and input)
    ("aten", "_scaled_dot_product_flash_attention"),
    ("aten", "_scaled_dot_product_efficient_attention"),
    ("aten", "_scaled_dot_product_cudnn_attention"),
    ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
    # collectives: rerunning one in backward would communicate again (FSDP2's own all-gathers
    # run in its hooks, outside the checkpointed function)
    ("_c10d_functional", "reduce_scatter_tensor"),
    ("_c10d_functional", "all_gather_into_tensor"),
    ("_c10d_functional", "all_to_all_single"),
    ("_c10d_functional", "all_reduce"),
)


def _overloads(namespace: str, name: str) -> list[object]:
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):  # not in this build, or its library not loaded yet
        return []
    overloads = (getattr(packet, overload) for overload in packet.overloads())
    # ``out=`` variants write into a given tensor: there is no output of their own to keep.
    return [op for op in overloads if not op._schema.is_mutable]


def saved_ops() -> frozenset[object]:
    """Every overload of the operators selective checkpointing keeps that this process has.

    Evaluated when a checkpointed forward starts (not at import), so that operators registered
    later, such as Forge's custom linear op once :mod:`forge_lm.model.linear` is imported,
    are included."""
    return frozenset(op for namespace, name in _SAVED_OPERATORS for op in _overloads(namespace, name))


def _selective_policy(saved: frozenset[object], ctx: object, op: object, *args: object, **kwargs: object):
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[object, object]:
    return create_selective_checkpoint_contexts(functools.partial(_selective_policy, saved_ops()))


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
