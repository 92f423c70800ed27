"""Which side each parameter goes to is decided by its role, and the config can override it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forge_lm.components import parameter_roles
from forge_lm.config import ModelSection, load_config
from forge_lm.errors import ConfigError
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager
from forge_optim_muon.factory import assign_parameters, build_muon


def _sides(assignments):
    return {a.name: (a.side, a.role) for a in assignments}


def test_dense_model_sends_hidden_matrices_to_muon_and_the_rest_to_adamw(models):
    model = build_model(ModelSection(dim=64, n_layers=2, n_heads=4), 97, PluginManager().registry)
    sides = _sides(assign_parameters(model))
    assert sides["tok_embeddings.weight"] == ("adamw", "embedding")  # the tied head is this same tensor
    assert "output.weight" not in sides
    assert sides["norm.weight"] == ("adamw", "norm")
    assert sides["layers.1.ffn_norm.weight"] == ("adamw", "norm")
    for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2"):
        assert sides[f"layers.0.{name}.weight"] == ("muon", "hidden matrix")


def test_untied_output_head_goes_to_adamw_and_is_decayed():
    model = build_model(ModelSection(dim=64, n_layers=1, n_heads=4, tie_embeddings=False), 97, PluginManager().registry)
    by_name = {a.name: a for a in assign_parameters(model)}
    head, embedding = by_name["output.weight"], by_name["tok_embeddings.weight"]
    assert (head.side, head.role, head.decay) == ("adamw", "output head", True)
    assert (embedding.side, embedding.decay) == ("adamw", False)
    assert by_name["tok_embeddings.weight"].decay is False
    assert {a.name: a.decay for a in assign_parameters(model, decay_embeddings=True)}["tok_embeddings.weight"]


def test_routers_biases_norms_and_stacked_experts_are_told_apart(models):
    sides = _sides(assign_parameters(models.tiny_mixture_lm()))
    assert sides["layers.0.router.weight"] == ("adamw", "router")
    assert sides["layers.0.mix.bias"] == ("adamw", "bias")
    assert sides["layers.0.mix.weight"] == ("muon", "hidden matrix")
    assert sides["layers.0.norm.weight"] == ("adamw", "norm")
    assert sides["layers.0.w_in"] == ("muon", "stacked matrices")
    assert sides["output.weight"] == ("adamw", "output head")


def test_router_modules_are_recognised_by_class_name_whatever_their_attribute_name():
    class TopKRouter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 8))

    model = nn.Sequential(nn.Linear(8, 8), TopKRouter())
    assert _sides(assign_parameters(model))["1.weight"] == ("adamw", "router")


class SquareLM(nn.Module):
    """Vocabulary = width: every matrix has the same shape, and the last one projects onto the vocabulary."""

    def __init__(self, declares_head: bool) -> None:
        super().__init__()
        self.vocab_size = 16
        self.declares_head = declares_head
        self.embed = nn.Embedding(16, 16)
        self.hidden = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 16, bias=False)

    def get_output_embeddings(self) -> nn.Module | None:  # Hugging Face's way to name the head
        return self.head if self.declares_head else None


def test_role_decides_not_layout_a_declared_square_head_stays_on_adamw():
    assert _sides(assign_parameters(SquareLM(declares_head=True))) == {
        "embed.weight": ("adamw", "embedding"),
        "hidden.weight": ("muon", "hidden matrix"),
        "head.weight": ("adamw", "output head"),
    }


def test_a_model_without_a_head_sends_its_last_vocabulary_wide_matrix_to_muon():
    """A pipeline stage without the head: its last Linear projects onto the vocabulary's width,
    but it is a hidden matrix (the old rule took the last such Linear for the head)."""
    model = SquareLM(declares_head=False)
    assert model.head.out_features == model.vocab_size
    assert _sides(assign_parameters(model)) == {
        "embed.weight": ("adamw", "embedding"),
        "hidden.weight": ("muon", "hidden matrix"),
        "head.weight": ("muon", "hidden matrix"),
    }


def test_sides_follow_the_core_parameter_roles(models):
    """Muon reuses the core's rule: its role names map one to one, routers refine core matrices."""
    model = models.tiny_mixture_lm()
    core = parameter_roles(model)
    expected = {"embedding": "embedding", "output": "output head", "norm": "norm", "bias": "bias"}
    for assignment in assign_parameters(model):
        role = core[assignment.name]
        if role == "matrix":
            assert assignment.role in ("hidden matrix", "stacked matrices", "router"), assignment
            assert (assignment.role == "router") == (".router." in assignment.name)
        else:
            assert assignment.role == expected[role], assignment


def test_name_patterns_send_parameters_either_way(models):
    model = models.tiny_mixture_lm()
    sides = _sides(assign_parameters(model, muon_params=["output.weight"], adamw_params=["layers.*.w_out"]))
    assert sides["output.weight"] == ("muon", "muon_params")
    assert sides["layers.1.w_out"] == ("adamw", "adamw_params")
    assert sides["layers.1.w_in"] == ("muon", "stacked matrices")


def test_a_pattern_that_matches_nothing_is_an_error(models):
    with pytest.raises(ConfigError, match=r"'layers\.\*\.wq\.weight' matches no parameter"):
        assign_parameters(models.tiny_mixture_lm(), adamw_params=["layers.*.wq.weight"])


def test_a_vector_sent_to_muon_is_an_error(models):
    with pytest.raises(ConfigError, match="only parameters of two or more dimensions"):
        assign_parameters(models.tiny_mixture_lm(), muon_params=["*.bias"])


def test_config_rejects_a_pattern_on_both_sides_and_bad_values():
    registry = PluginManager().registry
    base = ["--optimizer.name=muon"]
    with pytest.raises(ConfigError, match="also in muon_params"):
        load_config(None, [*base, '--optimizer.muon_params=["a"]', '--optimizer.adamw_params=["a"]'], registry)
    with pytest.raises(ConfigError, match="momentum"):
        load_config(None, [*base, "--optimizer.momentum=1.0"], registry)
    with pytest.raises(ConfigError, match="ns_dtype"):
        load_config(None, [*base, "--optimizer.ns_dtype=float16"], registry)


def test_every_parameter_lands_in_one_group_and_group_zero_is_muon(models):
    model = models.tiny_mixture_lm()
    optimizer = build_muon(models.muon_options(), model)
    assert optimizer.param_groups[0]["algorithm"] == "muon"
    grouped = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())
    decayed_groups = [g for g in optimizer.param_groups if g["algorithm"] == "adamw" and g["weight_decay"]]
    decayed = {id(p) for g in decayed_groups for p in g["params"]}
    assert decayed == {id(model.output.weight), *(id(layer.router.weight) for layer in model.layers)}


def test_the_split_is_reported_once_with_counts_and_parameter_totals(models, capsys):
    model = models.tiny_mixture_lm()
    build_muon(models.muon_options(), model)
    lines = capsys.readouterr().out.splitlines()
    muon = 2 * (32 * 32 + 3 * 48 * 32 + 3 * 32 * 48)
    adamw = 61 * 32 + 3 * 32 + 2 * 32 + 2 * 3 * 32 + 61 * 32
    assert lines == [
        f"muon: Muon: 6 tensors, {muon:,} parameters (2 hidden matrix, 4 stacked matrices)",
        f"muon: AdamW (lr 0.003): 9 tensors, {adamw:,} parameters "
        "(1 embedding, 1 output head, 2 router, 3 norm, 2 bias)",
    ]


def test_forge_moe_routers_go_to_adamw_and_its_grouped_experts_to_muon():
    registry = PluginManager().registry  # forge-moe is installed beside this plugin in the workspace
    config = load_config(None, ["--model.dim=64", "--model.n_layers=1", "--model.ffn.name=moe"], registry)
    sides = _sides(assign_parameters(build_model(config.model, 97, registry)))
    assert sides["layers.0.feed_forward.router.weight"] == ("adamw", "router")
    for name in ("w1", "w2", "w3"):
        assert sides[f"layers.0.feed_forward.experts.{name}"] == ("muon", "stacked matrices")
