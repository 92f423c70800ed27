"""Context parallelism: the ranks of a ``cp`` group split every sequence of one batch.

Layout (load-balanced for causal attention): a sequence of ``T`` tokens is cut into ``2 * cp``
equal chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` ("zigzag"). Under a causal
mask a late chunk costs more than an early one; pairing the ``r``-th earliest with the ``r``-th
latest gives every rank the same amount of attention work.

Attention across the slices is exact and needs nothing from the device: each rank computes
its local queries, keys and values (RoPE at the tokens' global positions), all-gathers the keys
and values of the group (:func:`gather`, whose backward sums the gradients of every rank's
queries back onto the rank that owns the keys) and attends with a mask built from global
positions: a query at position ``p`` sees the keys at positions ``<= p`` (and, with packed
documents, of its own document). Memory for keys and values grows to the whole sequence on
every rank; activations elsewhere (feed-forward, norms, logits) are ``1 / cp`` of it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import attrs
import torch
import torch.distributed as dist

from forge_lm.components import ContextParallelAttention, ContextParallelModel

# The batch entries laid out along the sequence (dimension 1) that each rank slices.
SEQUENCE_KEYS = ("input_ids", "labels", "document_ids")


def zigzag_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions rank ``cp_rank`` of ``cp`` holds of a ``seq_len`` sequence, in its
    local order: chunk ``cp_rank``, then chunk ``2 * cp - 1 - cp_rank``, of ``2 * cp`` chunks."""
    chunk = seq_len // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat(
        (torch.arange(first, first + chunk, device=device), torch.arange(second, second + chunk, device=device))
    )


@attrs.frozen
class ContextParallel:
    """This rank's place in its context-parallel group, and the group's collectives."""

    group: Any  # the process group of the cp ranks sharing this rank's sequences
    rank: int  # this rank's index in the group
    size: int  # cp

    @classmethod
    def from_mesh(cls, mesh: Any) -> ContextParallel:
        cp = mesh["cp"]
        return cls(cp.get_group(), cp.get_local_rank(), cp.size())

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of ``batch`` (every rank of the group holds the same batch), with
        ``positions`` ``[T / cp]``: the global positions of its tokens, which RoPE and the
        attention mask use. Other entries pass through unchanged."""
        seq = batch["input_ids"].shape[1]
        positions = zigzag_positions(seq, self.size, self.rank, batch["input_ids"].device)
        sharded = {
            key: value.index_select(1, positions) if key in SEQUENCE_KEYS else value for key, value in batch.items()
        }
        sharded["positions"] = positions
        return sharded

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order; differentiable."""
        return _AllGather.apply(x, dim, self.group, self.size, self.rank)

    def gather_ids(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """:meth:`gather` for tensors without gradients (positions, document ids)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


class _AllGather(torch.autograd.Function):
    """All-gather whose backward reduce-scatters: every rank's queries used this rank's keys,
    so the gradient of this rank's slice is the sum of the group's gradients for it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, size: int, rank: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.size, ctx.rank = dim, group, size, rank
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        chunks = [chunk.contiguous() for chunk in grad.chunk(ctx.size, dim=ctx.dim)]
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce-scatter: sum everything, keep ours
            total = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(total, group=ctx.group)
            mine = total.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous()
        else:
            mine = torch.empty_like(chunks[ctx.rank])
            dist.reduce_scatter(mine, chunks, group=ctx.group)
        return mine, None, None, None, None


@runtime_checkable
class _AttributeOnly(Protocol):
    """:class:`~forge_lm.components.ContextParallelModel` as plugin API 1.2 defined it: a
    ``context_parallel`` attribute (and ``forward(..., positions=)``), no ``set_context_parallel``."""

    context_parallel: Any


def declares_only_the_attribute(model: object) -> bool:
    """Whether ``model`` declares context parallelism as plugin API 1.2 did, a ``context_parallel``
    attribute without ``set_context_parallel(context_parallel)``: deprecated since plugin API 1.3,
    run by :func:`enable_context_parallel`'s walk of the modules until plugin API 2."""
    return isinstance(model, _AttributeOnly) and not isinstance(model, ContextParallelModel)


def enable_context_parallel(model: torch.nn.Module, context_parallel: ContextParallel) -> None:
    """Make ``model`` attend across the group: it then expects this rank's slice of each sequence
    with its ``positions``. A :class:`~forge_lm.components.ContextParallelModel` (Forge's
    Transformer) is told through ``model.set_context_parallel(context_parallel)`` and hands the
    group to its attention layers itself. A model of plugin API 1.2's protocol (the attribute only,
    :func:`declares_only_the_attribute`; deprecated) gets it set, and so does every submodule that
    declares a ``context_parallel`` attribute (:class:`~forge_lm.components.ContextParallelAttention`)."""
    if isinstance(model, ContextParallelModel):
        model.set_context_parallel(context_parallel)
        return
    if not declares_only_the_attribute(model):
        raise TypeError(
            f"{type(model).__name__} declares no set_context_parallel(context_parallel) (ContextParallelModel); "
            "forge_lm.model.capabilities refuses [distributed] cp > 1 for it before this is reached."
        )
    model.context_parallel = context_parallel  # plugin API 1.2's way, until plugin API 2
    for module in model.modules():
        if module is not model and isinstance(module, ContextParallelAttention):
            module.context_parallel = context_parallel
