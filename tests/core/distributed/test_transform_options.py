"""Typed options of model transforms: ``[transforms.<name>]`` reaches that transform's factory."""

from __future__ import annotations

import tomllib

import attrs
import pytest
import torch

from forge_lm import hookimpl
from forge_lm.config import load_config, to_toml
from forge_lm.distributed import ModelTransform, ParallelDims, TransformContext, apply_model_transforms
from forge_lm.errors import ConfigError
from forge_lm.model import build_model
from forge_lm.validators import positive


@attrs.define
class ScaleOptions:
    enabled: bool = False
    factor: float = attrs.field(default=1.0, validator=positive)


class _ScalePlugin:
    """A transform that multiplies the output head's weight by ``factor`` when enabled."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self) -> None:
        self.built_with: list[ScaleOptions] = []

    @hookimpl
    def forge_lm_register_model_transforms(self, register):
        def build(options):
            self.built_with.append(options)

            def apply(model, context):
                with torch.no_grad():
                    model.output.weight.mul_(options.factor)

            return ModelTransform(slot="float8", enabled=lambda context: options.enabled, apply=apply)

        register("scale", build, config=ScaleOptions, description="scales the head (a test transform)")


@pytest.fixture
def scale(manager):
    plugin = _ScalePlugin()
    manager.add_plugin(plugin, "scale")
    return plugin


def configured(manager, *overrides, text=None, tmp_path=None):
    path = None
    if text is not None:
        path = tmp_path / "run.toml"
        path.write_text(text)
    base = ["--model.dim=32", "--model.n_layers=1", "--model.tie_embeddings=false"]
    return load_config(path, [*base, *overrides], manager.registry)


def test_a_transform_gets_its_table_and_others_their_defaults(manager, scale, tmp_path):
    config = configured(manager, text="[transforms.scale]\nenabled = true\nfactor = 2.5\n", tmp_path=tmp_path)
    torch.manual_seed(0)
    model = build_model(config.model, 64, manager.registry)
    before = model.output.weight.detach().clone()
    applied = apply_model_transforms(
        model, TransformContext(config, ParallelDims(), None, torch.device("cpu"), None), manager.registry
    )
    assert applied == ["scale"]
    assert scale.built_with == [ScaleOptions(enabled=True, factor=2.5)]
    torch.testing.assert_close(model.output.weight, before * 2.5)


def test_without_a_table_the_transform_is_built_with_its_defaults_and_stays_off(manager, scale):
    config = configured(manager)
    assert config.transforms == {}
    model = build_model(config.model, 64, manager.registry)
    context = TransformContext(config, ParallelDims(), None, torch.device("cpu"), None)
    assert apply_model_transforms(model, context, manager.registry) == []
    assert scale.built_with == [ScaleOptions()]


def test_overrides_reach_the_table_and_the_dump_round_trips(manager, scale, tmp_path):
    config = configured(manager, "--transforms.scale.enabled=true", "--transforms.scale.factor=3")
    assert config.transforms["scale"].options == ScaleOptions(enabled=True, factor=3.0)
    dumped = to_toml(config)
    assert tomllib.loads(dumped)["transforms"] == {"scale": {"enabled": True, "factor": 3.0}}
    (tmp_path / "config.toml").write_text(dumped)
    assert load_config(tmp_path / "config.toml", [], manager.registry) == config


def test_a_config_without_transform_tables_dumps_no_transforms_section(manager):
    assert "transforms" not in tomllib.loads(to_toml(configured(manager)))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "--transforms.scal.enabled=true",
            r"\[transforms.scal\]: unknown model transform 'scal'. Did you mean 'scale'\?",
        ),
        ("--transforms.scale.factr=2", r"\[transforms.scale\] factr: unknown key for model transform 'scale'"),
        ("--transforms.scale.factor=-1", r"\[transforms.scale\] factor: "),
        ("--transforms.scale=3", r"\[transforms.scale\] must be a table of the model transform's options"),
    ],
)
def test_mistakes_name_the_table(manager, scale, override, message):
    with pytest.raises(ConfigError, match=message):
        configured(manager, override)
