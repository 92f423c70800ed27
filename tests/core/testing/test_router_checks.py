"""The kit's router checks: forge-moe's routers pass them; a broken router fails each one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from forge_lm import hookimpl
from forge_lm.plugins import PluginManager
from forge_lm.testing import check_component, component_checks

MOE = PluginManager()  # forge-moe is installed in the development environment


@pytest.mark.parametrize(
    ("name", "extras"),
    [
        ("softmax_topk", {}),
        ("softmax_topk", {"options": {"renormalize": False, "z_loss_weight": 1e-3}}),
        ("sigmoid_topk", {}),
        ("sigmoid_topk", {"options": {"sequence_balance_loss_weight": 1e-3}, "n_experts": 6, "top_k": 3}),
    ],
)
def test_forge_moe_routers_pass_the_router_checks(name, extras):
    check_component("routers", name, manager=MOE, **extras)


class _Router(nn.Module):
    """A softmax top-k router with one defect chosen by ``flaw``."""

    def __init__(self, dim, n_experts, top_k, flaw):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_experts, dim) * 0.1)
        self.unused = nn.Parameter(torch.zeros(3))
        self.top_k, self.n_experts, self.flaw = top_k, n_experts, flaw

    def forward(self, x):
        logits = x.reshape(-1, x.shape[-1]).float() @ self.weight.t()
        if self.flaw == "noisy":
            logits = logits + torch.randn_like(logits)
        probs = logits.softmax(-1)
        top, indices = probs.topk(self.top_k, dim=-1)
        weights = top / top.sum(-1, keepdim=True)
        losses = {} if self.flaw == "orphan" else {"pull": self.unused.square().sum()}
        if self.flaw == "per_batch":
            indices = indices.reshape(*x.shape[:-1], self.top_k)
        elif self.flaw == "repeats":
            indices = indices[:, :1].expand(-1, self.top_k).contiguous()
        elif self.flaw == "unnormalised":
            weights = top
        elif self.flaw == "detached":
            weights = weights.detach()
        return SimpleNamespace(indices=indices, weights=weights, aux_losses=losses)


def _manager_with(flaw: str) -> PluginManager:
    class Broken:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_register_routers(self, register):
            register(
                flaw,
                lambda options, dim, n_experts, top_k: _Router(dim, n_experts, top_k, flaw),
                description="broken on purpose",
            )

    manager = PluginManager()
    info = manager.add_plugin(Broken(), "broken", distribution="forge-broken", version="9.9")
    assert info.status == "ok", info.reason
    return manager


def _failure(flaw: str, check: str) -> str:
    checks = {c.id.rsplit(":", 1)[1]: c for c in component_checks("routers", flaw, manager=_manager_with(flaw))}
    with pytest.raises(AssertionError) as caught:
        checks[check]()
    return str(caught.value)


@pytest.mark.parametrize(
    ("flaw", "check", "expected"),
    [
        ("per_batch", "returns_the_documented_shapes", "indices has shape (3, 5, 2); the kit expects"),
        ("repeats", "chooses_top_k_distinct_experts_per_token", "must get top_k = 2 distinct experts"),
        ("unnormalised", "weights_are_non_negative_and_normalised", "must sum to 1 (within 1e-05)"),
        ("detached", "weights_carry_gradient_to_the_router", "gives a non-zero gradient to 0 of 2 parameters"),
        ("orphan", "weights_carry_gradient_to_the_router", "1 of 2 get none: ['unused']"),
        ("noisy", "routes_the_same_input_the_same_way", "tokens changed experts on a second call"),
    ],
)
def test_each_router_check_catches_its_broken_router(flaw, check, expected):
    message = _failure(flaw, check)
    assert message.startswith(f"router '{flaw}'")
    assert expected in message


def test_unknown_aids_are_refused():
    with pytest.raises(TypeError, match="accepts: n_experts, top_k, normalized"):
        component_checks("routers", "softmax_topk", manager=MOE, renormalise=False)
