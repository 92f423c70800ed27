"""Run under torchrun: the training loop's own build of configs/vlm_debug.toml (``build_parts``: the
llava on the meta device, FSDP2 over the ranks, then each rank materializing its shards)
against the one-process model of the same seed, built directly.

Usage: meta_init_llava.py OUT_JSON [--section.key=value ...]
Rank 0 writes one entry per rank: {"mismatched": [...], "compared": n, "reference_tensors": n,
"sharded": n (DTensors), "parameters": n, "local_fraction": f}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forge_lm.config import load_config, model_options
from forge_lm.distributed.launch import exit_process
from forge_lm.model import build_model, init
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.parts import build_parts

DEBUG = Path(__file__).resolve().parents[4] / "configs" / "vlm_debug.toml"
QUIET = ["--eval.interval=0", '--metrics.backends=["jsonl"]', "--metrics.peak_flops=1e12"]
QUIET += ["--resilience.health_check=false"]


def compare(overrides: list[str]) -> dict:
    init.CHUNK_ELEMENTS = 500  # chunk borders of the random values fall inside shards
    manager = PluginManager(PluginSettings(allow=("vlm",)))
    config = load_config(DEBUG, [*QUIET, *overrides], manager.registry)
    manager.configure(config)
    model = build_parts(config, manager).model  # joins the process group
    reference = build_model(config.model, model_options(config).vocab_size, manager.registry, seed=config.train.seed)
    expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    mismatched, compared, sharded, local = [], 0, 0, 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        tensor = tensor.detach()
        if isinstance(tensor, DTensor):
            sharded += 1
            part, tensor = tensor.to_local(), tensor.full_tensor()
        else:
            part = tensor
        local += part.numel()
        compared += 1
        if tensor.shape != expected[name].shape or not torch.equal(tensor, expected[name].detach()):
            mismatched.append(name)
    return {
        "mismatched": mismatched,
        "compared": compared,
        "reference_tensors": len(expected),
        "sharded": sharded,
        "parameters": len(list(model.parameters())),
        "local_fraction": local / sum(t.numel() for t in expected.values()),
    }


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    result = compare(overrides)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()
    exit_process(0)  # past gloo's destructors, which can abort at exit


if __name__ == "__main__":
    main()
