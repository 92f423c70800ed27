"""Staged unfreezing: parameters frozen for a run's first steps, then trained.

A model transform in the ``adaptation`` slot calls :func:`freeze_until` in its ``apply``. The
slot runs before the optimizer is built; the loop builds the optimizer with these parameters
in it (:func:`staged_parameters_trainable`), so the optimizer knows every parameter it will
train. Until a parameter trains it has no gradient, so the optimizer keeps no state for it and
does not touch it (torch's optimizers pass over a parameter without a gradient, weight decay
included); its state starts at its first trained step, as if it had been added then.

Before each step the loop sets ``requires_grad`` from the step count (:func:`follow_schedule`),
so a resume or a rollback to any step trains exactly what the uninterrupted run trained there.
A checkpoint is read with the staged parameters trainable (:func:`staged_parameters_trainable`),
so that the live optimizer has a place for the state of a parameter that had started training
when the checkpoint was written, and loaded into the optimizer with each staged parameter
trainable only if the checkpoint holds state for it (:func:`staged_as_saved`): one that had not
started training gets no state, as in the uninterrupted run.

A parameter frozen by plain ``requires_grad_(False)`` stays out of the optimizer: it never trains.
Staged unfreezing runs in one process (several processes are refused: FSDP2's handling of a
parameter whose ``requires_grad`` changes after sharding is not tested here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator

import torch
from torch import nn

from forge_lm.errors import ConfigError

_SCHEDULE = "_forge_frozen_until"  # the model's attribute: {parameter name: steps it stays frozen}


def freeze_until(model: nn.Module, names: Iterable[str], steps: int) -> None:
    """Freeze the parameters ``names`` of ``model`` for the run's first ``steps`` optimizer steps:
    they train from step ``steps + 1`` on. Call it from a model transform's ``apply`` in the
    ``adaptation`` slot (before the optimizer is built); ``steps = 0`` trains them from the start."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"freeze_until: steps must be a whole number >= 0, got {steps!r}")
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        raise ConfigError(
            "staged unfreezing (forge_lm.model.freezing.freeze_until) runs in one process only; run it without "
            "torchrun, or freeze the parameters for the whole run (requires_grad_(False))."
        )
    parameters = dict(model.named_parameters())
    names = list(names)
    unknown = [name for name in names if name not in parameters]
    if unknown:
        raise ConfigError(
            f"freeze_until: the model has no parameter {', '.join(repr(n) for n in unknown[:3])}; its parameters "
            f"include {', '.join(repr(n) for n in list(parameters)[:3])}"
        )
    schedule = staged_parameters(model)
    for name in names:
        schedule[name] = steps
    model.__dict__[_SCHEDULE] = schedule  # in __dict__: not a submodule, parameter or buffer
    follow_schedule(model, 0)


def staged_parameters(model: nn.Module) -> dict[str, int]:
    """The staged parameters of ``model``: name to the optimizer steps it stays frozen (a copy)."""
    return dict(model.__dict__.get(_SCHEDULE, {}))


def follow_schedule(model: nn.Module, step: int) -> list[str]:
    """Set ``requires_grad`` of each staged parameter for the step after ``step`` steps done:
    trainable once ``step`` reaches its number of frozen steps. Returns the names this changed."""
    schedule = model.__dict__.get(_SCHEDULE)
    if not schedule:
        return []
    parameters = dict(model.named_parameters())
    changed = []
    for name, frozen_steps in schedule.items():
        trains = step >= frozen_steps
        if parameters[name].requires_grad != trains:
            parameters[name].requires_grad_(trains)
            changed.append(name)
    return changed


def staged_parameters_trainable(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Every staged parameter trainable inside the block (building the optimizer, reading a
    checkpoint for it); as it was after."""
    return _staged_requires_grad(model, lambda name: True)


def staged_as_saved(model: nn.Module, with_state: Collection[str]) -> contextlib.AbstractContextManager[None]:
    """Inside the block, each staged parameter trainable exactly when ``with_state`` (the names
    of the parameters a checkpoint's optimizer state holds) names it: torch's loader refuses a
    trainable parameter without saved state. As it was after."""
    return _staged_requires_grad(model, lambda name: name in with_state)


@contextlib.contextmanager
def _staged_requires_grad(model: nn.Module, trains: Callable[[str], bool]) -> Iterator[None]:
    schedule = model.__dict__.get(_SCHEDULE)
    if not schedule:
        yield
        return
    parameters = dict(model.named_parameters())
    before = {name: parameters[name].requires_grad for name in schedule}
    for name in schedule:
        parameters[name].requires_grad_(trains(name))
    try:
        yield
    finally:
        for name, requires_grad in before.items():
            parameters[name].requires_grad_(requires_grad)
