"""deepseek_v3 in the training loop and on the command line: configs/deepseek_debug.toml trains
with the loss falling and ``mtp_loss`` logged beside (not inside) ``loss``, a run resumes
exactly, and the trained run exports to transformers with the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from forge_lm.config import load_config, to_toml
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.train import train
from forge_lm.train.inference import load_for_inference

from .conftest import forge_cli_run

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "deepseek_debug.toml"
SMALL = ("--train.batch_size=2", "--train.seq_len=32", "--eval.interval=0", "--metrics.log_interval=1")


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek") / "run"
    done = forge_cli_run(
        "train",
        str(DEBUG),
        "--train.max_steps=30",
        "--train.batch_size=4",
        "--train.seq_len=64",
        "--metrics.log_interval=1",
        "--eval.interval=0",
        f"--train.output_dir={out}",
    )
    assert done.returncode == 0, done.stderr
    return out


def test_deepseek_debug_config_is_valid_and_round_trips_through_toml(deepseek_manager, tmp_path):
    config = load_config(DEBUG, [], deepseek_manager.registry)
    assert (config.model.name, config.model.options.attention.name) == ("deepseek_v3", "mla")
    assert config.model.options.ffn.options.router.name == "sigmoid_topk"
    again = tmp_path / "again.toml"
    again.write_text(to_toml(config))
    assert load_config(again, [], deepseek_manager.registry) == config


def test_deepseek_debug_trains_from_the_cli_with_falling_loss_and_mtp_loss_logged(debug_run):
    records = [r for r in read_metrics(debug_run / "metrics.jsonl") if "loss" in r]
    losses = [r["loss"] for r in records]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    mtp = [r["mtp_loss"] for r in records]
    assert all(m > 0 for m in mtp)
    assert sum(mtp[-5:]) < sum(mtp[:5])  # the MTP module learns too
    for record in records:  # the logged mtp_loss is the weighted depth-1 loss
        assert record["mtp_loss"] == pytest.approx(0.3 * record["mtp/depth1_loss"], rel=1e-6)
    assert {"moe/layer1/load_cv", "moe/layer4/load_cv"} <= records[-1].keys()  # layer 4: the MTP block
    assert "moe/layer0/load_cv" not in records[-1]  # the dense block


def test_the_logged_loss_leaves_the_mtp_loss_out(deepseek_manager, tmp_path):
    """Step 1 of two runs that differ only in mtp_loss_weight: the same loss, twice the mtp_loss."""
    first = {}
    for weight in (0.5, 1.0):
        overrides = [*SMALL, "--train.max_steps=1", f"--model.mtp_loss_weight={weight}"]
        config = load_config(
            DEBUG, [*overrides, f"--train.output_dir={tmp_path / str(weight)}"], deepseek_manager.registry
        )
        run_dir = train(config, deepseek_manager).run_dir
        (first[weight],) = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert first[0.5]["loss"] == first[1.0]["loss"]
    assert first[1.0]["mtp_loss"] == 2 * first[0.5]["mtp_loss"]


def test_a_resumed_run_trains_bitwise_as_an_uninterrupted_one(deepseek_manager, tmp_path):
    def config(steps: int, run_dir: Path):
        overrides = [*SMALL, "--checkpoint.interval=2", f"--train.max_steps={steps}", f"--train.output_dir={run_dir}"]
        return load_config(DEBUG, overrides, deepseek_manager.registry)

    straight = train(config(4, tmp_path / "straight"), deepseek_manager).run_dir
    interrupted = train(config(2, tmp_path / "interrupted"), deepseek_manager).run_dir
    assert train(config(4, interrupted), deepseek_manager).steps == 4
    logged = [[r for r in read_metrics(d / "metrics.jsonl") if "loss" in r] for d in (straight, interrupted)]
    for key in ("loss", "mtp_loss", "grad_norm", "moe/layer2/load_cv"):
        assert [r[key] for r in logged[1]] == [r[key] for r in logged[0]], key
    models = [load_for_inference(d, deepseek_manager)[0] for d in (straight, interrupted)]
    resumed = models[1].state_dict()
    for name, tensor in models[0].state_dict().items():  # the routers' bias buffers included
        assert torch.equal(resumed[name], tensor), name


def test_trained_run_exports_to_transformers_with_the_same_logits(debug_run, deepseek_manager, tmp_path):
    done = forge_cli_run("export-hf", str(debug_run), str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["architectures"], written["num_nextn_predict_layers"]) == (["DeepseekV3ForCausalLM"], 1)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, _, _ = load_for_inference(debug_run, deepseek_manager)
    assert model.layers[1].feed_forward.router.expert_bias.abs().sum() > 0  # trained: the bias must carry over
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=1e-4)


def test_full_activation_checkpointing_trains_bitwise_as_without(deepseek_manager, tmp_path):
    """The blocks' replay in backward recomputes MLA and the MoE layers without reporting their
    losses twice; the MTP modules (outside the blocks) run once."""
    logged = {}
    for mode in ("none", "full"):
        overrides = [*SMALL, "--train.max_steps=2", f"--train.activation_checkpointing={mode}"]
        config = load_config(DEBUG, [*overrides, f"--train.output_dir={tmp_path / mode}"], deepseek_manager.registry)
        run_dir = train(config, deepseek_manager).run_dir
        logged[mode] = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    for key in ("loss", "grad_norm", "mtp_loss", "moe/layer1/seq_balance_loss", "moe/layer3/load_cv"):
        assert [r[key] for r in logged["full"]] == [r[key] for r in logged["none"]], key
