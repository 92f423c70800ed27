"""Finding a run's checkpoints: which steps there are, which are complete, what ``latest`` names.

Nothing found is trusted yet: ``latest`` is a small file anyone could have edited, and a step
directory is checked (:mod:`._validate`) before anything in it is loaded. ``latest`` is written
for people and tools; loading does not depend on it (every step is a candidate, newest first, so
that a ``latest`` edited to name an old checkpoint cannot make a run overwrite newer ones).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forge_lm import run_lock
from forge_lm.checkpoint._errors import being_written, describe
from forge_lm.checkpoint._layout import LATEST, STEP_DIR
from forge_lm.checkpoint._safe import UnsafeCheckpointError, read_metadata
from forge_lm.checkpoint._state import TRAINER_STATE, read_trainer_state
from forge_lm.checkpoint._validate import check_owner, check_place
from forge_lm.errors import ForgeError


class FindingCheckpoints:
    """The finding half of :class:`forge_lm.checkpoint.CheckpointManager` (which sets ``store``,
    ``root``, ``run_dir`` and ``run_id``)."""

    store: Any
    root: Any
    run_dir: Path
    run_id: str | None

    def latest(self) -> Any:
        """The checkpoint ``checkpoints/latest`` names, if it names a step directory of this run."""
        return self._latest()[0]

    def _latest(self) -> tuple[Any, str | None]:
        """(what ``latest`` names, or None; why it was ignored, or None)."""
        top = self.store.top
        kind = top.kind(LATEST)
        if kind is None:
            return None, None
        if kind != "file" or top.size(LATEST) > 64:
            return None, f"{LATEST}: not a small plain file; ignored"
        try:
            name = top.read(LATEST, 64).decode("ascii").strip()
        except (OSError, UnicodeDecodeError, ForgeError):
            return None, f"{LATEST}: unreadable; ignored"
        if not STEP_DIR.fullmatch(name):
            return None, f"{LATEST}: names {name!r}, not a step_<N> directory of {self.root}; ignored"
        return self.store.location(name), None

    def _step_names(self) -> list[str]:
        """Every entry named ``step_<N>``, newest first (whether usable or not)."""
        names = [name for name in self.store.names() if STEP_DIR.fullmatch(name)]
        return sorted(names, key=lambda name: -int(name[5:]))

    def _complete_names(self) -> list[str]:
        """Complete checkpoints (plain directories with a trainer state), oldest first."""
        return [
            name
            for name in reversed(self._step_names())
            if self.store.is_step_dir(name) and self.store.files(name).kind(TRAINER_STATE) == "file"
        ]

    def complete(self) -> list[Any]:
        """Complete checkpoints (plain directories with a trainer state), oldest first."""
        return [self.store.location(name) for name in self._complete_names()]

    def candidates(self) -> list[Any]:
        """Where to resume from, best first: every step directory, newest first."""
        return [self.store.location(name) for name in self._step_names()]

    def _cut_short(self, name: str) -> bool:
        """A step directory whose save never finished: a plain directory without a trainer state."""
        return self.store.is_step_dir(name) and self.store.files(name).kind(TRAINER_STATE) is None

    def survey(self) -> list[tuple[Any, str | None]]:
        """Every step directory, newest first, with why it would be passed over (None when it
        passes every check that needs no model: place, trainer state, metadata). Reads the
        same way loading does; loads no tensor. A payload is reported, not raised."""
        found: list[tuple[Any, str | None]] = []
        names = self._step_names()
        writer = self.writer_elsewhere() if any(self._cut_short(name) for name in names) else None
        for name in names:
            path = self.store.location(name)
            try:
                files = self.store.files(name)
                check_owner(read_trainer_state(files, check_place(self.store, name)), self.run_id, self.root)
                read_metadata(files)
            except UnsafeCheckpointError as exc:
                found.append((path, f"UNSAFE: {exc}"))
            except (ForgeError, *self.store.failures) as exc:
                found.append((path, being_written(writer) if writer and self._cut_short(name) else describe(exc)))
            else:
                found.append((path, None))
        return found

    def writer_elsewhere(self) -> str | None:
        """Who else writes this run's checkpoints now (``pid 12 on host n1, running since ...``):
        another process training in the run directory, which holds its lock; None when none
        does (a step directory without its trainer state is then a save cut short)."""
        holder = run_lock.other_holder(self.run_dir)
        return None if holder is None else run_lock.describe(holder)

    def _check_root(self) -> None:
        self.store.check_root()
