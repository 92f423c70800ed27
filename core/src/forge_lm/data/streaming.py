"""``hf_text`` with ``streaming = true``: the files read as a stream, tokenized and packed on the fly.

Nothing but one shuffle buffer of windows (and the reader's current batch of rows) is held in
memory, so the corpus may be any size.
Each file is opened on its own through ``datasets``' streaming mode
(``load_dataset(..., streaming=True)``, an ``IterableDataset``), the files in sorted order.

**Order.** Rows are numbered ``k = 0, 1, ...`` through the files in order, every row counted
(blank ones too): the numbering of the in-memory ``hf_text``, so row ``k`` belongs to the eval
split under the same rule (:func:`forge_lm.data.splits.held_out_rule`). The non-blank rows of
a split are its documents, numbered ``j = 0, 1, ...``; data-parallel rank ``r`` of ``n`` takes
document ``j`` when ``j % n == r``. Every rank reads every row (reading is cheap), and
tokenizes only its own documents (tokenizing is not), so the ranks' documents are disjoint and
together are all of the split's, whatever the number of files. A rank's documents are packed as
:mod:`forge_lm.data.packing` packs: each followed by eos, concatenated, cut into windows of
``seq_len + 1`` tokens with stride ``seq_len``. With one rank and no shuffle buffer, window
``i`` of the stream is therefore window ``i`` of the in-memory dataset's token stream. After
the last file the stream starts over from the first (the next epoch), the packing running on
across the seam: the stream is endless, as every dataset of a mixture must be.

**Shuffle buffer.** With ``shuffle_buffer = N`` (train split only) windows are taken in blocks
of ``N`` consecutive windows, and block ``b`` is handed out in the order of a pseudo-random
permutation of ``range(N)`` keyed by ``(seed, rank, b)`` (:class:`KeyedPermutation`, the
sampler's). Every window of a block is equally likely to come first, and no window moves more
than ``N - 1`` places. The eval split is read in order: each evaluation reads the same first
batches, and a buffer would only delay them. (``IterableDataset.shuffle`` is not used: its
buffer's examples are lost when ``datasets`` resumes from a state, so no resume would be exact.)

**State.** A block is fully determined by where its first window starts: a row (epoch, file,
row within the file, ``k``, ``j``) and a token offset into that row's document. The state is
that position, the block's number (its permutation key) and how many of its windows were handed
out; nothing else is random. The buffer's contents are saved by where they come from rather
than as tokens, so the state is a few integers per rank whatever ``N`` and ``seq_len`` are.
Resuming opens the file of the position (no earlier file is opened), skips the rows before it
with ``IterableDataset.skip`` (parsed by Arrow in batches, not tokenized: a fraction of a second
per 10^5 rows), tokenizes the block's documents again (at most ``N`` windows' worth), and skips
the windows already handed out. A saved position is checked when it is loaded, by reading it:
one that does not point at a document of this rank, or past its end, is refused.

**Ranks.** A checkpoint keeps one data state, rank 0's, and each rank's position is its own:
in a distributed run :meth:`StreamingTextDataset.state_dict` gathers every data-parallel rank's
position (a collective, called by every rank at once, as saving and restoring are), and
:meth:`~StreamingTextDataset.load_state_dict` takes its own. A streaming run therefore resumes
on the same number of data-parallel ranks only.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from forge_lm.components import DataContext
from forge_lm.data._random import hash_keys
from forge_lm.data.hf_corpus import corpus_name, first_bad_line, load_hub, reader, text_field, unreadable
from forge_lm.data.packing import check_tokenizer, window_sample
from forge_lm.data.sampler import KeyedPermutation
from forge_lm.data.shards import token_dtype
from forge_lm.data.splits import held_out_rule
from forge_lm.errors import ConfigError, ForgeError

_SALT = 0x737472  # keeps the buffer's permutations apart from other users of the seed
_BATCH_ROWS = 512  # rows per Arrow batch read from a file
_POSITION = ("epoch", "file", "row", "index", "ordinal", "offset")
_RANK_KEYS = ("dp_rank", *_POSITION, "block", "emitted")


class Row(NamedTuple):
    """Where a row is: its epoch, file, row within the file, row number ``k`` across the
    files, and ``j``, the number of the split's documents before it in the epoch."""

    epoch: int
    file: int
    row: int
    index: int
    ordinal: int


class Position(NamedTuple):
    """Where a window starts: token ``offset`` of the document at ``row`` (for a fresh stream,
    of the first document of this rank at or after ``row``)."""

    row: Row
    offset: int


START = Position(Row(0, 0, 0, 0, 0), 0)


class StreamingTextDataset:
    """Windows of ``files``' documents for one rank and split, read as a stream (module doc)."""

    def __init__(self, options: Any, context: DataContext, files: list[Path], datasets: Any) -> None:
        self.tokenizer = check_tokenizer(context.tokenizer, context.vocab_size, "hf_text")
        self.context = context
        self.files = files
        self._options = options
        # The sources read in turn: the files, or the one Hub dataset (streamed from the Hub).
        self.hub = options.dataset is not None
        self.sources = [options.dataset] if self.hub else [str(path) for path in files]
        self._datasets = datasets
        self.format = options.format
        self.field = text_field(options)
        self._builder, self._settings = reader(options)
        self.eval = context.split == "eval"
        self._is_held_out = held_out_rule(options.eval_fraction)
        self.block_size = 1 if self.eval else max(1, options.shuffle_buffer)
        self.shuffle = not self.eval and options.shuffle_buffer > 0
        self._dtype = token_dtype(self.tokenizer.vocab_size)
        self.source = f"the {context.split} split of the streamed hf_text data at '{corpus_name(options)}'"
        if self.eval and options.eval_fraction == 0:
            raise ConfigError(
                f"the eval split of dataset 'hf_text' ('{corpus_name(options)}') is empty: eval_fraction = 0; raise "
                "eval_fraction or set [eval] interval = 0."
            )
        # What a saved position means depends on these: resuming with other files, options or
        # tokenizer would read other documents at the same numbers.
        identity = [
            [options.dataset, options.dataset_config, options.hub_split, options.revision]
            if self.hub
            else [path.name for path in files],
            options.format,
            self.field,
            options.sample_by,
            options.eval_fraction,
            context.split,
            self.tokenizer.vocab_size,
            self.tokenizer.eos_id,
        ]
        self.fingerprint = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
        self._position, self._block, self._emitted = START, 0, 0
        self._loads = 0  # counts load_state_dict calls: a running iterator restarts from the new state

    # -- reading ----------------------------------------------------------------------------------

    def _rows(self, number: int, start: int) -> Iterator[Any]:
        """The ``text_field`` values of source ``number`` (a file, or the Hub dataset), from its row ``start``."""
        if self.hub:
            yield from self._stream_rows(load_hub(self._datasets, self._options, streaming=True), None, start)
            return
        path = self.files[number]
        if self.format != "text" and path.stat().st_size == 0:
            return  # the json reader cannot open an empty file; it has no rows
        try:
            stream = self._datasets.load_dataset(
                self._builder, data_files=[str(path)], split="train", streaming=True, **self._settings
            )
        except StopIteration:  # the json reader found no row to infer the columns from
            return
        except Exception as exc:  # datasets and Arrow raise many kinds for a malformed file
            raise unreadable(path, self.format, exc, first_bad_line(path, self.format)) from exc
        yield from self._stream_rows(stream, path, start)

    def _stream_rows(self, stream: Any, path: Path | None, start: int) -> Iterator[Any]:
        """The ``text_field`` values of ``stream`` from row ``start``; a failure names ``path``
        (None: the Hub dataset)."""
        name = Path(self.sources[0]) if path is None else path
        try:
            columns = stream.column_names  # None when the reader cannot tell before reading
            if columns is not None:
                self._check_field(name, columns)
                stream = stream.select_columns([self.field])
            if start:
                stream = stream.skip(start)
            for batch in stream.iter(batch_size=_BATCH_ROWS):
                if self.field not in batch:
                    self._check_field(name, list(batch))
                yield from batch[self.field]
        except ForgeError:
            raise
        except Exception as exc:  # datasets and Arrow raise many kinds for a malformed file
            where = first_bad_line(path, self.format) if path is not None else None
            raise unreadable(name, "the Hub's rows" if path is None else self.format, exc, where) from exc

    def _check_field(self, path: Path, columns: list[str]) -> None:
        if self.field not in columns:
            raise ConfigError(
                f"dataset 'hf_text': the rows of '{path}' have no field '{self.field}'; set text_field to one of "
                f"{', '.join(repr(c) for c in columns)}."
            )

    def _documents(self, start: Row) -> Iterator[tuple[Row, str]]:
        """This rank's documents of the split from ``start`` on, with where each is; endless."""
        epoch, file, row, index, ordinal = start
        dp_rank, dp_size = self.context.dp_rank, self.context.dp_size
        while True:
            whole_pass, found = file == 0 and row == 0, False
            while file < len(self.sources):
                for text in self._rows(file, row):
                    if not isinstance(text, str):
                        shown = repr(text)[:80]
                        raise ForgeError(
                            f"dataset 'hf_text': row {row} of '{self.sources[file]}' (counting from 0) has "
                            f"{self.field} = {shown}, not a string."
                        )
                    if text.strip() and self._is_held_out(index) == self.eval:
                        if ordinal % dp_size == dp_rank:
                            found = True
                            yield Row(epoch, file, row, index, ordinal), text
                        ordinal += 1
                    row += 1
                    index += 1
                file, row = file + 1, 0
            if whole_pass and not found:
                fix = "raise eval_fraction" if self.eval else "lower eval_fraction"
                raise ConfigError(
                    f"{self.source} has no document for data-parallel rank {dp_rank} of {dp_size} ({index} rows in "
                    f"{len(self.sources)} sources, {ordinal} documents in this split); {fix} or give the dataset more "
                    "documents."
                )
            epoch, file, row, index, ordinal = epoch + 1, 0, 0, 0, 0

    def _tokens(self, text: str) -> np.ndarray:
        return np.array([*self.tokenizer.encode(text), self.tokenizer.eos_id], dtype=self._dtype)

    def _windows(self, start: Position) -> Iterator[tuple[np.ndarray, Position]]:
        """Windows of ``seq_len + 1`` tokens from ``start`` on, each with where the next starts."""
        length, stride = self.context.seq_len + 1, self.context.seq_len
        documents = self._documents(start.row)
        row, text = next(documents)
        tokens = self._tokens(text)
        if start != START and (row != start.row or start.offset >= len(tokens)):
            raise ForgeError(
                f"the saved position in {self.source} (row {start.row.row} of '{self.sources[start.row.file]}', token "
                f"{start.offset}) is not in a document of this rank: the files changed since the checkpoint was "
                "written, or the state was edited."
            )
        pending: deque[tuple[Row, np.ndarray]] = deque([(row, tokens)])
        head = start.offset  # where the next window starts in pending[0]
        available = len(tokens) - head
        while True:
            while available < length:
                row, text = next(documents)
                tokens = self._tokens(text)
                pending.append((row, tokens))
                available += len(tokens)
            pieces, need, begin = [], length, head
            for _, tokens in pending:
                piece = tokens[begin : begin + need]
                pieces.append(piece)
                need, begin = need - len(piece), 0
                if not need:
                    break
            head, available = head + stride, available - stride
            while head >= len(pending[0][1]):
                head -= len(pending[0][1])
                pending.popleft()
            yield np.concatenate(pieces), Position(pending[0][0], head)

    # -- the dataset ------------------------------------------------------------------------------

    def _order(self, block: int) -> KeyedPermutation | range:
        if not self.shuffle:
            return range(self.block_size)
        return KeyedPermutation(self.block_size, hash_keys(self.context.seed, _SALT, self.context.dp_rank, block))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # The state is advanced before each yield, so it always names the next sample.
        while True:
            loads = self._loads
            windows = self._windows(self._position)
            buffer = np.empty((self.block_size, self.context.seq_len + 1), dtype=self._dtype)
            while loads == self._loads:
                end = self._position
                for slot in range(self.block_size):
                    buffer[slot], end = next(windows)
                order = self._order(self._block)
                for turn in range(self._emitted, self.block_size):
                    if loads != self._loads:
                        break  # load_state_dict was called while this iterator was paused
                    window = buffer[order[turn]]
                    if turn + 1 < self.block_size:
                        self._emitted = turn + 1
                    else:
                        self._position, self._block, self._emitted = end, self._block + 1, 0
                    yield window_sample(window, self.tokenizer.eos_id)

    def _own_state(self) -> dict[str, int]:
        (row, offset), context = self._position, self.context
        values = (context.dp_rank, *row, offset, self._block, self._emitted)
        return dict(zip(_RANK_KEYS, values, strict=True))

    def state_dict(self) -> dict[str, Any]:
        """Every data-parallel rank's position (gathered: a collective on several ranks)."""
        return self._state(gather_ranks(self._own_state(), self.context.dp_size))

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's position alone, without a collective (what a loader reading ahead notes
        per batch); :meth:`load_state_dict` restores it on this rank."""
        return self._state([self._own_state()])

    def _state(self, ranks: list[dict[str, int]]) -> dict[str, Any]:
        return {
            "streaming": self.fingerprint,
            "dp_size": self.context.dp_size,
            "block_size": self.block_size,
            "seq_len": self.context.seq_len,
            "ranks": ranks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position :meth:`state_dict` saved, after checking it: a state from another
        corpus, options or number of ranks, or one that was edited, raises ForgeError."""
        mine = self._checked(state)
        position = Position(Row(*(mine[key] for key in _POSITION[:-1])), mine["offset"])
        if position != START:
            next(self._windows(position))  # reads the position: refuses one outside this rank's documents
        elif mine["block"]:
            raise ForgeError(
                f"the saved data state of {self.source} is inconsistent (block {mine['block']} at the start)."
            )
        self._position, self._block, self._emitted = position, mine["block"], mine["emitted"]
        self._loads += 1

    def _checked(self, state: Any) -> dict[str, int]:
        """This rank's entry of ``state``, every value checked."""
        if not isinstance(state, dict) or set(state) != {"streaming", "dp_size", "block_size", "seq_len", "ranks"}:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ForgeError(f"the saved data state {keys} is not the state of {self.source}.")
        if state["streaming"] != self.fingerprint:
            raise ForgeError(
                f"the saved data position is for other data than {self.source}: its files, format, text_field, "
                "sample_by, eval_fraction or tokenizer changed since the checkpoint was written. Resume with the same "
                "data and options, or start a new run."
            )
        for key, ours, what in (
            ("dp_size", self.context.dp_size, "data-parallel ranks"),
            ("block_size", self.block_size, "windows per shuffle buffer (shuffle_buffer)"),
            ("seq_len", self.context.seq_len, "tokens per sequence (seq_len)"),
        ):
            if state[key] != ours:
                raise ForgeError(
                    f"the saved position in {self.source} is for {state[key]!r} {what}, but this run has {ours}: a "
                    "stream resumes exactly only with the same setting. Resume with it, or start a new run."
                )
        entries = state["ranks"]
        if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
            raise ForgeError(f"the saved data state of {self.source} has malformed ranks.")
        found = [entry for entry in entries if entry.get("dp_rank") == self.context.dp_rank]
        if len(found) != 1:
            raise ForgeError(
                f"the saved data state of {self.source} holds {len(found)} positions for data-parallel rank "
                f"{self.context.dp_rank}, not one."
            )
        mine = found[0]
        if set(mine) != set(_RANK_KEYS) or not all(_is_count(mine[key]) for key in _RANK_KEYS):
            raise ForgeError(f"the saved position of rank {self.context.dp_rank} in {self.source} is malformed.")
        if not (
            mine["file"] < len(self.sources)
            and mine["row"] <= mine["index"]
            and mine["ordinal"] <= mine["index"]
            and mine["emitted"] < self.block_size
        ):
            raise ForgeError(f"the saved position of rank {self.context.dp_rank} in {self.source} is out of range.")
        return mine


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def gather_ranks(mine: dict[str, int], dp_size: int) -> list[dict[str, int]]:
    """Every data-parallel rank's entry, in rank order, on every rank (a collective over the
    default group when one is initialised and there are several ranks; else this rank's only).
    Ranks that differ only in their tensor- or pipeline-parallel place read the same data and
    hold the same entry: one is kept per data-parallel rank."""
    import torch.distributed as dist

    if dp_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    by_rank: dict[int, dict[str, int]] = {}
    for entry in gathered:
        by_rank.setdefault(entry["dp_rank"], entry)
    return [by_rank[rank] for rank in sorted(by_rank)]
