"""Whether a model's weights are finite: the test every checkpoint passes before it is written,
and again when it is loaded.

Weights holding a NaN or an infinity are not a checkpoint anyone can train on: saved, they would
become ``latest``, count for ``keep_last_n`` (pruning the good ones) and be what a resume or a
rollback restores. The test is cheap: the largest magnitude of every floating tensor of this
rank (its shards only), computed by ``torch._foreach_norm`` (one fused kernel per device and
dtype; the maximum never overflows, and a NaN anywhere makes it NaN), counted on the device,
and one all-reduce with whatever else the caller packs beside it: every rank decides the same.
Only a failed test looks at the tensors one by one, to name one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forge_lm.distributed.reduce import distributed


def _local_floats(state: Mapping[str, Any]) -> Iterable[tuple[str, torch.Tensor]]:
    """``(name, this rank's part)`` of every floating-point tensor of a model state dict."""
    for name, value in state.items():
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() and not value.is_meta:
            yield name, value.detach()


def count_nonfinite(state: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    """How many of this rank's floating tensors in ``state`` hold a NaN or an infinity: a 0-d
    float64 tensor on ``device``, not read (the caller reduces it with the other ranks first)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for _, tensor in _local_floats(state):
        groups[(tensor.device, tensor.dtype)].append(tensor)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for tensors in groups.values():
        largest = torch.stack(torch._foreach_norm(tensors, math.inf))  # max |x| per tensor
        count = count + (~torch.isfinite(largest)).sum().to(device=device, dtype=torch.float64)
    return count


def sum_over_ranks(flags: list[torch.Tensor]) -> list[float]:
    """Each 0-d tensor of ``flags`` (on one device) summed over every rank, in one all-reduce,
    read once."""
    packed = torch.stack([flag.double() for flag in flags])
    if distributed():
        dist.all_reduce(packed)
    return packed.tolist()


def first_nonfinite(state: Mapping[str, Any]) -> str | None:
    """The name of this rank's first tensor of ``state`` that is not finite, or None (a check
    tensor by tensor: only for the message, once the fused test failed)."""
    for name, tensor in _local_floats(state):
        if not bool(torch.isfinite(tensor).all()):
            return name
    return None


def device_of(model: torch.nn.Module) -> torch.device:
    """Where the model's (first) parameter lives: the device of the test's collective."""
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")
