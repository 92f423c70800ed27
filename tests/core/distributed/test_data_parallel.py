"""FSDP2 and replicated data parallelism on 2 CPU ranks (gloo) against one process.

The worker runs the training loop's own step (``build_parts`` + ``compute_gradients``, with gradient
accumulation and clipping) on 2 ranks and the plain single-process step on the same global
batch, from the same weights, and compares the loss, the gradient norm and every gradient.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge_lm.testing.distributed import torchrun

WORKER = Path(__file__).parent / "workers" / "data_parallel_worker.py"


@pytest.mark.parametrize(
    ("layout", "nproc"),
    [
        pytest.param(["--distributed.dp_shard=2"], 2, id="fsdp2"),
        pytest.param(["--distributed.dp_replicate=2", "--distributed.dp_shard=1"], 2, id="replicated"),
        pytest.param(["--distributed.dp_replicate=2", "--distributed.dp_shard=2"], 4, id="hsdp-4-ranks"),
        pytest.param(["--distributed.dp_shard=2", "--optimizer.name=muon"], 2, id="fsdp2-muon"),
        pytest.param(["--distributed.dp_shard=2", "--distributed.defer_grad_reduction=true"], 2, id="fsdp2-deferred"),
        # FSDP2 wraps the blocks torch.compile compiled (inductor, as [train] compile runs).
        pytest.param(["--distributed.dp_shard=2", "--train.compile=true"], 2, id="fsdp2-compile"),
    ],
)
def test_step_matches_the_single_process_step(tmp_path: Path, layout: list[str], nproc: int) -> None:
    out = tmp_path / "result.json"
    result = torchrun([str(WORKER), str(out), *layout], nproc=nproc)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    transforms = "compile, fsdp2" if "--train.compile=true" in layout else "fsdp2"
    if "--distributed.dp_shard=2" in layout:
        assert f"model transforms: {transforms}\n" in result.stderr
    # FSDP2's warning about units returning views: Forge reads them out of place, and says nothing.
    assert "returned a view tensor" not in result.stderr
    numbers = json.loads(out.read_text())
    assert numbers["sharded"]  # the parameters really are DTensors spread over the ranks
    assert numbers["unsynced_micro_batch"]  # a micro-batch without reduction leaves the sharded gradients alone
    # By default each micro-batch reduce-scatters: between them a rank holds only gradient shards
    # (FSDP's memory saving); deferred, it holds its unsharded gradients inside FSDP until the last.
    deferred = "--distributed.defer_grad_reduction=true" in layout
    assert numbers["grads_between_micro_batches"] == (["none"] if deferred else ["sharded"])
    assert numbers["master_dtypes"] == ["torch.float32"]
    assert (numbers["fsdp_param_dtype"], numbers["fsdp_reduce_dtype"]) == ("None", "None")
    assert numbers["clipped"]  # the comparison covers clipping with the global norm
    assert numbers["loss"] == pytest.approx(numbers["reference_loss"], abs=1e-5)
    assert numbers["grad_norm"] == pytest.approx(numbers["reference_grad_norm"], rel=1e-5)
    assert numbers["max_grad_error"] < 1e-6
    # The optimizer step on sharded parameters (Muon orthogonalises whole matrices) is the
    # single-process step.
    assert numbers["optimizer"] == ("Muon" if "--optimizer.name=muon" in layout else "AdamW")
    assert numbers["max_update_error"] < 1e-2 * numbers["update_scale"]


def test_bf16_gathers_bf16_reduces_fp32_keeps_fp32_masters(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = torchrun([str(WORKER), str(out), "--distributed.dp_shard=2", "--train.precision=bf16"], nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    numbers = json.loads(out.read_text())
    assert (numbers["fsdp_param_dtype"], numbers["fsdp_reduce_dtype"]) == ("torch.bfloat16", "torch.float32")
    assert numbers["master_dtypes"] == ["torch.float32"]  # the sharded weights the optimizer updates
    assert numbers["unsynced_micro_batch"]
    assert numbers["loss"] == pytest.approx(numbers["reference_loss"], rel=2e-2)  # fp32 reference: loose
