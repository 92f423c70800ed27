"""A router that takes top-k of detached probabilities (to save memory): the gate never learns."""

from types import SimpleNamespace

from kit_mutant_base import SoftmaxTopK

CATEGORY = "routers"
EXPECTED_CHECK = "weights_carry_gradient_to_the_router"


class Detached(SoftmaxTopK):
    def forward(self, x):
        probs = self.gate(x.flatten(0, 1)).float().softmax(-1).detach()  # bug
        weights, indices = probs.topk(self.top_k, dim=-1)
        return SimpleNamespace(indices=indices, weights=weights / weights.sum(-1, keepdim=True), aux_losses={})


def factory(options, dim, n_experts, top_k):
    return Detached(dim, n_experts, top_k)
