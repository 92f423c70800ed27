"""Typed, layered run configs: defaults, a TOML file, then ``--section.key=value`` overrides."""

from forge_lm.config._converter import CliValue, converter
from forge_lm.config._dump import to_data, to_toml
from forge_lm.config._load import (
    load_config,
    merge,
    parse_overrides,
    read_toml,
    structure_config,
    structure_options,
)
from forge_lm.config._schema import (
    ComponentConfig,
    ForgeConfig,
    MetricsSection,
    ModelSection,
    RunSection,
    TrainSection,
    component,
    components,
)

__all__ = [
    "CliValue",
    "ComponentConfig",
    "ForgeConfig",
    "MetricsSection",
    "ModelSection",
    "RunSection",
    "TrainSection",
    "component",
    "components",
    "converter",
    "load_config",
    "merge",
    "parse_overrides",
    "read_toml",
    "structure_config",
    "structure_options",
    "to_data",
    "to_toml",
]
