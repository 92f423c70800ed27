"""Where a run's checkpoints are kept: a local directory (:mod:`._local_store`).

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

from forge_lm.checkpoint._layout import CHECKPOINTS
from forge_lm.checkpoint._local_store import LocalStore


def open_store(run_dir: Path, location: str | None) -> Any:
    """The store of a run's checkpoints: ``location`` (an object-store URL) or ``<run_dir>/checkpoints``."""
    return LocalStore(run_dir / CHECKPOINTS)
