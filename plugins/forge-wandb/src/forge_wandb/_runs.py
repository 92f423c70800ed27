"""The W&B run of each run directory in this process: how the plugin hooks and the backend meet.

The hooks and the backend never hold each other: the core calls ``forge_lm_load_state``
with the checkpoint's state before any backend's ``start()``, and ``forge_lm_save_state``
at each checkpoint. So the run id goes through this small table, keyed by run directory:

- ``forge_lm_load_state`` restores the id of the checkpoint (:func:`restore`);
- the backend's ``start()`` resumes that id, or starts a new W&B run, and records the id of
  the run it got (:func:`started`);
- ``forge_lm_save_state`` stores the id in each checkpoint (:func:`run_id`); when W&B could
  not start, the restored id is stored again, so a later resume still finds the W&B run;
- ``forge_lm_train_end`` notes the run's status (:func:`ended`), which the backend's
  ``finish()`` reports to W&B and then forgets the entry (:func:`finished`).

Nothing here imports wandb.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_run_ids: dict[str, str] = {}
_statuses: dict[str, str] = {}
_live: set[str] = set()  # run directories whose backend has started and not finished


def _key(run_dir: Any) -> str:
    return str(Path(run_dir).resolve())


def restore(run_dir: Any, run_id: str) -> None:
    """The checkpoint of ``run_dir`` holds ``run_id``: the backend's start() resumes it."""
    _run_ids[_key(run_dir)] = run_id


def run_id(run_dir: Any) -> str | None:
    """The W&B run id of ``run_dir``: the one logged to, else the one restored, else None."""
    return _run_ids.get(_key(run_dir))


def started(run_dir: Any, run_id: str | None) -> None:
    """The backend of ``run_dir`` started; ``run_id`` is its W&B run's id (None: no real run)."""
    key = _key(run_dir)
    _live.add(key)
    _statuses.pop(key, None)
    if run_id is not None:
        _run_ids[key] = run_id


def ended(run_dir: Any, status: str) -> None:
    """The training of ``run_dir`` ended with ``status``; kept for the backend's finish()."""
    key = _key(run_dir)
    if key in _live:
        _statuses[key] = status
    else:  # no backend will finish: forget the restored id, so nothing leaks into a later run
        _run_ids.pop(key, None)


def finished(run_dir: Any) -> str | None:
    """The backend of ``run_dir`` finished: forget its entry; return the status ``ended`` noted."""
    key = _key(run_dir)
    _live.discard(key)
    _run_ids.pop(key, None)
    return _statuses.pop(key, None)
