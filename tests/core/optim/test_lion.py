"""``lion`` follows Chen et al. 2023: sign of interpolated momentum, decoupled weight decay."""

from __future__ import annotations

import pytest
import torch

from forge_lm.errors import ConfigError

STEPS = 6


def lion_reference_step(param, grad, momentum, lr, beta1, beta2, weight_decay):
    """The paper's update, written out: returns the new parameter and momentum."""
    direction = torch.sign(beta1 * momentum + (1 - beta1) * grad)
    new_param = param - lr * direction - lr * weight_decay * param
    new_momentum = beta2 * momentum + (1 - beta2) * grad
    return new_param, new_momentum


@pytest.mark.parametrize("betas", [[0.9, 0.99], [0.5, 0.8]])
def test_lion_matches_the_reference_step_over_several_steps(betas, build_optimizer, make_model, loss_at, decayed):
    ours, theirs = make_model(), make_model()
    optimizer = build_optimizer("lion", ours, lr=1e-2, betas=betas, weight_decay=0.5)
    momenta = {name: torch.zeros_like(p) for name, p in theirs.named_parameters()}

    for step in range(STEPS):
        optimizer.zero_grad()
        loss_at(ours, step).backward()
        optimizer.step()

        theirs.zero_grad()
        loss_at(theirs, step).backward()
        with torch.no_grad():
            for name, param in theirs.named_parameters():
                decay = 0.5 if name in decayed else 0.0
                new, momenta[name] = lion_reference_step(param, param.grad, momenta[name], 1e-2, *betas, decay)
                param.copy_(new)

    for (name, actual), expected in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-15, msg=name)


def test_lion_moves_each_coordinate_by_exactly_lr_without_decay(build_optimizer, make_model, loss_at):
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer("lion", model, lr=1e-3, weight_decay=0.0)

    loss_at(model, 0).backward()
    optimizer.step()

    for old, param in zip(before, model.parameters(), strict=True):
        moved = (param.detach() - old).abs()
        torch.testing.assert_close(moved[param.grad != 0], torch.full_like(moved[param.grad != 0], 1e-3))


def test_lion_defaults_to_the_papers_betas(build_optimizer, make_model):
    optimizer = build_optimizer("lion", make_model())

    assert {group["betas"] for group in optimizer.param_groups} == {(0.9, 0.99)}


@pytest.mark.parametrize("betas", [[1.0, 0.99], [0.0, 0.99], [0.9, 1.0]])
def test_lion_rejects_betas_outside_the_unit_interval(betas, options_of):
    with pytest.raises(ConfigError) as caught:
        options_of("lion", betas=betas)

    assert str(caught.value) == (
        f"[optimizer] betas: must be [beta1, beta2] with 0 < beta1 < 1 and 0 <= beta2 < 1, got {betas!r}."
    )
