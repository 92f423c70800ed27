"""`forge import-hf` and `forge export-hf` of Mllama on the command line, end to end: a tiny random
MllamaForConditionalGeneration written by save_pretrained, imported by the CLI, gives
transformers' logits (fp32, 1e-4); a Forge cross_attention run with Mllama's tower, trained by
the CLI and exported by it, loads in transformers with the run's logits; so does the imported
run exported again."""

from __future__ import annotations

import pytest
import torch

from forge_lm.cli._main import main
from forge_lm.pretrained import load_pretrained

from .test_mllama import VISION
from .test_mllama_hf import ATOL, hf_config, inputs, open_hf_gates

# A Forge-made run: Mllama's tiny tower, a cross-attention layer after each of 2 llama blocks,
# the marker inside the byte tokenizer's vocabulary (no extra ids), transformers' empty rows.
RUN_VOCAB, RUN_MARK = 260, 259
RUN_CONFIG = f"""
[model]
name = "cross_attention"
tower = "mllama"
image_token_id = {RUN_MARK}
every_n_blocks = 1
empty_rows = "attend_all"

[model.language]
name = "llama"
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
vocab_size = {RUN_VOCAB}
max_seq_len = 64
tie_embeddings = false

[model.vision]
image_size = {VISION["image_size"]}
patch_size = {VISION["patch_size"]}
width = {VISION["width"]}
depth = {VISION["depth"]}
global_depth = {VISION["global_depth"]}
heads = {VISION["heads"]}
mlp_dim = {VISION["mlp_dim"]}
max_num_tiles = {VISION["max_num_tiles"]}
aspect_ratios = {VISION["aspect_ratios"]}
intermediate_layers = {VISION["intermediate_layers"]}

[data]
name = "synthetic_image_text"
max_images = 2

[train]
max_steps = 2
batch_size = 2
seq_len = 32

[optimizer]
name = "adamw"
lr = 0.05                     # two large steps: the gates open well away from zero

[scheduler]
name = "constant"
warmup_steps = 0

[eval]
interval = 0

[metrics]
backends = ["jsonl"]
peak_flops = 1e12
"""


def forge_logits(model, batch, cross=None):
    extra = {k: v for k, v in batch.items() if k != "input_ids"}
    with torch.no_grad():
        return model(batch["input_ids"], **extra, cross_attention_mask=cross)


def hf_logits(hf_dir, batch, cross):
    from transformers import MllamaForConditionalGeneration

    hf = MllamaForConditionalGeneration.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(**batch, cross_attention_mask=cross).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from transformers import MllamaForConditionalGeneration

    torch.manual_seed(0)
    hf = MllamaForConditionalGeneration(hf_config()).eval()
    open_hf_gates(hf)
    out = tmp_path_factory.mktemp("mllama")
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def imported(saved, tmp_path_factory, vlm_manager):
    run = tmp_path_factory.mktemp("imported") / "run"
    assert main(["import-hf", str(saved), "--plugins=vlm", f"--train.output_dir={run}"]) == 0
    return run


def test_the_cli_import_gives_transformers_logits(saved, imported, vlm_manager):
    model, _ = load_pretrained(imported, plugins=vlm_manager)
    batch, cross = inputs()
    expected = hf_logits(saved, batch, cross)
    torch.testing.assert_close(forge_logits(model, batch, cross), expected, rtol=0, atol=ATOL)
    torch.testing.assert_close(forge_logits(model, batch), expected, rtol=0, atol=ATOL)  # masks from markers


def test_the_imported_run_exported_by_the_cli_gives_the_same_logits(saved, imported, tmp_path):
    out = tmp_path / "hf"
    assert main(["export-hf", str(imported), str(out), "--plugins=vlm"]) == 0
    batch, cross = inputs()
    torch.testing.assert_close(hf_logits(out, batch, cross), hf_logits(saved, batch, cross), rtol=0, atol=ATOL)


def test_a_forge_run_with_the_mllama_tower_exported_by_the_cli_loads_in_transformers(tmp_path, vlm_manager):
    config = tmp_path / "run.toml"
    config.write_text(RUN_CONFIG)
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", str(config), "--plugins=vlm", f"--train.output_dir={run}"]) == 0
    assert main(["export-hf", str(run), str(out), "--plugins=vlm"]) == 0
    model, _ = load_pretrained(run, plugins=vlm_manager)
    gates = [float(layer.attn_gate.detach()) for layer in model.cross_layers()]
    assert all(abs(gate) > 0.02 for gate in gates), gates  # trained (0.07, 0.03): the images reach the text
    batch, cross = inputs(RUN_VOCAB, RUN_MARK)
    expected = forge_logits(model, batch)
    torch.testing.assert_close(hf_logits(out, batch, cross), expected, rtol=0, atol=ATOL)
