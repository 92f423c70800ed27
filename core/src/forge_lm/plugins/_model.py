"""What the plugin manager knows about a plugin and about each component it registered."""

from __future__ import annotations

import enum
import importlib
import re
from collections.abc import Callable
from typing import Any

import attrs

from forge_lm.errors import ForgeError, PluginError
from forge_lm.plugins._categories import singular
from forge_lm.plugins._contracts import contract_problem


class PluginStatus(enum.StrEnum):
    OK = "ok"
    BROKEN = "broken"  # failed to import, or its hooks or registrations are invalid
    INCOMPATIBLE = "incompatible"  # its declared plugin API range excludes this core
    DISABLED = "disabled"  # not loaded: blocked, not allowed, or autoloading is off


@attrs.define
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
    components: dict[str, list[str]] = attrs.Factory(dict)
    commands: list[str] = attrs.Factory(list)  # the forge subcommands it adds (forge_lm_register_commands)

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


@attrs.frozen
class Component:
    """A registered component: everything needed to validate its options and build it."""

    category: str
    name: str
    factory: Callable[..., Any] | str
    options_class: type
    description: str
    plugin: PluginInfo

    @property
    def qualified_name(self) -> str:
        return f"{self.plugin.distribution}:{self.name}"

    def load_factory(self) -> Callable[..., Any]:
        """The factory, importing it now if it was registered as ``"module:attribute"``."""
        if callable(self.factory):
            return self.factory
        module_name, _, attribute = self.factory.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except Exception as exc:  # whatever the import raises, the fix is the same
            dist = self.plugin.distribution
            raise PluginError(
                f"{singular(self.category)} '{self.name}' from {self.plugin.label} cannot be built: importing "
                f"'{self.factory}' failed with {type(exc).__name__}: {exc}. Reinstall it with "
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
