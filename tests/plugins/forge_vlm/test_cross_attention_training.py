"""configs/vlm_cross_attention_debug.toml (the cross_attention family with forge-vlm's ViT) trains
from the CLI with the text loss falling; a run stopped and resumed continues exactly as one that
was not; FSDP2 on 2 gloo ranks trains like one process on the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.testing.distributed import metrics_by_step, torchrun
from forge_lm.train import train

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "vlm_cross_attention_debug.toml"
FEW = ["--metrics.log_interval=1", '--metrics.backends=["jsonl"]', "--metrics.peak_flops=1e12"]
# Smaller than the debug config; batch 4 in one process = 2 per rank on 2 ranks.
SMALL = [
    "--model.language.dim=32",
    "--model.vision.depth=1",
    "--model.freeze_vision=true",  # a training stage: it must survive the resume
    "--train.seq_len=32",
    "--scheduler.name=constant",
    *FEW,
]


def test_the_debug_config_trains_from_the_cli_with_the_loss_falling(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_LM_")}
    env["OMP_NUM_THREADS"] = "1"
    run = tmp_path / "run"
    command = [sys.executable, "-m", "forge_lm", "train", str(DEBUG), f"--train.output_dir={run}"]
    result = subprocess.run(
        [*command, "--train.max_steps=12", *FEW], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = metrics_by_step(run)
    first, last = metrics[1]["loss"], metrics[12]["loss"]
    assert last < first - 1.0, (first, last)  # 5.6 -> about 3 in 12 steps (0.34 after the config's 60)
    # image tokens per second beside tokens per second: 17 ViT states per image, up to 3 images a row
    rates = [metrics[step]["image_tokens_per_sec"] for step in range(2, 13)]
    assert all(rate > 0 for rate in rates), rates
    assert max(rates) < 3 * 17 / 64 * max(metrics[step]["tokens_per_sec"] for step in range(2, 13)) * 1.5


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, vlm_manager) -> Path:
    """4 steps of batch 4 in one process, uninterrupted: what the others must match."""
    run = tmp_path_factory.mktemp("one_process") / "run"
    overrides = [*SMALL, "--train.batch_size=4", f"--train.output_dir={run}", "--train.max_steps=4"]
    train(load_config(DEBUG, overrides, vlm_manager.registry), vlm_manager)
    return run


@pytest.fixture(scope="module")
def one_process(one_process_run) -> dict[int, dict[str, float]]:
    return metrics_by_step(one_process_run)


def test_forge_generate_with_an_image_equals_full_forwards_by_hand(one_process_run, vlm_manager, tmp_path, capsys):
    """`forge generate --image` on a cross_attention run: one marker for the image, before the
    prompt; decoding with the cache (image states kept from the prefill) gives the tokens of full
    forwards that each see the image."""
    from PIL import Image

    from forge_lm.cli._main import main
    from forge_lm.train.inference import load_for_inference

    Image.new("RGB", (20, 20), (0, 255, 0)).save(tmp_path / "green.png")
    model, config, tokenizer = load_for_inference(one_process_run, vlm_manager)
    prompt, inputs = model.image_prompt("ab", [str(tmp_path / "green.png")], tokenizer, config)
    assert prompt == [259, *tokenizer.encode("ab")]  # the marker before the text
    assert tuple(inputs["pixel_values"].shape) == (1, 3, 16, 16)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            tokens.append(int(model(torch.tensor([tokens]), **inputs)[0, -1].argmax()))
    code = main(
        ["generate", str(one_process_run), "--image", str(tmp_path / "green.png"), "--prompt", "ab",
         "--temperature=0", "--max-new-tokens=6"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == "ab" + tokenizer.decode(tokens[len(prompt) :]) + "\n"


def test_resume_continues_exactly(tmp_path, vlm_manager, one_process):
    parts = tmp_path / "parts"
    first = [*SMALL, "--train.batch_size=4", f"--train.output_dir={parts}", "--checkpoint.interval=2"]
    train(load_config(DEBUG, [*first, "--train.max_steps=2"], vlm_manager.registry), vlm_manager)
    train(load_config(DEBUG, [*first, "--train.max_steps=4"], vlm_manager.registry), vlm_manager)
    assert '"resume"' in (parts / "events.jsonl").read_text()  # step 2's checkpoint was resumed
    got = metrics_by_step(parts)
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(one_process[step]["loss"], rel=1e-6, abs=1e-6)
        assert got[step]["grad_norm"] == pytest.approx(one_process[step]["grad_norm"], rel=1e-5)


def test_fsdp2_on_two_ranks_trains_like_one_process(tmp_path, one_process):
    run = tmp_path / "run"
    args = [str(DEBUG), "--plugins=vlm", *SMALL, "--train.batch_size=2", f"--train.output_dir={run}"]
    result = torchrun(["-m", "forge_lm", "train", *args, "--train.max_steps=3"], nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 ranks: dp_replicate=1 dp_shard=2 tp=1 pp=1 ep=1; model transforms: fsdp2" in result.stderr
    got = metrics_by_step(run)
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(one_process[step][key], rel=1e-5), (step, key)
