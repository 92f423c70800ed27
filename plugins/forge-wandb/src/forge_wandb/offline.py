"""Read back what an offline W&B run recorded: its id, config, history and summary.

An offline run (``mode = "offline"``) writes ``<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb``:
W&B's transaction log, a LevelDB-style log of ``wandb.proto.wandb_internal_pb2.Record``
protobufs, which ``wandb sync`` uploads later. wandb no longer ships a Python reader for it,
so :func:`records` reads the log format (7-byte file header ``:W&B`` + magic + version, then
32 KiB blocks of chunks, each with a CRC-32, a length and a type) and parses every record
with wandb's own protobuf classes. The tests use it to check what the backend recorded; it
also lets you inspect an offline run without uploading it.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_IDENT, _MAGIC = b":W&B", 0xBEE1
_CHUNK_HEADER = struct.Struct("<IHB")  # crc32 of type + data, data length, type
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def run_files(root: str | Path) -> list[Path]:
    """Every offline run's ``.wandb`` file under ``root`` (a run directory, or its ``wandb/``),
    oldest first (their folders are named by start time)."""
    found = Path(root).glob("**/offline-run-*/run-*.wandb")
    return sorted(found, key=lambda path: path.parent.name)


def records(path: str | Path) -> Iterator[Any]:
    """The ``Record`` protobufs of one ``.wandb`` file, in order; a chunk cut short at the end
    (a run still writing, or killed) ends the iteration, a corrupt one raises ValueError."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if len(data) < _FILE_HEADER.size or _FILE_HEADER.unpack_from(data)[:2] != (_IDENT, _MAGIC):
        raise ValueError(f"{path}: not a W&B transaction log (no ':W&B' header)")
    position, pending = _FILE_HEADER.size, b""
    while position + _CHUNK_HEADER.size <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < _CHUNK_HEADER.size:  # too little room for a header: the block is padded
            position += left_in_block
            continue
        checksum, length, kind = _CHUNK_HEADER.unpack_from(data, position)
        if (checksum, length, kind) == (0, 0, 0):  # zero padding up to the block's end
            position += left_in_block
            continue
        start = position + _CHUNK_HEADER.size
        chunk = data[start : start + length]
        if len(chunk) < length:
            return
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != checksum:
            raise ValueError(f"{path}: corrupt record at byte {position} (checksum mismatch)")
        position = start + length
        if kind in (_FULL, _FIRST):
            pending = chunk
        elif kind in (_MIDDLE, _LAST):
            pending += chunk
        else:
            raise ValueError(f"{path}: unknown chunk type {kind} at byte {position}")
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def run_record(path: str | Path) -> Any:
    """The run's ``RunRecord`` protobuf: ``run_id``, ``project``, ``entity``, ``display_name``,
    ``run_group``, ``tags``, ... as the run was started."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise ValueError(f"{path}: no run record")


def run_id(path: str | Path) -> str:
    """The W&B run id a ``.wandb`` file records."""
    return run_record(path).run_id


def exit_code(path: str | Path) -> int | None:
    """The exit code the run was finished with (0: success), or None if it was never finished."""
    code = None
    for record in records(path):
        if record.WhichOneof("record_type") == "exit":
            code = record.exit.exit_code
    return code


def config(path: str | Path) -> dict[str, Any]:
    """The run's config as it was logged (W&B's own ``_wandb`` entry left out)."""
    values: dict[str, Any] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else ()
        for item in updates:
            values[_key(item)] = json.loads(item.value_json)
    values.pop("_wandb", None)
    return values


def history(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """Every history row as ``(step, {metric: value})``, W&B's own ``_``-keys left out.

    NaN and infinities come back as floats (W&B writes them as JSON's ``NaN``, ``Infinity``).
    """
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {_key(item): json.loads(item.value_json) for item in record.history.item}
        step = record.history.step.num if record.history.HasField("step") else row.get("_step")
        rows.append((int(step), {key: value for key, value in row.items() if not key.startswith("_")}))
    return rows


def summary(path: str | Path) -> dict[str, Any]:
    """The run's final summary (the last value of each key), W&B's own ``_``-keys left out."""
    values: dict[str, Any] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                values[_key(item)] = json.loads(item.value_json)
            for item in record.summary.remove:
                values.pop(_key(item), None)
    return {key: value for key, value in values.items() if not key.startswith("_")}


def read_history(root: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """The history rows of every offline run under ``root``, oldest run first.

    A resumed training writes one offline run folder per session, with the same run id; this
    is their history in the order it was logged (what ``wandb sync`` uploads to the one run).
    """
    return [row for path in run_files(root) for row in history(path)]
