"""The ``muon`` component's factory: split the model by role, build the optimizer, report the split."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from forge_optim_muon.optimizer import Muon
from forge_optim_muon.roles import ADAMW, MUON, assign_parameters, describe


def build_muon(options: Any, model: nn.Module) -> Muon:
    """A :class:`Muon` over ``model``: group 0 holds the Muon matrices (its ``lr`` is the one a run
    logs), then the AdamW parameters with weight decay, then those without. Rank 0 prints the split."""
    assignments = assign_parameters(model, options.muon_params, options.adamw_params, options.decay_embeddings)
    muon = [a.param for a in assignments if a.side == MUON]
    decayed = [a.param for a in assignments if a.side == ADAMW and a.decay]
    plain = [a.param for a in assignments if a.side == ADAMW and not a.decay]
    groups = [
        {"params": muon, "algorithm": "muon"},
        {"params": decayed, "algorithm": "adamw", "weight_decay": options.adamw_weight_decay},
        {"params": plain, "algorithm": "adamw", "weight_decay": 0.0},
    ]
    optimizer = Muon(
        [group for group in groups if group["params"]],
        lr=options.lr,
        momentum=options.momentum,
        nesterov=options.nesterov,
        weight_decay=options.weight_decay,
        update_scale=options.update_scale,
        ns_coefficients=tuple(options.ns_coefficients),
        ns_steps=options.ns_steps,
        ns_eps=options.ns_eps,
        ns_dtype=options.ns_dtype,
        adamw_lr=options.adamw_lr,
        adamw_betas=tuple(options.adamw_betas),
        adamw_eps=options.adamw_eps,
        adamw_weight_decay=options.adamw_weight_decay,
    )
    optimizer.assignments = assignments  # who went where, and why: for users and tests
    if _is_rank_zero():
        print("\n".join(describe(assignments, options.adamw_lr)), file=sys.stdout, flush=True)
    return optimizer


def _is_rank_zero() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or (
        torch.distributed.get_rank() == 0
    )
