"""Preemption signals and non-finite steps: the run stops cleanly or carries on, never silently.

Exit codes of ``forge train`` (documented in the README):

- 75: stopped by SIGTERM or SIGUSR1 (SLURM preemption) after saving a checkpoint; requeue the
  job and run the same command to resume.
- 76: stopped by SIGTERM or SIGUSR1, but the checkpoint did not finish within
  ``resilience.signal_timeout`` seconds; the previous checkpoint is intact.
- 3: stopped by the non-finite-loss policy.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

from forge_lm.distributed.reduce import any_rank
from forge_lm.errors import ForgeError

PREEMPTED_EXIT_CODE = 75
FORCED_EXIT_CODE = 76
NONFINITE_EXIT_CODE = 3
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):  # an event the CLI turns into an exit code, not an error
    """Raised after the checkpoint that a preemption signal asked for is written."""

    def __init__(self, signal_name: str, step: int) -> None:
        super().__init__(f"{signal_name} at step {step}")
        self.signal_name, self.step = signal_name, step


class NonFiniteLoss(ForgeError):
    """The loss or gradients stayed non-finite beyond what the policy allows."""


class PreemptionWatcher:
    """Notes SIGTERM/SIGUSR1 so that the loop can finish its step and checkpoint; from the
    signal on, a timer forces the exit after ``timeout`` seconds in case the save hangs."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> PreemptionWatcher:
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
            self._timer = threading.Timer(self.timeout, _force_exit, args=(signal.Signals(signum).name, self.timeout))
            self._timer.daemon = True
            self._timer.start()

    def requested(self) -> bool:
        """Whether any rank received a preemption signal (agreed across ranks)."""
        return agree(self.received is not None)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""


def _force_exit(name: str, timeout: float) -> None:
    print(
        f"forge: {name} received, but the checkpoint did not finish within {timeout:g} s; exiting now. "
        "The previous checkpoint is intact.",
        file=sys.stderr,
        flush=True,
    )
    os._exit(FORCED_EXIT_CODE)


def agree(flag: bool) -> bool:
    """``flag`` on any rank makes it true on every rank (no-op in a single process)."""
    return any_rank(flag)
