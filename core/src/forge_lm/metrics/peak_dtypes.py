"""The dtypes a peak FLOP/s is known for, by the name the peak tables use, and the hint every
"no known peak" error ends with."""

from __future__ import annotations

import torch

# torch dtype -> the name of its column in the GPU table (gpu_peaks), of its FLOP per cycle on
# a CPU (cpu_peak) and of its entry in the measured-peak cache (measured_peak).
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

SET_PEAK = "set [metrics] peak_flops to the peak FLOP/s of one device (e.g. --metrics.peak_flops=3.12e14)"
