"""From the command line: train on the embedded corpus, then generate, export and plot.

One short run (module scope) feeds every test here, as a user would chain the commands.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.inference import load_for_inference

SMALL = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--train.seq_len=64",
    "--train.batch_size=8",
    "--train.max_steps=60",
    "--optimizer.lr=3e-3",
    "--scheduler.warmup_steps=5",
    "--metrics.log_interval=1",
    "--metrics.peak_flops=1e11",
    "--eval.interval=30",
]


def forge(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_LM_")}
    return subprocess.run(
        [sys.executable, "-m", "forge_lm", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    done = forge("train", *SMALL, f"--train.output_dir={out}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(f"run directory {out}")
    return out


def test_training_on_the_embedded_corpus_lowers_the_loss(run_dir):
    records = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(losses) == 60
    assert len(evals) == 2
    assert losses[0] == pytest.approx(math.log(257), abs=0.3)  # near uniform over the byte vocabulary at init
    assert sum(losses[-10:]) / 10 < losses[0] - 2.0  # clearly learning: below 3.5 nats after 60 steps
    assert evals[-1] < evals[0]


def test_train_writes_no_traceback_for_a_bad_override(tmp_path):
    done = forge("train", "--train.max_steps=0", f"--train.output_dir={tmp_path / 'x'}")
    assert done.returncode == 2
    assert done.stderr == "forge: error: [train] max_steps: must be > 0, got 0.\n"
    assert not (tmp_path / "x").exists()  # rejected before anything was written


def test_generate_prints_what_the_python_api_generates(run_dir):
    from forge_lm.model.generate import generate

    args = ("--prompt", "def ", "--max-new-tokens", "24", "--temperature", "0.7", "--top-k", "20", "--seed", "3")
    done = forge("generate", str(run_dir), *args)
    assert done.returncode == 0, done.stderr
    model, _, tokenizer = load_for_inference(run_dir, PluginManager(PluginSettings(autoload=False)))
    prompt = tokenizer.encode("def ")
    tokens = generate(
        model,
        prompt,
        24,
        temperature=0.7,
        top_k=20,
        eos_id=tokenizer.eos_id,
        generator=torch.Generator().manual_seed(3),
    )
    assert done.stdout == "def " + tokenizer.decode(tokens[len(prompt) :]) + "\n"


def test_exported_model_gives_the_same_logits_in_transformers(run_dir, tmp_path):
    import transformers  # a development dependency (requirements-dev.txt): the independent reference

    done = forge("export-hf", str(run_dir), str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 256
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, _, _ = load_for_inference(run_dir, PluginManager(PluginSettings(autoload=False)))
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=1e-4)


def test_plot_writes_a_png_of_the_run(run_dir):
    done = forge("plot", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_imported_hf_llama_gives_the_same_logits_and_exports_back_unchanged(tmp_path):
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.save_pretrained(tmp_path / "hf")

    done = forge("import-hf", str(tmp_path / "hf"), f"--train.output_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr
    model, config, _ = load_for_inference(tmp_path / "run", PluginManager(PluginSettings(autoload=False)))
    assert (config.model.options.dim, config.model.options.n_kv_heads, config.model.options.vocab_size) == (64, 2, 300)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)

    back = forge("export-hf", str(tmp_path / "run"), str(tmp_path / "back"))
    assert back.returncode == 0, back.stderr
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def _small_hf_llama(path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def test_an_import_that_fails_before_its_checkpoint_leaves_no_half_made_run(tmp_path, monkeypatch, capsys):
    """import-hf writes the run's config, then its step-0 checkpoint; when the write fails (here
    a full disk), the directory it created goes, so the same command can simply be run again."""
    from forge_lm.checkpoint import CheckpointManager
    from forge_lm.cli._main import main

    _small_hf_llama(tmp_path / "hf")
    run = tmp_path / "runs" / "imported"
    command = ["--no-plugin-autoload", "import-hf", str(tmp_path / "hf"), f"--train.output_dir={run}"]

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointManager, "save", disk_full)
        assert main(command) == 2
    err = capsys.readouterr().err
    assert f"cannot write the imported checkpoint into '{run}': No space left on device." in err
    assert "Traceback" not in err
    assert not run.exists()
    assert not run.parent.exists()  # the parents it made, too
    assert main(command) == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0"


def test_import_hf_takes_the_run_directory_lock(tmp_path, capsys):
    """A directory another command holds (its lock taken) is refused, and left as it was."""
    from forge_lm.cli._main import main
    from forge_lm.run_lock import RunLock

    _small_hf_llama(tmp_path / "hf")
    run = tmp_path / "busy"
    run.mkdir()
    lock = RunLock(run)
    lock.acquire()
    try:
        code = main(["--no-plugin-autoload", "import-hf", str(tmp_path / "hf"), f"--train.output_dir={run}"])
    finally:
        lock.release()
    assert code == 2
    assert "lock" in capsys.readouterr().err
    assert run.is_dir()
    assert not (run / "config.toml").exists()
