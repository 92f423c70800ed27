"""Feed-forward contract: ``factory(options, dim, layer_index) -> nn.Module`` mapping
``[batch, seq, dim]`` to the same shape."""

from __future__ import annotations

import torch

from forge_lm.testing._kit import Subject, category_check

DIM = 32


@category_check("feed_forwards")
def check_maps_hidden_states_to_the_same_shape_with_gradients(subject: Subject) -> None:
    torch.manual_seed(0)
    layer = subject.build(DIM, 0)
    assert isinstance(layer, torch.nn.Module), f"{subject.label} must return a torch.nn.Module"
    x = torch.randn(2, 5, DIM, requires_grad=True)
    y = layer(x)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape, f"{subject.label} maps {tuple(x.shape)} to {y.shape}"
    assert torch.isfinite(y).all(), f"{subject.label} returns non-finite values"
    y.square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0, f"{subject.label} passes no gradient to its input"
    frozen = [name for name, p in layer.named_parameters() if p.requires_grad and p.grad is None]
    assert not frozen, f"{subject.label}: parameters receive no gradient: {frozen}"
