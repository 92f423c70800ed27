"""Preemption signals and non-finite steps: the run stops cleanly or carries on, never silently.

Exit codes of ``forge train`` (documented in the README):

- 75: stopped by SIGTERM or SIGUSR1 (SLURM preemption) after saving a checkpoint; requeue the
  job and run the same command to resume.
- 76: stopped by SIGTERM or SIGUSR1, but the checkpoint did not finish within
  ``resilience.signal_timeout`` seconds; the previous checkpoint is intact.
- 3: stopped by the non-finite-loss policy.

A preemption signal during start-up (plugins loading, the model, data and run directory being
prepared, a checkpoint being restored: before the loop's :class:`PreemptionWatcher` is
installed) also ends in 75, with nothing to save: ``forge train`` notes it from its start
(:class:`StartupSignals`), and the next safe point (:func:`check_startup`: before the run
directory is prepared and as the loop begins) raises :class:`PreemptedAtStartup`; a run
directory that this start created is removed again (:mod:`forge_lm.train.run_dir`). Should no
safe point come within ``resilience.signal_timeout`` seconds, the process exits 75 anyway.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from forge_lm import events
from forge_lm.distributed.reduce import any_rank
from forge_lm.errors import ForgeError

PREEMPTED_EXIT_CODE = 75
FORCED_EXIT_CODE = 76
NONFINITE_EXIT_CODE = 3
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):  # an event the CLI turns into an exit code, not an error
    """Raised after the checkpoint that a preemption signal asked for is written."""

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, signal_name: str, step: int) -> None:
        super().__init__(f"{signal_name} at step {step}")
        self.signal_name, self.step = signal_name, step


class PreemptedAtStartup(Preempted):
    """A preemption signal came before the first step: nothing to save, nothing kept."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name, 0)


class NonFiniteLoss(ForgeError):
    """The loss or gradients stayed non-finite beyond what the policy allows."""

    exit_code = NONFINITE_EXIT_CODE


class _SignalNote:
    """Notes the first SIGTERM/SIGUSR1 while installed (in the main thread, where signals
    arrive) and from it on runs ``on_timeout(signal name, timeout)`` after ``timeout``
    seconds, in case the point where the code acts on it never comes."""

    def __init__(self, timeout: float, on_timeout: Callable[[str, float], None]) -> None:
        self.timeout = timeout
        self.received: int | None = None
        self._on_timeout = on_timeout
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> _SignalNote:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            self._timer = threading.Timer(self.timeout, self._on_timeout, args=(self.signal_name, self.timeout))
            self._timer.daemon = True
            self._timer.start()

    @property
    def signal_name(self) -> str:
        """The signal this process received; a rank that learnt of it from another says so."""
        return (
            signal.Signals(self.received).name
            if self.received is not None
            else "SIGTERM or SIGUSR1 (sent to another rank)"
        )


class PreemptionWatcher(_SignalNote):
    """Notes SIGTERM/SIGUSR1 so that the loop can finish its step and checkpoint (the ranks
    agree on it with the step's loss: :func:`forge_lm.distributed.reduce.agree_on_step`); from
    the signal on, a timer forces the exit (76) after ``timeout`` seconds in case the save hangs."""

    def __init__(self, timeout: float) -> None:
        super().__init__(timeout, _force_exit)


class StartupSignals(_SignalNote):
    """Notes SIGTERM/SIGUSR1 from the start of ``forge train`` until the loop's watcher takes
    over; :func:`check_startup` turns a noted signal into :class:`PreemptedAtStartup`.

    ``earlier``: the signals noted before this was installed (by the command line's first,
    light handler, which spares a mistyped command the import of torch). From the signal on,
    a timer exits 75 after ``timeout`` seconds in case no safe point comes (a long checkpoint
    restore, a hung rendezvous)."""

    def __init__(self, timeout: float, earlier: Sequence[int] = ()) -> None:
        super().__init__(timeout, _force_exit_at_startup)
        self._earlier = earlier

    def __enter__(self) -> StartupSignals:
        global _startup
        super().__enter__()
        if self._earlier:  # read after installing: a signal cannot fall between the two handlers
            self._handle(self._earlier[0], None)
        _startup = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _startup
        _startup = None
        super().__exit__(*exc)


_startup: StartupSignals | None = None  # installed by ``forge train`` for its whole run


def check_startup() -> None:
    """A safe point of the start-up: stop with :class:`PreemptedAtStartup` if a preemption
    signal came (to any rank: under torchrun every rank calls this at the same point)."""
    received = _startup.received if _startup is not None else None
    if agree(received is not None):
        raise PreemptedAtStartup(signal.Signals(received).name if received is not None else "a signal on another rank")


def _force_exit_at_startup(name: str, timeout: float) -> None:
    print(
        f"forge: {name} received during start-up, and start-up did not reach a point to stop within {timeout:g} s; "
        "exiting now. No step was trained: run the same command to start again.",
        file=sys.stderr,
        flush=True,
    )
    os._exit(PREEMPTED_EXIT_CODE)


def _force_exit(name: str, timeout: float) -> None:
    print(
        f"forge: {name} received, but the checkpoint did not finish within {timeout:g} s; exiting now. "
        "The previous checkpoint is intact.",
        file=sys.stderr,
        flush=True,
    )
    events.record("end", status="interrupted", exit_code=FORCED_EXIT_CODE)  # the save never finished
    os._exit(FORCED_EXIT_CODE)


def agree(flag: bool) -> bool:
    """``flag`` on any rank makes it true on every rank (no-op in a single process)."""
    return any_rank(flag)
