"""Run under torchrun: the training loop's own build (``build_parts``: meta device, transforms, then
each rank materializing its shards) on 2 ranks, against the one-process model of the same seed.

Usage:
    meta_init_worker.py equal OUT_JSON CASE [CASE ...]
        Each case (``fsdp2``, ``tp``, ``pp``, ``ep``) builds its layout; every parameter and
        buffer this rank holds, gathered whole, must equal the one-process model's bit for bit
        (random values drawn in chunks of 500, so that chunk borders fall inside shards).
        Rank 0 writes {case: {"mismatched": [...], "compared": n, "local_fraction": f, ...}}.
    meta_init_worker.py memory OUT_JSON [--section.key=value ...]
        One ``build_parts`` of a ~170 MB model (one process under ``torchrun --nproc_per_node=1``, or
        FSDP2 over the ranks); every rank reports how much its peak resident memory grew during
        the build (``ru_maxrss`` after minus before) and its parameters' local bytes.
"""

from __future__ import annotations

import gc
import json
import resource
import sys

import torch
import torch.distributed as dist

# Imported before the baseline is taken: the sharded build imports them, the one-process build
# does not, and their code would count as model memory.
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.distributed.pipelining
import torch.distributed.tensor
import torch.distributed.tensor.parallel
from torch.distributed.tensor import DTensor

from forge_lm.config import load_config
from forge_lm.distributed.launch import exit_process
from forge_lm.model import build_model, init
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.parts import build_parts

VOCAB = 257
COMMON = [
    "--model.max_seq_len=32",
    "--train.seq_len=16",
    "--train.seed=1234",
    "--eval.interval=0",
    "--data.name=synthetic",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",  # no matmul timing while building
    "--resilience.health_check=false",
]
TINY = ["--model.dim=64", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.init_std=0.1"]
CASES = {
    # tied embeddings (the default) under FSDP2 and TP: one tensor, sharded, in two places
    "fsdp2": ["--distributed.dp_shard=2"],
    "tp": ["--distributed.tp=2", "--distributed.dp_shard=1"],
    "pp": [
        "--distributed.pp=2",
        "--distributed.dp_shard=1",
        "--model.tie_embeddings=false",
        "--train.grad_accum_steps=2",
    ],
    "ep": [  # experts split over ep = 2 (then FSDP2 over a 1-rank efsdp), a router with buffers, a shared expert
        "--distributed.ep=2",
        "--model.ffn.name=moe",
        "--model.ffn.n_experts=4",
        "--model.ffn.top_k=2",
        "--model.ffn.n_shared_experts=1",
        "--model.ffn.router.name=sigmoid_topk",
    ],
}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local_bytes(model: torch.nn.Module) -> int:
    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total


def compare(case: str) -> dict:
    # Tiny tensors fit in one chunk of random values; smaller chunks make every tensor span
    # several, whose borders fall inside shards, as a large model's do.
    init.CHUNK_ELEMENTS = 500
    manager = PluginManager(PluginSettings(autoload=case == "ep", allow=("moe",)))
    config = load_config(None, [*COMMON, *TINY, *CASES[case]], manager.registry)
    manager.configure(config)
    parts = build_parts(config, manager)  # joins the process group on the first call
    model = parts.model
    # The one-process model of the seed: what `forge train` builds without torchrun.
    reference = build_model(config.model, VOCAB, manager.registry, seed=config.train.seed)
    expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    mismatched, compared, placements = [], 0, set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(tensor, DTensor):
            placements.add(f"{type(tensor.placements[-1]).__name__}")
        whole = _full(tensor.detach())
        compared += 1
        if whole.shape != expected[name].shape or not torch.equal(whole, expected[name].detach()):
            mismatched.append(name)
    reference_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    return {
        "mismatched": mismatched,
        "compared": compared,
        "reference_tensors": len(expected),
        "local_fraction": _local_bytes(model) / reference_bytes,
        "placements": sorted(placements),
        "tied": bool(getattr(model, "tied", False)),
        "stage_blocks": sorted(int(i) for i in model.layers) if case == "pp" else None,
    }


def equal(out: str, cases: list[str]) -> None:
    results = {case: compare(case) for case in cases}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(gathered, handle)


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def _resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def memory(out: str, overrides: list[str]) -> None:
    """Peak growth of one build: ``ru_maxrss`` (the high-water mark of resident memory) after
    the build minus the resident memory just before it. A first build of a tiny model of the
    same layout goes before, so what any build pays once (the process group, the mesh, lazy
    imports, allocator pools) is not counted as the model's."""
    manager = PluginManager(PluginSettings(autoload=False))
    warm_up = load_config(None, [*COMMON, *overrides, "--model.dim=64", "--model.n_layers=1"], manager.registry)
    parts = build_parts(warm_up, manager)
    del parts
    gc.collect()
    config = load_config(None, [*COMMON, *overrides], manager.registry)
    before = _resident_bytes()
    parts = build_parts(config, manager)
    grown = _peak_bytes() - before
    report = {"peak_growth": grown, "local_bytes": _local_bytes(parts.model)}
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, report)
    else:
        gathered = [report]
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(gathered, handle)


def main() -> int:
    mode, out, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "equal":
        equal(out, rest)
    else:
        memory(out, rest)
    if dist.is_initialized():
        dist.barrier()  # no rank tears its groups down while another still uses them
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())  # past gloo's destructors, which can abort at exit
