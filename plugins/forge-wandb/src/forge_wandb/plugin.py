"""Forge plugin module of forge-wandb (entry point group ``forge_lm``).

Registers the ``wandb`` metrics backend (options in ``[metrics.wandb]``) and keeps the W&B
run id in each checkpoint, so a resumed training continues the same W&B run. Kept free of
heavy imports: Forge imports this module to list plugins, and ``wandb`` is imported only
when a run builds the backend (``forge_wandb.backend``).
"""

from __future__ import annotations

from typing import Any

import attrs

from forge_lm import hookimpl
from forge_lm.validators import FieldError
from forge_wandb import _runs

FORGE_LM_PLUGIN_API = ">=1,<2"

MODES = ("online", "offline", "disabled")


def _mode(instance: Any, attribute: Any, value: str | None) -> None:
    if value is not None and value not in MODES:
        allowed = ", ".join(repr(mode) for mode in MODES)
        raise FieldError(attribute.name, f"must be one of {allowed}, or unset to follow WANDB_MODE, got {value!r}")


def _not_empty(instance: Any, attribute: Any, value: str | None) -> None:
    if value is not None and not value.strip():
        raise FieldError(attribute.name, "must not be empty; leave it unset for the default")


def _tags(instance: Any, attribute: Any, value: list[str]) -> None:
    for tag in value:
        if not tag.strip() or len(tag) > 64:
            raise FieldError(attribute.name, f"each tag must be 1 to 64 characters (a W&B limit), got {tag!r}")


@attrs.define
class WandbOptions:
    """The keys of ``[metrics.wandb]``; unset ones leave the choice to W&B (and its WANDB_* variables)."""

    project: str | None = attrs.field(default=None, validator=_not_empty)  # unset: WANDB_PROJECT, else W&B's
    entity: str | None = attrs.field(default=None, validator=_not_empty)  # team or user; unset: your default
    run_name: str | None = attrs.field(default=None, validator=_not_empty)  # unset: the run directory's name
    group: str | None = attrs.field(default=None, validator=_not_empty)  # groups runs in the W&B UI
    tags: list[str] = attrs.field(factory=list, validator=_tags)
    mode: str | None = attrs.field(default=None, validator=_mode)  # online, offline, disabled; unset: WANDB_MODE
    dir: str | None = attrs.field(default=None, validator=_not_empty)  # wandb/ files go here; unset: the run directory


@hookimpl
def forge_lm_register_metrics_backends(register):
    register(
        "wandb",
        "forge_wandb.backend:build_wandb",
        config=WandbOptions,
        description="Weights & Biases: metrics, config and summary on rank 0; resumes the same W&B run",
    )


@hookimpl
def forge_lm_save_state(context):
    run_id = _runs.run_id(context.run_dir)
    return None if run_id is None else {"run_id": run_id}


@hookimpl
def forge_lm_load_state(context, state):
    run_id = state.get("run_id") if isinstance(state, dict) else None
    if isinstance(run_id, str) and run_id:
        _runs.restore(context.run_dir, run_id)


@hookimpl
def forge_lm_train_end(context, status):
    _runs.ended(context.run_dir, status)
