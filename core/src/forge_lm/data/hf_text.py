"""The ``hf_text`` dataset: local text or JSON-lines files, read with Hugging Face ``datasets``.

Rows are documents: with ``format = "text"`` a row is a whole file, a paragraph or a line
(``sample_by``); with ``"json"``/``"jsonl"`` a row is a JSON object whose ``text_field`` holds
the document. Rows are split by ``eval_fraction`` (spread through the files' order), and each
split is tokenized and packed into one token stream in memory, so the corpus must fit in
memory as tokens; for larger corpora run ``forge prepare-data`` and use the ``memmap``
dataset. ``datasets`` keeps its own cache of the parsed files (``cache_dir``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from forge_lm.components import DataContext
from forge_lm.data.files import resolve_files
from forge_lm.data.packing import TokenStream, check_tokenizer, pack_documents
from forge_lm.data.splits import held_out_rule
from forge_lm.data.windows import WindowDataset
from forge_lm.errors import ConfigError, ForgeError

SUFFIXES = {"text": (".txt", ".text", ".md"), "json": (".json", ".jsonl"), "jsonl": (".json", ".jsonl")}


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ForgeError(
            "dataset 'hf_text' needs the Hugging Face 'datasets' library, which is not installed: "
            "pip install forge-lm[hf]"
        ) from None
    return datasets


def load_rows(options: Any) -> Any:
    """The rows of the files ``options.path`` names, as a ``datasets.Dataset``."""
    datasets = _import_datasets()
    files = [str(path) for path in resolve_files(options.path, SUFFIXES[options.format], "hf_text")]
    if options.format == "text":
        builder, settings = "text", {"sample_by": options.sample_by, "keep_linebreaks": True}
    else:
        builder, settings = "json", {}
    try:
        rows = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=options.cache_dir, **settings)
    except Exception as exc:  # datasets raises many kinds for a malformed file; each means the same
        cause = exc.__cause__ or exc
        raise ForgeError(
            f"dataset 'hf_text' cannot read '{options.path}' as {options.format}: {type(cause).__name__}: {cause}"
        ) from exc
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


def build_hf_text(options: Any, context: DataContext) -> WindowDataset:
    tokenizer = check_tokenizer(context.tokenizer, context.vocab_size, "hf_text")
    rows = load_rows(options)
    field = "text" if options.format == "text" else options.text_field
    tokens = pack_documents(_documents(rows, field, options.eval_fraction, context.split), tokenizer)
    if context.split == "eval" and len(tokens) == 0:
        raise ConfigError(
            f"the eval split of dataset 'hf_text' ('{options.path}', {len(rows)} documents) is empty; raise "
            "eval_fraction or set [eval] interval = 0."
        )
    source = f"the {context.split} split of the hf_text data at '{options.path}'"
    return WindowDataset(TokenStream([tokens]), context, eos_id=tokenizer.eos_id, source=source)
