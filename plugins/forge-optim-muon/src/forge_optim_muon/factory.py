"""The ``muon`` component's factory: split the model by role, build the optimizer, report the split.

Which side a parameter goes to is decided by its role in the model, never by its shape alone,
and the role comes from the core's rule, :func:`forge_lm.components.parameter_roles` (the one
the core's weight decay follows), so that Muon and every other optimizer agree on a whole
model, a pipeline stage and a sharded layout. In order, the first that applies decides:

1. ``adamw_params`` / ``muon_params``: parameters whose name (any name, for a shared tensor)
   matches one of these fnmatch patterns go to that side.
2. The core's ``embedding``, ``output`` (reported as ``output head``: the module the model
   declares as its head, ``model.output`` or ``get_output_embeddings()``; a pipeline stage
   without it has none, whatever the shapes of its matrices), ``norm`` and ``bias`` (any
   vector) go to AdamW.
3. ``router``: a core ``matrix`` inside a router or gate module (a class name ending in
   ``Router``, ``Gate`` or ``Gating``, or a module its parent holds as ``router`` or
   ``gate``) goes to AdamW: a router scores experts with a few rows, which orthogonalising
   would flatten. This refinement is Muon's own; the core counts routers as matrices.
4. Every other core ``matrix`` goes to Muon: ``hidden matrix`` when 2-D, ``stacked matrices``
   (``[experts, rows, cols]``) when of three or more dimensions.

On the AdamW side, weight decay follows the core's rule: matrices are decayed, vectors are not,
embeddings only with ``decay_embeddings``.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from forge_lm.components import parameter_roles
from forge_lm.errors import ConfigError
from forge_optim_muon.optimizer import Muon

MUON, ADAMW = "muon", "adamw"
MUON_ROLES = ("hidden matrix", "stacked matrices")
ROLES = (*MUON_ROLES, "embedding", "output head", "router", "norm", "bias", "muon_params", "adamw_params")

_CORE_LABELS = {"embedding": "embedding", "output": "output head", "norm": "norm", "bias": "bias"}
_ROUTER_CLASS = re.compile(r"(Router|Gate|Gating)$")
_ROUTER_NAMES = {"router", "gate"}


@attrs.frozen
class Assignment:
    """One parameter's side (``"muon"`` or ``"adamw"``), the role that decided it and its weight decay."""

    name: str
    param: torch.nn.Parameter = attrs.field(repr=False, eq=False)
    role: str
    side: str
    decay: bool

    @property
    def numel(self) -> int:
        return self.param.numel()


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
        gather_bucket_mb=options.gather_bucket_mb,
    )
    optimizer.assignments = assignments  # who went where, and why: for users and tests
    if _is_rank_zero():
        print("\n".join(describe(assignments, options.adamw_lr)), file=sys.stdout, flush=True)
    return optimizer


def assign_parameters(
    model: nn.Module,
    muon_params: Sequence[str] = (),
    adamw_params: Sequence[str] = (),
    decay_embeddings: bool = False,
) -> list[Assignment]:
    """Every trainable parameter of ``model`` once, in ``named_parameters`` order, with its side."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    core_roles = parameter_roles(model)
    routers = _router_parameters(model)
    unused = {pattern: True for pattern in [*muon_params, *adamw_params]}
    assignments = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        core_role = core_roles[name]
        role = _role(core_role, param, id(param) in routers)
        side = MUON if role in MUON_ROLES else ADAMW
        for wanted, patterns in ((MUON, muon_params), (ADAMW, adamw_params)):
            matched = [p for p in patterns if any(fnmatch.fnmatchcase(alias, p) for alias in aliases[id(param)])]
            for pattern in matched:
                unused[pattern] = False
            if matched:
                side, role = wanted, f"{wanted}_params"
        if side == MUON and param.ndim < 2:
            raise ConfigError(
                f"[optimizer] muon_params: '{name}' has shape {list(param.shape)}; Muon orthogonalises matrices, "
                "so only parameters of two or more dimensions can go to it."
            )
        # The core's weight-decay rule (forge_lm.optim.param_groups), for the AdamW side.
        decay = core_role in ("matrix", "output") or (core_role == "embedding" and decay_embeddings and param.ndim >= 2)
        assignments.append(Assignment(name, param, role, side, decay))
    for pattern, never in unused.items():
        if never:
            key = "muon_params" if pattern in muon_params else "adamw_params"
            example = assignments[0].name if assignments else "weight"
            raise ConfigError(
                f"[optimizer] {key}: the pattern '{pattern}' matches no parameter of the model; patterns are "
                f"fnmatch patterns of parameter names such as '{example}' ('*' matches dots too)."
            )
    return assignments


def _role(core_role: str, param: torch.Tensor, in_router: bool) -> str:
    """Muon's name for a parameter's role, from the core's role (see the module docstring)."""
    if core_role != "matrix":
        return _CORE_LABELS[core_role]
    if in_router:
        return "router"
    return "hidden matrix" if param.ndim == 2 else "stacked matrices"


def _router_parameters(model: nn.Module) -> set[int]:
    """``id`` of every parameter held by a router or gate module or by anything inside one."""
    routers: list[nn.Module] = []
    for path, module in model.named_modules():
        if _ROUTER_CLASS.search(type(module).__name__) or path.rpartition(".")[2] in _ROUTER_NAMES:
            routers.append(module)
    return {id(param) for router in routers for param in router.parameters()}


def describe(assignments: Sequence[Assignment], adamw_lr: float) -> list[str]:
    """Two lines for the start-up report: each side's tensor and parameter counts, by role."""
    lines = []
    for side, label in ((MUON, "Muon"), (ADAMW, f"AdamW (lr {adamw_lr:g})")):
        chosen = [a for a in assignments if a.side == side]
        by_role = {role: sum(a.role == role for a in chosen) for role in ROLES}
        roles = ", ".join(f"{count} {role}" for role, count in by_role.items() if count) or "nothing"
        total = sum(a.numel for a in chosen)
        lines.append(f"muon: {label}: {len(chosen)} tensors, {total:,} parameters ({roles})")
    return lines


def _is_rank_zero() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or (
        torch.distributed.get_rank() == 0
    )
