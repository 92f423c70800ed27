"""The head is the module the model calls its head, not a matrix as wide as the vocabulary."""

from __future__ import annotations

import pytest

from forge_lm.config import ModelSection
from forge_lm.distributed.pipeline import keep_stage
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager
from forge_optim_muon.factory import assign_parameters

DIM = 64  # the vocabulary is as large as the width: every attention matrix has the head's shape


def _model():
    section = ModelSection(dim=DIM, n_layers=4, n_heads=4, tie_embeddings=False)
    return build_model(section, DIM, PluginManager().registry)


def _sides(model):
    return {a.name: (a.side, a.role) for a in assign_parameters(model)}


def test_whole_model_of_vocabulary_width_sends_only_the_head_and_embedding_to_adamw():
    sides = _sides(_model())
    assert sides["output.weight"] == ("adamw", "output head")
    assert sides["tok_embeddings.weight"] == ("adamw", "embedding")
    matrices = {name: side for name, side in sides.items() if name.startswith("layers.") and "norm" not in name}
    assert matrices
    assert set(matrices.values()) == {("muon", "hidden matrix")}


@pytest.mark.parametrize("stage", [0, 1])
def test_a_pipeline_stage_gives_each_parameter_the_role_it_has_in_the_whole_model(stage):
    whole = _sides(_model())
    part = _sides(keep_stage(_model(), stage, 2))
    assert part
    assert all(part[name] == whole[name] for name in part)
    hidden = [name for name in part if name.endswith(("wo.weight", "wv.weight", "wq.weight"))]
    assert hidden
    assert all(part[name] == ("muon", "hidden matrix") for name in hidden)
    if stage == 0:  # the embedding, no head: the last [vocab, dim] matrix here is a hidden one
        assert part["tok_embeddings.weight"] == ("adamw", "embedding")
        assert "output.weight" not in part
        model = keep_stage(_model(), stage, 2)
        wide = [f"{path}.weight" for path, m in model.named_modules() if getattr(m, "out_features", None) == DIM]
        assert part[wide[-1]] == ("muon", "hidden matrix")
    else:
        assert part["output.weight"] == ("adamw", "output head")
        assert "tok_embeddings.weight" not in part
