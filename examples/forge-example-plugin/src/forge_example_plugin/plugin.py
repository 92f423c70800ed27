"""The plugin module Forge imports to list and register this plugin's components.

Keep it light: options classes and registration hooks only. Torch is imported by the
implementation modules, which the factory strings name and Forge imports only when a run
builds the component.
"""

from __future__ import annotations

import attrs

from forge_lm import hookimpl
from forge_lm.validators import fraction

FORGE_LM_PLUGIN_API = ">=1,<2"  # the plugin API versions this plugin is written for


@attrs.define
class SmoothedCrossEntropyOptions:
    smoothing: float = attrs.field(default=0.1, validator=fraction)  # probability mass spread over the vocabulary


@attrs.define
class CsvOptions:
    filename: str = "metrics.csv"  # inside the run directory


@hookimpl
def forge_lm_register_losses(register):
    register(
        "smoothed_cross_entropy",
        "forge_example_plugin.losses:build_smoothed_cross_entropy",
        config=SmoothedCrossEntropyOptions,
        description="Cross-entropy with label smoothing",
    )


@hookimpl
def forge_lm_register_metrics_backends(register):
    register(
        "csv",
        "forge_example_plugin.csv_backend:build_csv",
        config=CsvOptions,
        description="Metrics as step,name,value rows in a CSV file",
    )
