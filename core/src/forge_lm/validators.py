"""attrs validators for config fields, with messages the config loader can place.

A validator raises :class:`FieldError` naming the key; the loader prefixes the section, so
the user reads ``[optimizer] lr: must be > 0, got -1.0``. Cross-field checks in
``__attrs_post_init__`` raise :class:`FieldError` too, naming the key to change.
"""

from __future__ import annotations

from typing import Any


class FieldError(ValueError):
    """A config value is invalid; ``key`` names the field, ``message`` says what is valid."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def positive(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and not value > 0:
        raise FieldError(attribute.name, f"must be > 0, got {value!r}")


def non_negative(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and not value >= 0:
        raise FieldError(attribute.name, f"must be >= 0, got {value!r}")


def fraction(instance: Any, attribute: Any, value: Any) -> None:
    if not 0.0 <= value <= 1.0:
        raise FieldError(attribute.name, f"must be between 0 and 1, got {value!r}")


def one_of(*choices: str) -> Any:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            raise FieldError(attribute.name, f"must be one of {allowed}, got {value!r}")

    return check
