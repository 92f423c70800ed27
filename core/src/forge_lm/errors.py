"""The one exception family for mistakes a user can fix.

The CLI prints a :class:`ForgeError` as its message alone (no traceback) and exits with its
``exit_code``: :data:`USAGE_EXIT_CODE` unless a subclass says otherwise (a stop that a job
script may act on has a code of its own). Anything else that escapes is a bug in Forge or in
a plugin.
"""

from __future__ import annotations

from collections.abc import Iterable

USAGE_EXIT_CODE = 2


class ForgeError(Exception):
    """Something the user can fix: the message says what was wrong, where, and what is right."""

    exit_code = USAGE_EXIT_CODE


class ConfigError(ForgeError):
    """A run config is invalid (unknown key, wrong type, impossible combination)."""


class PluginError(ForgeError):
    """A plugin or component cannot be used (missing, broken, incompatible, ambiguous)."""


class UsageError(ForgeError):
    """The command line itself is wrong."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest choice, or an empty string.

    Close spellings first; failing that, the one choice that starts with ``word`` (``metric``
    for ``metrics_backends``), which plain similarity misses for short words.
    """
    import difflib  # here: only a mistake needs it, and forge list-plugins is kept from importing it

    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close and len(word) >= 3:
        close = [c for c in choices if c.startswith(word)]
        close = close if len(close) == 1 else []
    return f" Did you mean '{close[0]}'?" if close else ""


def quoted_list(items: Iterable[str]) -> str:
    """``a, b, c`` quoted and sorted, or ``(none)`` when empty."""
    items = sorted(items)
    return ", ".join(f"'{item}'" for item in items) if items else "(none)"
