"""``torch.compile`` per transformer block, the transform after activation checkpointing and
before FSDP2.

Each block's ``forward`` is compiled in place (:func:`compile_block`; parameter names do not
change): all blocks share one compiled graph (they have the same structure), so compile time
does not grow with depth. Only ``forward`` is compiled, not the module's call: the hooks
around it, FSDP2's all-gathers and reduce-scatters among them, run outside the graph, which
is why FSDP2 may wrap the block afterwards (torchtitan's order: checkpointing, compile, FSDP).

Data-dependent shapes and values (a mixture-of-experts layer's tokens per expert, the rows
kept under a capacity limit) are traced as symbolic sizes rather than breaking the graph
(``capture_dynamic_output_shape_ops``, ``capture_scalar_outputs``): batches that route their
tokens differently reuse the compiled graph instead of recompiling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from forge_lm.distributed.transforms import ModelTransform, TransformContext, transformer_blocks

# Dynamo settings read while tracing a block; set per call, for the blocks only, so that the
# rest of the process keeps torch's defaults. The last lets a checkpointed block update a
# counter in forward (an MoE layer's routing counts) without its replay in backward counting
# the batch twice.
_TRACING = {
    "capture_dynamic_output_shape_ops": True,
    "capture_scalar_outputs": True,
    "skip_fwd_side_effects_in_bwd_under_checkpoint": True,
}


def compile_block(block: nn.Module, backend: str | Callable[..., Any] = "inductor") -> None:
    """Replace ``block.forward`` by its compiled version (``backend`` as ``torch.compile`` takes it)."""
    compiled = torch.compile(block.forward, backend=backend)

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(_TRACING):
            return compiled(*args, **kwargs)

    block.forward = forward


def _enabled(context: TransformContext) -> bool:
    return context.config.train.compile


def _apply(model: nn.Module, context: TransformContext) -> None:
    for block in transformer_blocks(model):
        compile_block(block)


def compile_transform(options: object) -> ModelTransform:
    """The ``compile`` transform: on when [train] compile is true."""
    return ModelTransform(slot="compile", enabled=_enabled, apply=_apply)
