"""``forge config show|validate|reference``."""

from __future__ import annotations

import sys

HELP = "show or validate a run config, or list every option (reference)"
TAKES_OVERRIDES = True

_ACTIONS = {
    "show": "print the fully resolved config as TOML",
    "validate": "check a config and estimate its memory per rank; exit 0 if valid, 2 if not (or if it cannot fit)",
}
REFERENCE = "reference"
_REFERENCE_HELP = (
    "print every option of every section and of every installed component, as Markdown "
    "(docs/config-reference.md is this for the core and the first-party plugins)"
)


def add_arguments(parser) -> None:
    from forge_lm.cli._main import _Parser, add_config_argument, add_plugin_switches

    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", parser_class=_Parser)
    for action, text in _ACTIONS.items():
        sub = actions.add_parser(
            action, help=text, description=f"{text[0].upper()}{text[1:]}. Overrides: --section.key=value."
        )
        add_config_argument(sub)
        add_plugin_switches(sub, after_command=True)
        if action == "validate":
            _add_simulation_arguments(sub)
    reference = actions.add_parser(
        REFERENCE, help=_REFERENCE_HELP, description=_REFERENCE_HELP[0].upper() + _REFERENCE_HELP[1:] + "."
    )
    add_plugin_switches(reference, after_command=True)


def _add_simulation_arguments(parser) -> None:
    """Validate a config for another machine from this one (a preset for an 8-GPU node here)."""
    parser.add_argument(
        "--world-size",
        type=_positive(int),
        metavar="N",
        help="check the config as launched on N ranks (dp_shard = -1 takes them) instead of this launch's",
    )
    parser.add_argument(
        "--device-memory-gib",
        type=_positive(float),
        metavar="GIB",
        help="check the estimate per rank against GIB GiB on each device (a GPU unless [train] device = "
        "'cpu') instead of this machine's free memory; no device is used here",
    )


def _positive(kind):
    import argparse

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
        return value

    return parse


def run(args, overrides, plugins) -> int:
    from forge_lm.cli._main import checked_config_file
    from forge_lm.config import load_config, to_toml
    from forge_lm.errors import UsageError

    if args.config_command is None:
        raise UsageError(
            "say what to do with the config: 'forge config show', 'forge config validate' or 'forge config reference'."
        )
    if args.config_command == REFERENCE:
        from forge_lm.config._reference import reference_markdown

        if overrides:
            raise UsageError(
                "'forge config reference' takes no overrides: it lists every option, whatever a config sets."
            )
        sys.stdout.write(reference_markdown(plugins().registry))
        return 0
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
        sys.stdout.write(_derived_values(config))
    else:
        from forge_lm.cli._status import working

        with working("estimating memory: loading torch, building the model on the meta device"):
            from forge_lm.train.preflight import SimulatedLaunch, validation_report

            simulated = SimulatedLaunch(args.world_size, args.device_memory_gib)
            report = validation_report(config, manager.registry, simulated)  # refuses a run that cannot fit
        print(f"{path or 'the default config'} is valid.")
        print(report)
    return 0


def _derived_values(config) -> str:
    """The values left unset in the config ("derive it") as a run resolves them, as TOML
    comments: a config saved with ``show > run.toml`` keeps deriving them (a tokenizer changed
    later still sizes the vocabulary), and the reader still sees every number the run uses."""
    from forge_lm.config import model_options
    from forge_lm.errors import ForgeError

    options = model_options(config)
    lines = []
    if getattr(options, "vocab_size", 0) is None:
        try:  # building a tokenizer reads its file, not torch: show stays fast
            size = f"{config.tokenizer.build().vocab_size} (the tokenizer's vocabulary)"
        except ForgeError as error:  # a tokenizer file not there yet: say so, the rest still shows
            size = "the tokenizer's vocabulary (not read here: " + " ".join(str(error).split()) + ")"
        lines.append(f"[model] vocab_size = {size}")
    if getattr(options, "n_kv_heads", 0) is None and hasattr(options, "kv_heads"):
        lines.append(f"[model] n_kv_heads = {options.kv_heads} (n_heads: multi-head attention)")
    if getattr(options, "head_dim", 0) is None and hasattr(options, "head_size"):
        lines.append(f"[model] head_dim = {options.head_size} (dim / n_heads)")
    if not lines:
        return ""
    return "\n# Unset above, derived when the run starts:\n" + "".join(f"#   {line}\n" for line in lines)
