"""The AdamW fallback: a hand-written AdamW step, its own hyperparameters, and the schedule."""

from __future__ import annotations

import torch

from forge_lm.plugins import PluginManager
from forge_optim_muon.factory import build_muon

OPTIONS = {"adamw_lr": 0.01, "adamw_betas": [0.8, 0.9], "adamw_eps": 1e-6, "adamw_weight_decay": 0.05}


def hand_written_adamw(w, grads, lrs, betas, eps, weight_decay):
    """AdamW as in Loshchilov & Hutter, in float64: decoupled decay, bias-corrected moments."""
    w = w.double()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    beta1, beta2 = betas
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        g = g.double()
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        w = w * (1 - lr * weight_decay) - lr * m_hat / (v_hat.sqrt() + eps)
    return w


def _run(models, steps, scheduler=None):
    """Three steps with random gradients; returns the model, its start, the gradients and each step's fallback lr."""
    model = models.tiny_mixture_lm()
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_muon(models.muon_options(**OPTIONS), model)
    schedule = scheduler(optimizer) if scheduler else None
    generator = torch.Generator().manual_seed(7)
    grads, lrs = [], []
    for _ in range(steps):
        step_grads = {name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            p.grad = step_grads[name].clone()
        lrs.append({g["algorithm"]: g["lr"] for g in optimizer.param_groups})
        optimizer.step()
        if schedule:
            schedule.step()
        grads.append(step_grads)
    return model, start, grads, lrs


def test_fallback_parameters_take_hand_written_adamw_steps_with_their_own_hyperparameters(models):
    model, start, grads, _ = _run(models, 3)
    decayed = ("output.weight", "layers.0.router.weight")
    betas, eps = OPTIONS["adamw_betas"], OPTIONS["adamw_eps"]
    for name in ("tok_embeddings.weight", *decayed, "layers.0.mix.bias", "norm.weight"):
        decay = OPTIONS["adamw_weight_decay"] if name in decayed else 0.0
        expected = hand_written_adamw(start[name], [g[name] for g in grads], [0.01] * 3, betas, eps, decay)
        actual = dict(model.named_parameters())[name]
        torch.testing.assert_close(actual.double(), expected, rtol=0, atol=1e-6, msg=name)


def test_fallback_learning_rate_follows_the_schedule(models):
    registry = PluginManager().registry
    cosine = registry.resolve("schedulers", "cosine")
    options = cosine.options_class(warmup_steps=2, min_lr_ratio=0.1)
    model, start, grads, lrs = _run(models, 5, lambda optimizer: cosine.build(options, optimizer, 5))
    factors = [step["muon"] / models.muon_options().lr for step in lrs]
    assert factors[0] == 0.5  # warmup
    assert factors[-1] < 0.5  # then decay
    for step, factor in zip(lrs, factors, strict=True):
        assert step["adamw"] == OPTIONS["adamw_lr"] * factor
    name, betas, eps = "tok_embeddings.weight", OPTIONS["adamw_betas"], OPTIONS["adamw_eps"]
    scheduled = [step["adamw"] for step in lrs]
    expected = hand_written_adamw(start[name], [g[name] for g in grads], scheduled, betas, eps, 0.0)
    torch.testing.assert_close(dict(model.named_parameters())[name].double(), expected, rtol=0, atol=1e-6)
