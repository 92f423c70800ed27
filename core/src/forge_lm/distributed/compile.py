"""``torch.compile`` per transformer block, the last transform.

Blocks are compiled one by one (``Module.compile`` compiles in place, so parameter names do
not change): all blocks share one compiled graph (they have the same structure), compile time
does not grow with depth, and the FSDP2 units around each block stay outside the graph.
"""

from __future__ import annotations

from torch import nn

from forge_lm.distributed.transforms import ModelTransform, TransformContext, transformer_blocks


def _enabled(context: TransformContext) -> bool:
    return context.config.train.compile


def _apply(model: nn.Module, context: TransformContext) -> None:
    for block in transformer_blocks(model):
        block.compile()


def compile_transform(options: object) -> ModelTransform:
    """The ``compile`` transform: on when [train] compile is true."""
    return ModelTransform(slot="compile", enabled=_enabled, apply=_apply)
