"""Tensor parallelism with sequence parallelism (TO BE WRITTEN)."""

from __future__ import annotations

from torch import nn

from forge_lm.distributed.transforms import ModelTransform, TransformContext


def _enabled(context: TransformContext) -> bool:
    return context.dims.tp > 1


def _apply(model: nn.Module, context: TransformContext) -> None:
    raise NotImplementedError("tensor parallelism is not written yet")


def tensor_parallel_transform(options: object) -> ModelTransform:
    return ModelTransform(slot="tensor_parallel", enabled=_enabled, apply=_apply)
