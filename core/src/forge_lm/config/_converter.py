"""The one cattrs converter, strict about types, and the typing of command-line values.

Values from a TOML file arrive typed, and must match the field exactly (``n_heads = "8"`` is
an error, not a silent conversion). Values from ``--section.key=value`` arrive as text
(:class:`CliValue`) and are parsed by the type of the field they set: ``8`` for an int,
``1e-3`` for a float, ``true`` for a bool, a TOML inline array for a list, ``none`` to clear
an optional field.

Numbers must be representable where they are used: integers fit in 64 bits (TOML's own range;
torch takes nothing wider), and floats are finite and within float32's range (training computes
in float32 at most: ``lr = inf`` or ``1e300`` would only turn into a NaN or an overflow later).
"""

from __future__ import annotations

import contextlib
import math
import tomllib
import types
import typing
from typing import Any

import cattrs

_NONE_WORDS = {"none", "null"}
_TRUE_WORDS = {"true", "yes", "on", "1"}
_FALSE_WORDS = {"false", "no", "off", "0"}

INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # a signed 64-bit integer: TOML's range, and torch's
FLOAT_MAX = 3.4028234663852886e38  # the largest finite float32


class CliValue(str):
    """Text given on the command line, typed later by the field it sets."""


def describe(value: Any) -> str:
    """How a message shows a given value: ``'8'`` from the command line, ``string '8'`` from TOML."""
    if isinstance(value, CliValue):
        return _shortened(f"'{value}'")
    kind = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}
    return f"{kind.get(type(value), type(value).__name__)} {_shortened(repr(value))}"


def _shortened(text: str, limit: int = 80) -> str:
    """``text``, or its start and end and its length when it is longer than ``limit``."""
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-10:]} ({len(text)} characters)"


def _structure_int(value: Any, _: type) -> int:
    number = None
    if isinstance(value, CliValue):
        with contextlib.suppress(ValueError):
            number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    if number is None:
        raise ValueError(f"expected an integer, got {describe(value)}")
    if not INT_MIN <= number <= INT_MAX:
        raise ValueError(f"expected an integer between -2**63 and 2**63 - 1 (64 bits), got {describe(value)}")
    return number


def _structure_float(value: Any, _: type) -> float:
    number = None
    if isinstance(value, CliValue):
        with contextlib.suppress(ValueError):
            number = float(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value) if isinstance(value, float) or abs(value) <= FLOAT_MAX else math.inf
    if number is None:
        raise ValueError(f"expected a number, got {describe(value)}")
    # inf and nan as such ("inf", TOML's inf), not a finite number too large for a float ("1e400").
    spelled = isinstance(value, float) or any(word in str(value).lower() for word in ("inf", "nan"))
    if math.isnan(number) or (math.isinf(number) and spelled):
        raise ValueError(f"expected a finite number, got {describe(value)}")
    if abs(number) > FLOAT_MAX:
        raise ValueError(f"expected a number of magnitude at most {FLOAT_MAX:.4g} (float32), got {describe(value)}")
    return number


def _structure_bool(value: Any, _: type) -> bool:
    if isinstance(value, CliValue):
        word = value.strip().lower()
        if word in _TRUE_WORDS | _FALSE_WORDS:
            return word in _TRUE_WORDS
    elif isinstance(value, bool):
        return value
    raise ValueError(f"expected true or false, got {describe(value)}")


def _structure_str(value: Any, _: type) -> str:
    if isinstance(value, str):
        return str(value)
    raise ValueError(f"expected a string, got {describe(value)}")


def _parse_cli_array(value: CliValue) -> list[Any]:
    try:
        parsed = tomllib.loads(f"value = {value}")["value"]
    except (tomllib.TOMLDecodeError, RecursionError):  # tomllib recurses into nested arrays
        parsed = None
    if not isinstance(parsed, list):
        raise ValueError(f"expected a TOML array such as '[1, 2]' or '[\"a\", \"b\"]', got {describe(value)}")
    return parsed


def _is_sequence(tp: Any) -> bool:
    return typing.get_origin(tp) in (list, tuple)


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=False)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(float, _structure_float)
    conv.register_structure_hook(bool, _structure_bool)
    conv.register_structure_hook(str, _structure_str)

    def structure_sequence(value: Any, tp: Any) -> Any:
        if isinstance(value, CliValue):
            value = _parse_cli_array(value)
        if not isinstance(value, list | tuple):
            raise ValueError(f"expected an array, got {describe(value)}")
        args = typing.get_args(tp)
        if typing.get_origin(tp) is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ValueError(f"expected an array of {len(args)} items, got {len(value)}")
            return tuple(conv.structure(item, arg) for item, arg in zip(value, args, strict=True))
        item_type = args[0] if args else Any
        items = [conv.structure(item, item_type) for item in value]
        return tuple(items) if typing.get_origin(tp) is tuple else items

    def structure_optional(value: Any, tp: Any) -> Any:
        if value is None or (isinstance(value, CliValue) and value.strip().lower() in _NONE_WORDS):
            return None
        (inner,) = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        return conv.structure(value, inner)

    conv.register_structure_hook_func(_is_sequence, structure_sequence)
    conv.register_structure_hook_func(_is_optional, structure_optional)
    return conv


converter = _make_converter()
