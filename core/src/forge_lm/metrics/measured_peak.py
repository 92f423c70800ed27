"""A CPU's peak FLOP/s measured: the best of several timed matmuls, cached on disk (keyed by
host: CPU model, matrix instruction flags, thread count and torch version; and by dtype and
kernels) only when the machine was idle,
since a rate measured under load is too low and would make MFU too high.
:func:`remeasure_cpu_peak` replaces a cached rate that an MFU above 1 proved wrong."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from forge_lm import hardware
from forge_lm.metrics.peak_dtypes import DTYPE_NAMES
from forge_lm.model.linear import onednn_available
from forge_lm.notices import warn
from forge_lm.safe_write import write_atomically

CPU_MEASURE_SECONDS = 0.2  # target duration of one timed matmul
# The best of these is the peak: a matmul slowed by another process only loses, so more tries
# make it likelier that one of them ran undisturbed. Seven at 0.2 s is under two seconds.
CPU_MEASURE_REPEATS = 7
_MAX_SIZE = 8192  # 1.1 TFLOP per matmul: enough for any CPU, bounded for a slow one


@dataclasses.dataclass(frozen=True)
class CpuMeasurement:
    flops: float  # FLOP/s of the fastest timed matmul
    size: int  # the matmuls were size x size
    repeats: int  # how many were timed
    threads: int  # torch's thread count during them


# Measurements taken on a busy machine, kept for the rest of this process only: its later
# peak lookups (another run in the same process, a test session) reuse them rather than spend
# two seconds measuring again, and the next process measures anew.
_BUSY_MEASUREMENTS: dict[str, tuple[float, str]] = {}


def measured_cpu_peak(dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """The cached measurement for this CPU, thread count, torch and dtype, else one taken now:
    cached when the machine was idle; when it was busy, used for this run only (warned)."""
    cached = cached_measurement(dtype)
    if cached is not None:
        return cached
    key = cpu_cache_key(dtype)
    if key in _BUSY_MEASUREMENTS:  # measured on a busy machine earlier in this process
        return _BUSY_MEASUREMENTS[key]
    return _measure_and_maybe_cache(dtype, key)


def cached_measurement(dtype: torch.dtype = torch.float32) -> tuple[float, str] | None:
    """The cached measurement for this CPU, thread count, torch and dtype with its source, or
    None when there is none (nothing is measured)."""
    cached = _cached_entry(_read_cache(cache_path()), cpu_cache_key(dtype))
    if cached is None:
        return None
    return cached["flops"], _measured_source(cached, f"cached {cached['date']}")


def remeasure_cpu_peak_with_source(dtype: torch.dtype | None = torch.float32) -> tuple[float, str]:
    """Drop the cached measurement for ``dtype`` (None: fp32) and measure again, caching the
    new rate only when the machine is idle.

    For when a measured peak proved wrong: an MFU above 1 means the cached rate was measured
    on a busy machine (or before something sped it up)."""
    dtype = torch.float32 if dtype is None else dtype
    key = cpu_cache_key(dtype)
    _BUSY_MEASUREMENTS.pop(key, None)
    path = cache_path()
    cache = _read_cache(path)
    if cache.pop(key, None) is not None:
        _write_cache(path, cache)
    return _measure_and_maybe_cache(dtype, key)


def remeasure_cpu_peak(dtype: torch.dtype | None = torch.float32) -> float:
    """The peak alone of :func:`remeasure_cpu_peak_with_source`."""
    return remeasure_cpu_peak_with_source(dtype)[0]


def _measure_and_maybe_cache(dtype: torch.dtype, key: str) -> tuple[float, str]:
    others, cpus = hardware.machine_load()  # before measuring: the measurement itself loads the machine
    measured = measure_cpu(dtype)
    if hardware.is_busy(others, cpus):
        source = _measured_source(dataclasses.asdict(measured), "not cached", busy=f"load {others:.1f} on {cpus} CPUs")
        warn(
            f"the CPU peak for MFU was {source}: other processes were running, so it is "
            "probably too low and MFU too high; it is used for this run only. Fix: run on an idle machine "
            "once, or set [metrics] peak_flops",
        )
        _BUSY_MEASUREMENTS[key] = (measured.flops, source)
        return measured.flops, source
    entry = {**dataclasses.asdict(measured), "date": datetime.date.today().isoformat()}
    path = cache_path()
    cache = _read_cache(path)  # read again: another process may have added entries meanwhile
    cache[key] = entry
    _write_cache(path, cache)
    return measured.flops, _measured_source(entry, f"cached {entry['date']}")


def _measured_source(entry: dict[str, Any], cached: str, busy: str | None = None) -> str:
    what = f"best of {entry['repeats']} matmuls of {entry['size']}^2 at {entry['threads']} threads, {cached}"
    return f"measured while busy ({busy}): {what}" if busy else f"measured: {what}"


def _cached_entry(cache: dict[str, Any], key: str) -> dict[str, Any] | None:
    # Entries of older Forge versions (a bare number) carry no sign of how they were measured,
    # maybe on a busy machine: they are measured again and replaced.
    entry = cache.get(key)
    if not isinstance(entry, dict):
        return None
    fields = ("flops", "size", "repeats", "threads")
    if not all(isinstance(entry.get(f), int | float) and entry[f] > 0 for f in fields):
        return None
    if not isinstance(entry.get("date"), str):
        return None
    return {**entry, "flops": float(entry["flops"])}


def measure_cpu(dtype: torch.dtype = torch.float32) -> CpuMeasurement:
    """Best FLOP/s of several square matmuls, sized so that each takes about 0.2 s."""
    # Small matmuls run far below peak (overheads dominate), so one small probe would pick a
    # size too small: double it until a matmul takes a quarter of the target, then choose n so
    # that 2 n^3 flops take the target time. About two seconds in all, once per machine set-up.
    size = 256
    while True:
        seconds = 2 * size**3 / _matmul_rate(size, dtype, repeats=1)
        if seconds >= CPU_MEASURE_SECONDS / 4 or size >= _MAX_SIZE:
            break
        size *= 2
    size = min(max(round((CPU_MEASURE_SECONDS * size**3 / seconds) ** (1 / 3) / 64) * 64, 256), _MAX_SIZE)
    rate = _matmul_rate(size, dtype, repeats=CPU_MEASURE_REPEATS)
    return CpuMeasurement(flops=rate, size=size, repeats=CPU_MEASURE_REPEATS, threads=torch.get_num_threads())


def measure_cpu_flops(dtype: torch.dtype = torch.float32) -> float:
    """The rate alone of :func:`measure_cpu`."""
    return measure_cpu(dtype).flops


def _matmul_rate(size: int, dtype: torch.dtype, repeats: int) -> float:
    """The best rate of ``size``-square products over the kernels a run's layers can take
    (:func:`matmul_kernels`): the peak must be one the model's products can reach, or MFU
    would exceed 1 (in fp32, oneDNN's GEMM can be twice torch.mm's MKL sgemm)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    best = float("inf")
    for kernel in matmul_kernels(dtype).values():
        kernel(a, b)  # warm-up: thread pool start and kernel selection are not part of the rate
        for _ in range(repeats):
            start = time.perf_counter()
            kernel(a, b)
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9)


def matmul_kernels(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The CPU matrix-product kernels measured for the peak of ``dtype``, by name: torch.mm,
    and in fp32 the oneDNN product of Forge's linear layers (forge_lm.model.linear) where this
    torch build has it. In bf16 and fp16, ``F.linear`` too (``a @ b.T``, a linear layer's product
    under autocast): on a CPU without bf16 or fp16 matrix instructions torch emulates those
    products, and the linear layout ran far faster than torch.mm's ``a @ b`` (at 512, one thread,
    AMD EPYC with AVX2: fp16 6.7 against 1.4 GFLOP/s, bf16 about 11-15 against 1.7), so a peak
    of torch.mm alone would put MFU above 1."""
    kernels: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"torch.mm": torch.mm}
    if dtype == torch.float32 and onednn_available():
        kernels["oneDNN linear"] = lambda a, b: torch.ops.forge.onednn_linear(a, b)
    if dtype in (torch.bfloat16, torch.float16):
        kernels["F.linear"] = torch.nn.functional.linear
    return kernels


def cpu_cache_key(dtype: torch.dtype) -> str:
    dtype_name = DTYPE_NAMES.get(dtype, str(dtype))
    kernels = "+".join(matmul_kernels(dtype))
    return f"{hardware.host_key()} | {dtype_name} | {kernels}"


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/forge_lm/peak_flops.json``, or under ``~/.cache`` without it."""
    return hardware.cache_dir() / "peak_flops.json"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}  # absent or damaged: measure again and rewrite it
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, cache: dict[str, Any]) -> None:
    # Written whole or not at all, never through a link (forge_lm.safe_write); not flushed to the
    # disk, as a lost cache only costs a measurement. A cache that cannot be written (read-only
    # home) costs the same, so it is not an error.
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(cache, indent=2, sort_keys=True), durable=False)
