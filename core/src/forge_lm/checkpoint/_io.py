"""Save a training checkpoint; find the newest one; load a model from one for inference."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from forge_lm.errors import ForgeError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
) -> Path:
    """Write ``checkpoints/step_<step>`` and then point ``latest`` at it."""
    path = Path(run_dir) / CHECKPOINTS / f"step_{step}"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    with _single_process_quietly():
        dcp.save(state, checkpoint_id=str(path), no_dist=not _distributed())
    (path / TRAINER_STATE).write_text(json.dumps({"step": step, **trainer_state}, indent=2) + "\n")
    pointer = path.parent / LATEST
    scratch = pointer.with_suffix(".tmp")
    scratch.write_text(path.name + "\n")
    os.replace(scratch, pointer)  # atomic: readers see the old or the new name, never half of one
    return path


def _distributed() -> bool:
    """Whether a process group is running (then every rank writes its shards)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns on every call that it assumes one process when none is initialised; that is
    the intent here, and the warning would repeat at every checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.exists():
        return None
    return pointer.parent / pointer.read_text().strip()


def load_for_inference(path: str | Path, manager: Any) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, config, tokenizer)`` from a run directory (its latest checkpoint) or a checkpoint.

    The model is rebuilt from the run's resolved ``config.toml`` with the components the
    installed plugins provide, then its weights are loaded; it is returned in eval mode on CPU.
    """
    from forge_lm.config import load_config
    from forge_lm.model import build_model
    from forge_lm.train.run_dir import CONFIG_FILE

    path = Path(path)
    checkpoint = path if (path / TRAINER_STATE).exists() else latest_checkpoint(path)
    if checkpoint is None or not (checkpoint / TRAINER_STATE).exists():
        raise ForgeError(
            f"'{path}' is neither a checkpoint nor a run directory with one; give a run directory "
            f"whose {CHECKPOINTS}/{LATEST} exists, or a {CHECKPOINTS}/step_<N> directory."
        )
    run_dir = checkpoint.parent.parent
    config = load_config(run_dir / CONFIG_FILE, [], manager.registry)
    tokenizer = manager.registry.resolve("tokenizers", config.tokenizer.name).build(config.tokenizer.options)
    model = build_model(config.model, config.model.vocab_size or tokenizer.vocab_size, manager.registry)
    state = {"model": model.state_dict()}
    with _single_process_quietly():
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=not _distributed())
    model.load_state_dict(state["model"])
    return model.eval(), config, tokenizer
