"""Mixtral conversion: the same weights give the same logits in Forge and in transformers, both ways."""

from __future__ import annotations

import pytest
import torch
import transformers

from forge_lm.config import structure_config
from forge_lm.errors import ForgeError
from forge_lm.model import build_model
from forge_lm.model.hf import export_with_plugins, import_with_plugins
from forge_moe.hf import from_mixtral

from .conftest import VOCAB

ATOL = 1e-5
VARIANTS = {
    "tied-mha": {"tie_embeddings": True},
    "untied-gqa-capacity": {"tie_embeddings": False, "n_kv_heads": 2, "ffn_extra": {"capacity_factor": 1.0}},
}
FFN = {"n_experts": 4, "top_k": 2, "hidden_multiplier": 1.5, "multiple_of": 16}


def perturb(model: torch.nn.Module, seed: int = 123) -> None:
    """Distinct norm scales, so a swapped or missing norm changes the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


def assert_same_logits(forge: torch.nn.Module, hf: torch.nn.Module) -> None:
    ids = batch()
    with torch.no_grad():
        ours, theirs = forge(ids), hf(ids).logits
    assert ours.std() > 0.1  # logits of a meaningful size, or the tolerance says nothing
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fields", VARIANTS.values(), ids=VARIANTS.keys())
def test_exported_forge_moe_model_loads_in_mixtral_with_the_same_logits(fields, make_moe_model, moe_manager, tmp_path):
    fields = dict(fields)
    model = make_moe_model({**FFN, **fields.pop("ffn_extra", {})}, **fields)
    perturb(model)
    export_with_plugins(moe_manager, model, model.config, tmp_path / "hf", eos_id=3)
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_local_experts == 4
    assert hf.config.intermediate_size == 48
    assert hf.config.router_aux_loss_coef == pytest.approx(0.01 / 2)  # Mixtral's loss sums over the k choices
    assert hf.config.tie_word_embeddings == model.config.tie_embeddings
    assert_same_logits(model, hf)


def mixtral(tied: bool = False) -> transformers.MixtralForCausalLM:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        tie_word_embeddings=tied,
        rope_theta=500.0,
    )
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(config).eval()
    perturb(hf)
    with torch.no_grad():  # HF's init is std 0.02; larger weights make the comparison sharper
        for param in hf.parameters():
            if param.ndim >= 2:
                param.mul_(5)
    return hf


def forge_model(moe_manager, table: dict, state: dict) -> torch.nn.Module:
    config = structure_config({"model": table, "train": {"seq_len": table["max_seq_len"]}}, moe_manager.registry)
    model = build_model(config.model, config.model.options.vocab_size, moe_manager.registry)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_mixtral_saved_by_transformers_imports_with_the_same_logits_and_exports_back_unchanged(
    tied, moe_manager, tmp_path
):
    hf = mixtral(tied)
    hf.save_pretrained(tmp_path / "hf")
    table, state = import_with_plugins(moe_manager, tmp_path / "hf")
    assert table["ffn"]["router"] == {
        "name": "softmax_topk",
        "balance_loss_weight": pytest.approx(0.04),
        "z_loss_weight": 0.0,
        "renormalize": True,
    }
    model = forge_model(moe_manager, table, state)
    assert model.tied == tied
    assert model.layers[0].feed_forward.experts.w1.shape == (4, 40, 32)
    assert_same_logits(model, hf)

    export_with_plugins(moe_manager, model, model.config, tmp_path / "back")
    again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert again.config.router_aux_loss_coef == pytest.approx(0.02)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_mixtral_in_transformers_fused_layout_imports_too(moe_manager):
    hf = mixtral()
    table, state = from_mixtral(hf.config.to_dict(), hf.state_dict())  # mlp.experts.gate_up_proj / down_proj
    assert_same_logits(forge_model(moe_manager, table, state), hf)


@pytest.mark.parametrize(
    ("ffn", "problem"),
    [
        ({"router": {"name": "sigmoid_topk"}}, "router is not softmax_topk"),
        ({"n_shared_experts": 1}, "has shared experts"),
        ({"every_n_layers": 2}, "layer 1 is dense"),
    ],
)
def test_models_mixtral_cannot_express_are_refused_with_the_reason(ffn, problem, make_moe_model, moe_manager, tmp_path):
    model = make_moe_model({**FFN, **ffn})
    with pytest.raises(ForgeError, match=f"no Hugging Face MixtralForCausalLM equivalent: .*{problem}"):
        export_with_plugins(moe_manager, model, model.config, tmp_path / "hf")


def test_a_sliding_window_moe_model_is_not_exported_as_full_attention_mixtral(make_moe_model, moe_manager, tmp_path):
    model = make_moe_model(FFN, attention={"name": "sliding_window", "window": 8})
    with pytest.raises(ForgeError, match=r"\[model.attention\] name = 'sliding_window'"):
        export_with_plugins(moe_manager, model, model.config, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def moe_hook(manager, hook: str):
    (impl,) = [impl for impl in getattr(manager.hook, hook).get_hookimpls() if impl.plugin_name == "moe"]
    return impl.function


def test_hooks_leave_dense_models_and_other_model_types_to_the_core(moe_manager):
    dense = build_model(structure_config({}, moe_manager.registry).model, VOCAB, moe_manager.registry)
    assert moe_hook(moe_manager, "forge_lm_hf_export")(model=dense, config=dense.config) is None
    assert moe_hook(moe_manager, "forge_lm_hf_import")(hf_config={"model_type": "llama"}, state={}) is None
    # so the core's Llama conversion, asked after forge-moe, is the one that answers
    hf_config, _ = moe_manager.call_first("forge_lm_hf_export", model=dense, config=dense.config)
    assert hf_config["architectures"] == ["LlamaForCausalLM"]


def test_mixtral_with_a_sliding_window_is_refused():
    config = mixtral().config.to_dict() | {"sliding_window": 16}
    with pytest.raises(ForgeError, match="sliding_window 16"):
        from_mixtral(config, {})
