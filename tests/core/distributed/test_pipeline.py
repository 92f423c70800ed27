"""Pipeline parallelism: the stage split and its rules in one process, and GPipe / 1F1B
against a single-process reference under torchrun (2 ranks, gloo, CPU)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from forge_lm.config import ModelSection
from forge_lm.distributed.mesh import ParallelDims
from forge_lm.distributed.pipeline import PipelineRunner, check_pipeline, keep_stage, stage_layers
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.model import build_model
from forge_lm.testing.distributed import torchrun

WORKER = Path(__file__).parent / "workers" / "pipeline_worker.py"
VOCAB = 61
CPU = torch.device("cpu")


def tiny_model(manager, **overrides: object) -> torch.nn.Module:
    fields = {"dim": 32, "n_layers": 4, "n_heads": 4, "max_seq_len": 32, "init_std": 0.1, "tie_embeddings": False}
    fields.update(overrides)
    torch.manual_seed(0)
    return build_model(ModelSection(**fields), VOCAB, manager.registry)


# --- the split -----------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers", range(1, 10))
def test_stage_layers_are_contiguous_and_even(n_layers: int) -> None:
    for stages in range(1, n_layers + 1):
        runs = [stage_layers(n_layers, stages, stage) for stage in range(stages)]
        assert [i for run in runs for i in run] == list(range(n_layers))
        sizes = [len(run) for run in runs]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # extra blocks go to the first stages, not the head's


def test_stage_layers_of_five_over_two() -> None:
    assert stage_layers(5, 2, 0) == range(0, 3)
    assert stage_layers(5, 2, 1) == range(3, 5)


def test_stage_layers_rejects_more_stages_than_layers() -> None:
    with pytest.raises(ForgeError):
        stage_layers(2, 3, 0)


@pytest.mark.parametrize("documents", [False, True])
def test_stages_chained_are_the_full_model(manager, documents: bool) -> None:
    """Three stages of a 5-layer model, run one after the other, give the full model's logits,
    and hold its parameters under the same names, each exactly once."""
    full = tiny_model(manager, n_layers=5).eval()
    stages = [keep_stage(copy.deepcopy(full), stage, 3).eval() for stage in range(3)]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
    doc_ids = torch.cumsum(torch.rand(2, 12, generator=generator) < 0.3, dim=1) if documents else None
    with torch.no_grad():
        h = stages[0](ids, doc_ids)
        assert h.shape == (2, 12, 32)
        h = stages[1](h, doc_ids)
        logits = stages[2](h, doc_ids)
        torch.testing.assert_close(logits, full(ids, doc_ids), rtol=0, atol=0)

    full_params = dict(full.named_parameters())
    held = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(held) == sorted(full_params)
    for stage in stages:
        for name, param in stage.named_parameters():
            assert torch.equal(param, full_params[name]), name
    assert [list(stage.layers) for stage in stages] == [["0", "1"], ["2", "3"], ["4"]]
    assert "tok_embeddings.weight" in dict(stages[0].named_parameters())
    assert "output.weight" in dict(stages[2].named_parameters())
    assert "layers.2.attention.wq.weight" in stages[1].state_dict()


def test_a_later_stage_wants_a_hidden_state(manager) -> None:
    stage = keep_stage(tiny_model(manager), 1, 2)
    with pytest.raises(ForgeError, match="hidden state"):
        stage(torch.zeros(2, 8, dtype=torch.long))


def test_an_unsplit_model_is_unchanged(manager) -> None:
    model = tiny_model(manager)
    assert not model.tied
    assert tiny_model(manager, tie_embeddings=True).tied
    with pytest.raises(ForgeError, match=r"\[batch, seq\]"):
        model(torch.zeros(2, 8, 32))


# --- the rules -----------------------------------------------------------------------------


def test_tied_embeddings_are_rejected(manager) -> None:
    model = tiny_model(manager, tie_embeddings=True)
    with pytest.raises(ConfigError, match=r"set \[model\] tie_embeddings = false for pipeline parallelism"):
        PipelineRunner(model, ParallelDims(pp=2, pp_schedule="gpipe"), None, CPU, None, 2)
    assert len(model.layers) == 4  # rejected before anything was split
    assert model.output is not None


def test_a_model_that_is_not_a_forge_transformer_is_rejected_with_the_fix() -> None:
    with pytest.raises(ForgeError, match=r"Sequential declares no keep_stage\(stage, stages\) and blocks\(\).*pp = 1"):
        check_pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)), ParallelDims(pp=2, pp_schedule="gpipe"), 2)


def test_more_stages_than_layers_are_rejected(manager) -> None:
    with pytest.raises(ConfigError, match="pp = 3 stages need at least as many layers; the model has 2"):
        check_pipeline(tiny_model(manager, n_layers=2), ParallelDims(pp=3, pp_schedule="gpipe"), 4)


def test_1f1b_needs_as_many_microbatches_as_stages(manager) -> None:
    model = tiny_model(manager)
    with pytest.raises(ConfigError, match=r"1f1b schedule needs at least pp = 2 microbatches.*gpipe"):
        check_pipeline(model, ParallelDims(pp=2, pp_schedule="1f1b"), 1)
    check_pipeline(model, ParallelDims(pp=2, pp_schedule="gpipe"), 1)  # gpipe does not


def test_the_problems_are_named_together(manager) -> None:
    model = tiny_model(manager, n_layers=2, tie_embeddings=True)
    with pytest.raises(ConfigError) as raised:
        check_pipeline(model, ParallelDims(pp=3, pp_schedule="1f1b"), 2)
    message = str(raised.value)
    assert "tie_embeddings" in message
    assert "the model has 2" in message
    assert "1f1b" in message


def test_a_pipeline_needs_stages(manager) -> None:
    with pytest.raises(ForgeError, match="pp > 1"):
        PipelineRunner(tiny_model(manager), ParallelDims(), None, CPU, None, 1)


def test_only_a_model_that_declares_its_stages_is_split() -> None:
    with pytest.raises(ForgeError, match="cuts a model into stages of blocks"):
        check_pipeline(torch.nn.Linear(2, 2), ParallelDims(pp=2, pp_schedule="gpipe"), 2)


# --- against one process, under torchrun -----------------------------------------------------


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One launch runs every case (see the worker's docstring)."""
    out = tmp_path_factory.mktemp("pipeline") / "result.json"
    result = torchrun([str(WORKER), str(out)], nproc=2, timeout=300)
    assert out.exists(), f"the worker wrote no result (rc {result.returncode}):\n{result.stderr[-4000:]}"
    summary = json.loads(out.read_text())
    summary["returncode"], summary["stderr"] = result.returncode, result.stderr
    return summary


CASES = [
    "gpipe-accum2",
    "gpipe-accum2-documents",
    "1f1b-accum2-documents",
    "1f1b-accum4-5layers-checkpointed",
    "gpipe-accum2-documents-bf16",
    "1f1b-accum2-z-loss",  # the logged loss leaves the z-loss out, the gradients keep it
]


def test_the_worker_succeeded(pipelined: dict) -> None:
    problems = {name: [r["problems"] for r in ranks] for name, ranks in pipelined["cases"].items()}
    assert pipelined["returncode"] == 0, (problems, pipelined["stderr"][-4000:])
    assert pipelined["ok"], problems
    assert sorted(pipelined["cases"]) == sorted([*CASES, "aux"])


@pytest.mark.parametrize("case", CASES)
def test_loss_gradients_and_eval_match_one_process(pipelined: dict, case: str) -> None:
    first, last = pipelined["cases"][case]
    assert (first["rank"], last["rank"]) == (0, 1)
    assert (first["problems"], last["problems"]) == ([], [])
    assert len(first["steps"]) == len(last["steps"]) == 2
    for step_first, step_last in zip(first["steps"], last["steps"], strict=True):
        assert step_first["loss"] == 0.0  # only the last stage has the loss
        assert step_last["loss"] == pytest.approx(step_last["reference_loss"], rel=1e-6)
        for step in (step_first, step_last):
            assert step["grad_max_diff"] <= 1e-6
            assert step["grad_norm"] == pytest.approx(step["reference_grad_norm"], rel=1e-6)  # summed over stages
    assert first["steps"][0]["eval_loss"] == 0.0
    assert last["steps"][0]["eval_loss"] == pytest.approx(last["steps"][0]["reference_eval_loss"], rel=1e-6)
    assert last["steps"][0]["loss"] != last["steps"][1]["loss"]  # two steps, two different batches


@pytest.mark.parametrize("case", CASES)
def test_each_stage_holds_its_part_under_full_names(pipelined: dict, case: str) -> None:
    first, last = pipelined["cases"][case]
    assert sorted(first["names"] + last["names"]) == sorted(first["full_model_names"])
    assert "tok_embeddings.weight" in first["names"]
    assert not {"output.weight", "norm.weight"} & set(first["names"])
    assert {"output.weight", "norm.weight"} <= set(last["names"])
    assert "tok_embeddings.weight" not in last["names"]
    split = 3 if "5layers" in case else 2
    assert {name.split(".")[1] for name in first["names"] if name.startswith("layers.")} == {
        str(i) for i in range(split)
    }
    if "checkpointed" in case:
        assert first["transforms"] == last["transforms"] == ["activation_checkpointing"]


def test_auxiliary_losses_are_refused(pipelined: dict) -> None:
    for rank in pipelined["cases"]["aux"]:
        assert not rank["problems"], rank["problems"]
        assert "auxiliary losses (balance)" in rank["error"]
        assert "pipeline parallelism does not support" in rank["error"]
