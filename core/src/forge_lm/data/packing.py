"""Documents to training windows: tokenize, end each with eos, concatenate, cut.

A token stream is the documents' tokens, each document followed by the tokenizer's
``eos_id``. Window ``k`` of a stream holds tokens ``[k * seq_len, k * seq_len + seq_len + 1)``:
consecutive windows overlap by one token so that every token after the first is a label
exactly once. A window gives one sample: ``input_ids = w[:-1]``, ``labels = w[1:]``.

``document_ids[t]`` counts the eos tokens among ``input_ids[:t + 1]``, minus the count at
``t = 0``. The eos that ends a document therefore opens the next document's segment, acting
as its beginning-of-text: under attention masked to equal document ids, the last token of a
document predicts eos from its own document, and eos predicts the next document's first
token from nothing but itself; no prediction sees across a document boundary. Every label
carries loss (the stream has no padding).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from forge_lm.data.shards import token_dtype
from forge_lm.errors import ConfigError, ForgeError


def check_tokenizer(tokenizer: Any, vocab_size: int, dataset: str) -> Any:
    """``tokenizer``, after checking that its ids fit the model's vocabulary."""
    if tokenizer is None:
        raise ConfigError(
            f"dataset '{dataset}' reads text and needs a tokenizer, but none was given "
            "(DataContext.tokenizer is None); build it with the run's [tokenizer]."
        )
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary has {vocab_size}; "
            f"set [model] vocab_size to at least {tokenizer.vocab_size} (or leave it unset)."
        )
    return tokenizer


def pack_documents(texts: Iterable[str], tokenizer: Any) -> np.ndarray:
    """The token stream of ``texts``: each one encoded and followed by ``eos_id``."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text))
        ids.append(tokenizer.eos_id)
    return np.array(ids, dtype=token_dtype(tokenizer.vocab_size))


def document_ids(input_ids: np.ndarray, eos_id: int | None) -> np.ndarray:
    """Which document each input token belongs to, numbered from 0 within the window (along the
    last axis: one window, or a batch of them)."""
    if eos_id is None:
        return np.zeros(input_ids.shape, dtype=np.int64)
    counts = np.cumsum(input_ids == eos_id, axis=-1, dtype=np.int64)
    return counts - counts[..., :1]


def window_sample(window: np.ndarray, eos_id: int | None) -> dict[str, torch.Tensor]:
    """The sample of one window of ``seq_len + 1`` tokens."""
    tokens = torch.from_numpy(np.array(window, dtype=np.int64))
    return {
        "input_ids": tokens[:-1],
        "labels": tokens[1:],
        "document_ids": torch.from_numpy(document_ids(window[:-1], eos_id)),
    }


def window_batch(windows: np.ndarray, eos_id: int | None) -> dict[str, torch.Tensor]:
    """The samples of ``windows`` (``[count, seq_len + 1]``, int64) stacked: what collating the
    :func:`window_sample` of each would give, in a few numpy operations for the whole batch."""
    inputs = np.ascontiguousarray(windows[:, :-1])
    return {
        "input_ids": torch.from_numpy(inputs),
        "labels": torch.from_numpy(np.ascontiguousarray(windows[:, 1:])),
        "document_ids": torch.from_numpy(document_ids(inputs, eos_id)),
    }


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many windows of ``seq_len + 1`` tokens, stride ``seq_len``, a stream holds."""
    return max(0, (num_tokens - 1) // seq_len)


class TokenStream:
    """Several 1-D token arrays (shards, possibly memory-mapped) read as one stream."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = [part for part in parts if len(part)]
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + len(part))

    def __len__(self) -> int:
        return self.starts[-1]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, joined across shard boundaries."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside a stream of {len(self)}")
        pieces = []
        part = bisect.bisect_right(self.starts, start) - 1
        while length > 0:
            offset = start - self.starts[part]
            piece = self.parts[part][offset : offset + length]
            pieces.append(np.array(piece, dtype=np.int64))  # a copy: never a view of a memory map
            start, length, part = start + len(piece), length - len(piece), part + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def read_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` for each of ``starts``, as an int64 array
        ``[len(starts), length]``: one gather per shard for the windows inside it, :meth:`read`
        for a window across a shard boundary. A copy, never a view of a memory map."""
        starts = np.asarray(starts, dtype=np.int64)
        if starts.size and (starts.min() < 0 or starts.max() + length > len(self)):
            raise IndexError(f"windows of {length} tokens outside a stream of {len(self)}")
        offsets = np.arange(length, dtype=np.int64)
        if len(self.parts) == 1:  # the text datasets' one array: one gather (fancy indexing copies)
            return self.parts[0][starts[:, None] + offsets].astype(np.int64, copy=False)
        bounds = np.asarray(self.starts, dtype=np.int64)
        first_part = np.searchsorted(bounds, starts, side="right") - 1
        last_part = np.searchsorted(bounds, starts + length - 1, side="right") - 1
        windows = np.empty((len(starts), length), dtype=np.int64)
        for part in np.unique(first_part[first_part == last_part]):
            inside = (first_part == part) & (last_part == part)
            local = starts[inside] - bounds[part]
            windows[inside] = self.parts[part][local[:, None] + offsets]
        for row in np.flatnonzero(first_part != last_part):
            windows[row] = self.read(int(starts[row]), length)
        return windows


def check_ids(window: np.ndarray, vocab_size: int, where: str) -> None:
    """Refuse ids the model cannot embed: better a message here than a device-side assert."""
    low, high = int(window.min()), int(window.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ForgeError(
            f"{where} holds token id {bad}, outside the model's vocabulary of {vocab_size}: the data "
            "was tokenized with another tokenizer. Use the same [tokenizer] (or a larger [model] "
            "vocab_size) as when the data was prepared."
        )
