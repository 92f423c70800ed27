"""``forge train`` under ``torchrun --nproc_per_node=2`` on CPU, as the README documents it:
the same losses as one process on the same global batch, checkpoints that resume on another
number of ranks, and a clear error when the ranks' plugins differ."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge_lm.testing import TINY_MODEL
from forge_lm.testing.distributed import metrics_by_step, torchrun

# Per-rank batch 2 on 2 ranks = batch 4 in one process. A constant learning rate, so that a run
# stopped early and resumed follows the same schedule as one that never stopped.
TINY = [
    *TINY_MODEL,
    "--train.seq_len=16",
    "--train.grad_accum_steps=2",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=2",
    "--eval.steps=2",
    "--data.name=synthetic",
    "--scheduler.name=constant",
    "--checkpoint.interval=2",
]


def _one_process_args(steps: int) -> list[str]:
    """What follows ``forge train`` in :func:`_one_process` but the output directory and extras:
    the command line of a run of ``one_process_runs`` (tests/core/distributed/conftest.py)."""
    return ["--no-plugin-autoload", *TINY, "--train.batch_size=4", f"--train.max_steps={steps}"]


def _one_process(run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    args = [*_one_process_args(steps), f"--train.output_dir={run_dir}", *extra]
    return subprocess.run(
        [sys.executable, "-m", "forge_lm", "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _two_ranks(run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    args = [*TINY, "--train.batch_size=2", f"--train.max_steps={steps}", f"--train.output_dir={run_dir}", *extra]
    return torchrun(["-m", "forge_lm", "train", "--no-plugin-autoload", *args], nproc=2)


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def reference(one_process_runs) -> dict[int, dict[str, float]]:
    """Four steps in one process: what every layout below must reproduce (the run
    test_context_parallel.py compares with too, trained once per session)."""
    return metrics_by_step(one_process_runs.read(*_one_process_args(4)))


def _assert_same_steps(actual, expected, steps) -> None:
    for step in steps:
        for key in ("loss", "grad_norm", "eval/loss"):
            if key in expected[step]:
                assert actual[step][key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)


def test_two_ranks_train_like_one_process(tmp_path: Path, reference) -> None:
    run_dir = tmp_path / "run"
    result = _ok(_two_ranks(run_dir, 4))
    assert "2 ranks: dp_replicate=1 dp_shard=2 tp=1 pp=1 ep=1; model transforms: fsdp2" in result.stderr
    assert result.stdout.count("trained 4 steps") == 1  # one summary, from rank 0
    _assert_same_steps(metrics_by_step(run_dir), reference, [1, 2, 3, 4])
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_4").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # each rank wrote its own shard


def test_tensor_parallel_ranks_share_the_batch(tmp_path: Path, reference) -> None:
    """tp ranks read the same data: with tp = 2 the per-rank batch is the global batch."""
    run_dir = tmp_path / "run"
    result = _ok(_two_ranks(run_dir, 2, "--distributed.tp=2", "--train.batch_size=4"))
    assert "model transforms: tensor_parallel" in result.stderr
    _assert_same_steps(metrics_by_step(run_dir), reference, [1, 2])


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path: Path, reference) -> None:
    run_dir = tmp_path / "run"
    _ok(_two_ranks(run_dir, 2))
    resumed = _ok(_one_process(run_dir, 4))
    assert "resumed from" in resumed.stderr
    assert "global batch changed" not in resumed.stderr  # 2 ranks x 2 = 1 rank x 4
    _assert_same_steps(metrics_by_step(run_dir), reference, [3, 4])


def test_one_rank_checkpoint_resumes_on_two_ranks(tmp_path: Path, reference, one_process_runs) -> None:
    run_dir = one_process_runs.copy(tmp_path / "run", *_one_process_args(2))  # _one_process(run_dir, 2)
    resumed = _ok(_two_ranks(run_dir, 4))
    assert resumed.stderr.count("resumed from") == 1  # the run's message, said by rank 0 only
    _assert_same_steps(metrics_by_step(run_dir), reference, [3, 4])


def test_pipeline_checkpoint_resumes_on_one_rank(tmp_path: Path) -> None:
    """Under pipeline parallelism each rank holds one stage; the checkpoint holds them all."""
    untied = "--model.tie_embeddings=false"
    expected_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    _ok(_one_process(expected_dir, 4, untied))
    _ok(_two_ranks(run_dir, 2, untied, "--distributed.pp=2", "--train.batch_size=4"))  # pp ranks share data
    resumed = _ok(_one_process(run_dir, 4, untied))
    assert "resumed from" in resumed.stderr
    expected, actual = metrics_by_step(expected_dir), metrics_by_step(run_dir)
    _assert_same_steps(actual, expected, [1, 2, 3, 4])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _srun_style_ranks(args: list[str], nproc: int = 2) -> list[subprocess.Popen]:
    """Start ``forge train`` ranks as ``srun`` does: each with SLURM's variables and an exported
    MASTER_ADDR/MASTER_PORT, no torchrun."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "FORGE_LM"))}
    base.update(SLURM_NTASKS=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    return [
        subprocess.Popen(
            [sys.executable, "-m", "forge_lm", "train", "--no-plugin-autoload", *args],
            env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(nproc)
    ]


def test_srun_style_launch_without_torchrun(tmp_path: Path, reference) -> None:
    """examples/slurm/multi_node.sbatch starts the ranks with srun alone."""
    run_dir = tmp_path / "run"
    ranks = _srun_style_ranks([*TINY, "--train.batch_size=2", "--train.max_steps=2", f"--train.output_dir={run_dir}"])
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert "2 ranks: dp_replicate=1 dp_shard=2" in outputs[0][1]
    _assert_same_steps(metrics_by_step(run_dir), reference, [1, 2])


def test_a_signal_to_one_rank_stops_every_rank_after_one_checkpoint(tmp_path: Path) -> None:
    """SIGUSR1 reaching rank 1 alone: both ranks agree, save the same step and exit with 75;
    the run then resumes in one process."""
    run_dir = tmp_path / "run"
    args = [*TINY, "--train.batch_size=2", "--train.max_steps=100000", "--eval.interval=0", "--checkpoint.interval=0"]
    ranks = _srun_style_ranks([*args, f"--train.output_dir={run_dir}"])
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.jsonl").exists() or len(metrics_by_step(run_dir)) < 3:
        assert time.monotonic() < deadline, "the ranks did not train"
        assert all(rank.poll() is None for rank in ranks), [rank.communicate() for rank in ranks]
        time.sleep(0.2)
    ranks[1].send_signal(signal.SIGUSR1)
    outputs = [rank.communicate(timeout=240) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [75, 75], outputs
    # The stop is the run's: rank 0 says it, once (issue 36: every rank printed it)
    assert "(sent to another rank) received: saved a checkpoint at step" in outputs[0][1]
    assert "received" not in outputs[1][1], outputs[1][1]
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(saved) == 1  # one checkpoint, written by both ranks together
    step = int(saved[0].name.removeprefix("step_"))
    assert sorted(p.name for p in saved[0].glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resumed = _ok(_one_process(run_dir, step + 1))
    assert f"resumed from {saved[0]} (step {step})" in resumed.stderr


RANK_ONE_BLOCKS_A_PLUGIN = """
import os, sys
if os.environ["RANK"] == "1":
    os.environ["FORGE_LM_BLOCK_PLUGINS"] = "core.transforms"
from forge_lm.cli._main import main
sys.exit(main())
"""


def test_ranks_with_different_plugins_stop_with_the_difference(tmp_path: Path) -> None:
    script = tmp_path / "launch.py"
    script.write_text(RANK_ONE_BLOCKS_A_PLUGIN)
    run_dir = tmp_path / "run"
    args = [*TINY, "--train.batch_size=2", "--train.max_steps=1", f"--train.output_dir={run_dir}"]
    result = torchrun([str(script), "train", "--no-plugin-autoload", *args], nproc=2)
    assert result.returncode != 0
    assert "the ranks resolved different plugin sets (compared with rank 0)" in result.stderr
    assert "rank 1: lacks plugin 'core.transforms' (forge-lm)" in result.stderr
    assert "forge_lm/" not in result.stderr  # a message, not a traceback through Forge (torchrun adds its own)
    assert not run_dir.exists()  # nothing was written
