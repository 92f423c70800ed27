"""Which parameters Muon updates: decided by each parameter's role in the model, not its shape.

The rule, in order (the first that applies decides):

1. ``adamw_params`` / ``muon_params``: parameters whose name (any name, for a shared tensor)
   matches one of these fnmatch patterns go to that side.
2. ``embedding``: parameters of ``nn.Embedding`` modules, including an output head tied to one.
3. ``output head``: the weight of the module the model says is its head: the Forge
   :class:`~forge_lm.model.transformer.Transformer`'s ``output`` (None on a pipeline stage
   without the head: then no parameter of the stage is the head, whatever its shape), or what
   ``get_output_embeddings()`` returns (Hugging Face models, None meaning no head). Only a
   model that says neither falls back to the last ``nn.Linear`` (in registration order, as
   the head comes last in every decoder) that projects onto the vocabulary: ``out_features``
   equal to the model's ``vocab_size`` attribute or, without one, to the size of an
   embedding table. So on every Forge layout (whole model, any pipeline stage, sharded) a
   parameter's role is the same.
4. ``router``: parameters inside a router or gate module: one whose class name ends in
   ``Router``, ``Gate`` or ``Gating``, or that its parent holds as ``router`` or ``gate``
   (MoE routers score experts; orthogonalising their few rows does not suit them).
5. ``norm``: parameters of normalisation layers (``nn.LayerNorm``, ``nn.RMSNorm``, batch and
   group norms, and any module whose class name ends in ``Norm``).
6. ``bias``: parameters named ``bias``.
7. ``vector``: any other parameter with fewer than two dimensions (gains, scalars).
8. ``hidden matrix``: any other 2-D parameter; ``stacked matrices``: any other parameter of
   three or more dimensions (stacked expert weights ``[experts, rows, cols]``), updated as a
   batch of matrices over the last two dimensions.

Roles 2-7 go to AdamW, role 8 to Muon. On the AdamW side, weight decay follows the core's rule:
matrices are decayed, vectors are not, embeddings only with ``decay_embeddings``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence

import attrs
import torch
from torch import nn

from forge_lm.errors import ConfigError
from forge_lm.model.transformer import Transformer

MUON, ADAMW = "muon", "adamw"
MUON_ROLES = ("hidden matrix", "stacked matrices")
ROLES = (*MUON_ROLES, "embedding", "output head", "router", "norm", "bias", "vector", "muon_params", "adamw_params")

_ROUTER_CLASS = re.compile(r"(Router|Gate|Gating)$")
_ROUTER_NAMES = {"router", "gate"}
_NORM_CLASS = re.compile(r"Norm(\dd)?$")
_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)


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


def assign_parameters(
    model: nn.Module,
    muon_params: Sequence[str] = (),
    adamw_params: Sequence[str] = (),
    decay_embeddings: bool = False,
) -> list[Assignment]:
    """Every trainable parameter of ``model`` once, in ``named_parameters`` order, with its side."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    roles = _roles(model)
    unused = {pattern: True for pattern in [*muon_params, *adamw_params]}
    assignments = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        aliases = names[id(param)]
        role = roles.get(id(param)) or _role_by_dimensions(param)
        side = MUON if role in MUON_ROLES else ADAMW
        for wanted, patterns in ((MUON, muon_params), (ADAMW, adamw_params)):
            matched = [p for p in patterns if any(fnmatch.fnmatchcase(alias, p) for alias in aliases)]
            for pattern in matched:
                unused[pattern] = False
            if matched:
                side, role = wanted, f"{wanted}_params"
        if side == MUON and param.ndim < 2:
            raise ConfigError(
                f"[optimizer] muon_params: '{name}' has shape {list(param.shape)}; Muon orthogonalises matrices, "
                "so only parameters of two or more dimensions can go to it."
            )
        decay = param.ndim >= 2 and (decay_embeddings or roles.get(id(param)) != "embedding")
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


def _role_by_dimensions(param: torch.Tensor) -> str:
    if param.ndim < 2:
        return "vector"
    return "hidden matrix" if param.ndim == 2 else "stacked matrices"


def _roles(model: nn.Module) -> dict[int, str]:
    """``id(param) -> role`` for the parameters whose module says what they are (rules 2-6)."""
    head = _output_head(model)
    routers: set[str] = set()  # module paths of routers and gates
    found: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        local_name = path.rpartition(".")[2]
        parent = path.rpartition(".")[0]
        in_router = (
            bool(_ROUTER_CLASS.search(type(module).__name__))
            or local_name in _ROUTER_NAMES
            or any(path.startswith(r + ".") or parent == r for r in routers)
        )
        if in_router:
            routers.add(path)
        for attr, param in module.named_parameters(recurse=False):
            role = None
            if isinstance(module, nn.Embedding):
                role = "embedding"
            elif attr == "weight" and module is head:
                role = "output head"
            elif in_router:
                role = "router"
            elif isinstance(module, _NORM_TYPES) or _NORM_CLASS.search(type(module).__name__):
                role = "norm"
            elif attr == "bias":
                role = "bias"
            if role is not None:
                found.setdefault(id(param), []).append(role)
    order = ["embedding", "output head", "router", "norm", "bias"]
    return {key: min(roles, key=order.index) for key, roles in found.items()}


def _output_head(model: nn.Module) -> nn.Module | None:
    """The module that is the model's head, by what the model declares (see rule 3)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the model it compiled
    if isinstance(model, Transformer):
        # The core model's head is its ``output``, None on a pipeline stage that does not hold it:
        # a hidden matrix as wide as the vocabulary must not be taken for it there.
        return model.output
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        head = get_head()
        return head if isinstance(head, nn.Module) else None
    # A model that declares nothing: the shape heuristic, the last projection onto the vocabulary.
    vocab = getattr(model, "vocab_size", None)
    sizes = (
        {vocab}
        if isinstance(vocab, int)
        else {module.num_embeddings for module in model.modules() if isinstance(module, nn.Embedding)}
    )
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features in sizes]
    return heads[-1] if heads else None


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
