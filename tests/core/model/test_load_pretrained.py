"""``forge_lm.load_pretrained``: a run directory, one of its checkpoints and a Hugging Face
directory give the model in eval mode and its tokenizer; the same weights give the same logits
as the command-line path (``forge generate``'s loader) and as transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import forge_lm
from forge_lm.cli._main import main
from forge_lm.errors import ForgeError
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train.inference import load_for_inference

STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("pretrained") / "run"
    args = [*TINY_MODEL, "--train.seq_len=32", "--train.batch_size=2", "--eval.interval=0"]
    assert (
        main(["train", *args, f"--train.max_steps={STEPS}", "--checkpoint.interval=2", f"--train.output_dir={run}"])
        == 0
    )
    return run


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def test_a_run_directory_gives_its_newest_checkpoint_in_eval_mode_and_its_tokenizer(trained):
    model, tokenizer = forge_lm.load_pretrained(trained)
    assert not model.training
    ids = torch.tensor([tokenizer.encode("def load(path):")])
    logits = _logits(model, ids)
    assert logits.shape == (1, ids.shape[1], model.vocab_size)
    assert tokenizer.decode(tokenizer.encode("x = 1")) == "x = 1"
    reference, _, _ = load_for_inference(trained, PluginManager(PluginSettings(autoload=False)))
    assert torch.equal(logits, _logits(reference, ids))


def test_a_checkpoint_directory_gives_that_step(trained):
    newest, _ = forge_lm.load_pretrained(trained)
    older, _ = forge_lm.load_pretrained(trained / "checkpoints" / "step_2")
    ids = torch.arange(10)[None]
    assert not torch.equal(_logits(newest, ids), _logits(older, ids))  # a step of training apart
    again, _ = forge_lm.load_pretrained(trained / "checkpoints" / f"step_{STEPS}")
    assert torch.equal(_logits(newest, ids), _logits(again, ids))


def test_a_hugging_face_directory_loads_with_the_logits_transformers_computes(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export-hf", str(trained), str(out)]) == 0
    model, tokenizer = forge_lm.load_pretrained(out)
    assert tokenizer is not None  # export-hf writes tokenizer.json
    ids = torch.tensor([tokenizer.encode("import os\n")])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(model, ids), hf_model(ids).logits, atol=1e-4, rtol=1e-4)
    run_model, _ = forge_lm.load_pretrained(trained)
    torch.testing.assert_close(_logits(model, ids), _logits(run_model, ids), atol=1e-5, rtol=1e-5)


def test_a_hugging_face_directory_without_a_tokenizer_gives_none(trained, tmp_path):
    out = tmp_path / "hf"
    assert main(["export-hf", str(trained), str(out)]) == 0
    (out / "tokenizer.json").unlink()
    model, tokenizer = forge_lm.load_pretrained(out)
    assert tokenizer is None
    assert model(torch.arange(5)[None]).shape[-1] == json.loads((out / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("kind", ["missing", "file", "empty"])
def test_what_is_not_a_model_is_a_forge_error_naming_it(tmp_path, kind):
    path = tmp_path / "thing"
    if kind == "file":
        path.write_text("no model here")
    elif kind == "empty":
        path.mkdir()
    with pytest.raises(ForgeError, match="thing"):
        forge_lm.load_pretrained(path)
