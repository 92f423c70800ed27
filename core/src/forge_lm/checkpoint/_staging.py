"""Host buffers that hold a copy of the state while a background save writes it.

An async save copies every tensor to host memory before training changes it, then writes the
copy in a background thread. Allocating that copy afresh at every save costs as much as the
copy itself (the host allocator zeroes and maps new pages), and on CUDA a copy into pageable
memory goes through a bounce buffer and cannot overlap anything. So the buffers are kept from
one save to the next: allocated at the first save, reused while a tensor keeps its local shape
and dtype, allocated again when it changes. Buffers for CUDA tensors are pinned (page-locked),
which lets the device copy into them directly and asynchronously; CPU tensors get plain memory,
since pinning needs CUDA and would gain nothing there.

The caller must not stage again before the write of the previous staging has finished
(:meth:`CheckpointManager.save` waits for it first): the buffers are overwritten in place.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def wants_pinned(tensor: torch.Tensor) -> bool:
    """Whether the host buffer for ``tensor`` should be pinned: only for tensors on a GPU."""
    return tensor.is_cuda and torch.cuda.is_available()


class StagingBuffers:
    """A host copy of a flat ``{key: tensor}`` state, in buffers reused from save to save."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pinned: dict[str, bool] = {}

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into the host buffers and return the copies, keyed alike. A DTensor
        comes back as a DTensor with the same sharding whose local tensor is the host buffer, so
        that DCP writes this rank's shard as it would the original."""
        buffers: dict[str, torch.Tensor] = {}
        pinned: dict[str, bool] = {}
        staged: dict[str, torch.Tensor] = {}
        copied_from_device = False
        for key, value in tensors.items():
            local = value.detach()
            if isinstance(local, DTensor):
                local = local.to_local()
            pin = wants_pinned(local)
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype or self._pinned[key] != pin:
                buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
            # From a GPU into pinned memory the copy is asynchronous: the device queues all of
            # them back to back, and one synchronisation below waits for the lot.
            buffer.copy_(local, non_blocking=pin)
            copied_from_device |= pin
            buffers[key], pinned[key] = buffer, pin
            staged[key] = DTensor(buffer, value._spec, requires_grad=False) if isinstance(value, DTensor) else buffer
        if copied_from_device:
            torch.cuda.synchronize()  # the background writer reads the buffers: the copies must be done
        # Keys no longer in the state (a plugin's tensor that went away) release their buffers.
        self._buffers, self._pinned = buffers, pinned
        return staged

    def storage(self) -> dict[str, int]:
        """Where each buffer's memory lies (``data_ptr``): the same numbers after two saves mean
        the second reused the first's buffers."""
        return {key: buffer.data_ptr() for key, buffer in self._buffers.items()}
