"""Run under torchrun (2 ranks, gloo): async checkpoints of an FSDP2-sharded model.

Usage: async_save_worker.py OUT_DIR [--section.key=value ...] (a run config with dp_shard = 2)
Trains a step, saves step 1 in the background, trains another, saves step 2, records what the
ranks received from the skeleton gather and whether step 2 reused step 1's host buffers; then
trains on, loads step 2 back and compares every full tensor with what was saved. Each rank
writes OUT_DIR/rank<N>.json; rank 0 also OUT_DIR/expected.pt (step 2's model, whole tensors).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

import forge_lm.checkpoint._write as checkpoint_io
from forge_lm.checkpoint import CheckpointManager
from forge_lm.config import load_config
from forge_lm.distributed.launch import exit_process
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.parts import build_parts
from forge_lm.train.step import compute_gradients


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, whole (a collective under FSDP2)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    tensors = {f"model.{k}": full(v).detach().clone() for k, v in model_state.items()}
    for name, state in optimizer_state["state"].items():
        tensors.update({f"optimizer.{name}.{k}": full(v).detach().clone() for k, v in state.items()})
    return tensors


def main() -> int:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    manager = PluginManager(PluginSettings(autoload=False))
    config = load_config(None, [*overrides, f"--train.output_dir={out / 'run'}"], manager.registry)
    parts = build_parts(config, manager)  # joins the process group
    rank = dist.get_rank()
    batches = iter(parts.train_batches)

    def train_step() -> None:
        compute_gradients(parts, batches, config)
        parts.optimizer.step()

    received: list = []  # per save: the skeletons this rank got from the gather, or None
    all_gathers: list = []

    class CountingDist:
        """torch.distributed as the checkpoint module sees it, its object gathers recorded
        (DCP's own gathers, which go through torch.distributed directly, are not counted)."""

        def __getattr__(self, name):
            return getattr(dist, name)

        def gather_object(self, obj, object_gather_list=None, dst=None, group=None):
            dist.gather_object(obj, object_gather_list, dst=dst, group=group)
            received.append(None if object_gather_list is None else [sorted(s) for s in object_gather_list])

        def all_gather_object(self, object_list, obj, group=None):
            all_gathers.append(1)
            dist.all_gather_object(object_list, obj, group=group)

    checkpoints = CheckpointManager(out / "run", async_save=True)
    train_step()
    checkpoint_io.dist = CountingDist()
    checkpoints.save(1, parts.model, parts.optimizer, {"tokens_seen": 1})
    first_buffers = checkpoints._staging.storage()
    train_step()
    checkpoints.save(2, parts.model, parts.optimizer, {"tokens_seen": 2})
    checkpoints.wait()
    checkpoint_io.dist = dist
    reused = checkpoints._staging.storage() == first_buffers
    expected = whole_state(parts.model, parts.optimizer)  # step 2's state, as saved
    weight = next(p for p in parts.model.parameters() if p.ndim == 2)
    sharded = isinstance(weight, DTensor) and weight.to_local().numel() < weight.numel()

    train_step()  # move on, then go back to step 2
    moved = whole_state(parts.model, parts.optimizer)
    state = checkpoints.load(parts.model, parts.optimizer, only=out / "run" / "checkpoints" / "step_2")
    restored = whole_state(parts.model, parts.optimizer)
    result = {
        "received": received,
        "all_gathers": len(all_gathers),
        "reused": reused,
        "buffers": len(first_buffers),
        "sharded": sharded,
        "moved": any(not torch.equal(moved[k], expected[k]) for k in expected),
        "restored_bitwise": restored.keys() == expected.keys()
        and all(torch.equal(restored[k], expected[k]) for k in expected),
        "tensors": len(expected),
        "step": state["step"],
        "tokens_seen": state["tokens_seen"],
    }
    if rank == 0:
        torch.save({k: v for k, v in expected.items() if k.startswith("model.")}, out / "expected.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    checkpoints.close()
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())  # past gloo's destructors, which can abort at exit
