"""Next-token cross-entropy, with an optional z-loss.

The z-loss (PaLM, Chowdhery et al. 2022) adds ``z_loss_weight * mean(logsumexp(logits)**2)``
over the counted tokens. It pulls the softmax normaliser towards 1 (log 0), which keeps
the logits from drifting to large magnitudes where bf16 loses precision, and it leaves the
probabilities themselves unchanged. The returned value, the objective that is
backpropagated, includes the weighted z-loss; the weighted term is reported with
:func:`forge_lm.losses.aux.report_loss_term` as ``z_loss``, so the logged ``loss``,
``eval/loss`` and perplexity are the cross-entropy alone and the z-loss is logged apart.

Under tensor parallelism the loss without z-loss takes the logits split over the vocabulary
(:mod:`forge_lm.losses.vocab_parallel`); with a z-loss it takes the full logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from forge_lm.components import IGNORE_INDEX
from forge_lm.losses.aux import report_loss_term
from forge_lm.losses.vocab_parallel import VocabParallelLoss


def at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` upcast to fp32 if narrower (bf16, fp16), so the loss keeps its precision."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def token_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over the counted rows of ``[tokens, vocab]`` logits: cross-entropy and ``logsumexp**2``.

    Computed in fp32 at least, whatever the logits' dtype.
    """
    logits = at_least_fp32(logits)
    counted = labels != IGNORE_INDEX
    log_z = torch.logsumexp(logits, dim=-1)
    # Ignored labels (negative) would index out of range; their rows are masked out below.
    picked = logits.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1)
    zero = log_z.new_zeros(())
    return torch.where(counted, log_z - picked, zero).sum(), torch.where(counted, log_z.square(), zero).sum()


def combine(ce_sum: torch.Tensor, z_sum: torch.Tensor, count: torch.Tensor, z_loss_weight: float) -> torch.Tensor:
    """The token mean of cross-entropy plus the weighted z-loss; reports the weighted z-loss as
    ``z_loss``, a term of the returned value (see :func:`forge_lm.losses.aux.report_loss_term`)."""
    if z_loss_weight == 0:
        return ce_sum / count  # no z-loss, no term to report
    z_term = z_loss_weight * (z_sum / count)
    report_loss_term("z_loss", z_term)
    return ce_sum / count + z_term


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float = 0.0) -> torch.Tensor:
    """Mean over non-ignored positions of ``[batch, seq, vocab]`` logits against ``[batch, seq]`` labels."""
    flat_logits, flat_labels = logits.flatten(0, -2), labels.flatten()
    if z_loss_weight == 0:
        # Fused kernel; it keeps an fp32 [tokens, vocab] log-softmax for backward (see
        # chunked_cross_entropy for a loss that does not).
        return F.cross_entropy(at_least_fp32(flat_logits), flat_labels, ignore_index=IGNORE_INDEX)
    ce_sum, z_sum = token_sums(flat_logits, flat_labels)
    return combine(ce_sum, z_sum, (flat_labels != IGNORE_INDEX).sum(), z_loss_weight)


def build_cross_entropy(options: Any) -> Any:
    weight = options.z_loss_weight

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, labels, weight)

    if weight == 0:
        # F.cross_entropy alone: loss parallelism computes it from vocabulary-sharded logits.
        return VocabParallelLoss(loss_fn)
    # The z-loss's logsumexp and gather over the vocabulary are not operations loss_parallel
    # distributes: with a z-loss, tensor parallelism gathers the full logits for the loss.
    return loss_fn
