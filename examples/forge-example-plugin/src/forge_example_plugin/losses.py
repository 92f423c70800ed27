"""Label-smoothed next-token cross-entropy.

With smoothing ``e`` over ``V`` classes the target distribution is ``1 - e + e/V`` on the
label and ``e/V`` elsewhere, so the loss per position is
``(1 - e) * nll(label) + e * mean_over_classes(-log p)``.
"""

from __future__ import annotations

import torch

from forge_lm.components import IGNORE_INDEX


def build_smoothed_cross_entropy(options):
    smoothing = options.smoothing

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(logits.flatten(0, -2).float(), dim=-1)
        labels = labels.flatten()
        keep = labels != IGNORE_INDEX
        log_probs, labels = log_probs[keep], labels[keep]
        nll = -log_probs.gather(1, labels.unsqueeze(1)).squeeze(1)
        uniform = -log_probs.mean(dim=-1)
        return ((1.0 - smoothing) * nll + smoothing * uniform).mean()

    return loss_fn
