"""StepProfiler: which optimizer steps a [profiling] window records, and what it writes.

A few Linear layers trained for a dozen steps drive the profiler exactly as the loop does
(``step(n)`` after the n-th optimizer step). The recorded steps are read back from the traces'
``forge/step_N`` spans, so the window arithmetic is checked against what torch really saw.
The CUDA-only memory snapshot is checked with torch.cuda.memory's functions replaced.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import weakref
from pathlib import Path

import pytest
import torch

from forge_lm.config import ProfilingSection
from forge_lm.train import profiling
from forge_lm.train.profiler_output import without_kineto_lines
from forge_lm.train.profiling import StepProfiler, recorded_steps

CPU = torch.device("cpu")


def train(
    section: ProfilingSection,
    run_dir: Path,
    steps: int,
    rank: int = 0,
    first: int = 1,
    fail: Exception | None = None,
) -> StepProfiler:
    """Optimizer steps ``first..steps`` of a tiny MLP, under a StepProfiler; returns it.
    ``fail`` is raised after the last step, as a failure in the step after it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with StepProfiler(section, run_dir, rank, CPU) as profiler:
        for step in range(first, steps + 1):
            loss = model(torch.randn(8, 16)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step(step)
        if fail is not None:
            model(torch.randn(8, 16)).sum().backward()
            raise fail
    return profiler


def section(**values) -> ProfilingSection:
    return ProfilingSection(**{"enabled": True, "with_stack": False, **values})


def traced_steps(trace: Path) -> list[int]:
    """The steps whose forge/step_N span is in ``trace``."""
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted(int(m.group(1)) for e in events if (m := re.fullmatch(r"forge/step_(\d+)", e.get("name", ""))))


def traces(run_dir: Path, rank: int = 0) -> dict[str, list[int]]:
    """Trace file name -> the steps in it, for every trace of ``rank``."""
    folder = run_dir / "profiles" / f"rank{rank}"
    return {path.name: traced_steps(path) for path in sorted(folder.glob("trace_*.json"))}


def reference_windows(start: int, warmup: int, active: int, repeat: int, last: int) -> list[int]:
    """The documented rule, written out independently: window k records
    start + k*(warmup + active) ... + active - 1."""
    steps = []
    k = 0
    while (repeat == 0 or k < repeat) and start + k * (warmup + active) <= last:
        first = start + k * (warmup + active)
        steps += [n for n in range(first, first + active) if n <= last]
        k += 1
    return steps


@pytest.mark.parametrize(
    ("values", "steps", "expected"),
    [
        # The defaults: warm up on 4, record 5-7.
        ({}, 12, {"trace_step5-7.json": [5, 6, 7]}),
        # Two windows, each after one warm-up step: 2 is warm-up for 3-4, 5 for 6-7.
        (
            {"start_step": 3, "warmup_steps": 1, "active_steps": 2, "repeat": 2},
            12,
            {"trace_step3-4.json": [3, 4], "trace_step6-7.json": [6, 7]},
        ),
        # No step before step 1 to warm up on: only the first window's warm-up is cut.
        (
            {"start_step": 1, "warmup_steps": 1, "active_steps": 2, "repeat": 2},
            12,
            {"trace_step1-2.json": [1, 2], "trace_step4-5.json": [4, 5]},
        ),
        # repeat = 0 repeats to the end; the run stops inside the last window, which keeps step 6
        # (and the loop's work after it, in a span for the step 7 that never ran).
        (
            {"start_step": 2, "warmup_steps": 0, "active_steps": 2, "repeat": 0},
            6,
            {"trace_step2-3.json": [2, 3], "trace_step4-5.json": [4, 5], "trace_step6-6.json": [6, 7]},
        ),
    ],
)
def test_the_traces_hold_exactly_the_steps_of_each_window(tmp_path, values, steps, expected):
    train(section(**values), tmp_path, steps)

    assert traces(tmp_path) == expected
    assert recorded_steps(section(**values), steps) == [n for window in expected.values() for n in window if n <= steps]


def test_the_schedule_follows_the_documented_rule():
    for start, warmup, active, repeat in itertools.product([1, 2, 3, 7], [0, 1, 3], [1, 2, 5], [0, 1, 3]):
        values = {"start_step": start, "warmup_steps": warmup, "active_steps": active, "repeat": repeat}
        expected = reference_windows(start, warmup, active, repeat, 60)
        assert recorded_steps(section(**values), 60) == expected, values


def test_a_rank_writes_into_its_own_folder_only(tmp_path):
    train(section(start_step=2, active_steps=2), tmp_path, 4, rank=1)

    assert [p.name for p in (tmp_path / "profiles").iterdir()] == ["rank1"]
    assert sorted(p.name for p in (tmp_path / "profiles" / "rank1").iterdir()) == [
        "ops_step2-3.json",
        "trace_step2-3.json",
    ]


def test_with_stack_writes_folded_stacks_that_flamegraph_tools_read(tmp_path):
    train(section(start_step=2, active_steps=2, with_stack=True), tmp_path, 4)

    lines = (tmp_path / "profiles" / "rank0" / "stacks_step2-3.txt").read_text().splitlines()
    assert lines
    for line in lines:
        frames, _, value = line.rpartition(" ")
        assert frames
        assert all(frames.split(";")), line  # no empty frame
        assert value.isdigit()
        assert int(value) > 0
    assert any(";" in line.rpartition(" ")[0] for line in lines)  # real stacks, not lone frames
    assert any("Linear" in line or "linear" in line for line in lines)  # the model's calls are in them


def test_the_summary_is_torchs_key_averages_of_the_operators(tmp_path, monkeypatch):
    seen = {}
    summarize = profiling.summarize

    def spy(prof, *args):
        # torch's own aggregation and order (its table sorts the same way for sort_by=...).
        seen["torch"] = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)
        seen["frames"] = {e.key for e in prof.events() if e.is_python_function}
        return summarize(prof, *args)

    monkeypatch.setattr(profiling, "summarize", spy)
    train(section(start_step=2, active_steps=2, with_stack=True), tmp_path, 4)

    summary = json.loads((tmp_path / "profiles" / "rank0" / "ops_step2-3.json").read_text())
    assert summary["steps"] == [2, 3]
    assert summary["rank"] == 0
    assert summary["device"] == "cpu"
    assert summary["trace"] == "trace_step2-3.json"
    ops = {op["name"]: op for op in summary["ops"]}
    for name in ("aten::addmm", "aten::mm"):  # forward Linear layers; their weight gradients
        assert ops[name]["self_cpu_us"] > 0
        assert ops[name]["calls"] > 0
    assert ops["aten::addmm"]["calls"] == 4  # two layers, two steps

    expected = [a for a in seen["torch"] if a.key in ops]
    assert [op["name"] for op in summary["ops"]] == [a.key for a in expected]
    assert [op["self_cpu_us"] for op in summary["ops"]] == [a.self_cpu_time_total for a in expected]
    assert [op["calls"] for op in summary["ops"]] == [a.count for a in expected]
    # What is left out is only Python frames and the step spans, never an operator.
    left_out = {a.key for a in seen["torch"]} - set(ops)
    assert left_out
    assert all(k in seen["frames"] or k.startswith(("ProfilerStep", "forge/step_")) for k in left_out)


def test_disabled_profiling_starts_nothing_and_writes_nothing(tmp_path, monkeypatch):
    def no_profiler(*args, **kwargs):
        raise AssertionError("torch.profiler.profile was started")

    monkeypatch.setattr(torch.profiler, "profile", no_profiler)
    profiler = train(ProfilingSection(), tmp_path, 8)

    assert not (tmp_path / "profiles").exists()
    assert profiler.written == []


def test_a_failed_export_is_a_warning_and_training_goes_on(tmp_path, capsys):
    (tmp_path / "profiles").write_text("a file where the folder should be")

    profiler = train(section(start_step=2, active_steps=2, repeat=2), tmp_path, 8)

    err = capsys.readouterr().err
    assert err.count("forge: warning: could not write the profile of steps") == 2
    assert "steps 2-3" in err
    assert "steps 5-6" in err
    assert profiler.written == []


def test_an_exception_goes_through_and_the_window_keeps_its_completed_steps(tmp_path):
    boom = ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        train(section(start_step=2, active_steps=3), tmp_path, 3, fail=boom)  # fails in step 4, inside 2-4

    assert list(traces(tmp_path)) == ["trace_step2-3.json"]
    assert traced_steps(tmp_path / "profiles" / "rank0" / "trace_step2-3.json") == [2, 3, 4]  # 4: the failed step


def test_a_resumed_run_records_the_windows_still_ahead_by_the_loops_step_numbers(tmp_path):
    # Windows 2-3, 4-5, 6-7, 8-9; the run resumes after step 5. Its first step (6) is not
    # recorded: the profiler learns the step number only when that step ends.
    train(section(start_step=2, warmup_steps=0, active_steps=2, repeat=0), tmp_path, 9, first=6)

    assert traces(tmp_path) == {"trace_step7-7.json": [7], "trace_step8-9.json": [8, 9]}


def test_a_resumed_run_drops_a_recording_made_under_the_wrong_step_number(tmp_path):
    # Every step is recorded (windows of 3 from step 1). Entering, the profiler must assume
    # step 1 is next; resumed at step 5, that first recording is dropped, not labelled step 1.
    train(section(start_step=1, warmup_steps=0, active_steps=3, repeat=0), tmp_path, 9, first=5)

    assert traces(tmp_path) == {"trace_step6-6.json": [6], "trace_step7-9.json": [7, 8, 9]}


# -- CUDA memory snapshots, with torch.cuda.memory's functions replaced ------------------------


@pytest.fixture
def fake_cuda_memory(monkeypatch):
    """torch.cuda.memory's history functions, recording their calls; a dump writes a small file."""
    calls = []

    def record(*args, **kwargs):
        calls.append(("record", kwargs.get("enabled", "all"), kwargs))

    def dump(filename):
        # Written beside its place under a temporary name (forge_lm.safe_write), then renamed:
        # recorded as the file it becomes.
        partial = Path(filename)
        named = re.fullmatch(r"\.(.+)\.[0-9a-f]{8}\.partial", partial.name)
        assert named, f"the snapshot is not written beside its place: {filename}"
        calls.append(("dump", str(partial.with_name(named[1]))))
        partial.write_bytes(b"fake snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return calls


CUDA = torch.device("cuda")  # only a name here: nothing runs on it


def test_the_snapshot_is_written_after_its_step_and_recording_stops(tmp_path, fake_cuda_memory, capsys):
    with StepProfiler(ProfilingSection(memory_snapshot_step=3), tmp_path, 2, CUDA) as profiler:
        assert [c[:2] for c in fake_cuda_memory] == [("record", "all")]  # from the start
        for step in range(1, 7):
            profiler.step(step)

    path = tmp_path / "profiles" / "rank2" / "memory_snapshot_step3.pickle"
    assert [c[:2] for c in fake_cuda_memory] == [("record", "all"), ("dump", str(path)), ("record", None)]
    assert fake_cuda_memory[0][2]["max_entries"] == profiling.MEMORY_HISTORY_ENTRIES
    assert path.read_bytes() == b"fake snapshot"
    assert profiler.written == [path]
    assert capsys.readouterr().err == (
        f"forge: memory snapshot written to {path}; open it at https://pytorch.org/memory_viz\n"
    )


def fail_after(section: ProfilingSection, run_dir: Path, steps: int, error: Exception) -> None:
    """Steps 1..steps on "CUDA" (no work at all), then ``error``."""
    with StepProfiler(section, run_dir, 0, CUDA) as profiler:
        for step in range(1, steps + 1):
            profiler.step(step)
        raise error


def test_an_out_of_memory_error_before_the_snapshot_step_dumps_the_history(tmp_path, fake_cuda_memory, capsys):
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        fail_after(ProfilingSection(memory_snapshot_step=10), tmp_path, 1, oom)

    path = tmp_path / "profiles" / "rank0" / "memory_snapshot_oom.pickle"
    assert [c[:2] for c in fake_cuda_memory] == [("record", "all"), ("dump", str(path)), ("record", None)]
    assert path.is_file()
    assert f"forge: memory snapshot written to {path}" in capsys.readouterr().err


def test_other_errors_and_errors_after_the_snapshot_dump_nothing_more(tmp_path, fake_cuda_memory):
    with pytest.raises(ValueError, match="not memory"):
        fail_after(ProfilingSection(memory_snapshot_step=10), tmp_path, 0, ValueError("not memory"))
    with pytest.raises(torch.OutOfMemoryError, match="history is off"):
        fail_after(ProfilingSection(memory_snapshot_step=1), tmp_path, 1, torch.OutOfMemoryError("history is off"))

    dumps = [Path(c[1]).name for c in fake_cuda_memory if c[0] == "dump"]
    assert dumps == ["memory_snapshot_step1.pickle"]


def test_a_run_resumed_past_the_snapshot_step_stops_recording_without_a_snapshot(tmp_path, fake_cuda_memory):
    with StepProfiler(ProfilingSection(memory_snapshot_step=3), tmp_path, 0, CUDA) as profiler:
        profiler.step(8)
        profiler.step(9)

    assert [c[:2] for c in fake_cuda_memory] == [("record", "all"), ("record", None)]
    assert not (tmp_path / "profiles").exists()


def test_on_cpu_a_snapshot_step_is_warned_about_once_and_ignored(tmp_path, fake_cuda_memory, capsys):
    train(ProfilingSection(memory_snapshot_step=2), tmp_path, 4)

    err = capsys.readouterr().err
    assert err.count("forge: warning:") == 1
    assert "[profiling] memory_snapshot_step = 2 is ignored" in err
    assert "CUDA" in err
    assert fake_cuda_memory == []
    assert not (tmp_path / "profiles").exists()


# -- light defaults: what a user can leave on (issue 36) ---------------------------------------------


def test_the_default_window_writes_a_trace_and_the_summary_only_and_no_stacks(tmp_path):
    assert ProfilingSection().with_stack is False
    assert (ProfilingSection().record_shapes, ProfilingSection().profile_memory) == (False, False)

    train(ProfilingSection(enabled=True, start_step=2, active_steps=2), tmp_path, 4)

    folder = tmp_path / "profiles" / "rank0"
    assert sorted(p.name for p in folder.iterdir()) == ["ops_step2-3.json", "trace_step2-3.json"]
    events = json.loads((folder / "trace_step2-3.json").read_text())["traceEvents"]
    # No Python frames: with_stack's verbose recording adds one event per Python call.
    assert not [e for e in events if e.get("cat") == "python_function"]


def test_each_window_announces_the_size_of_what_it_wrote(tmp_path, capfd):
    train(section(start_step=2, active_steps=2, repeat=2, warmup_steps=0), tmp_path, 6)

    err = capfd.readouterr().err
    folder = tmp_path / "profiles" / "rank0"
    for steps in ("2-3", "4-5"):
        trace, ops = folder / f"trace_step{steps}.json", folder / f"ops_step{steps}.json"
        total = trace.stat().st_size + ops.stat().st_size
        # The sizes in decimal megabytes (kilobytes below 1 MB), written out here independently.
        words = [f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB" for n in (trace.stat().st_size, total)]
        assert f"profile of steps {steps} written to {trace} ({words[0]}; 2 files, {words[1]} on this rank)\n" in err


def test_a_finished_window_gives_its_recording_back_before_the_run_ends(tmp_path):
    kept = []
    real = StepProfiler._window_done

    def watch(self, prof):  # a weak reference to the recording torch hands over
        kept.append(weakref.ref(prof.profiler))
        real(self, prof)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepProfiler, "_window_done", watch)
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4)
        with StepProfiler(section(start_step=2, active_steps=2), tmp_path, 0, CPU) as profiler:
            for step in range(1, 7):
                model(torch.randn(8, 16)).sum().backward()
                profiler.step(step)
                if step == 4:  # the window (steps 2-3) ended at step 3; the profiler is still open
                    assert profiler._prof is not None
                    assert [ref() for ref in kept] == [None]


def test_no_kineto_line_reaches_the_console_and_the_run_s_own_lines_do(tmp_path, capfd):
    train(section(start_step=2, active_steps=2), tmp_path, 4)

    err = capfd.readouterr().err
    assert "USDT" not in err
    assert "profiler_start" not in err
    assert "forge: profile of steps 2-3 written to" in err


def test_only_kineto_lines_are_taken_from_what_is_written_around_the_profiler(capfd):
    with without_kineto_lines():
        os.write(2, b"USDT:2026-12-03 16:26:57 19741:19741 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning of another thread\n")
        os.write(2, b"STAGE:2026-12-03 16:27:24 19947:19947 SyncActivityProfilerHandler.cpp:51] Completed Stage\n")
        os.write(2, b"forge: a message\n")
        os.write(2, b"USDT in a line of its own making\n")

    assert capfd.readouterr().err == "a warning of another thread\nforge: a message\nUSDT in a line of its own making\n"
