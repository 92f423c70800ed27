"""Built-in datasets."""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_datasets(register):
    register(
        "synthetic",
        "forge_lm.data.synthetic:build_synthetic",
        description="Random token sequences, reproducible from (seed, sample index); for smoke tests",
    )
