"""The hang watchdog in a real 2-rank ``forge train`` under torchrun (gloo on CPU).

A test plugin makes rank 1 stall in ``forge_lm_step_end`` at step 2, so rank 0 waits in its
next collective for a peer that never comes. The process group's timeout is far longer than
``resilience.hang_timeout``, so the watchdogs act first: each rank writes its stacks to
``<run>/hang/rank<R>.txt`` (rank 1's naming the plugin's stalling function, rank 0's the
collective it waits in, inside the training loop), records a ``hang`` event and exits with 77,
within the timeout plus a margin of the stall.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from forge_lm.train.watchdog import HANG_EXIT_CODE

HANG_TIMEOUT_S = 5.0
MARGIN_S = 20.0  # a loaded 2-core machine: waking, writing the stacks, exiting

STALL_PLUGIN = """
import os, time
from pathlib import Path
from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


def stall_rank_one_in_step_end():
    Path(os.environ["STALL_MARK"]).write_text(str(time.time()))
    time.sleep(600)


@hookimpl
def forge_lm_step_end(step):
    if step == 2 and os.environ.get("RANK") == "1":
        stall_rank_one_in_step_end()
"""

TINY = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--train.seq_len=16",
    "--train.batch_size=2",
    "--train.max_steps=1000",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--checkpoint.interval=0",
    "--data.name=synthetic",
]


def test_a_rank_stalled_in_a_plugin_stops_every_rank_with_77_and_their_stacks(tmp_path: Path, fake_site) -> None:
    fake_site.install("forge-stall", STALL_PLUGIN)
    run_dir, mark = tmp_path / "run", tmp_path / "stalled-at"
    args = [
        *TINY,
        f"--train.output_dir={run_dir}",
        f"--resilience.hang_timeout={HANG_TIMEOUT_S:g}",
        "--distributed.timeout=300",  # far longer: the watchdogs must act first
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += ["-m", "forge_lm", "train", "--plugins", "stall", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STALL_MARK": str(mark)}
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    ended = time.time()

    assert mark.exists(), err[-3000:]  # rank 1 reached the stall
    stalled_at = float(mark.read_text())
    assert ended - stalled_at <= HANG_TIMEOUT_S + MARGIN_S, err[-3000:]
    assert launcher.returncode != 0  # torchrun reports its workers' failure with its own code
    # Each rank's watchdog fired (the line comes right before its os._exit(77)).
    for rank in (0, 1):
        stacks = run_dir / "hang" / f"rank{rank}.txt"
        assert (
            f"forge: error: no optimizer step completed in {HANG_TIMEOUT_S:g} s (resilience.hang_timeout); "
            f"wrote the Python stacks of rank {rank} to {stacks}; exiting with {HANG_EXIT_CODE}." in err
        ), err[-3000:]
    assert f"exitcode  : {HANG_EXIT_CODE}" in err  # torchrun's summary of the failed workers

    stuck = (run_dir / "hang" / "rank1.txt").read_text()
    assert stuck.startswith("forge hang watchdog: rank 1, pid ")
    assert "in stall_rank_one_in_step_end" in stuck  # where rank 1 is stuck: the plugin
    assert "in forge_lm_step_end" in stuck
    waiting = (run_dir / "hang" / "rank0.txt").read_text()
    assert waiting.startswith("forge hang watchdog: rank 0, pid ")
    assert "stall_rank_one_in_step_end" not in waiting
    assert "torch/distributed/" in waiting  # rank 0 waits in a collective ...
    assert "forge_lm/train/loop.py" in waiting  # ... of the training loop

    hangs = [
        json.loads(line)
        for line in (run_dir / "events.jsonl").read_text().splitlines()
        if json.loads(line)["type"] == "hang"
    ]
    assert sorted(event["rank"] for event in hangs) == [0, 1]
    for event in hangs:
        assert event["stacks"] == str(run_dir / "hang" / f"rank{event['rank']}.txt")
        assert event["seconds"] == HANG_TIMEOUT_S
        assert event["step"] == 2
        # Each rank's clock started at its last step (step 2, just before the stall).
        assert HANG_TIMEOUT_S - 2 <= event["time"] - stalled_at <= HANG_TIMEOUT_S + MARGIN_S
