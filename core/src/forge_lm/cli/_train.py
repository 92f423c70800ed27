"""``forge train [CONFIG] [--section.key=value ...]``: train a model.

With no CONFIG it trains the embedded default: a small model on the source text of Python's
standard library, which every machine with Python has, so it needs no download.
"""

from __future__ import annotations

import sys

HELP = "train a model (no CONFIG: the embedded default run)"
TAKES_OVERRIDES = True


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_config_argument, add_plugin_switches

    add_config_argument(parser)
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    from forge_lm.cli._main import checked_config_file
    from forge_lm.config import load_config

    path = checked_config_file(args.config_file)
    manager = plugins()
    config = load_config(path, overrides, manager.registry)
    manager.configure(config)  # every plugin checks the config before anything is built

    from forge_lm.distributed import detect_launch
    from forge_lm.train import train
    from forge_lm.train.resilience import (
        NONFINITE_EXIT_CODE,
        PREEMPTED_EXIT_CODE,
        NonFiniteLoss,
        Preempted,
    )

    try:
        result = train(config, manager)
    except Preempted as stop:
        print(
            f"forge: {stop.signal_name} received: saved a checkpoint at step {stop.step} and stopped; "
            "run the same command to resume.",
            file=sys.stderr,
        )
        return PREEMPTED_EXIT_CODE
    except NonFiniteLoss as stop:
        print(f"forge: error: {stop}", file=sys.stderr)
        return NONFINITE_EXIT_CODE
    if detect_launch().rank == 0:  # under torchrun, one summary line for the whole run
        print(f"trained {result.steps} steps; final loss {result.final_loss:.4f}; run directory {result.run_dir}")
    return 0
