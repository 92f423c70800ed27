"""Distributed training on torch.distributed: launch detection, the device mesh, and the
ordered model transforms (tensor parallel, FSDP2, activation checkpointing, compile, and the
slots plugins fill). See docs/distributed.md."""

from forge_lm.distributed.launch import Launch, detect_launch, init_distributed, is_main_process, shutdown_distributed
from forge_lm.distributed.mesh import ParallelDims, dp_coordinates
from forge_lm.distributed.transforms import (
    TRANSFORM_ORDER,
    ModelTransform,
    TransformContext,
    apply_model_transforms,
    ordered_transforms,
)

__all__ = [
    "TRANSFORM_ORDER",
    "Launch",
    "ModelTransform",
    "ParallelDims",
    "TransformContext",
    "apply_model_transforms",
    "detect_launch",
    "dp_coordinates",
    "init_distributed",
    "is_main_process",
    "ordered_transforms",
    "shutdown_distributed",
]
