"""``forge``: the command line. Parses arguments, loads plugins only for commands that need
them, and turns every :class:`ForgeError` into a one-paragraph message and exit code 2."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from forge_lm.errors import USAGE_EXIT_CODE, ForgeError, UsageError
from forge_lm.plugins import (
    ENV_ALLOW,
    ENV_BLOCK,
    ENV_DISABLE_AUTOLOAD,
    PLUGIN_API_VERSION,
    PluginManager,
    PluginSettings,
    core_version,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors, same shape as ours
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="forge",
        description="Forge: pre-train language models with PyTorch, extended by plugins.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=version_text())
    _add_plugin_switches(parser, after_command=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    listing = commands.add_parser("list-plugins", help="show installed plugins and their components")
    listing.add_argument("--json", action="store_true", help="print JSON for scripts")
    _add_plugin_switches(listing, after_command=True)

    config = commands.add_parser("config", help="show or validate a run config")
    config_commands = config.add_subparsers(dest="config_command", metavar="ACTION", parser_class=_Parser)
    for action, text in (
        ("show", "print the fully resolved config as TOML"),
        ("validate", "check a config; exit 0 if valid, 2 if not"),
    ):
        sub = config_commands.add_parser(
            action, help=text, description=f"{text[0].upper()}{text[1:]}. Overrides: --section.key=value."
        )
        sub.add_argument(
            "config_file", nargs="?", metavar="CONFIG", help="TOML run config (default: built-in defaults)"
        )
        _add_plugin_switches(sub, after_command=True)
    return parser


def _add_plugin_switches(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
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


def version_text() -> str:
    return f"forge {core_version()} (distribution forge-lm, plugin API {PLUGIN_API_VERSION})"


# ``--section.key=value``: a dotted key sets a config value. Taken out before argparse sees the
# command line, because argparse reads an argument containing a space as a positional one.
_OVERRIDE = re.compile(r"^--[A-Za-z_][\w-]*(\.[\w-]+)+=")


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    overrides = [arg for arg in args_in if _OVERRIDE.match(arg)]
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args([arg for arg in args_in if not _OVERRIDE.match(arg)])
        rest += overrides
        if args.command is None:
            parser.print_help()
            return 0
        return _dispatch(parser, args, rest)
    except ForgeError as exc:
        print(f"forge: error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE


def _plugin_manager(args: argparse.Namespace) -> PluginManager:
    settings = PluginSettings.from_env().with_cli(
        no_autoload=args.no_plugin_autoload,
        allow=args.plugins,
        block=[*args.block_plugin, *getattr(args, "block_plugin_after_command", [])],
    )
    manager = PluginManager(settings)
    for warning in manager.warnings:
        print(f"forge: warning: {warning}", file=sys.stderr)
    return manager


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> int:
    takes_overrides = args.command == "config"
    stray = [arg for arg in rest if not (takes_overrides and arg.startswith("--") and "=" in arg)]
    if stray:
        hint = " Overrides look like --section.key=value." if takes_overrides else ""
        raise UsageError(f"unrecognized arguments: {' '.join(stray)}.{hint}")
    if args.command == "list-plugins":
        from forge_lm.cli._list_plugins import list_plugins

        return list_plugins(_plugin_manager(args), as_json=args.json)
    if args.command == "config":
        if args.config_command is None:
            raise UsageError("say what to do with the config: 'forge config show' or 'forge config validate'.")
        from pathlib import Path

        from forge_lm.cli._config import config_command
        from forge_lm.config import parse_overrides

        if args.config_file and "=" in args.config_file and not Path(args.config_file).exists():
            parse_overrides([args.config_file])

        return config_command(_plugin_manager(args), args.config_command, args.config_file, rest)
    raise UsageError(f"unknown command '{args.command}'")  # argparse rejects these first


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
