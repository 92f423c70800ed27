"""Hugging Face Llama conversion: the same weights give the same logits in Forge and in transformers."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import transformers

from forge_lm.config import ModelSection
from forge_lm.errors import ForgeError
from forge_lm.model import build_model
from forge_lm.model.hf import (
    export_hf,
    from_hf_state_dict,
    load_hf,
    swiglu_options_for,
    to_hf_config,
    to_hf_state_dict,
)
from forge_lm.model.swiglu import swiglu_hidden

from .conftest import VOCAB, perturb_norms

# Logits of size ~4 in fp32; Forge's CPU linear layers run on oneDNN, transformers' on MKL:
# a different summation order, a few ulp apart (1e-5 is about 20 ulp at 4). A wrong weight
# mapping or RoPE layout is off by more than 1e-2.
ATOL = 5e-5
VARIANTS = {
    "tied-mha": {"tie_embeddings": True},
    "untied-gqa": {"tie_embeddings": False, "n_kv_heads": 2},
    "tied-mqa-theta": {"tie_embeddings": True, "n_kv_heads": 1, "rope_theta": 500.0, "norm_eps": 1e-6},
}


def hf_model(config: ModelSection, attention: str = "eager") -> transformers.LlamaForCausalLM:
    hidden = swiglu_hidden(config.dim, 8 / 3, 64)  # the default swiglu options
    torch.manual_seed(1)
    hf_config = to_hf_config(config, VOCAB, hidden)
    return transformers.LlamaForCausalLM._from_config(hf_config, attn_implementation=attention).eval()


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


def assert_same_logits(forge: torch.nn.Module, hf: transformers.LlamaForCausalLM) -> None:
    ids = batch()
    with torch.no_grad():
        ours, theirs = forge(ids), hf(ids).logits
    assert ours.std() > 0.1  # logits of a meaningful size, or the tolerance says nothing
    assert torch.allclose(ours, theirs, atol=ATOL, rtol=0), (ours - theirs).abs().max()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("fields", VARIANTS.values(), ids=VARIANTS.keys())
def test_forge_weights_in_transformers_give_the_same_logits(make_model, fields, attention):
    model = make_model(**fields)
    perturb_norms(model)
    hf = hf_model(model.config, attention)
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    assert_same_logits(model, hf)


@pytest.mark.parametrize("fields", VARIANTS.values(), ids=VARIANTS.keys())
def test_transformers_weights_in_forge_give_the_same_logits(make_model, fields):
    model = make_model(seed=9, **fields)
    hf = hf_model(model.config)
    perturb_norms(hf)
    with torch.no_grad():  # HF's init is std 0.02; larger weights make the comparison sharper
        for param in hf.parameters():
            if param.ndim == 2:
                param.mul_(5)
    model.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    assert model.tied == model.config.tie_embeddings
    assert_same_logits(model, hf)


def test_a_tied_checkpoint_without_lm_head_loads_the_embedding_as_head(make_model):
    model = make_model(tie_embeddings=False)
    hf_state = to_hf_state_dict(make_model(seed=3, tie_embeddings=True))
    del hf_state["lm_head.weight"]
    model.load_state_dict(from_hf_state_dict(hf_state), strict=True)
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)


@pytest.mark.parametrize("fields", VARIANTS.values(), ids=VARIANTS.keys())
def test_export_then_import_round_trips_through_disk(make_model, manager, tmp_path, fields):
    model = make_model(**fields)
    perturb_norms(model)
    out = export_hf(model, model.config, tmp_path / "hf", eos_id=7)

    # transformers reads the directory as a Llama model with the same logits
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.config.eos_token_id == 7
    assert_same_logits(model, hf)

    # and Forge imports it back: the same architecture, the same weights
    fields_back, state = load_hf(out)
    config_back = ModelSection(**fields_back)
    for name in ("dim", "n_layers", "n_heads", "kv_heads", "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings"):
        assert getattr(config_back, name) == getattr(model.config, name), name
    rebuilt = build_model(config_back, fields_back["vocab_size"], manager.registry).eval()
    rebuilt.load_state_dict(state, strict=True)
    assert rebuilt.layers[0].feed_forward.w1.out_features == model.layers[0].feed_forward.w1.out_features
    for name, tensor in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name
    assert rebuilt.tied == model.tied


def test_a_sharded_save_pretrained_checkpoint_imports(manager, make_config, tmp_path):
    hf = hf_model(make_config(n_kv_heads=2, tie_embeddings=False))
    perturb_norms(hf)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    fields, state = load_hf(tmp_path)
    model = build_model(ModelSection(**fields), fields["vocab_size"], manager.registry).eval()
    model.load_state_dict(state, strict=True)
    assert_same_logits(model, hf)


@pytest.mark.parametrize(("dim", "hidden"), [(32, 128), (4096, 11008), (4096, 14336), (100, 300), (96, 250)])
def test_imported_swiglu_options_reproduce_the_hidden_size(dim, hidden):
    options = swiglu_options_for(dim, hidden)
    assert swiglu_hidden(dim, options.hidden_multiplier, options.multiple_of) == hidden


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"norm": "layernorm"}, "norm = 'layernorm'"),
        ({"qk_norm": True}, "qk_norm = true"),
    ],
)
def test_models_without_a_llama_equivalent_are_refused(make_model, tmp_path, fields, problem):
    model = make_model(**fields)
    with pytest.raises(ForgeError, match=f"no Hugging Face LlamaForCausalLM equivalent: .*{problem}"):
        export_hf(model, model.config, tmp_path)
    with pytest.raises(ForgeError, match=problem):
        to_hf_state_dict(model)
    assert not (tmp_path / "config.json").exists()


def test_export_without_safetensors_names_the_extra_to_install(make_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # makes `import safetensors.torch` fail
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    model = make_model()
    with pytest.raises(ForgeError, match=r"pip install 'forge-lm\[hf\]'"):
        export_hf(model, model.config, tmp_path)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias = true"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "RoPE scaling 'llama3'"),
    ],
)
def test_checkpoints_forge_cannot_express_are_refused(make_model, tmp_path, change, problem):
    model = make_model()
    export_hf(model, model.config, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ForgeError, match=problem):
        load_hf(tmp_path)


def test_a_directory_without_weights_is_refused(make_model, tmp_path):
    model = make_model()
    export_hf(model, model.config, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ForgeError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_hf(tmp_path)
