"""``forge`` subcommands that plugins add (:func:`forge_lm.hookspecs.forge_lm_register_commands`).

A registration is checked when the plugin loads (its name, and the shape of what it names,
without importing it); the command object is imported and checked when ``forge`` uses it, and
anything wrong with it then is the plugin's failure, naming the plugin (exit 4).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any

from forge_lm.errors import PluginError
from forge_lm.plugins._calls import PluginHookFailed, describe
from forge_lm.plugins._model import PluginInfo

CORE_COMMANDS = (
    "train",
    "generate",
    "prepare-data",
    "train-tokenizer",
    "export-hf",
    "import-hf",
    "plot",
    "profile",
    "list-plugins",
    "config",
    "doctor",
)
"""The core's own commands (``forge_lm.cli``): a plugin may not take their names."""

_COMMAND_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclasses.dataclass(frozen=True, slots=True)  # no attrs: forge list-plugins does not import it
class PluginCommand:
    """A command a plugin registered: its name, what implements it, its help line and plugin."""

    name: str
    target: Any = dataclasses.field(repr=False)  # the command object, or "module:attribute"
    description: str
    plugin: PluginInfo

    def load(self) -> Any:
        """The command object, imported now if registered as a string, with ``add_arguments``
        and ``run`` (:class:`forge_lm.components.Command`); a PluginHookFailed naming the plugin
        otherwise."""
        from forge_lm.components import Command, protocol_methods

        command = self.target
        if isinstance(command, str):
            module_name, _, attribute = command.partition(":")
            try:
                command = getattr(importlib.import_module(module_name), attribute)
            except Exception as exc:  # whatever the import raises, the plugin is at fault
                problem = f"cannot import its command '{self.name}' ('{self.target}'): {describe(exc)}"
                raise self.failed(problem) from exc
        missing = [name for name in protocol_methods(Command) if not callable(getattr(command, name, None))]
        if missing:
            raise self.failed(
                f"registered command '{self.name}' as {type(command).__name__}, without "
                f"{' and '.join(f'{name}()' for name in missing)} (forge_lm.components.Command)"
            )
        return command

    def failed(self, problem: str) -> PluginHookFailed:
        """The plugin-failure error (exit 4) for ``problem``, a sentence about this command."""
        return PluginHookFailed(self.plugin, f"command '{self.name}'", problem)


def make_command(info: PluginInfo, name: object, target: object, description: object) -> PluginCommand:
    """Check one ``register(name, command, description)`` call of ``forge_lm_register_commands``."""
    if not isinstance(name, str) or not _COMMAND_NAME.match(name):
        raise PluginError(
            f"command name {name!r} is invalid: use lower-case letters and digits, words joined by '-' (export-onnx)"
        )
    if name in CORE_COMMANDS:
        raise PluginError(f"registers command '{name}', which is a command of the core; choose another name")
    if isinstance(target, str):
        module_name, colon, attribute = target.partition(":")
        if not (module_name and colon and attribute):
            raise PluginError(f"command '{name}': {target!r} is not a 'module:attribute' string")
    elif target is None:
        raise PluginError(f"command '{name}': the command is None; give an object with add_arguments() and run()")
    if not isinstance(description, str) or "\n" in description or not description.strip():
        raise PluginError(f"command '{name}': description must be one non-empty line (it is the command's --help)")
    return PluginCommand(name, target, description.strip(), info)
