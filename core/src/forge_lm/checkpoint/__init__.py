"""Checkpoints of a run, written with torch.distributed.checkpoint (sharded, reshardable).

Layout under the run directory (or, with ``[checkpoint] dir`` an object-store URL such as
``s3://bucket/prefix``, ``checkpoints/`` is that prefix: :mod:`._object_store`; the run directory
keeps its lock, metrics, events, config and ``run_id``)::

    checkpoints/step_<N>/                  DCP tensor files: model, optimizer, plugin tensors
    checkpoints/step_<N>/trainer_state.json  everything else, as plain data: step, scheduler,
                                           data position, RNG states, plugin states; written last
    checkpoints/latest                     names the newest complete checkpoint; switched atomically
    run_id                                 the run's id, which each checkpoint records (beside checkpoints/)

Nothing is unpickled: loading reads tensors (through ``torch.load(weights_only=True)``) and
JSON, reads DCP's pickled metadata with an unpickler that can reach no callable
(:mod:`._safe`), checks every field of both, and refuses a checkpoint whose metadata names
code to run.

The parts: the names (:mod:`._layout`), finding checkpoints (:mod:`._find`), checking them
(:mod:`._validate`, :mod:`._state`, :mod:`._safe`, :mod:`._finite`), writing (:mod:`._write`),
loading (:mod:`._load`), where they are kept (:mod:`._store`), and the manager that joins them
(:mod:`._manager`).
"""

from forge_lm.checkpoint._errors import CheckpointPlaceError, CheckpointSaveError, NonFiniteWeights
from forge_lm.checkpoint._layout import CHECKPOINTS, RUN_ID_FILE, SAVE_IN_PROGRESS, read_run_id, step_of
from forge_lm.checkpoint._manager import CheckpointManager, latest_checkpoint
from forge_lm.checkpoint._safe import DamagedCheckpointError, UnsafeCheckpointError
from forge_lm.checkpoint._store import check_location, holds_checkpoints
from forge_lm.checkpoint._tree import PerRank

__all__ = [
    "CHECKPOINTS",
    "RUN_ID_FILE",
    "SAVE_IN_PROGRESS",
    "CheckpointManager",
    "CheckpointPlaceError",
    "CheckpointSaveError",
    "DamagedCheckpointError",
    "NonFiniteWeights",
    "PerRank",
    "UnsafeCheckpointError",
    "check_location",
    "holds_checkpoints",
    "latest_checkpoint",
    "read_run_id",
    "step_of",
]
