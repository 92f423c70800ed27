"""``[checkpoint.growth]``: ``init_from`` weights into a larger ``[model]``. A function-preserving
growth is checked against the small model's own forward on the new run's first batch (the loss
the ``source`` fixture computes), not against the growth code."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from forge_lm.cli._main import main as forge_main
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.model.transformer import build_model
from forge_lm.train import train
from forge_lm.train.growth import grow, residual_projections

from .conftest import TINY
from .test_init_from import VOCAB, _config, source  # noqa: F401 - the 2-layer source run, shared

WIDER = "--model.ffn.hidden_multiplier=5"  # SwiGLU hidden 192 instead of the source's 128


def _grown_run(manager, run_dir, source_dir, *overrides):
    config = _config(manager, run_dir, "--train.max_steps=1", f"--checkpoint.init_from={source_dir}", *overrides)
    result = train(config, manager)
    assert (result.status, result.steps) == ("completed", 1)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (grown,) = [event for event in events if event["type"] == "init_from"]
    return read_metrics(run_dir / "metrics.jsonl")[0]["loss"], {t["name"]: t for t in grown["tensors"]}


def test_zero_depth_growth_computes_what_the_small_model_did(source, manager, tmp_path, capsys):  # noqa: F811
    run_dir, _, expected = source
    loss, tensors = _grown_run(
        manager, tmp_path / "deep", run_dir, "--model.n_layers=4", "--checkpoint.growth.depth=zero"
    )
    assert loss == pytest.approx(expected, abs=1e-5)
    # 2 layers into 4: new layer j takes source layer j * 2 // 4; layers 1 and 3 are the new copies.
    assert tensors["layers.2.attention.wq.weight"] == {
        "name": "layers.2.attention.wq.weight",
        "how": "copied",
        "source": "layers.1.attention.wq.weight",
        "shape": [32, 32],
        "note": "",
    }
    assert (tensors["layers.3.attention.wq.weight"]["how"], tensors["layers.3.attention.wq.weight"]["note"]) == (
        "new",
        "copy of layers.1.attention.wq.weight",
    )
    for name in ("layers.1.attention.wo.weight", "layers.3.feed_forward.w2.weight"):
        assert (tensors[name]["how"], tensors[name]["note"]) == ("new", "zeros")
    assert tensors["tok_embeddings.weight"]["how"] == "copied"
    table = capsys.readouterr().err
    assert "grew" in table
    assert re.search(r"layers\.1\.attention\.wo\.weight +\[32, 32\] +\[32, 32\] +new \(zeros\)", table)


def test_wider_feed_forward_and_zero_depth_together_compute_what_the_small_model_did(
    source,  # noqa: F811
    manager,
    tmp_path,
):
    run_dir, _, expected = source
    overrides = ("--model.n_layers=3", "--checkpoint.growth.depth=zero", WIDER, "--checkpoint.growth.width=preserve")
    loss, tensors = _grown_run(manager, tmp_path / "wide", run_dir, *overrides)
    assert loss == pytest.approx(expected, abs=1e-5)
    w1 = tensors["layers.2.feed_forward.w1.weight"]
    assert (w1["how"], w1["source"], w1["shape"]) == ("grown", "layers.1.feed_forward.w1.weight", [192, 32])
    assert tensors["layers.1.feed_forward.w2.weight"]["how"] == "new"  # 3 layers: layer 1 copies layer 0


def test_copy_depth_makes_new_layers_exact_copies_of_their_neighbours(source, manager, tmp_path):  # noqa: F811
    _, small, _ = source
    config = _config(manager, tmp_path / "unused", "--model.n_layers=3", "--checkpoint.growth.depth=copy")
    model = build_model(config.model, VOCAB, manager.registry, seed=0)
    fresh = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    weights = small.state_dict()
    grown = grow(weights, model, get_model_state_dict(model), config.checkpoint.growth, 0, "small").weights
    for name, value in grown.items():
        if name.startswith("layers."):
            index, rest = name.split(".", 2)[1:]
            mapped = {"0": "0", "1": "0", "2": "1"}[index]
            assert torch.equal(value, weights[f"layers.{mapped}.{rest}"]), name
        else:
            assert torch.equal(value, weights[name]), name
    assert not torch.equal(grown["layers.1.attention.wo.weight"], fresh["layers.1.attention.wo.weight"])


def test_the_residual_projections_are_those_the_modules_draw_with_residual_std(manager, tmp_path):
    config = _config(manager, tmp_path / "unused")
    model = build_model(config.model, VOCAB, manager.registry, seed=0)
    expected = {f"layers.{i}.{name}.weight" for i in range(2) for name in ("attention.wo", "feed_forward.w2")}
    assert residual_projections(model) == expected


def test_more_layers_without_a_depth_rule_are_refused_with_exit_2_naming_them(source, tmp_path, capsys):  # noqa: F811
    run_dir, _, _ = source
    out = tmp_path / "new"
    code = forge_main(
        ["train", *TINY, f"--train.output_dir={out}", "--model.n_layers=4", f"--checkpoint.init_from={run_dir}"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "has 2 layers but this run's [model] has 4, so layers layers.2, layers.3 have no weights" in err
    assert "[checkpoint.growth] depth = 'zero'" in err
    assert not out.exists()


def test_a_wider_feed_forward_without_the_width_rule_is_refused_naming_the_tensors(source, manager, tmp_path):  # noqa: F811
    run_dir, _, _ = source
    config = _config(manager, tmp_path / "new", WIDER, f"--checkpoint.init_from={run_dir}")
    with pytest.raises(
        ConfigError,
        match=r"'layers\.0\.feed_forward\.w1\.weight' is \[128, 32\] in the source but "
        r"\[192, 32\] here \(set \[checkpoint\.growth\] width = 'preserve'",
    ):
        train(config, manager)
    assert not (tmp_path / "new").exists()


def test_a_wider_residual_stream_is_refused_even_with_the_width_rule(source, manager, tmp_path):  # noqa: F811
    _, small, _ = source
    config = _config(manager, tmp_path / "unused", "--model.dim=64", "--checkpoint.growth.width=preserve")
    model = build_model(config.model, VOCAB, manager.registry, seed=0)
    with pytest.raises(
        ConfigError, match=r"'tok_embeddings\.weight' is \[257, 32\] in the source but \[257, 64\] here"
    ):
        grow(small.state_dict(), model, get_model_state_dict(model), config.checkpoint.growth, 0, "small")


def test_depth_zero_is_refused_where_a_layer_declares_no_residual_projection(source, manager, tmp_path, monkeypatch):  # noqa: F811
    run_dir, _, _ = source
    from forge_lm.model.swiglu import SwiGLU

    def without_residual_std(self, init):  # a plugin layer that draws its down projection with init.std
        for linear in (self.w1, self.w2, self.w3):
            init.normal(linear.weight, init.std)

    monkeypatch.setattr(SwiGLU, "init_weights", without_residual_std)
    overrides = ("--model.n_layers=3", "--checkpoint.growth.depth=zero", f"--checkpoint.init_from={run_dir}")
    with pytest.raises(ConfigError, match=r"the feed_forward of layers\.1 declares no projection into the residual"):
        train(_config(manager, tmp_path / "new", *overrides), manager)
    assert not (tmp_path / "new").exists()
