"""A resolved config back to plain data and TOML (``forge config show``)."""

from __future__ import annotations

from typing import Any

import attrs
import tomli_w

from forge_lm.config._converter import converter
from forge_lm.config._schema import ARRAY, CATEGORY, KEYED, MANY, OPTIONS_OF, ComponentConfig


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
        elif field.metadata.get(KEYED):
            if value:  # none: left out, so a config without entries dumps as it did before they existed
                out[field.name] = {key: _entry_data(entry) for key, entry in value.items()}
        elif field.metadata.get(OPTIONS_OF):
            if value:  # none: left out, as in a config from before such options existed
                out[field.name] = {name: to_data(chosen.options) for name, chosen in value.items()}
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
        elif isinstance(value, list) and value and all(attrs.has(type(item)) for item in value):
            out[field.name] = [to_data(item) for item in value]  # an array of tables: each one's unset keys left out
        elif value is not None:
            out[field.name] = converter.unstructure(value)
    return out


def _entry_data(entry: Any) -> dict[str, Any]:
    """One entry of a KEYED table, as its table holds it: the component's name and options, flat,
    then the entry's own settings; an unset component (the default) writes no name."""
    out: dict[str, Any] = {}
    settings = {}
    for field in attrs.fields(type(entry)):
        value = getattr(entry, field.name)
        if field.metadata.get(CATEGORY):
            if value is not None:
                out.update({"name": value.name, **to_data(value.options)})
        elif value is not None:
            settings[field.name] = converter.unstructure(value)
    return {**out, **settings}


def to_toml(instance: Any) -> str:
    return tomli_w.dumps(to_data(instance))
