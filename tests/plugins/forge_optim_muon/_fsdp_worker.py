"""One rank of the FSDP2 / HSDP tests: ``RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python
_fsdp_worker.py OUT LAYOUT``, with ``LAYOUT`` ``fsdp`` (a 1-D mesh of 2 shards) or ``hsdp`` (a 2-D
mesh: 2 replicas x 1 shard, the layout of ``dp_replicate = 2``).

Shards the tiny model with ``fully_shard`` (gloo, CPU) and trains it on this rank's half of each
batch with ``muon``, twice from the same weights: with the default gather budget and with one
small enough to cut every step into several groups. Writes (rank 0) both runs' whole parameters
and (every rank) how many matrices each Newton-Schulz call orthogonalised, the bytes of whole
matrices each gather produced, and each parameter's side and role, so the test can compare
with a single-process run.
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
SMALL_BUCKET_MB = 0.02  # 20,971 bytes: above the largest parameter (18,432), below a step's 81,920
MESHES = {"fsdp": ((2,), ("shard",)), "hsdp": ((2, 1), ("replicate", "shard"))}


def main(out: Path, layout: str) -> None:
    import forge_optim_muon.optimizer as muon_module
    from forge_optim_muon.factory import build_muon

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape, names = MESHES[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)

    orthogonalised = []  # matrices per Newton-Schulz call on this rank
    gathered = []  # bytes of the whole (gathered) matrices per gather call on this rank
    newton_schulz, gather = muon_module.newton_schulz, muon_module._gather_whole_matrices

    def counting_newton_schulz(batch, *args, **kwargs):
        orthogonalised.append(batch.shape[0])
        return newton_schulz(batch, *args, **kwargs)

    def counting_gather(entries):
        gather(entries)
        gathered.append(sum(e.full.numel() * e.full.element_size() for e in entries if e.mesh is not None))

    muon_module.newton_schulz = counting_newton_schulz
    muon_module._gather_whole_matrices = counting_gather
    share = [(ids.chunk(world)[rank], targets.chunk(world)[rank]) for ids, targets in batches(STEPS)]
    report: dict[str, object] = {}
    for run, bucket_mb in (("default", None), ("small_buckets", SMALL_BUCKET_MB)):
        model = tiny_mixture_lm()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        options = OPTIONS if bucket_mb is None else {**OPTIONS, "gather_bucket_mb": bucket_mb}
        optimizer = build_muon(muon_options(**options), model)
        orthogonalised.clear()
        gathered.clear()
        train(model, optimizer, share)
        params = {name: param.full_tensor() for name, param in model.named_parameters()}
        buffers = {type(s["momentum_buffer"]).__name__ for s in optimizer.state.values() if "momentum_buffer" in s}
        if rank == 0:
            torch.save(params, out / f"params_{run}.pt")
        report[run] = {
            "orthogonalised": list(orthogonalised),
            "gathered": list(gathered),
            "buffers": sorted(buffers),
            "roles": [[a.name, a.side, a.role, a.decay] for a in optimizer.assignments],
            "mesh_ndim": model.layers[0].mix.weight.device_mesh.ndim,
        }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    exit_process(0)  # past gloo's destructors, which can abort at exit
