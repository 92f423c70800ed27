"""``forge``: the command line.

Each core command lives in its own module of this package (named in :data:`COMMANDS`) with
``HELP``, ``TAKES_OVERRIDES``, ``add_arguments(parser)`` and ``run(args, overrides, plugins)``.
Plugins add commands through ``forge_lm_register_commands`` (``forge eval`` is forge-lm-eval's).
A core command imports only its own module and nothing heavy at the top, so ``forge
list-plugins`` stays fast; plugins load only when a command asks for them, a plugin's command
and ``forge --help`` (which lists the plugins' commands) included. Every :class:`ForgeError`
becomes one message and its exit code (2 for a mistake of the user's).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forge_lm.errors import ForgeError, UsageError
from forge_lm.notices import warn
from forge_lm.plugins import (
    ENV_ALLOW,
    ENV_BLOCK,
    ENV_DISABLE_AUTOLOAD,
    PLUGIN_API_VERSION,
    PluginManager,
    PluginSettings,
    core_version,
)
from forge_lm.plugins._calls import noting_ctrl_c

INTERRUPTED_EXIT_CODE = 130  # the shell's convention for a command stopped by Ctrl-C (128 + SIGINT)

COMMANDS: dict[str, str] = {
    "train": "forge_lm.cli._train",
    "generate": "forge_lm.cli._generate",
    "prepare-data": "forge_lm.cli._prepare_data",
    "train-tokenizer": "forge_lm.cli._train_tokenizer",
    "export-hf": "forge_lm.cli._export_hf",
    "import-hf": "forge_lm.cli._import_hf",
    "plot": "forge_lm.cli._plot",
    "profile": "forge_lm.cli._profile",
    "list-plugins": "forge_lm.cli._list_plugins",
    "config": "forge_lm.cli._config",
    "doctor": "forge_lm.cli._doctor",
}
"""The core's commands; plugins add more (``forge_lm_register_commands``: ``forge eval`` is forge-lm-eval's)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors, same shape as ours
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser(manager: PluginManager | None = None, *, only: str | None = None) -> argparse.ArgumentParser:
    """The ``forge`` parser: with ``only``, that core command alone (its module is the only one
    imported); else every core command and every command the loaded plugins add (``manager``,
    or the plugins the environment's switches load)."""
    parser, commands = _top_parser()
    for name in [only] if only else COMMANDS:
        module = importlib.import_module(COMMANDS[name])
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP, allow_abbrev=False)
        module.add_arguments(sub)
    if only is None:
        manager = manager if manager is not None else PluginManager(PluginSettings.from_env())
        for _, command in sorted(manager.commands.items()):
            try:
                _add_plugin_command(commands, command)
            except ForgeError as exc:  # one plugin's broken command does not take the others' help away
                warn(str(exc))
    return parser


def _top_parser() -> tuple[argparse.ArgumentParser, Any]:
    """``forge`` with its own options and no command yet: the parser and its subparsers."""
    parser = _Parser(
        prog="forge",
        description="Forge: pre-train language models with PyTorch, extended by plugins.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=version_text())
    add_plugin_switches(parser, after_command=False)
    return parser, parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)


def _add_plugin_command(commands: Any, command: Any) -> argparse.ArgumentParser:
    """The parser of a plugin's command: its own arguments (``add_arguments``, guarded: a plugin's
    bug names the plugin) and the plugin switches."""
    from forge_lm.plugins._calls import describe

    implementation = command.load()
    sub = commands.add_parser(command.name, help=command.description, description=command.description)
    try:
        implementation.add_arguments(sub)
    except ForgeError:
        raise
    except Exception as exc:
        raise command.failed(f"raised in add_arguments() of its command '{command.name}': {describe(exc)}") from exc
    add_plugin_switches(sub, after_command=True)
    return sub


def add_plugin_switches(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """The plugin switches, accepted before the command and after it alike.

    After the command they default to "not given" (SUPPRESS), so they add to the switches
    given before it instead of resetting them; blocked plugins from both places are combined.
    """
    unset = {"default": argparse.SUPPRESS} if after_command else {}
    switches = parser.add_argument_group(
        "plugin switches", f"also set by {ENV_DISABLE_AUTOLOAD}, {ENV_ALLOW} and {ENV_BLOCK}"
    )
    switches.add_argument("--no-plugin-autoload", action="store_true", help="load no third-party plugins", **unset)
    switches.add_argument("--plugins", metavar="A,B", help="load only these third-party plugins", **unset)
    switches.add_argument(
        "--block-plugin",
        metavar="NAME",
        action="append",
        dest="block_plugin_after_command" if after_command else "block_plugin",
        help="never load this plugin (repeatable)",
        **(unset or {"default": []}),
    )


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """The optional CONFIG file of commands that take a run config (and overrides)."""
    parser.add_argument("config_file", nargs="?", metavar="CONFIG", help="TOML run config (default: built-in defaults)")


def checked_config_file(path: str | None) -> str | None:
    """``path``, unless it is an override missing its dashes (then a clear UsageError)."""
    if path and "=" in path and not Path(path).exists():
        from forge_lm.config import parse_overrides

        parse_overrides([path])
    return path


def version_text() -> str:
    return f"forge {core_version()} (distribution forge-lm, plugin API {PLUGIN_API_VERSION})"


# ``--section.key=value``: a dotted key sets a config value. Taken out before argparse sees the
# command line, because argparse reads an argument containing a space as a positional one.
_OVERRIDE = re.compile(r"^--[A-Za-z_][\w-]*(\.[\w-]+)+=")


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    overrides = [arg for arg in args_in if _OVERRIDE.match(arg)]
    plain = [arg for arg in args_in if not _OVERRIDE.match(arg)]
    try:
        # The plugin switches, wherever they are, and the command word: a core command needs its
        # own module only; a plugin's command needs the plugins loaded before its parser exists.
        switches, rest = _switches_parser().parse_known_args(plain)
        command = next((arg for arg in rest if not arg.startswith("-")), None)
        if command is not None and command not in COMMANDS:
            return _run_plugin_command(command, plain, overrides, switches)
        if command is None:  # forge, forge --help, forge --version
            if "--version" in rest and not {"-h", "--help"} & set(rest):
                _top_parser()[0].parse_known_args(plain)  # prints the version and exits
            parser = build_parser(plugin_manager(switches))
            parser.parse_known_args(plain)  # --help prints and exits
            parser.print_help()
            return 0
        args, rest = build_parser(only=command).parse_known_args(plain)
        module = importlib.import_module(COMMANDS[args.command])
        rest += overrides
        stray = [arg for arg in rest if not (module.TAKES_OVERRIDES and arg.startswith("--") and "=" in arg)]
        if stray:
            hint = " Overrides look like --section.key=value." if module.TAKES_OVERRIDES else ""
            raise UsageError(f"unrecognized arguments: {' '.join(stray)}.{hint}")
        with noting_ctrl_c():  # a KeyboardInterrupt without a SIGINT is a plugin's, not the user's
            return module.run(args, rest, lambda: plugin_manager(args))
    except ForgeError as exc:
        print(f"forge: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # its text, if any, says what the Ctrl-C cut short
        print(f"forge: interrupted {exc}" if str(exc) else "forge: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


def _switches_parser() -> argparse.ArgumentParser:
    """Only the plugin switches, read from anywhere in the command line (before the command or
    after it), to load the plugins before a plugin's command is parsed."""
    parser = _Parser(prog="forge", add_help=False, allow_abbrev=False)
    add_plugin_switches(parser, after_command=False)
    return parser


def _run_plugin_command(name: str, plain: list[str], overrides: list[str], switches: argparse.Namespace) -> int:
    """``forge NAME ...`` for a command a loaded plugin registered; a name no plugin offers is a
    UsageError that says which plugin provides it (a first-party command) or what the commands are."""
    from forge_lm.plugins._calls import describe

    manager = plugin_manager(switches)
    command = manager.commands.get(name)
    if command is None:
        raise _unknown_command(name, manager)
    parser, subparsers = _top_parser()
    _add_plugin_command(subparsers, command)
    args, stray = parser.parse_known_args(plain)
    stray += overrides
    if stray:
        raise UsageError(f"unrecognized arguments: {' '.join(stray)}.")
    implementation = command.load()
    with noting_ctrl_c():
        try:
            code = implementation.run(args, manager)
        except (ForgeError, KeyboardInterrupt):
            raise
        except Exception as exc:  # the plugin's bug: named, not a traceback
            raise command.failed(f"raised in run() of its command '{name}': {describe(exc)}") from exc
    if isinstance(code, bool) or not isinstance(code, int):
        raise command.failed(f"returned {type(code).__name__} from run() of its command '{name}', not an exit code")
    return code


def _unknown_command(name: str, manager: PluginManager) -> UsageError:
    from forge_lm.errors import did_you_mean
    from forge_lm.plugins._hints import KNOWN_COMMANDS

    distribution = KNOWN_COMMANDS.get(name)
    if distribution is None:
        known = [*COMMANDS, *manager.commands]
        return UsageError(
            f"argument COMMAND: invalid choice: '{name}'.{did_you_mean(name, known)} Commands: "
            f"{', '.join(sorted(known))} (see 'forge --help')"
        )
    present = next((p for p in manager.plugins if p.distribution == distribution), None)
    if present is None:
        return UsageError(
            f"forge {name} is a command of the {distribution} plugin, which is not installed: "
            f"pip install {distribution}"
        )
    return UsageError(
        f"forge {name} is a command of {present.label}, which is installed but {present.status}: {present.reason}. "
        "Enable it to use its commands."
    )


def plugin_manager(args: argparse.Namespace) -> PluginManager:
    """The plugins, loaded with the environment's switches and the command line's."""
    settings = PluginSettings.from_env().with_cli(
        no_autoload=args.no_plugin_autoload,
        allow=args.plugins,
        block=[*args.block_plugin, *getattr(args, "block_plugin_after_command", [])],
    )
    manager = PluginManager(settings)
    for warning in manager.warnings:
        warn(str(warning))
    return manager


def run() -> None:
    """Console-script entry point."""
    code = main()
    launch = sys.modules.get("forge_lm.distributed.launch")  # imported only by commands that use torch
    if launch is not None and launch.JOINED:  # a distributed run: see exit_process
        launch.exit_process(code)
    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()[1:]):
        # A plugin's thread that is not a daemon (named by forge_lm.train.watchdog.wait_for_threads) would keep
        # the interpreter waiting at exit forever: the process ends without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
