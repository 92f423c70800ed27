"""A cross-entropy that clamps labels to be non-negative (to avoid an index error): positions
labelled IGNORE_INDEX are trained as token 0."""

import torch.nn.functional as F

CATEGORY = "losses"
EXPECTED_CHECK = "ignores_positions_labelled_ignore_index"


def factory(options):
    def loss(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().clamp(min=0))  # bug

    return loss
