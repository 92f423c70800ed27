"""MoE blocks under activation checkpointing: selective checkpointing keeps the experts' grouped
GEMMs (backward recomputes none of them, nor any other matmul), full checkpointing recomputes
them, gradients are bitwise those without checkpointing, and the replay in backward counts
no batch twice (routing statistics, the sigmoid router's pending load, the reported losses).
With expert parallelism (2 gloo ranks), selective checkpointing exchanges no tokens again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims, TransformContext
from forge_lm.distributed.activation_checkpointing import checkpointed, saved_ops
from forge_lm.errors import ConfigError
from forge_lm.losses.aux import collect_aux
from forge_lm.model import build_model
from forge_lm.model.linear import kernel as linear_kernel
from forge_lm.testing.counters import OpCounter
from forge_lm.testing.distributed import torchrun
from forge_moe.expert_parallel import expert_parallel_transform
from forge_moe.experts import grouped_mm_works

from .conftest import VOCAB, model_section

WORKER = Path(__file__).parent / "workers" / "checkpointed_exchange_worker.py"
FFN = {
    "n_experts": 4,
    "top_k": 2,
    "expert_kernel": "auto",  # grouped_mm, chosen by the probe, with torch's own linear kernel (below)
    "capacity_factor": 1.0,
    "router": {"name": "sigmoid_topk"},
}


def _run(manager, mode: str):
    torch.manual_seed(0)
    model = build_model(model_section(manager, FFN, n_layers=2), VOCAB, manager.registry).train()
    if mode != "none":
        for block in model.layers:
            block.forward = checkpointed(block.forward, mode)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    # The kernel probe runs on the first forward, inside the checkpointed region: it must not
    # hand its own products to selective checkpointing's cache.
    grouped_mm_works.cache_clear()
    with collect_aux() as aux, OpCounter() as forward:
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    with collect_aux(), OpCounter() as backward:  # a collector, as in the loop: a replay would report here
        loss.backward()
    layers = [block.feed_forward for block in model.layers]
    return {
        "forward": forward.counts,
        "backward": backward.counts,
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "logged": aux.logged(),
        "pending": [layer.router.pending_load.clone() for layer in layers],
        "routed": [layer.routed_load.clone() for layer in layers],
    }


@pytest.fixture(scope="module")
def runs(moe_manager):
    # With oneDNN linear products, auto would pick the per-expert loop on this CPU; with torch's
    # own it probes and picks grouped_mm, whose probe must stay out of the checkpoint's cache.
    with linear_kernel("aten"):
        return {mode: _run(moe_manager, mode) for mode in ("none", "full", "selective")}


def test_selective_recomputes_no_grouped_gemm_or_matmul_and_full_does(runs) -> None:
    saved = saved_ops()
    grouped = torch.ops.aten._grouped_mm.default
    plain = runs["none"]
    assert plain["forward"][grouped] == 2 * 3  # two MoE layers, three projections each
    for op in saved:
        assert runs["selective"]["backward"][op] == plain["backward"][op], op
    ran = [op for op in saved if plain["forward"][op]]
    assert grouped in ran
    for op in ran:
        assert runs["full"]["backward"][op] > plain["backward"][op], op


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_are_bitwise_those_without_checkpointing(runs, mode) -> None:
    for name, grad in runs["none"]["grads"].items():
        torch.testing.assert_close(runs[mode]["grads"][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_replay_in_backward_counts_nothing_twice(runs, mode) -> None:
    plain = runs["none"]
    assert runs[mode]["logged"] == plain["logged"]
    for counts, expected in zip(
        runs[mode]["pending"] + runs[mode]["routed"], plain["pending"] + plain["routed"], strict=True
    ):
        torch.testing.assert_close(counts, expected, rtol=0, atol=0)
    # Each layer counted its 32 tokens' 2 choices once.
    assert [int(load.sum()) for load in runs[mode]["routed"]] == [64, 64]


@pytest.fixture(scope="module")
def exchange_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("exchange") / "result.json"
    done = torchrun([str(WORKER), str(out)], nproc=2, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(out.read_text())


def test_with_expert_parallelism_selective_reissues_no_exchange(exchange_run) -> None:
    """2 gloo ranks, ``ep = 2``: backward under selective checkpointing runs exactly the
    all-to-alls of backward without checkpointing (the exchanges' own backward), full
    checkpointing runs the forward exchanges again; the gradients are bitwise the same."""
    exchange = "_c10d_functional.all_to_all_single.default"
    plain = exchange_run["none"]["collectives"]
    assert plain[exchange] == 2 * 2  # two MoE layers, the backward of their two row exchanges
    assert exchange_run["selective"]["collectives"] == plain
    # Full: each layer's count exchange and two row exchanges, again.
    assert exchange_run["full"]["collectives"][exchange] == plain[exchange] + 2 * 3
    for mode in ("full", "selective"):
        assert exchange_run[mode]["grads"] == exchange_run["none"]["grads"], mode


def test_expert_parallelism_refuses_selective_checkpointing(moe_manager) -> None:
    config = load_config(
        None,
        ["--model.ffn.name=moe", "--distributed.ep=2", "--train.activation_checkpointing=selective"],
        moe_manager.registry,
    )
    context = TransformContext(config, ParallelDims(dp_shard=2, ep=2), None, torch.device("cpu"), None)
    with pytest.raises(ConfigError) as caught:
        expert_parallel_transform(None).apply(torch.nn.Module(), context)
    assert "activation_checkpointing = 'selective' with [distributed] ep > 1" in str(caught.value)
    assert "Use activation_checkpointing = 'full'" in str(caught.value)
