"""Checkpoints of a run, written with torch.distributed.checkpoint (sharded, reshardable).

Layout under the run directory::

    checkpoints/step_<N>/                  DCP tensor files: model, optimizer, plugin tensors
    checkpoints/step_<N>/trainer_state.json  everything else, as plain data: step, scheduler,
                                           data position, RNG states, plugin states; written last
    checkpoints/latest                     names the newest complete checkpoint; switched atomically

Nothing is pickled: loading reads tensors and JSON only, and refuses a checkpoint whose
metadata or items would need arbitrary unpickling.
"""

from forge_lm.checkpoint._io import CheckpointManager, latest_checkpoint, load_for_inference
from forge_lm.checkpoint._safe import UnsafeCheckpointError

__all__ = ["CheckpointManager", "UnsafeCheckpointError", "latest_checkpoint", "load_for_inference"]
