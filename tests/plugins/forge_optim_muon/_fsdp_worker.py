"""One rank of the FSDP2 test: ``RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python _fsdp_worker.py OUT``.

Shards the tiny model with ``fully_shard`` (gloo, CPU), trains it on this rank's half of each
batch with ``muon``, and writes (rank 0) the whole parameters and (every rank) how many
matrices it orthogonalised, so the test can compare with a single-process run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _models import batches, muon_options, tiny_mixture_lm, train  # the script's folder is on sys.path
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from forge_lm.distributed.launch import exit_process

STEPS = 3
OPTIONS = {"lr": 0.05, "adamw_lr": 0.01, "weight_decay": 0.1, "ns_dtype": "float32"}


def main(out: Path) -> None:
    import forge_optim_muon.optimizer as muon_module
    from forge_optim_muon.factory import build_muon

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = tiny_mixture_lm()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    orthogonalised = []  # matrices per Newton-Schulz call on this rank
    newton_schulz = muon_module.newton_schulz

    def counting(batch, *args, **kwargs):
        orthogonalised.append(batch.shape[0])
        return newton_schulz(batch, *args, **kwargs)

    muon_module.newton_schulz = counting
    optimizer = build_muon(muon_options(**OPTIONS), model)
    share = [(ids.chunk(world)[rank], targets.chunk(world)[rank]) for ids, targets in batches(STEPS)]
    train(model, optimizer, share)

    params = {name: param.full_tensor() for name, param in model.named_parameters()}
    buffers = {type(s["momentum_buffer"]).__name__ for s in optimizer.state.values() if "momentum_buffer" in s}
    if rank == 0:
        torch.save(params, out / "params.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({"orthogonalised": orthogonalised, "buffers": sorted(buffers)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_process(0)  # past gloo's destructors, which can abort at exit
