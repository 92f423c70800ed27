"""A cross-entropy that passes label_smoothing=0.1 whatever its options say: it is not the loss
its reference computes."""

import torch.nn.functional as F

from forge_lm.components import IGNORE_INDEX

CATEGORY = "losses"
EXPECTED_CHECK = "matches_its_reference"


def factory(options):
    def loss(logits, labels):
        flat = logits.flatten(0, 1).float()
        return F.cross_entropy(flat, labels.flatten(), ignore_index=IGNORE_INDEX, label_smoothing=0.1)  # bug

    return loss
