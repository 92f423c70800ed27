"""Where and in which precision a run computes. Never hard-coded: always from the config."""

from __future__ import annotations

import os
import random

import torch

from forge_lm.errors import ConfigError

# CUDA's caching allocator fragments under the varying shapes of training (MoE token counts,
# FSDP's gathers); expandable segments let it grow blocks in place instead. Read once, when CUDA
# first allocates: it must be set before, and a user's own setting is kept.
ALLOCATOR_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
ALLOCATOR_DEFAULT = "expandable_segments:True"


# A NCCL collective that fails or times out must end the process, not leave it waiting on a
# broken communicator until the job's time limit: then the job script sees the exit and can
# requeue. 3 ("skip clean-up") tears the process down without NCCL's own clean-up, which can
# itself hang on a dead peer. Torch's default today, set explicitly so that the choice does not
# change under Forge with a torch release; a user's own setting is kept.
NCCL_ERRORS_VARIABLE = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERRORS_DEFAULT = "3"


def use_expandable_segments() -> None:
    """Forge's CUDA settings, unless the environment has its own: the allocator's expandable
    segments and NCCL's asynchronous error handling."""
    os.environ.setdefault(ALLOCATOR_VARIABLE, ALLOCATOR_DEFAULT)
    os.environ.setdefault(NCCL_ERRORS_VARIABLE, NCCL_ERRORS_DEFAULT)


def resolve_device(setting: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; an explicit device must exist."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(setting)
    except RuntimeError:
        raise ConfigError(
            f"[train] device: '{setting}' is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'."
        ) from None
    if device.type == "cuda":
        use_expandable_segments()
        if not torch.cuda.is_available():
            raise ConfigError(f"[train] device: '{setting}' asked for, but CUDA is not available; use 'cpu' or 'auto'.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"[train] device: '{setting}' does not exist; this machine has {torch.cuda.device_count()} GPU(s)."
            )
    elif device.type != "cpu":
        raise ConfigError(f"[train] device: '{setting}' is not supported; use 'auto', 'cpu', 'cuda' or 'cuda:N'.")
    return device


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32. Weights always stay fp32 (master weights)."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return AUTOCAST_DTYPES.get(precision)


# fp16 needs a loss scaler beside autocast: forge_lm.train.loss_scale.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's generators (all devices): the run is reproducible from it."""
    random.seed(seed)
    torch.manual_seed(seed)


def batch_transfer(device: torch.device) -> dict[str, bool]:
    """How the training loader hands batches to ``device`` (:class:`~forge_lm.data.loader.BatchLoader`
    options). For a GPU: read the next batch in a background thread while the GPU computes, into
    pinned memory, so that the ``non_blocking`` copy to the GPU is asynchronous. On CPU the batch
    is used where it is read; a reader thread would only compete with the step for the cores."""
    on_gpu = device.type == "cuda"
    return {"read_ahead": on_gpu, "pin_memory": on_gpu}
