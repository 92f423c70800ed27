"""Muon's state (momentum buffers, the fallback's moments) goes through the core's checkpoints;
resuming from one continues exactly as the uninterrupted run. And configs/muon.toml trains."""

from __future__ import annotations

from pathlib import Path

import torch

from forge_lm.checkpoint import CheckpointManager
from forge_lm.config import load_config
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager
from forge_lm.train import train
from forge_optim_muon.factory import build_muon

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "muon.toml"
SMALL = ["--model.dim=32", "--model.n_layers=1", "--train.batch_size=4", "--train.seq_len=64"]
QUIET = ["--eval.interval=0", "--metrics.log_interval=1", '--metrics.backends=["jsonl"]']


def test_checkpoint_round_trip_resumes_muon_bit_for_bit(models, tmp_path):
    options = models.muon_options(weight_decay=0.1)
    data = models.batches(6)
    model = models.tiny_mixture_lm()
    optimizer = build_muon(options, model)
    models.train(model, optimizer, data[:3])
    checkpoints = CheckpointManager(tmp_path)
    checkpoints.save(3, model, optimizer, {})
    saved = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}
    models.train(model, optimizer, data[3:])

    resumed = models.tiny_mixture_lm(seed=123)  # different weights: everything must come from the checkpoint
    resumed_optimizer = build_muon(options, resumed)
    assert checkpoints.load(resumed, resumed_optimizer)["step"] == 3
    for name, param in resumed.named_parameters():  # momentum buffers and the fallback's moments and steps
        restored = resumed_optimizer.state[param]
        assert set(restored) == set(saved[name])
        assert set(restored) in ({"momentum_buffer"}, {"step", "exp_avg", "exp_avg_sq"})
        for key, value in saved[name].items():
            assert torch.equal(restored[key], value), f"{name} {key}"
    models.train(resumed, resumed_optimizer, data[3:])
    for (name, expected), actual in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), f"{name} differs after resuming"


def test_a_run_resumed_from_its_checkpoint_continues_bit_for_bit_with_muon(tmp_path):
    manager = PluginManager()

    def config(path, overrides):
        return load_config(path, [*SMALL, *QUIET, "--scheduler.name=constant", *overrides], manager.registry)

    straight = train(config(CONFIG, [f"--train.output_dir={tmp_path / 'straight'}", "--train.max_steps=6"]), manager)
    first = train(config(CONFIG, [f"--train.output_dir={tmp_path / 'resumed'}", "--train.max_steps=3"]), manager)
    resumed = train(config(first.run_dir / "config.toml", ["--train.max_steps=6"]), manager)
    assert resumed.steps == 6
    assert _losses(resumed.run_dir) == _losses(straight.run_dir)  # steps 4-6 after resuming, bit for bit


def _losses(run_dir):
    records = read_metrics(run_dir / "metrics.jsonl")
    return [r["loss"] for r in records if "loss" in r]


def test_shipped_muon_config_trains_the_model_with_muon(tmp_path, capsys):
    manager = PluginManager()
    run = [f"--train.output_dir={tmp_path / 'run'}", "--train.max_steps=10", "--scheduler.warmup_steps=0"]
    config = load_config(CONFIG, [*SMALL, *run, *QUIET], manager.registry)
    assert config.optimizer.name == "muon"
    result = train(config, manager)
    assert "muon: Muon: 7 tensors" in capsys.readouterr().out  # wq, wk, wv, wo, w1, w2, w3 of the one layer
    losses = _losses(result.run_dir)
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3
