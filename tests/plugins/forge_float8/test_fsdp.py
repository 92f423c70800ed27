"""float8 under FSDP2 on two CPU processes (gloo), as `torchrun ... forge train` runs it: the
losses of one process, float8 all-gather, exact resume, and checkpoints any process can read."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from forge_lm.testing.distributed import torchrun
from forge_lm.train import train

from .conftest import TINY, read_losses

# Per-rank batch 2 on 2 ranks = batch 4 in one process.
TWO_RANKS = [*TINY, "--train.batch_size=2"]


def two_ranks(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = ["-m", "forge_lm", "--plugins", "float8", "train", *TWO_RANKS, f"--train.output_dir={run_dir}", *overrides]
    done = torchrun(args, nproc=2, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def close_to(actual: dict[int, float], expected: dict[int, float]) -> None:
    # Each rank scales its activations by the largest value of its own half of the batch, so the
    # float8 activations are not bit for bit those of one process; the weights' scales are the same.
    assert sorted(actual) == sorted(expected)
    for step, loss in expected.items():
        assert actual[step] == pytest.approx(loss, rel=1e-3), step


@pytest.fixture(scope="module")
def first_two_rank_run(tmp_path_factory) -> tuple[dict[int, float], str]:
    """Four steps of float8 on two FSDP2 ranks, FSDP2 gathering the fp32 weights: (losses, stderr)."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    done = two_ranks(run_dir)
    return read_losses(run_dir), done.stderr


def test_two_fsdp2_ranks_train_float8_like_one_process(first_two_rank_run, tiny_float8, float8_manager, tmp_path):
    losses, stderr = first_two_rank_run
    assert "2 ranks: dp_replicate=1 dp_shard=2 tp=1 pp=1 ep=1; model transforms: float8, fsdp2" in stderr
    assert stderr.count("forge-float8: 14 of 15 Linear layers train in float8") == 1  # printed by rank 0
    assert "FSDP2 gathers the converted weights in float8" not in stderr

    one = train(tiny_float8("--train.batch_size=4", run_dir=tmp_path / "one"), float8_manager).run_dir

    close_to(losses, read_losses(one))


def test_float8_all_gather_gives_the_same_losses_and_resumes_bit_for_bit(first_two_rank_run, tmp_path, forge_cli):
    """Gathering float8 weights with one scale per weight (the largest value over both shards)
    gives the same float8 weights as casting the gathered fp32 weight: the same losses, bit for
    bit. Stopped after step 2 and resumed, the run logs them too."""
    run_dir = tmp_path / "run"
    gather = "--transforms.float8.fsdp_float8_all_gather=true"
    first = two_ranks(run_dir, gather, "--train.max_steps=2")
    assert "forge-float8: FSDP2 gathers the converted weights in float8" in first.stderr
    resumed = two_ranks(run_dir, gather)
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'} (step 2)" in resumed.stderr

    assert read_losses(run_dir) == first_two_rank_run[0]

    # torchao keeps such weights in a tensor subclass; the checkpoint holds plain tensors, so that
    # a process without torchao (export-hf, generate) and Forge's safe reader can load it.
    shards = sorted((run_dir / "checkpoints" / "step_4").glob("*.distcp"))
    assert [shard.name for shard in shards] == ["__0_0.distcp", "__1_0.distcp"]
    assert not any(b"torchao" in shard.read_bytes() for shard in shards)
    exported = forge_cli("export-hf", str(run_dir), str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_the_rowwise_recipe_runs_under_fsdp2_too(tiny_float8, float8_manager, tmp_path):
    rowwise = ("--transforms.float8.recipe=rowwise", "--train.max_steps=2")
    two_ranks(tmp_path / "two", *rowwise)
    one = train(tiny_float8("--train.batch_size=4", *rowwise, run_dir=tmp_path / "one"), float8_manager).run_dir

    close_to(read_losses(tmp_path / "two"), read_losses(one))


def test_pipeline_stages_convert_their_own_layers(tiny_float8, float8_manager, tmp_path):
    pipeline = ("--model.tie_embeddings=false", "--train.grad_accum_steps=2", "--train.max_steps=2")
    done = two_ranks(tmp_path / "two", *pipeline, "--distributed.pp=2", "--train.batch_size=4")  # pp ranks share data
    assert "forge-float8: pipeline stage 0: 7 of 7 Linear layers train in float8 (recipe tensorwise).\n" in done.stderr
    one = train(tiny_float8("--train.batch_size=4", *pipeline, run_dir=tmp_path / "one"), float8_manager).run_dir

    expected = read_losses(one)
    assert read_losses(tmp_path / "two") == pytest.approx(expected, rel=1e-6)
