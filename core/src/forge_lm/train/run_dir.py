"""The run directory: what a run writes besides checkpoints and metrics, and whether it resumes.

``config.toml`` is the fully resolved config (``forge train <run>/config.toml`` reproduces the
run); ``plugins.json`` is the plugin manifest, so a later reader knows which distributions and
versions produced it: one entry (name, distribution, version) per loaded plugin, then one per
installed plugin that did not load because it is ``incompatible`` or ``broken``, with its
``status`` and ``reason`` (those took no part in the run). Training into a directory that
already holds a run resumes it: the new config may change how the run goes on (steps,
intervals, metrics) but not what it trains.

One run at a time: :class:`RunDirectory`, what ``forge train`` uses (on rank 0), locks the
directory (``<run>/.lock``, :mod:`forge_lm.train.run_lock`) before it writes anything into it,
and releases the lock when the run ends, also on errors.

A start that fails leaves nothing behind ("exit 2: nothing written"), in three layers:

- whatever can be checked without writing is checked before the directory is touched: the
  config, the plugins, building the model and the data (the loop prepares the directory last);
- a directory this run created is removed again when the run fails before its first step is
  done: token ids outside the vocabulary in the first batch, a dtype or layout error in the
  first forward pass, a preemption signal during start-up. It holds nothing of value then
  (its ``config.toml`` is the command line's);
- a directory that holds no checkpoint yet (such a failed start in a directory that existed
  before, or a run stopped before its first checkpoint) accepts a corrected config: its
  ``config.toml`` and ``plugins.json`` are replaced, with a warning. Only a checkpoint makes the
  settings in :data:`FIXED_ON_RESUME` binding.

A resumed run must be able to write: before anything is loaded, the directory and its
``checkpoints/`` are probed and the files in it opened for appending, so a read-only run
directory is a message naming it and the fix (exit 2), not a traceback halfway through.

A run directory is a Forge run's or a new one: an existing directory that is not empty and
holds nothing a run writes (:data:`RUN_MARKERS`: a folder with the user's own ``config.toml``)
is refused before anything is written (exit 2), so that nothing of the user's is overwritten.
A new run writes its id (``run_id``); every checkpoint records it, and a run refuses another
run's checkpoints (:mod:`forge_lm.checkpoint`). A run made before run ids gets one when resumed.

Links among the run's own entries (:data:`RUN_ENTRIES`, the metrics backends' files) are refused
before the directory is locked or anything in it is read or written (exit 2, naming the link):
Forge never follows one out of the run (:mod:`forge_lm.run_links`). The run directory
itself may be a link.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path, PurePath
from typing import Any

from forge_lm.checkpoint._layout import CHECKPOINTS, LATEST, RUN_ID_FILE, read_run_id, step_of
from forge_lm.config import ForgeConfig, read_toml, structure_config, to_data, to_toml
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.events import EVENTS_FILE
from forge_lm.plugins import PluginManager, PluginStatus
from forge_lm.run_links import link_error, refuse_links, write_text
from forge_lm.train.profiling import PROFILES_DIR
from forge_lm.train.run_lock import LOCK_FILE, RunLock
from forge_lm.train.watchdog import HANG_DIR

CONFIG_FILE = "config.toml"
MANIFEST_FILE = "plugins.json"
# Settings a resumed run may not change: the checkpoint would not fit, or would mean another run.
# The batch size may change (with a warning): a run resumed on another number of ranks adjusts
# the per-rank batch to keep the global batch.
FIXED_ON_RESUME = ("model.", "tokenizer.", "optimizer.name", "train.seq_len", "train.seed")
_NOT_APPENDED = (CONFIG_FILE, MANIFEST_FILE, LOCK_FILE, RUN_ID_FILE)  # files a resumed run does not write to
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
        resuming, self._resume_record = _prepare(self.path, config, manager)
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


def _prepare(run_dir: Path, config: ForgeConfig, manager: PluginManager) -> tuple[bool, Path | None]:
    """Whether ``config`` resumes the run in ``run_dir`` (else it starts it), and the record of
    the resume's changed settings it wrote, if any."""
    checkpoints = run_dir / CHECKPOINTS
    if _lexists(checkpoints) and not checkpoints.is_dir():
        raise ForgeError(
            f"[train] output_dir: '{checkpoints}' is not a directory, but the run's checkpoints go there. Move it "
            "away or choose another train.output_dir."
        )
    try:
        checkpointed = checkpoints.is_dir() and any(
            p.name == LATEST or step_of(p) is not None for p in checkpoints.iterdir()
        )
    except OSError as exc:
        raise ForgeError(
            f"cannot read '{checkpoints}': {exc.strerror}. Give this user access to the run directory "
            f"(chmod -R u+rwX '{run_dir}') or choose another train.output_dir."
        ) from None
    config_file = run_dir / CONFIG_FILE
    if not _lexists(config_file):
        if checkpointed:
            raise ConfigError(
                f"[train] output_dir: '{run_dir}' holds checkpoints but no {CONFIG_FILE}, so whether this config "
                f"may resume them cannot be checked. Put the run's {CONFIG_FILE} back (from a copy of the run), "
                "or choose another train.output_dir."
            )
        _write_run_files(run_dir, config, manager)
        _write_run_id(run_dir)
        return False, None
    _check_writable(run_dir)
    if checkpointed:
        record = _check_resume(run_dir, config, manager)
        _write_run_id(run_dir)
        return True, record
    _restart(run_dir, config, manager)
    _write_run_id(run_dir)
    return True, None


def _write_run_id(run_dir: Path) -> None:
    """Give the run its id, unless it has one (runs made before run ids get one at a resume)."""
    if read_run_id(run_dir) is not None:
        return
    if _lexists(run_dir / RUN_ID_FILE):
        _warn(
            f"'{run_dir / RUN_ID_FILE}' does not hold a run id; it is replaced by a new one (checkpoints recording "
            "the old id are then another run's)"
        )
    _write(run_dir / RUN_ID_FILE, uuid.uuid4().hex + "\n")


def _restart(run_dir: Path, config: ForgeConfig, manager: PluginManager) -> None:
    """A run directory without a checkpoint: nothing binds it, so a new config replaces its own."""
    config_file = run_dir / CONFIG_FILE
    if config_file.is_dir():
        raise ConfigError(
            f"[train] output_dir: '{config_file}' is a directory, not the run's config; remove it or choose "
            "another train.output_dir."
        )
    try:
        stored = structure_config(read_toml(config_file), manager.registry)
    except ConfigError as exc:
        why = f"its {CONFIG_FILE} does not load ({str(exc).rstrip('.')})"
    else:
        changed = differences(to_data(stored), to_data(config))
        why = f"changed settings: {', '.join(changed)}" if changed else ""
    if why:
        _warn(
            f"'{run_dir}' holds no checkpoint yet, so this run starts it afresh and replaces its {CONFIG_FILE} "
            f"and {MANIFEST_FILE} ({why})"
        )
        _write_run_files(run_dir, config, manager)


def _check_resume(run_dir: Path, config: ForgeConfig, manager: PluginManager) -> Path | None:
    """Refuse a resume that changes what a run cannot change; record the settings it does change
    (``config.resume-N.toml``, returned) and warn about plugin differences."""
    try:
        stored_data = read_toml(run_dir / CONFIG_FILE)
    except ConfigError as exc:
        raise ConfigError(
            f"cannot resume the run in '{run_dir}': {str(exc).rstrip('.')}. Restore it (from a copy of the run) "
            "or choose another train.output_dir."
        ) from None
    try:  # every component the stored run used must still be available
        stored = structure_config(stored_data, manager.registry)
    except ConfigError as exc:
        raise ConfigError(f"cannot resume the run in '{run_dir}': its {CONFIG_FILE} no longer loads: {exc}") from exc
    changed = differences(to_data(stored), to_data(config))
    fixed = [key for key in changed if key.startswith(FIXED_ON_RESUME)]
    if fixed:
        raise ConfigError(
            f"[train] output_dir: '{run_dir}' holds a run with other settings for {', '.join(fixed)}; a resumed "
            f"run cannot change them. Resume with its own config (forge train {run_dir / CONFIG_FILE}) or "
            "choose a new train.output_dir."
        )
    record = None
    if changed:
        _warn(f"resuming '{run_dir}' with changed settings: {', '.join(changed)}")
        index = len(list(run_dir.glob("config.resume-*.toml"))) + 1
        record = run_dir / f"config.resume-{index}.toml"
        _write(record, to_toml(config))
    manifest_path = run_dir / MANIFEST_FILE
    if not _lexists(manifest_path):
        return record
    stored_manifest, problem = _read_manifest(manifest_path)
    if problem:
        _warn(f"resuming '{run_dir}': {problem}; it is replaced by this run's plugins")
        _write(manifest_path, _manifest_text(manager))
        return record
    for difference in manifest_differences(_loaded(stored_manifest), manager.manifest()):
        _warn(f"resuming '{run_dir}': {difference}")
    return record


def _read_manifest(path: Path) -> tuple[list[dict[str, str]], str]:
    """The stored plugin manifest, or what is wrong with it."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 and bad JSON are ValueErrors; nesting recurses
        return [], f"its {MANIFEST_FILE} is not valid JSON ({exc}), so whether the plugins changed cannot be told"
    except OSError as exc:
        return [], f"its {MANIFEST_FILE} cannot be read ({exc.strerror}), so whether the plugins changed cannot be told"
    keys = ("name", "distribution", "version")
    if not (
        isinstance(manifest, list)
        and all(isinstance(p, dict) and all(isinstance(p.get(k), str) for k in keys) for p in manifest)
    ):
        return [], (
            f"its {MANIFEST_FILE} is not a list of plugins (name, distribution, version), so whether the plugins "
            "changed cannot be told"
        )
    return manifest, ""


def _check_writable(run_dir: Path) -> None:
    """Fail now, naming the directory, if the resumed run could not write what it writes."""
    place = run_dir
    try:
        for place in (run_dir, run_dir / CHECKPOINTS):
            if place.is_dir():
                fd, probe = tempfile.mkstemp(prefix=".forge-write-test-", dir=place)
                os.close(fd)
                os.unlink(probe)
        for place in sorted(run_dir.iterdir()):
            if (
                place.name not in _NOT_APPENDED
                and not place.name.startswith("config.")
                and not place.is_symlink()  # never followed (the run's own entries were refused as links)
                and place.is_file()
            ):
                os.close(os.open(place, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW))  # as a metrics backend; no write
    except OSError as exc:
        raise ForgeError(
            f"cannot resume the run in '{run_dir}': '{place}' cannot be written ({exc.strerror}). "
            + _writable_fix(run_dir)
        ) from None


def _writable_fix(run_dir: Path) -> str:
    return (
        f"Make the run directory writable again (chmod -R u+w '{run_dir}'), or copy the run and resume the copy: "
        f"cp -r '{run_dir}' NEW && forge train NEW/{CONFIG_FILE} --train.output_dir=NEW."
    )


def _cannot_lock(run_dir: Path, lock_path: Path, exc: OSError) -> ForgeError:
    if lock_path.is_symlink():  # put there after the links were refused: not followed (ELOOP)
        return link_error(lock_path, LINK_FIX)
    if exc.errno == errno.EISDIR or lock_path.is_dir():
        return ForgeError(
            f"[train] output_dir: cannot lock '{run_dir}': '{lock_path}' is a directory, but Forge keeps the run's "
            "lock file there. Remove it or choose another train.output_dir."
        )
    if _lexists(run_dir / CONFIG_FILE):
        return ForgeError(
            f"cannot resume the run in '{run_dir}': the directory is not writable ({exc.strerror}: cannot create "
            f"its lock file '{LOCK_FILE}'). " + _writable_fix(run_dir)
        )
    return ConfigError(
        f"[train] output_dir: cannot write to '{run_dir}': {exc.strerror}. Choose a writable train.output_dir."
    )


def _make_dirs(run_dir: Path) -> Path | None:
    """Create ``run_dir`` and its missing parents; the topmost directory this call created (and
    no other process did at the same moment), or None when it existed."""
    missing = []
    existing = run_dir
    while not _lexists(existing) and existing != existing.parent:
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


def _write_run_files(run_dir: Path, config: ForgeConfig, manager: PluginManager) -> None:
    _write(run_dir / CONFIG_FILE, to_toml(config))
    _write(run_dir / MANIFEST_FILE, _manifest_text(manager))


# Plugins that are installed but did not load for a reason the user did not choose; recorded
# so that a run's plugins.json tells why a plugin someone expected took no part in it.
_RECORDED_UNLOADED = (PluginStatus.INCOMPATIBLE, PluginStatus.BROKEN)


def manifest_record(manager: PluginManager) -> list[dict[str, str]]:
    """What ``plugins.json`` holds: the loaded plugins (``manager.manifest()``), then each
    incompatible or broken one with its ``status`` and ``reason``."""
    unloaded = [
        {
            "name": p.name,
            "distribution": p.distribution,
            "version": p.version,
            "status": str(p.status),
            "reason": p.reason or "",
        }
        for p in sorted(manager.plugins, key=lambda p: p.name)
        if p.status in _RECORDED_UNLOADED
    ]
    return [*manager.manifest(), *unloaded]


def _manifest_text(manager: PluginManager) -> str:
    return json.dumps(manifest_record(manager), indent=2) + "\n"


def _loaded(manifest: list[dict[str, str]]) -> list[dict[str, str]]:
    """The entries of a stored ``plugins.json`` that took part in the run (older files have no status)."""
    return [p for p in manifest if p.get("status", str(PluginStatus.OK)) == PluginStatus.OK]


def _write(path: Path, text: str) -> None:
    try:
        write_text(path, text)  # a link at path is not followed (ELOOP)
    except OSError as exc:
        raise ConfigError(f"[train] output_dir: cannot write to '{path.parent}': {exc.strerror}.") from None


def _lexists(path: Path) -> bool:
    return os.path.lexists(path)


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain config trees."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [d for key in keys for d in differences(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [prefix.rstrip(".")]


def manifest_differences(old: list[dict[str, str]], new: list[dict[str, str]]) -> list[str]:
    before = {p["name"]: p for p in old}
    after = {p["name"]: p for p in new}
    notes = [
        f"plugin '{name}' ({before[name]['distribution']}) is no longer loaded" for name in before.keys() - after.keys()
    ]
    notes += [f"plugin '{name}' ({after[name]['distribution']}) is new" for name in after.keys() - before.keys()]
    notes += [
        f"plugin '{name}' changed from {before[name]['distribution']} {before[name]['version']} to "
        f"{after[name]['distribution']} {after[name]['version']}"
        for name in before.keys() & after.keys()
        if (before[name]["distribution"], before[name]["version"])
        != (after[name]["distribution"], after[name]["version"])
    ]
    return sorted(notes)


def _warn(message: str) -> None:
    print(f"forge: warning: {message}", file=sys.stderr, flush=True)
