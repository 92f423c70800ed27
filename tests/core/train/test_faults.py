"""Faults reproduced with real ``forge train`` processes and real signals; nothing may be lost.

A small fault-injection plugin is installed for these runs (a real distribution on the
subprocesses' path). Environment variables tell it what to do:

- FAULT_SIGNAL_AT=<step>:<SIGTERM|SIGUSR1>: the process signals itself after that step (in its
  step_end); the ranks agree on a signal with the next step's loss, so that next step is the one
  checkpointed before the run stops;
- FAULT_HANG_SAVE_AT=<step>: saving the checkpoint of that step hangs;
- FAULT_KILL_SAVE_AT=<step>: the process is killed (SIGKILL) while that checkpoint is written;
- the loss ``nan_once`` returns NaN on its ``at_call``-th call.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from forge_lm.metrics.jsonl import read_metrics
from forge_lm.model.linear import onednn_available
from forge_lm.testing import TINY_MODEL

FAULTS = """
import os, signal, threading, time
from pathlib import Path

import attrs

from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


def _at(name):
    value = os.environ.get(name, "")
    return value.split(":") if value else None


@hookimpl
def forge_lm_step_end(context, step):
    wanted = _at("FAULT_SIGNAL_AT")
    if wanted and int(wanted[0]) == step:
        os.kill(os.getpid(), getattr(signal, wanted[1]))


@hookimpl
def forge_lm_save_state(context):
    wanted = _at("FAULT_HANG_SAVE_AT")
    if wanted and int(wanted[0]) == context.step:
        time.sleep(120)
    wanted = _at("FAULT_KILL_SAVE_AT")
    if wanted and int(wanted[0]) == context.step:
        import torch

        target = Path(context.run_dir) / "checkpoints" / f"step_{context.step}"

        def kill_once_writing():
            while not any(target.glob("*.distcp")):
                time.sleep(0.0005)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_once_writing, daemon=True).start()
        return {"ballast": torch.zeros(64 * 1024 * 1024 // 4)}  # makes the write long enough to be hit
    return None


@attrs.define
class NanOnceOptions:
    at_call: int = 1


class _NanOnce:
    def __init__(self, at_call):
        self.calls, self.at_call = 0, at_call

    def __call__(self, logits, labels):
        import torch.nn.functional as F

        self.calls += 1
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return loss * float("nan") if self.calls == self.at_call else loss


@hookimpl
def forge_lm_register_losses(register):
    register("nan_once", lambda options: _NanOnce(options.at_call), config=NanOnceOptions, description="NaN once")
"""

BASE = [
    *TINY_MODEL,
    "--train.batch_size=4",
    "--train.seq_len=32",
    "--train.max_steps=12",
    "--optimizer.lr=3e-3",
    "--scheduler.warmup_steps=2",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e11",
    "--eval.interval=0",
    "--checkpoint.interval=4",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults-site")
    (root / "forge_faults.py").write_text(FAULTS)
    info = root / "forge_faults-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: forge-faults\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[forge_lm]\nfaults = forge_faults\n")
    return root


def forge_train(site: Path, run_dir: Path, *overrides: str, **faults: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_LM_", "FAULT_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    env.update({f"FAULT_{key.upper()}": value for key, value in faults.items()})
    return subprocess.run(
        [sys.executable, "-m", "forge_lm", "train", *BASE, f"--train.output_dir={run_dir}", *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def events(run_dir: Path, **where: object) -> list[dict]:
    """The run's events.jsonl records, those whose fields match ``where``."""
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [r for r in records if all(r.get(key) == value for key, value in where.items())]


def kinds(run_dir: Path) -> list[str]:
    return [record["type"] for record in events(run_dir)]


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; where a step was logged twice (redone after a resume), the later record."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def straight(site, tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    done = forge_train(site, run_dir)
    assert done.returncode == 0, done.stderr
    return losses(run_dir)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_signal_saves_exits_75_and_resume_is_bitwise_identical(site, straight, tmp_path, sig):
    run_dir = tmp_path / "run"
    stopped = forge_train(site, run_dir, signal_at=f"5:{sig}")
    assert stopped.returncode == 75, stopped.stderr
    assert f"forge: {sig} received: saved a checkpoint at step 6 and stopped" in stopped.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_6"
    resumed = forge_train(site, run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert "(step 6)" in resumed.stderr
    assert losses(run_dir) == straight  # bit for bit, every step
    # The event log tells the same story as data: two starts, the preemption, the resume.
    assert kinds(run_dir) == [
        "start", "checkpoint_saved", "checkpoint_saved", "preemption", "end",
        "start", "resume", "checkpoint_saved", "checkpoint_saved", "end",
    ]  # fmt: skip
    first, _, _, preempted, stopped_end, second, resume, _, _, last = events(run_dir)
    assert (first["resuming"], first["step"], first["rank"], first["world_size"]) == (False, 0, 0, 1)
    assert first["config_hash"] == second["config_hash"]
    assert len(first["config_hash"]) == 16
    assert any(plugin["name"] == "faults" for plugin in first["plugins"])
    # "auto": the kernel measured faster here (oneDNN only where torch has it), the same on resume (bitwise)
    assert first["cpu_linear_kernel"] == second["cpu_linear_kernel"]
    assert first["cpu_linear_kernel"] in (("onednn", "aten") if onednn_available() else ("aten",))
    assert "oneDNN measured" in first["cpu_linear_kernel_reason"] or not onednn_available()
    # glibc here: freed memory is kept in the process (forge_lm.train.cpu_memory)
    assert first["cpu_memory"] == "kept (glibc malloc: no mmap, thresholds raised)"
    assert (preempted["signal"], preempted["step"]) == (sig, 6)
    assert (stopped_end["status"], stopped_end["exit_code"]) == ("interrupted", 75)
    assert (second["resuming"], resume["from_step"], resume["checkpoint"]) == (True, 6, "step_6")
    saved = events(run_dir, type="checkpoint_saved")
    assert [(e["step"], e["checkpoint"]) for e in saved] == [
        (4, "step_4"),
        (6, "step_6"),
        (8, "step_8"),
        (12, "step_12"),
    ]
    for event in saved:  # the size recorded is the size on disk
        files = (run_dir / "checkpoints" / event["checkpoint"]).iterdir()
        assert event["bytes"] == sum(f.stat().st_size for f in files)
        assert event["seconds"] >= 0
    assert (last["status"], last["exit_code"], last["step"]) == ("completed", 0, 12)
    assert all(e["time"] <= f["time"] for e, f in zip(events(run_dir), events(run_dir)[1:], strict=False))


def test_async_checkpoints_resume_bitwise_identical(site, straight, tmp_path):
    run_dir = tmp_path / "run"
    stopped = forge_train(
        site, run_dir, "--checkpoint.async_save=true", "--checkpoint.interval=2", signal_at="6:SIGTERM"
    )
    assert stopped.returncode == 75, stopped.stderr
    resumed = forge_train(site, run_dir, "--checkpoint.async_save=true", "--checkpoint.interval=2")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(run_dir) == straight


def test_a_hanging_save_after_a_signal_is_cut_off_by_the_timer(site, tmp_path):
    run_dir = tmp_path / "run"
    done = forge_train(site, run_dir, "--resilience.signal_timeout=2", signal_at="5:SIGTERM", hang_save_at="6")
    assert done.returncode == 76, done.stderr
    assert "the checkpoint did not finish within 2 s" in done.stderr
    assert events(run_dir)[-1] | {"time": 0} == {
        "time": 0, "rank": 0, "step": 6, "type": "end", "status": "interrupted", "exit_code": 76
    }  # fmt: skip
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_4"  # the previous one, intact


def test_kill_during_a_checkpoint_write_leaves_the_previous_one_in_charge(site, straight, tmp_path):
    run_dir = tmp_path / "run"
    killed = forge_train(site, run_dir, kill_save_at="8")
    assert killed.returncode == -signal.SIGKILL
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_4"
    assert not (run_dir / "checkpoints" / "step_8" / "trainer_state.json").exists()  # cut off mid-write
    resumed = forge_train(site, run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "(step 4)" in resumed.stderr
    assert losses(run_dir) == straight


def test_a_corrupt_newest_checkpoint_is_reported_and_an_older_one_used(site, straight, tmp_path):
    run_dir = tmp_path / "run"
    assert forge_train(site, run_dir, signal_at="7:SIGTERM").returncode == 75
    newest = run_dir / "checkpoints" / "step_8"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    resumed = forge_train(site, run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "forge: warning: passed over checkpoint step_8:" in resumed.stderr
    (skipped,) = events(run_dir, type="checkpoint_skipped")
    assert skipped["checkpoint"] == "step_8"
    assert skipped["reason"] in resumed.stderr
    assert events(run_dir, type="resume")[0]["from_step"] == 4
    assert "(step 4)" in resumed.stderr
    assert losses(run_dir) == straight


def test_rollback_goes_back_to_the_checkpoint_and_past_the_bad_batch(site, tmp_path):
    run_dir = tmp_path / "run"
    done = forge_train(site, run_dir, "--loss.name=nan_once", "--loss.at_call=7", "--resilience.nan_policy=rollback")
    assert done.returncode == 0, done.stderr
    assert "rolled back to step 4 and skipping the bad batch" in done.stderr
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11, 12]  # 5, 6 redone
    assert all(r["loss"] == r["loss"] for r in records)  # no NaN was ever logged as a step
    first_five, redone_five = records[4], records[6]
    assert first_five["loss"] != redone_five["loss"]  # the redone step 5 saw the next batch, not the bad one
    (bad,) = events(run_dir, type="nonfinite_step")
    assert (bad["step"], bad["action"], bad["loss"]) == (6, "rollback", "nan")
    assert events(run_dir, type="resume")[0]["from_step"] == 4  # the rollback is a restore too


def test_skip_policy_drops_the_bad_step_and_stop_policy_exits_3(site, tmp_path):
    skipped = forge_train(site, tmp_path / "skip", "--loss.name=nan_once", "--loss.at_call=3")
    assert skipped.returncode == 0, skipped.stderr
    assert "skipped the step (no optimizer or scheduler update)" in skipped.stderr
    steps = [r["step"] for r in read_metrics(tmp_path / "skip" / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 13))
    (bad,) = events(tmp_path / "skip", type="nonfinite_step")
    assert (bad["step"], bad["action"], bad["bad_steps_in_a_row"]) == (2, "skip", 1)
    stopped = forge_train(
        site, tmp_path / "stop", "--loss.name=nan_once", "--loss.at_call=3", "--resilience.nan_policy=stop"
    )
    assert stopped.returncode == 3
    assert "non-finite loss nan" in stopped.stderr
    assert "resilience.nan_policy = 'stop'" in stopped.stderr
    *_, bad, error, end = events(tmp_path / "stop")
    assert (bad["type"], bad["action"], error["type"], error["exit_code"]) == ("nonfinite_step", "stop", "error", 3)
    assert "NonFiniteLoss: non-finite loss nan" in error["error"]
    assert (end["status"], end["exit_code"]) == ("failed", 3)


def test_keep_last_n_keeps_the_newest_checkpoints(site, tmp_path):
    run_dir = tmp_path / "run"
    done = forge_train(
        site, run_dir, "--checkpoint.interval=2", "--checkpoint.keep_last_n=2", "--eval.interval=6", "--eval.steps=1"
    )
    assert done.returncode == 0, done.stderr
    logged = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/loss" in r]
    evaluations = events(run_dir, type="evaluation")
    assert [(e["step"], e["metrics"]) for e in evaluations] == [
        (r["step"], {k: v for k, v in r.items() if k != "step"}) for r in logged
    ]
    assert [e["step"] for e in evaluations] == [6, 12]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_10", "step_12"]
    state = json.loads((run_dir / "checkpoints" / "step_12" / "trainer_state.json").read_text())
    assert (state["step"], state["trainer"]["tokens_seen"]) == (12, 12 * 4 * 32)
