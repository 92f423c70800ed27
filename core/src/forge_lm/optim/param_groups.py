"""Which parameters get weight decay.

The rule, by role rather than by name patterns: weight matrices (2-D and higher) are decayed;
biases and norm scales (1-D) never are; embedding tables (parameters of ``nn.Embedding``,
including a head tied to one) are not decayed unless ``decay_embeddings`` is set, because
decaying rarely-seen tokens' rows towards zero hurts them for no benefit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def weight_decay_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = False) -> list[dict[str, Any]]:
    embedding_ids = {
        id(p)
        for module in model.modules()
        if isinstance(module, nn.Embedding)
        for p in module.parameters(recurse=False)
    }
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():  # shared (tied) parameters are yielded once
        if not param.requires_grad:
            continue
        is_embedding = id(param) in embedding_ids
        if param.ndim >= 2 and (decay_embeddings or not is_embedding):
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
