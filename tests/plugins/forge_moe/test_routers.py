"""The routers against hand-computed examples, and their losses against the written-out formulas."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from forge_lm.losses.aux import collect_aux
from forge_moe.layer import MoELayer, after_optimizer_step
from forge_moe.routers import (
    SigmoidTopKRouter,
    SoftmaxTopKRouter,
    sequence_balance_loss,
    switch_balance_loss,
)

from .conftest import (
    ref_sequence_balance,
    ref_sigmoid,
    ref_softmax,
    ref_switch_balance,
    ref_z_loss,
)

# Two tokens whose router logits are the rows below: with dim = n_experts = 4 and the router
# weight the identity, the logits are the input itself.
LOGITS = [[1.0, 2.0, 3.0, 0.0], [0.0, 3.5, 0.5, 5.0]]


def assert_values(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-7)


def identity_router(router: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    return router


def logits_input(rows=LOGITS) -> torch.Tensor:
    return torch.tensor(rows).view(1, len(rows), 4)  # [batch 1, seq, dim 4]


def test_softmax_router_picks_the_top_k_probabilities_and_renormalises_them():
    router = identity_router(SoftmaxTopKRouter(4, 4, 2, balance_loss_weight=0.0))
    routing = router(logits_input())
    assert routing.indices.tolist() == [[2, 1], [3, 1]]
    e = math.e
    expected = [[e**3 / (e**3 + e**2), e**2 / (e**3 + e**2)], [e**5 / (e**5 + e**3.5), e**3.5 / (e**5 + e**3.5)]]
    assert_values(routing.weights, expected)
    assert routing.aux_losses == {}


def test_softmax_router_without_renormalisation_keeps_the_softmax_probabilities():
    router = identity_router(SoftmaxTopKRouter(4, 4, 2, balance_loss_weight=0.0, renormalize=False))
    routing = router(logits_input())
    probs = [ref_softmax(row) for row in LOGITS]
    expected = [[probs[0][2], probs[0][1]], [probs[1][3], probs[1][1]]]
    assert_values(routing.weights, expected)


def test_softmax_router_losses_are_the_switch_and_z_formulas_times_their_weights():
    router = identity_router(SoftmaxTopKRouter(4, 4, 2, balance_loss_weight=0.3, z_loss_weight=0.02))
    routing = router(logits_input())
    probs = [ref_softmax(row) for row in LOGITS]
    balance = ref_switch_balance(probs, [[2, 1], [3, 1]])
    # By hand: f = (0, 2, 1, 1) / 4, P = mean probabilities, loss = E * sum_i f_i * P_i.
    p = [(probs[0][i] + probs[1][i]) / 2 for i in range(4)]
    assert balance == pytest.approx(4 * (0.5 * p[1] + 0.25 * p[2] + 0.25 * p[3]))
    assert routing.aux_losses["balance_loss"].item() == pytest.approx(0.3 * balance, rel=1e-6)
    assert routing.aux_losses["z_loss"].item() == pytest.approx(0.02 * ref_z_loss(LOGITS), rel=1e-6)


def test_switch_balance_loss_is_one_when_balanced_and_e_when_collapsed():
    uniform = torch.full((8, 4), 0.25)
    spread = torch.tensor([[0], [1], [2], [3]] * 2)
    assert switch_balance_loss(uniform, spread).item() == pytest.approx(1.0)
    collapsed = torch.zeros(8, 4)
    collapsed[:, 0] = 1.0
    assert switch_balance_loss(collapsed, torch.zeros(8, 1, dtype=torch.long)).item() == pytest.approx(4.0)


def test_sigmoid_router_chooses_with_the_bias_but_weighs_with_the_unbiased_scores():
    router = identity_router(SigmoidTopKRouter(4, 4, 2))
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    routing = router(logits_input([[0.0, 1.0, -1.0, 2.0]]))
    # Biased scores: expert 2 (sigmoid(-1) + 5) first, then expert 3 (sigmoid(2)) over expert 1 (sigmoid(1)).
    assert routing.indices.tolist() == [[2, 3]]
    s2, s3 = ref_sigmoid(-1.0), ref_sigmoid(2.0)
    assert_values(routing.weights, [[s2 / (s2 + s3), s3 / (s2 + s3)]])


def test_sigmoid_router_bias_is_a_buffer_that_gets_no_gradient_and_is_saved():
    router = SigmoidTopKRouter(8, 4, 2, sequence_balance_loss_weight=0.1, z_loss_weight=0.01)
    router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    routing = router(torch.randn(2, 5, 8))
    (routing.weights.sum() + sum(routing.aux_losses.values())).backward()
    assert [name for name, _ in router.named_parameters()] == ["weight"]
    assert router.weight.grad is not None
    assert router.weight.grad.abs().sum() > 0
    assert not router.expert_bias.requires_grad
    assert router.expert_bias.grad is None
    assert set(router.state_dict()) == {"weight", "expert_bias"}  # the pending load is not state
    assert router.state_dict()["expert_bias"].tolist() == pytest.approx([0.3, -0.2, 0.1, 0.0])


def test_sigmoid_router_bias_moves_by_rate_times_sign_of_the_load_error_after_each_step():
    router = identity_router(SigmoidTopKRouter(4, 4, 2, bias_update_rate=0.01)).train()
    # Token choices: {3, 1} and {3, 2}: loads (0, 1, 1, 2), mean 1.
    router(logits_input([[0.0, 1.0, -1.0, 2.0], [-3.0, 0.0, 1.0, 2.0]]))
    router.after_optimizer_step()
    assert router.expert_bias.tolist() == pytest.approx([0.01, 0.0, 0.0, -0.01])
    assert router.pending_load.tolist() == [0, 0, 0, 0]
    # Two micro-batches before one step: their loads add up before the sign is taken.
    router.expert_bias.zero_()
    router(logits_input([[5.0, 4.0, 0.0, 0.0]]))  # {0, 1}
    router(logits_input([[5.0, 0.0, 4.0, 0.0]]))  # {0, 2}: loads (2, 1, 1, 0), mean 1
    router.after_optimizer_step()
    assert router.expert_bias.tolist() == pytest.approx([-0.01, 0.0, 0.0, 0.01])


def test_sigmoid_router_in_eval_mode_leaves_the_load_alone():
    router = SigmoidTopKRouter(8, 4, 2).eval()
    router(torch.randn(1, 6, 8))
    router.after_optimizer_step()
    assert router.expert_bias.tolist() == [0, 0, 0, 0]


def test_sequence_balance_loss_is_computed_per_sequence_then_averaged():
    logits = torch.tensor(
        [[[0.0, 1.0, -1.0, 2.0], [1.0, 0.0, 0.5, -2.0]], [[2.0, 2.5, -1.0, 0.0], [0.0, 3.0, 1.0, 1.0]]]
    )
    scores = logits.sigmoid()
    chosen = [[[3, 1], [0, 2]], [[1, 0], [1, 2]]]
    expected = ref_sequence_balance(scores.tolist(), chosen)
    assert sequence_balance_loss(scores, torch.tensor(chosen)).item() == pytest.approx(expected, rel=1e-6)
    # The whole batch as one sequence gives another number: the loss is not batch-level.
    whole = ref_sequence_balance([scores.view(4, 4).tolist()], [chosen[0] + chosen[1]])
    assert abs(whole - expected) > 1e-3


def test_sigmoid_router_reports_the_sequence_loss_times_its_weight_once():
    router = SigmoidTopKRouter(8, 4, 2, sequence_balance_loss_weight=0.25, z_loss_weight=0.5)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    routing = router(x)
    logits = (x @ router.weight.detach().T).view(3, 5, 4)
    chosen = routing.indices.view(3, 5, 2).tolist()
    seq = ref_sequence_balance(logits.sigmoid().tolist(), chosen)
    assert routing.aux_losses["seq_balance_loss"].item() == pytest.approx(0.25 * seq, rel=1e-5)
    assert routing.aux_losses["z_loss"].item() == pytest.approx(0.5 * ref_z_loss(logits.view(15, 4).tolist()), rel=1e-5)


def test_layer_adds_each_weighted_router_loss_to_the_training_loss_once():
    router = identity_router(SoftmaxTopKRouter(4, 4, 2, balance_loss_weight=0.3, z_loss_weight=0.02))
    layer = MoELayer(4, 7, router, n_experts=4, top_k=2, expert_hidden=8).train()
    x = logits_input()
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    with collect_aux() as aux:
        layer(x)
    probs = [ref_softmax(row) for row in LOGITS]
    balance, z = 0.3 * ref_switch_balance(probs, [[2, 1], [3, 1]]), 0.02 * ref_z_loss(LOGITS)
    assert set(aux.losses) == {"moe/layer7/balance_loss", "moe/layer7/z_loss"}
    assert aux.losses["moe/layer7/balance_loss"].item() == pytest.approx(balance, rel=1e-6)
    assert aux.total().item() == pytest.approx(balance + z, rel=1e-6)


def test_step_end_hook_updates_the_bias_of_every_sigmoid_router_in_the_model(make_moe_model, moe_manager):
    model = make_moe_model({"router": {"name": "sigmoid_topk", "bias_update_rate": 0.5}}).train()
    model(torch.randint(0, 61, (2, 12)))
    routers = [layer.feed_forward.router for layer in model.layers]
    loads = [router.pending_load.clone() for router in routers]
    assert all(load.sum() == 2 * 12 * 2 for load in loads)
    moe_manager.hook.forge_lm_step_end(context=SimpleNamespace(model=model), step=1, metrics={})
    for router, load in zip(routers, loads, strict=True):
        assert router.expert_bias.tolist() == pytest.approx((0.5 * torch.sign(load.mean() - load)).tolist())
    after_optimizer_step(model)  # nothing pending: nothing moves
    assert routers[0].expert_bias.tolist() == pytest.approx((0.5 * torch.sign(loads[0].mean() - loads[0])).tolist())
