"""Checkpoints of a run: written with torch.distributed.checkpoint (sharded, reshardable).

Layout under the run directory::

    checkpoints/step_<N>/       DCP files: the model and optimizer state
    checkpoints/step_<N>/trainer_state.json   step, scheduler, data position, plugin states
    checkpoints/latest          the name of the newest complete checkpoint, switched atomically

Only plain data goes into ``trainer_state.json``; tensors go through DCP.
"""

from forge_lm.checkpoint._io import latest_checkpoint, load_for_inference, save_checkpoint

__all__ = ["latest_checkpoint", "load_for_inference", "save_checkpoint"]
