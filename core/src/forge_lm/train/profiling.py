"""The ``[profiling]`` section at work: torch.profiler over a window of optimizer steps, and
CUDA allocator snapshots.

Which steps are recorded. Steps are optimizer steps, numbered from 1 as the loop counts them
(a resumed run keeps counting where it left off). With ``start_step`` s, ``warmup_steps`` W,
``active_steps`` A and ``repeat`` R, window k (k = 0, 1, ..., R - 1; without end when R is 0)
records steps ``s + k*(W + A)`` through ``s + k*(W + A) + A - 1``. The W steps just before each
window are profiled and thrown away (the profiler's warm-up: its start-up cost stays out of
the numbers), so windows follow each other back to back; before the first window only the
warm-up steps numbered 1 or more exist. The defaults (s=5, W=1, A=3, R=1) record steps 5, 6
and 7, after warming up on step 4. A run that ends inside a window saves the steps of it that
completed (the file name gives them). A resumed run records only the windows still ahead of
it, and never its own first step: the profiler learns a step's number when the step ends.

Each step is marked in the trace by a ``forge/step_N`` span, which runs from the end of step
N-1's optimizer update to the end of step N's: it holds step N's forward, backward and update,
and also whatever the loop did after step N-1 (logging, evaluation, a checkpoint). torch's
A window cut short by the end of the run ends with a span for the step that never ran: the
loop's work after the last step (or, when an error stopped the run, the failed step).
torch's own ``ProfilerStep#K`` spans count the steps since this process started profiling, so on a
fresh run ``ProfilerStep#K`` is step K+1.

What is written, per rank, under ``<run_dir>/profiles/rank<R>/``, for each window whose first
and last recorded steps are a and b:

* ``trace_step<a>-<b>.json``: the Chrome trace (open it in https://ui.perfetto.dev or
  chrome://tracing);
* ``ops_step<a>-<b>.json``: the operators of the window, as torch's ``key_averages`` gives them,
  sorted by self CPU time (what ``forge profile`` reads);
* ``stacks_step<a>-<b>.txt`` (and ``stacks_cuda_step<a>-<b>.txt`` on CUDA), with ``with_stack``:
  folded stacks, one ``frame;frame;frame value`` line per operator call, the value its self
  CPU (CUDA) time in microseconds: flamegraph.pl and speedscope read them.

Rank 0 says where the trace went and how large the window's files are. The defaults are light
(no stacks, shapes or memory profile: each is several times the trace, and slower to export).
Once a window is written its recording is freed (:func:`forge_lm.train.profiler_output.release_window`),
and libkineto's own console lines are filtered out around the profiler's calls
(:func:`~forge_lm.train.profiler_output.without_kineto_lines`).

``memory_snapshot_step`` (CUDA only) records the allocator's history from the start of the run
and writes ``memory_snapshot_step<N>.pickle`` after step N, or ``memory_snapshot_oom.pickle``
when the run dies of an out-of-memory error before then; it works whether or not ``enabled``.

Profiling never stops a run: an error while exporting or profiling is a warning, after which
training goes on (unprofiled when the profiler itself failed).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from forge_lm.config import ProfilingSection
from forge_lm.notices import warn
from forge_lm.run_links import make_dirs
from forge_lm.safe_write import replacing
from forge_lm.train.profiler_output import release_window, size_in_words, without_kineto_lines

PROFILES_DIR = "profiles"
SUMMARY_FORMAT = 1  # the version of the ops_step*.json layout, read back by `forge profile`
MAX_SUMMARY_OPS = 1000  # a bound on the summary's size; real models have a few hundred distinct ops
MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept (a ring buffer): the size PyTorch's docs suggest
MEMORY_VIZ = "https://pytorch.org/memory_viz"

_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
# Spans that wrap whole steps, left out of the operator summary: their "self time" is the
# Python around the operators, and per-step names would crowd out the operators themselves.
_STEP_SPANS = ("ProfilerStep", "forge/step_")


def rank_dir(run_dir: Path, rank: int) -> Path:
    """Where the profiles of ``rank`` go."""
    return Path(run_dir) / PROFILES_DIR / f"rank{rank}"


def window_schedule(section: ProfilingSection) -> tuple[Any, int]:
    """torch's schedule for the section's windows, and the shift to add to a step index.

    torch's schedule numbers the steps it sees from 0, so optimizer step n is index n - 1.
    The first window's warm-up starts at step ``start_step - warmup_steps``, which may be 1 or
    less: then the index is shifted up by the missing steps, as though they had been warmed
    up on, and only that first window's warm-up is shortened.
    """
    before = section.start_step - 1  # the steps there are before the first recorded one
    with warnings.catch_warnings():
        # torch warns when warmup is 0; here that is the user's explicit choice.
        warnings.filterwarnings("ignore", message=".*won't be using warmup.*")
        schedule = torch.profiler.schedule(
            wait=0,
            warmup=section.warmup_steps,
            active=section.active_steps,
            repeat=section.repeat,
            skip_first=max(0, before - section.warmup_steps),
        )
    return schedule, max(0, section.warmup_steps - before)


def recorded_steps(section: ProfilingSection, last_step: int, first_step: int = 1) -> list[int]:
    """The steps of ``first_step..last_step`` that the section's windows record (see the module doc)."""
    schedule, shift = window_schedule(section)
    return [n for n in range(first_step, last_step + 1) if schedule(n - 1 + shift) in _RECORDING]


def summarize(prof: Any, rank: int, steps: tuple[int, int], device: torch.device) -> dict[str, Any]:
    """The window's operators, as torch's ``key_averages`` aggregates them, by self CPU time.

    Python frames (recorded with ``with_stack``) and the step spans are left out: the summary
    is about operators. The order is torch's: a stable sort on self CPU time, largest first.
    """
    # key_averages' rows do not say whether they are Python frames; the raw events do.
    frames = {event.key for event in prof.events() if getattr(event, "is_python_function", False)}
    kept = [avg for avg in prof.key_averages() if avg.key not in frames and not avg.key.startswith(_STEP_SPANS)]
    rows = sorted(kept, key=lambda avg: avg.self_cpu_time_total, reverse=True)
    on_device = device.type == "cuda"
    ops = []
    device_total = 0.0
    for avg in rows:
        row = {
            "name": avg.key,
            "calls": int(avg.count),
            "self_cpu_us": float(avg.self_cpu_time_total),
            "cpu_total_us": float(avg.cpu_time_total),
        }
        if on_device:
            row["self_device_us"] = float(avg.self_device_time_total)
            # Kernels are rows of their own and their time also counts to the operator that
            # launched them: totals (as in torch's table) add up the kernels only.
            row["kernel"] = avg.device_type != torch.autograd.DeviceType.CPU
            if row["kernel"] and not getattr(avg, "is_user_annotation", False):
                device_total += row["self_device_us"]
        ops.append(row)
    summary: dict[str, Any] = {
        "format": SUMMARY_FORMAT,
        "rank": rank,
        "device": device.type,
        "steps": list(steps),
        "trace": trace_name(steps),
        "self_cpu_us_total": float(sum(row["self_cpu_us"] for row in ops)),
    }
    if on_device:
        summary["self_device_us_total"] = device_total
    summary["ops"] = ops[:MAX_SUMMARY_OPS]
    return summary


def trace_name(steps: tuple[int, int]) -> str:
    return f"trace_step{steps[0]}-{steps[1]}.json"


class StepProfiler:
    """Profiles the optimizer steps ``section`` names; the loop calls :meth:`step` after each one.

    Disabled (the default, and no memory snapshot), entering, stepping and leaving do nothing.
    """

    def __init__(self, section: ProfilingSection, run_dir: Path, rank: int, device: torch.device) -> None:
        self.section = section
        self.rank = rank
        self.device = torch.device(device)
        self.run_dir = Path(run_dir)
        self.out_dir = rank_dir(run_dir, rank)
        self.written: list[Path] = []  # every file this profiler wrote, in order (for tests and messages)
        self._prof: Any = None
        self._schedule, self._shift = window_schedule(section) if section.enabled else (None, 0)
        self._next = 1  # the optimizer step now running (assumed 1 until step() says otherwise)
        self._window: list[int] = []  # the completed steps recorded in the current window
        self._discard = False  # set while stopping a profiler whose recording is mislabelled
        self._marker: Any = None  # the open forge/step_N span
        self._history = False  # whether CUDA allocator history is being recorded

    # -- the loop's interface ------------------------------------------------------------------

    def __enter__(self) -> StepProfiler:
        if self.section.memory_snapshot_step > 0:
            self._start_history()
        if self.section.enabled:
            try:
                self._start_profiler()
            except Exception as exc:  # noqa: BLE001 - profiling is a diagnostic: it never stops the run
                self._give_up(exc)
        return self

    def step(self, step: int) -> None:
        """Step ``step`` (optimizer steps completed so far) is done."""
        if self._prof is not None:
            try:
                self._advance(step)
            except Exception as exc:  # noqa: BLE001 - as in __enter__
                self._give_up(exc)
        if self._history and step >= self.section.memory_snapshot_step:
            if step == self.section.memory_snapshot_step:  # a run resumed past it writes none
                self._dump_snapshot(f"memory_snapshot_step{step}.pickle")
            self._stop_history()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Returns None: whatever ended the run goes on up, unchanged.
        if self._prof is not None:
            try:
                self._close_marker()
                prof, self._prof = self._prof, None
                with without_kineto_lines():
                    prof.stop()  # saves the window in progress, with the steps of it that completed
            except Exception as error:  # noqa: BLE001 - never replaces the exception that ended the run
                warn(f"could not stop the profiler: {error}")
        if self._history:
            if exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError):
                # The history up to the failed allocation is what explains it: keep it first.
                self._dump_snapshot("memory_snapshot_oom.pickle")
            self._stop_history()

    # -- torch.profiler ----------------------------------------------------------------------

    def _start_profiler(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        experimental = None
        if self.section.with_stack:
            # Without verbose, the Kineto profiler keeps no Python stack on its events and
            # export_stacks writes an empty file.
            experimental = torch._C._profiler._ExperimentalConfig(verbose=True)
        self._prof = torch.profiler.profile(
            activities=activities,
            # The schedule is asked about the step that is about to run; it goes by the loop's
            # step number, not by torch's count, so a resumed run keeps the same windows.
            schedule=lambda _index: self._schedule(self._next - 1 + self._shift),
            on_trace_ready=self._window_done,
            record_shapes=self.section.record_shapes,
            profile_memory=self.section.profile_memory,
            with_stack=self.section.with_stack,
            experimental_config=experimental,
        )
        with without_kineto_lines():
            self._prof.start()
        self._open_marker()

    def _advance(self, step: int) -> None:
        self._close_marker()
        prof = self._prof
        if step != self._next:
            # The first step of a resumed run: what ran was step `step`, not the step the
            # schedule was asked about. Nothing recorded is fine; a recording is mislabelled,
            # so it is dropped and profiling starts again from the right step.
            self._next = step + 1
            if prof.current_action != ProfilerAction.NONE:
                self._discard = True
                try:
                    with without_kineto_lines():
                        prof.stop()
                finally:
                    self._discard = False
                    self._window = []
                self._start_profiler()
                return
        else:
            if prof.current_action in _RECORDING:
                self._window.append(step)
            self._next = step + 1
        with warnings.catch_warnings():
            # A new window starts a fresh recording, and torch says so once per process; a
            # window per trace is what is wanted here.
            warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle.*")
            with without_kineto_lines():
                prof.step()  # may end a window: then _window_done exports it
        self._open_marker()

    def _open_marker(self) -> None:
        # Only while the profiler collects: outside the windows a step costs nothing extra.
        if self._prof.current_action != ProfilerAction.NONE:
            self._marker = torch.profiler.record_function(f"forge/step_{self._next}")
            self._marker.__enter__()

    def _close_marker(self) -> None:
        if self._marker is not None:
            marker, self._marker = self._marker, None
            marker.__exit__(None, None, None)

    def _window_done(self, prof: Any) -> None:
        """torch's on_trace_ready: export the window that just ended."""
        steps, self._window = self._window, []
        try:
            if self._discard or not steps:  # a window cut short before any of its steps completed
                return
            first, last = steps[0], steps[-1]
            try:
                self._export(prof, (first, last))
            except Exception as exc:  # noqa: BLE001 - a full disk or a torch export bug: the run goes on
                warn(f"could not write the profile of steps {first}-{last} to {self.out_dir}: {exc}")
        finally:
            # The window's events are written (or given up): the memory they hold goes back now,
            # not when the next window or the end of the run replaces them.
            release_window(prof)

    def _make_out_dir(self) -> None:
        """``profiles/rank<R>/``, refusing (an error, warned about) a level that is a link."""
        make_dirs(self.run_dir, PROFILES_DIR, self.out_dir.name, fix="Remove the link.")

    def _export(self, prof: Any, steps: tuple[int, int]) -> None:
        self._make_out_dir()
        label = f"step{steps[0]}-{steps[1]}"
        before = len(self.written)
        trace = self.out_dir / trace_name(steps)
        _write_atomically(trace, prof.export_chrome_trace)
        self.written.append(trace)
        if self.section.with_stack:
            metrics = [("stacks", "self_cpu_time_total")]
            if self.device.type == "cuda":
                metrics.append(("stacks_cuda", "self_cuda_time_total"))
            for prefix, metric in metrics:
                path = self.out_dir / f"{prefix}_{label}.txt"
                _write_atomically(path, lambda tmp, metric=metric: prof.export_stacks(tmp, metric))
                self.written.append(path)
        summary = summarize(prof, self.rank, steps, self.device)
        path = self.out_dir / f"ops_{label}.json"
        _write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=1) + "\n"))
        self.written.append(path)
        if self.rank == 0:
            files = self.written[before:]
            trace_size, total = trace.stat().st_size, sum(path.stat().st_size for path in files)
            print(
                f"forge: profile of steps {steps[0]}-{steps[1]} written to {trace} ({size_in_words(trace_size)}; "
                f"{len(files)} files, {size_in_words(total)} on this rank)",
                file=sys.stderr,
                flush=True,
            )

    def _give_up(self, exc: Exception) -> None:
        warn(f"profiling stopped after an error ({type(exc).__name__}: {exc}); training goes on unprofiled")
        self._marker = None  # a half-open span is dropped with its profiler
        prof, self._prof = self._prof, None
        if prof is not None:
            self._discard = True
            try:
                with without_kineto_lines():
                    prof.stop()
            except Exception:  # noqa: BLE001 - already reported; the profiler is being abandoned
                pass
            finally:
                self._discard = False

    # -- CUDA allocator history ----------------------------------------------------------------

    def _start_history(self) -> None:
        if self.device.type != "cuda":
            if self.rank == 0:  # the same for every rank: said once
                warn(
                    f"[profiling] memory_snapshot_step = {self.section.memory_snapshot_step} is ignored: "
                    f"memory snapshots record the CUDA allocator, and this run is on {self.device.type}"
                )
            return
        try:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES, device=self.device)
            self._history = True
        except Exception as exc:  # noqa: BLE001 - no snapshot is better than no run
            warn(f"cannot record CUDA memory history, so no memory snapshot will be written: {exc}")

    def _dump_snapshot(self, name: str) -> None:
        path = self.out_dir / name
        try:
            self._make_out_dir()
            _write_atomically(path, torch.cuda.memory._dump_snapshot)  # a link planted there is replaced
        except Exception as exc:  # noqa: BLE001 - as for the traces
            warn(f"could not write the memory snapshot {path}: {exc}")
            return
        self.written.append(path)
        print(f"forge: memory snapshot written to {path}; open it at {MEMORY_VIZ}", file=sys.stderr, flush=True)

    def _stop_history(self) -> None:
        self._history = False
        try:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        except Exception as exc:  # noqa: BLE001 - as for the traces
            warn(f"could not stop recording CUDA memory history: {exc}")


def _write_atomically(path: Path, write: Any) -> None:
    """Have ``write(tmp_path)`` write beside ``path``, then move it in place
    (:func:`forge_lm.safe_write.replacing`): readers (``forge profile``, a crashed run's
    leftovers) never see half a file, and no link is written through: the temporary file has a
    fresh random name, and a link at ``path`` is replaced. Not flushed to the disk: a profile is
    a diagnosis, and large."""
    with replacing(path, durable=False, replace_link=True) as tmp:
        write(str(tmp))


__all__ = ["PROFILES_DIR", "StepProfiler", "rank_dir", "recorded_steps", "summarize", "window_schedule"]
