"""One rule says what a normalisation layer is (forge_lm.components.is_norm_layer): the default
initialisation sets its scale to 1 and parameter_roles calls its parameters "norm", for the same
modules. Before, initialisation took any class name containing "Norm" and the roles one ending in it,
so a NormGate (a gate matrix) started at 1 and was still trained as a matrix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forge_lm.components import is_norm_layer, parameter_roles
from forge_lm.errors import PluginError
from forge_lm.model.init import initialize


class ScaleNorm(nn.Module):  # a norm by name, as Hugging Face's LlamaRMSNorm is
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))


class NormGate(nn.Module):  # "Norm" inside the name, not a norm: a gate matrix, set by no default rule
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dim))


class Holder(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer


@pytest.mark.parametrize(
    ("layer", "is_norm"),
    [
        (nn.LayerNorm(8), True),
        (nn.RMSNorm(8), True),
        (nn.GroupNorm(2, 8), True),
        (ScaleNorm(8), True),
        (nn.Linear(8, 8, bias=False), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, nn.Module) else str(value),
)
def test_initialisation_and_roles_agree_on_what_a_norm_is(layer, is_norm):
    model = Holder(layer)
    initialize(model, seed=0, std=0.02)
    weight = model.layer.weight
    assert is_norm_layer(layer) is is_norm
    assert torch.equal(weight, torch.ones_like(weight)) is is_norm  # a norm's scale starts at 1, a matrix does not
    assert (parameter_roles(model)["layer.weight"] == "norm") is is_norm


def test_a_module_with_norm_inside_its_name_is_a_matrix_to_both():
    model = Holder(NormGate(8))
    assert not is_norm_layer(model.layer)
    assert parameter_roles(model)["layer.weight"] == "matrix"
    with pytest.raises(PluginError, match=r"no initialisation rule set layer\.weight"):  # not silently 1
        initialize(model, seed=0, std=0.02)
