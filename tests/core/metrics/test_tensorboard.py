"""The 'tensorboard' backend: every logged value as a float64 scalar, read back by TensorBoard's reader."""

from __future__ import annotations

import json
import math
import sys

import pytest
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.util import tensor_util

from forge_lm.components import MetricsContext
from forge_lm.config import structure_options
from forge_lm.errors import ConfigError, PluginError
from forge_lm.metrics.tensorboard import read_scalars
from forge_lm.plugins import PluginManager, PluginSettings

MANIFEST = [{"name": "core.metrics", "distribution": "forge-lm", "version": "0.1.0"}]


@pytest.fixture(scope="module")
def manager() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False))


def build(manager, run_dir, **table):
    component = manager.registry.resolve("metrics_backends", "tensorboard")
    options = structure_options(manager.registry, component, table, "metrics.tensorboard")
    return component.build(options, MetricsContext(run_dir=run_dir, run_name="tb", total_steps=10))


def text_of(log_dir, tag: str) -> str:
    """A text summary, read independently of the backend's reader."""
    accumulator = plugin_event_accumulator.EventAccumulator(str(log_dir))
    accumulator.Reload()
    (event,) = accumulator.Tensors(f"{tag}/text_summary")
    return tensor_util.make_ndarray(event.tensor_proto).item().decode()


def test_scalars_come_back_exactly_per_step_including_nan_and_inf(manager, tmp_path):
    backend = build(manager, tmp_path)
    logged = [
        (1, {"loss": 3.141592653589793, "lr": 1e-4}),
        (2, {"loss": float("inf"), "lr": 2e-4, "grad_norm": 0.1}),
        (10, {"loss": float("nan"), "lr": 3.3e-4}),
    ]

    backend.start({"run": {"name": "tb"}}, MANIFEST)
    for step, metrics in logged:
        backend.log(step, metrics)
    backend.finish({"final_loss": 2.5})
    recorded = read_scalars(tmp_path / "tensorboard")

    assert [step for step, _ in recorded] == [1, 2, 10]
    for (_, sent), (_, got) in zip(logged, recorded, strict=True):
        assert got.keys() == sent.keys()
        for key, value in sent.items():
            assert got[key] == value or (math.isnan(value) and math.isnan(got[key]))  # float64: no rounding


def test_subdir_option_chooses_the_folder_inside_the_run_directory(manager, tmp_path):
    backend = build(manager, tmp_path, subdir="logs/tb")

    backend.start({}, MANIFEST)
    backend.log(3, {"loss": 1.5})
    backend.finish({})

    assert read_scalars(tmp_path / "logs" / "tb") == [(3, {"loss": 1.5})]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]


def test_config_plugins_and_summary_are_stored_as_text(manager, tmp_path):
    config = {"model": {"dim": 64}, "optimizer": {"name": "adamw", "lr": 0.001}}
    backend = build(manager, tmp_path)

    backend.start(config, MANIFEST)
    backend.finish({"final_loss": 2.5, "tokens": 4096})
    log_dir = tmp_path / "tensorboard"

    config_text = text_of(log_dir, "config")
    assert json.loads("\n".join(line.removeprefix("    ") for line in config_text.splitlines())) == config
    assert text_of(log_dir, "plugins") == "- core.metrics (forge-lm 0.1.0)"
    assert text_of(log_dir, "summary") == "| metric | value |\n| --- | --- |\n| final_loss | 2.5 |\n| tokens | 4096 |"


@pytest.mark.parametrize("subdir", ["/tmp/elsewhere", "../sibling", "a/../../b", ""])
def test_subdir_outside_the_run_directory_is_refused(manager, subdir):
    component = manager.registry.resolve("metrics_backends", "tensorboard")

    with pytest.raises(ConfigError, match=r"\[metrics.tensorboard\] subdir: must be a folder inside the run directory"):
        structure_options(manager.registry, component, {"subdir": subdir}, "metrics.tensorboard")


def test_without_tensorboard_building_fails_naming_the_extra(manager, tmp_path, monkeypatch):
    # What absent packages look like to import, even after an earlier test imported them.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)

    with pytest.raises(PluginError, match=r"`pip install forge-lm\[tensorboard\]`, or remove 'tensorboard' from"):
        build(manager, tmp_path)
