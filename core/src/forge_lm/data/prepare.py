"""``forge prepare-data``'s work: tokenize text files into ``.bin`` shards for ``memmap``.

Documents are read in order (each text file is one document; each line of a JSON-lines file
is one, its ``text_field`` holding the text), encoded, followed by the tokenizer's eos id,
and written as one token stream cut into shards of ``shard_tokens`` tokens (the last one
shorter). Each ``shard_NNNNN.bin`` gets a ``shard_NNNNN.json`` metadata file
(:mod:`forge_lm.data.shards`); the ``memmap`` dataset reads the stream back exactly. Memory
use is one document plus one write buffer, whatever the corpus size. numpy only: no torch.

Shard files are only ever created, never opened where something already is: an output that
holds shards (or their metadata) is refused, a link among them naming the link, and each file
is created with ``O_EXCL | O_NOFOLLOW`` (:func:`forge_lm.run_links.open_to_write`), so nothing
outside the output directory is written through a link planted there.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from forge_lm.data.files import expand_glob, special_kind
from forge_lm.data.shards import metadata_path, token_dtype, write_shard_metadata
from forge_lm.errors import ForgeError
from forge_lm.run_links import link_error, open_to_write

FORMATS = {"text": (".txt", ".text", ".md"), "jsonl": (".jsonl", ".json")}


def resolve_inputs(inputs: Sequence[str], format: str) -> list[Path]:
    """The input files: each input is a file, a directory (its files of ``format``), or a glob."""
    suffixes = FORMATS[format]
    files: list[Path] = []
    for name in inputs:
        path = Path(name).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            try:
                found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in suffixes)
            except OSError as exc:
                raise ForgeError(f"cannot read input directory '{name}': {exc.strerror or exc}.") from None
            if not found:
                raise ForgeError(f"input directory '{name}' holds no {format} files ({', '.join(suffixes)}).")
            files.extend(found)
        elif matches := sorted(m for m in expand_glob(path) if m.is_file()):
            files.extend(matches)
        elif (kind := special_kind(path)) is not None:
            raise ForgeError(f"input '{name}' is {kind}, not a file or a directory of {format} files.")
        else:
            raise ForgeError(f"input '{name}' does not exist (nor matches any file).")
    return files


def read_documents(files: Sequence[Path], format: str, text_field: str) -> Iterator[tuple[str, int]]:
    """``(document, bytes read for it)`` for every document of ``files``, in order.

    A file that cannot be read (permissions, an I/O error, gone) is a :class:`ForgeError` naming it."""
    for path in files:
        try:
            yield from _file_documents(path, format, text_field)
        except OSError as exc:
            raise ForgeError(f"cannot read '{path}': {exc.strerror or exc}.") from None


def input_bytes(files: Sequence[Path]) -> int:
    """The total size of ``files``; one that cannot be looked at is a :class:`ForgeError` naming it."""
    total = 0
    for path in files:
        try:
            total += path.stat().st_size
        except OSError as exc:
            raise ForgeError(f"cannot read '{path}': {exc.strerror or exc}.") from None
    return total


def _file_documents(path: Path, format: str, text_field: str) -> Iterator[tuple[str, int]]:
    if format == "text":
        data = path.read_bytes()
        yield _decode(data, path, None), len(data)
        return
    with path.open("rb") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():  # blank lines separate nothing in JSON lines; skip them
                yield "", len(line)
                continue
            try:
                row = json.loads(_decode(line, path, number))
            except json.JSONDecodeError as exc:
                raise ForgeError(f"{path}:{number} is not valid JSON ({exc.msg}); fix or remove the line.") from None
            except (ValueError, RecursionError) as exc:  # a number too long, or nesting too deep
                raise ForgeError(f"{path}:{number} cannot be read as JSON ({exc}); fix or remove the line.") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                keys = ", ".join(repr(k) for k in row) if isinstance(row, dict) else "none: not an object"
                raise ForgeError(
                    f"{path}:{number} has no text field '{text_field}' (its keys: {keys}); "
                    "name the right one with --text-field."
                )
            yield row[text_field], len(line)


def _decode(data: bytes, path: Path, line: int | None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"{path}:{line}" if line else str(path)
        raise ForgeError(f"{where} is not UTF-8 text (byte {exc.start}); convert it to UTF-8.") from None


FIX_OUTPUT = "Choose an empty directory for --output, or delete the shards and links there first."


def _write_error(path: Path, exc: OSError) -> ForgeError:
    """The error for ``path``, which could not be created or written."""
    if isinstance(exc, FileExistsError):  # it appeared after the output directory was checked
        if os.path.islink(path):
            return link_error(path, FIX_OUTPUT)
        return ForgeError(f"'{path}' already exists and is not replaced. {FIX_OUTPUT}")
    return ForgeError(f"cannot write '{path}': {exc.strerror or exc}.")


class ShardWriter:
    """Appends tokens to ``shard_NNNNN.bin`` files of ``shard_tokens`` tokens each."""

    def __init__(self, output: Path, shard_tokens: int, dtype: np.dtype, metadata: dict[str, Any]) -> None:
        self.output = output
        self.shard_tokens = shard_tokens
        self.dtype = dtype
        self.metadata = metadata
        self.shards: list[Path] = []
        self.created: list[Path] = []  # the files this writer made: only these are removed on failure
        self._file: Any = None
        self._in_shard = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None:
                shard = self.output / f"shard_{len(self.shards):05d}.bin"
                try:  # created, never opened where something is already (a link included)
                    self._file = os.fdopen(open_to_write(shard, new=True), "wb")
                except OSError as exc:
                    raise _write_error(shard, exc) from None
                self.shards.append(shard)
                self.created.append(shard)
            room = self.shard_tokens - self._in_shard
            piece, tokens = tokens[:room], tokens[room:]
            try:
                self._file.write(piece.tobytes())
            except OSError as exc:
                raise _write_error(self.shards[-1], exc) from None
            self._in_shard += len(piece)
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        file, self._file = self._file, None
        shard = self.shards[-1]
        try:
            file.close()
        except OSError as exc:
            raise _write_error(shard, exc) from None
        try:
            write_shard_metadata(shard, {**self.metadata, "num_tokens": self._in_shard})
        except OSError as exc:
            raise _write_error(metadata_path(shard), exc) from None
        self.created.append(metadata_path(shard))
        self._in_shard = 0

    def close(self) -> None:
        if self._file is not None:
            self._close_shard()

    def remove(self) -> None:
        """Delete what this writer created (never an entry that was there before it)."""
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):
                file.close()
        for path in self.created:
            path.unlink(missing_ok=True)


@attrs.frozen
class Prepared:
    shards: list[Path]
    num_tokens: int
    documents: int
    dtype: str


def prepare(
    inputs: Sequence[str],
    output: Path,
    tokenizer: Any,
    *,
    tokenizer_name: str,
    format: str = "text",
    text_field: str = "text",
    shard_tokens: int = 100_000_000,
    on_progress: Callable[[int, int], None] = lambda done, total: None,
) -> Prepared:
    """Tokenize ``inputs`` into shards in ``output``; ``on_progress(bytes_done, bytes_total)``."""
    if format not in FORMATS:
        raise ForgeError(f"unknown input format {format!r}; use 'text' or 'jsonl'.")
    if shard_tokens < 1:
        raise ForgeError(f"--shard-tokens must be at least 1, got {shard_tokens}.")
    files = resolve_inputs(inputs, format)
    _check_output(output)
    dtype = token_dtype(tokenizer.vocab_size)
    metadata = {
        "dtype": dtype.name,
        "eos_id": tokenizer.eos_id,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer_name,
    }
    writer = ShardWriter(output, shard_tokens, dtype, metadata)
    total_bytes, done_bytes, documents, num_tokens = input_bytes(files), 0, 0, 0
    try:
        for text, size in read_documents(files, format, text_field):
            done_bytes += size
            if text.strip():  # a blank document would add a lone eos and nothing to learn
                ids = np.array([*tokenizer.encode(text), tokenizer.eos_id], dtype=np.int64)
                writer.write(ids)
                documents, num_tokens = documents + 1, num_tokens + len(ids)
            on_progress(done_bytes, total_bytes)
        writer.close()
    except BaseException:
        writer.remove()  # no half-written corpus left behind to be trained on
        raise
    if not documents:
        raise ForgeError(f"the inputs ({', '.join(inputs)}) hold no text; nothing was written.")
    return Prepared(writer.shards, num_tokens, documents, dtype.name)


def _is_shard_file(name: str) -> bool:
    """A name ``prepare`` writes (``shard_*.bin``, ``shard_*.json``) or a shard the dataset reads (``*.bin``,
    ``*.npy``)."""
    return name.endswith((".bin", ".npy")) or (name.startswith("shard_") and name.endswith(".json"))


def _check_output(output: Path) -> None:
    """``output`` created (with its parents) and holding no shards, no shard metadata and no link
    among their names: refused before anything is read or written."""
    if os.path.lexists(output) and not output.is_dir():
        what = "a dangling symbolic link" if not output.exists() else "a file"
        raise ForgeError(f"--output '{output}' is {what}, not a directory; give a directory for the shards.")
    try:
        output.mkdir(parents=True, exist_ok=True)
        names = sorted(name for name in os.listdir(output) if _is_shard_file(name))
    except OSError as exc:
        raise ForgeError(
            f"cannot create or read the output directory '{output}': {exc.strerror or exc}; choose another --output."
        ) from None
    for name in names:
        if os.path.islink(output / name):
            raise link_error(output / name, FIX_OUTPUT)
    if names:
        shown = [name for name in names if not name.endswith(".json")] or names  # shards first, else metadata
        raise ForgeError(
            f"output directory '{output}' already holds shards ({', '.join(shown[:3])}, ...); "
            "choose an empty directory or delete them first."
        )
