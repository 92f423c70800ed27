"""Built-in datasets and their options.

Options classes live here (no torch, numpy or ``datasets`` import), but for the mixture's, which
name component tables and so the config schema (:mod:`forge_lm.default_plugins.mixture_options`,
named by import path); each factory is named by a ``"module:function"`` string, imported only
when the dataset is built.
"""

from __future__ import annotations

from typing import Any

import attrs

from forge_lm.hookspecs import hookimpl
from forge_lm.validators import FieldError, non_negative, one_of

FORGE_LM_PLUGIN_API = ">=1,<2"


def held_out_fraction(instance: Any, attribute: Any, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise FieldError(attribute.name, f"must be at least 0 and below 1, got {value!r}")


def _eval_fraction(default: float) -> Any:
    return attrs.field(default=default, validator=held_out_fraction)


@attrs.define
class PythonStdlibOptions:
    eval_fraction: float = _eval_fraction(0.05)  # share of modules held out for the eval split


@attrs.define
class MemmapOptions:
    path: str  # a .bin/.npy shard, a directory of shards, or a glob ("data/*.bin")
    eval_fraction: float = _eval_fraction(0.01)  # share of windows held out, spread through the data


@attrs.define
class HfTextOptions:
    path: str | None = None  # a file, a directory of files, or a glob ("corpus/**/*.jsonl")
    # Instead of path: a dataset on the Hugging Face Hub by id ("HuggingFaceFW/fineweb-edu"). Needs
    # network, or the dataset already in the datasets library's cache with HF_HUB_OFFLINE=1; a token
    # for a gated dataset comes from the environment (HF_TOKEN) or `hf auth login`, never the config.
    dataset: str | None = None
    dataset_config: str | None = None  # the Hub dataset's configuration ("sample-10BT"); unset = its default
    hub_split: str = "train"  # the Hub dataset's split to read (eval_fraction holds out part of it)
    revision: str | None = None  # a Hub branch, tag or commit: pin it, so a resume reads the same rows
    format: str = attrs.field(default="text", validator=one_of("text", "json", "jsonl", "parquet"))
    text_field: str = "text"  # json/jsonl/parquet: the field holding each document's text
    sample_by: str = attrs.field(  # text: one document per file, per paragraph or per line
        default="document", validator=one_of("document", "paragraph", "line")
    )
    eval_fraction: float = _eval_fraction(0.01)  # share of documents held out
    cache_dir: str | None = None  # the datasets library's cache; unset = its default (not used when streaming)
    streaming: bool = False  # read the files as a stream, tokenizing on the fly: no corpus held in memory
    # streaming, train split: windows shuffled in blocks of this many, held in memory (0 = file order)
    shuffle_buffer: int = attrs.field(default=0, validator=non_negative)

    def __attrs_post_init__(self) -> None:
        if (self.path is None) == (self.dataset is None):
            raise FieldError(
                "path" if self.path is None else "dataset",
                'hf_text reads local files (path) or a Hugging Face Hub dataset (dataset = "org/name"): set '
                "exactly one",
            )
        if (self.dataset is not None and self.dataset.count("/") > 1) or self.dataset == "":
            raise FieldError("dataset", f"must be a Hub id such as 'org/name', got {self.dataset!r}")
        if self.shuffle_buffer and not self.streaming:
            raise FieldError(
                "shuffle_buffer",
                "applies to streaming = true only (without streaming every window is shuffled already); "
                "set streaming = true or remove it",
            )


@hookimpl
def forge_lm_register_datasets(register):
    register(
        "python_stdlib",
        "forge_lm.data.stdlib:build_python_stdlib",
        config=PythonStdlibOptions,
        description="Source of Python's own standard library as text: the default corpus, on every machine",
    )
    register(
        "memmap",
        "forge_lm.data.memmap:build_memmap",
        config=MemmapOptions,
        description="Pre-tokenized shards (.bin with .json metadata, or .npy), memory-mapped",
    )
    register(
        "hf_text",
        "forge_lm.data.hf_text:build_hf_text",
        config=HfTextOptions,
        description="Local text, JSON-lines or Parquet files read with Hugging Face datasets, in memory or streamed "
        "(pip install forge-lm[hf])",
    )
    register(
        "mixture",
        "forge_lm.data.mixture:build_mixture",
        config="forge_lm.default_plugins.mixture_options:MixtureOptions",
        description="Samples from several datasets by (temperature-scaled, phased) weights",
    )
    register(
        "synthetic",
        "forge_lm.data.synthetic:build_synthetic",
        description="Random token sequences, reproducible from (seed, sample index); for smoke tests",
    )
