"""The options of forge-lm-eval's ``lm_eval`` evaluator: the keys of ``[eval.lm_eval]``.

Named by import path in :mod:`forge_lm_eval.plugin`'s registration, so that listing plugins does
not import this module (nor attrs).
"""

from __future__ import annotations

from typing import Any

import attrs

from forge_lm.validators import FieldError, positive


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
