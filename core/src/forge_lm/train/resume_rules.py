"""Whether a config starts or resumes the run in a directory, and what a start writes there.

``config.toml`` is the fully resolved config (``forge train <run>/config.toml`` reproduces the
run) and ``plugins.json`` the plugin manifest (:mod:`forge_lm.train.run_manifest`). Training into
a directory that already holds a run resumes it: the new config may change how the run goes on
(steps, intervals, metrics) but not what it trains (:data:`FIXED_ON_RESUME`); the settings it
does change are recorded in ``config.resume-N.toml``. A directory that holds no checkpoint yet
accepts a corrected config: its ``config.toml`` and ``plugins.json`` are replaced, with a
warning. Only a checkpoint makes the settings in :data:`FIXED_ON_RESUME` binding.

A resumed run must be able to write: before anything is loaded, the directory and its
``checkpoints/`` are probed and the files in it opened for appending, so a read-only run
directory is a message naming it and the fix (exit 2), not a traceback halfway through.

A new run writes its id (``run_id``); every checkpoint records it, and a run refuses another
run's checkpoints (:mod:`forge_lm.checkpoint`). A run made before run ids gets one when resumed.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from forge_lm.checkpoint import holds_checkpoints
from forge_lm.checkpoint._layout import CHECKPOINTS, LATEST, RUN_ID_FILE, read_run_id, step_of
from forge_lm.config import ForgeConfig, read_toml, structure_config, to_data, to_toml
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.notices import warn
from forge_lm.plugins import PluginManager
from forge_lm.run_links import write_text
from forge_lm.run_lock import LOCK_FILE
from forge_lm.train.run_manifest import (
    MANIFEST_FILE,
    loaded_entries,
    manifest_differences,
    manifest_text,
    read_manifest,
)

CONFIG_FILE = "config.toml"
# Settings a resumed run may not change: the checkpoint would not fit, or would mean another run.
# The batch size may change (with a warning): a run resumed on another number of ranks adjusts
# the per-rank batch to keep the global batch.
FIXED_ON_RESUME = ("model.", "tokenizer.", "optimizer.name", "train.seq_len", "train.seed")
_NOT_APPENDED = (CONFIG_FILE, MANIFEST_FILE, LOCK_FILE, RUN_ID_FILE)  # files a resumed run does not write to


def prepare(run_dir: Path, config: ForgeConfig, manager: PluginManager) -> tuple[bool, Path | None]:
    """Whether ``config`` resumes the run in ``run_dir`` (else it starts it), and the record of
    the resume's changed settings it wrote, if any."""
    checkpoints = run_dir / CHECKPOINTS
    if lexists(checkpoints) and not checkpoints.is_dir():
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
    # Checkpoints on an object store ([checkpoint] dir) count as the run's own checkpoints/ would.
    stored = config.checkpoint.dir is not None and holds_checkpoints(config.checkpoint.dir)
    checkpointed = checkpointed or stored
    config_file = run_dir / CONFIG_FILE
    if not lexists(config_file):
        if stored:
            raise ConfigError(
                f"[checkpoint] dir: '{config.checkpoint.dir}' holds checkpoints, but '{run_dir}' holds no run they "
                f"belong to (no {CONFIG_FILE}). Resume with the run directory that wrote them, or give this run a "
                "[checkpoint] dir of its own."
            )
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
    if lexists(run_dir / RUN_ID_FILE):
        warn(
            f"'{run_dir / RUN_ID_FILE}' does not hold a run id; it is replaced by a new one (checkpoints recording "
            "the old id are then another run's)"
        )
    write_run_file(run_dir / RUN_ID_FILE, uuid.uuid4().hex + "\n")


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
        warn(
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
        warn(f"resuming '{run_dir}' with changed settings: {', '.join(changed)}")
        index = len(list(run_dir.glob("config.resume-*.toml"))) + 1
        record = run_dir / f"config.resume-{index}.toml"
        write_run_file(record, to_toml(config))
    manifest_path = run_dir / MANIFEST_FILE
    if not lexists(manifest_path):
        return record
    stored_manifest, problem = read_manifest(manifest_path)
    if problem:
        warn(f"resuming '{run_dir}': {problem}; it is replaced by this run's plugins")
        write_run_file(manifest_path, manifest_text(manager))
        return record
    for difference in manifest_differences(loaded_entries(stored_manifest), manager.manifest()):
        warn(f"resuming '{run_dir}': {difference}")
    return record


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
            + writable_fix(run_dir)
        ) from None


def writable_fix(run_dir: Path) -> str:
    return (
        f"Make the run directory writable again (chmod -R u+w '{run_dir}'), or copy the run and resume the copy: "
        f"cp -r '{run_dir}' NEW && forge train NEW/{CONFIG_FILE} --train.output_dir=NEW."
    )


def _write_run_files(run_dir: Path, config: ForgeConfig, manager: PluginManager) -> None:
    write_run_file(run_dir / CONFIG_FILE, to_toml(config))
    write_run_file(run_dir / MANIFEST_FILE, manifest_text(manager))


def write_run_file(path: Path, text: str) -> None:
    try:
        write_text(path, text)  # a link at path is not followed (ELOOP)
    except OSError as exc:
        raise ConfigError(f"[train] output_dir: cannot write to '{path.parent}': {exc.strerror}.") from None


def lexists(path: Path) -> bool:
    return os.path.lexists(path)


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain config trees."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [d for key in keys for d in differences(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [prefix.rstrip(".")]
