"""The dense peak FLOP/s of known GPUs, from their vendors' datasheets."""

from __future__ import annotations

import re

from forge_lm.errors import ConfigError
from forge_lm.metrics.peak_dtypes import SET_PEAK

# Dense peaks (FLOP/s) per GPU from the vendor's datasheets; the sheets quote tensor-core rates
# "with sparsity", which are halved here. "fp32" is the plain (non-tensor-core) FP32 rate:
# PyTorch computes fp32 matmuls without TF32 unless torch.backends.cuda.matmul.allow_tf32 is
# set. "bf16" is the BF16 tensor-core rate with FP32 accumulation (what PyTorch uses). "fp16" is
# the FP16 tensor-core rate with FP32 accumulation (cuBLAS's compute type for PyTorch's fp16
# matmuls): every datasheet below that lists both gives FP16 the BF16 figure ("FP16/BF16" on
# Blackwell's; two equal rows on Hopper's, Ampere's and Ada's; the Ada and GA102 whitepapers list
# the GeForce cards' FP16 with FP32 accumulate equal to BF16, half their FP16-accumulate rate),
# so those entries repeat it. V100 and T4 have FP16 tensor cores and no BF16. (The fp16 figures
# were written from those documents as known, without network access to re-read them.)
# Patterns are tried in order against torch.cuda.get_device_name(), so variants come first.
GPU_PEAKS: list[tuple[str, str, dict[str, float]]] = [
    # Blackwell datasheet / HGX B200 spec: 36 PFLOPS BF16 sparse for 8 GPUs -> 2.25 P dense each.
    (r"\bB200\b", "NVIDIA B200", {"bf16": 2.25e15, "fp16": 2.25e15}),
    # H200 datasheet: NVL 1,671 TFLOPS BF16 sparse, 60 TFLOPS FP32.
    (r"\bH200\b.*\bNVL\b", "NVIDIA H200 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 60e12}),
    # GH200 datasheet: the Hopper GPU of an SXM H100 (989 TFLOPS BF16 dense, 67 TFLOPS FP32).
    (r"\bGH200\b", "NVIDIA GH200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),
    # H200 datasheet: SXM 1,979 TFLOPS BF16 sparse, 67 TFLOPS FP32 (same compute as H100 SXM).
    (r"\bH200\b", "NVIDIA H200 SXM", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),
    # H100 datasheet: NVL 1,671 TFLOPS BF16 sparse, 60 TFLOPS FP32.
    (r"\bH100\b.*\bNVL\b", "NVIDIA H100 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 60e12}),
    # H100 datasheet: PCIe 1,513 TFLOPS BF16 sparse, 51 TFLOPS FP32.
    (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe", {"bf16": 756.5e12, "fp16": 756.5e12, "fp32": 51.2e12}),
    # H100 datasheet: SXM5 1,979 TFLOPS BF16 sparse, 67 TFLOPS FP32 ("NVIDIA H100 80GB HBM3").
    (r"\bH100\b", "NVIDIA H100 SXM", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),
    # A100 datasheet: 312 TFLOPS BF16 dense, 19.5 TFLOPS FP32, SXM4 and PCIe, 40 and 80 GB alike.
    (r"\bA100\b", "NVIDIA A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    # L40S datasheet: 733 TFLOPS BF16 sparse, 91.6 TFLOPS FP32.
    (r"\bL40S\b", "NVIDIA L40S", {"bf16": 366.5e12, "fp16": 366.5e12, "fp32": 91.6e12}),
    # L40 datasheet: 362.1 TFLOPS BF16 sparse, 90.5 TFLOPS FP32.
    (r"\bL40\b", "NVIDIA L40", {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12}),
    # L4 datasheet: 242 TFLOPS BF16 sparse, 30.3 TFLOPS FP32.
    (r"\bL4\b", "NVIDIA L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    # A10 datasheet: 250 TFLOPS BF16 sparse, 31.2 TFLOPS FP32. (Not the A10G, which differs.)
    (r"\bA10\b", "NVIDIA A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    # RTX 6000 Ada datasheet: 91.1 TFLOPS FP32; Ada whitepaper: BF16 tensor (FP32 accumulate) 364.2 dense.
    (r"\bRTX 6000 Ada\b", "NVIDIA RTX 6000 Ada", {"bf16": 364.2e12, "fp16": 364.2e12, "fp32": 91.1e12}),
    # RTX A6000 datasheet: 309.7 TFLOPS tensor sparse, 38.7 TFLOPS FP32.
    (r"\bA6000\b", "NVIDIA RTX A6000", {"bf16": 154.8e12, "fp16": 154.8e12, "fp32": 38.7e12}),
    # Ada whitepaper (appendix A): RTX 4090, BF16 tensor with FP32 accumulate 165.2 dense, FP32 82.6.
    (r"\bRTX 4090\b", "NVIDIA GeForce RTX 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "fp32": 82.6e12}),
    # Ampere GA102 whitepaper: RTX 3090, BF16 tensor with FP32 accumulate 71 dense, FP32 35.6.
    (r"\bRTX 3090\b", "NVIDIA GeForce RTX 3090", {"bf16": 71e12, "fp16": 71e12, "fp32": 35.6e12}),
    # V100 datasheet: no BF16; Tensor Performance (FP16 with FP32 accumulate, no sparsity) 125 TFLOPS,
    # FP32 15.7 (SXM2; the PCIe card's 112 and 14 are lower, so its MFU reads low, never above 1).
    (r"\bV100\b", "NVIDIA V100", {"fp16": 125e12, "fp32": 15.7e12}),
    # T4 datasheet: no BF16; Mixed Precision (FP16/FP32) 65 TFLOPS, FP32 8.1 TFLOPS.
    (r"\bT4\b", "NVIDIA T4", {"fp16": 65e12, "fp32": 8.1e12}),
]


def gpu_peak_with_source(device_name: str, dtype_name: str) -> tuple[float, str]:
    """The table's dense peak for a GPU named like ``torch.cuda.get_device_name()`` says."""
    for pattern, label, peaks in GPU_PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if dtype_name not in peaks:
                raise ConfigError(
                    f"[metrics] peak_flops: {label} has no {dtype_name} peak in Forge's table; {SET_PEAK}."
                )
            return peaks[dtype_name], f"GPU table: {label} {dtype_name}"
    raise ConfigError(f"[metrics] peak_flops: GPU '{device_name}' is not in Forge's table of peaks; {SET_PEAK}.")


def gpu_peak_flops(device_name: str, dtype_name: str) -> float:
    """The table's dense peak for a GPU named like ``torch.cuda.get_device_name()`` says."""
    return gpu_peak_with_source(device_name, dtype_name)[0]
