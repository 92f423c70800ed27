"""A metrics backend that fails is turned off, never fatal to training.

Metrics backends are plugins' code writing to disks and services that fail (a full disk, a
path that is a directory, a tracker that went away). The training loop uses every backend
through a :class:`GuardedBackend`: the first exception from ``start``, ``log`` or
``finish`` is reported in one warning naming the backend and the error, the backend is off
for the rest of the run, and training and the other backends go on. A checkpoint does not
depend on metrics, so nothing is lost that a resume could not give back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from forge_lm.notices import warn
from forge_lm.plugins._calls import describe


class GuardedBackend:
    """``backend`` (a :class:`forge_lm.components.MetricsBackend`), shielded.

    ``label`` names it in the warning: ``metrics backend 'jsonl' (forge-lm 0.1.0)``.
    ``KeyboardInterrupt`` passes through; anything else a backend raises, ``SystemExit``
    included, turns it off. A backend turned off by a failure in ``start`` or ``log`` still
    gets its ``finish`` call (to close what it opened), whose errors are then not reported
    again.
    """

    def __init__(self, backend: Any, label: str) -> None:
        self.backend = backend
        self.label = label
        self.started = False
        self.failed = False

    def start(self, config: Mapping[str, Any], manifest: Sequence[Mapping[str, str]]) -> None:
        self.started = True
        self._shielded("start", lambda: self.backend.start(config, manifest))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.started and not self.failed:
            self._shielded(f"log (step {step})", lambda: self.backend.log(step, dict(metrics)))

    def finish(self, summary: Mapping[str, float]) -> None:
        if not self.started:
            return  # never started: nothing to close
        self.started = False  # finish once
        if self.failed:
            with contextlib.suppress(Exception):  # already reported and off: this is only a clean-up
                self.backend.finish(dict(summary))
            return
        self._shielded("finish", lambda: self.backend.finish(dict(summary)))

    def _shielded(self, what: str, call: Callable[[], object]) -> None:
        try:
            call()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a backend's failure, whatever it is, must not stop training
            self.failed = True
            then = (
                "what it logged before may be incomplete"
                if what == "finish"
                else "it is off for the rest of this run; training and the other metrics backends go on"
            )
            message = f"{self.label} failed in {what}: {describe(exc)}; {then}"
            warn(message)
