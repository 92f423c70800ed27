"""A router with exploration noise added to its logits in eval mode too: the same token is routed
differently each time."""

from types import SimpleNamespace

import torch
from kit_mutant_base import SoftmaxTopK

CATEGORY = "routers"
EXPECTED_CHECK = "routes_the_same_input_the_same_way"


class Noisy(SoftmaxTopK):
    def forward(self, x):
        logits = self.gate(x.flatten(0, 1)).float()
        logits = logits + torch.randn_like(logits)  # bug: not only when self.training
        weights, indices = logits.softmax(-1).topk(self.top_k, dim=-1)
        return SimpleNamespace(indices=indices, weights=weights / weights.sum(-1, keepdim=True), aux_losses={})


def factory(options, dim, n_experts, top_k):
    return Noisy(dim, n_experts, top_k)
