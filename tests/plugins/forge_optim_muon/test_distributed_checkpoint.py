"""Muon's optimizer state through Forge's DCP checkpoints on gloo ranks, under FSDP2, HSDP,
tensor parallelism (2 ranks each) and FSDP2 with tensor parallelism (4 ranks), and each of
those runs against the one-process run.

For each layout, ``forge train`` runs under ``torchrun`` for 4 steps, checkpointing at steps 2
and 4. A copy of its directory as it stood at step 2 (the checkpoint a run of 2 steps leaves)
is resumed to step 4 on the same ranks: the two step-4 checkpoints (weights, momentum buffers,
the fallback's moments and steps) are equal bit for bit. Another copy resumes in one process
(DCP reshards the state) and continues like the distributed run; every distributed run follows
the one-process run of the same global batch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from forge_lm.checkpoint import CheckpointManager
from forge_lm.config import load_config
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager
from forge_lm.testing import TINY_MODEL
from forge_lm.testing.distributed import metrics_by_step, torchrun
from forge_lm.train import TrainResult, train

# A constant learning rate, so that a run stopped at step 2 and resumed follows the schedule of
# one that never stopped; the model is big enough that every matrix is sharded on each layout.
TINY = [
    *TINY_MODEL,
    "--model.tie_embeddings=false",
    "--train.seq_len=16",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--eval.interval=0",
    "--data.name=synthetic",
    "--scheduler.name=constant",
    "--checkpoint.interval=2",
    "--metrics.peak_flops=1e12",  # no calibration matmuls at start
    "--resilience.health_check=false",
    "--optimizer.name=muon",
    "--optimizer.lr=0.05",
    "--optimizer.weight_decay=0.1",
    "--optimizer.ns_dtype=float32",
]
GLOBAL_BATCH = 4
# Each layout's arguments, per-rank batch and ranks: data-parallel ranks split the global batch
# of 4, tensor-parallel ranks read their data-parallel rank's share whole.
LAYOUTS = {
    "fsdp2": (["--distributed.dp_shard=2"], 2, 2),
    "hsdp": (["--distributed.dp_replicate=2", "--distributed.dp_shard=1"], 2, 2),
    "tp": (["--distributed.tp=2"], 4, 2),
    # Parameters sharded over dp_shard and split over tp: DTensors on a 2-D mesh.
    "fsdp2-tp": (["--distributed.dp_shard=2", "--distributed.tp=2"], 2, 4),
}


def _distributed(run_dir: Path, steps: int, layout: str) -> str:
    extra, batch, ranks = LAYOUTS[layout]
    args = [*TINY, *extra, f"--train.batch_size={batch}", f"--train.max_steps={steps}", f"--train.output_dir={run_dir}"]
    result = torchrun(["-m", "forge_lm", "train", "--plugins", "muon", *args], nproc=ranks)
    _ok(result)
    return result.stderr


def _as_at_step(run_dir: Path, copy: Path, step: int) -> Path:
    """A copy of ``run_dir`` as it stood after ``step``: later checkpoints and metrics removed."""
    shutil.copytree(run_dir, copy)
    for later in (copy / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (copy / "checkpoints" / "latest").write_text(f"step_{step}\n")
    metrics = copy / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line).get("step", 0) <= step]
    metrics.write_text("".join(line + "\n" for line in kept))
    return copy


def _one_process(run_dir: Path, steps: int, config_file: Path | None = None) -> TrainResult:
    manager = PluginManager()
    overrides = [f"--train.batch_size={GLOBAL_BATCH}", f"--train.max_steps={steps}", f"--train.output_dir={run_dir}"]
    if config_file is None:
        config = load_config(None, [*TINY, *overrides], manager.registry)
    else:  # a distributed run's own config, on one process: its layout back to 1 rank
        one_rank = ["--distributed.dp_shard=-1", "--distributed.dp_replicate=1", "--distributed.tp=1"]
        config = load_config(config_file, [*one_rank, *overrides], manager.registry)
    return train(config, manager)


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _checkpoint(run_dir: Path, step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and Muon optimizer of ``run_dir``'s step-``step`` checkpoint, in this one process."""
    manager = PluginManager()
    config = load_config(run_dir / "config.toml", [], manager.registry)
    vocab_size = config.model.options.vocab_size or config.tokenizer.build().vocab_size
    model = build_model(config.model, vocab_size, manager.registry)
    optimizer = config.optimizer.build(model)
    state = CheckpointManager(run_dir).load(model, optimizer, only=run_dir / "checkpoints" / f"step_{step}")
    assert state is not None, f"{run_dir} has no step-{step} checkpoint"
    assert state["step"] == step
    return model, optimizer


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four steps in one process on the global batch: what every layout must follow."""
    run_dir = tmp_path_factory.mktemp("one_process") / "run"
    _one_process(run_dir, 4)
    return run_dir


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per layout: 4 steps straight; its step 2 resumed to 4 on the same ranks, and on 1."""
    layout, root = request.param, tmp_path_factory.mktemp(request.param)
    straight = root / "straight"
    _distributed(straight, 4, layout)
    resumed = _as_at_step(straight, root / "resumed", 2)
    assert "resumed from" in _distributed(resumed, 4, layout)
    one_rank = _as_at_step(straight, root / "one_rank", 2)
    assert _one_process(one_rank, 4, one_rank / "config.toml").resumed_at == 2
    return {"straight": straight, "resumed": resumed, "one_rank": one_rank}


def test_distributed_resume_ends_bit_for_bit_where_the_uninterrupted_run_does(runs):
    model, optimizer = _checkpoint(runs["straight"], 4)
    resumed_model, resumed_optimizer = _checkpoint(runs["resumed"], 4)
    initial, _ = _checkpoint(runs["resumed"], 2)
    for (name, expected), actual in zip(model.state_dict().items(), resumed_model.state_dict().values(), strict=True):
        assert not torch.equal(expected, initial.state_dict()[name]), f"{name} did not move after the resume"
        assert torch.equal(actual, expected), f"{name} differs after resuming"
    states, resumed_states = optimizer.state_dict()["state"], resumed_optimizer.state_dict()["state"]
    kinds = set()
    for index, state in states.items():
        kinds.add(frozenset(state))
        assert set(resumed_states[index]) == set(state)
        for key, value in state.items():
            assert torch.equal(resumed_states[index][key], value), f"parameter {index}: {key} differs"
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}
    assert any(a.side == "muon" for a in optimizer.assignments)


def test_distributed_run_follows_the_one_process_run(runs, reference):
    expected, actual = metrics_by_step(reference), metrics_by_step(runs["straight"])
    for step in (1, 2, 3, 4):
        assert actual[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step
    one, _ = _checkpoint(reference, 4)
    sharded, _ = _checkpoint(runs["straight"], 4)
    for (name, want), got in zip(one.state_dict().items(), sharded.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def test_distributed_checkpoint_resumes_on_one_process(runs):
    """The distributed step-2 checkpoint, resharded to 1 rank, continues as the distributed run does."""
    distributed, one = metrics_by_step(runs["resumed"]), metrics_by_step(runs["one_rank"])
    for step in (3, 4):
        assert one[step]["loss"] == pytest.approx(distributed[step]["loss"], rel=1e-5), step
    expected, _ = _checkpoint(runs["resumed"], 4)
    actual, _ = _checkpoint(runs["one_rank"], 4)
    for (name, want), got in zip(expected.state_dict().items(), actual.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
