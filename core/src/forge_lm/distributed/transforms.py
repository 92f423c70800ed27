"""Model transforms: parallelisms and other rewrites of a built model, applied in one fixed order.

Order of the slots (each transform registers into one; the core does not know which exist).
Each is named by its role, not by a transform that fills it::

    adaptation -> tensor_parallel -> model_parallel -> precision -> activation_checkpointing -> compile
    -> data_parallel

Why this order: ``adaptation`` holds the transforms that are not parallelisms but change what
trains (freezing parameters, adding LoRA adapters, pruning): they see the whole model, before
any parallelism splits it. Every transform, this slot's included, runs before the optimizer is
built, so the optimizer is given the parameters that are trainable after all of them (a
parameter frozen here is not in it), and those frozen for the first steps only
(:func:`forge_lm.model.freezing.freeze_until`: staged unfreezing). Under ``torchrun`` the model is still on the meta
device: a parameter a transform adds gets its values when the model is initialised (the
default rule for ``nn.Linear``, or its module's ``init_weights(init)``). Tensor parallelism
replaces weights with DTensors sharded over the ``tp`` mesh, so it comes next;
``model_parallel`` holds the parallelisms that split modules over mesh dimensions of their own
after it (forge-moe's expert parallelism over ``ep``); ``precision`` the transforms that change
the number formats of layers, which must see the final local shapes (forge-float8's float8
linear layers); activation checkpointing wraps the computation of
each block, which ``torch.compile`` then traces (checkpointing included) and FSDP2 shards as
one unit; FSDP2 comes last, around the
compiled blocks, so that its hooks (the parameters' all-gathers and the gradients'
reduce-scatters) stay outside the compiled graphs, as in torchtitan.
Within one slot, transforms run in name order. Pipeline parallelism is not a transform: it
splits the model into stages first, and every stage then goes through this list.

A transform is registered in the ``model_transforms`` category; its factory takes its options
(typed by the class it registers, set in the run config's ``[transforms.<name>]`` table, the
defaults where the config has none) and returns a :class:`ModelTransform`. ``enabled(context)`` decides from the
config and the mesh whether it applies; ``apply(model, context)`` changes the model in place
and keeps parameter names (checkpoints and plugins address parameters by name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from forge_lm.config import ForgeConfig
from forge_lm.distributed.mesh import ParallelDims
from forge_lm.errors import ForgeError, PluginError
from forge_lm.plugins._calls import PluginHookFailed, describe

TRANSFORM_ORDER = (
    "adaptation",
    "tensor_parallel",
    "model_parallel",
    "precision",
    "activation_checkpointing",
    "compile",
    "data_parallel",
)

FORMER_SLOT_NAMES = {"expert_parallel": "model_parallel", "float8": "precision"}
"""Slot names of plugin API 1.0, named after the first plugin to fill them, still accepted as the
slot they became (a transform built with ``slot="float8"`` has ``slot == "precision"``)."""


def _current_slot(slot: str) -> str:
    return FORMER_SLOT_NAMES.get(slot, slot) if isinstance(slot, str) else slot


@attrs.frozen
class TransformContext:
    """What a transform sees: the run's config, degrees, mesh (None in one process), device and
    autocast dtype (None for fp32)."""

    config: ForgeConfig
    dims: ParallelDims
    mesh: Any
    device: torch.device
    dtype: torch.dtype | None

    def submesh(self, *names: str) -> Any:
        """The mesh over ``names`` (e.g. ``"tp"``, ``"dp_shard"``, ``"dp_replicate", "dp_shard"``)."""
        if self.mesh is None:
            raise RuntimeError("no device mesh in a single-process run")
        return self.mesh[names if len(names) > 1 else names[0]]


@attrs.frozen
class ModelTransform:
    """One registered transform: its slot in :data:`TRANSFORM_ORDER` (a former name in
    :data:`FORMER_SLOT_NAMES` becomes the current one) and two callables."""

    slot: str = attrs.field(converter=_current_slot)
    enabled: Callable[[TransformContext], bool]
    apply: Callable[[nn.Module, TransformContext], None]


def ordered_transforms(registry: Any, config: ForgeConfig | None = None) -> list[tuple[str, ModelTransform]]:
    """Every registered transform as ``(name, transform)``, in application order, each built
    with its options from ``config.transforms`` (its defaults where it has no table)."""
    # By the registry's entry: [transforms.forge-lm:compile] and [transforms.compile] are one.
    configured = {id(chosen.component): chosen.options for chosen in (config.transforms.values() if config else ())}
    found = []
    for component in registry.components("model_transforms"):
        options = configured.get(id(component)) or component.options_class()
        try:  # every installed transform is built on every run: a factory that raises is named, not a traceback
            transform = component.build_for_run(options)
        except PluginError as error:
            hint = f" Or run without the plugin (--block-plugin {component.plugin.name})."
            raise PluginError(f"{error}{'' if component.plugin.builtin else hint}") from error
        if not isinstance(transform, ModelTransform):
            raise PluginError(
                f"model transform '{component.name}' of {component.plugin.label} returned "
                f"{type(transform).__name__}; its factory must return forge_lm.distributed.ModelTransform."
                f"{_without(component)}"
            )
        if transform.slot not in TRANSFORM_ORDER:
            raise PluginError(
                f"model transform '{component.name}' of {component.plugin.label} names slot "
                f"'{transform.slot}'; the slots are {', '.join(TRANSFORM_ORDER)}.{_without(component)}"
            )
        found.append((component, transform))
    found.sort(key=lambda item: (TRANSFORM_ORDER.index(item[1].slot), item[0].name))
    return [(component.name, _Guarded(component, transform)) for component, transform in found]


def apply_model_transforms(model: nn.Module, context: TransformContext, registry: Any) -> list[str]:
    """Apply every enabled transform to ``model`` in order; returns the names applied. A
    transform that leaves no parameter to train stops the run naming it (not the optimizer's
    "empty parameter list" later)."""
    applied = []
    for name, transform in ordered_transforms(registry, context.config):
        if transform.enabled(context):
            trained = trains_something(model)
            transform.apply(model, context)
            applied.append(name)
            if trained and not trains_something(model):
                raise transform.left_nothing_to_train()
    return applied


def trains_something(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` requires a gradient."""
    return any(param.requires_grad for param in model.parameters())


def _without(component: Any) -> str:
    """How to run without a transform's plugin: every installed transform takes part in every run."""
    plugin = component.plugin
    if plugin.builtin:
        return ""
    return (
        f" This is a bug in {plugin.distribution} {plugin.version}: report it to its authors, or run without "
        f"the plugin (--block-plugin {plugin.name})."
    )


@attrs.frozen
class _Guarded:
    """A registered transform whose ``enabled`` and ``apply`` are untrusted: every installed
    transform is consulted on every run, so one that raises (or whose ``enabled`` answers
    something other than a bool) is a PluginError naming it and its plugin, not a traceback.
    A ForgeError it raises (which says what to fix, such as a config it cannot work with)
    passes as it is."""

    component: Any
    transform: ModelTransform

    @property
    def slot(self) -> str:
        return self.transform.slot

    def enabled(self, context: TransformContext) -> bool:
        answer = self._call("enabled", self.transform.enabled, context)
        if not isinstance(answer, bool):
            raise PluginError(
                f"model transform '{self.component.name}' of {self.component.plugin.label}: enabled() returned "
                f"{type(answer).__name__}, not a bool.{_without(self.component)}"
            )
        return answer

    def apply(self, model: nn.Module, context: TransformContext) -> None:
        self._call("apply", self.transform.apply, model, context)

    def left_nothing_to_train(self) -> PluginHookFailed:
        """The plugin-failure path's error (exit 4): ``apply`` froze every parameter."""
        return PluginHookFailed(
            self.component.plugin,
            f"model transform '{self.component.name}'",
            f"left no parameter to train in apply() of its model transform '{self.component.name}': every parameter "
            "of the model has requires_grad = False after it (a transform that freezes parameters must leave some "
            "trainable)",
            without=f"--block-plugin {self.component.plugin.name}",
        )

    def _call(self, what: str, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except ForgeError:
            raise
        except Exception as exc:
            raise PluginError(
                f"model transform '{self.component.name}' of {self.component.plugin.label} failed in {what}(): "
                f"{describe(exc)}.{_without(self.component)}"
            ) from exc


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: what it declares (:class:`~forge_lm.components.ShardedByBlocks`), else
    ``model.layers`` (a list or, in a pipeline stage, a dict), else none."""
    from forge_lm.components import ShardedByBlocks

    if isinstance(model, ShardedByBlocks):
        return list(model.blocks())
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return [block for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers) if block is not None]
