"""``forge eval RUN_OR_CHECKPOINT --tasks TASKS``: lm-evaluation-harness tasks on a checkpoint.

This plugin adds the command to ``forge`` (``forge_lm_register_commands``); without the plugin,
``forge eval`` says which package to install (exit 2). The command runs this plugin's
``lm_eval`` evaluator, resolved through the plugin registry like any component, on the loaded
model as it runs during training; its ``table`` (lm-eval's results table) is printed and its
``results`` (lm-eval's results, JSON) written to ``<run>/eval/step_<N>.json``, or to
``--output``. Links in the run are not followed: an ``eval/`` or a results file there that is a
link is refused before anything is loaded (exit 2), and the results file is created anew, never
written through a link put there meanwhile.

Kept free of heavy imports at the top: ``forge --help`` imports this module to list the command.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from forge_lm import api
from forge_lm.components import EvaluatorContext, ReportsResults
from forge_lm.errors import ConfigError, ForgeError, UsageError

EVALUATOR = "lm_eval"
RESULTS_DIR = "eval"
LINK_FIX = "Remove the link, or write the results elsewhere with --output PATH."


class EvalCommand:
    """``forge eval`` (a :class:`forge_lm.components.Command`)."""

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run directory or checkpoints/step_<N>")
        parser.add_argument(
            "--tasks",
            action="append",
            required=True,
            metavar="TASKS",
            help="lm-eval task, group or tag names and task YAML files, comma-separated (repeatable)",
        )
        parser.add_argument(
            "--include-path",
            action="append",
            metavar="DIR",
            help="also index the task YAML files in DIR, so its tasks and groups can be named (repeatable)",
        )
        parser.add_argument("--limit", type=int, default=None, help="at most N examples per task (default: all)")
        parser.add_argument(
            "--batch-size", type=int, default=None, help="sequences per forward pass (default: the run's)"
        )
        parser.add_argument(
            "--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)"
        )
        parser.add_argument(
            "--output",
            default=None,
            metavar="PATH",
            help="write the results JSON here (default: <run>/eval/step_<N>.json)",
        )

    def run(self, args: Any, plugins: Any) -> int:
        import torch

        component = plugins.registry.resolve("evaluators", EVALUATOR)  # this plugin's: loaded with the command
        options = _options(plugins, component, args)
        checkpoint, run_dir, step = api.locate_checkpoint(Path(args.checkpoint))
        output = Path(args.output) if args.output else _results_path(run_dir, step)  # refuses a link there
        model, config, tokenizer = api.load_for_inference(checkpoint, plugins)
        context = EvaluatorContext(
            run_dir=run_dir,
            tokenizer=tokenizer,
            vocab_size=config.model.options.vocab_size or tokenizer.vocab_size,
            seq_len=config.train.seq_len,
            max_seq_len=config.model.options.max_seq_len,
            batch_size=config.train.batch_size,
            device=torch.device("cpu"),
            dtype=None,
        )
        # Built as a training run builds it: a factory failing with anything but a ForgeError is
        # reported naming the plugin, not as a traceback.
        evaluator = api.ComponentConfig(component.name, options, component).build(context)
        with torch.no_grad():
            evaluator.evaluate(model, step)
        if not isinstance(evaluator, ReportsResults) or not isinstance(evaluator.results, dict):
            raise ForgeError(f"evaluator '{EVALUATOR}' ({component.plugin.label}) returned no results to write")
        print(evaluator.table)
        results = {**evaluator.results, "forge": {"run": str(run_dir), "checkpoint": str(checkpoint), "step": step}}
        _write(output, run_dir, json.dumps(results, indent=2, ensure_ascii=False) + "\n", chosen=bool(args.output))
        print(f"wrote the results of step {step} to {output}")
        return 0


COMMAND = EvalCommand()


def _options(plugins: Any, component: Any, args: Any) -> Any:
    """``[eval.lm_eval]``'s options from the command line; a bad one is named by its switch."""
    table = {
        "tasks": [task.strip() for value in args.tasks for task in value.split(",") if task.strip()],
        **{
            key: value
            for key in ("include_path", "limit", "batch_size", "num_fewshot")
            if (value := getattr(args, key)) is not None
        },
    }
    try:
        return api.structure_options(plugins.registry, component, table, f"eval.{EVALUATOR}")
    except ConfigError as exc:  # the options came from this command line: name its switches
        message = re.sub(rf"\[eval\.{EVALUATOR}\] (\w+):", lambda m: f"--{m[1].replace('_', '-')}:", str(exc))
        raise UsageError(message) from None


def _write(output: Path, run_dir: Path, text: str, *, chosen: bool) -> None:
    try:
        if chosen:  # the user's own choice of a path
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(text, encoding="utf-8")
        else:  # inside the run: created anew, through no link
            api.make_run_dirs(run_dir, RESULTS_DIR, fix=LINK_FIX)
            api.write_run_text(output, text, new=True)
    except OSError as exc:
        raise ForgeError(f"cannot write the results to '{output}': {exc.strerror or exc}") from None


def _results_path(run_dir: Path, step: int | None) -> Path:
    """``<run>/eval/step_<N>.json``, or ``step_<N>-2.json``... when taken: results are never replaced.
    An ``eval/`` or a results file that is a link (dangling or not) is refused, naming it."""
    api.refuse_links(run_dir, [RESULTS_DIR], LINK_FIX)
    directory = run_dir / RESULTS_DIR
    stem = f"step_{step}"
    path, number = directory / f"{stem}.json", 1
    while os.path.lexists(path):
        api.refuse_links(directory, [path.name], LINK_FIX)
        number += 1
        path = directory / f"{stem}-{number}.json"
    return path
