"""Qwen3-MoE conversion: a forge-moe model with QK-norm and an explicit head size is
``Qwen3MoeForCausalLM``; the same weights give the same logits in Forge and in transformers, both ways."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from forge_lm.config import structure_config
from forge_lm.errors import ForgeError
from forge_lm.model import build_model
from forge_lm.model.hf import export_with_plugins, import_with_plugins
from forge_moe.layer import MoELayer

from .conftest import VOCAB

# The brief's bound for fp32 parity; measured differences are a few 1e-6 on logits of size ~5.
ATOL = 1e-4
# 4 blocks, head_dim 16 with hidden 32 and 4 heads (query heads twice as wide as the residual
# stream, as in Qwen3-30B-A3B: hidden 2048, 32 heads of 128); dense blocks 48 wide, experts 24.
QWEN3_MOE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
}
# (config.json fields, the MoE blocks, forge-moe's every_n_layers and first_moe_layer)
LAYOUTS = {
    "tied-renormalised-first-dense": (
        {"tie_word_embeddings": True, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0]},
        [1, 2, 3],
        (1, 1),
    ),
    "untied-raw-every-second": (
        {"tie_word_embeddings": False, "norm_topk_prob": False, "decoder_sparse_step": 2},
        [1, 3],
        (2, 1),
    ),
}


def perturb(model: torch.nn.Module, seed: int = 123) -> None:
    """Distinct norm scales (QK-norm's included), and matrices 5x HF's init std 0.02, so a
    swapped or missing weight changes the logits clearly."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.mul_(5)


def qwen3_moe(**fields) -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**QWEN3_MOE, **fields})
    hf = transformers.Qwen3MoeForCausalLM._from_config(config, attn_implementation="eager").eval()
    perturb(hf)
    return hf


def max_logit_difference(forge: torch.nn.Module, hf: torch.nn.Module) -> float:
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = forge(ids), hf(ids).logits
    assert ours.std() > 0.5  # logits of a meaningful size, or the tolerance says nothing
    return (ours - theirs).abs().max().item()


def forge_model(manager, table: dict, state: dict) -> torch.nn.Module:
    config = structure_config({"model": table, "train": {"seq_len": table["max_seq_len"]}}, manager.registry)
    model = build_model(config.model, config.model.options.vocab_size, manager.registry)
    model.load_state_dict(state, strict=True)
    return model.eval()


def moe_blocks(model: torch.nn.Module) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.feed_forward, MoELayer)]


@pytest.mark.parametrize(("fields", "moe", "layout"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_qwen3_moe_saved_by_transformers_imports_with_the_same_logits_and_exports_back_unchanged(
    fields, moe, layout, moe_manager, tmp_path
):
    hf = qwen3_moe(**fields)
    hf.save_pretrained(tmp_path / "hf")
    table, state = import_with_plugins(moe_manager, tmp_path / "hf")
    ffn = table["ffn"]
    assert (ffn["every_n_layers"], ffn["first_moe_layer"], ffn["n_experts"], ffn["top_k"]) == (*layout, 4, 2)
    assert ffn["router"]["renormalize"] == fields["norm_topk_prob"]
    assert ffn["router"]["balance_loss_weight"] == pytest.approx(0.04)  # Qwen's loss sums over the k choices
    assert (table["qk_norm"], table["head_dim"]) == (True, 16)
    model = forge_model(moe_manager, table, state)
    assert moe_blocks(model) == moe
    assert model.tied == fields["tie_word_embeddings"]
    assert model.layers[1].feed_forward.experts.w1.shape == (4, 24, 32)
    assert model.layers[0].attention.wq.weight.shape == (64, 32)
    assert max_logit_difference(model, hf) < ATOL

    export_with_plugins(moe_manager, model, model.config, tmp_path / "back")
    again = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert again.config.router_aux_loss_coef == pytest.approx(0.02)
    assert again.config.norm_topk_prob == fields["norm_topk_prob"]
    for name, tensor in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_qwen3_moe_in_transformers_fused_layout_imports_too(moe_manager):
    from forge_moe.hf import from_qwen3_moe

    hf = qwen3_moe(norm_topk_prob=True, mlp_only_layers=[0])
    table, state = from_qwen3_moe(hf.config.to_dict(), hf.state_dict())  # mlp.experts.gate_up_proj / down_proj
    assert max_logit_difference(forge_model(moe_manager, table, state), hf) < ATOL


FORGE_MODELS = {
    "tied-renormalised-moe-everywhere": ({"renormalize": True}, {"tie_embeddings": True}, 1, []),
    # MoE in blocks 0 and 2: Qwen counts from block step - 1, so the dense blocks are listed
    "untied-raw-dense-between": ({"renormalize": False, "every_n_layers": 2}, {"tie_embeddings": False}, 1, [1, 3]),
    "every-second-from-block-1": ({"renormalize": True, "every_n_layers": 2, "first_moe_layer": 1}, {}, 2, []),
}


@pytest.mark.parametrize(("router", "fields", "step", "mlp_only"), FORGE_MODELS.values(), ids=FORGE_MODELS.keys())
def test_forge_qk_norm_moe_model_exports_as_qwen3_moe_with_the_same_logits(
    router, fields, step, mlp_only, make_moe_model, moe_manager, tmp_path
):
    layout = {key: router.pop(key) for key in ("every_n_layers", "first_moe_layer") if key in router}
    ffn = {"n_experts": 4, "top_k": 2, "hidden_multiplier": 1.5, "multiple_of": 8, "expert_multiplier": 0.5}
    model = make_moe_model(
        {**ffn, **layout, "router": {"name": "softmax_topk", **router}},
        n_layers=4,
        qk_norm=True,
        head_dim=16,
        n_kv_heads=2,
        **fields,
    )
    perturb(model)
    export_with_plugins(moe_manager, model, model.config, tmp_path / "hf", eos_id=3)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["decoder_sparse_step"], written["mlp_only_layers"]) == (step, mlp_only)
    assert (written["intermediate_size"], written["moe_intermediate_size"], written["head_dim"]) == (48, 24, 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is transformers.Qwen3MoeForCausalLM
    assert hf.config.norm_topk_prob == router["renormalize"]
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")] == moe_blocks(model)
    assert max_logit_difference(model, hf) < ATOL


def test_a_moe_model_without_qk_norm_still_exports_as_mixtral(make_moe_model, moe_manager, tmp_path):
    model = make_moe_model({"n_experts": 4, "top_k": 2})
    export_with_plugins(moe_manager, model, model.config, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]


@pytest.mark.parametrize(
    ("ffn", "problem"),
    [
        ({"n_shared_experts": 1}, "layer 0 has shared experts"),
        ({"router": {"name": "sigmoid_topk"}}, "layer 0's router is not softmax_topk"),
    ],
)
def test_models_qwen3_moe_cannot_express_are_refused_with_the_reason(
    ffn, problem, make_moe_model, moe_manager, tmp_path
):
    model = make_moe_model({"n_experts": 4, "top_k": 2, **ffn}, qk_norm=True)
    with pytest.raises(ForgeError, match=f"no Hugging Face Qwen3MoeForCausalLM equivalent: .*{problem}"):
        export_with_plugins(moe_manager, model, model.config, tmp_path / "hf")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"mlp_only_layers": [2]}, r"mlp_only_layers = \[2\] puts the MoE blocks in layers \[0, 1, 3\]"),
        ({"mlp_only_layers": [0, 1, 2, 3]}, "puts the MoE blocks in no layer"),
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window = true with sliding_window 8"),
        ({"attention_bias": True}, "attention_bias = true"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ],
)
def test_qwen3_moe_checkpoints_forge_cannot_express_are_refused_naming_the_field(
    change, problem, moe_manager, tmp_path
):
    qwen3_moe().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ForgeError, match=problem):
        import_with_plugins(moe_manager, tmp_path)
