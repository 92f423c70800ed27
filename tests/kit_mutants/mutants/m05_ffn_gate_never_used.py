"""A gated feed-forward whose gate projection is built but never used in forward: it gets no
gradient and trains nothing."""

from kit_mutant_base import GeluMLP
from torch import nn

CATEGORY = "feed_forwards"
EXPECTED_CHECK = "maps_hidden_states_to_the_same_shape_with_gradients"


class UngatedMLP(GeluMLP):
    def __init__(self, dim):
        super().__init__(dim)
        self.gate = nn.Linear(dim, 64, bias=False)  # bug: forward forgets to multiply by it


def factory(options, dim, layer_index):
    return UngatedMLP(dim)
