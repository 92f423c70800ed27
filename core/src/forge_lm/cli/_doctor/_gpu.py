"""Checks of the GPU, NCCL and the ``torch.distributed`` backends. CPU only is fine; a GPU that
torch cannot use, or one without what runs on GPUs need, is not. No row when torch is missing."""

from __future__ import annotations

from pathlib import Path

from forge_lm.cli._doctor._check import FAIL, OK, WARNING, Check, Context


def gpu(context: Context) -> list[Check]:
    torch = context.torch
    if torch is None:
        return []
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        found = f"{count} GPU(s): {', '.join(names)}; CUDA {torch.version.cuda}"
        if not torch.cuda.is_bf16_supported():
            return [
                Check(
                    "gpu",
                    WARNING,
                    f"{found}; bf16 is not supported, and runs on CUDA use it by default. "
                    "Fix: set train.precision = 'fp32' (--train.precision=fp32)",
                )
            ]
        return [Check("gpu", OK, found)]
    hint = _gpu_hint()
    if hint is None:
        return [Check("gpu", OK, "CPU only (no GPU found): training runs on the CPU")]
    why = (
        f"torch {torch.__version__} is a CPU build"
        if not torch.version.cuda
        else f"this CUDA {torch.version.cuda} build of torch sees no device (driver, or CUDA_VISIBLE_DEVICES)"
    )
    return [
        Check(
            "gpu",
            WARNING,
            f"a GPU seems present ({hint}) but torch cannot use it: {why}; runs will use the CPU. "
            "Fix: install the torch build for this machine's CUDA driver (see pytorch.org), or check nvidia-smi",
        )
    ]


def distributed(context: Context) -> list[Check]:
    torch = context.torch
    if torch is None:
        return []
    if not torch.distributed.is_available():
        return [
            Check(
                "distributed",
                FAIL,
                "this torch build has no torch.distributed, which checkpoints and multi-process runs need. "
                "Fix: install an official torch build (pip install torch)",
            )
        ]
    backends = []
    if torch.distributed.is_gloo_available():
        backends.append("gloo")
    cuda = torch.cuda.is_available()
    if cuda and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()
        backends.append(f"nccl {'.'.join(map(str, version)) if isinstance(version, tuple) else version}")
    found = f"backends: {', '.join(backends) or 'none'}"
    if cuda and not any(b.startswith("nccl") for b in backends):
        return [
            Check(
                "distributed",
                FAIL,
                f"{found}; runs on GPUs communicate through NCCL, which this torch build lacks. "
                "Fix: install an official CUDA build of torch (it bundles NCCL)",
            )
        ]
    if "gloo" not in backends:
        return [
            Check(
                "distributed",
                WARNING if cuda else FAIL,
                f"{found}; CPU runs communicate through gloo, which this torch build lacks. "
                "Fix: install an official torch build (pip install torch)",
            )
        ]
    return [Check("distributed", OK, found + ("" if cuda else " (nccl is needed only with CUDA)"))]


CHECKS = (gpu, distributed)


def _gpu_hint() -> str | None:
    """A sign that this machine has an NVIDIA GPU (whether or not torch can use it), or None."""
    import shutil

    if Path("/dev/nvidiactl").exists():
        return "/dev/nvidiactl exists"
    if shutil.which("nvidia-smi"):
        return "nvidia-smi is installed"
    return None
