"""lm-eval's side: which tasks to run, the harness call, and its numbers as Forge metrics."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table

from forge_lm.errors import ForgeError, did_you_mean
from forge_lm_eval.data_files import find_data_files_beside_tasks
from forge_lm_eval.lm import generation_settings
from forge_lm_eval.safety import (
    describe_template_error,
    refuse_task_code,
    sandbox_templates,
    scan_task_files,
    template_error,
)

# Task templates come from untrusted files; lm-eval's own Jinja environment would let them run
# Python. Every template lm-eval renders in this process goes through a sandbox from here on,
# before any task is loaded (forge_lm_eval.safety says how).
sandbox_templates()
# A task file's relative data files are looked for beside it, so the task runs from any directory.
find_data_files_beside_tasks()

TASK_FILE_SUFFIXES = (".yaml", ".yml")


def is_task_file(spec: str) -> bool:
    """A task given as a YAML file rather than by name."""
    return spec.endswith(TASK_FILE_SUFFIXES)


class TaskSet:
    """The tasks to run: lm-eval task, group or tag names, and task YAML files.

    Checked when made, so a misspelt name or a missing file stops a run before it trains:
    names against lm-eval's index, files and directories for existence; then every task is
    loaded once (which reads, or downloads, its dataset) and the generation settings of
    generation tasks are checked against the model's ``max_length``.

    lm-eval indexes the YAML files under ``include_path`` and beside each task file given, so
    those tasks and groups can be named; its index of its own tasks takes seconds to build, so it
    is read only when a name is not found there.
    """

    def __init__(self, specs: Sequence[str], max_length: int, include_path: Sequence[str] = ()) -> None:
        if not specs:
            raise ForgeError("no lm-eval task given; name at least one task, or a task YAML file")
        files = [Path(spec).expanduser().resolve() for spec in specs if is_task_file(spec)]
        for spec, path in zip([s for s in specs if is_task_file(s)], files, strict=True):
            if not path.is_file():
                raise ForgeError(f"task file '{spec}' does not exist (a task given by path must be a YAML file)")
        directories = [Path(directory).expanduser().resolve() for directory in include_path]
        for given, directory in zip(include_path, directories, strict=True):
            if not directory.is_dir():
                raise ForgeError(f"task directory '{given}' (include_path) is not a directory")
        local = sorted({*map(str, directories), *(str(path.parent) for path in files)})
        # lm-eval imports `!function` code while it loads a file, so every file it may load for these
        # tasks is scanned first, and code in them is refused unless the user trusts it.
        self.scan = scan_task_files(files, [Path(directory) for directory in local])
        refuse_task_code(self.scan)
        names = [spec for spec in specs if not is_task_file(spec)]
        self.manager = TaskManager(include_path=local or None, include_defaults=False)
        if any(name not in self.manager.all_tasks for name in names):
            self.manager = TaskManager(include_path=local or None, include_defaults=True)
        for name in names:
            if name not in self.manager.all_tasks:
                raise ForgeError(
                    f"unknown lm-eval task '{name}'.{did_you_mean(name, self.manager.all_tasks)} "
                    "`lm-eval ls tasks` lists the tasks lm-eval knows; give your own as a YAML file path, or "
                    "their directory in include_path."
                )
        # Files by absolute path: the tasks stay the same if the working directory changes.
        by_path = iter(files)
        self.specs = [str(next(by_path)) if is_task_file(spec) else spec for spec in specs]
        try:
            loaded = self.manager.load(self.specs)
        except Exception as exc:  # a task config or its dataset may fail in any way
            if (stopped := template_error(exc)) is not None:
                raise describe_template_error(stopped, self.scan, specs) from None
            raise ForgeError(f"lm-eval could not load the tasks {list(specs)}: {type(exc).__name__}: {exc}") from exc
        for name, task in loaded["tasks"].items():
            if task.get_config("output_type") == "generate_until":
                generation_settings(task.get_config("generation_kwargs") or {}, max_length, name)


def run_tasks(
    lm: Any, tasks: TaskSet, *, limit: int | None = None, num_fewshot: int | None = None
) -> dict[str, Any] | None:
    """lm-eval's results for ``tasks`` on ``lm``, as JSON data (None where lm-eval returns
    none: a process whose ``LOCAL_RANK`` is not 0).

    lm-eval seeds Python's, NumPy's and torch's global generators before it runs (its defaults,
    which fix few-shot sampling); they are put back afterwards, so a training run goes on
    drawing the numbers it would have drawn without the evaluation.
    """
    with _global_rngs_restored(lm.device):
        try:
            results = simple_evaluate(
                model=lm,
                tasks=list(tasks.specs),
                task_manager=tasks.manager,
                limit=limit,
                num_fewshot=num_fewshot,
                log_samples=False,
            )
        except Exception as exc:  # a template may reach for Python internals on any document
            if (stopped := template_error(exc)) is not None:
                raise describe_template_error(stopped, tasks.scan, tasks.specs) from None
            raise
    if results is None:
        return None
    # lm-eval's own JSON output goes through the same conversion (NumPy numbers, sets, callables).
    return json.loads(json.dumps(results, default=handle_non_serializable))


def results_table(results: Mapping[str, Any]) -> str:
    """lm-eval's text tables of ``results``: tasks, then groups when there are any."""
    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def metrics_of(results: Mapping[str, Any]) -> dict[str, float]:
    """``eval/<task>/<metric>`` for every number lm-eval reports per task and group.

    lm-eval keys a value ``<metric>,<filter>``; the filter ``none`` (no post-processing) is left
    out of the name, another one is appended: ``eval/gsm8k/exact_match/strict-match``.
    Standard errors are ``<metric>_stderr``; one lm-eval could not compute ("N/A") is left out.
    """
    metrics = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or "," not in key:
                continue  # alias, sample counts and the like
            metric, _, filter_name = key.partition(",")
            name = metric if filter_name == "none" else f"{metric}/{filter_name}"
            metrics[f"eval/{task}/{name}"] = float(value)
    return metrics


@contextlib.contextmanager
def _global_rngs_restored(device: torch.device) -> Iterator[None]:
    python_state, numpy_state = random.getstate(), np.random.get_state()
    accelerators = [device] if device.type != "cpu" else []
    try:
        with torch.random.fork_rng(devices=accelerators, device_type=device.type if accelerators else "cuda"):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
