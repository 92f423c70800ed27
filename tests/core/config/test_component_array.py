"""Arrays of component tables: a ``component_array`` field of an options class.

A component that composes others (a data mixture) declares ``sources: list =
component_array("datasets", ...)``; the config then holds ``[[data.sources]]`` tables, each
selecting its own component by ``name`` with that component's own typed options.
"""

from __future__ import annotations

import attrs
import pytest

from forge_lm.config import ComponentConfig, component_array, load_config, to_toml
from forge_lm.plugins import NoOptions, PluginStatus


@attrs.define
class MixtureOptions:
    sources: list = component_array("datasets", "Datasets to mix, each with its own options.")
    temperature: float = 1.0


@attrs.define
class ShardOptions:
    path: str  # required: no default
    weight: float = 1.0


class MixturePlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def forge_lm_register_datasets(self, register):
        register("toy_mixture", "fake_mixture:build", config=MixtureOptions, description="A mixture of datasets")
        register("toy_shard", "fake_mixture:build_shard", config=ShardOptions, description="One shard file")


@pytest.fixture
def with_mixture(builtins):
    info = builtins.add_plugin(MixturePlugin(), "toy_mixture")
    assert info.status is PluginStatus.OK, info.reason
    return builtins


MIXTURE_TOML = """
[data]
name = "toy_mixture"
temperature = 0.5

[[data.sources]]
name = "toy_shard"
path = "a.bin"
weight = 2.0

[[data.sources]]
name = "synthetic"
"""


def test_each_table_of_the_array_is_structured_into_a_component_with_its_own_options(with_mixture, load):
    data = load(MIXTURE_TOML).data
    assert data == ComponentConfig(
        "toy_mixture",
        MixtureOptions(
            sources=[
                ComponentConfig("toy_shard", ShardOptions(path="a.bin", weight=2.0)),
                ComponentConfig("synthetic", NoOptions()),
            ],
            temperature=0.5,
        ),
    )


def test_a_component_array_absent_from_the_file_is_an_empty_list(with_mixture, load):
    assert load(None, "--data.name=toy_mixture").data.options == MixtureOptions(sources=[])


def test_an_unknown_key_inside_one_table_of_the_array_names_the_table_by_its_index(with_mixture, error):
    message = error(
        """
        [data]
        name = "toy_mixture"

        [[data.sources]]
        name = "toy_shard"
        path = "a.bin"

        [[data.sources]]
        name = "toy_shard"
        path = "b.bin"
        weigth = 3.0
        """
    )
    assert message == (
        "[data.sources[1]] weigth: unknown key for dataset 'toy_shard'. Did you mean 'weight'? "
        "Valid keys: 'path', 'weight'."
    )


def test_a_component_array_round_trips_through_toml(with_mixture, load, tmp_path):
    config = load(MIXTURE_TOML)
    path = tmp_path / "dumped.toml"
    path.write_text(to_toml(config), encoding="utf-8")
    assert load_config(path, [], with_mixture.registry) == config
