"""The MoE layer's forward and backward read nothing back from the device: its routing
statistics stay device tensors, summed over the step's micro-batches, until the step is logged;
and what is logged then equals the statistics computed by hand from the router's choices.

(The one sync a layer has is expert parallelism's: ``all_to_all_single`` takes its split sizes
as Python integers. The padded kernel without a capacity reads the busiest expert's count to
size its buffer; the grouped kernel, the default where it works, needs no such read.)

A host sync is counted as a call of a tensor method that returns a Python value (``item``,
``tolist``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``): on a GPU each of these
waits for the device (``torch.cuda.set_sync_debug_mode`` is GPU-only)."""

from __future__ import annotations

import collections

import pytest
import torch

from forge_lm.losses.aux import collect_aux
from forge_lm.model.init import initialize
from forge_moe.experts import capacity
from forge_moe.layer import MoELayer
from forge_moe.routers import SoftmaxTopKRouter

DIM, HIDDEN, EXPERTS, TOP_K = 16, 24, 4, 2
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch) -> collections.Counter:
    """Counts the calls of every tensor method in READS from now until the test ends."""
    counts: collections.Counter[str] = collections.Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, __name=name, __original=original, **kwargs):
            counts[__name] += 1
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def _layer(kernel: str, capacity_factor: float | None) -> MoELayer:
    torch.manual_seed(0)
    router = SoftmaxTopKRouter(DIM, EXPERTS, TOP_K, z_loss_weight=1e-3)
    layer = MoELayer(
        DIM,
        0,
        router,
        n_experts=EXPERTS,
        top_k=TOP_K,
        expert_hidden=HIDDEN,
        capacity_factor=capacity_factor,
        kernel=kernel,
    )
    initialize(layer, seed=0, std=0.3, residual_std=0.3)
    return layer.train()


def _reference(choices: list[list[list[int]]], capacity_factor: float | None) -> dict[str, float]:
    """The statistics of one step's micro-batches, from the router's choices, in plain Python."""
    assigned, dropped, slots = [0] * EXPERTS, 0, 0
    for micro_batch in choices:
        per_expert = [sum(row.count(e) for row in micro_batch) for e in range(EXPERTS)]
        if capacity_factor is not None:
            limit = capacity(capacity_factor, len(micro_batch), TOP_K, EXPERTS)
            dropped += sum(max(0, count - limit) for count in per_expert)
        assigned = [a + c for a, c in zip(assigned, per_expert, strict=True)]
        slots += len(micro_batch) * TOP_K
    mean = sum(assigned) / EXPERTS
    std = (sum((a - mean) ** 2 for a in assigned) / EXPERTS) ** 0.5
    return {
        "moe/layer0/load_min": min(assigned) * EXPERTS / slots,
        "moe/layer0/load_max": max(assigned) * EXPERTS / slots,
        "moe/layer0/load_cv": std / mean,
        "moe/layer0/drop_fraction": dropped / slots,
    }


@pytest.mark.parametrize(("kernel", "capacity_factor"), [("grouped_mm", None), ("grouped_mm", 1.0), ("padded", 1.0)])
def test_forward_and_backward_read_nothing_and_the_logged_statistics_are_exact(
    host_reads, kernel, capacity_factor
) -> None:
    layer = _layer(kernel, capacity_factor)
    batches = [torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    choices = [layer.router(x).indices.tolist() for x in batches]
    layer(batches[0]).sum().backward()  # warm-up: the kernel probe's own reads happen once per process
    layer.after_optimizer_step()  # a new step: the warm-up's counts are cleared
    host_reads.clear()
    for x in batches:  # two micro-batches of one step, each in its own collector, as in the loop
        with collect_aux() as aux:
            out = layer(x)
            (out.sum() + aux.total()).backward()
    assert dict(host_reads) == {}
    logged = aux.logged()  # the step's one read, when it is logged
    assert host_reads["tolist"] == 1
    statistics = {name: value for name, value in logged.items() if "loss" not in name}
    assert statistics == pytest.approx(_reference(choices, capacity_factor), rel=1e-6)
    assert set(logged) - set(statistics) == {"moe/layer0/balance_loss", "moe/layer0/z_loss"}


def test_a_new_step_starts_the_statistics_again(host_reads) -> None:
    layer = _layer("grouped_mm", 1.0)
    first, second = (torch.randn(1, 6, DIM, generator=torch.Generator().manual_seed(seed)) for seed in (3, 4))
    layer(first)
    layer.after_optimizer_step()
    with collect_aux() as aux:
        layer(second)
    statistics = {name: value for name, value in aux.logged().items() if "loss" not in name}
    assert statistics == pytest.approx(_reference([layer.router(second).indices.tolist()], 1.0), rel=1e-6)
    layer.step_skipped()  # an abandoned step's counts go too
    assert int(layer.routed_slots) == 0
    assert int(layer.routed_load.sum()) == 0
