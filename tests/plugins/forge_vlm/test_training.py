"""configs/vlm_debug.toml trains from the CLI (the text loss falls within a few steps, image
tokens per second logged beside tokens per second), and a run stopped and resumed continues
exactly as one that was not (the data position and the training stage kept)."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge_lm.config import load_config
from forge_lm.testing.distributed import metrics_by_step
from forge_lm.train import train

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "vlm_debug.toml"
FEW = ["--metrics.log_interval=1", '--metrics.backends=["jsonl"]', "--metrics.peak_flops=1e12"]


def test_the_debug_config_trains_from_the_cli_with_the_loss_falling(debug_run):
    run, result = debug_run
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = metrics_by_step(run)
    first, last = metrics[1]["loss"], metrics[12]["loss"]
    assert last < first - 1.0, (first, last)  # 5.6 -> about 3.5 in 12 steps
    assert metrics[12]["image_tokens_per_sec"] > 0
    # 3 images of 16 tokens in a row of 64: the image tokens are a share of all tokens
    assert metrics[12]["image_tokens_per_sec"] < metrics[12]["tokens_per_sec"]


@pytest.fixture(scope="module")
def small(vlm_manager):
    return [
        "--model.language.dim=32",
        "--model.language.n_layers=1",
        "--model.vision.depth=2",
        "--model.freeze_vision=true",  # the stage must survive the resume
        "--train.batch_size=2",
        "--train.seq_len=48",
        "--scheduler.name=constant",
        *FEW,
    ]


def test_resume_continues_exactly(tmp_path, vlm_manager, small):
    whole = tmp_path / "whole"
    train(
        load_config(DEBUG, [*small, f"--train.output_dir={whole}", "--train.max_steps=4"], vlm_manager.registry),
        vlm_manager,
    )
    parts = tmp_path / "parts"
    first = [*small, f"--train.output_dir={parts}", "--checkpoint.interval=2"]
    train(load_config(DEBUG, [*first, "--train.max_steps=2"], vlm_manager.registry), vlm_manager)
    train(load_config(DEBUG, [*first, "--train.max_steps=4"], vlm_manager.registry), vlm_manager)
    events = (parts / "events.jsonl").read_text()
    assert '"resume"' in events  # the second start resumed from step 2, it did not start over
    expected, got = metrics_by_step(whole), metrics_by_step(parts)
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-6, abs=1e-6)
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-5)
