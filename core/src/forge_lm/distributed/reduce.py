"""What ranks agree on: a rank-local value made global, a flag any rank may raise, rank 0's word.

Every helper is a no-op in a single process, so callers need no special case for it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from forge_lm.distributed.mesh import ParallelDims


def distributed() -> bool:
    """Whether this process is one rank of an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def any_rank(flag: bool, group: Any = None) -> bool:
    """``flag`` on any rank makes it true on every rank."""
    if not distributed():
        return flag
    value = torch.tensor([1 if flag else 0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def from_rank0(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (any picklable plain data)."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def barrier(group: Any = None) -> None:
    if distributed():
        dist.barrier(group=group)


def all_ranks_true(flag: torch.Tensor) -> bool:
    """Whether the boolean tensor ``flag`` is true on every rank: reduced on its own device (no
    transfer before the reduction), then read once, which is the one wait for the device."""
    value = flag.to(torch.int32).reshape(1)
    if distributed():
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def mean_over_data_parallel(value: Any, mesh: Any, dims: ParallelDims) -> Any:
    """The mean of ``value`` (a number, or a 0-d tensor kept on its device) over the ranks that
    read different data; the same kind comes back (a tensor in float64).

    Under pipeline parallelism only the last stage computes the loss: the other stages pass 0,
    and the sum over the pipeline hands every stage the last stage's value first.
    """
    is_tensor = isinstance(value, torch.Tensor)
    if mesh is None:
        return value.double() if is_tensor else value
    total = value.detach().double().reshape(1) if is_tensor else torch.tensor([value], dtype=torch.float64)
    if dims.pp > 1:
        dist.all_reduce(total, group=mesh["pp"].get_group())
    if dims.dp_size > 1:
        dist.all_reduce(total, group=mesh["dp"].get_group())
    return total[0] / dims.dp_size if is_tensor else total.item() / dims.dp_size
