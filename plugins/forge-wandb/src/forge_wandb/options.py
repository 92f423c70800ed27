"""The options of forge-wandb's ``wandb`` backend: the keys of ``[metrics.wandb]``.

Named by import path in :mod:`forge_wandb.plugin`'s registration, so that listing plugins does
not import this module (nor attrs).
"""

from __future__ import annotations

from typing import Any

import attrs

from forge_lm.validators import FieldError

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
