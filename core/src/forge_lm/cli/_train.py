"""``forge train [CONFIG] [--section.key=value ...]``: train a model.

With no CONFIG it trains the embedded default: a small model on the source text of Python's
standard library, which every machine with Python has, so it needs no download.

SIGTERM and SIGUSR1 are noted from the very start of the command: one during start-up stops
it at the next safe point with exit 75 and nothing written (see forge_lm.train.resilience).
"""

from __future__ import annotations

import signal
import sys
import threading

HELP = "train a model (no CONFIG: the embedded default run)"
TAKES_OVERRIDES = True
_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
_PREEMPTED_EXIT_CODE = 75  # resilience.PREEMPTED_EXIT_CODE; importing it would import torch
_THREAD_WAIT_S = 30.0  # the most a run's end waits for threads a plugin left running (less with a shorter hang_timeout)


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_config_argument, add_plugin_switches

    add_config_argument(parser)
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    noted: list[int] = []  # preemption signals before the training code (and torch) is imported
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for name in _PREEMPTION_SIGNALS:
            sig = getattr(signal, name)
            previous[sig] = signal.signal(sig, lambda signum, frame: noted.append(signum))
    try:
        return _run(args, overrides, plugins, noted)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args, overrides, plugins, noted: list[int]) -> int:
    from forge_lm.cli._main import checked_config_file
    from forge_lm.config import load_config

    path = checked_config_file(args.config_file)
    manager = plugins()
    notes: list[str] = []  # options of a replaced component that a later layer dropped
    config = load_config(path, overrides, manager.registry, notes)
    for note in notes:
        print(f"forge: note: {note}", file=sys.stderr)
    manager.configure(config)  # every plugin checks the config before anything is built
    if noted:  # the first safe point: nothing built, nothing written
        return _stopped_at_startup(signal.Signals(noted[0]).name)

    from forge_lm.plugins._calls import PLUGIN_HOOK_EXIT_CODE
    from forge_lm.train.watchdog import ThreadFailures, wait_for_threads

    before = set(threading.enumerate())
    with ThreadFailures() as threads:
        try:
            code = _train(config, manager, noted)
        finally:  # a plugin's non-daemon thread would keep the process alive forever
            wait = config.resilience.hang_timeout or _THREAD_WAIT_S
            wait_for_threads(before, min(wait, _THREAD_WAIT_S))
    if threads.failures and code == 0:
        print(
            f"forge: error: the run ended, but {len(threads.failures)} of its threads raised (above); exiting with "
            f"{PLUGIN_HOOK_EXIT_CODE}. The newest checkpoint is intact; fix or remove the plugin that started them.",
            file=sys.stderr,
        )
        return PLUGIN_HOOK_EXIT_CODE
    return code


def _train(config, manager, noted: list[int]) -> int:
    """Train, and say how the run ended; the exit code."""
    from forge_lm.distributed import detect_launch
    from forge_lm.plugins._calls import PLUGIN_HOOK_EXIT_CODE, PluginHookFailed
    from forge_lm.train import train
    from forge_lm.train.resilience import (
        NONFINITE_EXIT_CODE,
        PREEMPTED_EXIT_CODE,
        NonFiniteLoss,
        Preempted,
        PreemptedAtStartup,
        StartupSignals,
        check_startup,
    )
    from forge_lm.train.saving import SAVE_FAILED_EXIT_CODE, CheckpointSaveFailed

    try:
        with StartupSignals(config.resilience.signal_timeout, noted):
            check_startup()
            result = train(config, manager)
    except PreemptedAtStartup as stop:
        return _stopped_at_startup(stop.signal_name)
    except Preempted as stop:
        if detect_launch().rank == 0:  # every rank saved its part; the run says it once
            print(
                f"forge: {stop.signal_name} received: saved a checkpoint at step {stop.step} and stopped; "
                "run the same command to resume.",
                file=sys.stderr,
            )
        return PREEMPTED_EXIT_CODE
    except NonFiniteLoss as stop:
        print(f"forge: error: {stop}", file=sys.stderr)
        return NONFINITE_EXIT_CODE
    except PluginHookFailed as stop:  # a plugin's training hook failed; the message says what is intact
        print(f"forge: error: {stop}", file=sys.stderr)
        return PLUGIN_HOOK_EXIT_CODE
    except CheckpointSaveFailed as stop:  # checkpoints could not be written; the previous one is intact
        print(f"forge: error: {stop}", file=sys.stderr)
        return SAVE_FAILED_EXIT_CODE
    if detect_launch().rank == 0:  # under torchrun, one summary line for the whole run
        if result.steps == result.resumed_at:  # resumed a finished run: no step, so no final loss
            print(_already_complete(config, result))
        else:
            print(f"trained {result.steps} steps; final loss {result.final_loss:.4f}; run directory {result.run_dir}")
    return 0


def _already_complete(config, result) -> str:
    """What a start that found its run finished says: the run's last logged loss and how to go on."""
    from forge_lm.metrics.jsonl import last_logged

    line = (
        f"nothing to train: run directory {result.run_dir} already has {result.steps} steps "
        f"(train.max_steps={config.train.max_steps})"
    )
    jsonl = [backend for backend in config.metrics.backends if backend.name in ("jsonl", "forge-lm:jsonl")]
    filename = getattr(jsonl[0].options, "filename", None) if jsonl else None
    logged = last_logged(result.run_dir / filename, "loss") if filename else None
    if logged is not None:
        step, loss = logged
        line += f"; last logged loss {loss:.4f} at step {step}"
    return line + f". To train further, run the same command with --train.max_steps=N, N above {result.steps}."


def _stopped_at_startup(signal_name: str) -> int:
    from forge_lm.distributed import detect_launch

    if detect_launch().rank != 0:  # the same on every rank: said once
        return _PREEMPTED_EXIT_CODE
    print(
        f"forge: {signal_name} received during start-up: stopped before the first step, with nothing to save; "
        "run the same command to start again.",
        file=sys.stderr,
    )
    return _PREEMPTED_EXIT_CODE
