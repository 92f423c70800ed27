"""Next-token cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forge_lm.components import IGNORE_INDEX


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over non-ignored positions; logits upcast to fp32 so bf16 runs keep precision."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def build_cross_entropy(options):
    return cross_entropy
