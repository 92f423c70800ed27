"""What a command is doing while it is slow, shown only where someone watches.

Loading torch and a checkpoint, building a model on the meta device for the memory estimate,
probing the host: each takes seconds on a small machine, and a command that prints nothing
for that long looks hung. On a terminal the step is named by a transient status line (rich's
spinner, erased when the step ends, so the command's output is what stays on the screen);
anywhere else (a pipe, a log file, a test) nothing is printed, so output stays what scripts
parse. The line goes to standard error, beside Forge's other messages.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import IO


@contextlib.contextmanager
def working(message: str, stream: IO[str] | None = None) -> Iterator[None]:
    """Show ``message`` with a spinner on ``stream`` (standard error) while the block runs,
    if ``stream`` is a terminal."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        yield
        return
    from rich.console import Console  # rich only where the line is drawn

    with Console(file=stream, stderr=stream is sys.stderr).status(message):
        yield
