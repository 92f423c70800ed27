"""Model FLOPs utilisation: the fraction of a device's peak FLOP/s that training achieves.

``mfu = flops_per_token * tokens_per_second / peak``, with the peak and where it came from
given by :func:`peak_with_source`, first found of:

- ``[metrics] peak_flops`` when the config sets it;
- on CUDA, the dense (no sparsity) peak of a known GPU (:mod:`forge_lm.metrics.gpu_peaks`);
- on CPU, the theoretical peak, cores used x maximum clock x FLOP per cycle per core, where
  the CPU reports all three (:mod:`forge_lm.metrics.cpu_peak`: not in most VMs, which hide the
  boost clock);
- else on CPU, the best of several timed matmuls, cached on disk only when the machine was
  idle (:mod:`forge_lm.metrics.measured_peak`).

Each is the peak of the run's autocast dtype: fp32, bf16 or, under ``precision = "fp16"``, fp16
(the GPU table's FP16 tensor-core rate, which its datasheets give as the BF16 rate wherever a GPU
has both; on a CPU the theoretical rate with AMX-FP16, else measured float16 products, which a
CPU without fp16 matrix instructions emulates, far below its fp32 rate).
"""

from __future__ import annotations

import torch

from forge_lm.errors import ConfigError
from forge_lm.metrics.cpu_peak import cpu_peak_with_source
from forge_lm.metrics.gpu_peaks import gpu_peak_with_source
from forge_lm.metrics.peak_dtypes import DTYPE_NAMES, SET_PEAK
from forge_lm.notices import warn

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
    dtype_name = DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        raise ConfigError(f"[metrics] peak_flops: no known peak for dtype {dtype}; {SET_PEAK}.")
    if device.type == "cuda":
        return gpu_peak_with_source(torch.cuda.get_device_name(device), dtype_name)
    if device.type == "cpu":
        return cpu_peak_with_source(dtype)
    raise ConfigError(f"[metrics] peak_flops: no known peak for device type '{device.type}'; {SET_PEAK}.")


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
        warn(f"MFU will not be logged: {str(unknown).removeprefix('[metrics] peak_flops: ')}")
        return None
    return peak * world_size, source


def world_peak_flops(
    device: torch.device | str, dtype: torch.dtype | None, configured: float | None, world_size: int
) -> float | None:
    """The peak alone of :func:`world_peak_with_source`, or None (warned) when none is known."""
    found = world_peak_with_source(device, dtype, configured, world_size)
    return None if found is None else found[0]


def mfu(flops_per_token: float, tokens_per_second: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over ``peak``, a fraction (0.4 means 40%).

    ``tokens_per_second`` and ``peak`` must describe the same devices: per device, or both
    summed over all of them.
    """
    if not peak > 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {peak!r}")
    return flops_per_token * tokens_per_second / peak
