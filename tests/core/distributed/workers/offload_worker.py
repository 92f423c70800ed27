"""``[distributed] cpu_offload`` on 2 gloo ranks (FSDP2, dp_shard = 2), the CPU standing in for the GPU.

Usage: ``torchrun --standalone --nproc_per_node=2 offload_worker.py WORK_DIR OUT_JSON``

On a CPU device Forge refuses offloading (there is nothing to offload to); this worker lifts the
refusal (``check_offload`` replaced where the run's build imports it) so that the CPUOffloadPolicy
path runs for real: FSDP2 keeps the shards on the host (here the same memory, unpinned), runs the
optimizer on them, and Forge saves and resumes them. Runs, in one launch (the worker joins the
process group itself, so train() leaves it up between them):

- ``offloaded``: 3 steps with cpu_offload; at its end every rank records its shards' devices and
  whether FSDP2 holds them as offloaded;
- ``plain``: the same 3 steps without it (the losses must be equal: offloading moves, never changes);
- ``first_half``/``resumed``: the offloaded run stopped at step 2 (a checkpoint), then resumed to 3.

Rank 0 writes OUT_JSON: each run's losses by step, and per rank what it recorded.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.distributed.launch import exit_process
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.testing.distributed import metrics_by_step
from forge_lm.train import train

BASE = [
    *TINY_MODEL,
    "--distributed.dp_shard=2",
    "--train.max_steps=3",
    "--train.batch_size=2",
    "--train.seq_len=16",
    "--data.name=synthetic",
    "--eval.interval=0",
    "--checkpoint.interval=2",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--resilience.health_check=false",
    "--train.cpu_linear_kernel=aten",
    "--scheduler.name=constant",  # a schedule that does not depend on max_steps: the resume lengthens the run
    "--scheduler.warmup_steps=2",  # not chosen by timing: every run computes with the same kernel
]


class _Watch:
    """What a run holds at its end (also watched by test_offload_one_process.py, in one process):
    its FSDP2 units, where their shards and the optimizer state are, the group it runs in."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self) -> None:
        self.seen: dict = {}

    @hookimpl
    def forge_lm_train_end(self, context, status):
        states = [m._get_fsdp_state() for m in context.model.modules() if hasattr(m, "_get_fsdp_state")]
        params = [p for s in states if s._fsdp_param_group for p in s._fsdp_param_group.fsdp_params]
        optimizer_devices = {
            str(t.device) for state in context.optimizer.state.values() for t in state.values() if torch.is_tensor(t)
        }
        self.seen = {
            "units": len(states),
            "mesh_sizes": sorted({p.mesh_info.mesh.size() for p in params}),
            "group_size": dist.get_world_size() if dist.is_initialized() else None,
            "offloaded": sorted({p.offload_to_cpu for p in params}),
            "shard_devices": sorted({str(p.sharded_param.to_local().device) for p in params}),
            "optimizer_devices": sorted(optimizer_devices),
            "status": status,
        }


def _lift_the_cpu_refusal() -> None:
    for name in ("loop", "parts"):  # wherever the run's build imports it from
        try:
            module = importlib.import_module(f"forge_lm.train.{name}")
        except ImportError:
            continue
        if hasattr(module, "check_offload"):
            module.check_offload = lambda *args: None


def run(work: Path, name: str, extra: list[str], watch: _Watch, manager: PluginManager) -> dict:
    config = load_config(None, [*BASE, *extra, f"--train.output_dir={work / name}"], manager.registry)
    train(config, manager)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, watch.seen)
    losses = {}
    if dist.get_rank() == 0:
        losses = {step: m["loss"] for step, m in metrics_by_step(work / name).items() if "loss" in m}
    return {"losses": losses, "ranks": gathered}


def main() -> int:
    torch.set_num_threads(1)
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    _lift_the_cpu_refusal()
    dist.init_process_group("gloo")  # ours: train() leaves it up between the runs
    watch = _Watch()
    manager = PluginManager(PluginSettings(autoload=False))
    manager.add_plugin(watch, "offload-watch")
    offload = ["--distributed.cpu_offload=true"]
    results = {
        "offloaded": run(work, "offloaded", offload, watch, manager),
        "plain": run(work, "plain", [], watch, manager),
        "first_half": run(work, "resumed", [*offload, "--train.max_steps=2"], watch, manager),
        "resumed": run(work, "resumed", offload, watch, manager),
    }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())
