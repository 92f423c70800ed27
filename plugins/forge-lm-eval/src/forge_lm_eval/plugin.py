"""Forge plugin module of forge-lm-eval (entry point group ``forge_lm``).

Registers the ``lm_eval`` evaluator (options in ``[eval.lm_eval]``) and the ``forge eval``
command, which runs it on a checkpoint (``forge_lm_eval.command``). Kept free of heavy imports:
Forge imports this module to list plugins, and lm-eval (with torch, datasets and transformers
behind it) is imported only when the evaluator is built (``forge_lm_eval.evaluator``).
"""

from __future__ import annotations

from typing import Any

import attrs

from forge_lm import hookimpl
from forge_lm.validators import FieldError, positive

FORGE_LM_PLUGIN_API = ">=1.1,<2"  # 1.1: forge_lm_register_commands


def _tasks(instance: Any, attribute: Any, value: list[str]) -> None:
    if not value:
        raise FieldError(
            attribute.name,
            'name at least one lm-eval task, group or task YAML file, like ["hellaswag"] or ["tasks/my_task.yaml"]',
        )
    for task in value:
        if not isinstance(task, str) or not task.strip():
            raise FieldError(attribute.name, f"every task must be a non-empty string, got {task!r}")


def _directories(instance: Any, attribute: Any, value: list[str]) -> None:
    for directory in value:
        if not isinstance(directory, str) or not directory.strip():
            raise FieldError(attribute.name, f"every directory must be a non-empty string, got {directory!r}")


def _non_negative_or_unset(instance: Any, attribute: Any, value: int | None) -> None:
    if value is not None and value < 0:
        raise FieldError(attribute.name, f"must be >= 0 (or unset), got {value!r}")


@attrs.define
class LmEvalOptions:
    """The keys of ``[eval.lm_eval]``."""

    tasks: list[str] = attrs.field(factory=list, validator=_tasks)  # task, group or tag names, or YAML files
    include_path: list[str] = attrs.field(factory=list, validator=_directories)  # more task YAML directories
    limit: int | None = attrs.field(default=None, validator=positive)  # examples per task; unset: all
    batch_size: int | None = attrs.field(default=None, validator=positive)  # unset: [train] batch_size
    num_fewshot: int | None = attrs.field(default=None, validator=_non_negative_or_unset)  # unset: each task's own
    every: int = attrs.field(default=1, validator=positive)  # run at every k-th evaluation


@hookimpl
def forge_lm_register_evaluators(register):
    register(
        "lm_eval",
        "forge_lm_eval.evaluator:build_lm_eval",
        config=LmEvalOptions,
        description="lm-evaluation-harness tasks (multiple choice, perplexity, generation) on the live model",
    )


@hookimpl
def forge_lm_register_commands(register):
    register(
        "eval",
        "forge_lm_eval.command:COMMAND",
        description="run lm-evaluation-harness tasks on a checkpoint (the forge-lm-eval plugin)",
    )
