"""Checks of where the run writes: the run directory (can it be created and written, is there
disk to spare), the checkpoints already in it (which one a resumed run would start from), and
the cache directory that keeps the CPU's measured peak FLOP/s between runs."""

from __future__ import annotations

from pathlib import Path

from forge_lm.cli._doctor._check import FAIL, OK, WARNING, Check, Context

_GIB = 1024**3


def run_directory(context: Context) -> list[Check]:
    """A row for the directory and, when it can be written, one for its disk's free space."""
    import shutil

    directory = context.directory
    existing = _existing_ancestor(directory)
    where = str(directory)
    if not existing.is_dir():
        blocked = (
            f"{where} exists and is not a directory"
            if existing == directory.absolute()
            else f"{where} cannot be created: {existing} is not a directory"
        )
        return [Check("run directory", FAIL, f"{blocked}. Fix: choose another --train.output_dir")]
    try:
        _probe_writable(existing)
    except OSError as exc:
        return [
            Check(
                "run directory",
                FAIL,
                f"{where}: cannot write in {existing}: {exc.strerror or exc}. "
                "Fix: choose a writable --train.output_dir, or give this user write access",
            )
        ]
    found = f"{where} is writable" if existing == directory.absolute() else f"{where} will be created in {existing}"
    free = shutil.disk_usage(existing).free / _GIB
    if free < context.min_free_gib:
        disk = Check(
            "disk",
            WARNING,
            f"{free:.1f} GiB free at {existing}, under {context.min_free_gib:g} GiB: checkpoints may not fit. "
            "Fix: free space, choose another --train.output_dir, "
            "or keep fewer checkpoints (checkpoint.keep_last_n)",
        )
    else:
        disk = Check("disk", OK, f"{free:.1f} GiB free at {existing}")
    return [Check("run directory", OK, found), disk]


def checkpoints(context: Context) -> list[Check]:
    """The run's checkpoints, read as resuming reads them (no tensor loaded): which one a
    resumed run would start from, and why any newer one would be passed over. Nothing when the
    run directory has no checkpoints/ (or torch is missing)."""
    directory = context.directory
    if context.torch is None or not (directory / "checkpoints").is_dir():
        return []
    from forge_lm.checkpoint import SAVE_IN_PROGRESS, CheckpointManager

    survey = CheckpointManager(directory).survey()
    unsafe = [f"{path.name}: {problem[8:]}" for path, problem in survey if problem and problem.startswith("UNSAFE: ")]
    if unsafe:
        return [Check("checkpoints", FAIL, f"{unsafe[0]}. Fix: remove that checkpoint; never load it")]
    usable = next((path for path, problem in survey if problem is None), None)
    if usable is None:
        if not survey:
            return [Check("checkpoints", OK, "none yet")]
        first, problem = survey[0]
        if all(problem.startswith(SAVE_IN_PROGRESS) for _, problem in survey):  # the run's first save, not damage
            return [Check("checkpoints", OK, f"none yet: {first.name} is {problem}")]
        return [Check("checkpoints", FAIL, f"none usable: {first.name} ({problem}). Fix: remove the damaged ones")]
    skipped = [f"{path.name} ({problem})" for path, problem in survey if _step(path) > _step(usable)]
    if skipped:
        return [
            Check("checkpoints", WARNING, f"a resumed run starts from {usable.name}; passed over: {'; '.join(skipped)}")
        ]
    return [Check("checkpoints", OK, f"a resumed run starts from {usable.name}")]


def cache_directory(context: Context) -> list[Check]:
    """Nothing without torch: the cache serves MFU, which only a training run (with torch) logs."""
    if context.torch is None:
        return []
    from forge_lm.hardware import cache_dir

    directory = cache_dir()
    existing = _existing_ancestor(directory)
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "not a directory", str(existing))
        _probe_writable(existing)
    except OSError as exc:
        return [
            Check(
                "cache directory",
                WARNING,
                f"{directory}: {exc.strerror or exc}; the CPU's peak FLOP/s (for MFU) will be measured again at every "
                "run. Fix: set XDG_CACHE_HOME to a writable directory, or metrics.peak_flops",
            )
        ]
    return [Check("cache directory", OK, f"{directory} is writable")]


CHECKS = (run_directory, checkpoints, cache_directory)


def _existing_ancestor(path: Path) -> Path:
    """``path`` itself if it exists, else the nearest ancestor that does."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_writable(directory: Path) -> None:
    """Create and delete a file in ``directory``; raises OSError when that is not possible."""
    import os
    import tempfile

    handle, name = tempfile.mkstemp(prefix=".forge-doctor-", dir=directory)
    os.close(handle)
    os.unlink(name)


def _step(path: Path) -> int:
    from forge_lm.checkpoint import step_of

    return step_of(path) or 0
