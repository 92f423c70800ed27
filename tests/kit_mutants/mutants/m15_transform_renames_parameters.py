"""A LoRA transform that wraps each attention projection in a module holding it as 'base':
the parameter names change (wq.weight becomes wq.base.weight) and checkpoints no longer match."""

import torch
from kit_mutant_base import FreezeOptions
from torch import nn

from forge_lm.distributed import ModelTransform

CATEGORY = "model_transforms"
EXPECTED_CHECK = "apply_keeps_names_and_leaves_something_to_train"
OPTIONS = FreezeOptions


class LoraLinear(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.zeros(4, base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, 4))

    def forward(self, x):
        return self.base(x) + x @ self.a.T @ self.b.T


def factory(options):
    def apply(model, context):
        for module in list(model.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and child_name.startswith("w"):
                    setattr(module, child_name, LoraLinear(child))  # bug: wq.weight is now wq.base.weight

    return ModelTransform("adaptation", lambda context: options.enabled, apply)
