"""The SwiGLU feed-forward layer of Llama: ``w2(silu(w1(x)) * w3(x))``; the ``swiglu`` component."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from forge_lm.model.linear import Linear

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from forge_lm.components import Initializer


def swiglu_hidden(dim: int, hidden_multiplier: float, multiple_of: int) -> int:
    """Hidden size ``multiple_of * ceil(hidden_multiplier * dim / multiple_of)``.

    The quotient is rounded to 9 decimals before ``ceil`` so that float noise in the multiplier
    (``1.1 * 400 / 8`` is ``55.00000000000001`` in binary floating point) does not push an exact
    multiple up to the next one.
    """
    return multiple_of * math.ceil(round(hidden_multiplier * dim / multiple_of, 9))


class SwiGLU(nn.Module):
    """Gated MLP: ``w1`` gate and ``w3`` up project ``dim -> hidden``, ``w2`` projects back. No biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=False)  # gate
        self.w3 = Linear(dim, hidden, bias=False)  # up
        self.w2 = Linear(hidden, dim, bias=False)  # down: writes into the residual stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [batch, seq, dim] -> [batch, seq, hidden] -> [batch, seq, dim]
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """How tensor parallelism splits this layer (``{submodule: ParallelStyle}``, see
        :mod:`forge_lm.distributed.tensor_parallel`): the hidden units across the ranks.

        ``w1``/``w3`` split their output (the hidden units), so ``silu(w1(x)) * w3(x)`` is
        computed on this rank's units alone; ``w2`` splits its input the same way, and its
        partial sums are reduce-scattered along the sequence, the layout the residual stream has
        between layers. The input arrives as the full sequence (the transform gathers it).
        """
        # Imported here: torch.distributed.tensor is slow to import and single-process runs never need it.
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {
            "w1": ColwiseParallel(),
            "w3": ColwiseParallel(),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
        }

    def init_weights(self, init: Initializer) -> None:
        """Gate and up projections ``normal(0, init.std)``; the residual (down) projection
        ``normal(0, init.residual_std)``."""
        init.normal(self.w1.weight, init.std)
        init.normal(self.w3.weight, init.std)
        init.normal(self.w2.weight, init.residual_std)


def build_swiglu(options, dim: int, layer_index: int) -> SwiGLU:
    """Factory of the ``swiglu`` feed-forward component (options: ``SwiGLUOptions``); same layer at every index."""
    return SwiGLU(dim, swiglu_hidden(dim, options.hidden_multiplier, options.multiple_of))
