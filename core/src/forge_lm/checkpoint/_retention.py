"""Which checkpoints a run keeps: one pure rule, given the saved steps and their metrics.

With ``keep_last_n = 0`` every checkpoint is kept (the other rules have nothing to add). With
``keep_last_n = n`` the newest n are kept, and so is any step that one of these rules keeps:

- ``keep_every_n_steps = k``: every step divisible by k, forever;
- ``[[checkpoint.keep]]`` rules by step range: a step belongs to the first rule whose
  ``until_step`` is at or above it (a rule without ``until_step`` has no end), and is kept when
  that rule's ``every`` divides it;
- ``keep_best_n = b``: the b steps with the best value of ``keep_best_metric`` (lowest, or
  highest with ``keep_best_mode = "max"``). A checkpoint with no value of that metric (no
  evaluation at its step, or a NaN) never counts as one of the best; among equal values the
  newer step wins.

The checkpoint ``latest`` names and one still being written are never removed whatever the rule
says; the caller passes the first as ``protected`` and never lists the second.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def steps_to_keep(
    steps: Iterable[int],
    *,
    keep_last_n: int,
    keep_every_n_steps: int = 0,
    ranges: Sequence[Any] = (),
    keep_best_n: int = 0,
    best_mode: str = "min",
    metric: Mapping[int, float] | None = None,
    protected: Iterable[int] = (),
) -> set[int]:
    """The steps of ``steps`` to keep. ``ranges`` are objects with ``until_step`` (int or None)
    and ``every``, in rising ``until_step`` order; ``metric`` maps a step to its value of the
    metric that ranks the best checkpoints."""
    steps = sorted(set(steps))
    if not keep_last_n:
        return set(steps)
    kept = set(steps[-keep_last_n:]) | (set(protected) & set(steps))
    kept |= {s for s in steps if keep_every_n_steps and s % keep_every_n_steps == 0}
    kept |= {s for s in steps if _kept_by_range(s, ranges)}
    if keep_best_n:
        scored = [(value, s) for s, value in (metric or {}).items() if s in steps and _finite(value)]
        # Best first; among equal values the newer step (the one that trained longer) wins.
        scored.sort(key=lambda pair: (-pair[0] if best_mode == "max" else pair[0], -pair[1]))
        kept |= {s for _, s in scored[:keep_best_n]}
    return kept


def _kept_by_range(step: int, ranges: Sequence[Any]) -> bool:
    for rule in ranges:
        if rule.until_step is None or step <= rule.until_step:
            return step % rule.every == 0
    return False  # past the last rule's end: no range rule keeps it


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
