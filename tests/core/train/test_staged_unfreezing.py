"""Staged unfreezing: an adaptation transform freezes the embeddings for the first two steps
(forge_lm.model.freezing.freeze_until); the optimizer is built knowing them, they do not move
before step 3 and move from it on, and a resume before or after the unfreezing continues the
uninterrupted run bit for bit."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from forge_lm import hookimpl
from forge_lm.components import parameter_roles
from forge_lm.config import load_config
from forge_lm.distributed import ModelTransform
from forge_lm.errors import ConfigError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.model.freezing import follow_schedule, freeze_until, staged_parameters, staged_parameters_trainable
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train import train

FROZEN_STEPS = 2


@attrs.define
class UnfreezeOptions:
    steps: int = FROZEN_STEPS


class _StagedEmbeddings:
    """A plugin: the transform, and hooks that keep a copy of every parameter after each step."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}  # step -> parameters after it (0: as built)
        self.optimized: set[str] = set()

    @hookimpl
    def forge_lm_register_model_transforms(self, register):
        def build(options):
            def apply(model, context):
                embeddings = [name for name, role in parameter_roles(model).items() if role == "embedding"]
                freeze_until(model, embeddings, options.steps)

            return ModelTransform("adaptation", lambda context: True, apply)

        register("staged_embeddings", build, config=UnfreezeOptions, description="embeddings frozen at first")

    @hookimpl
    def forge_lm_train_start(self, context):
        if context.step == 0:
            self.weights[0] = _copy(context.model)
        ids = {id(p) for group in context.optimizer.param_groups for p in group["params"]}
        self.optimized = {name for name, p in context.model.named_parameters() if id(p) in ids}

    @hookimpl
    def forge_lm_step_end(self, context, step):
        self.weights[step] = _copy(context.model)


def _copy(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _run(tmp_path: Path, *overrides: str) -> tuple[Path, _StagedEmbeddings]:
    manager = PluginManager(PluginSettings(autoload=False))
    plugin = _StagedEmbeddings()
    manager.add_plugin(plugin, "staged")
    config = load_config(None, [*RUN, f"--train.output_dir={tmp_path}", *overrides], manager.registry)
    return train(config, manager).run_dir, plugin


# A constant rate: a run stopped after 2 or 3 steps (max_steps) is then the first steps of the
# 5-step run. Only the last step is checkpointed (interval 0).
RUN = (
    *TINY_MODEL,
    "--train.batch_size=4",
    "--train.seq_len=16",
    "--data.name=synthetic",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--train.max_steps=5",
    "--checkpoint.interval=0",
    "--scheduler.name=constant",
)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, _StagedEmbeddings]:
    """The uninterrupted run, shared by the tests."""
    return _run(tmp_path_factory.mktemp("straight") / "run")


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def test_frozen_embeddings_do_not_move_until_their_step_then_train(straight):
    _, staged = straight
    weights = staged.weights
    embedding = "tok_embeddings.weight"
    assert staged.optimized == set(weights[0])  # the optimizer was built with the frozen embeddings in it
    assert torch.equal(weights[1][embedding], weights[0][embedding])
    assert torch.equal(weights[2][embedding], weights[0][embedding])
    assert not torch.equal(weights[3][embedding], weights[2][embedding])  # trains from step 3
    assert not torch.equal(weights[4][embedding], weights[3][embedding])
    others = [name for name in weights[0] if name != embedding]
    assert all(not torch.equal(weights[1][name], weights[0][name]) for name in others)  # the rest trains at once


@pytest.mark.parametrize("stopped_at", [2, 3], ids=["before-unfreezing", "after-unfreezing"])
def test_a_resume_continues_the_uninterrupted_run_bitwise(straight, tmp_path, stopped_at):
    straight_dir, uninterrupted = straight
    _run(tmp_path / "run", f"--train.max_steps={stopped_at}")
    resumed_dir, resumed = _run(tmp_path / "run")

    assert set(resumed.weights) == set(range(stopped_at + 1, 6))  # it resumed at stopped_at
    assert _losses(resumed_dir) == _losses(straight_dir)
    for name, value in uninterrupted.weights[5].items():
        assert torch.equal(resumed.weights[5][name], value), name


def test_the_schedule_sets_what_trains_by_step_and_refuses_bad_input():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    freeze_until(model, ["0.weight"], 2)

    assert staged_parameters(model) == {"0.weight": 2}
    assert not model[0].weight.requires_grad
    with staged_parameters_trainable(model):
        assert model[0].weight.requires_grad
    assert not model[0].weight.requires_grad
    assert follow_schedule(model, 1) == []
    assert follow_schedule(model, 2) == ["0.weight"]
    assert model[0].weight.requires_grad
    assert follow_schedule(model, 0) == ["0.weight"]  # a rollback to before the unfreezing freezes again
    with pytest.raises(ConfigError, match=r"freeze_until: the model has no parameter 'embed.weight'"):
        freeze_until(model, ["embed.weight"], 2)
    with pytest.raises(ConfigError, match=r"steps must be a whole number >= 0, got -1"):
        freeze_until(model, ["0.weight"], -1)
