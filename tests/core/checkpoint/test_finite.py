"""Weights that are not finite are never checkpointed, and a checkpoint holding such weights
(written before saves checked them) is never loaded: the test is one fused reduction per
device and dtype, and all ranks decide alike."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import forge_lm.checkpoint._write as checkpoint_io
from forge_lm.checkpoint import CheckpointManager, NonFiniteWeights
from forge_lm.checkpoint._finite import count_nonfinite, first_nonfinite
from forge_lm.testing.distributed import torchrun

WORKER = Path(__file__).parent / "workers" / "finite_worker.py"


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_the_count_matches_a_tensor_by_tensor_check(dtype, bad):
    """Against ``torch.isfinite(t).all()`` per tensor; large finite values (whose squares would
    overflow a norm) count as finite."""
    state = {
        "a": torch.full((3, 5), 3e38 if dtype != torch.bfloat16 else 1e38, dtype=dtype),
        "b": torch.randn(7, dtype=dtype),
        "c": torch.randn(4, dtype=torch.float32),
        "ids": torch.arange(5),  # not floating: not counted
        "empty": torch.empty(0, dtype=dtype),
    }
    if bad is not None:
        state["b"][3] = bad
    expected = sum(not bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())
    assert count_nonfinite(state, torch.device("cpu")).item() == expected == (0 if bad is None else 1)
    assert first_nonfinite(state) == (None if bad is None else "b")


def test_a_save_of_nan_weights_writes_nothing_and_names_the_tensor(tmp_path):
    model, optimizer = model_and_optimizer()
    checkpoints = CheckpointManager(tmp_path, keep_last_n=1)
    checkpoints.save(1, model, optimizer, {})
    with torch.no_grad():
        model[1].bias[2] = math.nan
    with pytest.raises(NonFiniteWeights, match=r"not writing checkpoint step_2: the weights are not finite: '1\.bias'"):
        checkpoints.save(2, model, optimizer, {})
    assert sorted(p.name for p in checkpoints.root.iterdir()) == ["latest", "step_1"]
    assert checkpoints.latest().name == "step_1"


def test_a_checkpoint_of_nan_weights_is_passed_over_and_the_older_one_loaded(tmp_path, monkeypatch):
    model, optimizer = model_and_optimizer()
    checkpoints = CheckpointManager(tmp_path)
    checkpoints.save(1, model, optimizer, {})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model[0].weight[0, 0] = math.inf
    with monkeypatch.context() as patch:  # as a Forge that did not check wrote it
        patch.setattr(checkpoint_io, "count_nonfinite", lambda state, device: torch.zeros((), dtype=torch.float64))
        checkpoints.save(2, model, optimizer, {})
    fresh, fresh_optimizer = model_and_optimizer()
    state = CheckpointManager(tmp_path).load(fresh, fresh_optimizer)
    assert state["step"] == 1
    assert state["passed_over"] == ["step_2: its weights are not finite: '0.weight' holds NaN or Inf"]
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key])


def test_pruning_keeps_another_runs_checkpoints(tmp_path):
    """keep_last_n counts and removes this run's checkpoints only."""
    (tmp_path / "run_id").write_text("a" * 32 + "\n")
    model, optimizer = model_and_optimizer()
    CheckpointManager(tmp_path).save(1, model, optimizer, {})
    (tmp_path / "run_id").write_text("b" * 32 + "\n")
    checkpoints = CheckpointManager(tmp_path, keep_last_n=1)
    checkpoints.save(2, model, optimizer, {})
    checkpoints.save(3, model, optimizer, {})
    assert sorted(p.name for p in checkpoints.root.glob("step_*")) == ["step_1", "step_3"]
    assert json.loads((checkpoints.root / "step_1" / "trainer_state.json").read_text())["run_id"] == "a" * 32


def test_two_ranks_agree_on_a_nan_in_one_ranks_shard(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    out.mkdir()
    result = torchrun([str(WORKER), str(run_dir), str(out)], nproc=2, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["refused"] == (
        "not writing checkpoint step_2: the weights are not finite: another rank's weights hold NaN or Inf"
    )
    assert (
        ranks[1]["refused"] == "not writing checkpoint step_2: the weights are not finite: '0.weight' holds NaN or Inf"
    )
    for got in ranks:
        assert not got["written_after_refusal"]
        assert got["loaded_step"] == 1
        assert len(got["passed_over"]) == 1
        assert got["passed_over"][0].startswith("step_2: its weights are not finite")
