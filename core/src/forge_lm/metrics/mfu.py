"""Model FLOPs utilisation: the fraction of a device's peak FLOP/s that training achieves.

``mfu = flops_per_token * tokens_per_second / peak``, with the peak from :func:`peak_flops`:
``[metrics] peak_flops`` when the config sets it; on CUDA, the dense (no sparsity) peak of a
known GPU from :data:`GPU_PEAKS`; on CPU, a matmul rate measured once and cached on disk,
keyed by CPU model, thread count, torch version and dtype, so later runs reuse it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from forge_lm.errors import ConfigError

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
CPU_MEASURE_REPEATS = 3  # the best of these is the peak (the others catch a busy moment)
_MAX_SIZE = 8192  # 1.1 TFLOP per matmul: enough for any CPU, bounded for a slow one


def peak_flops(device: torch.device | str, dtype: torch.dtype | None, configured: float | None = None) -> float:
    """Peak FLOP/s of one ``device`` computing in ``dtype``; ``configured`` (the config's) wins.

    ``dtype`` is the autocast dtype, None meaning plain fp32 (no autocast).
    """
    if configured is not None:
        return float(configured)
    device = torch.device(device)
    dtype = torch.float32 if dtype is None else dtype
    dtype_name = _DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        raise ConfigError(f"[metrics] peak_flops: no known peak for dtype {dtype}; {_SET_PEAK}.")
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype_name)
    if device.type == "cpu":
        return cpu_peak_flops(dtype)
    raise ConfigError(f"[metrics] peak_flops: no known peak for device type '{device.type}'; {_SET_PEAK}.")


def world_peak_flops(
    device: torch.device | str, dtype: torch.dtype | None, configured: float | None, world_size: int
) -> float | None:
    """The peak of ``world_size`` such devices, or None when Forge knows no peak for this one
    (a GPU missing from the table, a dtype it lists no peak for): then one warning says how to
    set ``metrics.peak_flops`` and MFU is not logged. MFU is a report; it never stops a run."""
    try:
        return peak_flops(device, dtype, configured) * world_size
    except ConfigError as unknown:
        print(
            f"forge: warning: MFU will not be logged: {str(unknown).removeprefix('[metrics] peak_flops: ')}",
            file=sys.stderr,
            flush=True,
        )
        return None


def gpu_peak_flops(device_name: str, dtype_name: str) -> float:
    """The table's dense peak for a GPU named like ``torch.cuda.get_device_name()`` says."""
    for pattern, label, peaks in GPU_PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if dtype_name not in peaks:
                raise ConfigError(
                    f"[metrics] peak_flops: {label} has no {dtype_name} peak in Forge's table; {_SET_PEAK}."
                )
            return peaks[dtype_name]
    raise ConfigError(f"[metrics] peak_flops: GPU '{device_name}' is not in Forge's table of peaks; {_SET_PEAK}.")


def mfu(flops_per_token: float, tokens_per_second: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over ``peak``, a fraction (0.4 means 40%).

    ``tokens_per_second`` and ``peak`` must describe the same devices: per device, or both
    summed over all of them.
    """
    if not peak > 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {peak!r}")
    return flops_per_token * tokens_per_second / peak


# --------------------------------------------------------------------------------------
# CPU: measured once per machine set-up, then read from the cache.
# --------------------------------------------------------------------------------------


def cpu_peak_flops(dtype: torch.dtype = torch.float32) -> float:
    """The CPU's matmul FLOP/s in ``dtype`` at torch's thread count, from the cache or measured."""
    key = cpu_cache_key(dtype)
    path = cache_path()
    cache = _read_cache(path)
    if isinstance(cache.get(key), int | float) and cache[key] > 0:
        return float(cache[key])
    measured = measure_cpu_flops(dtype)
    cache[key] = measured
    _write_cache(path, cache)
    return measured


def measure_cpu_flops(dtype: torch.dtype = torch.float32) -> float:
    """Best FLOP/s of a few square matmuls, sized so that each takes about 0.2 s."""
    # Small matmuls run far below peak (overheads dominate), so one small probe would pick a
    # size too small: double it until a matmul takes a quarter of the target, then choose n so
    # that 2 n^3 flops take the target time. About a second in all, once per machine set-up.
    size = 256
    while True:
        seconds = 2 * size**3 / _matmul_rate(size, dtype, repeats=1)
        if seconds >= CPU_MEASURE_SECONDS / 4 or size >= _MAX_SIZE:
            break
        size *= 2
    size = round((CPU_MEASURE_SECONDS * size**3 / seconds) ** (1 / 3) / 64) * 64
    return _matmul_rate(min(max(size, 256), _MAX_SIZE), dtype, repeats=CPU_MEASURE_REPEATS)


def _matmul_rate(size: int, dtype: torch.dtype, repeats: int) -> float:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    torch.mm(a, b)  # warm-up: thread pool start and kernel selection are not part of the rate
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9)


def cpu_cache_key(dtype: torch.dtype) -> str:
    dtype_name = _DTYPE_NAMES.get(dtype, str(dtype))
    return f"{cpu_model()} | threads={torch.get_num_threads()} | torch={torch.__version__} | {dtype_name}"


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
    except (OSError, ValueError):
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
