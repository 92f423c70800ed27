"""Replacing a file safely: a reader sees the old file or the whole new one, never half of one,
and nothing is ever written through a link.

Every file the core writes whole (a checkpoint's ``trainer_state.json`` and ``latest``, a run's
``config.toml`` and ``plugins.json``, a Hugging Face export, a trained tokenizer, a profile,
the caches of measured peaks and CPU kernels) is written by the one rule here:

* The data goes to a new file beside the target (the same directory, so that the rename never
  crosses file systems), created under a random name with ``O_CREAT | O_EXCL | O_NOFOLLOW``: a
  leftover or a link planted at a temporary name is never opened, let alone written through.
  It gets the mode ``open()`` gives a new file (0666 less the umask).
* With ``durable`` (the default) the file's data is flushed to the disk (``fsync``) before the
  rename and the directory after it, so that after a power cut the name holds the old file or
  the whole new one. Caches and profiles, cheap to lose, pass ``durable=False``.
* The temporary file is renamed over the target (``os.replace``, atomic on POSIX). A link at
  the target is refused with the error ``O_NOFOLLOW`` gives (``OSError`` ELOOP) before anything
  is written, unless the caller passes ``replace_link``: then the rename replaces the link
  itself and what it pointed at is untouched. (The check is for a link planted beforehand, in a
  copied run or a shared directory; a user racing their own Forge process is not defended
  against.)
* On any failure the temporary file is removed and the target is as it was. A crash (SIGKILL,
  power cut) between the write and the rename leaves the target as it was and a
  ``.NAME.XXXXXXXX.partial`` file beside it.

:func:`write_atomically` writes bytes or text; :func:`replacing` hands a temporary path to a
writer that only takes a path (safetensors, the profiler's trace export).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

PARTIAL_SUFFIX = ".partial"
_NAME_KEPT = 200  # of the target's name in the temporary one: with the rest, under NAME_MAX (255)
# What link() and a directory's fsync fail with where the file system does not offer them.
_UNSUPPORTED = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def write_atomically(
    path: str | os.PathLike[str],
    data: bytes | str,
    *,
    durable: bool = True,
    replace_link: bool = False,
    new: bool = False,
) -> None:
    """Write ``data`` (a ``str`` as UTF-8) to ``path`` by the module's rule.

    ``new``: nothing may be at ``path``; anything there, a dangling link included, is left as it
    is and ``FileExistsError`` raised. Where the file system has hard links, the check and the
    creation are one step (``os.link``); elsewhere they are two."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    _check_target(path, replace_link=replace_link, new=new)
    partial, fd = _create_partial(path)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(payload)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        _move_in_place(partial, path, new=new, durable=durable)
    except BaseException:
        _remove(partial)
        raise


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], *, durable: bool = True, replace_link: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (an empty file, created by the module's rule) for
    a writer that takes a path; when the block ends without an error, that file replaces
    ``path``. The writer may write the file in place or replace it (safetensors writes a new
    file, 0600); what is there when the block ends is moved, with the rule's mode."""
    path = Path(path)
    _check_target(path, replace_link=replace_link, new=False)
    partial, fd = _create_partial(path)
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    os.close(fd)  # the writer opens it by name
    try:
        yield partial
        _finish_file(partial, mode, durable=durable)
        _move_in_place(partial, path, new=False, durable=durable)
    except BaseException:
        _remove(partial)
        raise


def sync_directory(directory: str | os.PathLike[str]) -> None:
    """Flush ``directory``'s entries to the disk (after a rename, so that the new name survives a
    power cut). A file system that cannot (some network and FUSE ones) is left as it is."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED or exc.errno == errno.EACCES:  # a directory one may write but not list
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _check_target(path: Path, *, replace_link: bool, new: bool) -> None:
    if new:
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
    elif not replace_link and os.path.islink(path):
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))


def _create_partial(path: Path) -> tuple[Path, int]:
    """A new, empty file beside ``path`` under a name no one could have planted something at."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
    for _ in range(100):
        partial = path.with_name(f".{path.name[:_NAME_KEPT]}.{os.urandom(4).hex()}{PARTIAL_SUFFIX}")
        try:
            return partial, os.open(partial, flags, 0o666)  # the kernel takes the umask off
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name beside it", str(path))


def _move_in_place(partial: Path, path: Path, *, new: bool, durable: bool) -> None:
    if new:
        _link_new(partial, path)
    else:
        os.replace(partial, path)  # replaces the name: a link there is replaced, never followed
    if durable:
        sync_directory(path.parent)


def _link_new(partial: Path, path: Path) -> None:
    """Give ``partial`` the name ``path`` only if nothing is there, then drop its own name."""
    try:
        os.link(partial, path, follow_symlinks=False)  # EEXIST for anything there, a link included
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
        _check_target(path, replace_link=False, new=True)  # no hard links here: check, then rename
        os.replace(partial, path)
        return
    _remove(partial)


def _finish_file(path: Path, mode: int, *, durable: bool) -> None:
    """Give the file a writer left at ``path`` the ``mode`` it was created with, and flush it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _remove(partial: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(partial)


__all__ = ["PARTIAL_SUFFIX", "replacing", "sync_directory", "write_atomically"]
