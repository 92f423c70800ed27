"""Built-in metrics backends."""

from __future__ import annotations

import attrs

from forge_lm.hookspecs import hookimpl
from forge_lm.validators import positive

FORGE_LM_PLUGIN_API = ">=1,<2"


@attrs.define
class ConsoleOptions:
    digits: int = attrs.field(default=4, validator=positive)  # significant digits per value


@attrs.define
class JsonlOptions:
    filename: str = "metrics.jsonl"  # inside the run directory


@hookimpl
def forge_lm_register_metrics_backends(register):
    register(
        "console",
        "forge_lm.metrics.console:build_console",
        config=ConsoleOptions,
        description="One line per logged step on standard output",
    )
    register(
        "jsonl",
        "forge_lm.metrics.jsonl:build_jsonl",
        config=JsonlOptions,
        description="One JSON object per logged step, appended to a file in the run directory",
    )
