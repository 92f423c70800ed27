"""The ``hf_text`` dataset: local text, JSON-lines or Parquet files, read with Hugging Face ``datasets``.

Rows are documents: with ``format = "text"`` a row is a whole file, a paragraph or a line
(``sample_by``); with ``"json"``/``"jsonl"``/``"parquet"`` a row is a record whose
``text_field`` holds the document. Rows are split by ``eval_fraction`` (spread through the
files' order), and each split is tokenized and packed into one token stream in memory, so the
corpus must fit in memory as tokens; ``datasets`` keeps its own cache of the parsed files
(``cache_dir``). For larger corpora, either run ``forge prepare-data`` and use the ``memmap``
dataset, or set ``streaming = true``: the files are then read as a stream and tokenized on the
fly (:mod:`forge_lm.data.streaming`), with the same rows, split and packing.

Instead of local files, ``dataset = "org/name"`` reads a dataset of the Hugging Face Hub by id
(its ``dataset_config``, ``hub_split`` and ``revision``), with or without ``streaming``, as users of
torchtitan and OLMo do. That needs network, or the dataset already in the ``datasets`` cache
(``cache_dir`` or ``HF_DATASETS_CACHE``) with ``HF_HUB_OFFLINE=1``; credentials for a gated
dataset come from the environment, never from the config. Its ``text_field`` holds the text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forge_lm.components import DataContext
from forge_lm.data.files import resolve_files
from forge_lm.data.packing import TokenStream, check_tokenizer, pack_documents
from forge_lm.data.splits import held_out_rule
from forge_lm.data.windows import WindowDataset
from forge_lm.errors import ConfigError, ForgeError

SUFFIXES = {
    "text": (".txt", ".text", ".md"),
    "json": (".json", ".jsonl"),
    "jsonl": (".json", ".jsonl"),
    "parquet": (".parquet",),
}


def _import_datasets() -> Any:
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


def load_rows(options: Any) -> Any:
    """The rows of the files ``options.path`` names (or of the Hub dataset), as a ``datasets.Dataset``."""
    datasets = _import_datasets()
    if options.dataset is not None:
        rows = load_hub(datasets, options, streaming=False)
        if options.text_field not in rows.column_names:
            raise ConfigError(
                f"dataset 'hf_text': the rows of '{options.dataset}' have no field '{options.text_field}'; set "
                f"text_field to one of {', '.join(repr(c) for c in rows.column_names)}."
            )
        return rows
    files = [str(path) for path in resolve_files(options.path, SUFFIXES[options.format], "hf_text")]
    builder, settings = reader(options)
    try:
        rows = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=options.cache_dir, **settings)
    except Exception as exc:  # datasets raises many kinds for a malformed file; each means the same
        # The error does not say which file: the first with a bad line is named, if one has.
        for file in map(Path, files):
            where = first_bad_line(file, options.format)
            if where is not None:
                raise unreadable(file, options.format, exc, where) from exc
        raise unreadable(Path(options.path), options.format, exc) from exc
    if options.format != "text" and options.text_field not in rows.column_names:
        raise ConfigError(
            f"dataset 'hf_text': the rows of '{options.path}' have no field '{options.text_field}'; set "
            f"text_field to one of {', '.join(repr(c) for c in rows.column_names)}."
        )
    return rows


def _documents(rows: Any, field: str, fraction: float, split: str) -> Iterator[str]:
    """The documents of ``split`` that are not blank: row ``k`` is held out by :func:`held_out_rule`."""
    is_held_out, index = held_out_rule(fraction), 0
    for batch in rows.iter(batch_size=1024):
        for text in batch[field]:
            if not isinstance(text, str):
                raise ForgeError(f"dataset 'hf_text': row {index} has {field} = {text!r}, not a string.")
            if text.strip() and is_held_out(index) == (split == "eval"):
                yield text
            index += 1


def build_hf_text(options: Any, context: DataContext) -> Any:
    if options.streaming:
        from forge_lm.data.streaming import StreamingTextDataset

        datasets = _import_datasets()
        files = [] if options.dataset is not None else resolve_files(options.path, SUFFIXES[options.format], "hf_text")
        return StreamingTextDataset(options, context, files, datasets)
    tokenizer = check_tokenizer(context.tokenizer, context.vocab_size, "hf_text")
    rows = load_rows(options)
    field = text_field(options)
    tokens = pack_documents(_documents(rows, field, options.eval_fraction, context.split), tokenizer)
    if len(tokens) == 0 and next(_documents(rows, field, 0.0, "train"), None) is None:  # no split: all of it
        raise ConfigError(
            f"dataset 'hf_text' ('{corpus_name(options)}') holds no text: its {len(rows)} rows are all blank (an empty "
            "file?); point path at the corpus, or fill it."
        )
    if context.split == "eval" and len(tokens) == 0:
        raise ConfigError(
            f"the eval split of dataset 'hf_text' ('{corpus_name(options)}', {len(rows)} documents) is empty; raise "
            "eval_fraction or set [eval] interval = 0."
        )
    source = f"the {context.split} split of the hf_text data at '{corpus_name(options)}'"
    return WindowDataset(TokenStream([tokens]), context, eos_id=tokenizer.eos_id, source=source)


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
