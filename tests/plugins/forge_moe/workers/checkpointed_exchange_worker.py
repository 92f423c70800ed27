"""Run under ``torchrun`` with 2 ranks: which collectives backward runs under each activation
checkpointing mode, with expert parallelism (``ep = 2``; the model's other transforms but not
FSDP2, so the gradients are each rank's own).

For each mode (``none``, ``full``, ``selective``) every rank builds the same tiny MoE model from
one seed, applies the run's transforms, runs one forward on its own rows and counts, during
backward only, every functional collective that reaches the dispatcher (the expert exchanges'
``all_to_all_single``). Rank 0 writes ``{mode: {"collectives": {op: count}, "grads": {name:
[values]}}}`` to ``argv[1]`` (JSON); the test compares the modes.
"""

from __future__ import annotations

import collections
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims, TransformContext, detect_launch, init_distributed, ordered_transforms
from forge_lm.distributed.activation_checkpointing import checkpointed
from forge_lm.distributed.launch import exit_process
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL

VOCAB, BATCH, SEQ = 61, 4, 8
BASE = [
    *TINY_MODEL,
    f"--model.max_seq_len={SEQ}",
    f"--train.seq_len={SEQ}",
    "--model.ffn.name=moe",
    "--model.ffn.n_experts=4",
    "--model.ffn.top_k=2",
    "--model.ffn.capacity_factor=1.0",
    "--distributed.ep=2",
]


# The functional collectives that communicate (not wait_tensor or the autograd wrappers).
COMMUNICATING = {"all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"}


class FunctionalCollectives(TorchDispatchMode):
    """Counts the communicating functional collectives reaching the dispatcher while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._opname in COMMUNICATING:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def run(mode: str, manager: PluginManager, mesh, rank: int) -> dict:
    config = load_config(None, BASE, manager.registry)
    manager.configure(config)
    dims = ParallelDims.resolve(config, dist.get_world_size())
    torch.manual_seed(0)
    model = build_model(config.model, VOCAB, manager.registry).train()
    context = TransformContext(config, dims, mesh, torch.device("cpu"), None)
    for _, transform in ordered_transforms(manager.registry, config):
        # Without FSDP2: its hooks around the experts' own unit run profiler ops that differ
        # between forward and the replay, which selective checkpointing refuses in torch 2.13
        # (so the expert_parallel transform refuses 'selective': checkpointing is applied here).
        if transform.slot != "data_parallel" and transform.enabled(context):
            transform.apply(model, context)
    if mode != "none":
        for block in model.layers:
            block.forward = checkpointed(block.forward, mode)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    loss = F.cross_entropy(model(ids[rows]).flatten(0, 1), ids[rows].roll(-1, 1).flatten())
    with FunctionalCollectives() as backward:
        loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[name] = grad.flatten().tolist()
    return {"collectives": dict(backward.counts), "grads": grads}


def main() -> None:
    launch = detect_launch()
    init_distributed(launch, torch.device("cpu"))
    rank = dist.get_rank()
    manager = PluginManager(PluginSettings(allow=("moe",)))
    config = load_config(None, BASE, manager.registry)
    mesh = ParallelDims.resolve(config, launch.world_size).build_mesh("cpu")
    results = {mode: run(mode, manager, mesh, rank) for mode in ("none", "full", "selective")}
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)  # past gloo's destructors, which can abort at exit
