"""A trained model back from its run directory, for ``forge generate`` and ``forge export-hf``.

The model is rebuilt from the run's resolved ``config.toml`` (which anyone could have edited:
it is loaded and validated like any config, and a model too large for this host's memory is
refused from its estimate before anything is allocated) with the components the installed
plugins provide, then its newest usable checkpoint, or the one named, is loaded the way a
resumed run loads it (:class:`forge_lm.checkpoint.CheckpointManager`). A run whose checkpoints
are on an object store (``[checkpoint] dir``) is named the same way: its directory, or
``<run>/checkpoints/step_<N>``, which then names step N in the bucket (there is no such local
directory).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from forge_lm.checkpoint import CHECKPOINTS, CheckpointManager, step_of
from forge_lm.checkpoint._state import TRAINER_STATE
from forge_lm.config import CheckpointSection, load_config, model_options, read_toml
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.model import build_model
from forge_lm.model.memory import loading_shortfall
from forge_lm.notices import warn
from forge_lm.train.run_dir import CONFIG_FILE


def load_for_inference(path: str | Path, manager: Any) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, config, tokenizer)`` from a run directory (its newest usable checkpoint) or a
    ``checkpoints/step_<N>`` directory of one; the model is in eval mode on CPU."""
    path = Path(path)
    named = step_of(path) is not None and path.parent.name == CHECKPOINTS
    # A step with its trainer state here, or one that is not here at all (kept on an object store).
    single = named and ((path / TRAINER_STATE).exists() or not os.path.lexists(path))
    run_dir = path.parent.parent if single else path
    if not (run_dir / CONFIG_FILE).is_file():
        raise ForgeError(
            f"'{path}' is neither a run directory nor a checkpoint in one; give a directory holding "
            f"{CONFIG_FILE} and {CHECKPOINTS}/, or a {CHECKPOINTS}/step_<N> directory."
        )
    config = load_config(run_dir / CONFIG_FILE, [], manager.registry)
    if single and config.checkpoint.dir is None and not os.path.lexists(path):
        raise ForgeError(f"'{path}' does not exist; give a run directory or one of its {CHECKPOINTS}/step_<N>.")
    tokenizer = config.tokenizer.build()
    vocab_size = model_options(config).vocab_size or tokenizer.vocab_size
    _check_fits(config, vocab_size, manager.registry, run_dir)
    model = build_model(config.model, vocab_size, manager.registry)
    optimizer = config.optimizer.build(model)
    checkpoints = CheckpointManager(run_dir, location=config.checkpoint.dir)
    state = checkpoints.load(model, optimizer, only=checkpoints.store.location(path.name) if single else None)
    if state is None:
        raise ForgeError(f"run directory '{run_dir}' has no checkpoint yet; train it first.")
    for skipped in state["passed_over"]:
        warn(f"passed over checkpoint {skipped}")
    return model.eval(), config, tokenizer


def locate_checkpoint(path: str | Path) -> tuple[Path, Path, int | None]:
    """``(checkpoint to load, run directory, step)`` for a run directory or one of its
    ``checkpoints/step_<N>`` directories, before anything is loaded. Of a run, the newest
    checkpoint that passes the checks that load no tensor (those of ``forge doctor``), after a
    warning for each newer one passed over; a newest one that names code to run is left to
    :func:`load_for_inference`, which refuses it. A path that is neither comes back as it is
    (step None), for the loader to say what is wrong with it."""
    path = Path(path)
    if step_of(path) is not None and path.parent.name == CHECKPOINTS:
        return path, path.parent.parent, step_of(path)
    if (path / CONFIG_FILE).is_file():
        for candidate, problem in CheckpointManager(path, location=_checkpoint_location(path)).survey():
            if problem is None:  # <run>/checkpoints/step_<N>, which load_for_inference finds wherever it is kept
                return path / CHECKPOINTS / candidate.name, path, step_of(candidate)
            if problem.startswith("UNSAFE"):
                break
            warn(f"passed over checkpoint {candidate.name}: {problem}")
    return path, path, None


def _check_fits(config: Any, vocab_size: int, registry: Any, run_dir: Path) -> None:
    """Refuse a model whose weights and optimizer state (loaded with it) exceed this host's
    available memory: its numbers come from a file, and building it would be the first
    allocation."""
    shortfall = loading_shortfall(config, vocab_size, registry)
    if shortfall is not None:
        raise ConfigError(
            f"the model of '{run_dir}' {shortfall}; its {CONFIG_FILE} may have been edited, or the run was "
            "trained on a larger machine."
        )


def _checkpoint_location(run_dir: Path) -> str | None:
    """The run's ``[checkpoint] dir`` as its ``config.toml`` gives it, checked as the config's own
    field is; None when it has none (or the file does not load: the loader then says why)."""
    try:
        table = read_toml(run_dir / CONFIG_FILE).get("checkpoint", {})
        value = table.get("dir") if isinstance(table, dict) else None
        return CheckpointSection(dir=value).dir if isinstance(value, str) else None
    except (ConfigError, ValueError):
        return None
