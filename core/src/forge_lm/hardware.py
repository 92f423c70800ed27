"""What this host is: its CPU's model and matrix instructions, how busy it is, and where
Forge caches what it measured on it.

The MFU peak (:mod:`forge_lm.metrics.measured_peak`) and the CPU linear kernel's choice
(:mod:`forge_lm.model.linear_choice`) both measure the host, key their caches by its CPU and
trust a measurement only on an idle machine; their common ground lives here, below both.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path

import torch

# A measurement is not cached when the 1-minute load of the other processes exceeds this
# fraction of the CPUs: they took time slices from the timed work, so a measured rate is too
# low (and every later MFU computed from it too high).
BUSY_LOAD_FRACTION = 0.5


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX-512 BF16 or AMX), as torch's own CPU
    feature detection (cpuinfo) reports them. Without them torch emulates bf16 matmuls, several
    times slower than fp32; with them bf16 runs about twice the fp32 rate."""
    detected = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(callable(check) and check() for check in detected)


def cpu_multiplies_fp16() -> bool:
    """Whether torch runs this CPU's fp16 matmuls on oneDNN with fp16 instructions (AVX512-FP16 or
    AMX-FP16), as torch's own check reports it. Without them fp16 products are emulated, many
    times slower than fp32 (and than bf16 on a CPU with bf16 units)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:  # a build without oneDNN
        return False


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform module knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


# The CPU flags that decide which matrix-product kernel is fastest: two hosts of one model name
# (an "AMD EPYC" with AVX2 only, another with AVX-512 BF16) differ in them, so every cache of a
# measurement on this host is keyed by them as well as by the name.
MATRIX_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def matrix_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of :data:`MATRIX_FLAGS` this CPU has, in that order, from ``cpuinfo`` (the text of
    /proc/cpuinfo, read when not given; off Linux none are known)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
    for line in cpuinfo.splitlines():
        if line.lower().startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return [flag for flag in MATRIX_FLAGS if flag in present]
    return []


def host_key() -> str:
    """This host as the measurement caches name it: CPU model, matrix flags, torch's thread count
    and version (each changes which kernel is fastest, or how fast)."""
    flags = "+".join(matrix_flags()) or "no matrix flags known"
    return f"{cpu_model()} | {flags} | threads={torch.get_num_threads()} | torch={torch.__version__}"


def machine_load() -> tuple[float | None, int]:
    """``(1-minute load of the other processes, CPUs of the machine)``; the load is None where
    the system does not report one (then a measurement is trusted and cached).

    The load average counts runnable threads of the whole machine, so it is compared with all
    its CPUs, not only those this process may use. This process's own share (a training run
    re-measuring its peak has kept its threads busy) is taken out, estimated as the CPU time it
    used since this module was imported over that time, or over the load average's one minute
    when shorter.
    """
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None, cpus
    return max(0.0, load - _own_load()), cpus


def is_busy(others: float | None, cpus: int) -> bool:
    """Whether a load from :func:`machine_load` makes a measurement taken under it untrustworthy."""
    return others is not None and others > BUSY_LOAD_FRACTION * cpus


_IMPORTED_AT = (time.monotonic(), time.process_time())


def _own_load() -> float:
    wall = time.monotonic() - _IMPORTED_AT[0]
    cpu = time.process_time() - _IMPORTED_AT[1]
    return cpu / max(wall, 60.0)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/forge_lm``, or ``~/.cache/forge_lm`` without it: the measurements of
    this host (peak FLOP/s, the linear kernel's choice)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "forge_lm"
