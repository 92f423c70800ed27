"""The run directory: one run at a time in it, and nothing left behind by a start that failed.

:class:`RunDirectory`, what ``forge train`` uses (on rank 0), locks the directory
(``<run>/.lock``, :mod:`forge_lm.run_lock`) before it writes anything into it, and
releases the lock when the run ends, also on errors. Under the lock it decides whether the
config starts or resumes the run there (:mod:`forge_lm.train.resume_rules`), writing
``config.toml`` and ``plugins.json`` (:mod:`forge_lm.train.run_manifest`).

A start that fails leaves nothing behind ("exit 2: nothing written"), in three layers:

- whatever can be checked without writing is checked before the directory is touched: the
  config, the plugins, building the model and the data (the loop prepares the directory last);
- a directory this run created is removed again when the run fails before its first step is
  done: token ids outside the vocabulary in the first batch, a dtype or layout error in the
  first forward pass, a preemption signal during start-up. It holds nothing of value then
  (its ``config.toml`` is the command line's);
- a directory that holds no checkpoint yet (such a failed start in a directory that existed
  before, or a run stopped before its first checkpoint) accepts a corrected config
  (:mod:`forge_lm.train.resume_rules`).

A run directory is a Forge run's or a new one: an existing directory that is not empty and
holds nothing a run writes (:data:`RUN_MARKERS`: a folder with the user's own ``config.toml``)
is refused before anything is written (exit 2), so that nothing of the user's is overwritten.

Links among the run's own entries (:data:`RUN_ENTRIES`, the metrics backends' files) are refused
before the directory is locked or anything in it is read or written (exit 2, naming the link):
Forge never follows one out of the run (:mod:`forge_lm.run_links`). The run directory
itself may be a link.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path, PurePath

from forge_lm.checkpoint._layout import CHECKPOINTS, RUN_ID_FILE
from forge_lm.config import ForgeConfig
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.events import EVENTS_FILE
from forge_lm.plugins import PluginManager
from forge_lm.run_links import link_error, refuse_links
from forge_lm.run_lock import LOCK_FILE, RunLock
from forge_lm.train.profiling import PROFILES_DIR
from forge_lm.train.resume_rules import CONFIG_FILE, lexists, prepare, writable_fix
from forge_lm.train.run_manifest import MANIFEST_FILE
from forge_lm.train.watchdog import HANG_DIR

# The run directory's files, wherever their rules are kept: callers name them from here too.
__all__ = ["CONFIG_FILE", "EVAL_DIR", "LINK_FIX", "MANIFEST_FILE", "RUN_ENTRIES", "RUN_MARKERS", "RunDirectory"]

EVAL_DIR = "eval"  # forge eval's results (cli/_eval.py)
# The run directory's entries that Forge reads or writes: none of them may be a link.
RUN_ENTRIES = (
    LOCK_FILE,
    CONFIG_FILE,
    MANIFEST_FILE,
    RUN_ID_FILE,
    CHECKPOINTS,
    EVENTS_FILE,
    EVAL_DIR,
    HANG_DIR,
    PROFILES_DIR,
)
# Entries only Forge writes: a non-empty directory holding none of them is not a run (config.toml
# alone may be the user's own file).
RUN_MARKERS = (LOCK_FILE, MANIFEST_FILE, RUN_ID_FILE, CHECKPOINTS, EVENTS_FILE)
LINK_FIX = "Replace the link by a copy of what it points to, or remove it, or choose another train.output_dir."


class RunDirectory:
    """Rank 0's hold on ``train.output_dir`` for one ``forge train``.

    :meth:`open` creates or checks the directory under its lock; :meth:`close` (or leaving the
    ``with`` block) releases the lock and, when the run failed before :attr:`trained` was set
    (by the loop, after each step), removes the directory if this run created it, or else the
    record of a resume's changed settings (``config.resume-N.toml``) that never trained.
    """

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.path = Path(output_dir)
        self.trained = False  # set once a step is done: from then on the directory is kept
        self._created: Path | None = None  # the topmost directory this run created
        self._resume_record: Path | None = None  # the config.resume-N.toml this run wrote
        self._lock: RunLock | None = None

    def open(self, config: ForgeConfig, manager: PluginManager) -> tuple[Path, bool]:
        """Lock the run directory, then create it or check ``config`` may resume the run in it.

        Returns ``(run_dir, resuming)``."""
        self._created = _make_dirs(self.path)
        refuse_links(self.path, _entries(self.path, config), LINK_FIX)  # before the lock file is opened
        if self._created is None:
            _refuse_other_content(self.path)
        lock = RunLock(self.path)
        try:
            lock.acquire()
        except OSError as exc:
            raise _cannot_lock(self.path, lock.path, exc) from None
        self._lock = lock
        resuming, self._resume_record = prepare(self.path, config, manager)
        return self.path, resuming

    def close(self, *, failed: bool) -> None:
        # Only under its lock: a run that lost the race for a directory it made leaves it to the winner.
        if failed and self._created is not None and not self.trained and self._lock is not None:
            shutil.rmtree(self.path, ignore_errors=True)  # its content is this run's alone
            # Parents it created go only if still empty: another run may have started in one meanwhile.
            parent = self.path
            while parent != self._created and parent.parent != parent:
                parent = parent.parent
                try:
                    parent.rmdir()
                except OSError:
                    break
        if failed and self._resume_record is not None and not self.trained:
            self._resume_record.unlink(missing_ok=True)  # it records a resume that did not happen
        self._created = self._resume_record = None
        if self._lock is not None:
            self._lock, lock = None, self._lock
            lock.release()

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def _refuse_other_content(run_dir: Path) -> None:
    """Refuse an existing directory that is neither empty nor a Forge run's: a run would write its
    ``config.toml``, metrics and checkpoints over what is there."""
    try:
        names = sorted(entry.name for entry in run_dir.iterdir())
    except OSError:
        return  # unreadable: the lock or the resume checks name the problem
    if not names or any(name in RUN_MARKERS for name in names):
        return
    shown = ", ".join(repr(name) for name in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise ConfigError(
        f"[train] output_dir: '{run_dir}' is not empty ({shown}) and holds no Forge run; a run would write its "
        f"{CONFIG_FILE}, metrics and checkpoints there, over what is there. Choose a new or empty directory as "
        "train.output_dir."
    )


def _entries(run_dir: Path, config: ForgeConfig) -> list[str]:
    """The entries of ``run_dir`` this run reads or writes: :data:`RUN_ENTRIES`, the records of
    earlier resumes, and the files or folders of the metrics backends (``metrics.jsonl``)."""
    entries = [*RUN_ENTRIES, *(p.name for p in run_dir.glob("config.resume-*.toml"))]
    for backend in config.metrics.backends:
        for option in ("filename", "subdir"):
            value = getattr(backend.options, option, None)
            if isinstance(value, str) and PurePath(value).parts:
                entries.append(PurePath(value).parts[0])
    return entries


def _cannot_lock(run_dir: Path, lock_path: Path, exc: OSError) -> ForgeError:
    if lock_path.is_symlink():  # put there after the links were refused: not followed (ELOOP)
        return link_error(lock_path, LINK_FIX)
    if exc.errno == errno.EISDIR or lock_path.is_dir():
        return ForgeError(
            f"[train] output_dir: cannot lock '{run_dir}': '{lock_path}' is a directory, but Forge keeps the run's "
            "lock file there. Remove it or choose another train.output_dir."
        )
    if lexists(run_dir / CONFIG_FILE):
        return ForgeError(
            f"cannot resume the run in '{run_dir}': the directory is not writable ({exc.strerror}: cannot create "
            f"its lock file '{LOCK_FILE}'). " + writable_fix(run_dir)
        )
    return ConfigError(
        f"[train] output_dir: cannot write to '{run_dir}': {exc.strerror}. Choose a writable train.output_dir."
    )


def _make_dirs(run_dir: Path) -> Path | None:
    """Create ``run_dir`` and its missing parents; the topmost directory this call created (and
    no other process did at the same moment), or None when it existed."""
    missing = []
    existing = run_dir
    while not lexists(existing) and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        what = f"'{run_dir}' is" if existing == run_dir else f"'{run_dir}' cannot be created: '{existing}' is"
        kind = "a file, not a directory" if existing.is_file() else "not a directory"
        raise ConfigError(f"[train] output_dir: {what} {kind}; choose another train.output_dir.")
    created = None
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not directory.is_dir():
                raise ConfigError(
                    f"[train] output_dir: '{directory}' is not a directory; choose another train.output_dir."
                ) from None
            continue  # another process made it just now: not ours to remove
        except OSError as exc:
            raise ConfigError(
                f"[train] output_dir: cannot create '{directory}': {exc.strerror}. Choose a writable train.output_dir."
            ) from None
        created = created or directory
    return created
