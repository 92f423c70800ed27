"""Memory metrics carried by every logged step, named ``memory/...``.

On CUDA, from the caching allocator of this rank's device:

- ``memory/allocated_gib``: memory held by live tensors now;
- ``memory/reserved_gib``: memory the allocator holds from the driver (allocated plus cache);
- ``memory/peak_gib``: the most allocated at any moment since the previous log (the peak is
  reset after each reading, so a spike between two logs is not hidden by the average);
- ``memory/alloc_retries``: times the allocator had to free its cache and retry a ``cudaMalloc``
  since the run started; a growing count means the run is at the edge of the device's memory
  (fragmentation or a too-large batch) and slows down long before it fails.

On CPU: ``memory/rss_gib``, the resident set of this process (read from ``/proc/self/statm``;
where that does not exist, the peak resident set from ``getrusage``, as ``memory/peak_rss_gib``).

The numbers are rank 0's: the rank whose metrics are logged. Reading them costs no device
synchronisation.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch

GIB = 1024**3
_STATM = Path("/proc/self/statm")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryMetrics:
    """Reads the ``memory/...`` metrics of one device at each log.

    On CPU the statm file is opened once and read again at each log from its start (the kernel
    writes it anew at each read): about 2 us a read, against 40 us to 100 us to open and read it
    each time, which counts when a small model logs every step. :meth:`close` closes it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._statm: int | None = None  # the file descriptor of _STATM, from the first read on

    def read(self) -> dict[str, float]:
        if self.device.type == "cuda":
            return _cuda_metrics(self.device)
        try:
            if self._statm is None:
                self._statm = os.open(_STATM, os.O_RDONLY)
            resident_pages = int(os.pread(self._statm, 256, 0).split()[1])
            return {"memory/rss_gib": resident_pages * _PAGE_SIZE / GIB}
        except (OSError, ValueError, IndexError):
            return _peak_rss()

    def close(self) -> None:
        if self._statm is not None:
            statm, self._statm = self._statm, None
            os.close(statm)

    def __enter__(self) -> MemoryMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cuda_metrics(device: torch.device) -> dict[str, float]:
    stats = torch.cuda.memory_stats(device)
    metrics = {
        "memory/allocated_gib": stats.get("allocated_bytes.all.current", 0) / GIB,
        "memory/reserved_gib": stats.get("reserved_bytes.all.current", 0) / GIB,
        "memory/peak_gib": stats.get("allocated_bytes.all.peak", 0) / GIB,
        "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
    }
    torch.cuda.reset_peak_memory_stats(device)  # the next peak is the next window's own
    return metrics


def _peak_rss() -> dict[str, float]:
    # No /proc (macOS): only the peak is available; ru_maxrss is bytes there, KiB on Linux.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"memory/peak_rss_gib": peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB}
