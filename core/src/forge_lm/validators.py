"""attrs validators for config fields, with messages the config loader can place.

A validator raises :class:`FieldError` naming the key; the loader prefixes the section, so
the user reads ``[optimizer] lr: must be > 0, got -1.0``. Cross-field checks in
``__attrs_post_init__`` raise :class:`FieldError` too, naming the key to change.
"""

from __future__ import annotations

import math
from typing import Any


class FieldError(ValueError):
    """A config value is invalid; ``key`` names the field, ``message`` says what is valid."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _not_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def finite(instance: Any, attribute: Any, value: Any) -> None:
    """A float that is a number: not NaN, not infinite (None, meaning unset, passes)."""
    if _not_finite(value):
        raise FieldError(attribute.name, f"must be a finite number, got {value!r}")


def positive(instance: Any, attribute: Any, value: Any) -> None:
    finite(instance, attribute, value)
    if value is not None and not value > 0:
        raise FieldError(attribute.name, f"must be > 0, got {value!r}")


def non_negative(instance: Any, attribute: Any, value: Any) -> None:
    finite(instance, attribute, value)
    if value is not None and not value >= 0:
        raise FieldError(attribute.name, f"must be >= 0, got {value!r}")


def fraction(instance: Any, attribute: Any, value: Any) -> None:
    if not 0.0 <= value <= 1.0:
        raise FieldError(attribute.name, f"must be between 0 and 1, got {value!r}")


def between(low: int, high: int) -> Any:
    """An integer in ``[low, high]``."""

    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not low <= value <= high:
            raise FieldError(attribute.name, f"must be between {low} and {high}, got {value!r}")

    return check


def one_of(*choices: str) -> Any:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            raise FieldError(attribute.name, f"must be one of {allowed}, got {value!r}")

    return check
