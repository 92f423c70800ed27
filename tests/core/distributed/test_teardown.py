"""How a run ends: background work joined, then barrier, pipeline released, process group
destroyed once, in that order, whatever ended the run.

The order itself is checked with fakes (no flakiness: a wrong order fails every time); the
real thing by repeating a tiny 2-rank pipeline run's whole start-train-teardown cycle under
torchrun and reading every launch's exit status and output.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

import forge_lm.distributed.launch as launch
from forge_lm.config import load_config
from forge_lm.distributed.pipeline import PipelineRunner
from forge_lm.testing import TINY_MODEL
from forge_lm.testing.distributed import torchrun
from forge_lm.train import ending, loop
from forge_lm.train.ending import Teardown

WORKER = Path(__file__).parent / "workers" / "teardown_worker.py"
CYCLES = 8
# What torch prints when a process group or one of its threads is destroyed at the wrong time.
TEARDOWN_TROUBLE = re.compile(
    r"terminate called|Aborted|core dumped|destroy_process_group|ProcessGroup\w*.*destr", re.IGNORECASE
)


class FakeDist:
    """The calls of torch.distributed that the teardown makes, recorded in order."""

    def __init__(self, calls: list[str], barrier_error: Exception | None = None) -> None:
        self.calls = calls
        self.initialized = True
        self.barrier_error = barrier_error

    def is_initialized(self) -> bool:
        return self.initialized

    def barrier(self) -> None:
        self.calls.append("barrier")
        if self.barrier_error is not None:
            raise self.barrier_error

    def destroy_process_group(self) -> None:
        self.calls.append("destroy")
        self.initialized = False


class FakePipeline:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def close(self) -> None:
        self.calls.append("release pipeline")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A process that created its process group, with torch.distributed replaced by a recorder."""
    recorded: list[str] = []
    monkeypatch.setattr(launch, "dist", FakeDist(recorded))
    monkeypatch.setattr(launch, "_OWNED_GROUP", True)
    return recorded


# --- the order, with fakes ------------------------------------------------------------------


def test_ranks_stopping_together_wait_then_release_the_pipeline_then_destroy_the_group(calls: list[str]) -> None:
    teardown = Teardown()
    teardown.hold(FakePipeline(calls))
    teardown.close(together=True)
    assert calls == ["barrier", "release pipeline", "destroy"]


def test_a_rank_failing_alone_does_not_wait_for_the_others(calls: list[str]) -> None:
    teardown = Teardown()
    teardown.hold(FakePipeline(calls))
    teardown.close(together=False)
    assert calls == ["release pipeline", "destroy"]


def test_the_group_is_destroyed_exactly_once(calls: list[str]) -> None:
    teardown = Teardown()
    teardown.hold(FakePipeline(calls))
    teardown.close(together=True)
    teardown.close(together=True)
    assert calls == ["barrier", "release pipeline", "destroy"]
    launch.shutdown_distributed(wait_for_all=True)  # another caller after the run's teardown: nothing left to do
    assert calls == ["barrier", "release pipeline", "destroy"]


def test_a_failed_barrier_still_releases_and_destroys_then_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(launch, "dist", FakeDist(calls, barrier_error=RuntimeError("Connection reset by peer")))
    monkeypatch.setattr(launch, "_OWNED_GROUP", True)
    teardown = Teardown()
    teardown.hold(FakePipeline(calls))
    with pytest.raises(RuntimeError, match="Connection reset"):
        teardown.close(together=True)
    assert calls == ["barrier", "release pipeline", "destroy"]
    assert not launch._OWNED_GROUP


def test_a_group_this_process_did_not_create_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(launch, "dist", FakeDist(calls))
    monkeypatch.setattr(launch, "_OWNED_GROUP", False)  # the caller initialised it (a test harness)
    teardown = Teardown()
    teardown.hold(FakePipeline(calls))
    teardown.close(together=True)
    assert calls == ["release pipeline"]


def test_no_pipeline_no_release(calls: list[str]) -> None:
    teardown = Teardown()
    teardown.hold(None)
    teardown.close(together=True)
    assert calls == ["barrier", "destroy"]


def test_closing_a_pipeline_drops_its_schedules_and_group() -> None:
    runner = PipelineRunner.__new__(PipelineRunner)  # the state close() clears; no process group needed
    runner._schedules = {(True, (2, 8)): object()}
    runner._data_losses = [object()]
    runner.group = object()
    runner.close()
    assert (runner._schedules, runner._data_losses, runner.group) == ({}, [], None)


def test_the_loop_joins_its_background_work_before_the_teardown(
    tmp_path: Path, manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real one-process run, with a background checkpoint writer and the hang watchdog: when
    the teardown starts, end_run has run and every thread the run started has ended but the
    watchdog, which watches the teardown too and is stopped after it."""
    order: list[str] = []
    seen: dict[str, list[str]] = {}
    before = set(threading.enumerate())
    end_run = ending.end_run

    def recording_end_run(*args, **kwargs):
        end_run(*args, **kwargs)
        order.append("end_run")

    close = Teardown.close

    def recording_close(self: Teardown, *, together: bool) -> None:
        order.append(f"teardown together={together}")
        seen["threads"] = sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())
        close(self, together=together)

    monkeypatch.setattr(loop, "end_run", recording_end_run)
    monkeypatch.setattr(Teardown, "close", recording_close)
    overrides = [
        *TINY_MODEL,
        "--train.batch_size=2",
        "--train.seq_len=16",
        "--train.max_steps=2",
        "--data.name=synthetic",
        '--metrics.backends=["jsonl"]',
        "--metrics.peak_flops=1e12",
        "--checkpoint.interval=1",
        "--checkpoint.async_save=true",
        "--resilience.hang_timeout=300",
        f"--train.output_dir={tmp_path / 'run'}",
    ]
    result = loop.train(load_config(None, overrides, manager.registry), manager)
    assert result.status == "completed"
    assert order == ["end_run", "teardown together=True"]
    assert seen["threads"] == ["forge-hang-watchdog"]  # the checkpoint writer was joined before
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]  # the watchdog, after


def test_a_failing_run_tears_down_without_waiting_for_the_others(
    tmp_path: Path, manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    close = Teardown.close

    def recording_close(self: Teardown, *, together: bool) -> None:
        order.append(f"teardown together={together}")
        close(self, together=together)

    def failing_build(config, manager):
        raise RuntimeError("a rank failed while building")

    monkeypatch.setattr(Teardown, "close", recording_close)
    monkeypatch.setattr(loop, "build_parts", failing_build)
    overrides = [*TINY_MODEL, "--train.seq_len=16", f"--train.output_dir={tmp_path / 'run'}"]
    config = load_config(None, overrides, manager.registry)
    with pytest.raises(RuntimeError, match="a rank failed while building"):
        loop.train(config, manager)
    assert order == ["teardown together=False"]


# --- the real thing, repeated -----------------------------------------------------------------


def test_a_two_rank_pipeline_run_ends_cleanly_every_time(tmp_path: Path) -> None:
    """CYCLES launches of a 2-step pp = 2 run: each exits 0, on each rank the process group is
    gone and no thread of the run is left when train() returns, and no launch prints what
    torch prints when a group or its threads are torn down in the wrong order."""
    failures = []
    for cycle in range(CYCLES):
        result = torchrun([str(WORKER), str(tmp_path / f"run{cycle}")], nproc=2, timeout=300)
        output = result.stdout + result.stderr
        # Both ranks write to one pipe, so their lines may run together: find the reports in the text.
        lines = re.findall(r"teardown: status=\S+ steps=\d+ group_left=\S+ threads_left=\[[^\]]*\]", result.stdout)
        expected = ["teardown: status=completed steps=2 group_left=True threads_left=[]"] * 2
        trouble = TEARDOWN_TROUBLE.findall(output)
        if result.returncode != 0 or lines != expected or trouble:
            failures.append(f"cycle {cycle}: rc {result.returncode}, {lines}, {trouble}\n{output[-3000:]}")
    assert not failures, "\n\n".join(failures)
