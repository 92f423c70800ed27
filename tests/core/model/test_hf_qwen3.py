"""Hugging Face Qwen3 conversion: Forge's dense model with QK-norm and an explicit head size is
``Qwen3ForCausalLM``; the same weights give the same logits in Forge and in transformers, both ways."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from forge_lm.cli._main import main
from forge_lm.config import structure_config
from forge_lm.errors import ForgeError
from forge_lm.model import build_model
from forge_lm.model.hf import export_hf, export_with_plugins, import_with_plugins
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.inference import load_for_inference

from .conftest import VOCAB, perturb_norms, tiny_fields

# The brief's bound for fp32 parity; measured differences are a few 1e-6 on logits of size ~5.
ATOL = 1e-4
# head_dim 16 with hidden 32 and 4 heads: the query heads together (64) are twice as wide as the
# residual stream, as in Qwen3-0.6B (hidden 1024, 16 heads of 128).
QWEN3 = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
}


def qwen3(tied: bool) -> transformers.Qwen3ForCausalLM:
    config = transformers.Qwen3Config(**QWEN3, tie_word_embeddings=tied)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM._from_config(config, attn_implementation="eager").eval()
    perturb_norms(hf)  # q_norm and k_norm included: a swapped or misplaced QK-norm changes the logits
    with torch.no_grad():  # HF's init is std 0.02; larger weights make the comparison sharper
        for param in hf.parameters():
            if param.ndim == 2:
                param.mul_(5)
    return hf


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


def max_logit_difference(forge: torch.nn.Module, hf: torch.nn.Module) -> float:
    ids = batch()
    with torch.no_grad():
        ours, theirs = forge(ids), hf(ids).logits
    assert ours.std() > 0.5  # logits of a meaningful size, or the tolerance says nothing
    return (ours - theirs).abs().max().item()


def forge_model(manager: PluginManager, table: dict) -> torch.nn.Module:
    config = structure_config({"model": table, "train": {"seq_len": table["max_seq_len"]}}, manager.registry)
    return build_model(config.model, config.model.options.vocab_size, manager.registry).eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_saved_by_transformers_imports_with_the_same_logits(manager, tmp_path, tied):
    hf = qwen3(tied)
    hf.save_pretrained(tmp_path / "hf")
    table, state = import_with_plugins(manager, tmp_path / "hf")
    assert (table["qk_norm"], table["head_dim"], table["n_kv_heads"], table["rope_theta"]) == (True, 16, 2, 500.0)
    model = forge_model(manager, table)
    model.load_state_dict(state, strict=True)
    assert model.tied == tied
    assert model.layers[0].attention.wq.weight.shape == (4 * 16, 32)
    assert model.layers[0].attention.wo.weight.shape == (32, 4 * 16)
    assert max_logit_difference(model, hf) < ATOL


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_forge_qk_norm_model_exports_as_qwen3_with_the_same_logits(make_model, manager, tmp_path, tied):
    model = make_model(qk_norm=True, head_dim=16, n_kv_heads=2, tie_embeddings=tied, rope_theta=500.0)
    perturb_norms(model)
    export_with_plugins(manager, model, model.config, tmp_path / "hf", eos_id=7)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["architectures"], written["model_type"], written["head_dim"]) == (["Qwen3ForCausalLM"], "qwen3", 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is transformers.Qwen3ForCausalLM
    assert (hf.config.eos_token_id, hf.config.tie_word_embeddings) == (7, tied)
    assert max_logit_difference(model, hf) < ATOL

    # and back: the same architecture, the same weights
    table, state = import_with_plugins(manager, tmp_path / "hf")
    rebuilt = forge_model(manager, table)
    rebuilt.load_state_dict(state, strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name
    for name in ("dim", "n_heads", "kv_heads", "head_dim", "qk_norm", "rope_theta", "norm_eps", "tie_embeddings"):
        assert getattr(rebuilt.config, name) == getattr(model.config, name), name


def test_a_model_without_qk_norm_still_exports_as_llama(make_model, manager, tmp_path):
    model = make_model(head_dim=16)
    export_with_plugins(manager, model, model.config, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is transformers.LlamaForCausalLM
    assert max_logit_difference(model, hf) < ATOL


def test_llama_export_refuses_qk_norm_and_points_to_qwen3(make_model, tmp_path):
    model = make_model(qk_norm=True)
    with pytest.raises(ForgeError, match=r"qk_norm = true \(Llama has no QK-norm; .* Qwen3ForCausalLM"):
        export_hf(model, model.config, tmp_path)


def test_qk_norm_with_a_sliding_window_is_refused_naming_the_attention(manager, tmp_path):
    table = {**tiny_fields(qk_norm=True, vocab_size=VOCAB), "attention": {"name": "sliding_window", "window": 8}}
    model = forge_model(manager, table)
    with pytest.raises(ForgeError, match=r"no Hugging Face Qwen3ForCausalLM equivalent: \[model.attention\] name"):
        export_with_plugins(manager, model, model.config, tmp_path / "hf")
    assert not (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types is not 'full_attention' at layers 1"),
        (
            {"layer_types": None, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
            "use_sliding_window = true with sliding_window 8 from layer 1 on",
        ),
        ({"attention_bias": True}, "attention_bias = true"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "RoPE scaling 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"head_dim": 15}, "head_dim is 15, odd"),
    ],
)
def test_qwen3_checkpoints_forge_cannot_express_are_refused_naming_the_field(manager, tmp_path, change, problem):
    qwen3(tied=False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ForgeError, match=problem):
        import_with_plugins(manager, tmp_path)


def test_sliding_window_settings_that_window_no_layer_import(manager, tmp_path):
    """Qwen3 configs carry use_sliding_window = false with a sliding_window size, or a window only
    from max_window_layers on: neither narrows any layer of the model."""
    qwen3(tied=False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    unused = {"layer_types": None, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps({**config, **unused}))
    table, _ = import_with_plugins(manager, tmp_path)
    assert table["qk_norm"] is True


def test_import_hf_then_export_hf_from_the_command_line(tmp_path):
    hf = qwen3(tied=False)
    hf.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["--no-plugin-autoload", "import-hf", str(tmp_path / "hf"), f"--train.output_dir={run}"]) == 0
    model, config, _ = load_for_inference(run, PluginManager(PluginSettings(autoload=False)))
    assert (config.model.options.head_dim, config.model.options.qk_norm) == (16, True)
    assert max_logit_difference(model, hf) < ATOL

    assert main(["--no-plugin-autoload", "export-hf", str(run), str(tmp_path / "back")]) == 0
    again = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
