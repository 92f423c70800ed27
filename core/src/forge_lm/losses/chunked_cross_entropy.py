"""Cross-entropy (and z-loss) over chunks of tokens, recomputed in backward: lower peak memory.

The value and gradients are those of :mod:`forge_lm.losses.cross_entropy`. What changes is
what autograd keeps between forward and backward. The plain loss upcasts the whole
``[tokens, vocab]`` logits to fp32 and keeps an fp32 tensor of that size (the log-softmax;
with z-loss, the upcast logits) until backward. At 32k tokens and a 128k vocabulary that is
16 GiB, held at the start of backward, when the model's activations are all still alive,
so it sets the peak memory of a step.

Here the tokens are split into chunks of ``chunk_size`` and each chunk's upcast,
``logsumexp`` and loss sums run inside :func:`torch.utils.checkpoint.checkpoint`. Forward
keeps only each chunk's inputs, which are views of the logits that already exist, and two
scalars; backward recomputes one chunk at a time, so at most one chunk's fp32 copy (of size
``chunk_size * vocab``) exists at once. The price is recomputing the chunk's softmax in
backward, a small cost next to the output projection that produced the logits. The gradient
with respect to the logits is still a full ``[tokens, vocab]`` tensor, in the logits' own
dtype (briefly twice, while the chunks' gradients are joined); avoiding that too needs the
output projection fused into the loss.

Under tensor parallelism this loss takes the full logits, gathered over the vocabulary: its
per-chunk ``logsumexp`` and ``gather`` inside a checkpoint are not operations that
:func:`torch.distributed.tensor.parallel.loss_parallel` distributes, so it is not a
:class:`~forge_lm.losses.vocab_parallel.VocabParallelLoss`. ``cross_entropy`` without a
z-loss is; it keeps the logits split instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from forge_lm.components import IGNORE_INDEX
from forge_lm.losses.cross_entropy import combine, token_sums


def chunked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 4096, z_loss_weight: float = 0.0
) -> torch.Tensor:
    """Mean over non-ignored positions, as ``cross_entropy``, computed ``chunk_size`` tokens at a time."""
    flat_logits, flat_labels = logits.flatten(0, -2), labels.flatten()
    ce_sums, z_sums = [], []
    # split (not narrow in a loop): its backward assembles the logits' gradient once, instead
    # of adding one full-size, mostly-zero gradient per chunk.
    for chunk_logits, chunk_labels in zip(flat_logits.split(chunk_size), flat_labels.split(chunk_size), strict=True):
        # No randomness inside, so there is no RNG state to save and restore.
        chunk_ce, chunk_z = checkpoint(
            token_sums, chunk_logits, chunk_labels, use_reentrant=False, preserve_rng_state=False
        )
        ce_sums.append(chunk_ce)
        z_sums.append(chunk_z)
    ce_sum, z_sum = torch.stack(ce_sums).sum(), torch.stack(z_sums).sum()
    return combine(ce_sum, z_sum, (flat_labels != IGNORE_INDEX).sum(), z_loss_weight)


def build_chunked_cross_entropy(options: Any) -> Any:
    chunk_size, weight = options.chunk_size, options.z_loss_weight

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(logits, labels, chunk_size, weight)

    return loss_fn
