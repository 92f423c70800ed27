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
    CheckpointSection,
    ComponentConfig,
    DistributedSection,
    EvalSection,
    ForgeConfig,
    LlamaOptions,
    MetricsSection,
    ModelSection,
    ProfilingSection,
    ResilienceSection,
    SwiGLUOptions,
    TrainSection,
    component,
    component_array,
    components,
    model_options,
)

__all__ = [
    "CheckpointSection",
    "CliValue",
    "ComponentConfig",
    "DistributedSection",
    "EvalSection",
    "ForgeConfig",
    "LlamaOptions",
    "MetricsSection",
    "ModelSection",
    "ProfilingSection",
    "ResilienceSection",
    "SwiGLUOptions",
    "TrainSection",
    "component",
    "component_array",
    "components",
    "converter",
    "load_config",
    "merge",
    "model_options",
    "parse_overrides",
    "read_toml",
    "structure_config",
    "structure_options",
    "to_data",
    "to_toml",
]
