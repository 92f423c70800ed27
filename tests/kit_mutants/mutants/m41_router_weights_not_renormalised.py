"""A top-k router that keeps the softmax probabilities of its k experts without renormalising:
a token's weights sum to less than 1."""

from types import SimpleNamespace

from kit_mutant_base import SoftmaxTopK

CATEGORY = "routers"
EXPECTED_CHECK = "weights_are_non_negative_and_normalised"


class Unnormalised(SoftmaxTopK):
    def forward(self, x):
        probs = self.gate(x.flatten(0, 1)).float().softmax(-1)
        weights, indices = probs.topk(self.top_k, dim=-1)  # bug: no division by their sum
        return SimpleNamespace(indices=indices, weights=weights, aux_losses={})


def factory(options, dim, n_experts, top_k):
    return Unnormalised(dim, n_experts, top_k)
