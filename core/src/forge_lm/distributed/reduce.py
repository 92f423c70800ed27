"""Numbers every rank reports the same way: a rank-local value made global."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from forge_lm.distributed.mesh import ParallelDims


def mean_over_data_parallel(value: float, mesh: Any, dims: ParallelDims) -> float:
    """The mean of ``value`` over the ranks that read different data.

    Under pipeline parallelism only the last stage computes the loss: the other stages pass 0,
    and the sum over the pipeline hands every stage the last stage's value first.
    """
    if mesh is None:
        return value
    total = torch.tensor([value], dtype=torch.float64)
    if dims.pp > 1:
        dist.all_reduce(total, group=mesh["pp"].get_group())
    if dims.dp_size > 1:
        dist.all_reduce(total, group=mesh["dp"].get_group())
    return total.item() / dims.dp_size
