"""Feed-forward contract: ``factory(options, dim, layer_index) -> nn.Module`` mapping
``[batch, seq, dim]`` to the same shape."""

from __future__ import annotations

import torch

from forge_lm.components import CountsActiveParameters, TensorParallelizable
from forge_lm.testing._kit import Subject, category_check

DIM = 32


@category_check("feed_forwards")
def check_maps_hidden_states_to_the_same_shape_with_gradients(subject: Subject) -> None:
    torch.manual_seed(0)
    layer = subject.build(DIM, 0)
    assert isinstance(layer, torch.nn.Module), (
        f"{subject.label} returned {type(layer).__name__}; the kit expects a torch.nn.Module"
    )
    x = torch.randn(2, 5, DIM, requires_grad=True)
    y = layer(x)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape, (
        f"{subject.label} maps {tuple(x.shape)} to "
        f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}; the kit expects the same shape"
    )
    bad = int((~torch.isfinite(y)).sum())
    assert bad == 0, f"{subject.label} returns {bad} non-finite values of {y.numel()}; the kit expects none"
    y.square().mean().backward()
    reached = 0.0 if x.grad is None else x.grad.abs().sum().item()
    assert reached > 0, (
        f"{subject.label} passes no gradient to its input (total magnitude {reached}); the kit expects a non-zero one"
    )
    frozen = [name for name, p in layer.named_parameters() if p.requires_grad and p.grad is None]
    assert not frozen, (
        f"{subject.label}: {len(frozen)} trainable parameters receive no gradient: {frozen}; the kit expects "
        "every trainable parameter to get one"
    )


@category_check("feed_forwards")
def check_the_capabilities_it_claims_are_well_formed(subject: Subject) -> None:
    """A layer claiming a capability of forge_lm.components keeps its promise: an active
    parameter count between 1 and its parameters, a tensor-parallel plan naming submodules."""
    layer = subject.build(DIM, 0)
    total = sum(p.numel() for p in layer.parameters())
    if isinstance(layer, CountsActiveParameters):
        active = layer.active_parameter_count()
        assert isinstance(active, int) and 0 < active <= total, (
            f"{subject.label}: active_parameter_count() returned {active!r}; the kit expects an int between 1 and "
            f"the layer's {total} parameters"
        )
    if isinstance(layer, TensorParallelizable):
        plan = layer.tensor_parallel_plan()
        assert isinstance(plan, dict) and plan, (
            f"{subject.label}: tensor_parallel_plan() returned {plan!r}; the kit expects a non-empty "
            "{submodule name: ParallelStyle} dict"
        )
        names = {name for name, _ in layer.named_modules()}
        missing = sorted(name for name in plan if name not in names)
        assert not missing, (
            f"{subject.label}: tensor_parallel_plan() names {missing}, which are not submodules of the layer "
            f"(it has {sorted(n for n in names if n)}); the kit expects names as named_modules() gives them"
        )
