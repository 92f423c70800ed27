"""Run under torchrun (2 ranks, gloo): the finiteness test of a save, on an FSDP2-sharded model
whose NaN lies in rank 1's shard only.

Usage: finite_worker.py RUN_DIR OUT_DIR
Saves step 1 (finite); puts a NaN into rank 1's shard and tries step 2 (every rank must refuse
it); writes step 2 anyway with the test switched off (as a Forge before the test would have),
puts the weights right again and loads: step 2 must be passed over on both ranks and step 1
used. Each rank writes OUT_DIR/rank<N>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import forge_lm.checkpoint._write as checkpoint_io
from forge_lm.checkpoint import CheckpointManager, NonFiniteWeights


def main() -> None:
    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoints = CheckpointManager(run_dir)
    checkpoints.save(1, model, optimizer, {"note": "finite"})

    shard = model[0].weight.to_local()
    good = shard.detach().clone()
    if rank == 1:
        with torch.no_grad():
            shard[0, 0] = float("nan")
    refused = None
    try:
        checkpoints.save(2, model, optimizer, {"note": "nan"})
    except NonFiniteWeights as exc:
        refused = str(exc)
    written_after_refusal = (run_dir / "checkpoints" / "step_2").exists()

    real = checkpoint_io.count_nonfinite
    checkpoint_io.count_nonfinite = lambda state, device: torch.zeros((), dtype=torch.float64, device=device)
    checkpoints.save(2, model, optimizer, {"note": "nan"})
    checkpoint_io.count_nonfinite = real
    with torch.no_grad():
        shard.copy_(good)

    state = CheckpointManager(run_dir).load(model, optimizer)
    result = {
        "refused": refused,
        "written_after_refusal": written_after_refusal,
        "loaded_step": state["step"],
        "passed_over": state["passed_over"],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
