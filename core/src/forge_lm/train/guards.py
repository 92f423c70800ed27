"""Guards around the calls the training loop makes into a run's components.

A component is a plugin's code (or the core's own, registered the same way): the optimizer's
``step()``, the scheduler's ``step()``, the dataset's iterator, the loss function, the model
family's forward and backward with the attention and feed-forward layers inside it. Whatever
one of them raises mid-run, ``SystemExit`` and a ``KeyboardInterrupt`` that is not the user's
Ctrl-C included, or whatever unusable thing it returns, becomes a :class:`ComponentFailed`
naming the component, its plugin, distribution and version: the loop then stops through the
plugin-failure path (:func:`forge_lm.train.ending.stop_for_plugin`: the last good step
checkpointed, exit 4). A failure of the core's own component says it is a bug in Forge, not
the plugin's. The policy is documented in :mod:`forge_lm.hookspecs` ("When a plugin fails").

Nothing here waits for the device: checks read tensor metadata (shapes, dtypes) and Python
numbers (the learning rate) only. A failure inside the model is attributed after the fact, by
walking the traceback to the innermost module marked with its component (:func:`mark`); the
core marks the family and the layers of a family that keeps them as ``feed_forward`` and
``attention`` attributes (the llama family's blocks), and a plugin may mark the modules it
builds from other components (forge-moe marks its router). Modules that check their outputs
on the device without waiting (forge-moe's routing checks) expose :class:`ChecksOnDevice`: the
loop asks them, after a step whose loss or gradient was not finite, whether they caused it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from forge_lm.config import ComponentConfig, ForgeConfig, model_options
from forge_lm.errors import ForgeError
from forge_lm.plugins._calls import (
    PluginHookFailed,
    describe,
    from_the_user,
    moved_directory,
    moved_problem,
    working_directory,
)
from forge_lm.plugins._categories import singular

COMPONENT_ATTRIBUTE = "_forge_component"
"""The attribute :func:`mark` sets on a module: the registered component that built it."""

# How to run without a failing component, per category.
_INSTEAD = {
    "optimizers": "set another [optimizer] name",
    "schedulers": "set another [scheduler] name",
    "datasets": "set another [data] name",
    "losses": "set another [loss] name",
    "models": "set another [model] name",
    "feed_forwards": "set another [model.ffn] name",
    "attentions": "set another [model.attention] name",
    "routers": "set another router",
}


class ComponentFailed(PluginHookFailed):
    """A component of the run failed while it trained: ``component`` (a registered
    :class:`~forge_lm.plugins.Component`) ``what`` (``raised in step() at step 3: ValueError: x``).

    Exit code 4, like a failing training hook. For a plugin's component the message names the
    plugin and says how to run without it; for the core's own, that it is a bug in Forge."""

    def __init__(self, component: Any, what: str, without: str | None = None, unsaved: str | None = None) -> None:
        self.component = component
        self.unsaved = unsaved  # why the last step is not checkpointed (train.ending.stop_for_plugin)
        self.kind = singular(component.category)
        super().__init__(
            component.plugin,
            f"{self.kind} '{component.name}'",
            what,
            without=without or _INSTEAD.get(component.category) or f"--block-plugin {component.plugin.name}",
        )

    @property
    def headline(self) -> str:
        """``optimizer 'x' of plugin 'p' (forge-p 1.0) raised in step() at step 3: ValueError: boom``."""
        plugin = self.plugin
        owner = f"the core ({plugin.distribution} {plugin.version})" if plugin.builtin else plugin.label
        return f"{self.kind} '{self.component.name}' of {owner} {self.problem}"

    def __str__(self) -> str:
        if not self.plugin.builtin:
            return super().__str__()
        where = f" {self.outcome}." if self.outcome else ""
        return (
            f"{self.headline}. This is a bug in {self.plugin.distribution} {self.plugin.version}, not in the run or "
            f"a plugin: please report it.{where}"
        )


@runtime_checkable
class ChecksOnDevice(Protocol):
    """A module that checks its inputs or outputs on the device without waiting for it (it
    keeps what it found in a buffer and makes the step's loss NaN), so that a bad value costs
    no host sync on the steps where nothing is wrong."""

    def raise_device_findings(self) -> None:
        """Raise a :class:`ComponentFailed` naming the culprit if a forward since the last call
        found a fault; forget the findings either way. Called after a non-finite step."""


def mark(module: nn.Module, component: Any) -> nn.Module:
    """Note on ``module`` the registered component that built it: a failure inside its forward
    is then that component's (the innermost marked module on the traceback wins)."""
    object.__setattr__(module, COMPONENT_ATTRIBUTE, component)
    return module


def component_of(chosen: ComponentConfig | None, category: str, registry: Any) -> Any:
    """The registered component ``chosen`` selects (a config built in code resolves it here)."""
    if chosen is None:
        return None
    if chosen.component is not None:
        return chosen.component
    return registry.resolve(category, chosen.name) if registry is not None else None


def _passes(exc: BaseException) -> bool:
    """What a guard lets through as it is: a failure already named, the user's Ctrl-C, and a
    collective that timed out (another rank's trouble, explained by the loop)."""
    if isinstance(exc, PluginHookFailed) or from_the_user(exc):
        return True
    return (
        isinstance(exc, RuntimeError)
        and dist.is_available()
        and dist.is_initialized()
        and "timed out" in str(exc).lower()
    )


class ComponentGuard:
    """The calls into one component: ``with guard.calling("step()", step): component.step()``.

    ``attribute``: find the culprit of a failure on its traceback (:func:`mark`), this
    guard's component being the fallback; ``lets_through``: exception types that keep their
    own meaning (the data's ForgeErrors, which name the data and the fix)."""

    def __init__(
        self,
        component: Any,
        *,
        attribute: bool = False,
        lets_through: tuple[type[BaseException], ...] = (),
        unsaved: str | None = None,
    ) -> None:
        self.component = component
        self._attribute = attribute
        self._lets_through = lets_through
        self._unsaved = unsaved  # a failure in the call may leave the run's state half-changed: not saved

    def calling(self, call: str, step: int | None = None) -> _Calling:
        """``step``: the step being trained (context.step + 1), named in the message."""
        return _Calling(self, call, "" if step is None else f" at step {step}")

    def fail(self, what: str, culprit: Any = None, *, completed: bool = False) -> ComponentFailed:
        """``completed``: the call itself finished (what it returned or did is the problem)."""
        return ComponentFailed(culprit or self.component, what, unsaved=None if completed else self._unsaved)

    def failure_of(self, exc: BaseException, call: str, where: str) -> BaseException | None:
        """What ``exc``, raised in ``call``, becomes: None to let it through as it is."""
        if self.component is None or _passes(exc) or isinstance(exc, self._lets_through):
            return None
        culprit = _innermost_marked(exc) if self._attribute else None
        return self.fail(f"raised in {call}{where}: {describe(exc)}", culprit)


class _Calling:
    """One guarded call: failures named, the working directory checked (and put back)."""

    __slots__ = ("_call", "_directory", "_guard", "_where")

    def __init__(self, guard: ComponentGuard, call: str, where: str) -> None:
        self._guard, self._call, self._where = guard, call, where

    def __enter__(self) -> None:
        self._directory = working_directory()

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> bool:
        moved = moved_directory(self._directory)
        if exc is None:
            if moved is not None and self._guard.component is not None:
                raise self._guard.fail(moved_problem(self._call + self._where, self._directory, moved))
            return False
        failure = self._guard.failure_of(exc, self._call, self._where)
        if failure is None:
            return False
        raise failure from exc


def _innermost_marked(exc: BaseException) -> Any:
    """The component of the innermost marked module (:func:`mark`) whose method is on
    ``exc``'s traceback, or None."""
    found = None
    traceback = exc.__traceback__
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        component = getattr(owner, COMPONENT_ATTRIBUTE, None) if isinstance(owner, nn.Module) else None
        if component is not None:
            found = component
        traceback = traceback.tb_next
    return found


class SchedulerGuard(ComponentGuard):
    """The scheduler's ``step()``, and the learning rates it leaves the optimizer."""

    def check_rates(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Every parameter group's learning rate is a finite number, not negative (a negative one
        makes the optimizer climb the loss). Python numbers only: a tensor rate is read where it
        is on the CPU; on a device it is left unread (reading it would wait for the device)."""
        if self.component is None:
            return
        for index, group in enumerate(optimizer.param_groups):
            rate = group.get("lr")
            value = rate
            if isinstance(rate, torch.Tensor) and rate.device.type == "cpu" and rate.numel() == 1:
                value = rate.item()
            elif isinstance(rate, torch.Tensor):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                shown = repr(rate) if len(repr(rate)) <= 40 else f"a {type(rate).__name__}"
                when = "before the first step" if step == 0 else f"after step {step}"
                raise self.fail(
                    f"set the learning rate of parameter group {index} to {shown} {when}; a learning rate must be a "
                    "finite number >= 0 (a negative one trains uphill)",
                    completed=True,
                )


class DatasetGuard(ComponentGuard):
    """The training batches: the dataset failing, ending (the loop needs ``max_steps`` worth of
    batches: the built-in datasets start another pass instead), or yielding samples the loader
    refuses (:class:`forge_lm.data.loader.BadBatch`) is the dataset's failure."""

    def batches(self, batches: Iterator[dict[str, torch.Tensor]], loader: Any) -> Iterator[dict[str, torch.Tensor]]:
        from forge_lm.data.loader import BadBatch

        while True:
            number = loader.batches + 1
            with self.calling(f"reading batch {number}"):
                try:
                    batch = next(batches)
                except StopIteration:
                    raise self.fail(self._ended(loader)) from None
                except BadBatch as exc:
                    raise self.fail(str(exc)) from exc
                except RuntimeError as exc:
                    if isinstance(exc.__cause__, StopIteration):  # a generator's bare StopIteration (PEP 479)
                        raise self.fail(self._ended(loader, " (a StopIteration raised inside its generator)")) from exc
                    raise
            yield batch

    def _ended(self, loader: Any, how: str = "") -> str:
        return (
            f"ended after {loader.batches} batches{how}; training reads batches until [train] max_steps, so a "
            "dataset must not end (the built-in ones start another pass over their data)"
        )

    def failure_of(self, exc: BaseException, call: str, where: str) -> BaseException | None:
        if self.component is None or _passes(exc) or isinstance(exc, self._lets_through):
            return None
        return self.fail(f"raised while {call}: {describe(exc)}")


class Guards:
    """One guard per component the loop calls into; see the module docstring."""

    def __init__(self, config: ForgeConfig | None, registry: Any = None, model: nn.Module | None = None) -> None:
        def chosen(section: Any, category: str) -> Any:
            return component_of(section, category, registry) if isinstance(section, ComponentConfig) else None

        self.optimizer = ComponentGuard(
            chosen(getattr(config, "optimizer", None), "optimizers"),
            unsaved="its step() may have updated part of the weights",
        )
        self.scheduler = SchedulerGuard(
            chosen(getattr(config, "scheduler", None), "schedulers"),
            unsaved="the optimizer had stepped, the schedule had not",
        )
        self.dataset = DatasetGuard(chosen(getattr(config, "data", None), "datasets"), lets_through=(ForgeError,))
        self.loss = ComponentGuard(chosen(getattr(config, "loss", None), "losses"))
        family = chosen(getattr(config, "model", None), "models")
        self.model = ComponentGuard(family, attribute=True, lets_through=(torch.OutOfMemoryError,))
        self._device_checks = [] if model is None else _mark_layers(model, config, registry, family)
        self._registry = registry

    @classmethod
    def none(cls) -> Guards:
        """Guards that name nothing: every failure goes through as it is."""
        return cls(None)

    def raise_device_findings(self) -> None:
        """After a non-finite step: a module that found a fault on the device says so.

        Every module is asked (each forgets its findings), the first finding is kept. In a
        distributed run every rank asks here after the same step (the step's finiteness is
        agreed), and the findings are agreed too, in one collective: when one rank's router
        went wrong and the others' did not, every rank raises the same failure and all stop
        together through the plugin-failure path. A rank stopping alone would leave the others
        waiting in the next collective until the hang timeout."""
        found: ComponentFailed | None = None
        for module in self._device_checks:
            try:
                module.raise_device_findings()
            except ComponentFailed as exc:
                found = found or exc
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            found = self._agreed(found)
        if found is not None:
            raise found

    def _agreed(self, found: ComponentFailed | None) -> ComponentFailed | None:
        """The finding of the lowest rank that has one, the same on every rank, naming that rank."""
        mine = None if found is None else (found.component.category, found.component.name, found.problem)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        first = next(((rank, finding) for rank, finding in enumerate(everyone) if finding is not None), None)
        if first is None:
            return None
        rank, (category, name, problem) = first
        component = found.component if found is not None else self._resolve(category, name)
        if component is None:  # this rank's plugins lack it: the ranks were not started alike
            raise ForgeError(
                f"rank {rank} found that its {singular(category)} '{name}' {problem}, and this rank has no "
                f"{singular(category)} of that name: start every rank with the same plugins installed."
            )
        return ComponentFailed(component, f"{problem} (on rank {rank})")

    def _resolve(self, category: str, name: str) -> Any:
        try:
            return self._registry.resolve(category, name) if self._registry is not None else None
        except ForgeError:
            return None


def _mark_layers(model: nn.Module, config: ForgeConfig, registry: Any, family: Any) -> list[ChecksOnDevice]:
    """Mark the model with its family and, in a family whose blocks keep their layers as
    ``feed_forward`` and ``attention`` (the llama family's), each layer with its component, its
    outputs checked (:func:`_check_output`). The modules that check on the device."""
    if family is not None:
        mark(model, family)
    options = model_options(config) if isinstance(config.model, ComponentConfig) else None
    chosen = {
        "feed_forward": component_of(getattr(options, "ffn", None), "feed_forwards", registry),
        "attention": component_of(getattr(options, "attention", None), "attentions", registry),
    }
    for module in list(model.modules()):
        for attribute, component in chosen.items():
            layer = getattr(module, attribute, None)
            if component is not None and isinstance(layer, nn.Module) and not hasattr(layer, COMPONENT_ATTRIBUTE):
                mark(layer, component)
                if attribute == "feed_forward":
                    layer.register_forward_hook(_check_output)
    return [module for module in model.modules() if isinstance(module, ChecksOnDevice)]


def _same_layout(output: torch.Tensor, given: torch.Tensor) -> bool:
    """The output has the input's shape; under tensor parallelism (the input a DTensor holding
    the gathered sequence) the layer's plan hands back this rank's slice of the sequence, so
    only the batch and the width must agree."""
    from torch.distributed.tensor import DTensor

    if isinstance(given, DTensor) and not isinstance(output, DTensor):
        return output.ndim == given.ndim and (output.shape[0], output.shape[-1]) == (given.shape[0], given.shape[-1])
    return output.shape == given.shape


def _check_output(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
    """A feed-forward layer maps ``[batch, seq, dim]`` to a tensor of the same shape (metadata only)."""
    given = inputs[0] if inputs else None
    if isinstance(output, torch.Tensor) and isinstance(given, torch.Tensor) and _same_layout(output, given):
        return
    if isinstance(output, torch.Tensor):
        got = f"a tensor of shape {list(output.shape)}"
    else:
        got = "None" if output is None else f"a {type(output).__name__}"
    shape = list(given.shape) if isinstance(given, torch.Tensor) else "?"
    raise ComponentFailed(
        getattr(module, COMPONENT_ATTRIBUTE),
        f"returned {got} from forward() for an input of shape {shape}; a feed-forward layer returns a tensor of its "
        "input's shape [batch, seq, dim]",
    )
