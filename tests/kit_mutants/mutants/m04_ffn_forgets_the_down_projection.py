"""Feed-forward that returns the hidden activations (width 2 * dim) instead of projecting
back to dim."""

import torch.nn.functional as F
from kit_mutant_base import GeluMLP

CATEGORY = "feed_forwards"
EXPECTED_CHECK = "maps_hidden_states_to_the_same_shape_with_gradients"


class NoDownMLP(GeluMLP):
    def forward(self, x):
        return F.gelu(self.up(x))  # bug: self.down never applied


def factory(options, dim, layer_index):
    return NoDownMLP(dim, hidden=2 * dim)
