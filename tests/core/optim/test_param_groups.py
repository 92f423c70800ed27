"""Every built-in optimizer decays weight matrices only: not norms, biases, or (by default) embeddings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forge_lm.components import parameter_roles
from forge_lm.optim.param_groups import weight_decay_groups

OPTIMIZERS = ["adamw", "lion", "schedule_free_adamw"]


class SmallLM(nn.Module):
    """An embedding, a linear layer with a bias, a LayerNorm (scale and bias) and a head."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def grouped_names(model: nn.Module, groups: list[dict]) -> dict[float, list[str]]:
    """Parameter names per weight-decay value, in the order the groups list them."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {group["weight_decay"]: [names[id(p)] for p in group["params"]] for group in groups}


def test_weight_matrices_are_decayed_and_norms_biases_and_embeddings_are_not():
    model = SmallLM(tied=False)

    assert grouped_names(model, weight_decay_groups(model, 0.1)) == {
        0.1: ["proj.weight", "head.weight"],
        0.0: ["embed.weight", "proj.bias", "norm.weight", "norm.bias"],
    }


def test_decay_embeddings_puts_the_embedding_table_with_the_weight_matrices():
    model = SmallLM(tied=False)

    assert grouped_names(model, weight_decay_groups(model, 0.1, decay_embeddings=True)) == {
        0.1: ["embed.weight", "proj.weight", "head.weight"],
        0.0: ["proj.bias", "norm.weight", "norm.bias"],
    }


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_a_head_tied_to_the_embedding_is_counted_once_and_follows_the_embedding_rule(decay_embeddings):
    model = SmallLM(tied=True)

    grouped = grouped_names(model, weight_decay_groups(model, 0.1, decay_embeddings=decay_embeddings))

    every = [name for names in grouped.values() for name in names]
    assert sorted(every) == sorted(["embed.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias"])
    assert ("embed.weight" in grouped[0.1]) is decay_embeddings


def test_frozen_parameters_are_left_out():
    model = SmallLM(tied=False)
    model.proj.requires_grad_(False)

    assert grouped_names(model, weight_decay_groups(model, 0.1)) == {
        0.1: ["head.weight"],
        0.0: ["embed.weight", "norm.weight", "norm.bias"],
    }


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_builtin_optimizer_groups_parameters_by_the_rule(name, build_optimizer):
    model = SmallLM(tied=True)

    optimizer = build_optimizer(name, model, weight_decay=0.25)

    assert grouped_names(model, optimizer.param_groups) == {
        0.25: ["proj.weight"],
        0.0: ["embed.weight", "proj.bias", "norm.weight", "norm.bias"],
    }


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_builtin_optimizer_decays_embeddings_when_asked(name, build_optimizer):
    model = SmallLM(tied=True)

    optimizer = build_optimizer(name, model, weight_decay=0.25, decay_embeddings=True)

    assert grouped_names(model, optimizer.param_groups)[0.25] == ["embed.weight", "proj.weight"]


class PerChannelNorm(nn.Module):
    """A norm whose scale is 2-D (one row per group): a norm by role, whatever its shape."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 4))


def test_decay_follows_the_shared_parameter_roles_not_the_shape():
    # The rule is forge_lm.components.parameter_roles, the one plugin optimizers reuse: a norm's
    # 2-D scale is a norm (not decayed), and decay and roles agree name by name.
    model = SmallLM(tied=False)
    model.group_norm = PerChannelNorm()
    roles = parameter_roles(model)
    decayed = grouped_names(model, weight_decay_groups(model, 0.1))[0.1]

    assert "group_norm.weight" not in decayed
    assert sorted(decayed) == sorted(name for name, role in roles.items() if role in ("matrix", "output"))
