"""A cross-entropy with reduction='none' then .mean(): ignored positions count in the
denominator, so the value is not a mean over the counted tokens."""

import torch.nn.functional as F

from forge_lm.components import IGNORE_INDEX

CATEGORY = "losses"
EXPECTED_CHECK = "is_a_mean_over_counted_tokens"


def factory(options):
    def loss(logits, labels):
        flat = logits.flatten(0, 1).float()
        return F.cross_entropy(flat, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none").mean()  # bug

    return loss
