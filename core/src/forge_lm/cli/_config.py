"""``forge config show|validate``."""

from __future__ import annotations

import sys

HELP = "show or validate a run config"
TAKES_OVERRIDES = True

_ACTIONS = {
    "show": "print the fully resolved config as TOML",
    "validate": "check a config and estimate its memory per rank; exit 0 if valid, 2 if not (or if it cannot fit)",
}


def add_arguments(parser) -> None:
    from forge_lm.cli._main import _Parser, add_config_argument, add_plugin_switches

    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", parser_class=_Parser)
    for action, text in _ACTIONS.items():
        sub = actions.add_parser(
            action, help=text, description=f"{text[0].upper()}{text[1:]}. Overrides: --section.key=value."
        )
        add_config_argument(sub)
        add_plugin_switches(sub, after_command=True)


def run(args, overrides, plugins) -> int:
    from forge_lm.cli._main import checked_config_file
    from forge_lm.config import load_config, to_toml
    from forge_lm.errors import UsageError

    if args.config_command is None:
        raise UsageError("say what to do with the config: 'forge config show' or 'forge config validate'.")
    path = checked_config_file(args.config_file)
    manager = plugins()
    notes: list[str] = []  # options of a replaced component that a later layer dropped
    config = load_config(path, overrides, manager.registry, notes)
    manager.configure(config)
    for note in notes:
        print(f"forge: note: {note}", file=sys.stderr)
    if args.config_command == "show":
        # Also as TOML comments, so a config saved with `show > run.toml` still says what it lost.
        sys.stdout.write("".join(f"# {note}\n" for note in notes) + ("\n" if notes else ""))
        sys.stdout.write(to_toml(config))
    else:
        from forge_lm.train.preflight import validation_report

        report = validation_report(config, manager.registry)  # refuses a run that cannot fit in memory here
        print(f"{path or 'the default config'} is valid.")
        print(report)
    return 0
