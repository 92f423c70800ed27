"""DeepSeek-V3 conversion: the same weights give the same logits in Forge and in transformers'
``DeepseekV3ForCausalLM``, both ways, with the MTP modules written as DeepSeek's checkpoints do."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from forge_deepseek.hf import ffn_table, from_deepseek_v3
from forge_lm.config import structure_config
from forge_lm.errors import ForgeError
from forge_lm.model import build_model
from forge_lm.model.hf import export_with_plugins, import_with_plugins
from forge_lm.model.swiglu import swiglu_hidden

from .conftest import forge_cli_run, tiny_hf_config

ATOL = 1e-4
VOCAB = 97


def perturb(model: torch.nn.Module, seed: int = 123) -> None:
    """Distinct norm scales and router biases, so a swapped or missing one changes the output;
    larger matrices than HF's init, so the comparison is sharper."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.mul_(2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias") or name.endswith("expert_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def random_hf(**fields) -> transformers.DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(tiny_hf_config(**fields)).eval()
    perturb(hf)
    return hf


def ids(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


def forge_model(manager, table: dict, state: dict) -> torch.nn.Module:
    config = structure_config({"model": table, "train": {"seq_len": table["max_seq_len"]}}, manager.registry)
    model = build_model(config.model, table["vocab_size"], manager.registry)
    model.load_state_dict(state, strict=True)
    return model.eval()


def assert_same_logits(forge: torch.nn.Module, hf: torch.nn.Module) -> None:
    with torch.no_grad():
        ours, theirs = forge(ids()), hf(ids()).logits
    assert ours.std() > 0.1  # logits of a meaningful size, or the tolerance says nothing
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_forge_import_hf_of_a_deepseek_v3_gives_transformers_logits(tmp_path, deepseek_manager):
    """Interleaved RoPE, a routed scaling factor of 2.5 and non-zero expert biases: each must be converted."""
    from forge_lm.train.inference import load_for_inference

    hf = random_hf(routed_scaling_factor=2.5)
    hf.save_pretrained(tmp_path / "hf")
    done = forge_cli_run(
        "import-hf", str(tmp_path / "hf"), "--train.seq_len=32", f"--train.output_dir={tmp_path / 'run'}"
    )
    assert done.returncode == 0, done.stderr
    model, config, _ = load_for_inference(tmp_path / "run", deepseek_manager)
    assert config.model.name == "deepseek_v3"
    assert (config.model.options.n_dense_layers, config.model.options.mtp_depth) == (1, 0)
    assert_same_logits(model, hf)


@pytest.mark.parametrize("fields", [{"q_lora_rank": None, "rope_interleave": False}, {"first_k_dense_replace": 0}])
def test_variants_import_with_the_same_logits(fields, deepseek_manager):
    hf = random_hf(**fields)
    table, state = from_deepseek_v3(hf.config.to_dict(), hf.state_dict())  # the fused in-memory expert layout
    assert_same_logits(forge_model(deepseek_manager, table, state), hf)


def deepseek_table(**model) -> dict:
    return {
        "name": "deepseek_v3",
        "dim": 64,
        "n_layers": 3,
        "n_heads": 4,
        "vocab_size": VOCAB,
        "max_seq_len": 64,
        "init_std": 0.1,
        "n_dense_layers": 1,
        "mtp_depth": 2,
        "attention": {"name": "mla", "q_lora_rank": 32, "kv_lora_rank": 24, "qk_rope_head_dim": 8},
        "ffn": {
            "name": "moe",
            "n_experts": 4,
            "top_k": 2,
            "expert_multiplier": 0.25,
            "n_shared_experts": 1,
            "router": {"name": "sigmoid_topk"},
        },
        **model,
    }


VARIANTS = {
    "untied": {"tie_embeddings": False},
    "tied": {"tie_embeddings": True},
    "plain-wq-no-shared-experts": {
        "tie_embeddings": False,
        "attention": {"name": "mla", "kv_lora_rank": 24, "qk_rope_head_dim": 8},
        "ffn": {"name": "moe", "n_experts": 4, "top_k": 2, "router": {"name": "sigmoid_topk"}},
    },
}


# Without shared experts HF builds an empty shared MLP (n_shared_experts = 0) and warns that
# initialising it does nothing; its output is zero, as Forge's absent one.
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("fields", VARIANTS.values(), ids=VARIANTS.keys())
def test_exported_model_loads_in_transformers_with_the_same_logits_and_its_mtp_modules_import_back(
    fields, deepseek_manager, tmp_path
):
    torch.manual_seed(0)
    tied = fields["tie_embeddings"]
    table = deepseek_table(**fields)
    config = structure_config({"model": table, "train": {"seq_len": 64}}, deepseek_manager.registry)
    model = build_model(config.model, VOCAB, deepseek_manager.registry).eval()
    perturb(model)
    export_with_plugins(deepseek_manager, model, model.config, tmp_path / "hf")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (hf.config.first_k_dense_replace, hf.config.n_routed_experts, hf.config.num_nextn_predict_layers) == (
        1,
        4,
        2,
    )
    assert hf.config.tie_word_embeddings == tied
    assert_same_logits(model, hf)

    from safetensors.torch import load_file

    written = load_file(tmp_path / "hf" / "model.safetensors")
    # The MTP modules as DeepSeek lays them out: after the trunk's layers, with their own copies
    # of the shared embedding and head.
    assert torch.equal(written["model.layers.4.eh_proj.weight"], model.mtp[1].eh_proj.weight)
    assert torch.equal(written["model.layers.3.shared_head.norm.weight"], model.mtp[0].norm.weight)
    assert torch.equal(written["model.layers.3.shared_head.head.weight"], model.output.weight)
    assert torch.equal(written["model.layers.3.embed_tokens.weight"], model.tok_embeddings.weight)
    assert torch.equal(
        written["model.layers.4.mlp.experts.3.down_proj.weight"], model.mtp[1].block.feed_forward.experts.w2[3]
    )

    table, state = import_with_plugins(deepseek_manager, tmp_path / "hf")
    assert table["mtp_depth"] == 2
    again = forge_model(deepseek_manager, table, state)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"n_group": 2, "topk_group": 1}, "group-limited routing"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "RoPE scaling"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized weights"),
    ],
)
def test_checkpoints_forge_cannot_express_are_refused_with_the_reason(fields, problem):
    config = tiny_hf_config().to_dict() | fields
    with pytest.raises(ForgeError, match=f"cannot be imported: .*{problem}"):
        from_deepseek_v3(config, {})


def test_a_model_with_attention_other_than_mla_is_refused_on_export(deepseek_manager, tmp_path):
    table = deepseek_table(attention={"name": "gqa"}, mtp_depth=0)
    config = structure_config({"model": table, "train": {"seq_len": 64}}, deepseek_manager.registry)
    model = build_model(config.model, VOCAB, deepseek_manager.registry)
    with pytest.raises(ForgeError, match="no Hugging Face DeepseekV3ForCausalLM equivalent: block 0's attention"):
        export_with_plugins(deepseek_manager, model, model.config, tmp_path / "hf")


@pytest.mark.parametrize(("dim", "dense", "expert"), [(64, 128, 32), (7168, 18432, 2048), (96, 200, 56), (48, 96, 96)])
def test_ffn_sizes_round_to_exactly_the_checkpoint_sizes(dim, dense, expert):
    sizes = ffn_table(dim, dense, expert)
    assert swiglu_hidden(dim, sizes["hidden_multiplier"], sizes["multiple_of"]) == dense
    assert swiglu_hidden(dim, sizes["hidden_multiplier"] * sizes["expert_multiplier"], sizes["multiple_of"]) == expert


def test_a_block_weight_without_a_forge_equivalent_is_refused_not_dropped():
    hf = random_hf()
    state = dict(hf.state_dict())
    state["model.layers.1.mlp.experts.gate_up_proj_scale_inv"] = torch.ones(4)  # as an fp8 checkpoint's scales
    with pytest.raises(ForgeError, match=re.escape("'mlp.experts.gate_up_proj_scale_inv' has no Forge equivalent")):
        from_deepseek_v3(hf.config.to_dict(), state)
