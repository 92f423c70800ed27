"""A loss's declaration that it can take logits split over the vocabulary (loss parallelism).

Under tensor parallelism (``[distributed] tp > 1``) the output head computes each rank's slice
of the vocabulary. Gathering the full ``[B, T, vocab]`` logits on every rank costs an
all-gather of the largest activation of the step and ``tp`` times its memory. A loss built on
:func:`torch.nn.functional.cross_entropy` does not need them: inside
:func:`torch.distributed.tensor.parallel.loss_parallel` it computes the log-softmax from
per-rank maxima, sums and target logits (all-reduces of ``[B, T]`` values) and its gradient
stays split.

A loss function says it works that way by being a :class:`VocabParallelLoss`. The training
loop then runs its forward, the loss and the backward inside ``loss_parallel()`` and the
model's head hands the loss a DTensor sharded on the last (vocabulary) dimension
(:func:`forge_lm.distributed.tensor_parallel.loss_parallel_for`). Any other loss gets the full
logits, as without tensor parallelism. So does every loss outside the training step
(evaluation, pipeline stages), where the loop opens no such region.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor


class VocabParallelLoss:
    """Wraps ``loss_fn(logits, labels)``, declaring that it computes the same value from logits
    sharded on the vocabulary dimension inside ``loss_parallel()``: its operations on the
    logits must be those ``loss_parallel`` distributes (``F.cross_entropy`` /
    ``log_softmax`` + ``nll_loss`` over the last dimension, no label smoothing). Called with a
    plain tensor it is ``loss_fn`` itself.

    The value it returns is a plain 0-d tensor either way (the local value of the replicated
    DTensor that ``loss_parallel`` gives), so the caller adds it to plain tensors as before;
    its gradient still reaches the sharded logits through ``to_local``."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        value = self.loss_fn(logits, labels)
        return value.to_local() if isinstance(value, DTensor) else value

    def __repr__(self) -> str:
        return f"VocabParallelLoss({self.loss_fn!r})"
