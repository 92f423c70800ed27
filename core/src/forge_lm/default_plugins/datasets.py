"""Built-in datasets.

Each factory is named by a ``"module:function"`` string, imported only when the dataset is built,
and each options class by its path in :mod:`forge_lm.default_plugins.options.datasets`.
"""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_datasets(register):
    register(
        "python_stdlib",
        "forge_lm.data.stdlib:build_python_stdlib",
        config="forge_lm.default_plugins.options.datasets:PythonStdlibOptions",
        description="Source of Python's own standard library as text: the default corpus, on every machine",
    )
    register(
        "memmap",
        "forge_lm.data.memmap:build_memmap",
        config="forge_lm.default_plugins.options.datasets:MemmapOptions",
        description="Pre-tokenized shards (.bin with .json metadata, or .npy), memory-mapped",
    )
    register(
        "hf_text",
        "forge_lm.data.hf_text:build_hf_text",
        config="forge_lm.default_plugins.options.datasets:HfTextOptions",
        description="Local text, JSON-lines or Parquet files read with Hugging Face datasets, in memory or streamed "
        "(pip install forge-lm[hf])",
    )
    register(
        "mixture",
        "forge_lm.data.mixture:build_mixture",
        config="forge_lm.default_plugins.options.datasets:MixtureOptions",
        description="Samples from several datasets by (temperature-scaled, phased) weights",
    )
    register(
        "synthetic",
        "forge_lm.data.synthetic:build_synthetic",
        description="Random token sequences, reproducible from (seed, sample index); for smoke tests",
    )
