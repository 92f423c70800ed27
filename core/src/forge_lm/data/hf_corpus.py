"""Reading the ``hf_text`` corpus, shared by its in-memory (:mod:`forge_lm.data.hf_text`) and
streaming (:mod:`forge_lm.data.streaming`) forms: the ``datasets`` library, the builder for a
format, a Hub dataset by id, the text field, and the errors that name a bad file's line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from forge_lm.data.files import resolve_files
from forge_lm.errors import ConfigError, ForgeError

SUFFIXES = {
    "text": (".txt", ".text", ".md"),
    "json": (".json", ".jsonl"),
    "jsonl": (".json", ".jsonl"),
    "parquet": (".parquet",),
}


def import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ForgeError(
            "dataset 'hf_text' needs the Hugging Face 'datasets' library, which is not installed: "
            "pip install forge-lm[hf]"
        ) from None
    # The files are local: no request to the Hub's download counter at each file opened (the
    # streaming reader opens one per file and pass, and a host without network waits on each).
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


def corpus_files(options: Any) -> list[Path]:
    """The local files ``options.path`` names, of ``options.format``'s suffixes."""
    return resolve_files(options.path, SUFFIXES[options.format], "hf_text")


def reader(options: Any) -> tuple[str, dict[str, Any]]:
    """The ``datasets`` builder that reads ``options.format``, and its settings."""
    if options.format == "text":
        return "text", {"sample_by": options.sample_by, "keep_linebreaks": True}
    return ("parquet" if options.format == "parquet" else "json"), {}


def load_hub(datasets: Any, options: Any, *, streaming: bool) -> Any:
    """The ``split`` of the Hub dataset ``options.dataset`` (a ``Dataset``, or an
    ``IterableDataset`` when ``streaming``); a ConfigError naming the dataset and what loading it
    needs when it cannot be had."""
    try:
        return datasets.load_dataset(
            options.dataset,
            options.dataset_config,
            split=options.hub_split,
            revision=options.revision,
            cache_dir=options.cache_dir,
            streaming=streaming,
        )
    except Exception as exc:  # datasets raises its own kinds and the network's (ConnectionError, ...)
        offline = datasets.config.HF_HUB_OFFLINE
        reason = " ".join(str(exc).split())
        raise ConfigError(
            f"dataset 'hf_text' cannot load '{options.dataset}' (configuration {options.dataset_config or 'default'}, "
            f"split {options.hub_split!r}) from the Hugging Face Hub: {type(exc).__name__}: {reason}. "
            + (
                "Offline (HF_HUB_OFFLINE=1), a Hub dataset loads only from the datasets cache: load it once with "
                "network, or point cache_dir at a cache that holds it."
                if offline
                else "Loading by id needs network (and, for a gated dataset, HF_TOKEN); without it, download the "
                "files and set path instead."
            )
        ) from exc


def text_field(options: Any) -> str:
    """The field holding each row's text: ``text`` for text files, else ``text_field``."""
    return "text" if options.format == "text" and options.dataset is None else options.text_field


def corpus_name(options: Any) -> str:
    """The corpus as messages name it: the path, or the Hub dataset's id."""
    return options.path if options.dataset is None else f"hub:{options.dataset}"


def unreadable(path: Path, format: str, exc: BaseException, where: str | None = None) -> ForgeError:
    """The error for a file the reader failed on: ``where`` in it (:func:`first_bad_line`), else
    what the reader said."""
    cause = exc.__cause__ or exc
    return ForgeError(
        f"dataset 'hf_text' cannot read '{path}' as {format}: {where or f'{type(cause).__name__}: {cause}'}"
    )


def first_bad_line(path: Path, format: str) -> str | None:
    """The first line of ``path`` that is not UTF-8 (or, in a ``.jsonl`` file, not a JSON
    object), as "line N is ..."; None when there is none (the fault is elsewhere, or the file is
    Parquet). Run on failure only: Arrow's messages count rows within a block of the file, not
    its lines."""
    if format == "parquet":
        return None
    json_lines = path.suffix == ".jsonl"
    try:
        with path.open("rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    return f"line {number} is not UTF-8 text (byte {error.start + 1} of the line: {error.reason})"
                if not json_lines or not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as error:
                    return f"line {number} is not valid JSON ({error.msg}, column {error.colno})"
                except (ValueError, RecursionError) as error:  # nested too deeply, or a number too long
                    return f"line {number} is not valid JSON ({type(error).__name__})"
                if not isinstance(value, dict):
                    return f"line {number} holds a JSON {type(value).__name__}, not an object with a text field"
    except OSError as error:
        return f"{type(error).__name__}: {error}"
    return None
