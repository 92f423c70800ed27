"""What the plugin manager knows about a plugin and about each component it registered."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from forge_lm.errors import ForgeError, PluginError
from forge_lm.plugins._categories import singular


class PluginStatus(enum.StrEnum):
    OK = "ok"
    BROKEN = "broken"  # failed to import, or its hooks or registrations are invalid
    INCOMPATIBLE = "incompatible"  # its declared plugin API range excludes this core
    DISABLED = "disabled"  # not loaded: blocked, not allowed, or autoloading is off


# The records below are dataclasses, not attrs classes as options are: ``forge list-plugins``
# needs them but no options class, and importing attrs would cost it a tenth of its start-up.


@dataclasses.dataclass(slots=True)
class PluginInfo:
    """One plugin: an entry point in the ``forge_lm`` group, or one of the core's built-ins."""

    name: str
    distribution: str
    version: str
    module: str
    builtin: bool = False
    status: PluginStatus = PluginStatus.OK
    reason: str | None = None
    api_range: str | None = None
    components: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    commands: list[str] = dataclasses.field(default_factory=list)  # forge subcommands it adds (register_commands)

    @property
    def label(self) -> str:
        """How messages name the plugin: ``plugin 'moe' (forge-moe 0.1.0)``."""
        return f"plugin '{self.name}' ({self.distribution} {self.version})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "builtin": self.builtin,
            "status": str(self.status),
            "reason": self.reason,
            "api_range": self.api_range,
            "components": {cat: sorted(names) for cat, names in sorted(self.components.items())},
            "commands": sorted(self.commands),
        }


_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")


def check_component_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_PATTERN.match(name):
        raise PluginError(
            f"component name {name!r} is invalid: use lower-case letters, digits, '_', '.' "
            "or '-' (':' is reserved for 'distribution:name')"
        )
    return name


def is_import_path(text: str) -> bool:
    """Whether ``text`` looks like ``"package.module:attribute"``, as a lazily named factory or
    options class must."""
    module, sep, attribute = text.partition(":")
    return bool(module and sep and attribute)


def options_class_problem(config: object) -> str | None:
    """What makes ``config`` unusable as a component's options class, or None.

    It must be an attrs class, and an option that may be None must default to None: TOML has
    no null, so a config file cannot set such an option to None, and a dumped config omits None
    values, so a non-None default would silently come back on reload.
    """
    import attrs  # here: a class given directly imported it already, and listing plugins needs none

    if not (isinstance(config, type) and attrs.has(config)):
        return f"config must be an attrs class, got {config!r}"
    try:
        fields = attrs.fields(attrs.resolve_types(config))
    except Exception as exc:  # noqa: BLE001 - unresolvable annotations are the plugin's bug, reported as such
        return f"options class {config.__name__} has unresolvable type hints: {exc}"
    for field in fields:
        optional = typing.get_origin(field.type) in (typing.Union, types.UnionType) and type(None) in typing.get_args(
            field.type
        )
        default = field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
        if optional and default is not None and default is not attrs.NOTHING:
            return (
                f"option '{field.name}' may be None but defaults to {default!r}; a TOML config cannot "
                "write None, so default it to None (meaning 'derive it') or make it non-optional"
            )
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Component:
    """A registered component: everything needed to validate its options and build it.

    The factory and the options class may each be given as a ``"module:attribute"`` string,
    imported on first use: listing plugins then imports neither (nor what their modules
    import). The fourth argument is the options class or its string, read back through
    :attr:`options_class`.
    """

    category: str
    name: str
    factory: Callable[..., Any] | str
    options_ref: type | str
    description: str
    plugin: PluginInfo
    _imported: dict[str, type] = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def qualified_name(self) -> str:
        return f"{self.plugin.distribution}:{self.name}"

    @property
    def options_class(self) -> type:
        """The options class, imported now if it was registered as ``"module:Class"`` and then
        checked as ``register()`` checks a class it is given; a failure is a PluginError naming
        the component, its plugin and the fix."""
        if isinstance(self.options_ref, type):
            return self.options_ref
        if "options" not in self._imported:
            found = self._import(self.options_ref, "configured", f"its options class '{self.options_ref}'")
            problem = options_class_problem(found)
            if problem is not None:
                raise PluginError(
                    f"{singular(self.category)} '{self.name}' from {self.plugin.label} cannot be configured: its "
                    f"options class '{self.options_ref}' is unusable: {problem}. This is a bug in "
                    f"{self.plugin.distribution} {self.plugin.version}: report it to its authors."
                )
            self._imported["options"] = found
        return self._imported["options"]

    def load_factory(self) -> Callable[..., Any]:
        """The factory, importing it now if it was registered as ``"module:attribute"``."""
        if callable(self.factory):
            return self.factory
        return self._import(self.factory, "built", f"'{self.factory}'")

    def _import(self, path: str, use: str, what: str) -> Any:
        module_name, _, attribute = path.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except Exception as exc:  # whatever the import raises, the fix is the same
            dist = self.plugin.distribution
            raise PluginError(
                f"{singular(self.category)} '{self.name}' from {self.plugin.label} cannot be {use}: importing "
                f"{what} failed with {type(exc).__name__}: {exc}. Reinstall it with "
                f"its dependencies (pip install --force-reinstall {dist}) or uninstall it "
                f"(pip uninstall {dist})."
            ) from exc

    def build(self, options: Any, *args: Any, **kwargs: Any) -> Any:
        """Call the factory with the component's validated options and the category's arguments."""
        return self.load_factory()(options, *args, **kwargs)

    def build_for_run(self, options: Any, *args: Any, **kwargs: Any) -> Any:
        """:meth:`build`, where a factory failing with anything but a ForgeError (which says what
        to fix) is reported as a PluginError naming the component and its plugin, not as a
        traceback: what a run (``forge train``, ``forge eval``, ...) shows its user. What the
        factory returns is checked against its category's basic contract
        (:mod:`forge_lm.plugins._contracts`): a wrong object is a PluginError too, raised here
        rather than wherever the object is first used."""
        try:
            built = self.build(options, *args, **kwargs)
        except ForgeError:
            raise
        except Exception as exc:
            from forge_lm.plugins._calls import describe  # _calls imports this module

            advice = (
                "Check its options"
                if self.plugin.builtin
                else f"Check its options; if they are right, this is a bug in {self.plugin.distribution}: report "
                "it to its authors"
            )
            raise PluginError(
                f"{singular(self.category)} '{self.name}' from {self.plugin.label} could not be built: "
                f"{describe(exc)}. {advice}."
            ) from exc
        # Imported here: the contracts import forge_lm.components, which listing plugins never needs.
        from forge_lm.plugins._contracts import contract_problem

        problem = contract_problem(self.category, built)
        if problem is not None:
            noun = singular(self.category)
            instead = (
                "leave it out of the run's config"
                if self.category in ("evaluators", "metrics_backends")
                else f"choose another {noun}"
            )
            raise PluginError(
                f"{noun} '{self.name}' from {self.plugin.label} cannot be used: its factory returned {problem}. "
                f"This is a bug in {self.plugin.distribution} {self.plugin.version}: report it to its authors, or "
                f"{instead}."
            )
        return built
