"""Which parameters get weight decay.

The rule, by role (:func:`forge_lm.components.parameter_roles`, the one a plugin optimizer
reuses) rather than by name patterns: weight matrices and the output head are decayed;
biases and norm scales never are; embedding tables (including a head tied to one) are not
decayed unless ``decay_embeddings`` is set, because decaying rarely-seen tokens' rows towards
zero hurts them for no benefit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from forge_lm.components import parameter_roles

_DECAYED = ("matrix", "output")


def weight_decay_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = False) -> list[dict[str, Any]]:
    roles = parameter_roles(model)
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():  # shared (tied) parameters are yielded once
        if not param.requires_grad:
            continue
        role = roles[name]
        if role in _DECAYED or (role == "embedding" and decay_embeddings and param.ndim >= 2):
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
