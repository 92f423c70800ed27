"""What ranks agree on: a rank-local value made global, a flag any rank may raise, rank 0's word.

Every helper is a no-op in a single process, so callers need no special case for it."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

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


class StepAgreement(NamedTuple):
    """What :func:`agree_on_step` found."""

    loss: torch.Tensor  # the loss averaged over the ranks that read different data (on the device)
    finite: bool  # the loss and the gradient norm are finite on every rank
    stop: bool  # some rank asks to stop
    # (loss, grad_norm) as numbers, where the agreement read them (one process): a logged step
    # then reads nothing more.
    numbers: tuple[float, float] | None = None


def agree_on_step(loss: torch.Tensor, grad_norm: torch.Tensor, stop: bool, dims: ParallelDims) -> StepAgreement:
    """What every rank must agree on after a step's backward, in one collective and one read:
    the loss averaged over the ranks that read different data, whether the loss and the gradient
    norm are finite on every rank, whether any rank asks to stop (:class:`StepAgreement`).

    ``loss``: this rank's data loss (0 on pipeline stages without the head), ``grad_norm`` the
    global norm, both 0-d tensors on the training device; ``stop``: a preemption signal noted
    here. The three are summed over all ranks in one all-reduce on the device: the ranks of a
    tensor-parallel group hold the same loss, pipeline stages but the last hold 0, the ranks of
    a context-parallel group each the mean over an equal slice of the same sequences, so the sum
    divided by the data-parallel, context-parallel and tensor-parallel degrees is the mean over
    the data. The mean stays a tensor; the two flags are read, the step's one wait for the device.
    In one process there is nothing to sum: the loss and the norm are read together, in that one
    wait, checked as numbers (a third of the small device operations of the packed form) and
    kept (``numbers``)."""
    if not distributed():
        # Read as they are when they share a dtype (float32: every value of it is a float, exactly).
        pair = [loss.detach(), grad_norm.detach()]
        both = torch.stack(pair if loss.dtype == grad_norm.dtype else [value.double() for value in pair])
        loss_value, norm_value = both.tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        return StepAgreement(both[0], finite, stop, (loss_value, norm_value))
    finite_here = torch.isfinite(loss) & torch.isfinite(grad_norm)
    stop_flag = torch.tensor(1.0 if stop else 0.0, dtype=torch.float64, device=loss.device)
    packed = torch.stack([loss.detach().double(), (~finite_here).double(), stop_flag])
    dist.all_reduce(packed)
    bad_ranks, stopping_ranks = packed[1:].tolist()
    return StepAgreement(packed[0] / (dims.dp_size * dims.cp * dims.tp), bad_ranks == 0, stopping_ranks > 0)


def mean_over_data_parallel(value: Any, mesh: Any, dims: ParallelDims) -> Any:
    """The mean of ``value`` (a number, or a 0-d tensor kept on its device) over the ranks that
    read different data; the same kind comes back (a tensor in float64).

    Under pipeline parallelism only the last stage computes the loss: the other stages pass 0,
    and the sum over the pipeline hands every stage the last stage's value first. Under context
    parallelism each rank of a group holds the value of its equal slice of the same sequences:
    the mean runs over those ranks too.
    """
    is_tensor = isinstance(value, torch.Tensor)
    if mesh is None:
        return value.double() if is_tensor else value
    total = value.detach().double().reshape(1) if is_tensor else torch.tensor([value], dtype=torch.float64)
    if dims.pp > 1:
        dist.all_reduce(total, group=mesh["pp"].get_group())
    ranks, over = (dims.dp_size * dims.cp, "dp_cp") if dims.cp > 1 else (dims.dp_size, "dp")
    if ranks > 1:
        dist.all_reduce(total, group=mesh[over].get_group())
    return total[0] / ranks if is_tensor else total.item() / ranks
