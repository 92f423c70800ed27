"""No links inside a run directory: what Forge reads and writes there is never followed out of it.

Run directories come from anyone (a copied run, a shared file system), and a link among a run's
files would make Forge work outside the run: a ``.lock`` or ``metrics.jsonl`` linked to another
file gets that file overwritten or appended to, and a ``checkpoints`` linked to another run's
resumes from that run and then prunes its checkpoints. So the run's own entries that are links
are refused, naming the link and the fix (:func:`refuse_links`, exit 2, before anything is
written), files are written whole without following a link (:func:`write_text`, by the rule
of :mod:`forge_lm.safe_write`) or opened with ``O_NOFOLLOW`` (:func:`open_to_write`), and the
folders Forge creates in the run (``eval/``, ``hang/``, ``profiles/``) are created level by level, refusing
one that is a link (:func:`make_dirs`). The run directory itself may be a link
(``runs -> /scratch/runs``): only what is inside it is checked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from forge_lm.errors import ForgeError
from forge_lm.safe_write import write_atomically

NOT_IN_A_RUN = "Forge does not follow links inside a run directory, so that it never reads or writes outside the run"


class LinkInRunDir(ForgeError):
    """An entry of a run directory that Forge reads or writes is a symbolic link."""


def link_error(path: Path, fix: str) -> LinkInRunDir:
    """The error for ``path``, a link: where it points, why it is refused, and ``fix``."""
    try:
        target = f" (to '{os.readlink(path)}')"
    except OSError:
        target = ""
    return LinkInRunDir(f"'{path}' is a symbolic link{target}; {NOT_IN_A_RUN}. {fix}")


def refuse_links(directory: Path, names: Iterable[str], fix: str) -> None:
    """Raise :class:`LinkInRunDir` for the first of ``directory``'s entries ``names`` that is a link."""
    for name in sorted(set(names)):
        path = Path(directory) / name
        if os.path.islink(path):
            raise link_error(path, fix)


def make_dirs(top: Path, *parts: str, fix: str) -> Path:
    """``top/part/part...``, each missing level created; a level that is a link is refused
    (:class:`LinkInRunDir`) instead of followed. ``top`` (the run directory) may be a link."""
    path = Path(top)
    path.mkdir(parents=True, exist_ok=True)
    for part in parts:
        path = path / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
        if os.path.islink(path):
            raise link_error(path, fix)
    return path


def open_to_write(path: Path, *, new: bool = False, append: bool = False) -> int:
    """A descriptor of ``path`` opened for writing that never follows a link at ``path``
    (``OSError`` ELOOP there): truncated, appended to (``append``), or created and refused when
    anything, a dangling link included, is already there (``new``: ``FileExistsError``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    flags |= os.O_EXCL if new else os.O_APPEND if append else os.O_TRUNC
    return os.open(path, flags, 0o644)


def write_text(path: Path, text: str, *, new: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all, flushed to the disk
    (:func:`forge_lm.safe_write.write_atomically`): a reader, or a run resumed after a crash,
    finds the old file or the new one. A link at ``path`` is refused (``OSError`` ELOOP, as
    :func:`open_to_write`); with ``new``, anything already there, a dangling link included, is
    refused (``FileExistsError``) and left as it is."""
    write_atomically(path, text, new=new)
