"""One start-train-teardown cycle of a tiny ``pp = 2`` run, under ``torchrun`` with 2 ranks (gloo, CPU).

Usage: ``torchrun --standalone --nproc_per_node=2 teardown_worker.py RUN_DIR [overrides...]``

Runs the training loop's own ``train()`` (pipeline schedules, a background checkpoint writer,
the hang watchdog, a metrics backend: what ``forge train`` starts), prints one line saying
whether the process group is gone and which of the run's threads are still alive, and exits
the way ``forge`` does (:func:`forge_lm.distributed.launch.exit_process`). The test
(tests/core/distributed/test_teardown.py) repeats the cycle and reads every launch's output.
"""

from __future__ import annotations

import sys
import threading

import torch.distributed as dist

from forge_lm.config import load_config
from forge_lm.distributed.launch import exit_process
from forge_lm.plugins import PluginManager
from forge_lm.testing import TINY_MODEL
from forge_lm.train.loop import train

RUN = (
    *TINY_MODEL,
    "--model.tie_embeddings=false",  # pipeline stages cannot share the embedding with the head
    "--distributed.pp=2",
    "--train.batch_size=2",
    "--train.seq_len=16",
    "--train.grad_accum_steps=2",
    "--train.max_steps=2",
    "--data.name=synthetic",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--checkpoint.interval=1",
    "--checkpoint.async_save=true",  # a background writer that must be joined before the group goes
    "--resilience.hang_timeout=300",  # a watchdog thread, likewise
    "--resilience.health_check=false",
)


def main() -> int:
    run_dir, overrides = sys.argv[1], sys.argv[2:]
    manager = PluginManager(entry_points=False)  # built-in components only: nothing installed interferes
    config = load_config(None, [*RUN, f"--train.output_dir={run_dir}", *overrides], manager.registry)
    before = set(threading.enumerate())
    result = train(config, manager)
    left = sorted(thread.name for thread in set(threading.enumerate()) - before)
    print(
        f"teardown: status={result.status} steps={result.steps} group_left={not dist.is_initialized()} "
        f"threads_left={left}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    exit_process(main())  # as forge ends a distributed run
