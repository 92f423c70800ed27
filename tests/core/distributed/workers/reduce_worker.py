"""Gradient reduction choices on 2 or 4 gloo ranks: short runs of the debug config, one launch.

Usage: ``torchrun --standalone --nproc_per_node=N reduce_worker.py WORK_DIR OUT_JSON``

With N = 2 the ranks are 2 replicas (``dp_replicate = 2, dp_shard = 1``); with N = 4, HSDP
(``dp_replicate = 2, dp_shard = 2``: the compressed shards are FSDP2's reduce-scatter output).
The worker joins the process group itself, so that ``train()`` leaves it up and one launch runs
every variant: fp32 reduction, bf16 reduction, PowerSGD, and PowerSGD stopped at step 4 and
resumed from its checkpoint. Rank 0 writes OUT_JSON: each variant's losses by step and,
per rank, what its compressor did and a checksum of its weights (replicas must agree), and the
names of the compression tensors each rank asked the checkpoint reader for when it resumed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from forge_lm import hookimpl
from forge_lm.checkpoint import _load
from forge_lm.config import load_config
from forge_lm.distributed.compression import compressor_of
from forge_lm.distributed.launch import exit_process
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing.distributed import metrics_by_step
from forge_lm.train.loop import train

STEPS = 8
BASE = [
    f"--train.max_steps={STEPS}",
    "--train.batch_size=2",
    "--eval.interval=0",
    "--checkpoint.interval=0",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--resilience.health_check=false",
]
POWERSGD = [
    "--distributed.compression.method=powersgd",
    "--distributed.compression.rank=2",
    "--distributed.compression.warmup_steps=2",
]


class _Watch:
    """Records, at the end of each run, what the compressor holds and the weights' checksum."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self) -> None:
        self.seen: dict = {}

    @hookimpl
    def forge_lm_train_end(self, context, status):
        compressor = compressor_of(context.model)
        local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in context.model.parameters()]
        self.seen = {
            "checksum": sum(float(t.double().sum()) for t in local),
            "reductions": dict(compressor.reductions) if compressor else None,
            "errors": len(compressor.errors) if compressor else 0,
            "error_norm": sum(float(e.norm()) for e in compressor.errors.values()) if compressor else 0.0,
            "error_names": sorted(compressor.errors) if compressor else [],
            "factor_names": sorted(compressor.factors) if compressor else [],
        }


class _ReaderRequests:
    """Stands in for the loader's ``dcp`` module: records the compression tensors each load asks
    the reader for, then loads them."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def load(self, state_dict, **kwargs):
        self.asked += sorted(key for key in state_dict if ".grad_compression." in key)
        return dcp.load(state_dict, **kwargs)


def run(work: Path, name: str, layout: list[str], extra: list[str], watch: _Watch, manager: PluginManager) -> dict:
    config = load_config(
        "configs/debug.toml", [*BASE, *layout, *extra, f"--train.output_dir={work / name}"], manager.registry
    )
    train(config, manager)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, watch.seen)
    losses = (
        {step: m["loss"] for step, m in metrics_by_step(work / name).items() if "loss" in m}
        if dist.get_rank() == 0
        else {}
    )
    return {"losses": losses, "ranks": gathered}


def main() -> int:
    torch.set_num_threads(1)
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")  # ours: train() leaves it up between the runs
    world = dist.get_world_size()
    layout = ["--distributed.dp_replicate=2", f"--distributed.dp_shard={world // 2}"]
    watch = _Watch()
    manager = PluginManager(PluginSettings(autoload=False))
    manager.add_plugin(watch, "reduce-watch")
    results = {
        "fp32": run(work, "fp32", layout, [], watch, manager),
        "bf16": run(work, "bf16", layout, ["--distributed.reduce_dtype=bf16"], watch, manager),
        "powersgd": run(work, "powersgd", layout, POWERSGD, watch, manager),
    }
    # The same PowerSGD run, stopped after step 4 (its last step: a checkpoint), then resumed.
    results["first_half"] = run(work, "resumed", layout, [*POWERSGD, "--train.max_steps=4"], watch, manager)
    requests = _ReaderRequests()
    _load.dcp = requests
    results["resumed"] = run(work, "resumed", layout, POWERSGD, watch, manager)
    _load.dcp = dcp
    asked: list = [None] * dist.get_world_size()
    dist.all_gather_object(asked, requests.asked)
    results["asked_on_resume"] = asked
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
