"""The random generators' states a checkpoint keeps, as plain data."""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """Every random generator the run uses, as plain data: Python's, the CPU's and this rank's
    own GPU's (only that one: a run may resume where another number of GPUs is visible)."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device()).tolist()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda_device" in state and torch.cuda.is_available():
        device = torch.cuda.current_device()
        torch.cuda.set_rng_state(torch.tensor(state["cuda_device"], dtype=torch.uint8), device)
