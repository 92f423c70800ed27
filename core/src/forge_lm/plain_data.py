"""Plain data: what a JSON file can hold (dicts with string keys, lists, strings, integers,
floats, booleans and None), and one walker that says where a value is not that.

Values handed to the core by components and plugins (a scheduler's or dataset's
``state_dict()``, a plugin's checkpoint state, an evaluator's results, an event's fields) are
untrusted: one may hold an object JSON cannot write, a NaN, a key that is not a string, or
itself. Every check of them goes through :func:`find_not_plain`, with one depth limit
(:data:`MAX_DEPTH`, which :mod:`forge_lm.checkpoint`'s shape checks use too), so no check
recurses into Python's recursion limit and a cycle is named as a cycle. A caller chooses only
what it allows beyond plain JSON: tensors and integer keys (a checkpoint keeps them), NaN and
infinities (a plugin's own state may hold them).

:func:`to_plain` turns anything into plain data (for the event log, which records what it is
given rather than refuse it), and :func:`copy_containers` copies a value's dicts and lists.
Neither imports torch or numpy: a tensor is recognised only if torch is already imported.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, NamedTuple

MAX_DEPTH = 64
"""Containers nested deeper than this are refused: far more than any real state needs, far less
than Python's recursion limit (1000) and the depth json's own reader manages."""

DEEPER = f"<nested more than {MAX_DEPTH} levels deep>"
"""What :func:`to_plain` writes in place of a container nested deeper than :data:`MAX_DEPTH`."""


class NotPlain(NamedTuple):
    """Where in a value the first thing that is not plain data is, and what it is."""

    steps: tuple[Any, ...]
    """The keys and indices from the top of the value down to it (empty: the top itself)."""
    reason: str
    """What is wrong, as the end of a sentence whose subject is the place: ``is a set``."""
    kind: str
    """``"type"``, ``"number"`` (not finite), ``"key"``, ``"depth"`` or ``"cycle"``."""

    def at(self, top: str, *, subscripts: bool = False) -> str:
        """The place, starting from ``top``: ``top.key[0]``, or with ``subscripts``
        ``top['key'][0]`` (which tells an integer key from a string one)."""
        text = top
        for step in self.steps:
            if isinstance(step, int) and not isinstance(step, bool) and not subscripts:
                text += f"[{step}]"
            elif subscripts:
                text += f"[{short_repr(step)}]"
            else:
                text += f".{step}"
        return text

    def describe(self, top: str, *, subscripts: bool = False) -> str:
        """The whole sentence: ``state.a is a set``."""
        return f"{self.at(top, subscripts=subscripts)} {self.reason}"


def find_not_plain(
    value: Any, *, tensors: bool = False, int_keys: bool = False, non_finite: bool = False
) -> NotPlain | None:
    """The first place in ``value`` that is not plain data, or None when all of it is.

    Plain: None, bool, int, str, finite floats, lists, tuples, and dicts with string keys. With
    ``tensors``, a ``torch.Tensor`` is a leaf that is allowed; with ``int_keys``, dict keys may
    be integers too (never booleans); with ``non_finite``, NaN and infinities are allowed.
    Containers more than :data:`MAX_DEPTH` levels deep are refused, and one that contains
    itself is named as a cycle."""
    torch = sys.modules.get("torch") if tensors else None
    tensor_type = torch.Tensor if torch is not None else ()
    return _walk(value, (), set(), tensor_type, int_keys, non_finite)


def _walk(
    value: Any, steps: tuple[Any, ...], open_ids: set[int], tensor_type: Any, int_keys: bool, non_finite: bool
) -> NotPlain | None:
    if value is None or isinstance(value, bool | int | str):
        return None
    if isinstance(value, float):
        if non_finite or math.isfinite(value):
            return None
        return NotPlain(steps, f"is {value}, not a finite number", "number")
    if tensor_type and isinstance(value, tensor_type):
        return None
    if not isinstance(value, dict | list | tuple):
        return NotPlain(steps, f"is a {type(value).__name__}", "type")
    if id(value) in open_ids:
        return NotPlain(steps, "contains itself (a cycle)", "cycle")
    if len(steps) >= MAX_DEPTH:
        return NotPlain(steps, f"is nested more than {MAX_DEPTH} levels deep", "depth")
    open_ids.add(id(value))
    try:
        if isinstance(value, dict):
            for key, item in value.items():
                if not (isinstance(key, str) or (int_keys and isinstance(key, int) and not isinstance(key, bool))):
                    wanted = "a string or an integer" if int_keys else "a string"
                    return NotPlain(steps, f"has the key {short_repr(key)}, not {wanted}", "key")
                found = _walk(item, (*steps, key), open_ids, tensor_type, int_keys, non_finite)
                if found:
                    return found
        else:
            for index, item in enumerate(value):
                found = _walk(item, (*steps, index), open_ids, tensor_type, int_keys, non_finite)
                if found:
                    return found
        return None
    finally:
        open_ids.discard(id(value))


def to_plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON can hold it: non-finite numbers as strings (``"nan"``), keys as strings,
    tuples as lists, paths as strings, one-element tensors and numpy numbers as their number,
    anything else as its ``repr``, and a container deeper than :data:`MAX_DEPTH` (a cycle
    included) as :data:`DEEPER`."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict | list | tuple):
        if depth >= MAX_DEPTH:
            return DEEPER
        if isinstance(value, dict):
            return {str(key): to_plain(item, depth + 1) for key, item in value.items()}
        return [to_plain(item, depth + 1) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    item = getattr(value, "item", None)  # a one-element tensor or numpy number
    if callable(item):
        try:
            number = item()
        except (TypeError, ValueError, RuntimeError):
            number = None
        if isinstance(number, bool | int | float):
            return to_plain(number, depth)
    return short_repr(value, limit=None)


def copy_containers(value: Any, depth: int = 0) -> Any:
    """A copy of ``value``'s dicts and lists (tuples become lists), down to :data:`MAX_DEPTH`;
    the leaves and anything deeper are shared, not copied."""
    if depth >= MAX_DEPTH:
        return value
    if isinstance(value, dict):
        return {key: copy_containers(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [copy_containers(item, depth + 1) for item in value]
    return value


def short_repr(value: Any, limit: int | None = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters; an object whose ``repr`` fails (a plugin's)
    is described by its type instead of raising."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - an object from a plugin may fail even to describe itself
        text = f"<a {type(value).__name__}>"
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["DEEPER", "MAX_DEPTH", "NotPlain", "copy_containers", "find_not_plain", "short_repr", "to_plain"]
