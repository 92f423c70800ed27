"""Whether a checkpoint may be read, or a step written: its place, its run, its weights.

A checkpoint belongs to its run: it records the run's id (``<run>/run_id``, written when the run
directory was made). Loading passes over one another run wrote (two runs sharing one folder or
bucket prefix, or a checkpoint copied in); saving never replaces or prunes one. A step is read
only if it is a plain directory of plain files where the run keeps its checkpoints
(:meth:`check_step` of the store), and only weights that are finite are ever kept.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from forge_lm.checkpoint._finite import count_nonfinite, device_of, first_nonfinite, sum_over_ranks
from forge_lm.checkpoint._layout import RUN_ID_FILE, STEP_DIR, read_run_id
from forge_lm.checkpoint._safe import DamagedCheckpointError
from forge_lm.checkpoint._state import MAX_STATE_BYTES, TRAINER_STATE
from forge_lm.errors import ForgeError


def check_place(store: Any, name: str) -> int:
    """The step of the step directory ``name``, if it is a plain directory of plain files where
    the store keeps checkpoints; raises :class:`DamagedCheckpointError` otherwise."""
    match = STEP_DIR.fullmatch(name)
    if match is None:
        raise DamagedCheckpointError("a link or not a directory; checkpoints are plain directories")
    store.check_step(name)
    return int(match.group(1))


def check_owner(saved: dict[str, Any], run_id: str | None, root: Any) -> None:
    """A checkpoint another run wrote is not this run's to resume (one recording no run id,
    written before run ids, is anyone's)."""
    owner = saved.get("run_id")
    if owner is not None and run_id is not None and owner != run_id:
        raise DamagedCheckpointError(
            f"written by another run (run id {owner}; this run's is {run_id}): two runs share "
            f"'{root}', or it was copied in. Move it out of this run"
        )


def owner_of(store: Any, name: str) -> str | None:
    """The run id a complete checkpoint ``name`` records, or None (none recorded, not a complete
    checkpoint, unreadable: nothing that stops replacing it)."""
    try:
        if not store.is_step_dir(name):
            return None
        files = store.files(name)
        if files.kind(TRAINER_STATE) != "file":
            return None
        owner = json.loads(files.read(TRAINER_STATE, MAX_STATE_BYTES)).get("run_id")
    except (*store.failures, ForgeError, ValueError, RecursionError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def place_problem(store: Any, run_dir: Any, run_id: str | None, name: str) -> str | None:
    """Why step ``name`` is not a place to write this run's checkpoint, or None (rank 0 asks)."""
    if run_id is not None and read_run_id(run_dir) != run_id:
        what = "gone" if not os.path.lexists(run_dir / RUN_ID_FILE) else "another run's"
        return (
            f"the run directory '{run_dir}' was removed or replaced while the run trained (its "
            f"{RUN_ID_FILE} is {what}); a checkpoint written there would belong to no run"
        )
    owner = owner_of(store, name)
    if owner is not None and owner != run_id:
        return (
            f"'{store.location(name)}' is another run's checkpoint (run id {owner}, this run's is {run_id}): two "
            f"runs share '{store.root}'. Give each run its own train.output_dir"
        )
    return None


def check_finite_loaded(model: torch.nn.Module) -> None:
    """A loaded checkpoint whose weights are not finite (written before saves checked them) is
    passed over on every rank alike, like a damaged one."""
    state = get_model_state_dict(model)
    (nonfinite,) = sum_over_ranks([count_nonfinite(state, device_of(model))])
    if nonfinite:
        culprit = first_nonfinite(state)
        where = f"'{culprit}' holds" if culprit is not None else "another rank's weights hold"
        raise DamagedCheckpointError(f"its weights are not finite: {where} NaN or Inf")
