"""``forge``: the command line.

Each command lives in its own module of this package (named in :data:`COMMANDS`) with
``HELP``, ``TAKES_OVERRIDES``, ``add_arguments(parser)`` and ``run(args, overrides, plugins)``.
Command modules import nothing heavy at the top, so ``forge --help`` stays fast; plugins load
only when a command asks for them. Every :class:`ForgeError` becomes one message and exit 2.
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

from forge_lm.errors import ForgeError, UsageError
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
    "eval": "forge_lm.cli._eval",
    "export-hf": "forge_lm.cli._export_hf",
    "import-hf": "forge_lm.cli._import_hf",
    "plot": "forge_lm.cli._plot",
    "profile": "forge_lm.cli._profile",
    "list-plugins": "forge_lm.cli._list_plugins",
    "config": "forge_lm.cli._config",
    "doctor": "forge_lm.cli._doctor",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors, same shape as ours
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _command_modules() -> dict[str, object]:
    return {name: importlib.import_module(module) for name, module in COMMANDS.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="forge",
        description="Forge: pre-train language models with PyTorch, extended by plugins.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=version_text())
    add_plugin_switches(parser, after_command=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module in _command_modules().items():
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP, allow_abbrev=False)
        module.add_arguments(sub)
    return parser


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
    try:
        parser = build_parser()
        args, rest = parser.parse_known_args([arg for arg in args_in if not _OVERRIDE.match(arg)])
        if args.command is None:
            parser.print_help()
            return 0
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


def plugin_manager(args: argparse.Namespace) -> PluginManager:
    """The plugins, loaded with the environment's switches and the command line's."""
    settings = PluginSettings.from_env().with_cli(
        no_autoload=args.no_plugin_autoload,
        allow=args.plugins,
        block=[*args.block_plugin, *getattr(args, "block_plugin_after_command", [])],
    )
    manager = PluginManager(settings)
    for warning in manager.warnings:
        print(f"forge: warning: {warning}", file=sys.stderr)
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
