"""Where a run's checkpoints are kept: a local directory (:mod:`._local_store`), or an object
store (:mod:`._object_store`) when ``[checkpoint] dir`` is a URL.

A store holds one entry per step (``step_<N>``, each a directory of plain files) and small files
beside them (``latest``). Every store offers the same operations, used by finding, writing and
loading alike: ``names()``, ``location(name)`` and ``name_of(location)``, ``is_step_dir(name)``,
``check_step(name)`` (a plain directory of plain files where the store keeps checkpoints),
``files(name)`` and ``top`` (the files of a step, and of the store itself: ``kind``, ``size``,
``read``, ``write_text``, this last atomic), ``remove``, ``rename``, ``save`` and ``reader``
(DCP's, the reader taking its metadata from :func:`._safe.read_metadata`), ``bytes_of``,
``free_space``, and how a failed write is retried (``attempts``, ``retry_wait``), what fails
(``failures``) and what to do about it (``fix_for_failed_write``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forge_lm.checkpoint._layout import CHECKPOINTS, LATEST, STEP_DIR
from forge_lm.checkpoint._local_store import LocalStore


def open_store(run_dir: Path, location: str | None) -> Any:
    """The store of a run's checkpoints: ``location`` (an object-store URL) or ``<run_dir>/checkpoints``."""
    if not location:
        return LocalStore(run_dir / CHECKPOINTS)
    from forge_lm.checkpoint._object_store import ObjectStore  # here: fsspec is imported only for a URL

    return ObjectStore(location)


def check_location(location: str | None) -> None:
    """Before a run writes anything: an object-store ``[checkpoint] dir`` must be reachable with
    the environment's credentials and its bucket must exist (a ConfigError naming the setting and
    the fix otherwise, including a missing storage library). A local directory needs no check
    here: the run directory's own checks cover it."""
    if location:
        open_store(Path("."), location).check_reachable()


def holds_checkpoints(location: str) -> bool:
    """Whether the object store at ``location`` holds a checkpoint, a save of one or ``latest``
    (what makes a run directory's own ``checkpoints/`` count as checkpointed)."""
    return any(name == LATEST or STEP_DIR.fullmatch(name) for name in open_store(Path("."), location).names())
