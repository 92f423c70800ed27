"""Router contract, as forge-moe defines it (the core leaves the call contract to the MoE layer):
``factory(options, dim, n_experts, top_k) -> nn.Module``; ``router(x)`` with ``x`` of shape
``[batch, seq, dim]`` returns an object with

- ``indices``: ``LongTensor[batch * seq, top_k]``, each token's experts (tokens in row-major
  order, column 0 the first choice), ``top_k`` distinct experts in ``[0, n_experts)``;
- ``weights``: float32 ``[batch * seq, top_k]`` combine weights, non-negative, differentiable
  with respect to the router's parameters; summing to 1 per token when the router normalises;
- ``aux_losses``: ``{name: scalar tensor}``, each already multiplied by its weight.

Aids: ``n_experts`` (8) and ``top_k`` (2) for the sizes the router is built with, and
``normalized``: whether the weights of a token sum to 1. Without it the kit expects that unless
the options have ``renormalize = False``.
"""

from __future__ import annotations

import torch

from forge_lm.testing._kit import Subject, category_check

DIM, BATCH, SEQ = 16, 3, 5
N_EXPERTS, TOP_K = 8, 2
TOLERANCE = 1e-5  # on the sum of a token's normalised weights


def _sizes(subject: Subject) -> tuple[int, int]:
    return int(subject.extras.get("n_experts", N_EXPERTS)), int(subject.extras.get("top_k", TOP_K))


def _build(subject: Subject, seed: int = 0) -> torch.nn.Module:
    n_experts, top_k = _sizes(subject)
    torch.manual_seed(seed)
    router = subject.build(DIM, n_experts, top_k)
    assert isinstance(router, torch.nn.Module), (
        f"{subject.label}: the factory must return a torch.nn.Module; it returned {type(router).__name__}"
    )
    return router


def _input(seed: int = 1) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(seed))


def _route(subject: Subject, router: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    routing = router(x)
    missing = [name for name in ("indices", "weights", "aux_losses") if not hasattr(routing, name)]
    assert not missing, (
        f"{subject.label}: router(x) must return an object with indices, weights and aux_losses; "
        f"{type(routing).__name__} lacks {missing}"
    )
    return routing.indices, routing.weights, routing.aux_losses


def _normalized(subject: Subject) -> bool:
    if "normalized" in subject.extras:
        return bool(subject.extras["normalized"])
    return bool(getattr(subject.options(), "renormalize", True))


@category_check("routers")
def check_returns_the_documented_shapes(subject: Subject) -> None:
    _, top_k = _sizes(subject)
    tokens = BATCH * SEQ
    indices, weights, aux_losses = _route(subject, _build(subject), _input())
    expected = (tokens, top_k)
    assert isinstance(indices, torch.Tensor) and indices.dtype == torch.long, (
        f"{subject.label}: indices must be a LongTensor (torch.int64); got "
        f"{getattr(indices, 'dtype', type(indices).__name__)}"
    )
    assert tuple(indices.shape) == expected, (
        f"{subject.label}: for x of shape {(BATCH, SEQ, DIM)} indices has shape {tuple(indices.shape)}; "
        f"the kit expects [batch * seq, top_k] = {expected}"
    )
    assert isinstance(weights, torch.Tensor) and weights.dtype == torch.float32, (
        f"{subject.label}: weights must be a float32 tensor; got {getattr(weights, 'dtype', type(weights).__name__)}"
    )
    assert tuple(weights.shape) == expected, (
        f"{subject.label}: for x of shape {(BATCH, SEQ, DIM)} weights has shape {tuple(weights.shape)}; "
        f"the kit expects [batch * seq, top_k] = {expected}"
    )
    assert isinstance(aux_losses, dict), (
        f"{subject.label}: aux_losses must be a dict of name to scalar tensor; got {type(aux_losses).__name__}"
    )
    for name, value in aux_losses.items():
        assert isinstance(name, str) and isinstance(value, torch.Tensor) and value.ndim == 0, (
            f"{subject.label}: aux_losses['{name}'] must be a scalar tensor (0 dimensions); got "
            f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
        )
        assert torch.isfinite(value), f"{subject.label}: aux_losses['{name}'] is {value.item()}; it must be finite"


@category_check("routers")
def check_chooses_top_k_distinct_experts_per_token(subject: Subject) -> None:
    n_experts, top_k = _sizes(subject)
    indices, _, _ = _route(subject, _build(subject), _input())
    outside = indices[(indices < 0) | (indices >= n_experts)]
    assert outside.numel() == 0, (
        f"{subject.label}: indices must lie in [0, n_experts) = [0, {n_experts}); found {outside.unique().tolist()}"
    )
    distinct = torch.tensor([row.unique().numel() for row in indices])
    repeated = (distinct < top_k).nonzero().flatten().tolist()
    assert not repeated, (
        f"{subject.label}: each token must get top_k = {top_k} distinct experts; tokens {repeated[:5]} get "
        f"{[indices[t].tolist() for t in repeated[:5]]}"
    )


@category_check("routers")
def check_weights_are_non_negative_and_normalised(subject: Subject) -> None:
    _, weights, _ = _route(subject, _build(subject), _input())
    weights = weights.detach()
    assert torch.isfinite(weights).all(), f"{subject.label}: combine weights must be finite; found {weights.tolist()}"
    lowest = weights.min().item()
    assert lowest >= 0, f"{subject.label}: combine weights must be non-negative; the smallest is {lowest:.6g}"
    if _normalized(subject):
        sums = weights.double().sum(dim=-1)
        worst = (sums - 1).abs().max().item()
        assert worst <= TOLERANCE, (
            f"{subject.label}: a token's combine weights must sum to 1 (within {TOLERANCE:g}); the sums range "
            f"from {sums.min().item():.6g} to {sums.max().item():.6g} (pass normalized=False for a router that "
            "does not normalise)"
        )


@category_check("routers")
def check_weights_carry_gradient_to_the_router(subject: Subject) -> None:
    router = _build(subject)
    router.train()
    _, weights, aux_losses = _route(subject, router, _input())
    params = [(name, p) for name, p in router.named_parameters() if p.requires_grad]
    assert params, f"{subject.label}: the router has no trainable parameter; the kit expects at least 1"
    target = torch.randn(weights.shape, generator=torch.Generator().manual_seed(2))
    from_weights = (
        torch.autograd.grad((weights * target).sum(), [p for _, p in params], allow_unused=True, retain_graph=True)
        if weights.requires_grad
        else [None] * len(params)
    )
    reached = [name for (name, _), g in zip(params, from_weights, strict=True) if g is not None and g.abs().sum() > 0]
    assert reached, (
        f"{subject.label}: the combine weights must be differentiable with respect to the router's parameters; "
        f"a loss on them gives a non-zero gradient to 0 of {len(params)} parameters {[n for n, _ in params]} "
        "(the kit expects at least 1)"
    )
    total = (weights * target).sum() + sum(aux_losses.values(), torch.zeros(()))
    grads = torch.autograd.grad(total, [p for _, p in params], allow_unused=True)
    missing = [name for (name, _), g in zip(params, grads, strict=True) if g is None]
    assert not missing, (
        f"{subject.label}: every trainable parameter must get a gradient from the weights and aux losses; "
        f"{len(missing)} of {len(params)} get none: {missing}"
    )
    bad = [name for (name, _), g in zip(params, grads, strict=True) if not torch.isfinite(g).all()]
    assert not bad, f"{subject.label}: gradients must be finite; parameters {bad} get non-finite ones"


@category_check("routers")
def check_routes_the_same_input_the_same_way(subject: Subject) -> None:
    router = _build(subject)
    router.eval()
    x = _input()
    with torch.no_grad():
        first_indices, first_weights, _ = _route(subject, router, x)
        again_indices, again_weights, _ = _route(subject, router, x)
    changed = (first_indices != again_indices).any(dim=-1).sum().item()
    assert changed == 0, (
        f"{subject.label}: in eval mode the same input must be routed the same way; {changed} of "
        f"{first_indices.shape[0]} tokens changed experts on a second call (the kit expects 0)"
    )
    gap = (first_weights - again_weights).abs().max().item()
    assert gap == 0, (
        f"{subject.label}: in eval mode the same input must get the same weights; they differ by up to {gap:.3g} "
        "on a second call (the kit expects 0)"
    )
