"""The ``memmap`` dataset: pre-tokenized shards (``.bin`` + metadata, or ``.npy``) on disk.

The shards, in sorted order, are read as one token stream (windows may straddle two
shards). Eval windows are spread through the stream by ``eval_fraction``
(:mod:`forge_lm.data.splits`). Document boundaries come from the eos id that the shards'
metadata states, else from the run's tokenizer; with neither, every token is in one document.
"""

from __future__ import annotations

import json
from typing import Any

from forge_lm.components import DataContext
from forge_lm.data.files import resolve_files
from forge_lm.data.packing import TokenStream
from forge_lm.data.shards import Shard, open_shard
from forge_lm.data.windows import WindowDataset
from forge_lm.errors import ConfigError


def _stated(shards: list[Shard], key: str) -> Any:
    """The one value of metadata ``key`` across the shards (None if none states it)."""
    # Keyed by their JSON text, so that values of any JSON type (a dict too) can be compared.
    values = {
        json.dumps(s.metadata[key], sort_keys=True): s.metadata[key] for s in shards if s.metadata.get(key) is not None
    }
    if len(values) > 1:
        listing = ", ".join(f"'{s.path}': {s.metadata[key]}" for s in shards if s.metadata.get(key) is not None)
        raise ConfigError(f"the shards were made with different tokenizers ({key}: {listing}); use shards of one.")
    return next(iter(values.values())) if values else None


def check_tokenizer_agrees(shards: list[Shard], tokenizer: Any, path: str) -> int | None:
    """The eos id of the shards, after checking the run's tokenizer matches the metadata."""
    eos_id, vocab_size = _stated(shards, "eos_id"), _stated(shards, "vocab_size")
    if tokenizer is None:
        return eos_id
    for key, stated, ours in (("eos_id", eos_id, tokenizer.eos_id), ("vocab_size", vocab_size, tokenizer.vocab_size)):
        if stated is not None and stated != ours:
            made_with = _stated(shards, "tokenizer")
            raise ConfigError(
                f"the shards at '{path}' were tokenized with {key} = {stated}"
                + (f" (tokenizer {made_with})" if made_with else "")
                + f", but the run's tokenizer has {key} = {ours}. Set [tokenizer] to the one the data was "
                "prepared with, or prepare the data again with this tokenizer."
            )
    return tokenizer.eos_id if eos_id is None else eos_id


def build_memmap(options: Any, context: DataContext) -> WindowDataset:
    shards = [open_shard(path) for path in resolve_files(options.path, (".bin", ".npy"), "memmap")]
    eos_id = check_tokenizer_agrees(shards, context.tokenizer, options.path)
    vocab_size = _stated(shards, "vocab_size")
    if vocab_size is not None and vocab_size > context.vocab_size:
        raise ConfigError(
            f"the shards at '{options.path}' use a vocabulary of {vocab_size} ids but the model's has "
            f"{context.vocab_size}; set [model] vocab_size to at least {vocab_size}."
        )
    return WindowDataset(
        TokenStream([shard.tokens for shard in shards]),
        context,
        eos_id=eos_id,
        source=f"the memmap data at '{options.path}'",
        held_out=options.eval_fraction,
    )
