"""Attention with a learned output gain initialised in its constructor (torch.ones) and no
init_weights: on the meta device it has no values, and the Initializer never sets it."""

import torch
from kit_mutant_base import gqa
from torch import nn

CATEGORY = "attentions"
EXPECTED_CHECK = "meta_build_initialises_to_the_plain_build"


class Gained(nn.Module):
    def __init__(self, inner, dim):
        super().__init__()
        self.inner = inner
        self.gain = nn.Parameter(torch.ones(dim))  # bug: no init_weights sets it

    def forward(self, x, cos, sin, mask, is_causal, kv_cache=None):
        return self.inner(x, cos, sin, mask, is_causal, kv_cache) * self.gain


def factory(options, spec, layer_index):
    return Gained(gqa(options, spec, layer_index), spec.dim)
