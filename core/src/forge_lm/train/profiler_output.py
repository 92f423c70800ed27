"""What the profiler leaves on the console and in memory, kept to what the user asked for.

* libkineto (the C++ profiler inside libtorch) writes ``USDT:<time> <pid>:<tid>
  SyncActivityProfilerHandler.cpp:52] profiler_start`` (and ``profiler_stop``) straight to the
  process's standard error, file descriptor 2, each time a trace starts and stops, whatever
  ``KINETO_LOG_LEVEL`` says. :func:`without_kineto_lines` captures descriptor 2 around the
  profiler's own calls only and writes back everything else that was written there meanwhile
  (Forge's messages, a warning of another thread), in order.
* A finished window keeps its events (the trace's every operator call) in the profiler until
  the next window replaces them, or until the run ends. :func:`release_window` drops them as
  soon as the window is written, and hands the freed heap back to the system.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

# "USDT:2026-12-03 16:26:57 19741:19741 SyncActivityProfilerHandler.cpp:52] profiler_start";
# "STAGE:" lines of the same form appear at KINETO_LOG_LEVEL 2 and 3.
KINETO_LINE = re.compile(rb"(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def without_kineto_lines() -> Iterator[None]:
    """Run the block with descriptor 2 captured; write back all of it but libkineto's lines."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no standard error to capture (a daemon closed it): nothing to keep clean
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError, OSError):  # a closed sys.stderr: flushed already
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = b"".join(line for line in capture.read().splitlines(keepends=True) if not KINETO_LINE.match(line))
            _write_all(2, kept)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):  # standard error gone: what it would have shown is lost anyway
        while data:
            data = data[os.write(fd, data) :]


def release_window(prof: Any) -> None:
    """Drop the events of the window ``prof`` (a ``torch.profiler.profile``) just handed over.

    Called from its ``on_trace_ready``, after the window is written. torch keeps the window's
    recording in ``prof.profiler`` and builds a new one when the next window's warm-up begins
    (``prepare_trace`` makes one when there is none), so nothing later misses it.
    """
    prof.profiler = None
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    """glibc keeps freed memory in the process (RSS stays high) until asked to give it back."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl has no malloc_trim): its allocator decides
        ctypes.CDLL(None).malloc_trim(0)


def size_in_words(size: int) -> str:
    """``1234567`` -> ``1.2 MB`` (decimal units, as ``ls --si`` says them)."""
    if size < 1000:
        return f"{size} B"
    value, unit = float(size), "B"
    for unit in ("kB", "MB", "GB"):  # noqa: B007 - the unit the loop stops at is the one to print
        value /= 1000
        if value < 1000:
            break
    return f"{value:.1f} {unit}"
