"""examples/slurm/multi_node.sbatch run as SLURM would run it, on two simulated nodes.

Stand-ins for ``srun`` and ``scontrol`` go first on PATH: ``srun`` starts one task per node
and GPU of the (simulated) allocation as local processes with SLURM's variables, forwards
signals to them and returns their highest exit code, as srun does; ``scontrol`` answers
``show hostnames`` and records ``requeue``. The test then does what SLURM does before a time
limit: it signals every task of the job.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge_lm.metrics.jsonl import read_metrics
from forge_lm.testing import TINY_MODEL

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "multi_node.sbatch"
TINY = [
    *TINY_MODEL,
    "--train.batch_size=2",
    "--train.seq_len=16",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
    "--no-plugin-autoload",
]

FAKE_SRUN = """#!{python}
import os, signal, subprocess, sys
nodes, per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
tasks = []
for node in range(nodes):
    for local in range(per_node):
        env = dict(os.environ, SLURM_PROCID=str(node * per_node + local), SLURM_LOCALID=str(local),
                   SLURM_NODEID=str(node), SLURM_NTASKS=str(nodes * per_node), OMP_NUM_THREADS="1")
        tasks.append(subprocess.Popen(sys.argv[1:], env=env))
with open(os.environ["FAKE_SLURM_TASKS"], "w") as pids:
    pids.write(" ".join(str(task.pid) for task in tasks))
def forward(signum, frame):
    for task in tasks:
        task.send_signal(signum)
for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(sig, forward)
sys.exit(max(task.wait() for task in tasks))
"""

FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo 127.0.0.1; echo 127.0.0.2 ;;
  requeue*) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
  *) echo "scontrol stand-in: unexpected $*" >&2; exit 1 ;;
esac
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    """A two-node allocation with one task per node, and the stand-in commands on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_LM_", "SLURM_", "RANK", "WORLD_SIZE"))}
    env.update(
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_NNODES="2",
        SLURM_NTASKS_PER_NODE="1",
        MASTER_PORT=str(_free_port()),
        FAKE_SLURM_LOG=str(tmp_path / "scontrol.log"),
        FAKE_SLURM_TASKS=str(tmp_path / "tasks.pid"),
    )
    return env


def _job(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(SCRIPT), *TINY, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _training_job(env: dict[str, str], run_dir: Path, logged_steps: int) -> subprocess.Popen:
    """A job of a run with no end in sight, once it has logged ``logged_steps`` steps."""
    job = _job(env, "--train.max_steps=100000", "--checkpoint.interval=0", f"--train.output_dir={run_dir}")
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir / "metrics.jsonl")) < logged_steps:
        assert time.monotonic() < deadline, "the ranks did not train"
        assert job.poll() is None, job.communicate()
        time.sleep(0.2)
    return job


def test_a_preempted_multi_node_job_saves_one_checkpoint_requeues_once_and_resumes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job = _training_job(slurm, run_dir, logged_steps=3)
    for pid in Path(slurm["FAKE_SLURM_TASKS"]).read_text().split():  # SLURM signals every task
        os.kill(int(pid), signal.SIGUSR1)
    out, err = job.communicate(timeout=240)

    assert job.returncode == 0, err  # requeued: the job itself ends well
    assert "forge stopped with 75" in out
    assert Path(slurm["FAKE_SLURM_LOG"]).read_text() == "requeue 4242\n"
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(saved) == 1, saved  # one checkpoint, written by both ranks together
    assert sorted(p.name for p in saved[0].glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert "forge: SIGUSR1 received: saved a checkpoint at step" in err
    step = int(saved[0].name.removeprefix("step_"))

    # The requeued job: the same command, here with an end in sight, resumes from the checkpoint.
    slurm["MASTER_PORT"] = str(_free_port())
    rerun = _job(slurm, f"--train.max_steps={step + 1}", "--checkpoint.interval=0", f"--train.output_dir={run_dir}")
    out, err = rerun.communicate(timeout=240)
    assert rerun.returncode == 0, err
    assert f"resumed from {saved[0]} (step {step})" in err
    assert Path(slurm["FAKE_SLURM_LOG"]).read_text() == "requeue 4242\n"  # no second requeue


def test_a_rank_that_only_heard_of_the_signal_from_another_names_it_so(slurm, tmp_path):
    """SLURM signals one task only (the other learns of it at the step's agreement). The stop is the
    run's: rank 0 says it once, naming the signal as one another rank received (issue 36: every
    rank used to print its own line)."""
    run_dir = tmp_path / "run"
    job = _training_job(slurm, run_dir, logged_steps=2)
    os.kill(int(Path(slurm["FAKE_SLURM_TASKS"]).read_text().split()[1]), signal.SIGTERM)  # rank 1 only
    _, err = job.communicate(timeout=240)
    assert job.returncode == 0, err
    assert "forge: SIGTERM or SIGUSR1 (sent to another rank) received: saved a checkpoint at step" in err  # rank 0
    assert "forge: SIGTERM received: saved a checkpoint at step" not in err  # rank 1 says nothing of its own


EXITING_SRUN = """#!/bin/bash
exit "$FAKE_SRUN_EXIT"
"""


@pytest.mark.parametrize(
    ("code", "requeued"),
    [(75, True), (76, True), (77, True), (0, False), (1, False), (3, False), (78, False)],
)
def test_the_job_requeues_on_preemption_and_hang_codes_only(slurm, tmp_path, code, requeued):
    """75 (preempted), 76 (its save cut off) and 77 (a hang) requeue and end the job well; any
    other code, the health check's 78 included (a bad node would be drawn again), is the job's."""
    (tmp_path / "bin" / "srun").write_text(EXITING_SRUN)  # no training: the ranks' exit code alone
    job = subprocess.run(
        ["bash", str(SCRIPT)], env={**slurm, "FAKE_SRUN_EXIT": str(code)}, capture_output=True, text=True, timeout=60
    )
    log = Path(slurm["FAKE_SLURM_LOG"])
    if requeued:
        assert job.returncode == 0, job.stderr
        assert f"forge stopped with {code}" in job.stdout
        assert log.read_text() == "requeue 4242\n"
    else:
        assert job.returncode == code
        assert not log.exists()
