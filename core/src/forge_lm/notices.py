"""One way to warn the user: ``forge: warning: <message>`` on stderr, flushed at once so that it
lands among the run's other lines in order (a warning is never fatal; errors raise ForgeError)."""

from __future__ import annotations

import sys


def warn(message: str) -> None:
    """Print ``message`` as a Forge warning on stderr, on whichever rank calls it."""
    print(f"forge: warning: {message}", file=sys.stderr, flush=True)
