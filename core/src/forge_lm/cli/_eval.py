"""``forge eval RUN_OR_CHECKPOINT --tasks TASKS``: lm-evaluation-harness tasks on a checkpoint.

The work is done by the ``lm_eval`` evaluator, which the forge-lm-eval plugin registers; the
command finds it through the plugin registry like any component, so a missing plugin, or one a
switch turns off, is one message (exit 2) saying what to install or enable. The evaluator runs
on the loaded model as it runs during training; its ``table`` (lm-eval's results table) is
printed and its ``results`` (lm-eval's results, JSON) written to ``<run>/eval/step_<N>.json``,
or to ``--output``. Links in the run are not followed: an ``eval/`` or a results file there
that is a link is refused before anything is loaded (exit 2), and the results file is created
anew, never written through a link put there meanwhile.
"""

from __future__ import annotations

HELP = "run lm-evaluation-harness tasks on a checkpoint (needs the forge-lm-eval plugin)"
TAKES_OVERRIDES = False
EVALUATOR = "lm_eval"
RESULTS_DIR = "eval"
LINK_FIX = "Remove the link, or write the results elsewhere with --output PATH."


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_plugin_switches

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
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per forward pass (default: the run's)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    parser.add_argument(
        "--output", default=None, metavar="PATH", help="write the results JSON here (default: <run>/eval/step_<N>.json)"
    )
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    import json
    import re
    from pathlib import Path

    import torch

    from forge_lm.components import EvaluatorContext
    from forge_lm.config import ComponentConfig, structure_options
    from forge_lm.errors import ConfigError, ForgeError, PluginError, UsageError
    from forge_lm.plugins._hints import known_provider
    from forge_lm.run_links import make_dirs, write_text
    from forge_lm.train.inference import load_for_inference

    manager = plugins()
    # First: without the plugin there is nothing to do, and the registry says what to install
    # or enable.
    try:
        component = manager.registry.resolve("evaluators", EVALUATOR)
    except PluginError as exc:
        raise PluginError(
            f"forge eval runs the evaluator '{EVALUATOR}' of the {known_provider('evaluators', EVALUATOR)} plugin, "
            f"which cannot be used here:\n{exc}"
        ) from None
    table = {
        "tasks": [task.strip() for value in args.tasks for task in value.split(",") if task.strip()],
        **{
            key: value
            for key in ("include_path", "limit", "batch_size", "num_fewshot")
            if (value := getattr(args, key)) is not None
        },
    }
    try:
        options = structure_options(manager.registry, component, table, f"eval.{EVALUATOR}")
    except ConfigError as exc:  # the options came from this command line: name its switches
        message = re.sub(rf"\[eval\.{EVALUATOR}\] (\w+):", lambda m: f"--{m[1].replace('_', '-')}:", str(exc))
        raise UsageError(message) from None
    checkpoint, run_dir, step = _checkpoint(Path(args.checkpoint))
    output = Path(args.output) if args.output else _results_path(run_dir, step)  # refuses a link there
    model, config, tokenizer = load_for_inference(checkpoint, manager)
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
    evaluator = ComponentConfig(component.name, options, component).build(context)
    with torch.no_grad():
        evaluator.evaluate(model, step)
    results = getattr(evaluator, "results", None)
    if not isinstance(results, dict):
        raise ForgeError(f"evaluator '{EVALUATOR}' ({component.plugin.label}) returned no results to write")
    print(getattr(evaluator, "table", ""))
    results["forge"] = {"run": str(run_dir), "checkpoint": str(checkpoint), "step": step}
    text = json.dumps(results, indent=2, ensure_ascii=False) + "\n"
    try:
        if args.output:  # the user's own choice of a path
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(text, encoding="utf-8")
        else:  # inside the run: created anew, through no link
            make_dirs(run_dir, RESULTS_DIR, fix=LINK_FIX)
            write_text(output, text, new=True)
    except OSError as exc:
        raise ForgeError(f"cannot write the results to '{output}': {exc.strerror or exc}") from None
    print(f"wrote the results of step {step} to {output}")
    return 0


def _checkpoint(path):
    """``(checkpoint to load, run directory, step)`` for a run directory or one of its step
    directories. Of a run, the newest checkpoint that passes the checks that load no tensor
    (those of ``forge doctor``), after a warning for each newer one passed over; a newest one
    that names code to run is left to the loader, which refuses it."""
    import sys

    from forge_lm.checkpoint import CHECKPOINTS, CheckpointManager, step_of
    from forge_lm.train.run_dir import CONFIG_FILE

    if step_of(path) is not None and path.parent.name == CHECKPOINTS:
        return path, path.parent.parent, step_of(path)
    if (path / CONFIG_FILE).is_file():
        for candidate, problem in CheckpointManager(path).survey():
            if problem is None:
                return candidate, path, step_of(candidate)
            if problem.startswith("UNSAFE"):
                break
            print(f"forge: warning: passed over checkpoint {candidate.name}: {problem}", file=sys.stderr)
    return path, path, None  # the loader says what is wrong with it


def _results_path(run_dir, step):
    """``<run>/eval/step_<N>.json``, or ``step_<N>-2.json``... when taken: results are never replaced.
    An ``eval/`` or a results file that is a link (dangling or not) is refused, naming it."""
    import os

    from forge_lm.run_links import refuse_links

    refuse_links(run_dir, [RESULTS_DIR], LINK_FIX)
    directory = run_dir / RESULTS_DIR
    stem = f"step_{step}"
    path, number = directory / f"{stem}.json", 1
    while os.path.lexists(path):
        refuse_links(directory, [path.name], LINK_FIX)
        number += 1
        path = directory / f"{stem}-{number}.json"
    return path
