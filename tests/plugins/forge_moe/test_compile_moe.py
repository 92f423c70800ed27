"""An MoE block under ``torch.compile`` (the core's per-block compile): batches that send
different numbers of tokens to each expert reuse the compiled graph, the only graph break is
the hand-over of the losses and statistics to the training loop's collector (outside the
graph), and outputs, gradients, losses and statistics are those of the eager model.

Compiled with the ``aot_eager`` backend (AOTAutograd as inductor uses it, no kernel
generation, which would take minutes here)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from forge_lm.distributed.compile import compile_block
from forge_lm.losses.aux import collect_aux
from forge_lm.model import build_model
from forge_lm.testing.counters import CountingBackend

from .conftest import VOCAB, model_section


def _model(manager, ffn, dtype):
    torch.manual_seed(0)
    section = model_section(manager, {"n_experts": 4, "top_k": 2, **ffn}, n_layers=1)
    return build_model(section, VOCAB, manager.registry).to(dtype).train()


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    with collect_aux() as aux:
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())
        (loss + aux.total()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return logits.detach(), grads, aux.logged(), model.layers[0].feed_forward.routed_load.clone()


@pytest.mark.parametrize(
    ("ffn", "dtype"),
    [
        # grouped GEMMs (torch's compiled _grouped_mm takes bf16 only), every token routed
        pytest.param({"expert_kernel": "grouped_mm"}, torch.bfloat16, id="grouped_mm-bf16"),
        # a capacity limit: how many rows each expert keeps depends on the routing
        pytest.param({"expert_kernel": "padded", "capacity_factor": 1.0}, torch.float32, id="padded-capacity"),
        # no capacity: the padded buffer is as long as the busiest expert's rows, read from data
        pytest.param({"expert_kernel": "padded"}, torch.float32, id="padded-unlimited"),
    ],
)
def test_an_moe_block_compiles_once_for_any_routing_and_matches_eager(moe_manager, ffn, dtype) -> None:
    torch._dynamo.reset()
    counters.clear()
    reference, model = _model(moe_manager, ffn, dtype), _model(moe_manager, ffn, dtype)
    backend = CountingBackend()
    compile_block(model.layers[0], backend=backend)
    loads, graphs = [], []
    tolerance = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for seed in range(4):
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
        expected_logits, expected_grads, expected_logged, expected_load = _step(reference, ids)
        logits, grads, logged, load = _step(model, ids)
        graphs.append(backend.graphs)
        loads.append(load - (loads[-1] if loads else 0))
        torch.testing.assert_close(load, expected_load, rtol=0, atol=0)
        torch.testing.assert_close(logits, expected_logits, **tolerance)
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, **tolerance, msg=name)
        assert logged == pytest.approx(expected_logged, rel=1e-6 if dtype == torch.float32 else 1e-2)
    torch._dynamo.reset()
    assert len({tuple(load.tolist()) for load in loads}) == len(loads)  # every batch routes differently
    assert graphs[-1] - graphs[0] <= 2  # recompiles after the first batch
    # The one break: the reports handed to the collector, outside the graph.
    assert counters["graph_break"], "the report call is expected to end the graph"
    assert all("_report" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])
