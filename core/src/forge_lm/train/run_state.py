"""A run's state in a checkpoint, beyond the model and optimizer: saving it and restoring it.

What is restored comes from a file anyone could have edited. The scheduler's and data
loader's saved states must have the shape of the live objects' own (:func:`check_like`),
checked inside the checkpoint manager's attempt, so that a tampered one is passed over like a
damaged checkpoint and an older one used, instead of planting a string where a number belongs.
The optimizer's settings come from this run's config (the manager takes them from the live
optimizer); a saved setting that differs from the live one, while the optimizer settings the
checkpoint records are this run's, was edited: that checkpoint is passed over too.
Plugin states go to their plugins' ``load_state`` hooks, whose failure is the plugin's (exit 4).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from forge_lm import events
from forge_lm.checkpoint import CheckpointManager
from forge_lm.checkpoint._safe import DamagedCheckpointError
from forge_lm.checkpoint._state import TRAINER_STATE, check_like
from forge_lm.config import to_data
from forge_lm.data.loader import BatchLoader
from forge_lm.plugins import PluginManager


def save_run(checkpoints: CheckpointManager, context: Any, train_batches: BatchLoader, manager: PluginManager) -> None:
    """Checkpoint the run at ``context.step``: the training point, for an exact resume."""
    state = {
        "config": to_data(context.config),  # what produced it, even if the run directory is lost
        "manifest": manager.manifest(),
        "tokens_seen": context.tokens_seen,
        "tokens_per_step": context.tokens_per_step,
        "scheduler": context.scheduler.state_dict(),
        "data": train_batches.state_dict(),
        "plugins": manager.save_states(context),
    }
    checkpoints.save(context.step, context.model, context.optimizer, state)


def restore_run(
    checkpoints: CheckpointManager, context: Any, train_batches: BatchLoader, manager: PluginManager
) -> bool:
    """Load the newest usable checkpoint into the run; False when there is none."""

    def restore(state: dict[str, Any]) -> None:
        missing = {"tokens_seen", "plugins"} - set(state)
        if missing:
            raise ValueError(f"its trainer state lacks {', '.join(sorted(missing))}")
        _check_optimizer_settings(state, context.config)
        if "scheduler" in state:  # absent in an imported model's step 0: schedule and data start fresh
            check_like(state["scheduler"], context.scheduler.state_dict(), "the scheduler state", equal_lengths=True)
            check_like(state.get("data"), train_batches.state_dict(), "the data position")
            context.scheduler.load_state_dict(state["scheduler"])
            train_batches.load_state_dict(state["data"])

    state = checkpoints.load(context.model, context.optimizer, restore)
    if state is None:
        _warn(f"'{context.run_dir}' has no checkpoint yet; starting from step 0")
        return False
    for skipped in state["passed_over"]:
        _warn(f"passed over checkpoint {skipped}")
        name, _, reason = skipped.partition(": ")
        events.record("checkpoint_skipped", checkpoint=name, reason=reason)
    context.step, context.tokens_seen = state["step"], state["tokens_seen"]
    saved_batch = state.get("tokens_per_step", context.tokens_per_step)
    if saved_batch != context.tokens_per_step:  # e.g. resumed on another number of ranks
        _warn(
            f"the global batch changed from {saved_batch} to {context.tokens_per_step} tokens per step "
            "(batch_size x grad_accum_steps x seq_len x data-parallel ranks); the run goes on with the new one"
        )
    unclaimed = manager.load_states(context, state["plugins"])
    for name in unclaimed:
        _warn(f"checkpoint state of plugin '{name}' was not restored: that plugin is not loaded")
    print(f"resumed from {state['path']} (step {context.step})", file=sys.stderr, flush=True)
    events.set_step(context.step)
    events.record("resume", from_step=context.step, checkpoint=Path(state["path"]).name)
    return True


def _check_optimizer_settings(state: dict[str, Any], config: Any) -> None:
    """A setting of the saved optimizer that differs from the live one's is fine when the run's
    optimizer settings changed since the checkpoint (the config wins); when they are the ones the
    checkpoint records, the saved value was edited."""
    replaced = state.get("settings_from_config") or []
    recorded = state.get("config")
    if not replaced or not isinstance(recorded, dict):
        return
    live = json.loads(json.dumps(to_data(config).get("optimizer")))
    if recorded.get("optimizer") == live:
        raise DamagedCheckpointError(
            f"{TRAINER_STATE}: {replaced[0]} differs from what the run's optimizer settings (which the checkpoint "
            "records, unchanged) give it; the file was edited"
        )


def _warn(message: str) -> None:
    print(f"forge: warning: {message}", file=sys.stderr, flush=True)
