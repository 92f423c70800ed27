"""Built-in metrics backends."""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_metrics_backends(register):
    register(
        "console",
        "forge_lm.metrics.console:build_console",
        config="forge_lm.default_plugins.options.metrics:ConsoleOptions",
        description="Live progress display on a terminal; one line per logged step otherwise",
    )
    register(
        "jsonl",
        "forge_lm.metrics.jsonl:build_jsonl",
        config="forge_lm.default_plugins.options.metrics:JsonlOptions",
        description="One JSON object per logged step, appended to a file in the run directory",
    )
    register(
        "tensorboard",
        "forge_lm.metrics.tensorboard:build_tensorboard",
        config="forge_lm.default_plugins.options.metrics:TensorboardOptions",
        description="TensorBoard scalars in the run directory (pip install forge-lm[tensorboard])",
    )
