"""An optimizer that reads its learning rate from an option it never gets (lr_base, default
1e-6) instead of lr: it barely moves."""

import torch
from kit_mutant_base import MomentumOptions

CATEGORY = "optimizers"
EXPECTED_CHECK = "lowers_the_loss_of_a_tiny_problem"
OPTIONS = MomentumOptions


def factory(options, model):
    lr = getattr(options, "lr_base", 1e-6)  # bug: the option is lr
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)
