"""``schedule_free_adamw`` follows Algorithm 1 of Defazio et al. 2024 and swaps y and x on train()/eval()."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from forge_lm.default_plugins.options.schedulers import ConstantOptions
from forge_lm.schedulers.lambdas import build_constant
from forge_lm.testing._tiny import plain_round_trip

LR, BETAS, EPS, DECAY, WARMUP = 0.05, (0.9, 0.999), 1e-8, 0.1, 3


class PaperScheduleFreeAdamW:
    """The paper's Algorithm 1, with x, y and z all kept explicitly (no in-place algebra)."""

    def __init__(self, params: dict[str, torch.Tensor], decayed: tuple[str, ...], warmup: int) -> None:
        self.x = {name: p.detach().clone() for name, p in params.items()}
        self.z = {name: p.detach().clone() for name, p in params.items()}
        self.v = {name: torch.zeros_like(p) for name, p in params.items()}
        self.decay = {name: DECAY if name in decayed else 0.0 for name in params}
        self.warmup, self.t, self.lr_sq_sum = warmup, 0, 0.0

    def y(self) -> dict[str, torch.Tensor]:
        beta1 = BETAS[0]
        return {name: (1 - beta1) * self.z[name] + beta1 * self.x[name] for name in self.x}

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        beta2 = BETAS[1]
        self.t += 1
        y = self.y()
        lr_t = LR * math.sqrt(1 - beta2**self.t) * min(1.0, self.t / self.warmup)
        for name, g in grads.items():
            self.v[name] = beta2 * self.v[name] + (1 - beta2) * g**2
            self.z[name] = self.z[name] - lr_t * g / (self.v[name].sqrt() + EPS) - lr_t * self.decay[name] * y[name]
        self.lr_sq_sum += lr_t**2
        c = lr_t**2 / self.lr_sq_sum
        for name in self.x:
            self.x[name] = (1 - c) * self.x[name] + c * self.z[name]


def build(build_optimizer, model, **overrides):
    options = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": DECAY, "warmup_steps": WARMUP}
    return build_optimizer("schedule_free_adamw", model, **{**options, **overrides})


def train(model, optimizer, loss_at, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        loss_at(model, step).backward()
        optimizer.step()


def assert_params(model, expected: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=1e-10, atol=1e-12, msg=name)


def test_schedule_free_adamw_matches_the_papers_algorithm_in_y_and_in_x(build_optimizer, make_model, loss_at, decayed):
    model = make_model()
    optimizer = build(build_optimizer, model)
    paper = PaperScheduleFreeAdamW(dict(model.named_parameters()), decayed, WARMUP)

    for step in range(8):
        optimizer.zero_grad()
        loss_at(model, step).backward()
        optimizer.step()
        y = {name: p.requires_grad_(True) for name, p in paper.y().items()}
        loss = loss_at(lambda inputs, y=y: functional_call(model, y, (inputs,)), step)
        paper.step(dict(zip(y, torch.autograd.grad(loss, list(y.values())), strict=True)))

    assert_params(model, paper.y())  # training: the parameters hold y
    optimizer.eval()
    assert_params(model, paper.x)  # evaluation: the averaged point x
    optimizer.train()
    assert_params(model, paper.y())


def test_eval_and_train_each_apply_once_however_often_called(build_optimizer, make_model, loss_at):
    model = make_model()
    optimizer = build(build_optimizer, model)
    train(model, optimizer, loss_at, range(4))
    y = [p.detach().clone() for p in model.parameters()]

    optimizer.eval()
    x = [p.detach().clone() for p in model.parameters()]
    optimizer.eval()
    assert all(torch.equal(a, b) for a, b in zip(x, model.parameters(), strict=True))
    optimizer.train()
    optimizer.train()
    for a, b in zip(y, model.parameters(), strict=True):
        torch.testing.assert_close(b.detach(), a, rtol=1e-12, atol=1e-15)
    assert not all(torch.allclose(a, b) for a, b in zip(x, y, strict=True))  # x and y do differ


def test_a_step_in_eval_mode_is_refused(build_optimizer, make_model, loss_at):
    model = make_model()
    optimizer = build(build_optimizer, model)
    train(model, optimizer, loss_at, range(2))
    optimizer.eval()
    loss_at(model, 2).backward()

    with pytest.raises(RuntimeError, match=r"eval mode.*Call optimizer.train\(\)"):
        optimizer.step()


@pytest.mark.parametrize("export_in_eval_mode", [False, True])
def test_a_checkpoint_round_trip_resumes_exactly(export_in_eval_mode, build_optimizer, make_model, loss_at):
    model = make_model()
    optimizer = build(build_optimizer, model)
    train(model, optimizer, loss_at, range(4))
    if export_in_eval_mode:  # what the training loop does before writing a checkpoint
        optimizer.eval()
    saved_model, saved_optimizer = plain_round_trip(model.state_dict()), plain_round_trip(optimizer.state_dict())
    optimizer.train()
    train(model, optimizer, loss_at, range(4, 8))

    resumed = make_model(seed=7)  # other initial weights: everything must come from the checkpoint
    resumed.load_state_dict(saved_model)
    resumed_optimizer = build(build_optimizer, resumed)
    resumed_optimizer.load_state_dict(saved_optimizer)
    resumed_optimizer.train()
    train(resumed, resumed_optimizer, loss_at, range(4, 8))

    for (name, expected), actual in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), name


def test_a_schedulers_warmup_acts_as_the_optimizers_own(build_optimizer, make_model, loss_at):
    own, scheduled = make_model(), make_model()
    own_optimizer = build(build_optimizer, own, warmup_steps=5)
    scheduled_optimizer = build(build_optimizer, scheduled, warmup_steps=0)
    scheduler = build_constant(ConstantOptions(warmup_steps=5), scheduled_optimizer, 10)

    for step in range(10):
        train(own, own_optimizer, loss_at, range(step, step + 1))
        train(scheduled, scheduled_optimizer, loss_at, range(step, step + 1))
        scheduler.step()

    own_optimizer.eval()
    scheduled_optimizer.eval()
    for a, b in zip(own.parameters(), scheduled.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_the_loop_evaluates_at_the_averaged_point_and_trains_on():
    """The loop's evaluation context swaps schedule-free's evaluation weights in and back out;
    an optimizer without an evaluation point (AdamW) is left alone."""
    from forge_lm.components import EvaluationPointOptimizer
    from forge_lm.optim.schedule_free import ScheduleFreeAdamW
    from forge_lm.train.step import evaluation_mode

    model = torch.nn.Linear(3, 2)
    optimizer = ScheduleFreeAdamW(model.parameters(), lr=0.1, warmup_steps=0)
    assert isinstance(optimizer, EvaluationPointOptimizer)
    assert not isinstance(torch.optim.AdamW(model.parameters()), EvaluationPointOptimizer)
    for _ in range(3):
        model(torch.randn(4, 3)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    training = model.weight.detach().clone()
    optimizer.eval()
    averaged = model.weight.detach().clone()
    optimizer.train()
    assert not torch.equal(training, averaged)  # the two points differ after a few steps
    with evaluation_mode(model, optimizer):
        assert not model.training
        torch.testing.assert_close(model.weight.detach(), averaged)
    assert model.training
    torch.testing.assert_close(model.weight.detach(), training)
