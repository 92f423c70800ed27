"""Where a dataset's ``path`` option points: one file, a directory, or a glob pattern."""

from __future__ import annotations

import stat
from collections.abc import Sequence
from pathlib import Path

from forge_lm.errors import ConfigError

_GLOB_CHARACTERS = frozenset("*?[")


def resolve_files(path: str, suffixes: Sequence[str], dataset: str) -> list[Path]:
    """The files ``path`` names, sorted; only those ending in one of ``suffixes``.

    A directory contributes the matching files directly inside it (not in sub-directories; a
    glob such as ``data/**/*.bin`` reaches those). Raises :class:`ConfigError` when nothing
    matches, naming what was looked for.
    """
    wanted = ", ".join(suffixes)
    if not path:
        raise ConfigError(f"dataset '{dataset}' needs a path: set path = a file, a directory, or a glob.")
    expanded = Path(path).expanduser()
    if _GLOB_CHARACTERS & set(path):
        files = sorted(found for found in expand_glob(expanded) if found.is_file() and found.suffix in suffixes)
        where = f"the pattern '{path}'"
    elif expanded.is_dir():
        files = sorted(found for found in expanded.iterdir() if found.is_file() and found.suffix in suffixes)
        where = f"the directory '{path}'"
    elif expanded.is_file():
        if expanded.suffix not in suffixes:
            raise ConfigError(f"dataset '{dataset}' reads {wanted} files; '{path}' is not one.")
        return [expanded]
    elif (kind := special_kind(expanded)) is not None:
        raise ConfigError(f"dataset '{dataset}': path '{path}' is {kind}, not a file or a directory of {wanted} files.")
    else:
        raise ConfigError(f"dataset '{dataset}': path '{path}' does not exist.")
    if not files:
        raise ConfigError(f"dataset '{dataset}': {where} holds no {wanted} files.")
    return files


def special_kind(path: Path) -> str | None:
    """What ``path`` is when it exists but is neither a regular file nor a directory (a FIFO
    would block the reader until a writer comes); None otherwise."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"))
    kinds += ((stat.S_ISBLK, "a block device"),)
    return next((name for test, name in kinds if test(mode)), None)


def expand_glob(pattern: Path) -> list[Path]:
    """The paths ``pattern`` matches, as :func:`glob.glob` finds them (hidden names only where
    the pattern names them), except that ``**`` does not descend through links to directories:
    :func:`glob.glob` does, so a link to ``/`` or ``/proc`` among the data (``/proc/self/root``
    leads back to ``/``) made it walk the whole machine, without end."""
    parts = pattern.parts
    first = next((index for index, part in enumerate(parts) if _GLOB_CHARACTERS & set(part)), len(parts))
    anchor = Path(*parts[:first]) if first else Path(".")
    rest = parts[first:]
    if not rest:
        return [anchor] if anchor.exists() else []
    hidden = any(part.startswith(".") for part in rest)
    found = anchor.glob(str(Path(*rest)))
    return [path for path in found if hidden or not any(p.startswith(".") for p in path.relative_to(anchor).parts)]
