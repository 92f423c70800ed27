"""A resolved config back to plain data and TOML (``forge config show``)."""

from __future__ import annotations

from typing import Any

import attrs
import tomli_w

from forge_lm.config._converter import converter
from forge_lm.config._schema import ARRAY, CATEGORY, MANY, ComponentConfig


def to_data(instance: Any) -> dict[str, Any]:
    """Plain data that, written as TOML and loaded again, gives the same config.

    Unset optional values (``None``) are left out: they mean "derive it", and writing the
    derived value would pin it when another layer later changes what it derives from.
    """
    out: dict[str, Any] = {}
    for field in attrs.fields(type(instance)):
        value = getattr(instance, field.name)
        if field.metadata.get(ARRAY):
            out[field.name] = [{"name": c.name, **to_data(c.options)} for c in value]
        elif field.metadata.get(MANY):
            out[field.name] = [c.name for c in value]
            for chosen in value:
                options = to_data(chosen.options)
                if options:
                    out[chosen.name.rpartition(":")[2]] = options
        elif field.metadata.get(CATEGORY) or isinstance(value, ComponentConfig):
            out[field.name] = {"name": value.name, **to_data(value.options)}
        elif attrs.has(type(value)):
            out[field.name] = to_data(value)
        elif value is not None:
            out[field.name] = converter.unstructure(value)
    return out


def to_toml(instance: Any) -> str:
    return tomli_w.dumps(to_data(instance))
