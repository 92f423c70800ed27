"""Tensor + sequence parallelism: the same numbers as one process, and clear refusals.

The multi-process cases run ``workers/tensor_parallel_worker.py`` under torchrun (gloo, CPU):
it compares the loss, the logits and every parameter's gradient of the tensor-parallel model
with those of the same model in one process, over four training steps (causal, then packed
documents; with the full logits, then with the training loop's loss parallelism), and writes
the differences to a JSON file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims, TransformContext
from forge_lm.distributed.tensor_parallel import tensor_parallel_transform
from forge_lm.errors import ConfigError
from forge_lm.model import build_model

WORKER = Path(__file__).parent / "workers" / "tensor_parallel_worker.py"
# dim 64, 4 query heads over 2 key/value heads (GQA: each rank holds 2 query heads and 1 kv head)
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--train.seq_len=16"]


# The worker's cases: (its arguments after TINY, ranks). One launch per number of ranks runs every
# case of that number in turn, each with its own config, mesh and models.
CASES = {
    # vocab 301 is odd: the embedding and head are split 151 + 150 rows, and it still matches.
    "tied-uneven-vocab": (["--vocab=301", "--distributed.tp=2"], 2),
    # Two stages run one after the other in each process (no pipeline schedule): the hidden
    # state between them is [B, T, dim], as the stages' forward expects; untied head (pipeline
    # stages cannot tie), so output.weight is a parameter of its own.
    "stages": (["--vocab=300", "--distributed.tp=2", "--stages", "--model.tie_embeddings=false"], 2),
    # 4 ranks: dp_shard = 2 x tp = 2, each data-parallel pair reads half of the batch; FSDP2
    # shards the tied embedding/head DTensor again over dp_shard.
    "fsdp2-checkpointed": (["--vocab=301", "--distributed.tp=2", "--train.activation_checkpointing=selective"], 4),
}


@pytest.fixture(scope="module")
def reports(launches_by_rank_count):
    """``reports(case)``: the worker's report of ``case``; one launch per number of ranks, run for
    every case of that number when the first is asked for."""
    cases = {name: ([*TINY, *args], ranks) for name, (args, ranks) in CASES.items()}
    launch = launches_by_rank_count(WORKER, cases, timeout=300)
    return lambda case: launch(case)[0]


def check_matches_one_process(report: dict) -> None:
    assert report["failures"] == []
    assert not report["any_rank_failed"]
    assert report["same_names"]  # checkpoints address parameters by the same names
    assert report["all_dtensor"]
    assert [(step["documents"], step["in_loop"]) for step in report["steps"]] == [
        (False, False),
        (True, False),
        (False, True),
        (True, True),
    ]
    for step in report["steps"]:
        assert step["loss_excess"] == step["logits_excess"] == step["norm_excess"] == 0.0
        assert step["loss"][0] == pytest.approx(step["loss"][1], abs=1e-5)
        assert step["loss_type"] == "Tensor"
        if step["in_loop"]:
            check_loss_parallel(step, report["vocab"])
        else:
            assert step["logits_type"] == "Tensor"  # full logits, a plain tensor: evaluation need not know
        assert step["logits_max_abs"] < 1e-5
        # Gradients are O(1e-2): the worker's tolerance is 1e-5 + 1e-4 relative; they agree far closer.
        assert step["grad_max"] > 1e-3
        assert step["grad_max_abs"] < 1e-6
        assert set(step["grad_excess"].values()) == {0.0}
        assert step["missing_grads"] == []
    assert "tp = 2" in report["short_sequence_error"]


def check_loss_parallel(step: dict, vocab: int) -> None:
    """The training loop's loss under tp = 2: the logits reach it split over the vocabulary, a
    DTensor sharded on its last dimension holding this rank's half, never the full logits."""
    assert step["logits_type"] == "DTensor"
    [seen] = step["loss_inputs"]  # one call of the loss
    assert seen["type"] == "DTensor"
    assert seen["placements"] == "(Shard(dim=2),)"
    assert seen["shape"][-1] == vocab
    assert seen["local_shape"][:2] == seen["shape"][:2]
    assert seen["local_shape"][-1] == (vocab + 1) // 2 or seen["local_shape"][-1] == vocab // 2


def test_tp2_matches_one_process_with_tied_embeddings_and_uneven_vocab(reports) -> None:
    report = reports("tied-uneven-vocab")
    assert report["applied"] == ["tensor_parallel"]
    assert report["dims"].endswith("dp_shard=1 tp=2 pp=1 ep=1")
    check_matches_one_process(report)
    assert report["tied_before"]
    assert report["tied_after"]  # one Shard(0) DTensor serves embedding and head
    placements = report["placements"]
    assert placements["tok_embeddings.weight"] == "(Shard(dim=0),)"
    assert placements["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
    assert placements["layers.0.attention.wo.weight"] == "(Shard(dim=1),)"
    assert placements["layers.1.feed_forward.w2.weight"] == "(Shard(dim=1),)"
    assert placements["layers.0.attention_norm.weight"] == "(Replicate(),)"
    assert placements["norm.weight"] == "(Replicate(),)"


def test_tp2_pipeline_stages_pass_the_full_hidden_state_and_match_one_process(reports) -> None:
    report = reports("stages")
    assert report["stages"] == 2
    assert report["applied"] == ["tensor_parallel"]
    check_matches_one_process(report)
    assert not report["tied_before"]
    assert report["placements"]["output.weight"] == "(Shard(dim=0),)"


def test_tp2_with_fsdp2_and_activation_checkpointing_matches_one_process(reports) -> None:
    report = reports("fsdp2-checkpointed")
    assert report["applied"] == ["tensor_parallel", "activation_checkpointing", "fsdp2"]
    assert report["dims"].endswith("dp_shard=2 tp=2 pp=1 ep=1")
    check_matches_one_process(report)
    assert report["tied_after"]
    # On the (dp_shard, tp) mesh: split by vocabulary over tp, those rows split again over dp_shard.
    assert report["placements"]["tok_embeddings.weight"].endswith(", Shard(dim=0))")
    assert report["placements"]["layers.0.attention.wo.weight"] == "(Shard(dim=0), Shard(dim=1))"


# -- refusals, in one process: they come before the transform touches the mesh ----------------


class PlainMLP(nn.Module):
    """A feed-forward layer without tensor_parallel_plan()."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class PlainMLPPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def forge_lm_register_feed_forwards(self, register):
        register("plain_mlp", lambda options, dim, index: PlainMLP(dim), description="MLP without a TP plan")


def apply_tp2(overrides: list[str], manager) -> nn.Module:
    """Build the model of ``overrides`` and apply the tensor-parallel transform for tp = 2 in this
    process (no mesh: a refusal must come before it is needed); returns the model."""
    config = load_config(None, [*TINY, "--distributed.tp=2", *overrides], manager.registry)
    dims = ParallelDims(tp=2)
    dims.check(config)
    model = build_model(config.model, 300, manager.registry)
    transform = tensor_parallel_transform(None)
    context = TransformContext(config, dims, None, torch.device("cpu"), None)
    assert transform.enabled(context)
    try:
        transform.apply(model, context)
    finally:
        assert not any(isinstance(p, DTensor) for p in model.parameters())  # left untouched
    return model


def test_a_feed_forward_without_a_plan_is_refused_naming_it(manager) -> None:
    manager.add_plugin(PlainMLPPlugin(), "plain-mlp")
    with pytest.raises(ConfigError, match=r"PlainMLP \(\[model\.ffn\] 'plain_mlp'\).*tensor_parallel_plan") as info:
        apply_tp2(["--model.ffn.name=plain_mlp"], manager)
    assert "set [distributed] tp = 1" in str(info.value)


def test_a_swiglu_hidden_size_that_tp_does_not_divide_is_refused(manager) -> None:
    # hidden = ceil(2.7 * 64) = 173 units: w2 could not rebuild its input from unequal halves.
    with pytest.raises(ConfigError, match=r"tp = 2 must divide.*SwiGLU.*w1 has 173 output features.*multiple_of"):
        apply_tp2(["--model.ffn.hidden_multiplier=2.7", "--model.ffn.multiple_of=1"], manager)


def test_swiglu_declares_its_plan() -> None:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from forge_lm.model.swiglu import SwiGLU

    plan = SwiGLU(8, 16).tensor_parallel_plan()
    assert set(plan) == {"w1", "w2", "w3"}
    assert isinstance(plan["w1"], ColwiseParallel)
    assert isinstance(plan["w3"], ColwiseParallel)
    assert isinstance(plan["w2"], RowwiseParallel)
    assert plan["w2"].output_layouts == (Shard(1),)  # back to the sequence-split residual stream
