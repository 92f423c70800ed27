"""The hang watchdog: a rank that completes no optimizer step for too long writes where it is
stuck and exits, instead of waiting silently until the job's time limit.

A distributed run hangs when one rank never reaches a collective the others wait in (a stuck
file system, a dead data worker, a deadlocked plugin, a GPU gone bad): the process group's
timeout may be long, and NCCL can wait forever. :class:`HangWatchdog` runs a daemon thread per
rank; the training loop calls :meth:`HangWatchdog.beat` after each optimizer step. When no beat
comes for ``resilience.hang_timeout`` seconds, the thread writes the Python stacks of every
thread of its process to ``<run>/hang/rank<R>.txt``, records a ``hang`` event, prints one line
and ends the process with :data:`HANG_EXIT_CODE` (77). Each rank keeps its own clock, so every
rank of a hung run stops and leaves its stacks: the stuck rank shows where it is stuck, the
others show the collective they wait in. A job script requeues on 77 like on 75/76 (see
examples/slurm/multi_node.sbatch): the run resumes from its newest checkpoint.

The watchdog covers the whole run, not only its steps: from the run directory's opening
(resuming, the metrics backends' ``start``, the plugins' ``train_start``) to the process group's
end (``train_end``, the backends' ``finish``, the last checkpoint's write, the teardown). The
loop says what the run is doing with :meth:`HangWatchdog.doing`, and a hang outside the steps
names it. After the run, :func:`wait_for_threads` gives the threads a plugin left running a
bounded time to end, and :class:`ThreadFailures` turns an exception in any thread of the run
into one line instead of a traceback.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from forge_lm import events
from forge_lm.run_links import make_dirs, open_to_write

HANG_EXIT_CODE = 77
HANG_DIR = "hang"  # <run>/hang/rank<R>.txt

# Writing the stacks or the event may itself hang: a hung file system is a common reason for a
# hang. Each is given this long before the watchdog goes on without it and still exits.
_WRITE_SECONDS = 30.0
# The watchdog looks at the clock at least this often, and a look this much later than it asked
# for means the process was stopped (SIGSTOP and SIGCONT): not counted as time without progress.
_NAP_SECONDS = 1.0
_STOPPED_SECONDS = 1.0


class HangWatchdog:
    """Exits the process with 77 when :meth:`beat` is not called for ``timeout`` seconds,
    counted from ``__enter__`` and then from the last beat; ``timeout`` 0 turns it off."""

    def __init__(self, timeout: float, run_dir: Path, rank: int) -> None:
        self.timeout = float(timeout)
        self.run_dir = Path(run_dir)
        self.rank = rank
        self._last_beat = time.monotonic()
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # __exit__ and the decision to fire exclude each other
        self._thread: threading.Thread | None = None
        self._activity: str | None = None  # None: training steps, evaluations and saves

    @property
    def stacks_path(self) -> Path:
        return self.run_dir / HANG_DIR / f"rank{self.rank}.txt"

    def start(self) -> HangWatchdog:
        return self.__enter__()

    def stop(self) -> None:
        self.__exit__()

    def doing(self, activity: str | None) -> None:
        """The run moved on to ``activity`` (None: training steps, evaluations and saves): the
        clock starts again, and a hang from now on is reported as ``activity`` not finishing."""
        self._activity = activity
        self._last_beat = time.monotonic()

    def __enter__(self) -> HangWatchdog:
        if self.timeout > 0:
            self._last_beat = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="forge-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self) -> None:
        """An optimizer step completed: the clock starts again. Called every step, so it does
        no more than store a float (an atomic assignment: no lock, no wake-up of the thread)."""
        self._last_beat = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._stopped.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            # Returns at once, unless the watchdog had already begun to fire: then the hang was
            # real and the process ends in a moment with 77; the run's own ending must not race
            # that exit, so this waits for it.
            thread.join()

    def _watch(self) -> None:
        # The thread sleeps towards the deadline the last beat set, in naps of at most
        # _NAP_SECONDS, and looks again: a beat in between moved the deadline. A nap that took
        # far longer than asked means the whole process was stopped (SIGSTOP, a suspended
        # machine): that time was no one's hang, and the deadline moves past it.
        paused, beat = 0.0, self._last_beat  # seconds the process was stopped since beat
        woke = 0.0  # when the process was last found to have been stopped
        while True:
            if self._last_beat != beat:  # a beat since: the clock starts from it
                beat = self._last_beat
                if beat > woke:  # a beat before the stop (noticed only now) keeps the stopped time out
                    paused = 0.0
            before = time.monotonic()
            remaining = self._last_beat + paused + self.timeout - before
            if remaining <= 0:
                break
            nap = min(remaining, _NAP_SECONDS)
            if self._stopped.wait(nap):
                return
            overslept = time.monotonic() - before - nap
            if overslept > _STOPPED_SECONDS:
                paused, woke = paused + overslept, time.monotonic()
        with self._lock:
            if self._stopped.is_set():  # __exit__ came first: the run ended, no hang
                return
        self._fire()

    @property
    def _stuck(self) -> str:
        """What did not happen in time, for the message and the stacks' header."""
        return "no optimizer step completed" if self._activity is None else f"{self._activity} did not finish"

    def _fire(self) -> None:
        try:
            where = str(self.stacks_path)
            failure = _bounded(self._write_stacks)
            if failure is not None:
                where = "stderr"
                _write_header_and_stacks(
                    _stderr(),
                    self.rank,
                    self._stuck,
                    self.timeout,
                    f"{self.stacks_path} could not be written: {failure}",
                )
            _bounded(lambda: events.record("hang", stacks=where, seconds=self.timeout))
            print(
                f"forge: error: {self._stuck} in {self.timeout:g} s (resilience.hang_timeout); wrote "
                f"the Python stacks of rank {self.rank} to {where}; exiting with {HANG_EXIT_CODE}. Compare the "
                f"stacks of every rank in {self.run_dir / HANG_DIR}: a rank stuck outside the collective that the "
                "others wait in is the cause. Run the same command to resume from the newest checkpoint; raise "
                "resilience.hang_timeout if a step, evaluation or checkpoint legitimately takes longer (0 turns "
                "the watchdog off).",
                file=_stderr(),
                flush=True,
            )
        finally:  # whatever failed above, the process must not stay hung
            os._exit(HANG_EXIT_CODE)

    def _write_stacks(self) -> None:
        # Never through a link (a hang/ or rank<R>.txt planted in the run): that fails, and the stacks go to stderr.
        make_dirs(self.run_dir, HANG_DIR, fix="Remove the link.")
        with os.fdopen(open_to_write(self.stacks_path), "w") as file:
            _write_header_and_stacks(file, self.rank, self._stuck, self.timeout)


def _write_header_and_stacks(file: TextIO, rank: int, stuck: str, timeout: float, note: str = "") -> None:
    """Who and when, the names of the threads (faulthandler shows only their ids), then the
    Python stack of every thread of this process."""
    names = ", ".join(f"0x{thread.ident or 0:016x} {thread.name}" for thread in threading.enumerate())
    file.write(
        f"forge hang watchdog: rank {rank}, pid {os.getpid()}, host {socket.gethostname()}: {stuck} "
        f"in {timeout:g} s; {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n"
        + (f"({note})\n" if note else "")
        + f"threads: {names}\n\n"
    )
    file.flush()
    faulthandler.dump_traceback(file, all_threads=True)  # writes to the descriptor itself
    file.flush()


def _bounded(action: Callable[[], None], seconds: float = _WRITE_SECONDS) -> str | None:
    """Run ``action`` in its own daemon thread for at most ``seconds``: None when it finished,
    else why not (its exception, or the time it was given)."""
    outcome: list[str | None] = []

    def run() -> None:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - e.g. an unwritable run directory: the caller falls back
            outcome.append(f"{type(exc).__name__}: {exc}")
        else:
            outcome.append(None)

    worker = threading.Thread(target=run, name="forge-hang-watchdog-write", daemon=True)
    worker.start()
    worker.join(seconds)
    return outcome[0] if outcome else f"not done within {seconds:g} s"


def _stderr() -> TextIO:
    """The process's real standard error: faulthandler needs a file descriptor, which a
    replaced ``sys.stderr`` (a test's capture) may not have."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__
    return sys.stderr


def wait_for_threads(before: set[threading.Thread], seconds: float) -> list[threading.Thread]:
    """Give the non-daemon threads started since ``before`` (a plugin's, left running after the
    run) up to ``seconds`` in all to end; the ones still running, each named on stderr with
    where it is. Python would wait for them forever at exit; the caller ends the process instead."""
    deadline = time.monotonic() + seconds
    waiting = [t for t in threading.enumerate() if t not in before and not t.daemon and t.is_alive()]
    for thread in waiting:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [thread for thread in waiting if thread.is_alive()]
    frames = sys._current_frames()
    for thread in left:
        frame = frames.get(thread.ident or 0)
        where = f" in {frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})" if frame else ""
        print(
            f"forge: warning: thread '{thread.name}'{where} is not a daemon and still runs {seconds:g} s after the "
            "run ended; ending the process without it. A plugin's thread must be a daemon or end with the run "
            "(in train_end).",
            file=_stderr(),
            flush=True,
        )
    return left


class ThreadFailures:
    """While entered, an exception that ends a thread other than the main one (a plugin's
    background thread) is one ``forge: error:`` line naming the thread and where it raised,
    instead of a raw traceback; :attr:`failures` holds those lines, so that the run does not
    end as if all went well."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self._previous = threading.excepthook

    def __enter__(self) -> ThreadFailures:
        self._previous = threading.excepthook
        threading.excepthook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        threading.excepthook = self._previous

    def _hook(self, args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        tb, where = args.exc_traceback, ""
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None:
            code = tb.tb_frame.f_code
            where = f" in {code.co_name} ({code.co_filename}:{tb.tb_lineno})"
        name = args.thread.name if args.thread is not None else "?"
        line = f"thread '{name}' raised {args.exc_type.__name__}: {args.exc_value}{where}"
        self.failures.append(line)
        print(f"forge: error: {line}", file=_stderr(), flush=True)
