"""``[checkpoint] init_from``: a new run starts from another run's (or a Hugging Face model's)
weights, with a fresh optimizer, schedule and data position. The reference for the new run's
first loss is the source model, loaded on its own, on the new run's first batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forge_lm import load_pretrained
from forge_lm.cli._main import main as forge_main
from forge_lm.config import load_config
from forge_lm.data.loader import BatchLoader
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.model.hf import export_hf
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train import train
from forge_lm.train.builders import build_dataset

from .conftest import TINY

VOCAB = 257  # the byte tokenizer's, as the tiny runs use


def _config(manager, run_dir: Path, *overrides: str):
    return load_config(
        None, [*TINY, "--eval.interval=0", f"--train.output_dir={run_dir}", *overrides], manager.registry
    )


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 2-step run (seed 1, so its weights are not the new runs' initial ones) and the loss its
    final weights give on the first batch of a fresh run of the same data."""
    manager = PluginManager(PluginSettings(autoload=False))  # as the function-scoped fixture's
    run_dir = tmp_path_factory.mktemp("source") / "run"
    config = _config(manager, run_dir, "--train.max_steps=2", "--train.seed=1")
    assert train(config, manager).status == "completed"
    model, _ = load_pretrained(run_dir, plugins=manager)
    fresh = _config(manager, run_dir.parent / "unused")
    batch = next(iter(BatchLoader(build_dataset(fresh, manager.registry, None, VOCAB, "train"), 4)))
    with torch.no_grad():
        logits = model(batch["input_ids"], batch.get("document_ids"))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten()).item()
    return run_dir, model, loss


def _first_loss(manager, run_dir: Path, init_from: Path) -> float:
    result = train(_config(manager, run_dir, "--train.max_steps=1", f"--checkpoint.init_from={init_from}"), manager)
    assert (result.status, result.steps, result.resumed_at) == ("completed", 1, 0)
    return read_metrics(run_dir / "metrics.jsonl")[0]["loss"]


def test_a_new_run_starts_from_a_run_dirs_weights(source, manager, tmp_path):
    run_dir, _, expected = source
    assert _first_loss(manager, tmp_path / "new", run_dir) == pytest.approx(expected, rel=1e-5)
    # A fresh run of the same seed starts elsewhere: the check above is not met by chance.
    plain = train(_config(manager, tmp_path / "plain", "--train.max_steps=1"), manager)
    assert plain.status == "completed"
    assert read_metrics(tmp_path / "plain" / "metrics.jsonl")[0]["loss"] != pytest.approx(expected, rel=1e-3)


def test_a_step_dir_and_an_exported_hugging_face_dir_work_alike(source, manager, tmp_path):
    run_dir, model, expected = source
    step_dir = run_dir / "checkpoints" / "step_2"
    assert _first_loss(manager, tmp_path / "from_step", step_dir) == pytest.approx(expected, rel=1e-5)
    hf_dir = export_hf(model, model.config, tmp_path / "hf")
    assert _first_loss(manager, tmp_path / "from_hf", hf_dir) == pytest.approx(expected, rel=1e-5)


def test_a_path_that_is_not_a_checkpoint_is_refused_with_exit_2_and_nothing_written(manager, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "new"
    code = forge_main(["train", *TINY, f"--train.output_dir={out}", f"--checkpoint.init_from={tmp_path / 'empty'}"])
    assert code == 2
    assert "init_from" in capsys.readouterr().err
    assert not out.exists()


def test_a_model_of_other_sizes_is_refused_naming_the_tensors(source, manager, tmp_path):
    run_dir, _, _ = source
    out = tmp_path / "new"
    config = _config(manager, out, "--model.n_kv_heads=4", f"--checkpoint.init_from={run_dir}")
    with pytest.raises(
        ConfigError,
        match=r"do not fit .*'layers\.0\.attention\.wk\.weight' is \[16, 32\] in the source but \[32, 32\] here",
    ):
        train(config, manager)
    assert not out.exists()


def test_fewer_layers_than_the_source_are_refused(source, manager, tmp_path):
    run_dir, _, _ = source
    out = tmp_path / "new"
    config = _config(manager, out, "--model.n_layers=1", f"--checkpoint.init_from={run_dir}")
    with pytest.raises(ConfigError, match=r"has 2 layers but \[model\] n_layers is 1: growth only adds layers"):
        train(config, manager)
    assert not out.exists()


def test_a_run_with_its_own_checkpoint_resumes_and_ignores_init_from(source, manager, tmp_path, capsys):
    run_dir, _, _ = source
    out = tmp_path / "own"
    assert train(_config(manager, out, "--train.max_steps=1"), manager).status == "completed"
    resumed = train(_config(manager, out, "--train.max_steps=2", f"--checkpoint.init_from={run_dir}"), manager)
    assert (resumed.status, resumed.resumed_at, resumed.steps) == ("completed", 1, 2)
    assert f"init_from = '{run_dir}' is ignored" in capsys.readouterr().err
