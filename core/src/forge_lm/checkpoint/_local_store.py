"""Checkpoints in a local directory: ``<run>/checkpoints``.

Nothing here follows a link: a step directory, a file in one or ``latest`` that is a link is
reported as a ``"link"`` (the callers refuse it), a ``checkpoints`` directory that is a link is
refused outright, and a step directory is removed without following a link planted in its place.
Small files are written by :func:`forge_lm.safe_write.write_atomically` (a new file beside the
target, fsync, rename, fsync of the directory), so a reader sees the old file or the new one, never
half of one; a link at ``latest`` is replaced, never followed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from forge_lm.checkpoint._safe import DamagedCheckpointError, SafeReader
from forge_lm.errors import ForgeError
from forge_lm.safe_write import write_atomically


class LocalFiles:
    """The files of one local directory (:class:`forge_lm.checkpoint._safe.StepFiles`)."""

    def __init__(self, directory: Path) -> None:
        self.where = directory

    def kind(self, name: str) -> str | None:
        path = self.where / name
        if path.is_symlink():
            return "link"
        if not path.exists():
            return None
        return "file" if path.is_file() else "dir" if path.is_dir() else "other"

    def size(self, name: str) -> int:
        return (self.where / name).stat().st_size

    def read(self, name: str, limit: int) -> bytes:
        with (self.where / name).open("rb") as stream:
            data = stream.read(limit + 1)
        if len(data) > limit:
            raise DamagedCheckpointError(f"{name} is larger than {limit} bytes")
        return data

    def entries(self) -> list[tuple[str, str | None]]:
        """Every entry's name and kind."""
        return [(entry.name, self.kind(entry.name)) for entry in self.where.iterdir()]

    def write_text(self, name: str, text: str) -> None:
        # A link planted at the name is replaced (the readers refuse one: see kind()).
        write_atomically(self.where / name, text, replace_link=True)


class LocalStore:
    """A run's checkpoints in ``root`` (``<run>/checkpoints``), one directory per step."""

    remote = False
    attempts = 1  # a failed write to a local disk is not retried at once: SavePolicy's next interval may
    failures: tuple[type[BaseException], ...] = (OSError,)
    fix_for_failed_write = "free disk space or fix the permissions of the run directory"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.top = LocalFiles(root)

    def location(self, name: str) -> Path:
        return self.root / name

    def name_of(self, location: Any) -> str | None:
        """The name of ``location`` in this store, or None when it is not one of its entries."""
        location = Path(location)
        return location.name if location.parent == self.root else None

    def check_root(self) -> None:
        """Refuse a ``checkpoints`` directory that is a link: saving, pruning and loading through
        it would write, delete and read in some other place than this run."""
        if self.root.is_symlink():
            raise ForgeError(
                f"'{self.root}' is a link (to '{os.readlink(self.root)}'); a run's checkpoints directory must be a "
                "plain directory inside it. Replace the link with the directory it points to (or a copy of it)."
            )

    def names(self) -> list[str]:
        return [entry.name for entry in self.root.iterdir()] if self.root.is_dir() else []

    def is_step_dir(self, name: str) -> bool:
        path = self.root / name
        return path.is_dir() and not path.is_symlink()

    def files(self, name: str) -> LocalFiles:
        return LocalFiles(self.root / name)

    def check_step(self, name: str) -> None:
        """Raise :class:`DamagedCheckpointError` unless ``name`` is a plain directory of plain
        files inside ``checkpoints/``."""
        path = self.root / name
        if path.is_symlink() or not path.is_dir():
            raise DamagedCheckpointError("a link or not a directory; checkpoints are plain directories")
        if path.resolve().parent != self.root.resolve():
            raise DamagedCheckpointError(f"resolves outside {self.root}")
        odd = [entry for entry, kind in self.files(name).entries() if kind != "file"]
        if odd:
            raise DamagedCheckpointError(f"holds {odd[0]!r}, which is a link or not a plain file")

    def remove(self, name: str) -> None:
        """Remove a step directory without following a link planted in its place."""
        path = self.root / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)

    def rename(self, name: str, new_name: str) -> None:
        (self.root / name).rename(self.root / new_name)

    def save(self, tensors: dict[str, Any], name: str, **options: Any) -> None:
        """Write ``tensors`` as the DCP checkpoint ``name`` (every rank its own shards)."""
        dcp.save(tensors, checkpoint_id=str(self.root / name), **options)

    def reader(self, name: str) -> SafeReader:
        return SafeReader(str(self.root / name), self.files(name))

    def bytes_of(self, name: str) -> int:
        """Bytes of the files a checkpoint directory holds (0 where it cannot be read)."""
        try:
            return sum(entry.stat().st_size for entry in (self.root / name).iterdir() if entry.is_file())
        except OSError:
            return 0

    def free_space(self) -> str:
        """`` (12.3 GB free on its disk)``: what a failed write most often lacks, whatever the error
        said (torch's file writer reports a full disk as a position mismatch)."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return ""
        return f" ({free / 1e9:.3g} GB free on its disk)"

    def retry_wait(self, attempt: int) -> float:
        return 0.0
