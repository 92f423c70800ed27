"""One run per run directory: ``<run>/.lock``, held while a ``forge train`` uses the directory.

The lock is ``flock`` on that file, so the kernel releases it when the holding process ends,
however it ends (a crash, SIGKILL, a node reboot); the file's content, JSON with the holder's
``host``, ``pid``, ``started`` time and ``command``, only names the holder in messages.
``forge train`` takes it when it prepares the run directory (rank 0 under torchrun), before it
writes anything into a directory that exists, and releases it when the run ends, also on
errors; the file is removed then, so a finished run leaves no lock file behind.

A second run on a locked directory is refused with :class:`RunDirLocked` (exit 2), naming the
holder. A lock file whose holder is gone is stale and taken over with a warning: its flock is
free, or it is still held but the holder it names was a process on this host (same host name
and pid namespace) that no longer exists, e.g. a forked child kept the descriptor and outlived it.
On a file system without ``flock`` the file's content decides alone: a live holder on this
host, or any holder on another host (whose life cannot be checked), keeps the directory.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from forge_lm.errors import ForgeError
from forge_lm.notices import warn

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the content-only fallback below
    fcntl = None

LOCK_FILE = ".lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}  # e.g. Lustre mounted without flock
_ATTEMPTS = 8  # the file may be replaced under us by a release or a takeover: open it again


class RunDirLocked(ForgeError):
    """Another run holds the run directory."""


def this_process() -> dict[str, Any]:
    """What this process writes into the lock file it holds."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_namespace": _pid_namespace(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def describe(holder: dict[str, Any] | None) -> str:
    """``pid 123 on host node7, running since 2025-01-01T10:00:00+00:00``."""
    if not holder:
        return "a process whose lock file does not say which"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, running since {holder.get('started', '?')}"


class RunLock:
    """The lock of one run directory (which must exist). ``acquire`` raises :class:`RunDirLocked`
    when another run holds it and ``OSError`` when the lock file cannot be created or opened
    (a read-only directory, a directory named ``.lock``, a link named ``.lock``: never followed);
    ``release`` is idempotent."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            raise RuntimeError(f"the lock of '{self.run_dir}' is already held")
        for _ in range(_ATTEMPTS):
            # O_NOFOLLOW: a link planted at .lock is not followed (ELOOP), whatever it points to is never truncated.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                if self._try(fd):
                    self._fd = fd
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise RunDirLocked(
            f"[train] output_dir: could not lock '{self.run_dir}': its lock file '{self.path}' kept changing "
            "hands; another run is starting in it. Try again, or choose another train.output_dir."
        )

    def _try(self, fd: int) -> bool:
        """Lock the file open as ``fd``: True when this process now holds it, False to open it
        again (it was removed or replaced meanwhile); raises when another run holds it."""
        locked = _flock(fd)
        holder = _read(fd)
        if locked is False:  # held by someone else
            if _gone(holder, certain=True):  # ... by a descendant that outlived the holder it names
                _takeover_warning(self.run_dir, holder)
                if _names(fd, self.path):
                    self.path.unlink()  # open a new file: the old one stays locked by the orphan
                return False
            raise RunDirLocked(_held_message(self.run_dir, self.path, holder))
        if locked is None and holder and not _gone(holder, certain=False):  # no flock: the content decides
            raise RunDirLocked(_held_message(self.run_dir, self.path, holder))
        if not _names(fd, self.path):  # released (removed) or taken over since we opened it
            return False
        if holder is not None:
            _takeover_warning(self.run_dir, holder)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(this_process()) + "\n").encode(), 0)
        return True

    def release(self) -> None:
        """Remove the lock file and unlock it (in that order: whoever opened the old file and
        locks it next sees that it is no longer the lock file, and opens the new one)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if _names(fd, self.path):
                with contextlib.suppress(OSError):
                    self.path.unlink()
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def other_holder(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run that holds ``run_dir`` now, if it is not this process: what its lock file names
    (``{}`` when unreadable), or None. For commands that read a run directory while it may be
    training (a step directory without its trainer state is then a save in progress, not a cut
    one). Reads the file only and takes no lock, so that it never delays or refuses a run that
    starts meanwhile: a holder on this host is alive if its pid is (a lock file a killed run left
    behind names a free pid), one on another host is taken for alive."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None  # no lock file: no run holds it (a run removes it when it ends)
    try:
        holder = _read(fd)
    except OSError:
        holder = {}
    finally:
        os.close(fd)
    if holder is None or _gone(holder, certain=True):
        return None
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        return None  # this process's own run
    return holder


def _flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: the file system has no flock."""
    if fcntl is None:  # pragma: no cover
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            return None
        raise
    return True


def _read(fd: int) -> dict[str, Any] | None:
    """The holder the lock file names; None when it is empty; ``{}`` when it is unreadable."""
    data = os.pread(fd, 64 * 1024, 0)
    if not data.strip():
        return None
    try:
        holder = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # bad UTF-8 and bad JSON are ValueErrors; nesting recurses
        return {}
    return holder if isinstance(holder, dict) else {}


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (itself, not a link to it)."""
    try:
        here = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def _gone(holder: dict[str, Any] | None, *, certain: bool) -> bool:
    """Whether the holder is known to have ended: it ran on this host, in this pid namespace,
    and its pid is free. ``certain=False``: an unreadable or foreign holder counts as alive."""
    if not holder or not isinstance(holder.get("pid"), int):
        return False
    if holder.get("host") != socket.gethostname() or holder.get("pid_namespace") != _pid_namespace():
        return False
    if holder["pid"] == os.getpid():
        return False  # this process holds it (another RunLock): alive
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    return False


def _pid_namespace() -> int | None:
    """Processes with the same host name in other containers have pids of their own."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _held_message(run_dir: Path, path: Path, holder: dict[str, Any] | None) -> str:
    return (
        f"[train] output_dir: '{run_dir}' is in use by another run: {describe(holder)} (lock file '{path}'). "
        "Two runs in one directory would overwrite each other's checkpoints: wait for that run to end or stop "
        "it, or choose another train.output_dir. If that run has ended, remove the lock file."
    )


def _takeover_warning(run_dir: Path, holder: dict[str, Any]) -> None:
    who = f"pid {holder['pid']}" if "pid" in holder else "an unknown process (unreadable lock file)"
    where = f" on host {holder['host']}" if "host" in holder else ""
    since = f" since {holder['started']}" if "started" in holder else ""
    warn(f"taking over the stale lock of {who}{where}{since} in '{run_dir}': that run has ended.")
