"""Metrics as JSON lines in the run directory.

The file is opened for appending and flushed after every line, so a resumed run adds to
what the interrupted one wrote and a crash loses at most the line being written. A link at its
place is not followed (the backend fails to start instead): it would append outside the run.

Every line is strict JSON. A metric that is NaN or infinite (an undefined evaluator metric, a
plugin's) is written as ``null``, with why under the record's ``nonfinite`` key::

    {"step": 7, "loss": 2.5, "eval/acc": null, "nonfinite": {"eval/acc": "nan"}}

(``"nan"``, ``"inf"`` or ``"-inf"``, as ``events.jsonl`` spells them). :func:`read_metrics`
gives the number back (``float("nan")``) and drops the ``nonfinite`` key; it also reads what
runs before this form wrote: the bare ``NaN``/``Infinity`` of Python's json module.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from forge_lm.components import MetricsContext


class JsonlBackend:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = None

    def start(self, config: Mapping[str, Any], manifest: Sequence[Mapping[str, str]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW  # a link there: ELOOP, never followed
        self._file = os.fdopen(os.open(self.path, flags, 0o644), "a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._file.write(json.dumps(strict_record(step, metrics), allow_nan=False) + "\n")
        self._file.flush()

    def finish(self, summary: Mapping[str, float]) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


NONFINITE_KEY = "nonfinite"
"""The key of a record that says which of its metrics are ``null`` because they were not finite."""

_SPELLINGS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def strict_record(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The line written for ``metrics`` at ``step``: each non-finite number as ``null``, spelt
    under ``nonfinite`` (nothing there when every number is finite)."""
    record: dict[str, Any] = {"step": step}
    nonfinite: dict[str, str] = {}
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            record[key], nonfinite[key] = None, str(value)  # str(): 'nan', 'inf', '-inf'
        else:
            record[key] = value
    if nonfinite:
        record[NONFINITE_KEY] = nonfinite
    return record


def _with_numbers_restored(record: Any) -> Any:
    """A record read back with the numbers its ``nonfinite`` map spells; one without that map
    (an older run's, whose ``NaN`` json read itself) as it is."""
    if not isinstance(record, dict):
        return record
    spelt = record.get(NONFINITE_KEY)
    if not isinstance(spelt, dict):
        return record
    restored = {key: value for key, value in record.items() if key != NONFINITE_KEY}
    for key, spelling in spelt.items():
        if key in restored and restored[key] is None and spelling in _SPELLINGS:
            restored[key] = _SPELLINGS[spelling]
    return restored


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file, in order.

    A last line that is cut short (no newline, not JSON) is what a crash in the middle of a
    write leaves, and is skipped. A metric written as ``null`` because it was not finite is
    given back as the number (NaN, inf); older files' bare ``NaN`` reads the same. Any other
    line that is not JSON, or is nested too deeply for the JSON reader (a hostile file), raises
    ValueError naming it.
    """
    records = []
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                records.append(_with_numbers_restored(json.loads(line)))
            except (json.JSONDecodeError, RecursionError) as exc:
                if not line.endswith("\n"):
                    break  # the line being written when the run stopped: nothing follows it
                if isinstance(exc, RecursionError):  # valid or not, too deep for the reader: a hostile line
                    raise ValueError(f"{path}: line {number} is nested too deeply to be read as JSON") from None
                raise ValueError(f"{path}: line {number} is not valid JSON: {exc.msg}") from None
    return records


def last_logged(path: str | Path, key: str) -> tuple[int, float] | None:
    """The step and value of the last record of a metrics file that holds ``key``; None if
    there is none, or the file is missing or unreadable."""
    try:
        records = read_metrics(path)
    except (OSError, ValueError):
        return None
    for record in reversed(records):
        value = record.get(key)
        if isinstance(value, int | float) and isinstance(record.get("step"), int):
            return record["step"], float(value)
    return None


def build_jsonl(options, context: MetricsContext) -> JsonlBackend:
    return JsonlBackend(Path(context.run_dir) / options.filename)
