"""MoE models in the training loop and on the command line: configs/moe_debug.toml trains with the
loss falling and routing metrics logged, the sigmoid router's bias moves and is checkpointed,
and the trained run exports to (and a Mixtral imports from) Hugging Face."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from forge_lm.config import load_config, to_toml
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.testing import TINY_MODEL
from forge_lm.train import train
from forge_lm.train.inference import load_for_inference

from .test_hf import mixtral

REPO = Path(__file__).resolve().parents[3]
MOE_DEBUG = REPO / "configs" / "moe_debug.toml"
STATS = ("load_min", "load_max", "load_cv", "drop_fraction", "balance_loss", "z_loss")


def forge(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_LM_")}
    env["OMP_NUM_THREADS"] = "1"  # tiny models: as fast on one thread, and not stalled by a busy machine
    return subprocess.run(
        [sys.executable, "-m", "forge_lm", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "run"
    done = forge(
        "train",
        str(MOE_DEBUG),
        "--train.max_steps=30",
        "--train.batch_size=4",
        "--train.seq_len=64",
        "--metrics.log_interval=1",
        "--metrics.peak_flops=1e11",
        "--eval.interval=0",
        f"--train.output_dir={out}",
    )
    assert done.returncode == 0, done.stderr
    return out


def test_moe_debug_config_is_valid_and_round_trips_through_toml(moe_manager, tmp_path):
    config = load_config(MOE_DEBUG, [], moe_manager.registry)
    assert config.model.options.ffn.name == "moe"
    assert config.model.options.ffn.options.router.name == "softmax_topk"
    again = tmp_path / "again.toml"
    again.write_text(to_toml(config))
    assert load_config(again, [], moe_manager.registry) == config


def test_moe_debug_config_trains_from_the_cli_with_falling_loss_and_routing_metrics(moe_run):
    records = [r for r in read_metrics(moe_run / "metrics.jsonl") if "loss" in r]
    losses = [r["loss"] for r in records]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    n_layers = load_config(MOE_DEBUG, [], _manager().registry).model.options.n_layers
    for record in records:
        for layer in range(n_layers):
            for stat in STATS:
                assert f"moe/layer{layer}/{stat}" in record
        assert all(0.0 <= record[f"moe/layer{i}/drop_fraction"] < 1.0 for i in range(n_layers))
        assert all(record[f"moe/layer{i}/load_min"] <= 1.0 <= record[f"moe/layer{i}/load_max"] for i in range(n_layers))


def test_trained_moe_run_exports_to_mixtral_with_the_same_logits(moe_run, tmp_path):
    done = forge("export-hf", str(moe_run), str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, _, _ = load_for_inference(moe_run, _manager())
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=1e-4)


def test_forge_import_hf_reads_a_mixtral_that_exports_back_unchanged(tmp_path):
    hf = mixtral()
    hf.save_pretrained(tmp_path / "hf")
    done = forge("import-hf", str(tmp_path / "hf"), "--train.seq_len=32", f"--train.output_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr
    model, config, _ = load_for_inference(tmp_path / "run", _manager())
    assert (config.model.options.ffn.name, config.model.options.ffn.options.n_experts) == ("moe", 4)
    ids = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
    back = forge("export-hf", str(tmp_path / "run"), str(tmp_path / "back"))
    assert back.returncode == 0, back.stderr
    again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back")
    for name, tensor in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_sigmoid_router_bias_moves_once_per_optimizer_step_and_is_checkpointed(moe_manager, tmp_path):
    rate = 0.125  # exact in binary: the bias is rate times an integer
    config = load_config(
        None,
        [
            *TINY_MODEL,
            "--model.ffn.name=moe",
            "--model.ffn.n_experts=4",
            "--model.ffn.router.name=sigmoid_topk",
            f"--model.ffn.router.bias_update_rate={rate}",
            "--model.ffn.router.sequence_balance_loss_weight=0.01",
            "--train.batch_size=2",
            "--train.seq_len=16",
            "--train.max_steps=3",
            "--train.grad_accum_steps=2",
            '--metrics.backends=["jsonl"]',
            "--metrics.peak_flops=1e12",
            "--eval.interval=0",
            "--data.name=synthetic",
            f"--train.output_dir={tmp_path / 'run'}",
        ],
        moe_manager.registry,
    )
    train(config, moe_manager)
    model, _, _ = load_for_inference(tmp_path / "run", moe_manager)
    for layer in model.layers:
        steps = layer.feed_forward.router.expert_bias / rate
        assert torch.equal(steps, steps.round())
        assert steps.abs().max() <= 3
        assert steps.abs().sum() > 0
    record = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert {"moe/layer0/seq_balance_loss", "moe/layer1/load_cv"} <= record.keys()


def _manager():
    from forge_lm.plugins import PluginManager, PluginSettings

    return PluginManager(PluginSettings(allow=("moe",)))
