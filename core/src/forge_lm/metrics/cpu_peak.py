"""A CPU's peak FLOP/s: the theoretical peak, cores used x maximum clock x FLOP per cycle per
core, where the CPU reports all three (not in most VMs, which hide the boost clock); else the
measured one (:mod:`forge_lm.metrics.measured_peak`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from forge_lm.metrics.measured_peak import cached_measurement, measured_cpu_peak
from forge_lm.metrics.peak_dtypes import DTYPE_NAMES

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
    cached = cached_measurement(dtype)
    if cached is not None:
        return cached
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
    flop, kind = cpu_flop_per_cycle(available[0], DTYPE_NAMES.get(dtype, str(dtype)))
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


# FLOP per cycle per core, from the width and number of each core's FMA units (an FMA is two
# FLOPs): fp32 lanes per vector x 2 x units. Sources: Intel 64 and IA-32 Architectures
# Optimization Reference Manual (Haswell and later: two 256-bit FMA ports; Skylake-SP Xeon:
# two 512-bit FMA units, one on Silver/Bronze SKUs, where Intel's SKU lists give "AVX-512 FMA
# units: 1"; Sapphire Rapids AMX: the TMUL does 1024 BF16 multiply-adds per cycle per core);
# AMD Software Optimization Guides for family 17h (Zen 2: two 256-bit FMA pipes), 19h (Zen 3
# likewise; Zen 4 runs 512-bit AVX-512 as two halves on them) and 1Ah (Zen 5: 512-bit FMA
# pipes). AVX512_BF16's VDPBF16PS does two bf16 products per fp32 lane: twice the fp32 rate.
# Intel's AMX-FP16 (Granite Rapids) tile multiply has AMX-BF16's throughput, in fp16.
# Older or other CPUs are left out: their peak is measured instead.
_AVX512_TWO_UNITS = (64, "AVX-512, 2 FMA units")
_AVX512_ONE_UNIT = (32, "AVX-512, 1 FMA unit")
_AVX2 = (32, "AVX2, 2 FMA units")


def cpu_flop_per_cycle(processor: dict[str, str], dtype_name: str) -> tuple[int | None, str]:
    """``(FLOP per cycle per core, what sets it)`` for one /proc/cpuinfo block computing in
    ``dtype_name`` ("fp32", "bf16" or "fp16"), or ``(None, why not)`` for a CPU or dtype not known."""
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
    if dtype_name == "fp16":
        # AMX-FP16 (Granite Rapids) runs TDPFP16PS at TDPBF16PS's rate, accumulating in fp32, and
        # torch's fp16 matmuls reach it through oneDNN. AVX512-FP16 alone is left to measurement:
        # its FMAs accumulate in fp16, and the rate of oneDNN's fp32-accumulating fp16 GEMM on it
        # is no per-cycle figure Forge knows. A CPU with neither emulates fp16 products, far below
        # its fp32 rate: measuring them is the only honest peak (MFU is then of that slow rate).
        if "amx_fp16" in flags:
            return 2048, "AMX-FP16, 1024 multiply-adds"
        return None, f"{model_name}: no fp16 matrix instructions (amx_fp16) among its flags"
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
