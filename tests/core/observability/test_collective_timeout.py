"""A collective that times out names ``[distributed] timeout`` and ends with the hang code (77).

Two real ranks (started as ``srun`` starts them, gloo on CPU); a test plugin makes rank 1
sleep in ``step_end`` for longer than the process group's timeout, with the hang watchdog
off, so rank 0's next collective is the one that gives up.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from forge_lm.train.watchdog import HANG_EXIT_CODE

SLEEPER = """
import os, time
from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_step_end(context, step):
    if os.environ.get("SLURM_PROCID") == "1" and step == 2:
        time.sleep(float(os.environ["SLEEPER_SECONDS"]))
"""

TINY = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--train.seq_len=16",
    "--train.batch_size=2",
    "--train.max_steps=50",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _install_sleeper(site: Path) -> None:
    (site / "forge_sleeper.py").write_text(SLEEPER)
    info = site / "forge_sleeper-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: forge-sleeper\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[forge_lm]\nsleeper = forge_sleeper\n")


def test_a_collective_timeout_names_the_setting_and_exits_with_the_hang_code(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _install_sleeper(site)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "FORGE_LM"))}
    env.update(
        SLURM_NTASKS="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        OMP_NUM_THREADS="1",
        SLEEPER_SECONDS="25",
        PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]),
    )
    args = [*TINY, f"--train.output_dir={run_dir}", "--distributed.timeout=4", "--resilience.hang_timeout=0"]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "forge_lm", "train", *args],
            env={**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        _, err0 = ranks[0].communicate(timeout=120)
    finally:
        ranks[1].kill()  # asleep in the plugin: its own fate is not what this test is about
        ranks[1].communicate()
    assert ranks[0].returncode == HANG_EXIT_CODE, err0
    assert "a collective operation waited longer than [distributed] timeout = 4 s" in err0
    assert "Traceback" not in err0
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    error, end = records[-2:]
    assert (error["type"], error["rank"], error["exit_code"]) == ("error", 0, HANG_EXIT_CODE)
    assert "CollectiveTimedOut" in error["error"]
    assert (end["type"], end["status"], end["exit_code"]) == ("end", "failed", HANG_EXIT_CODE)
