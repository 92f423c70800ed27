"""An optimizer whose state_dict leaves out the momentum buffers: a resumed run restarts them
from zero."""

import torch
from kit_mutant_base import MomentumOptions

CATEGORY = "optimizers"
EXPECTED_CHECK = "state_dict_round_trip_resumes_exactly"
OPTIONS = MomentumOptions


class Forgetful(torch.optim.SGD):
    def state_dict(self):
        state = super().state_dict()
        state["state"] = {}  # bug
        return state


def factory(options, model):
    return Forgetful([p for p in model.parameters() if p.requires_grad], lr=options.lr, momentum=0.9)
