"""The one cattrs converter, strict about types, and the typing of command-line values.

Values from a TOML file arrive typed, and must match the field exactly (``n_heads = "8"`` is
an error, not a silent conversion). Values from ``--section.key=value`` arrive as text
(:class:`CliValue`) and are parsed by the type of the field they set: ``8`` for an int,
``1e-3`` for a float, ``true`` for a bool, a TOML inline array for a list, ``none`` to clear
an optional field.
"""

from __future__ import annotations

import tomllib
import types
import typing
from typing import Any

import cattrs

_NONE_WORDS = {"none", "null"}
_TRUE_WORDS = {"true", "yes", "on", "1"}
_FALSE_WORDS = {"false", "no", "off", "0"}


class CliValue(str):
    """Text given on the command line, typed later by the field it sets."""


def describe(value: Any) -> str:
    if isinstance(value, CliValue):
        return f"'{value}'"
    kind = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}
    return f"{kind.get(type(value), type(value).__name__)} {value!r}"


def _structure_int(value: Any, _: type) -> int:
    if isinstance(value, CliValue):
        try:
            return int(value)
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"expected an integer, got {describe(value)}")


def _structure_float(value: Any, _: type) -> float:
    if isinstance(value, CliValue):
        try:
            return float(value)
        except ValueError:
            pass
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"expected a number, got {describe(value)}")


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
    except tomllib.TOMLDecodeError:
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
