"""Options of the built-in datasets (:mod:`forge_lm.default_plugins.datasets`).

Named by import path at registration, so that listing plugins imports none of them, nor the
config schema the mixture's sources need (:func:`forge_lm.config.component_array`).
"""

from __future__ import annotations

from typing import Any

import attrs

from forge_lm.config import ComponentConfig, component_array
from forge_lm.validators import FieldError, non_negative, one_of, positive


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


def _check_weights(key: str, weights: list[float], count: int) -> None:
    if len(weights) != count:
        raise FieldError(key, f"has {len(weights)} weights for {count} sources; give one per [[data.sources]]")
    if any(weight < 0 for weight in weights) or not any(weight > 0 for weight in weights):
        raise FieldError(key, f"weights must be >= 0 with at least one > 0, got {weights}")


@attrs.define
class MixturePhase:
    until_sample: int = attrs.field(validator=positive)  # these weights hold for samples [previous, until)
    weights: list[float] = attrs.field(factory=list)


@attrs.define
class MixtureOptions:
    sources: list[ComponentConfig] = component_array(
        "datasets", "The mixed datasets: [[data.sources]] tables, each with its own name and options."
    )
    weights: list[float] = attrs.field(factory=list)  # one per source; empty = equal
    temperature: float = attrs.field(default=1.0, validator=positive)  # p ~ weight ** (1 / temperature)
    phases: list[MixturePhase] = attrs.field(factory=list)  # earlier weights; `weights` apply after the last

    def __attrs_post_init__(self) -> None:
        if not self.sources:
            raise FieldError("sources", "a mixture needs at least one source: add [[data.sources]] tables")
        if self.weights:
            _check_weights("weights", self.weights, len(self.sources))
        ends = [phase.until_sample for phase in self.phases]
        if ends != sorted(set(ends)):
            raise FieldError("phases", f"until_sample must increase from phase to phase, got {ends}")
        for index, phase in enumerate(self.phases):
            _check_weights(f"phases[{index}].weights", phase.weights, len(self.sources))
