"""Which capabilities a run's layout needs of its model, and the refusal when the family lacks one.

A model family declares what it supports through runtime-checkable protocols in
:mod:`forge_lm.components` (FSDP2 blocks, tensor and pipeline splits, context parallelism,
cached decoding). The layout of ``[distributed]`` and ``[train]`` needs some of them; one
missing is a :class:`~forge_lm.errors.ConfigError` naming the family, the capability and the
setting to change, raised by ``forge config validate`` (on a model built on the meta device,
which allocates nothing) and by ``forge train`` before anything is transformed. A capability
declared in a deprecated way still runs, with a warning naming the family (:func:`deprecated_capabilities`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from forge_lm.components import (
    ContextParallelAttention,
    ContextParallelModel,
    PipelineSplittable,
    ShardedByBlocks,
    TensorParallelizable,
    TensorParallelModel,
    declared_batch_inputs,
)
from forge_lm.config import ForgeConfig
from forge_lm.distributed.context_parallel import declares_only_the_attribute
from forge_lm.distributed.launch import is_main_process
from forge_lm.errors import ConfigError
from forge_lm.notices import warn


def _family(config: ForgeConfig) -> str:
    chosen = config.model
    where = f" from {chosen.component.plugin.label}" if chosen.component is not None else ""
    return f"model family '{chosen.name}'{where}"


def missing_capabilities(model: nn.Module, config: ForgeConfig, dims: Any) -> list[str]:
    """What ``model`` lacks for the layout ``dims`` and the run's ``[train]`` settings, one
    sentence each (empty: it supports them all)."""
    problems = []
    blocks = model.blocks() if isinstance(model, ShardedByBlocks) else None
    per_block = [
        (
            config.train.activation_checkpointing != "none",
            f"[train] activation_checkpointing = '{config.train.activation_checkpointing}'",
            "activation_checkpointing = 'none'",
        ),
        (config.train.compile, "[train] compile = true", "compile = false"),
    ]
    for active, setting, fix in per_block:
        if active and blocks is None:
            problems.append(
                f"{setting} works block by block, and the model declares no blocks() (ShardedByBlocks); set {fix}"
            )
    if dims.tp > 1:
        problems.extend(_tensor_parallel_problems(model, blocks, dims.tp))
    if dims.pp > 1 and (blocks is None or not isinstance(model, PipelineSplittable)):
        problems.append(
            f"[distributed] pp = {dims.pp} cuts the model into stages of blocks, and the model declares no "
            "keep_stage(stage, stages) and blocks() (PipelineSplittable, ShardedByBlocks); set pp = 1"
        )
    if dims.cp > 1:
        problems.extend(_context_parallel_problems(model, blocks, dims.cp))
    inputs = declared_batch_inputs(model)
    for size, setting, carries in ((dims.pp, "pp", "activations between stages"), (dims.cp, "cp", "token slices")):
        if inputs and size > 1:
            problems.append(
                f"[distributed] {setting} = {size} passes only {carries}, and the model's forward takes the batch's "
                f"{', '.join(inputs)} too (TakesBatchInputs); set {setting} = 1"
            )
    return problems


def _tensor_parallel_problems(model: nn.Module, blocks: list[nn.Module] | None, tp: int) -> list[str]:
    if blocks is None or not isinstance(model, TensorParallelModel):
        return [
            f"[distributed] tp = {tp} splits the model's outer modules and its blocks, and the model declares no "
            "tensor_parallel_plan() and blocks() (TensorParallelModel, ShardedByBlocks); set tp = 1"
        ]
    problems = []
    for kind in ("attention", "feed_forward"):
        lacking = sorted(
            {
                type(getattr(b, kind, None)).__name__
                for b in blocks
                if not isinstance(getattr(b, kind, None), TensorParallelizable)
            }
        )
        if lacking:
            problems.append(
                f"[distributed] tp = {tp}: the blocks' {kind.replace('_', '-')} layer {', '.join(lacking)} defines no "
                "tensor_parallel_plan() (TensorParallelizable); set tp = 1 or choose a layer that supports it"
            )
    return problems


def _context_parallel_problems(model: nn.Module, blocks: list[nn.Module] | None, cp: int) -> list[str]:
    attentions = [getattr(b, "attention", None) for b in blocks or []]
    # plugin API 1.2's protocol (deprecated): the core's walk reaches the layers, checked through the blocks
    walked = declares_only_the_attribute(model) and blocks is not None and None not in attentions
    if not isinstance(model, ContextParallelModel) and not walked:
        return [
            f"[distributed] cp = {cp} needs a model whose forward takes positions and that hands the "
            "context-parallel group to its attention layers (ContextParallelModel: set_context_parallel"
            "(context_parallel) and a context_parallel attribute); set cp = 1"
        ]
    lacking = sorted(
        {type(a).__name__ for a in attentions if a is not None and not isinstance(a, ContextParallelAttention)}
    )
    if lacking:
        return [
            f"[distributed] cp = {cp}: the blocks' attention layer {', '.join(lacking)} does not gather keys and "
            "values across ranks (it declares no context_parallel attribute, ContextParallelAttention); set cp = 1 "
            "or choose a layer that supports it"
        ]
    return []


def deprecated_capabilities(model: nn.Module, dims: Any) -> list[str]:
    """What the layout ``dims`` uses of ``model`` that it declares in a deprecated way, one
    sentence each (it runs, until the plugin API version named)."""
    if dims.cp > 1 and declares_only_the_attribute(model):
        return [
            f"[distributed] cp = {dims.cp}: the model declares context parallelism as plugin API 1.2 did, a "
            "context_parallel attribute without set_context_parallel(context_parallel), a way deprecated since "
            "plugin API 1.3 (ContextParallelModel); Forge still sets the attribute on the model and on every "
            "submodule that declares one, which plugin API 2 will no longer do: the family's plugin should define "
            "set_context_parallel"
        ]
    return []


def check_capabilities(model: nn.Module, config: ForgeConfig, dims: Any) -> None:
    """Refuse, with a :class:`ConfigError`, a layout that needs what ``model`` lacks; warn (on the
    main process) of what it declares in a deprecated way."""
    problems = missing_capabilities(model, config, dims)
    if problems:
        listed = "; ".join(problems)
        raise ConfigError(f"{_family(config)} cannot run this layout: {listed}.")
    if is_main_process():
        for deprecated in deprecated_capabilities(model, dims):
            warn(f"{_family(config)}: {deprecated}.")


def check_family_supports(config: ForgeConfig, vocab_size: int, registry: Any, dims: Any) -> None:
    """:func:`check_capabilities` on the model built on the meta device (nothing allocated; at
    most :data:`~forge_lm.model.memory.MAX_BUILT_LAYERS` blocks, as the memory estimate builds
    it): what ``forge config validate`` runs before any memory is touched."""
    from forge_lm.model.memory import capped_section
    from forge_lm.model.transformer import build_model

    section, _, _ = capped_section(config.model, registry)
    with torch.random.fork_rng(devices=[]):
        model = build_model(section, vocab_size, registry, device="meta")
    check_capabilities(model, config, dims)
