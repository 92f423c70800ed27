"""Keeping freed memory in the process on CPU, so that training steps do not page-fault.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc's ``malloc`` returns a large
block (above a threshold it adapts, from 128 KiB up to 32 MiB) to the kernel when it is freed,
and it trims the free top of its heap once that exceeds twice the threshold. A training step
frees its activations at the end of the backward pass and allocates them again in the next
forward, so a step can receive fresh pages from the kernel, which faults each of them in and
zeroes it (whether it does depends on what else sits on the heap when the activations are
freed): on ``benchmarks/bench_train.py``'s 16x model, 69,000 to 173,000 page faults per step,
and about 1,000 with freed memory kept. This is the problem that ``LD_PRELOAD``-ing jemalloc or
tcmalloc solves for CPU training; glibc can be told the same at run time with ``mallopt``:

- ``M_MMAP_THRESHOLD`` at glibc's ceiling on 64-bit (32 MiB): blocks up to that size come from
  the heap, whose freed memory is reused, instead of their own mappings;
- ``M_MMAP_MAX`` at 0: no block gets a mapping of its own, whatever its size. The threshold
  cannot go above 32 MiB, so without this the larger blocks (a stacked MoE weight's gradient,
  the logits of a large vocabulary) would still be mapped, and faulted in afresh every step:
  25,000 page faults per step in ``benchmarks/bench_moe.py``'s layer at 4x the width, whose
  three weight gradients are 32 MiB each, and none with it. Where the heap cannot grow, glibc
  still falls back to a mapping;
- ``M_TRIM_THRESHOLD`` at 2 GiB: the heap keeps up to that much free memory at its top.

The process's resident memory then stays near its peak instead of falling between steps, which
is what a training process holds anyway. The setting is process-wide and lasts until the process
ends. Other C libraries (musl) and other systems are left alone. Under an ``LD_PRELOAD``-ed
jemalloc or tcmalloc, which reuse freed memory themselves, the call sets thresholds of a
``malloc`` that is not used.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Any

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest accepted value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int: 2 GiB less a byte
_SETTINGS = (
    ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    ("M_MMAP_MAX", M_MMAP_MAX, 0),
    ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
)
KEPT = "kept (glibc malloc: no mmap, thresholds raised)"


def _libc() -> Any:
    """The C library this process runs on (its symbols: ``ctypes.CDLL(None)``)."""
    return ctypes.CDLL(None)


def keep_freed_memory() -> str:
    """Set glibc's ``malloc`` parameters (see the module docstring); returns what was done, for
    the run's event log: ``"kept (glibc malloc: no mmap, thresholds raised)"``, or why not."""
    name, _version = platform.libc_ver()
    if name != "glibc":
        return f"not changed: the C library is {name or 'unknown'}, not glibc"
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return "not changed: this C library has no mallopt"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success and 0 when it rejects a value.
    rejected = [name for name, parameter, value in _SETTINGS if not mallopt(parameter, value)]
    if rejected:
        return f"not kept: mallopt rejected {', '.join(rejected)}"
    return KEPT
