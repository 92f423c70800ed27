"""Model FLOPs utilisation: the fraction of a device's peak FLOP/s that training achieves.

``mfu = flops_per_token * tokens_per_second / peak``, with the peak and where it came from
given by :func:`peak_with_source`, first found of:

- ``[metrics] peak_flops`` when the config sets it;
- on CUDA, the dense (no sparsity) peak of a known GPU from :data:`GPU_PEAKS`;
- on CPU, the theoretical peak, cores used x maximum clock x FLOP per cycle per core, where
  the CPU reports all three (:func:`theoretical_cpu_peak`: not in most VMs, which hide the
  boost clock);
- else on CPU, the best of several timed matmuls, cached on disk (keyed by CPU model, thread
  count, torch version and dtype) only when the machine was idle, since a rate measured under
  load is too low and would make MFU too high. :func:`remeasure_cpu_peak` replaces a cached
  rate that an MFU above 1 proved wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from forge_lm.errors import ConfigError
from forge_lm.model.linear import onednn_available

_SET_PEAK = "set [metrics] peak_flops to the peak FLOP/s of one device (e.g. --metrics.peak_flops=3.12e14)"

# Dense peaks (FLOP/s) per GPU from the vendor's datasheets; the sheets quote tensor-core rates
# "with sparsity", which are halved here. "fp32" is the plain (non-tensor-core) FP32 rate:
# PyTorch computes fp32 matmuls without TF32 unless torch.backends.cuda.matmul.allow_tf32 is
# set. "bf16" is the BF16 tensor-core rate with FP32 accumulation (what PyTorch uses).
# Patterns are tried in order against torch.cuda.get_device_name(), so variants come first.
GPU_PEAKS: list[tuple[str, str, dict[str, float]]] = [
    # Blackwell datasheet / HGX B200 spec: 36 PFLOPS BF16 sparse for 8 GPUs -> 2.25 P dense each.
    (r"\bB200\b", "NVIDIA B200", {"bf16": 2.25e15}),
    # H200 datasheet: NVL 1,671 TFLOPS BF16 sparse, 60 TFLOPS FP32.
    (r"\bH200\b.*\bNVL\b", "NVIDIA H200 NVL", {"bf16": 835.5e12, "fp32": 60e12}),
    # GH200 datasheet: the Hopper GPU of an SXM H100 (989 TFLOPS BF16 dense, 67 TFLOPS FP32).
    (r"\bGH200\b", "NVIDIA GH200", {"bf16": 989.4e12, "fp32": 66.9e12}),
    # H200 datasheet: SXM 1,979 TFLOPS BF16 sparse, 67 TFLOPS FP32 (same compute as H100 SXM).
    (r"\bH200\b", "NVIDIA H200 SXM", {"bf16": 989.4e12, "fp32": 66.9e12}),
    # H100 datasheet: NVL 1,671 TFLOPS BF16 sparse, 60 TFLOPS FP32.
    (r"\bH100\b.*\bNVL\b", "NVIDIA H100 NVL", {"bf16": 835.5e12, "fp32": 60e12}),
    # H100 datasheet: PCIe 1,513 TFLOPS BF16 sparse, 51 TFLOPS FP32.
    (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe", {"bf16": 756.5e12, "fp32": 51.2e12}),
    # H100 datasheet: SXM5 1,979 TFLOPS BF16 sparse, 67 TFLOPS FP32 ("NVIDIA H100 80GB HBM3").
    (r"\bH100\b", "NVIDIA H100 SXM", {"bf16": 989.4e12, "fp32": 66.9e12}),
    # A100 datasheet: 312 TFLOPS BF16 dense, 19.5 TFLOPS FP32, SXM4 and PCIe, 40 and 80 GB alike.
    (r"\bA100\b", "NVIDIA A100", {"bf16": 312e12, "fp32": 19.5e12}),
    # L40S datasheet: 733 TFLOPS BF16 sparse, 91.6 TFLOPS FP32.
    (r"\bL40S\b", "NVIDIA L40S", {"bf16": 366.5e12, "fp32": 91.6e12}),
    # L40 datasheet: 362.1 TFLOPS BF16 sparse, 90.5 TFLOPS FP32.
    (r"\bL40\b", "NVIDIA L40", {"bf16": 181e12, "fp32": 90.5e12}),
    # L4 datasheet: 242 TFLOPS BF16 sparse, 30.3 TFLOPS FP32.
    (r"\bL4\b", "NVIDIA L4", {"bf16": 121e12, "fp32": 30.3e12}),
    # A10 datasheet: 250 TFLOPS BF16 sparse, 31.2 TFLOPS FP32. (Not the A10G, which differs.)
    (r"\bA10\b", "NVIDIA A10", {"bf16": 125e12, "fp32": 31.2e12}),
    # RTX 6000 Ada datasheet: 91.1 TFLOPS FP32; Ada whitepaper: BF16 tensor (FP32 accumulate) 364.2 dense.
    (r"\bRTX 6000 Ada\b", "NVIDIA RTX 6000 Ada", {"bf16": 364.2e12, "fp32": 91.1e12}),
    # RTX A6000 datasheet: 309.7 TFLOPS tensor sparse, 38.7 TFLOPS FP32.
    (r"\bA6000\b", "NVIDIA RTX A6000", {"bf16": 154.8e12, "fp32": 38.7e12}),
    # Ada whitepaper (appendix A): RTX 4090, BF16 tensor with FP32 accumulate 165.2 dense, FP32 82.6.
    (r"\bRTX 4090\b", "NVIDIA GeForce RTX 4090", {"bf16": 165.2e12, "fp32": 82.6e12}),
    # Ampere GA102 whitepaper: RTX 3090, BF16 tensor with FP32 accumulate 71 dense, FP32 35.6.
    (r"\bRTX 3090\b", "NVIDIA GeForce RTX 3090", {"bf16": 71e12, "fp32": 35.6e12}),
    # V100 and T4 datasheets: no BF16 tensor cores; FP32 15.7 (SXM2) and 8.1 TFLOPS.
    (r"\bV100\b", "NVIDIA V100", {"fp32": 15.7e12}),
    (r"\bT4\b", "NVIDIA T4", {"fp32": 8.1e12}),
]

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}

CPU_MEASURE_SECONDS = 0.2  # target duration of one timed matmul
# The best of these is the peak: a matmul slowed by another process only loses, so more tries
# make it likelier that one of them ran undisturbed. Seven at 0.2 s is under two seconds.
CPU_MEASURE_REPEATS = 7
_MAX_SIZE = 8192  # 1.1 TFLOP per matmul: enough for any CPU, bounded for a slow one
# A measurement is not cached when the 1-minute load of the other processes exceeds this
# fraction of the CPUs: they took time slices from the timed matmuls, so the rate is too low
# and every later MFU computed from it too high.
BUSY_LOAD_FRACTION = 0.5

CONFIGURED_SOURCE = "configured ([metrics] peak_flops)"


def peak_with_source(
    device: torch.device | str, dtype: torch.dtype | None, configured: float | None = None
) -> tuple[float, str]:
    """Peak FLOP/s of one ``device`` computing in ``dtype``, with where it came from.

    ``dtype`` is the autocast dtype, None meaning plain fp32 (no autocast). ``configured`` (the
    config's ``[metrics] peak_flops``) wins; then on CUDA the table of GPUs; on CPU the
    theoretical peak where the CPU's numbers are known, else a measurement (cached when the
    machine was idle). The source is a short phrase for logs and ``forge doctor``, e.g.
    ``"GPU table: NVIDIA H100 SXM bf16"``; it starts with ``"measured"`` exactly when the peak
    was measured (see :func:`is_measured`). Raises ConfigError when no peak is known.
    """
    if configured is not None:
        return float(configured), CONFIGURED_SOURCE
    device = torch.device(device)
    dtype = torch.float32 if dtype is None else dtype
    dtype_name = _DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        raise ConfigError(f"[metrics] peak_flops: no known peak for dtype {dtype}; {_SET_PEAK}.")
    if device.type == "cuda":
        return gpu_peak_with_source(torch.cuda.get_device_name(device), dtype_name)
    if device.type == "cpu":
        return cpu_peak_with_source(dtype)
    raise ConfigError(f"[metrics] peak_flops: no known peak for device type '{device.type}'; {_SET_PEAK}.")


def peak_flops(device: torch.device | str, dtype: torch.dtype | None, configured: float | None = None) -> float:
    """Peak FLOP/s of one ``device`` computing in ``dtype``; ``configured`` (the config's) wins.

    ``dtype`` is the autocast dtype, None meaning plain fp32 (no autocast). The peak alone of
    :func:`peak_with_source`.
    """
    return peak_with_source(device, dtype, configured)[0]


def is_measured(source: str) -> bool:
    """Whether a peak's ``source`` says it was measured (rather than configured or looked up):
    only such a peak can be wrong enough for MFU to exceed 1, and only it can be re-measured."""
    return source.startswith("measured")


def world_peak_with_source(
    device: torch.device | str, dtype: torch.dtype | None, configured: float | None, world_size: int
) -> tuple[float, str] | None:
    """The peak of ``world_size`` such devices and its source, or None when Forge knows no peak
    for this one (a GPU missing from the table, a dtype it lists no peak for): then one warning
    says how to set ``metrics.peak_flops`` and MFU is not logged. MFU is a report; it never
    stops a run."""
    try:
        peak, source = peak_with_source(device, dtype, configured)
    except ConfigError as unknown:
        print(
            f"forge: warning: MFU will not be logged: {str(unknown).removeprefix('[metrics] peak_flops: ')}",
            file=sys.stderr,
            flush=True,
        )
        return None
    return peak * world_size, source


def world_peak_flops(
    device: torch.device | str, dtype: torch.dtype | None, configured: float | None, world_size: int
) -> float | None:
    """The peak alone of :func:`world_peak_with_source`, or None (warned) when none is known."""
    found = world_peak_with_source(device, dtype, configured, world_size)
    return None if found is None else found[0]


def gpu_peak_with_source(device_name: str, dtype_name: str) -> tuple[float, str]:
    """The table's dense peak for a GPU named like ``torch.cuda.get_device_name()`` says."""
    for pattern, label, peaks in GPU_PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if dtype_name not in peaks:
                raise ConfigError(
                    f"[metrics] peak_flops: {label} has no {dtype_name} peak in Forge's table; {_SET_PEAK}."
                )
            return peaks[dtype_name], f"GPU table: {label} {dtype_name}"
    raise ConfigError(f"[metrics] peak_flops: GPU '{device_name}' is not in Forge's table of peaks; {_SET_PEAK}.")


def gpu_peak_flops(device_name: str, dtype_name: str) -> float:
    """The table's dense peak for a GPU named like ``torch.cuda.get_device_name()`` says."""
    return gpu_peak_with_source(device_name, dtype_name)[0]


def mfu(flops_per_token: float, tokens_per_second: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over ``peak``, a fraction (0.4 means 40%).

    ``tokens_per_second`` and ``peak`` must describe the same devices: per device, or both
    summed over all of them.
    """
    if not peak > 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {peak!r}")
    return flops_per_token * tokens_per_second / peak


# --------------------------------------------------------------------------------------
# CPU, theoretical: cores x clock x FLOP per cycle per core, where all three are known.
# --------------------------------------------------------------------------------------

CPUINFO_PATH = Path("/proc/cpuinfo")
SYSFS_CPU_PATH = Path("/sys/devices/system/cpu")


def cpu_peak_with_source(dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """The CPU's peak FLOP/s in ``dtype`` at torch's thread count, with its source: the
    theoretical peak when :func:`theoretical_cpu_peak` knows it, else a measured matmul rate
    (from the cache, or measured now: see :func:`measured_cpu_peak`)."""
    theoretical, source = theoretical_cpu_peak(dtype)
    if theoretical is not None:
        return theoretical, source
    return measured_cpu_peak(dtype)


def cpu_peak_flops(dtype: torch.dtype = torch.float32) -> float:
    """The peak alone of :func:`cpu_peak_with_source`."""
    return cpu_peak_with_source(dtype)[0]


def known_cpu_peak(dtype: torch.dtype = torch.float32) -> tuple[float | None, str]:
    """The CPU's peak and source where it is known without measuring (theoretical, or cached),
    else ``(None, why)``: what ``forge doctor`` shows, as a check must stay quick."""
    theoretical, reason = theoretical_cpu_peak(dtype)
    if theoretical is not None:
        return theoretical, reason
    cached = _cached_entry(_read_cache(cache_path()), cpu_cache_key(dtype))
    if cached is not None:
        return cached["flops"], _measured_source(cached, f"cached {cached['date']}")
    return None, f"not measured yet (the first run on this CPU measures it); no theoretical peak: {reason}"


def theoretical_cpu_peak(
    dtype: torch.dtype = torch.float32,
    *,
    cpuinfo: str | None = None,
    sysfs: Path | None = None,
    affinity: set[int] | None = None,
    threads: int | None = None,
) -> tuple[float | None, str]:
    """``(peak, source)`` with peak = cores used x maximum clock x FLOP per cycle per core, or
    ``(None, why not)`` when one of the three is unknown.

    Cores used: torch's thread count, at most the physical cores this process may run on
    (distinct ``(physical id, core id)`` pairs of ``/proc/cpuinfo`` among the CPUs of
    ``os.sched_getaffinity``): a second hardware thread on a core shares its FMA units, so it
    adds no FLOPs. Clock: the highest ``cpufreq/cpuinfo_max_freq`` in sysfs, the boost clock.
    Without it (usual in a VM) there is no theoretical peak: ``/proc/cpuinfo``'s ``cpu MHz`` is
    the nominal clock there, below what the CPU really runs at, so the peak would be too low
    and MFU too high. FLOP per cycle: :func:`cpu_flop_per_cycle`.

    ``cpuinfo`` (the text of /proc/cpuinfo), ``sysfs`` (the /sys/devices/system/cpu folder),
    ``affinity`` and ``threads`` default to this machine's and this process's.
    """
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO_PATH.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None, f"{CPUINFO_PATH} is not readable"
    processors = parse_cpuinfo(cpuinfo)
    if affinity is None:
        affinity = _affinity()
    threads = torch.get_num_threads() if threads is None else threads
    sysfs = SYSFS_CPU_PATH if sysfs is None else sysfs
    available = [p for p in processors if _int(p.get("processor")) in affinity] if affinity else processors
    if not available:
        return None, "/proc/cpuinfo lists none of the CPUs this process may run on"
    flop, kind = cpu_flop_per_cycle(available[0], _DTYPE_NAMES.get(dtype, str(dtype)))
    if flop is None:
        return None, kind
    clocks = [_max_freq_khz(sysfs, _int(p.get("processor"))) for p in available]
    clock_khz = max((khz for khz in clocks if khz is not None), default=None)
    if not clock_khz:
        return None, (
            "no cpufreq/cpuinfo_max_freq in sysfs (usual in a VM), so the boost clock is unknown; "
            "/proc/cpuinfo's 'cpu MHz' is only the nominal clock"
        )
    cores = min(threads, _physical_cores(available))
    peak = cores * clock_khz * 1e3 * flop
    return peak, f"theoretical: {cores} cores x {clock_khz / 1e6:.2f} GHz x {flop} FLOP/cycle ({kind})"


def parse_cpuinfo(text: str) -> list[dict[str, str]]:
    """The blocks of /proc/cpuinfo (one per logical CPU) as ``{lower-case field: value}``."""
    processors: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in [*text.splitlines(), ""]:
        if not line.strip():
            if current:
                processors.append(current)
            current = {}
        elif ":" in line:
            key, value = line.split(":", 1)
            current[key.strip().lower()] = value.strip()
    return processors


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX-512 BF16 or AMX), as torch's own CPU
    feature detection (cpuinfo) reports them. Without them torch emulates bf16 matmuls, several
    times slower than fp32; with them bf16 runs about twice the fp32 rate."""
    detected = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(callable(check) and check() for check in detected)


# FLOP per cycle per core, from the width and number of each core's FMA units (an FMA is two
# FLOPs): fp32 lanes per vector x 2 x units. Sources: Intel 64 and IA-32 Architectures
# Optimization Reference Manual (Haswell and later: two 256-bit FMA ports; Skylake-SP Xeon:
# two 512-bit FMA units, one on Silver/Bronze SKUs, where Intel's SKU lists give "AVX-512 FMA
# units: 1"; Sapphire Rapids AMX: the TMUL does 1024 BF16 multiply-adds per cycle per core);
# AMD Software Optimization Guides for family 17h (Zen 2: two 256-bit FMA pipes), 19h (Zen 3
# likewise; Zen 4 runs 512-bit AVX-512 as two halves on them) and 1Ah (Zen 5: 512-bit FMA
# pipes). AVX512_BF16's VDPBF16PS does two bf16 products per fp32 lane: twice the fp32 rate.
# Older or other CPUs are left out: their peak is measured instead.
_AVX512_TWO_UNITS = (64, "AVX-512, 2 FMA units")
_AVX512_ONE_UNIT = (32, "AVX-512, 1 FMA unit")
_AVX2 = (32, "AVX2, 2 FMA units")


def cpu_flop_per_cycle(processor: dict[str, str], dtype_name: str) -> tuple[int | None, str]:
    """``(FLOP per cycle per core, what sets it)`` for one /proc/cpuinfo block computing in
    ``dtype_name`` ("fp32" or "bf16"), or ``(None, why not)`` for a CPU or dtype not known."""
    flags = set(processor.get("flags", "").split())
    model_name = processor.get("model name", "unknown CPU")
    if dtype_name == "bf16":
        if "amx_bf16" in flags:
            return 2048, "AMX-BF16, 1024 multiply-adds"
        if "avx512_bf16" in flags:
            fp32, kind = cpu_flop_per_cycle(processor, "fp32")
            if fp32 is None:
                return None, kind
            return 2 * fp32, f"AVX512-BF16, twice the fp32 rate of {kind}"
        return None, f"{model_name}: no bf16 matrix instructions (amx_bf16, avx512_bf16) among its flags"
    if dtype_name != "fp32":
        return None, f"no theoretical CPU peak for {dtype_name}"
    vendor = processor.get("vendor_id", "")
    family = _int(processor.get("cpu family"))
    model = _int(processor.get("model"))
    has_avx2 = {"avx2", "fma"} <= flags
    found: tuple[int, str] | None = None
    if vendor == "GenuineIntel":
        if "avx512f" in flags and "xeon" in model_name.lower():
            one_unit = re.search(r"\b(silver|bronze)\b", model_name, flags=re.IGNORECASE)
            found = _AVX512_ONE_UNIT if one_unit else _AVX512_TWO_UNITS
        elif has_avx2:  # Haswell and later: two 256-bit FMA ports (client AVX-512 has no more)
            found = _AVX2
    elif vendor == "AuthenticAMD" and family is not None:
        if family == 26 and "avx512f" in flags:
            found = (64, "Zen 5 AVX-512, 2 FMA units")
        elif family == 25 and "avx512f" in flags:
            found = (32, "Zen 4 AVX-512 on 256-bit units")
        elif has_avx2 and (family in (25, 26) or (family == 23 and model is not None and model >= 0x30)):
            found = _AVX2
    if found is None:
        return None, f"{model_name} ({vendor or 'unknown vendor'} family {family}): FLOP per cycle not known"
    return found


def _physical_cores(processors: list[dict[str, str]]) -> int:
    # Without topology fields every logical CPU counts as a core: a peak too high rather than
    # too low, so MFU errs low, never above 1.
    pairs = {(p.get("physical id"), p.get("core id")) for p in processors}
    if any(core is None for _, core in pairs):
        return len(processors)
    return len(pairs)


def _max_freq_khz(sysfs: Path, cpu: int | None) -> int | None:
    if cpu is None:
        return None
    try:
        khz = int((sysfs / f"cpu{cpu}" / "cpufreq" / "cpuinfo_max_freq").read_text().strip())
    except (OSError, ValueError):
        return None
    return khz if khz > 0 else None


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux: every CPU listed
        return set()


def _int(text: str | None) -> int | None:
    # /proc/cpuinfo writes family, model and ids in decimal; a field may be absent or odd.
    try:
        return int(text or "")
    except ValueError:
        return None


# --------------------------------------------------------------------------------------
# CPU, measured: the best of several matmuls, cached on disk only when the machine was idle.
# --------------------------------------------------------------------------------------


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
    key = cpu_cache_key(dtype)
    cached = _cached_entry(_read_cache(cache_path()), key)
    if cached is not None:
        return cached["flops"], _measured_source(cached, f"cached {cached['date']}")
    if key in _BUSY_MEASUREMENTS:  # measured on a busy machine earlier in this process
        return _BUSY_MEASUREMENTS[key]
    return _measure_and_maybe_cache(dtype, key)


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
    others, cpus = machine_load()  # before measuring: the measurement itself loads the machine
    measured = measure_cpu(dtype)
    if others is not None and others > BUSY_LOAD_FRACTION * cpus:
        source = _measured_source(dataclasses.asdict(measured), "not cached", busy=f"load {others:.1f} on {cpus} CPUs")
        print(
            f"forge: warning: the CPU peak for MFU was {source}: other processes were running, so it is "
            "probably too low and MFU too high; it is used for this run only. Fix: run on an idle machine "
            "once, or set [metrics] peak_flops",
            file=sys.stderr,
            flush=True,
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


def machine_load() -> tuple[float | None, int]:
    """``(1-minute load of the other processes, CPUs of the machine)``; the load is None where
    the system does not report one (then a measurement is trusted and cached).

    The load average counts runnable threads of the whole machine, so it is compared with all
    its CPUs, not only those this process may use. This process's own share (a training run
    calling :func:`remeasure_cpu_peak` has kept its threads busy) is taken out, estimated as
    the CPU time it used since this module was imported over that time, or over the load
    average's one minute when shorter.
    """
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None, cpus
    return max(0.0, load - _own_load()), cpus


_IMPORTED_AT = (time.monotonic(), time.process_time())


def _own_load() -> float:
    wall = time.monotonic() - _IMPORTED_AT[0]
    cpu = time.process_time() - _IMPORTED_AT[1]
    return cpu / max(wall, 60.0)


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
    torch build has it. In bf16 torch.mm already runs on oneDNN."""
    kernels: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"torch.mm": torch.mm}
    if dtype == torch.float32 and onednn_available():
        kernels["oneDNN linear"] = lambda a, b: torch.ops.forge.onednn_linear(a, b)
    return kernels


def cpu_cache_key(dtype: torch.dtype) -> str:
    dtype_name = _DTYPE_NAMES.get(dtype, str(dtype))
    kernels = "+".join(matmul_kernels(dtype))
    return f"{cpu_model()} | threads={torch.get_num_threads()} | torch={torch.__version__} | {dtype_name} | {kernels}"


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform module knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/forge_lm/peak_flops.json``, or under ``~/.cache`` without it."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "forge_lm" / "peak_flops.json"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}  # absent or damaged: measure again and rewrite it
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, cache: dict[str, Any]) -> None:
    # Written to a temporary file and renamed, so a reader never sees half a file. A cache that
    # cannot be written (read-only home) only costs a measurement next time, so it is not an error.
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".peak_flops.", suffix=".json")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                json.dump(cache, file, indent=2, sort_keys=True)
            os.replace(temporary, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
