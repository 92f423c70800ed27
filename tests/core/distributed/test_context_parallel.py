"""Context parallelism (``[distributed] cp``): each sequence split over the ranks of a group.

On 2 (and 4) gloo ranks the loop's own step matches one process on the same batch, loss and
every gradient, which covers the zigzag slicing, RoPE at global positions and the causal (and
document) masks over the gathered keys; ``forge train`` under torchrun logs the losses of one
process, and its checkpoints resume in one process. In one process: the positions path of the
model, the layout, and the refused combinations.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims
from forge_lm.distributed.context_parallel import zigzag_positions
from forge_lm.errors import ConfigError
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.testing.distributed import metrics_by_step, torchrun

WORKER = Path(__file__).parent / "workers" / "context_parallel_worker.py"
# test_torchrun_cli.py's tiny run: a constant learning rate, evaluation and checkpoints at step 2.
TINY = [
    *TINY_MODEL,
    "--train.seq_len=16",
    "--train.batch_size=4",
    "--train.grad_accum_steps=2",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=2",
    "--eval.steps=2",
    "--data.name=synthetic",
    "--scheduler.name=constant",
    "--checkpoint.interval=2",
]


def _one_process_args(steps: int) -> list[str]:
    """What follows ``forge train`` in :func:`_train` but the output directory and extras: the
    command line of a run of ``one_process_runs`` (tests/core/distributed/conftest.py)."""
    return ["--no-plugin-autoload", *TINY, f"--train.max_steps={steps}"]


def _train(run_dir: Path, steps: int, *extra: str, nproc: int = 1) -> subprocess.CompletedProcess:
    args = ["train", *_one_process_args(steps), f"--train.output_dir={run_dir}"]
    if nproc == 1:
        command = [sys.executable, "-m", "forge_lm", *args, *extra]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    else:
        result = torchrun(["-m", "forge_lm", *args, *extra], nproc=nproc)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def manager() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False))


def _config(manager: PluginManager, *overrides: str):
    return load_config(None, ["--train.seq_len=16", *overrides], manager.registry)


def test_zigzag_pairs_early_and_late_chunks() -> None:
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([zigzag_positions(24, 3, r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))  # every token exactly once


@pytest.mark.parametrize("documents", [False, True])
def test_explicit_positions_give_the_same_logits_in_any_order(manager: PluginManager, documents: bool) -> None:
    """The path a context-parallel rank takes (RoPE and the mask from positions), in one process:
    tokens fed in a shuffled order with their positions give the shuffled logits."""
    config = _config(manager, "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.vocab_size=97")
    model = build_model(config.model, 97, manager.registry, seed=0)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    document_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16]) if documents else None
    expected = model(ids, document_ids)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    shuffled_docs = document_ids[:, order] if documents else None
    actual = model(ids[:, order], shuffled_docs, positions=order)
    torch.testing.assert_close(actual, expected[:, order], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(ids, document_ids, positions=torch.arange(16)), expected)


def test_cp_ranks_share_the_data_and_fsdp_spans_them(manager: PluginManager) -> None:
    dims = ParallelDims.resolve(_config(manager, "--distributed.cp=2"), 4)
    assert (dims.dp_shard, dims.cp, dims.dp_size, dims.shard_size, dims.world_size) == (2, 2, 2, 4, 4)
    assert dims.describe() == "4 ranks: dp_replicate=1 dp_shard=2 tp=1 pp=1 ep=1 cp=2"


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["--distributed.cp=2", "--train.seq_len=18"], 2, "divisible by 2 * cp = 4"),
        (["--distributed.cp=2", "--distributed.tp=2"], 4, "not supported with tp = 2"),
        (["--distributed.cp=2", "--distributed.pp=2", "--train.grad_accum_steps=2"], 4, "not supported with pp = 2"),
        (["--distributed.cp=2", "--distributed.ep=2"], 4, "not supported with ep = 2"),
        (["--distributed.cp=2", "--distributed.dp_replicate=2"], 4, "not supported with dp_replicate = 2"),
        (["--distributed.cp=2", "--train.compile=true"], 2, "compile = true"),
        (["--distributed.cp=2", "--distributed.dp_shard=2"], 2, "cp * tp"),
        (["--distributed.cp=3"], 2, "does not divide the world size 2"),
    ],
)
def test_unsupported_or_inconsistent_degrees_are_refused(
    manager: PluginManager, overrides: list[str], world: int, message: str
) -> None:
    with pytest.raises(ConfigError, match="cp") as error:
        ParallelDims.resolve(_config(manager, *overrides), world)
    assert message in str(error.value)


# The layouts of the worker's step: (its arguments, ranks). One launch per number of ranks runs
# every layout of that number in turn, each with its own parts, model and batch.
STEP_LAYOUTS = {
    "cp2": (["--distributed.cp=2"], 2),
    "cp2-documents": (["--distributed.cp=2", "--documents"], 2),
    "cp2-checkpointed": (["--distributed.cp=2", "--train.activation_checkpointing=full"], 2),
    "cp2-fsdp2-4-ranks": (["--distributed.cp=2", "--distributed.dp_shard=2"], 4),
}


@pytest.fixture(scope="module")
def steps(launches_by_rank_count):
    """``steps(layout)``: the worker's numbers for ``layout``; one launch per number of ranks, run
    for every layout of that number when the first is asked for."""
    launch = launches_by_rank_count(WORKER, STEP_LAYOUTS)
    return lambda layout: launch(layout)[0]


@pytest.mark.parametrize(
    ("layout", "nproc"), [pytest.param(args, nproc, id=name) for name, (args, nproc) in STEP_LAYOUTS.items()]
)
def test_step_matches_the_single_process_step(steps, request, layout: list[str], nproc: int) -> None:
    numbers = steps(request.node.callspec.id)
    assert numbers["ok"], numbers  # the worker's own check of the step
    assert numbers["cp"] == 2
    assert numbers["dp_size"] == nproc // 2  # the ranks of a cp group read the same data
    assert numbers["sharded"]
    assert numbers["shard_mesh"] == ["dp_shard_cp"]  # FSDP2 over dp_shard x cp
    assert numbers["clipped"]
    assert numbers["loss"] == pytest.approx(numbers["reference_loss"], abs=1e-4)
    assert numbers["grad_norm"] == pytest.approx(numbers["reference_grad_norm"], rel=1e-4)
    assert numbers["max_grad_error"] < 1e-4, numbers["worst_parameter"]


@pytest.fixture(scope="module")
def reference(one_process_runs) -> dict[int, dict[str, float]]:
    """Four steps in one process (``_train(run_dir, 4)``): what the cp runs must reproduce (the
    run test_torchrun_cli.py compares with too, trained once per session)."""
    return metrics_by_step(one_process_runs.read(*_one_process_args(4)))


def test_forge_train_under_cp_logs_the_losses_of_one_process_and_resumes_in_one(tmp_path: Path, reference) -> None:
    """cp ranks share the batch: the per-rank batch is the global batch (4, as in one process)."""
    run_dir = tmp_path / "run"
    result = _train(run_dir, 2, "--distributed.cp=2", nproc=2)
    assert "dp_shard=1 tp=1 pp=1 ep=1 cp=2; model transforms: fsdp2" in result.stderr
    resumed = _train(run_dir, 4)
    assert "resumed from" in resumed.stderr
    assert "global batch changed" not in resumed.stderr
    expected, actual = reference, metrics_by_step(run_dir)
    for step in (1, 2, 3, 4):  # the loss and norm of every step, the eval loss at 2 (cp) and 4 (resumed)
        for key in ("loss", "grad_norm", "eval/loss"):
            if key in expected[step]:
                assert actual[step][key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)


def test_a_one_process_checkpoint_resumes_under_cp(tmp_path: Path, reference, one_process_runs) -> None:
    """The other direction: steps 1-2 in one process, 3-4 on a cp group of 2 ranks, against an
    uninterrupted one-process run."""
    run_dir = one_process_runs.copy(tmp_path / "run", *_one_process_args(2))  # _train(run_dir, 2)
    resumed = _train(run_dir, 4, "--distributed.cp=2", nproc=2)
    assert "resumed from" in resumed.stderr
    expected, actual = reference, metrics_by_step(run_dir)
    for step in (3, 4):
        for key in ("loss", "grad_norm", "eval/loss"):
            if key in expected[step]:
                assert actual[step][key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)
