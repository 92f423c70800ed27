"""Feed-forward with a learned output scale drawn with torch.nn.init in its constructor and no
init_weights: the Initializer never sets it (a meta-device build has no values for it)."""

import torch
from kit_mutant_base import GeluMLP
from torch import nn

CATEGORY = "feed_forwards"
EXPECTED_CHECK = "initial_weights_depend_on_the_seed_only"


class ScaledMLP(GeluMLP):
    def __init__(self, dim):
        super().__init__(dim)
        self.scale = nn.Parameter(torch.empty(dim))
        nn.init.normal_(self.scale, 1.0, 0.02)  # bug: set outside the Initializer

    def forward(self, x):
        return super().forward(x) * self.scale


def factory(options, dim, layer_index):
    return ScaledMLP(dim)
