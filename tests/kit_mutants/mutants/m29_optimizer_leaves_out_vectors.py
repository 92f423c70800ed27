"""An optimizer that builds its group from matrices only (p.ndim == 2), meaning to put vectors in
a no-decay group, and forgets that group: biases and norm scales never train."""

import torch
from kit_mutant_base import MomentumOptions

CATEGORY = "optimizers"
EXPECTED_CHECK = "covers_every_trainable_parameter_once"
OPTIONS = MomentumOptions


def factory(options, model):
    matrices = [p for p in model.parameters() if p.requires_grad and p.ndim == 2]
    return torch.optim.SGD(matrices, lr=options.lr, momentum=0.9)  # bug: no group for the vectors
