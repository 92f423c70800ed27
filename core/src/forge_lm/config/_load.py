"""Build a :class:`ForgeConfig` from its layers: defaults, a TOML file, command-line overrides.

The layers are merged as plain data first and structured once at the end, so no value is
fixed before every layer has had its say. Structuring walks the attrs classes itself (to
name the section and key of every mistake, and to give each component section the options
class of the component it selects) and leaves the typing of individual values to the
converter.
"""

from __future__ import annotations

import tomllib
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import tomli_w

from forge_lm.config._converter import CliValue, _parse_cli_array, converter, describe
from forge_lm.config._schema import (
    ARRAY,
    CATEGORY,
    KEYED,
    MANY,
    OPTIONS_OF,
    ComponentConfig,
    ForgeConfig,
    check_cross_section,
)
from forge_lm.errors import ConfigError, ForgeError, UsageError, did_you_mean, quoted_list
from forge_lm.plugins import Registry
from forge_lm.plugins._categories import singular
from forge_lm.validators import FieldError


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist.") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file '{path}' is not valid TOML: it is not UTF-8 text ({exc.reason} at byte {exc.start})."
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc.strerror}.") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not valid TOML: {exc}.") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(
            f"config file '{path}' is not a usable config: its arrays or inline tables are nested too deeply to "
            "read. A Forge config nests a few levels at most: fix the file, or replace it."
        ) from None


def parse_overrides(args: Iterable[str]) -> dict[str, Any]:
    """``["--model.n_heads=8"]`` -> ``{"model": {"n_heads": CliValue("8")}}``."""
    tree: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.removeprefix("--").partition("=")
        parts = key.split(".")
        if not arg.startswith("--") or not sep or not all(parts):
            raise UsageError(f"'{arg}' is not an override; write --section.key=value (e.g. --model.n_heads=8).")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"'{arg}' sets a key inside '{part}', which an earlier override set to a value.")
        node[parts[-1]] = CliValue(value)
    return tree


def merge(base: Mapping[str, Any], top: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """``top`` layered over ``base``: tables merge key by key, any other value replaces."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and key in out:
            if not isinstance(out[key], Mapping):
                raise ConfigError(f"{_name(where, key)} is a value in the config file but a table in an override.")
            out[key] = merge(out[key], value, _join(where, key))
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None,
    overrides: Sequence[str],
    registry: Registry,
    notes: list[str] | None = None,
) -> ForgeConfig:
    """The resolved run config. Raises :class:`ConfigError` (or :class:`UsageError`).

    When the overrides select another component than the file did, the file's options that
    the new component does not take are dropped (see :func:`merge_layers`); ``notes``, if
    given, receives one line for each.
    """
    raw = read_toml(path) if path is not None else {}
    layered = merge_layers(raw, parse_overrides(overrides), registry, notes, f"in {path}", "on the command line")
    return structure_config(layered, registry)


def merge_layers(
    base: Mapping[str, Any],
    top: Mapping[str, Any],
    registry: Registry,
    notes: list[str] | None = None,
    base_name: str = "in an earlier layer",
    top_name: str = "in a later layer",
) -> dict[str, Any]:
    """``top`` merged over ``base`` (:func:`merge`), for layers of a :class:`ForgeConfig`.

    A layer that changes a component's ``name`` replaces the component: options that an
    earlier layer set for the old one and the new one does not take are dropped, not errors
    (``--scheduler.name=constant`` over a file's cosine ``min_lr_ratio``). Options given in
    the same layer as the new name are still checked strictly, as are earlier ones when the
    name stays. ``notes`` gets a line for each drop; ``base_name`` and ``top_name`` say where
    the layers come from ("in run.toml").
    """
    dropped: list[tuple[str, str]] = []
    pruned = _Pruner(registry, dropped).section(ForgeConfig, base, top, "")
    if notes is not None:
        for what, why in dropped:
            notes.append(f"{what}, set {base_name}, is dropped: {why} {top_name}.")
    return merge(pruned, top)


def structure_config(data: Mapping[str, Any], registry: Registry) -> ForgeConfig:
    config = _Walker(registry).structure(ForgeConfig, data, "")
    problems = check_cross_section(config)
    if problems:
        raise ConfigError("\n".join(f"{where}: {message}." for where, message in problems))
    return config


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _name(where: str, key: str) -> str:
    """How messages name a key: ``[model] n_heads``, or ``[model]`` for a whole section."""
    return f"[{where}] {key}" if where else f"[{key}]"


class _Walker:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def structure(self, cls: type, data: Any, where: str, owner: str = "", also: tuple[str, ...] = ()) -> Any:
        """An instance of the attrs class ``cls`` from the table ``data`` found at ``where``.

        ``owner`` names the component whose options these are; ``also`` are keys the section
        accepts besides the fields (a component section's ``name``), offered as suggestions.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"[{where}] must be a table, got {describe(data)}.")
        data = dict(data)
        fields = attrs.fields(attrs.resolve_types(cls))
        values: dict[str, Any] = {}
        for field in fields:
            if field.metadata.get(MANY):
                values[field.name] = self._component_list(field, data, where, [f.name for f in fields])
        self._reject_unknown_keys(cls, data, where, owner, also)
        for field in fields:
            if field.name in values:
                continue
            if field.metadata.get(ARRAY):
                values[field.name] = self._component_array(field, data.get(field.name, []), where)
                continue
            if field.metadata.get(KEYED):
                values[field.name] = self._component_table(field, data.get(field.name, {}), where)
                continue
            if field.metadata.get(OPTIONS_OF):
                values[field.name] = self._options_by_name(field, data.get(field.name, {}), where)
                continue
            if field.metadata.get(CATEGORY):
                # Structured even when absent, so the default component is checked and gets options.
                value = data.get(field.name, {})
                values[field.name] = self._component(field.metadata[CATEGORY], value, _join(where, field.name), field)
                continue
            if attrs.has(field.type):
                # Walked even when absent, so component fields nested inside get resolved too.
                values[field.name] = self.structure(field.type, data.get(field.name, {}), _join(where, field.name))
            elif field.name in data:
                values[field.name] = self._value(data[field.name], field.type, where, field.name)
        missing = [f.name for f in fields if f.name not in values and f.default is attrs.NOTHING]
        if missing:
            raise ConfigError(f"{_name(where, missing[0])}: required{owner and ' by ' + owner}, but not set.")
        try:
            return cls(**values)
        except FieldError as exc:
            raise ConfigError(f"{_name(where, exc.key)}: {exc.message}.") from None
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"[{where}]: {exc.args[0] if exc.args else exc}.") from None

    def _value(self, value: Any, tp: Any, where: str, key: str) -> Any:
        item = _table_array_item(tp)
        if item is not None:  # an array of tables ([[data.phases]]): each one walked like a section
            given, tables = describe(value), f"[[{_join(where, key)}]]"
            if isinstance(value, CliValue):  # on the command line: a TOML array of inline tables
                value = _cli_tables(value)
                example = ", ".join(f"{f.name} = ..." for f in attrs.fields(item) if f.default is attrs.NOTHING)
                tables += f"; on the command line inline tables, --{_join(where, key)}='[{{{example}}}, ...]'"
            if not isinstance(value, list | tuple) or not all(isinstance(t, Mapping) for t in value):
                raise ConfigError(f"{_name(where, key)}: expected an array of tables ({tables}), got {given}.")
            return [self.structure(item, table, f"{_join(where, key)}[{i}]") for i, table in enumerate(value)]
        if isinstance(value, Mapping) and not _accepts_table(tp):
            raise ConfigError(f"{_name(where, key)}: expected a value, got a table.")
        try:
            return converter.structure(value, tp)
        except ForgeError:
            raise
        except Exception as exc:  # noqa: BLE001 - cattrs raises many kinds; each means a bad value
            message = str(exc) or type(exc).__name__
            raise ConfigError(f"{_name(where, key)}: {message}.") from None

    def _reject_unknown_keys(
        self, cls: type, data: Mapping[str, Any], where: str, owner: str, also: tuple[str, ...]
    ) -> None:
        valid = [f.name for f in attrs.fields(cls)]
        for key in data:
            if key not in valid:
                kind = "key" if where else "section"
                context = f" for {owner}" if owner else ""
                hint = did_you_mean(key, [*valid, *also])
                raise ConfigError(
                    f"{_name(where, key)}: unknown {kind}{context}.{hint} Valid {kind}s: {quoted_list(valid)}."
                )

    def _resolve(self, category: str, name: str, where: str, named_at: str | None) -> Any:
        """The component ``name``; errors point at ``named_at``, else at ``[where] name``."""
        try:
            return self.registry.resolve(category, name)
        except ForgeError as exc:
            raise ConfigError(f"{named_at or _name(where, 'name') + f' = {name!r}'}: {exc}") from exc

    def _component(self, category: str, data: Any, where: str, field: Any) -> ComponentConfig:
        """A component section: ``name`` picks the component, the rest are its options."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"[{where}] must be a table with a 'name' key, got {describe(data)}.")
        data = dict(data)
        default = field.default.factory() if field is not None and isinstance(field.default, attrs.Factory) else None
        name = data.pop("name", default.name if default else None)
        if name is None:
            raise ConfigError(f"{_name(where, 'name')}: required; say which {singular(category)} to use.")
        name = self._value(name, str, where, "name")
        return self._options(category, name, data, where, also=("name",))

    def _options(
        self,
        category: str,
        name: str,
        data: Mapping[str, Any],
        where: str,
        also: tuple[str, ...] = (),
        named_at: str | None = None,
    ) -> ComponentConfig:
        found = self._resolve(category, name, where, named_at)
        owner = f"{singular(category)} '{name}'"
        options = self.structure(found.options_class, data, where, owner=owner, also=also)
        return ComponentConfig(name, options, found)

    def _component_array(self, field: Any, tables: Any, where: str) -> list[ComponentConfig]:
        """An array of component tables, each selecting its component by ``name``."""
        key_where = _join(where, field.name)
        if not isinstance(tables, list) or not all(isinstance(t, Mapping) for t in tables):
            raise ConfigError(f"{_name(where, field.name)}: expected an array of tables ([[{key_where}]]).")
        return [
            self._component(field.metadata[CATEGORY], table, f"{key_where}[{index}]", field=None)
            for index, table in enumerate(tables)
        ]

    def _options_by_name(self, field: Any, tables: Any, where: str) -> dict[str, ComponentConfig]:
        """``[transforms.<name>]``: options of the components named by the keys."""
        key_where = _join(where, field.name)
        category = field.metadata[CATEGORY]
        if not isinstance(tables, Mapping):
            raise ConfigError(
                f"{_name(where, field.name)}: expected tables, [{key_where}.<{singular(category)}>], "
                f"got {describe(tables)}."
            )
        chosen = {}
        for name, table in tables.items():
            entry_where = _join(key_where, name)
            if not isinstance(table, Mapping):
                raise ConfigError(f"[{entry_where}] must be a table of the {singular(category)}'s options.")
            found = self._options(category, name, table, entry_where, named_at=f"[{entry_where}]")
            if any(other.component is found.component for other in chosen.values()):
                raise ConfigError(f"[{entry_where}]: the {singular(category)} '{name}' has a table already.")
            chosen[name] = found
        return chosen

    def _component_table(self, field: Any, tables: Any, where: str) -> dict[str, Any]:
        """Entries keyed by names the user chose (``[eval.datasets.<name>]``). The field's KEYED
        class has one component field (the entry's ``name`` and options, flat in its table) and
        settings of the entry itself, whose keys the table reserves."""
        key_where = _join(where, field.name)
        if not isinstance(tables, Mapping):
            raise ConfigError(
                f"{_name(where, field.name)}: expected tables, [{key_where}.<name>], got {describe(tables)}."
            )
        entry_cls = field.metadata[KEYED]
        fields = attrs.fields(attrs.resolve_types(entry_cls))
        (chosen_field,) = [f for f in fields if f.metadata.get(CATEGORY)]
        settings = [f for f in fields if f is not chosen_field]
        reserved = [f.name for f in settings]
        category = chosen_field.metadata[CATEGORY]
        entries = {}
        for key, table in tables.items():
            entry_where = _join(key_where, key)
            if not isinstance(table, Mapping):
                raise ConfigError(
                    f"[{entry_where}] must be a table with the {singular(category)}'s name and options, "
                    f"got {describe(table)}."
                )
            table = dict(table)
            values = {
                f.name: self._value(table.pop(f.name), f.type, entry_where, f.name) for f in settings if f.name in table
            }
            if "name" in table:
                values[chosen_field.name] = self._entry_component(category, table, entry_where, reserved)
            elif table:  # options for a component the table does not name: a typo, or a forgotten name
                first = next(iter(table))
                hint = did_you_mean(first, [*reserved, "name"])
                if hint:
                    raise ConfigError(f"{_name(entry_where, first)}: unknown key.{hint}")
                kind = singular(category)
                raise ConfigError(
                    f"{_name(entry_where, first)}: an option, but [{entry_where}] names no {kind}; add "
                    f'name = "<{kind}>" to say which {kind} it is for (without a name, '
                    f"{chosen_field.metadata['unset']})."
                )
            try:
                entries[key] = entry_cls(**values)
            except FieldError as exc:
                raise ConfigError(f"{_name(entry_where, exc.key)}: {exc.message}.") from None
        return entries

    def _entry_component(
        self, category: str, table: dict[str, Any], where: str, reserved: list[str]
    ) -> ComponentConfig:
        """The component an entry's table names, from the table less the entry's own settings."""
        name = self._value(table.pop("name"), str, where, "name")
        found = self._resolve(category, name, where, None)
        if attrs.has(found.options_class):
            clash = [f.name for f in attrs.fields(found.options_class) if f.name in reserved]
            if clash:
                raise ConfigError(
                    f"{_name(where, 'name')} = {name!r}: the {singular(category)} has an option '{clash[0]}', but "
                    f"[{where}] keeps that key for its own setting, so the {singular(category)} cannot be used here."
                )
        return self._options(category, name, table, where, also=("name", *reserved))

    def _component_list(
        self, field: Any, data: dict[str, Any], where: str, section_keys: list[str]
    ) -> list[ComponentConfig]:
        """A component-list field: names in the field, each one's options in a sibling table."""
        category = field.metadata[CATEGORY]
        key_where = _join(where, field.name)
        if field.name in data:
            names = self._value(data.pop(field.name), list[str], where, field.name)
        else:
            names = [c.name for c in field.default.factory()]
        bares = [n.rpartition(":")[2] for n in names]
        if len(set(bares)) != len(bares):
            raise ConfigError(f"{_name(where, field.name)}: lists a {singular(category)} twice: {names}.")
        selected = []
        for name in names:
            bare = name.rpartition(":")[2]
            listed_at = _name(where, field.name)
            if bare in section_keys:  # [eval.datasets] is the section's own key, not an evaluator's options
                raise ConfigError(
                    f"{listed_at}: the {singular(category)} '{name}' has the name of the key {_name(where, bare)}, "
                    f"so its options cannot have the table [{_join(where, bare)}]; it cannot be selected here."
                )
            table = data.pop(bare, {})
            selected.append(self._options(category, name, table, _join(where, bare), named_at=listed_at))
        known = set(self.registry.names(category))
        for key in list(data):
            if key in known and key not in section_keys and isinstance(data[key], Mapping):
                raise ConfigError(
                    f"[{_join(where, key)}] configures the {singular(category)} '{key}', which "
                    f"{key_where} does not select; add it to {key_where} or remove the table."
                )
        return selected


class _Pruner:
    """Walks an earlier layer beside a later one, dropping what the later one's component changes orphan."""

    def __init__(self, registry: Registry, dropped: list[tuple[str, str]]) -> None:
        self.registry = registry
        self.dropped = dropped  # (what was dropped, why), for the notes

    def section(self, cls: type, base: Any, top: Any, where: str) -> Any:
        """``base`` (a table of ``cls``) less what ``top`` orphans; anything malformed is left for the walker."""
        if not isinstance(base, Mapping) or not isinstance(top, Mapping):
            return base
        out = dict(base)
        for field in attrs.fields(attrs.resolve_types(cls)):
            key = field.name
            if field.metadata.get(MANY) or field.metadata.get(ARRAY) or field.metadata.get(OPTIONS_OF):
                # An array replaces the earlier one whole (merge). A list that stops selecting a
                # component whose options table an earlier layer set stays an error, naming the table.
                # Options by name never change component: nothing to orphan.
                continue
            if key not in out or key not in top:
                continue
            if field.metadata.get(KEYED):
                out[key] = self._entries(field, out[key], top[key], _join(where, key))
            elif field.metadata.get(CATEGORY):
                default = field.default.factory().name if isinstance(field.default, attrs.Factory) else None
                out[key] = self._component(field.metadata[CATEGORY], default, out[key], top[key], _join(where, key))
            elif attrs.has(field.type):
                out[key] = self.section(field.type, out[key], top[key], _join(where, key))
        return out

    def _entries(self, field: Any, base: Any, top: Any, where: str) -> Any:
        """Each entry of a KEYED table that both layers set, pruned like a component section; the
        entry's own settings (``steps``) are never orphaned by a change of its component."""
        if not isinstance(base, Mapping) or not isinstance(top, Mapping):
            return base
        fields = attrs.fields(attrs.resolve_types(field.metadata[KEYED]))
        (chosen,) = [f for f in fields if f.metadata.get(CATEGORY)]
        keep = frozenset(f.name for f in fields if f is not chosen)
        out = dict(base)
        for name in [n for n in out if n in top]:
            out[name] = self._component(chosen.metadata[CATEGORY], None, out[name], top[name], _join(where, name), keep)
        return out

    def _find(self, category: str, name: Any) -> Any:
        """The registered component, or None: an unknown name is the walker's to report."""
        if not isinstance(name, str):
            return None
        try:
            return self.registry.resolve(category, name)
        except ForgeError:
            return None

    def _component(
        self, category: str, default: str | None, base: Any, top: Any, where: str, keep: frozenset[str] = frozenset()
    ) -> Any:
        """A component table (``default``: the name when it sets none); ``keep``: keys beside its
        options that belong to the table, not to the component."""
        if not isinstance(base, Mapping) or not isinstance(top, Mapping):
            return base
        old_name = base.get("name", default)
        new_name = top.get("name", old_name)
        old, new = self._find(category, old_name), self._find(category, new_name)
        if new is None or not attrs.has(new.options_class):
            return base
        out = dict(base)
        # Only a change of component orphans options; with the same one, a wrong key is a mistake.
        if old is not new:  # the registry's one entry per component: ``cosine`` is ``forge_lm:cosine``
            accepted = {f.name for f in attrs.fields(new.options_class)} | keep
            for key in [k for k in out if k != "name" and k not in top and k not in accepted]:
                value = out.pop(key)
                what = (
                    f"[{_join(where, key)}]"
                    if isinstance(value, Mapping)
                    else f"{_name(where, key)} = {_toml_value(value)}"
                )
                self.dropped.append((what, f"{singular(category)} '{new_name}', which does not take it, is selected"))
        # The selected component's own options may select components too ([model.ffn.router]).
        return self.section(new.options_class, out, top, where)


def _toml_value(value: Any) -> str:
    """``value`` as TOML writes it (``0.1``, ``true``, ``"text"``), for the notes."""
    try:
        return tomli_w.dumps({"v": value}).removeprefix("v = ").strip()
    except Exception:  # noqa: BLE001 - only a note; a value TOML cannot write is shown as Python does
        return repr(value)


def _cli_tables(value: CliValue) -> Any:
    """``--section.key=[{a = 1}, {a = 2}]`` as TOML reads it, or None if it is not a TOML array."""
    try:
        return _parse_cli_array(value)
    except ValueError:
        return None


def _accepts_table(tp: Any) -> bool:
    return getattr(tp, "__origin__", tp) is dict


def _table_array_item(tp: Any) -> type | None:
    """``X`` when ``tp`` is ``list[X]`` of an attrs class ``X``, else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and len(args) == 1 and isinstance(args[0], type) and attrs.has(args[0]):
        return args[0]
    return None


def structure_options(registry: Registry, component: Any, data: Mapping[str, Any], where: str) -> Any:
    """A component's options object from a table, validated as a config section would be."""
    owner = f"{singular(component.category)} '{component.name}'"
    return _Walker(registry).structure(component.options_class, data, where, owner=owner)
