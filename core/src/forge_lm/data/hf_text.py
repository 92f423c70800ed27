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

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forge_lm.components import DataContext
from forge_lm.data.hf_corpus import (
    corpus_files,
    corpus_name,
    first_bad_line,
    import_datasets,
    load_hub,
    reader,
    text_field,
    unreadable,
)
from forge_lm.data.packing import TokenStream, check_tokenizer, pack_documents
from forge_lm.data.splits import held_out_rule
from forge_lm.data.streaming import StreamingTextDataset
from forge_lm.data.windows import WindowDataset
from forge_lm.errors import ConfigError, ForgeError


def load_rows(options: Any) -> Any:
    """The rows of the files ``options.path`` names (or of the Hub dataset), as a ``datasets.Dataset``."""
    datasets = import_datasets()
    if options.dataset is not None:
        rows = load_hub(datasets, options, streaming=False)
        if options.text_field not in rows.column_names:
            raise ConfigError(
                f"dataset 'hf_text': the rows of '{options.dataset}' have no field '{options.text_field}'; set "
                f"text_field to one of {', '.join(repr(c) for c in rows.column_names)}."
            )
        return rows
    files = [str(path) for path in corpus_files(options)]
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
        datasets = import_datasets()
        files = [] if options.dataset is not None else corpus_files(options)
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
