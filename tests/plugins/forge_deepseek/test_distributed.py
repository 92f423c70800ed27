"""deepseek_v3 on 2 CPU ranks (gloo, real torchrun processes): FSDP2, and FSDP2 with expert
parallelism (``ep = 2``), train like one process on the same global batch: the same losses
(the MTP loss included in what is backpropagated) and gradient norms, step by step. Pipeline
parallelism (``pp = 2``) does too, for a model without MTP modules or router losses (the core
refuses auxiliary losses under pipeline parallelism)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from forge_lm.config import load_config
from forge_lm.testing.distributed import metrics_by_step, torchrun
from forge_lm.train import train

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "deepseek_debug.toml"
PLUGINS = "--plugins=moe,deepseek"
# Per-rank batch 2 on 2 ranks = batch 4 in one process; a constant learning rate.
SMALL = [
    "--model.dim=48",
    "--model.n_layers=3",
    "--model.ffn.n_experts=4",
    "--train.seq_len=32",
    "--train.max_steps=3",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--data.name=synthetic",
    "--scheduler.name=constant",
]


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _one_process(manager, run_dir: Path, *extra: str) -> dict[int, dict[str, float]]:
    overrides = [*SMALL, "--train.batch_size=4", f"--train.output_dir={run_dir}", *extra]
    train(load_config(DEBUG, overrides, manager.registry), manager)
    return metrics_by_step(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, deepseek_manager) -> dict[int, dict[str, float]]:
    return _one_process(deepseek_manager, tmp_path_factory.mktemp("reference") / "run")


@pytest.mark.parametrize(
    ("extra", "layout"),
    [
        ([], "ep=1; model transforms: moe_load_sync, fsdp2"),
        (["--distributed.ep=2"], "ep=2; model transforms: expert_parallel, moe_load_sync, fsdp2"),
    ],
    ids=["fsdp2", "fsdp2_ep2"],
)
def test_two_ranks_train_like_one_process(extra, layout, reference, tmp_path):
    """The loss is the mean over the ranks; the gradient norm covers every parameter, the MTP
    modules' and the experts' included (the logged ``mtp_loss`` is rank 0's own, as forge-moe's
    router losses are, so it is not compared)."""
    run_dir = tmp_path / "run"
    args = [str(DEBUG), PLUGINS, *SMALL, "--train.batch_size=2", f"--train.output_dir={run_dir}", *extra]
    result = _ok(torchrun(["-m", "forge_lm", "train", *args], nproc=2))
    assert f"2 ranks: dp_replicate=1 dp_shard=2 tp=1 pp=1 {layout}" in result.stderr
    actual = metrics_by_step(run_dir)
    assert reference[1]["mtp_loss"] > 0.1
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            assert actual[step][key] == pytest.approx(reference[step][key], rel=1e-5), (step, key)


def test_pipeline_stages_train_like_one_process(deepseek_manager, tmp_path):
    """No MTP and no router losses (aux losses are refused under pp), and no router bias update:
    with one, the bias after a pipelined step differs from one process's: torch's pipeline shape
    inference runs each stage once more in training mode (later stages on ``torch.empty``
    inputs) and forge-moe's router counts those routings (a forge-moe / core matter)."""
    plain = ["--model.n_layers=4", "--model.mtp_depth=0", "--model.ffn.router.sequence_balance_loss_weight=0"]
    plain += ["--model.ffn.router.bias_update_rate=0", "--train.grad_accum_steps=2"]
    expected = _one_process(deepseek_manager, tmp_path / "one", *plain)
    run_dir = tmp_path / "run"
    args = [str(DEBUG), PLUGINS, *SMALL, *plain, "--train.batch_size=4", f"--train.output_dir={run_dir}"]
    result = _ok(torchrun(["-m", "forge_lm", "train", *args, "--distributed.pp=2"], nproc=2))
    assert "2 ranks: dp_replicate=1 dp_shard=1 tp=1 pp=2 ep=1" in result.stderr
    actual = metrics_by_step(run_dir)
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            assert actual[step][key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)
