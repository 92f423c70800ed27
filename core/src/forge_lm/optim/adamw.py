"""AdamW factory for the ``adamw`` component."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from forge_lm.optim.param_groups import weight_decay_groups


def build_adamw(options: Any, model: nn.Module) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` over the weight-decay groups of ``model``."""
    groups = weight_decay_groups(model, options.weight_decay, options.decay_embeddings)
    return torch.optim.AdamW(groups, lr=options.lr, betas=tuple(options.betas), eps=options.eps)
