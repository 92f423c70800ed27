"""The MoE layer: packed experts against per-token and per-expert references, the capacity rule,
shared experts, layer placement, the active-parameter count by hand, and the conformance kit."""

from __future__ import annotations

import json

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.errors import ConfigError
from forge_lm.losses.aux import collect_aux
from forge_lm.model.flops import active_parameter_count
from forge_lm.model.init import initialize
from forge_lm.model.swiglu import SwiGLU
from forge_lm.testing import parametrize_with_checks
from forge_moe.experts import capacity, combine, dispatch, expert_swiglu, grouped_mm_works
from forge_moe.layer import MoELayer
from forge_moe.routers import Routing, SoftmaxTopKRouter

from .conftest import model_section, ref_swiglu

DIM, HIDDEN = 16, 24


class FixedRouter(torch.nn.Module):
    """A third-party router honouring the contract: fixed choices, weights from a parameter."""

    def __init__(self, indices: list[list[int]], n_experts: int) -> None:
        super().__init__()
        self.indices = torch.tensor(indices)
        self.fixed = torch.rand(len(indices), len(indices[0])) + 0.5
        self.weight = torch.nn.Parameter(self.fixed.clone())

    def init_weights(self, init) -> None:
        init.copy(self.weight, self.fixed)  # every parameter is set through init: these fixed values

    def forward(self, x: torch.Tensor) -> Routing:
        return Routing(self.indices, self.weight, {})


def reference_layer(layer: MoELayer, x: torch.Tensor, dropped: set[int] = frozenset()) -> torch.Tensor:
    """Token by token: sum over kept choices j of weight_j * expert_{e_j}(x_t), plus the shared experts."""
    routing = layer.router(x)
    flat = x.reshape(-1, x.shape[-1])
    w = layer.experts
    rows = []
    for t, token in enumerate(flat):
        out = torch.zeros(x.shape[-1])
        for j, e in enumerate(routing.indices[t].tolist()):
            if t * layer.top_k + j not in dropped:
                out = out + routing.weights[t, j] * ref_swiglu(token, w.w1[e], w.w3[e], w.w2[e])
        if layer.shared is not None:
            out = out + layer.shared(token)
        rows.append(out)
    return torch.stack(rows).view_as(x)


def softmax_layer(kernel: str = "auto", **kwargs) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(
        DIM, 0, SoftmaxTopKRouter(DIM, 6, 2), n_experts=6, top_k=2, expert_hidden=HIDDEN, kernel=kernel, **kwargs
    )
    # Weights large enough that a wrong expert changes the output visibly.
    initialize(layer, seed=0, std=0.3, residual_std=0.3)
    return layer


@pytest.mark.parametrize("kernel", ["auto", "grouped_mm", "padded", "loop"])
def test_layer_output_is_the_weighted_sum_of_each_tokens_experts(kernel):
    layer = softmax_layer(kernel).eval()
    x = torch.randn(3, 5, DIM)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference_layer(layer, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", ["grouped_mm", "padded"])
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_packed_kernels_equal_the_loop_over_experts_with_their_gradients(kernel, capacity_factor):
    x = torch.randn(4, 9, DIM)
    results = {}
    for name in ("loop", kernel):
        layer = softmax_layer(name, capacity_factor=capacity_factor).train()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results[name] = [y, xi.grad, *(p.grad for p in layer.parameters())]
    for ours, loop in zip(results[kernel], results["loop"], strict=True):
        torch.testing.assert_close(ours, loop, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
@pytest.mark.parametrize("router", ["softmax", "fixed-with-an-idle-expert"])
def test_the_fused_expert_loop_is_bitwise_gather_loop_and_combine(capacity_factor, router):
    """The loop kernel outside autocast runs gather, experts and combine fused, one expert at a
    time, with its own backward: output and every gradient bitwise those of the three steps run
    separately through autograd (dropped slots and an expert with no tokens included)."""
    if router == "softmax":
        layer = softmax_layer("loop", capacity_factor=capacity_factor).train()
    else:  # expert 3 of 6 never chosen
        indices = [[t % 3, 4 + t % 2] for t in range(12)]
        torch.manual_seed(0)
        fixed = FixedRouter(indices, 6)
        layer = MoELayer(DIM, 0, fixed, n_experts=6, top_k=2, expert_hidden=HIDDEN, kernel="loop")
        layer.capacity_factor = capacity_factor
        initialize(layer, seed=0, std=0.3, residual_std=0.3)
        layer.train()
    x = torch.randn(3, 4, DIM, generator=torch.Generator().manual_seed(1))
    probe = torch.linspace(-1, 1, x.numel()).view_as(x)

    def separately(leaf: torch.Tensor) -> torch.Tensor:
        flat = leaf.reshape(-1, DIM)
        routing = layer.router(leaf)
        plan = dispatch(routing.indices, 6, layer.capacity(flat.shape[0]))
        rows = flat.index_select(0, plan.slots // 2)
        w = layer.experts
        y = expert_swiglu(rows, plan.counts, w.w1, w.w3, w.w2, "loop")
        return combine(y, routing.weights, plan.slots, flat.shape[0], 2).view_as(leaf)

    results = {}
    for name, run in (("fused", layer), ("separately", separately)):
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        with collect_aux():
            out = run(leaf)
        if name == "fused":
            assert type(out.grad_fn).__name__ == "ViewBackward0"
            assert "RoutedLoop" in type(out.grad_fn.next_functions[0][0]).__name__
        (out * probe).sum().backward()
        results[name] = [out.detach(), leaf.grad, *(p.grad for p in layer.parameters())]
    assert len(results["fused"]) == 6  # output, input, router weight, w1, w3, w2
    for fused, separate in zip(results["fused"], results["separately"], strict=True):
        assert torch.equal(fused, separate)
    if router != "softmax":
        assert not results["fused"][3][3].any()  # the idle expert's gate weights got no gradient


def test_grouped_mm_runs_on_cpu_in_fp32_and_bf16():
    assert grouped_mm_works("cpu", torch.float32, DIM, HIDDEN)
    assert grouped_mm_works("cpu", torch.bfloat16, DIM, HIDDEN)


def test_the_kernel_auto_picks_is_announced_once_with_why(monkeypatch, capsys, tmp_path):
    from forge_lm import events

    grouped_mm_works.cache_clear()
    log = events.open_log(tmp_path, rank=0)
    try:
        assert grouped_mm_works("cpu", torch.float32, DIM, HIDDEN)
        assert grouped_mm_works("cpu", torch.float32, DIM, HIDDEN)  # cached: not announced again
        monkeypatch.delattr(torch, "_grouped_mm")
        assert not grouped_mm_works("cpu", torch.float32, DIM + 8, HIDDEN)
    finally:
        events.close_log()
        grouped_mm_works.cache_clear()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forge-moe: expert kernel")]
    assert lines == [
        f"forge-moe: expert kernel for cpu, float32, dim {DIM}, hidden {HIDDEN}: grouped_mm (torch._grouped_mm)",
        f"forge-moe: expert kernel for cpu, float32, dim {DIM + 8}, hidden {HIDDEN}: padded "
        "(this torch has no torch._grouped_mm)",
    ]
    recorded = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [(r["type"], r["kernel"]) for r in recorded] == [
        ("forge-moe/expert_kernel", "grouped_mm"),
        ("forge-moe/expert_kernel", "padded"),
    ]


@pytest.mark.parametrize("kernel", ["grouped_mm", "padded"])
def test_bf16_packed_experts_agree_with_the_fp32_loop(kernel):
    torch.manual_seed(1)
    x, counts = torch.randn(20, DIM), torch.tensor([5, 0, 9, 6])
    w1, w3, w2 = torch.randn(4, HIDDEN, DIM) / 4, torch.randn(4, HIDDEN, DIM) / 4, torch.randn(4, DIM, HIDDEN) / 4
    expected = expert_swiglu(x, counts, w1, w3, w2, "loop")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = expert_swiglu(x, counts, w1, w3, w2, kernel)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), expected, rtol=0.05, atol=0.05)


# Six tokens, two choices each, three experts; capacity_factor 0.5 gives C = ceil(0.5 * 6 * 2 / 3) = 2.
# Slot s = 2 * t + j. Per expert, first choices (j = 0) rank before second choices, then token order:
#   expert 0: t0 j0 (0), t1 j0 (2) kept | t3 j0 (6), t2 j1 (5) dropped
#   expert 1: t2 j0 (4), t5 j0 (10) kept | t0 j1 (1), t3 j1 (7), t4 j1 (9) dropped
#   expert 2: t4 j0 (8), t1 j1 (3) kept | t5 j1 (11) dropped
CHOICES = [[0, 1], [0, 2], [1, 0], [0, 1], [2, 1], [1, 2]]
DROPPED = {6, 5, 1, 7, 9, 11}


def test_capacity_is_the_ceiling_of_factor_times_tokens_times_k_over_experts():
    assert capacity(0.5, 6, 2, 3) == 2
    assert capacity(1.25, 10, 2, 4) == 7  # 6.25 -> 7
    assert capacity(1.1, 400, 1, 8) == 55  # 55.000000000000007 in floating point: not 56
    assert capacity(0.01, 3, 1, 8) == 1  # never 0


def test_dispatch_drops_exactly_the_assignments_beyond_capacity_in_priority_order():
    plan = dispatch(torch.tensor(CHOICES), 3, capacity_limit=2)
    assert plan.slots.tolist() == [0, 2, 4, 10, 8, 3]  # by expert, then choice rank, then token
    assert plan.experts.tolist() == [0, 0, 1, 1, 2, 2]
    assert plan.counts.tolist() == [2, 2, 2]
    assert plan.assigned.tolist() == [4, 5, 3]
    assert plan.dropped.item() == len(DROPPED)
    unlimited = dispatch(torch.tensor(CHOICES), 3)
    assert sorted(unlimited.slots.tolist()) == list(range(12))
    assert unlimited.dropped.item() == 0


def test_dropped_assignments_contribute_nothing_and_routing_statistics_are_reported():
    torch.manual_seed(0)
    layer = MoELayer(DIM, 3, FixedRouter(CHOICES, 3), n_experts=3, top_k=2, expert_hidden=HIDDEN, capacity_factor=0.5)
    initialize(layer, seed=0, std=0.3, residual_std=0.3)
    x = torch.randn(1, 6, DIM)
    with collect_aux() as aux:
        y = layer.train()(x)
    torch.testing.assert_close(y, reference_layer(layer, x, DROPPED), rtol=1e-5, atol=1e-6)
    assert y[0, 3].abs().max() == 0  # token 3 lost both experts: only the residual carries it
    loads = [4 * 3 / 12, 5 * 3 / 12, 3 * 3 / 12]
    cv = torch.tensor([4.0, 5.0, 3.0]).std(correction=0).item() / 4
    assert aux.metrics == pytest.approx(
        {
            "moe/layer3/load_min": min(loads),
            "moe/layer3/load_max": max(loads),
            "moe/layer3/load_cv": cv,
            "moe/layer3/drop_fraction": 0.5,
        }
    )
    with torch.no_grad():  # evaluation routes every token
        torch.testing.assert_close(layer.eval()(x), reference_layer(layer, x), rtol=1e-5, atol=1e-6)


def test_n_shared_experts_are_n_expert_sized_swiglus_summed():
    layer = softmax_layer(n_shared_experts=3).eval()
    assert (layer.shared.w1.out_features, layer.shared.w2.in_features) == (3 * HIDDEN, 3 * HIDDEN)
    x = torch.randn(7, DIM)
    separate = torch.zeros(7, DIM)
    for i in range(3):
        part = slice(i * HIDDEN, (i + 1) * HIDDEN)
        expert = SwiGLU(DIM, HIDDEN)
        with torch.no_grad():
            expert.w1.weight.copy_(layer.shared.w1.weight[part])
            expert.w3.weight.copy_(layer.shared.w3.weight[part])
            expert.w2.weight.copy_(layer.shared.w2.weight[:, part])
            separate += expert(x)
    with torch.no_grad():
        torch.testing.assert_close(layer.shared(x), separate, rtol=1e-5, atol=1e-6)


def test_active_parameters_count_the_router_top_k_experts_and_n_shared_experts(make_moe_model):
    # dim 32; expert hidden = 16 * ceil(8/3 * 0.5 * 32 / 16) = 16 * 3 = 48 (fine-grained, half width)
    ffn = {"n_experts": 8, "top_k": 2, "expert_multiplier": 0.5, "multiple_of": 16, "n_shared_experts": 2}
    model = make_moe_model(ffn, n_layers=3)
    layer = model.layers[0].feed_forward
    assert layer.experts.w1.shape == (8, 48, 32)
    router = 8 * 32
    routed = 2 * 3 * 32 * 48
    shared = 2 * 3 * 32 * 48
    assert layer.active_parameter_count() == router + routed + shared == 18688
    attention = 4 * 32 * 32
    norms = 2 * 32
    head = 61 * 32
    assert active_parameter_count(model) == 3 * (attention + norms + 18688) + 32 + head
    total = sum(p.numel() for p in layer.parameters())
    assert total == router + 8 * 3 * 32 * 48 + shared  # all experts are stored, two are active


def test_moe_layers_sit_every_n_th_block_from_the_first_and_the_rest_are_swiglu(make_moe_model):
    model = make_moe_model({"every_n_layers": 2, "first_moe_layer": 1, "hidden_multiplier": 2.0}, n_layers=5)
    kinds = [type(layer.feed_forward).__name__ for layer in model.layers]
    assert kinds == ["SwiGLU", "MoELayer", "SwiGLU", "MoELayer", "SwiGLU"]
    assert model.layers[0].feed_forward.w1.out_features == 64  # 64 * ceil(2.0 * 32 / 64)


def test_the_model_initialises_expert_down_projections_with_the_residual_std(make_moe_model):
    model = make_moe_model({"n_experts": 16}, n_layers=2)  # init_std 0.1, residual 0.1 / sqrt(4) = 0.05
    experts = model.layers[0].feed_forward.experts
    assert experts.w1.std().item() == pytest.approx(0.1, rel=0.05)
    assert experts.w2.std().item() == pytest.approx(0.05, rel=0.05)


def test_a_config_whose_first_moe_layer_is_past_the_last_block_is_rejected(moe_manager):
    config = load_config(
        None, ["--model.ffn.name=moe", "--model.n_layers=2", "--model.ffn.first_moe_layer=2"], moe_manager.registry
    )
    with pytest.raises(ConfigError, match="first_moe_layer: 2 leaves no MoE layer"):
        moe_manager.configure(config)


def test_top_k_above_the_number_of_experts_is_rejected_with_the_key(moe_manager):
    with pytest.raises(ConfigError, match=r"\[model.ffn\] top_k: must be at most n_experts \(4\)"):
        model_section(moe_manager, {"n_experts": 4, "top_k": 5})


def test_router_options_are_validated_in_their_own_table(moe_manager):
    with pytest.raises(ConfigError, match=r"\[model.ffn.router\] bias_update_rat: unknown key"):
        model_section(moe_manager, {"router": {"name": "sigmoid_topk", "bias_update_rat": 0.1}})


@parametrize_with_checks(
    components=[
        ("feed_forwards", "moe"),
        (
            "feed_forwards",
            "moe",
            {
                "options": {
                    "router": {"name": "sigmoid_topk", "sequence_balance_loss_weight": 1e-3},
                    "capacity_factor": 1.0,
                    "n_shared_experts": 1,
                    "expert_kernel": "padded",
                }
            },
        ),
    ]
)
def test_moe_layer_passes_the_feed_forward_conformance_kit(check):
    check()


def test_auto_takes_the_onednn_loop_in_fp32_on_cpu_and_the_probe_otherwise(monkeypatch):
    from forge_lm.model.linear import kernel as linear_kernel
    from forge_lm.model.linear import onednn_available
    from forge_moe.experts import resolve_kernel

    fp32, bf16 = torch.randn(4, DIM), torch.randn(4, DIM, dtype=torch.bfloat16)
    if onednn_available():
        with linear_kernel("onednn"):
            assert resolve_kernel("auto", fp32, HIDDEN) == "loop"
            assert resolve_kernel("auto", bf16, HIDDEN) == "grouped_mm"  # bf16: the probe decides
            assert resolve_kernel("padded", fp32, HIDDEN) == "padded"  # a named kernel is kept
    with linear_kernel("aten"):
        assert resolve_kernel("auto", fp32, HIDDEN) == "grouped_mm"
