"""Feed-forward contract: ``factory(options, dim, layer_index) -> nn.Module`` mapping
``[batch, seq, dim]`` to the same shape, initialised only through the
:class:`~forge_lm.components.Initializer` (as a model initialises its layers:
:func:`forge_lm.model.init.initialize`), deterministic in eval mode."""

from __future__ import annotations

import torch

from forge_lm.components import CountsActiveParameters, TensorParallelizable
from forge_lm.testing._init import (
    check_meta_build_equals_the_plain_build,
    check_weights_depend_on_the_seed_only,
    initialised,
)
from forge_lm.testing._kit import Subject, category_check

DIM = 32
N_LAYERS = 2  # the model the layer is initialised for (its residual_std)


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


def _layer(subject: Subject) -> torch.nn.Module:
    return subject.build(DIM, 0)


@category_check("feed_forwards")
def check_forward_is_deterministic_in_eval_mode(subject: Subject) -> None:
    layer = initialised(subject, lambda: _layer(subject), 0, N_LAYERS).eval()
    x = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first, again = layer(x), layer(x)
    gap = (first - again).abs().nan_to_num(float("inf")).max().item()
    assert torch.equal(first, again), (
        f"{subject.label}: in eval mode two passes over the same input give outputs up to {gap:.3g} apart; the kit "
        "expects identical outputs (dropout or other randomness left on outside training? use self.training)"
    )


@category_check("feed_forwards")
def check_initial_weights_depend_on_the_seed_only(subject: Subject) -> None:
    check_weights_depend_on_the_seed_only(subject, lambda: _layer(subject), N_LAYERS)


@category_check("feed_forwards")
def check_meta_build_initialises_to_the_plain_build(subject: Subject) -> None:
    """Built on the meta device, given memory and initialised (what a sharded run does), the
    layer equals the one built in memory: values set in the constructor do not survive."""
    check_meta_build_equals_the_plain_build(subject, lambda: _layer(subject), N_LAYERS)
