"""Model families and attention layers as plugin components: ``[model] name`` selects a
registered family, ``[model.attention] name`` an attention layer; the built-in ``llama`` is
built through the same path as a third party's; what a layout needs of a model is declared
by the model and refused, naming the family and the capability, when it is missing."""

from __future__ import annotations

import math

import pytest
import torch

from forge_lm.components import (
    ContextParallelModel,
    CountsFlops,
    DecodesWithCache,
    LanguageModel,
    PipelineSplittable,
    ShardedByBlocks,
    TensorParallelModel,
)
from forge_lm.config import ComponentConfig, LlamaOptions, load_config, model_options
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.model import build_model
from forge_lm.model.capabilities import check_family_supports
from forge_lm.model.flops import active_parameter_count, flops_per_token, model_flops_per_token
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL

from .conftest import VOCAB, tiny_fields

# A third party's model family that is not a transformer at all: each token's logits come
# from its own embedding and the previous token's (a causal bigram-plus model). It declares no
# capability beyond the LanguageModel contract.
BIGRAM_PLUGIN = """
import attrs
import torch
from torch import nn
from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@attrs.frozen
class BigramOptions:
    dim: int = 16
    vocab_size: int | None = None
    max_seq_len: int = 256
    init_std: float = 0.02


class Bigram(nn.Module):
    def __init__(self, config, vocab_size):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(vocab_size, config.dim)
        self.previous = nn.Linear(config.dim, config.dim, bias=False)
        self.head = nn.Linear(config.dim, vocab_size, bias=False)

    def forward(self, input_ids, document_ids=None):
        h = self.embed(input_ids)
        shifted = torch.nn.functional.pad(h, (0, 0, 1, 0))[:, :-1]  # the previous token's embedding
        return self.head(torch.tanh(h + self.previous(shifted)))

    def init_weights(self, init):
        init.normal(self.embed.weight, init.std)
        init.normal(self.previous.weight, init.std)
        init.normal(self.head.weight, init.std)


def build(options, context):
    return Bigram(options, context.vocab_size)


@hookimpl
def forge_lm_register_models(register):
    register("bigram", "forge_bigram:build", config=BigramOptions, description="a causal bigram model")
"""


@pytest.fixture
def bigram_manager(fake_site):
    fake_site.install("forge-bigram", BIGRAM_PLUGIN)
    return PluginManager(PluginSettings(allow=("bigram",)))


def _config(manager, *overrides: str):
    return load_config(None, list(overrides), manager.registry)


# -- the built-in family --------------------------------------------------------------------------


def test_the_default_model_section_is_the_llama_family_with_gqa_attention(manager):
    config = _config(manager)
    assert (config.model.name, type(config.model.options)) == ("llama", LlamaOptions)
    assert config.model.options.attention.name == "gqa"
    assert config.model.options.ffn.name == "swiglu"
    # A config file written before families (no name) is the same config as one naming llama.
    assert _config(manager, "--model.name=llama") == config


def test_llama_built_through_the_registry_is_the_model_built_from_its_options(manager):
    options = LlamaOptions(**tiny_fields())
    direct = build_model(options, VOCAB, manager.registry, seed=3)
    chosen = build_model(ComponentConfig("llama", options), VOCAB, manager.registry, seed=3)
    assert type(direct) is type(chosen)
    for (name, a), (_, b) in zip(direct.state_dict().items(), chosen.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_the_llama_model_declares_every_capability(manager):
    model = build_model(LlamaOptions(**tiny_fields()), VOCAB, manager.registry, device="meta")
    for capability in (
        LanguageModel,
        ShardedByBlocks,
        TensorParallelModel,
        PipelineSplittable,
        ContextParallelModel,
        DecodesWithCache,
        CountsFlops,
    ):
        assert isinstance(model, capability), capability.__name__


def test_the_declared_flops_are_the_formula_of_the_active_parameters(manager):
    options = LlamaOptions(**tiny_fields())
    model = build_model(options, VOCAB, manager.registry, seed=0)
    expected = 6.0 * active_parameter_count(model) + 12.0 * options.n_layers * options.dim * 32
    assert model_flops_per_token(model, 32) == expected == flops_per_token(options, active_parameter_count(model), 32)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("--model.name=nope", "model family 'nope'"),
        ("--model.attention.name=nope", "attention layer 'nope'"),
    ],
)
def test_an_unknown_family_or_attention_is_a_config_error_naming_it(manager, override, named):
    with pytest.raises(ConfigError) as caught:
        _config(manager, override)
    message = str(caught.value)
    assert named in message
    assert "llama" in message or "gqa" in message  # what is there to choose from


def test_an_unknown_family_is_refused_by_the_cli_with_exit_2_and_nothing_written(forge_cli, tmp_path):
    run_dir = tmp_path / "run"
    result = forge_cli("train", *TINY_MODEL, "--model.name=nope", f"--train.output_dir={run_dir}")
    assert result.returncode == 2, result.stderr
    assert "model family 'nope'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()


def test_deepseek_family_names_the_plugin_to_install_when_it_is_missing(manager):
    with pytest.raises(ConfigError, match="forge-deepseek"):
        _config(manager, "--model.name=deepseek_v3")


# -- a third party's family -----------------------------------------------------------------------


def test_a_third_party_family_trains_from_the_cli_with_its_own_options(bigram_manager, forge_cli, tmp_path):
    config = _config(bigram_manager, "--model.name=bigram", "--model.dim=8")
    assert type(config.model.options).__name__ == "BigramOptions"
    assert model_options(config).dim == 8
    run_dir = tmp_path / "run"
    result = forge_cli(
        "train",
        "--model.name=bigram",
        "--model.dim=32",
        "--train.max_steps=30",
        "--train.seq_len=32",
        "--train.batch_size=8",
        "--optimizer.lr=0.03",
        "--metrics.log_interval=1",
        "--scheduler.warmup_steps=1",
        "--eval.interval=0",
        f"--train.output_dir={run_dir}",
        env={"FORGE_LM_PLUGINS": "bigram"},
    )
    assert result.returncode == 0, result.stderr
    losses = [record.get("loss") for record in read_metrics(run_dir / "metrics.jsonl")]
    losses = [loss for loss in losses if loss is not None]
    assert abs(losses[0] - math.log(257)) < 0.3, losses[0]  # a uniform guess over the byte tokens at first
    assert losses[-1] < losses[0] - 1.0, losses  # then it learns the byte statistics
    assert 'name = "bigram"' in (run_dir / "config.toml").read_text()


def test_a_third_party_model_without_flops_counts_six_per_active_parameter(bigram_manager):
    config = _config(bigram_manager, "--model.name=bigram")
    model = build_model(config.model, 257, bigram_manager.registry, seed=0)
    assert not isinstance(model, CountsFlops)
    assert model_flops_per_token(model, 128) == 6.0 * active_parameter_count(model)
    assert active_parameter_count(model) == 16 * 16 + 16 * 257  # the embedding is a lookup


@pytest.mark.parametrize(
    ("overrides", "needs"),
    [
        (("--distributed.tp=2",), "tensor_parallel_plan()"),
        (("--distributed.pp=2", "--train.grad_accum_steps=2"), "keep_stage(stage, stages)"),
        (("--distributed.cp=2",), "positions"),
        (("--train.activation_checkpointing=full",), "blocks()"),
    ],
)
def test_a_layout_the_family_cannot_run_is_refused_at_validation_naming_family_and_capability(
    bigram_manager, overrides, needs
):
    config = _config(bigram_manager, "--model.name=bigram", *overrides)
    from forge_lm.distributed.mesh import ParallelDims

    section = config.distributed
    dims = ParallelDims(section.dp_replicate, 1, section.tp, section.pp, section.ep, section.pp_schedule, cp=section.cp)
    with pytest.raises(ConfigError) as caught:
        check_family_supports(config, 257, bigram_manager.registry, dims)
    message = str(caught.value)
    assert "model family 'bigram' from plugin 'bigram' (forge-bigram 1.0)" in message
    assert needs in message


def test_forge_config_validate_refuses_the_layout_with_exit_2(fake_site, forge_cli):
    fake_site.install("forge-bigram", BIGRAM_PLUGIN)
    result = forge_cli(
        "config", "validate", "--model.name=bigram", "--distributed.tp=2", env={"FORGE_LM_PLUGINS": "bigram"}
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "model family 'bigram'" in result.stderr
    assert "tensor_parallel_plan()" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_llama_family_passes_the_layouts_it_declares(manager):
    from forge_lm.distributed.mesh import ParallelDims

    config = _config(manager, *TINY_MODEL, "--train.seq_len=32", "--train.activation_checkpointing=full")
    check_family_supports(config, VOCAB, manager.registry, ParallelDims(1, 1, 2, 2, 1, "gpipe"))


def test_an_attention_without_a_tensor_parallel_plan_is_refused_under_tp(manager):
    from forge_lm.distributed.mesh import ParallelDims
    from forge_lm.model.attention import Attention

    class Plain(Attention):
        tensor_parallel_plan = None  # declared away: no plan

    class PlainPlugin:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        def forge_lm_register_attentions(self, register):
            register(
                "plain",
                lambda options, spec, i: Plain(spec.dim, spec.n_heads, spec.n_kv_heads, i),
                description="gqa without a tensor-parallel plan",
            )

    manager.add_plugin(PlainPlugin(), "plain", distribution="forge-plain", version="1.0")
    config = _config(manager, *TINY_MODEL, "--train.seq_len=32", "--model.attention.name=plain")
    model = build_model(config.model, VOCAB, manager.registry, device="meta")
    assert model.layers[0].attention.__class__ is Plain
    with pytest.raises(ConfigError, match=r"attention layer Plain defines no tensor_parallel_plan\(\)"):
        check_family_supports(config, VOCAB, manager.registry, ParallelDims(1, 1, 2, 1, 1, "gpipe"))


def test_a_family_factory_returning_no_module_is_a_plugin_error_naming_it(manager):
    from forge_lm.errors import PluginError

    class BrokenFamily:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        def forge_lm_register_models(self, register):
            register("broken", lambda options, context: {"not": "a model"}, description="returns a dict")

    manager.add_plugin(BrokenFamily(), "broken", distribution="forge-broken", version="0.1")
    with pytest.raises(PluginError, match=r"model family 'broken' from plugin 'broken' \(forge-broken 0\.1\)"):
        build_model(ComponentConfig("broken"), VOCAB, manager.registry)


def test_a_model_without_a_kv_cache_generates_by_running_the_whole_sequence(bigram_manager):
    from forge_lm.model.generate import generate

    config = _config(bigram_manager, "--model.name=bigram")
    model = build_model(config.model, 257, bigram_manager.registry, seed=5).eval()
    assert not isinstance(model, DecodesWithCache)
    tokens = [10, 20, 30]
    expected = list(tokens)
    with torch.no_grad():
        for _ in range(6):
            expected.append(int(model(torch.tensor([expected]))[0, -1].argmax()))
    assert generate(model, tokens, 6, temperature=0) == expected


def test_the_llama_model_generates_through_its_own_cache(manager, monkeypatch):
    from forge_lm.model.generate import generate
    from forge_lm.model.transformer import Transformer

    model = build_model(LlamaOptions(**tiny_fields()), VOCAB, manager.registry, seed=5).eval()
    made = []
    original = Transformer.new_kv_cache

    def spy(self, max_len=None):
        made.append(max_len)
        return original(self, max_len)

    monkeypatch.setattr(Transformer, "new_kv_cache", spy)
    with torch.no_grad():
        uncached = [1, 2, 3]
        for _ in range(5):
            uncached.append(int(model(torch.tensor([uncached]))[0, -1].argmax()))
    assert generate(model, [1, 2, 3], 5, temperature=0) == uncached
    assert made == [8]
