"""Attention with output dropout applied with training=True: random in eval mode."""

import torch.nn.functional as F
from kit_mutant_base import gqa
from torch import nn

CATEGORY = "attentions"
EXPECTED_CHECK = "forward_is_deterministic_in_eval_mode"


class Dropping(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, cos, sin, mask, is_causal, kv_cache=None):
        return F.dropout(self.inner(x, cos, sin, mask, is_causal, kv_cache), 0.1, training=True)  # bug


def factory(options, spec, layer_index):
    return Dropping(gqa(options, spec, layer_index))
