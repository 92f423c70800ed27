"""The run's structured event log: ``<run>/events.jsonl``, one JSON object per line.

Every line has ``time`` (Unix seconds), ``rank``, ``step`` (optimizer steps completed when it
happened) and ``type``; the other keys depend on the type. The core's types are listed in
:data:`EVENT_TYPES` (and in the README); a plugin records its own with :func:`record`, under a
type named ``<plugin>/<what>`` (``forge-moe/expert_load``), so it can never be mistaken for
one of the core's.

The core's events are rank 0's (what happened to the run: the other ranks' calls are
dropped), except a hang and an error, which each rank records for itself; a plugin's events
are recorded on whichever rank records them. Each line goes out in one ``write`` on a file opened
for appending, so lines from several ranks do not interleave. Recording never stops a run: a
value JSON cannot hold is written as its ``repr``, and a log that cannot be written is
reported once and then left alone. Values are made plain by
:func:`forge_lm.plain_data.to_plain`: non-finite numbers as strings (``"nan"``), anything nested
deeper than :data:`forge_lm.plain_data.MAX_DEPTH` levels (a value holding itself) as a marker.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from forge_lm.notices import warn
from forge_lm.plain_data import to_plain

EVENTS_FILE = "events.jsonl"

# type -> what it records (the README's table is checked against this).
EVENT_TYPES: dict[str, str] = {
    "start": "a start of the run: plugins (name and version), config_hash, world_size, resuming",
    "resume": "a checkpoint was restored: from_step, checkpoint",
    "init_from": "a run started from grown init_from weights: source, tensors (name, how, source, shape, note)",
    "checkpoint_saved": "a checkpoint was written: checkpoint, seconds, bytes",
    "checkpoint_skipped": "a checkpoint was passed over when loading: checkpoint, reason",
    "checkpoint_failed": "a checkpoint save failed: reason, and action (what the run does about it)",
    "nonfinite_step": "a NaN/Inf loss or gradient: loss, grad_norm, action (skip, rollback, stop)",
    "loss_spike": (
        "a step judged a loss spike ([resilience] spike_policy): at_step, metric, value, mean, std, threshold, "
        "spikes_in_a_row, action (skip, rollback, stop), skipped_batches (skip)"
    ),
    "rollback": "the run went back to its newest checkpoint: to_step, skipped_batches (first and last loader batch)",
    "batch_size": "a batch ramp changed the global batch: batch_size (sequences), micro_batches (per rank), lr_factor",
    "overflow": "fp16: gradients overflowed at this loss scale; the step is skipped: loss, grad_norm, scale, new_scale",
    "preemption": "a preemption signal was acted on: signal",
    "evaluation": "an evaluation finished: its metrics",
    "hang": "no optimizer step within resilience.hang_timeout: stacks (the file written), seconds",
    "error": "the run stopped on an error: exit_code, error",
    "end": "the run ended: status, exit_code",
}

_EVERY_RANK = {"hang", "error"}
_PLUGIN_TYPE = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+")


class EventLog:
    """Appends events to ``path`` for one rank; ``step`` is kept current by the training loop."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.rank, self.step = path, rank, 0
        self._broken = False

    def record(self, type: str, **fields: Any) -> None:
        if self._broken or (self.rank != 0 and type in EVENT_TYPES and type not in _EVERY_RANK):
            return
        line = {"time": round(time.time(), 3), "rank": self.rank, "step": self.step, "type": type}
        line.update((str(key), to_plain(value)) for key, value in fields.items() if key not in line)
        data = (json.dumps(line, allow_nan=False) + "\n").encode()
        try:
            # O_NOFOLLOW: a link at events.jsonl fails (ELOOP, reported below) instead of being appended through.
            descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                os.write(descriptor, data)
            finally:
                os.close(descriptor)
        except OSError as exc:
            self._broken = True
            warn(f"cannot write the event log {self.path} ({exc}); events are not recorded")


_current: EventLog | None = None


def open_log(run_dir: Path, rank: int) -> EventLog:
    """Make ``<run_dir>/events.jsonl`` the log that :func:`record` writes to in this process."""
    global _current
    _current = EventLog(Path(run_dir) / EVENTS_FILE, rank)
    return _current


def close_log() -> None:
    global _current
    _current = None


def current() -> EventLog | None:
    return _current


def set_step(step: int) -> None:
    if _current is not None:
        _current.step = step


def record(type: str, **fields: Any) -> None:
    """Record an event in the running training's log (nothing outside a run).

    ``type`` is one of :data:`EVENT_TYPES`, or ``<plugin>/<what>`` for a plugin's own events;
    ``fields`` are JSON values (anything else is written as its ``repr``; see
    :func:`forge_lm.plain_data.to_plain`)."""
    if not isinstance(type, str) or not (type in EVENT_TYPES or _PLUGIN_TYPE.fullmatch(type)):
        raise ValueError(
            f"event type {type!r} is neither one of Forge's ({', '.join(EVENT_TYPES)}) nor a plugin's own "
            "'<plugin>/<what>'"
        )
    if _current is not None:
        _current.record(type, **fields)


def exit_code_of(error: BaseException | None) -> int:
    """The exit code ``forge train`` ends with for ``error`` (None: a run that completed)."""
    if error is None:
        return 0
    if isinstance(error, KeyboardInterrupt):
        return 130
    code = getattr(error, "exit_code", None)  # ForgeError and the stops a job script acts on
    return code if isinstance(code, int) else 1
