"""Feed-forward whose init_weights(init) draws with torch.nn.init (torch's global generator)
instead of init.normal: the seed does not decide its weights."""

from kit_mutant_base import GeluMLP
from torch import nn

CATEGORY = "feed_forwards"
EXPECTED_CHECK = "initial_weights_depend_on_the_seed_only"


class TorchInitMLP(GeluMLP):
    def init_weights(self, init):
        init.normal(self.up.weight, init.std)
        init.normal(self.down.weight, init.residual_std)
        nn.init.normal_(self.down.weight, 0.0, 0.02)  # bug: a second, unseeded draw overwrites it


def factory(options, dim, layer_index):
    return TorchInitMLP(dim)
