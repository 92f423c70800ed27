"""Feed-forward with dropout written as F.dropout(h, p, training=True): still random in eval mode."""

import torch.nn.functional as F
from kit_mutant_base import GeluMLP

CATEGORY = "feed_forwards"
EXPECTED_CHECK = "forward_is_deterministic_in_eval_mode"


class DroppingMLP(GeluMLP):
    def forward(self, x):
        return self.down(F.dropout(F.gelu(self.up(x)), 0.1, training=True))  # bug: should be self.training


def factory(options, dim, layer_index):
    return DroppingMLP(dim)
