"""Attention that passes no mask and is_causal=False to SDPA: every query sees later keys."""

from kit_mutant_base import gqa
from torch import nn

CATEGORY = "attentions"
EXPECTED_CHECK = "no_output_depends_on_a_later_position"


class Bidirectional(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, cos, sin, mask, is_causal, kv_cache=None):
        return self.inner(x, cos, sin, None, False, kv_cache)  # bug: the mask is dropped


def factory(options, spec, layer_index):
    return Bidirectional(gqa(options, spec, layer_index))
