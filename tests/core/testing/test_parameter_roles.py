"""forge_lm.components.parameter_roles on Forge's own model, tied and untied, whole and split."""

from __future__ import annotations

import pytest
from torch import nn

from forge_lm.components import PARAMETER_ROLES, parameter_roles
from forge_lm.config import load_config
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager
from forge_lm.testing import TINY_MODEL

MANAGER = PluginManager()


def _model(tied: bool):
    config = load_config(
        None, [*TINY_MODEL, "--train.seq_len=16", f"--model.tie_embeddings={str(tied).lower()}"], MANAGER.registry
    )
    return build_model(config.model, 64, MANAGER.registry, seed=0)


@pytest.mark.parametrize("tied", [False, True])
def test_forge_model_parameters_get_their_roles(tied):
    model = _model(tied)
    roles = parameter_roles(model)
    assert list(roles) == [name for name, _ in model.named_parameters()]
    assert set(roles.values()) <= set(PARAMETER_ROLES)
    assert roles["tok_embeddings.weight"] == "embedding"
    assert roles["norm.weight"] == "norm"
    assert roles["layers.0.attention_norm.weight"] == roles["layers.1.ffn_norm.weight"] == "norm"
    assert roles["layers.0.attention.wq.weight"] == roles["layers.1.feed_forward.w2.weight"] == "matrix"
    if tied:  # one tensor: listed once, as the embedding
        assert "output.weight" not in roles
    else:
        assert roles["output.weight"] == "output"
    counts = {role: list(roles.values()).count(role) for role in PARAMETER_ROLES}
    assert counts == {"embedding": 1, "output": 0 if tied else 1, "norm": 5, "bias": 0, "matrix": 14}


def test_pipeline_stage_like_models_keep_the_roles_of_their_parameters():
    whole = parameter_roles(_model(False))
    first, last = _model(False), _model(False)
    first.norm, first.output = None, None  # what a first pipeline stage holds
    last.tok_embeddings = None
    del first.layers[1], last.layers[0]
    for stage in (first, last):
        for name, role in parameter_roles(stage).items():
            assert role == whole[name.replace("layers.0.", "layers.1.") if stage is last else name]


def test_biases_vectors_and_a_head_found_through_get_output_embeddings():
    class HFStyle(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 4)
            self.ln = nn.LayerNorm(4)
            self.gate = nn.Parameter(nn.init.ones_(nn.Parameter(nn.Linear(1, 1).bias.data)))
            self.lm_head = nn.Linear(4, 10)

        def get_output_embeddings(self):
            return self.lm_head

    assert parameter_roles(HFStyle()) == {
        "gate": "bias",
        "embed.weight": "embedding",
        "proj.weight": "matrix",
        "proj.bias": "bias",
        "ln.weight": "norm",
        "ln.bias": "norm",
        "lm_head.weight": "output",
        "lm_head.bias": "bias",
    }
