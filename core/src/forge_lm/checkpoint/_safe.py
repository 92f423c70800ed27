"""Reading DCP checkpoints without ever running code from them.

torch.distributed.checkpoint stores its metadata (``.metadata``) as a pickle, and a pickle can
name any importable callable. Forge never hands that file to a real unpickler. It reads it with
:class:`_InertUnpickler`, whose only globals are an exact list of (module, name) pairs that DCP
metadata uses, and even those resolve to inert stand-ins created for this one read: calling,
constructing or ``__setstate__``-ing one only records its arguments. No opcode sequence can
reach a real callable, because none is reachable: no import, no attribute lookup, no dotted
names, no persistent ids. :func:`read_metadata` then builds DCP's real ``Metadata`` from the
recorded data by explicit, typed construction, checking every field on the way: types, ranks
and sizes of tensors, that each tensor's chunks cover it exactly once (no gap left unloaded, no
overlap), that each chunk has exactly one storage entry and its stored bytes can hold it, and
that every data file it names is a plain file inside the checkpoint directory.

Two kinds of failure:

- :class:`UnsafeCheckpointError`: the metadata names a global outside the list (a payload, or a
  checkpoint written by something other than DCP). Loading stops and the user is told to
  remove the file; an older checkpoint is not silently used in its place.
- :class:`DamagedCheckpointError`: the metadata is well-formed pickle but not sound checkpoint
  metadata (wrong types, impossible sizes, a path out of the directory). The checkpoint is
  passed over like a truncated one.

:class:`TensorsOnlyPlanner` refuses any item stored as pickled bytes instead of unpickling it.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from forge_lm.errors import ForgeError

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 256 * 1024 * 1024  # metadata of a checkpoint of thousands of shards is tens of MB
_MAX_DIMS = 16
_MAX_DIM_SIZE = 2**48
_OVERLAP_BUDGET = 10**7  # chunk pairs compared per tensor; a grid of shards needs far fewer
_DATA_FILE = re.compile(r"[A-Za-z0-9_-]{1,128}\.distcp")

_DCP = "torch.distributed.checkpoint.metadata"
_DTYPES = {name: value for name in dir(torch) if isinstance(value := getattr(torch, name, None), torch.dtype)}
# Every global DCP's metadata pickle uses, exactly; nothing else is ever resolved.
ALLOWED_GLOBALS = frozenset(
    {(_DCP, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties")}
    | {(_DCP, name) for name in ("ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    | {("torch", "Size"), ("torch.serialization", "_get_layout")}
    | {("torch", name) for name in _DTYPES}
    | {("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}
)
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}


class UnsafeCheckpointError(ForgeError):
    """A checkpoint's metadata names code to run; it is refused."""


class DamagedCheckpointError(ForgeError):
    """A checkpoint's metadata is not sound; the checkpoint is passed over."""


# -- the inert unpickler ----------------------------------------------------------------------


class _Inert:
    """What every allowed global becomes: constructing, calling or setting state records data."""

    __slots__ = ("args", "kwargs", "state")

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        obj = object.__new__(cls)
        obj.args, obj.kwargs, obj.state = args, kwargs, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # __new__ recorded everything

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _InertUnpickler(pickle.Unpickler):
    def __init__(self, file: Any) -> None:
        super().__init__(file)
        # Fresh stand-in classes for every read: nothing one read does to them outlives it.
        self.stand_ins = {label: type(".".join(label), (_Inert,), {"__slots__": ()}) for label in ALLOWED_GLOBALS}
        self.labels = {stand_in: label for label, stand_in in self.stand_ins.items()}

    def find_class(self, module: str, name: str) -> Any:
        stand_in = self.stand_ins.get((module, name))
        if stand_in is None:
            raise UnsafeCheckpointError(
                f"its metadata would import '{module}.{name}', which checkpoint metadata never needs: the file was "
                "written to run code, not by a checkpoint save"
            )
        return stand_in

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("its metadata holds a persistent id, which checkpoint metadata never uses")


# -- from recorded data to real metadata --------------------------------------------------------


class _Builder:
    """Builds DCP metadata from what the inert unpickler recorded, checking each field."""

    def __init__(self, labels: dict[type, tuple[str, str]], files: StepFiles) -> None:
        self.labels = labels
        self.files = files
        self._file_sizes: dict[str, int] = {}

    def label(self, value: Any) -> tuple[str, str] | None:
        return self.labels.get(type(value)) if isinstance(value, _Inert) else None

    def fields(self, value: Any, kind: str, names: tuple[str, ...], module: str = _DCP) -> dict[str, Any]:
        """The fields of a recorded dataclass instance, by name (from its state or its arguments)."""
        if self.label(value) != (module, kind):
            raise DamagedCheckpointError(f"expected {kind}, found {_what(value)}")
        found: dict[str, Any] = dict(zip(names, value.args, strict=False)) if len(value.args) <= len(names) else {}
        if len(value.args) > len(names):
            raise DamagedCheckpointError(f"{kind} has {len(value.args)} arguments")
        found.update(value.kwargs)
        if isinstance(value.state, tuple) and len(value.state) == 2 and value.state[1] is None:
            value.state = value.state[0]  # (dict state, no slot state)
        if isinstance(value.state, dict):
            found.update(value.state)
        elif value.state is not None:
            raise DamagedCheckpointError(f"{kind} has a state of type {type(value.state).__name__}")
        unknown = [key for key in found if key not in names]
        if unknown:
            raise DamagedCheckpointError(f"{kind} has unknown fields {unknown[:3]!r}")
        return found

    def metadata(self, root: Any) -> Metadata:
        names = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
        fields = self.fields(root, "Metadata", names)
        version = fields.get("version")
        if version is not None and not (isinstance(version, str) and len(version) <= 32):
            raise DamagedCheckpointError("version is not a short string")
        items = _dict(fields.get("state_dict_metadata"), "state_dict_metadata")
        tensors = {_string(key, "a tensor name"): self.tensor(key, item) for key, item in items.items()}
        storage = self.storage(_dict(fields.get("storage_data"), "storage_data"), tensors)
        return Metadata(
            state_dict_metadata=tensors,
            planner_data=self.planner_data(fields.get("planner_data"), tensors),
            storage_data=storage,
            storage_meta=StorageMeta(),  # where and when it was saved: not needed, not trusted
            version=version,
        )

    def tensor(self, key: str, item: Any) -> TensorStorageMetadata:
        if self.label(item) == (_DCP, "BytesStorageMetadata"):
            raise DamagedCheckpointError(
                f"'{key}' is stored as a pickled object; Forge checkpoints hold tensors only (plain state is JSON)"
            )
        fields = self.fields(item, "TensorStorageMetadata", ("properties", "size", "chunks"))
        size = self.size(fields.get("size"), f"the size of '{key}'")
        chunks = []
        for chunk in _list(fields.get("chunks"), f"the chunks of '{key}'"):
            parts = self.fields(chunk, "ChunkStorageMetadata", ("offsets", "sizes"))
            offsets = self.size(parts.get("offsets"), f"a chunk offset of '{key}'")
            sizes = self.size(parts.get("sizes"), f"a chunk size of '{key}'")
            if not (len(offsets) == len(sizes) == len(size)) or any(
                o + s > whole for o, s, whole in zip(offsets, sizes, size, strict=True)
            ):
                raise DamagedCheckpointError(f"a chunk of '{key}' lies outside its tensor {tuple(size)}")
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
        _check_tiling(key, size, chunks)
        return TensorStorageMetadata(
            properties=self.properties(fields.get("properties"), key), size=size, chunks=chunks
        )

    def properties(self, value: Any, key: str) -> TensorProperties:
        if self.label(value) != (_DCP, "TensorProperties") or value.args or value.kwargs:
            raise DamagedCheckpointError(f"the tensor properties of '{key}' are not DCP's")
        state = value.state
        if not (isinstance(state, tuple) and len(state) == 5):
            raise DamagedCheckpointError(f"the tensor properties of '{key}' are malformed")
        dtype, layout, requires_grad, memory_format, pin_memory = state
        dtype_label = self.labels.get(dtype) if isinstance(dtype, type) else None
        if dtype_label is None or dtype_label[0] != "torch" or dtype_label[1] not in _DTYPES:
            raise DamagedCheckpointError(f"the dtype of '{key}' is not a torch dtype")
        if self.label(layout) != ("torch.serialization", "_get_layout") or layout.args != ("torch.strided",):
            raise DamagedCheckpointError(f"'{key}' is not a strided tensor")
        encoding = memory_format.args if self.label(memory_format) == (_DCP, "_MEM_FORMAT_ENCODING") else None
        if not (encoding and len(encoding) == 1 and _int(encoding[0]) in _MEMORY_FORMATS):
            raise DamagedCheckpointError(f"the memory format of '{key}' is unknown")
        if not (isinstance(requires_grad, bool) and isinstance(pin_memory, bool)):
            raise DamagedCheckpointError(f"the tensor properties of '{key}' are malformed")
        return TensorProperties(
            dtype=_DTYPES[dtype_label[1]],
            layout=torch.strided,
            requires_grad=requires_grad,
            memory_format=_MEMORY_FORMATS[encoding[0]],
            pin_memory=pin_memory,
        )

    def size(self, value: Any, what: str) -> torch.Size:
        if self.label(value) != ("torch", "Size") or value.kwargs or value.state is not None or len(value.args) > 1:
            raise DamagedCheckpointError(f"{what} is not a torch.Size")
        dims = value.args[0] if value.args else ()
        if not isinstance(dims, list | tuple) or len(dims) > _MAX_DIMS:
            raise DamagedCheckpointError(f"{what} is not a list of dimensions")
        if not all(_int(d) is not None and 0 <= d < _MAX_DIM_SIZE for d in dims):
            raise DamagedCheckpointError(f"{what} has an impossible dimension")
        return torch.Size(dims)

    def storage(self, entries: dict[Any, Any], tensors: dict[str, TensorStorageMetadata]) -> dict[Any, _StorageInfo]:
        storage: dict[Any, _StorageInfo] = {}
        # Each chunk is read from exactly one storage entry, found by (tensor, chunk offsets).
        unstored = {(fqn, tuple(chunk.offsets)) for fqn, tensor in tensors.items() for chunk in tensor.chunks}
        for index, info in entries.items():
            where = self.fields(index, "MetadataIndex", ("fqn", "offset", "index"))
            fqn = _string(where.get("fqn"), "a storage entry's tensor name")
            if fqn not in tensors:
                raise DamagedCheckpointError(f"storage is listed for '{fqn}', which the checkpoint does not describe")
            offset = self.size(where.get("offset"), f"a storage offset of '{fqn}'")
            if (fqn, tuple(offset)) not in unstored:
                raise DamagedCheckpointError(
                    f"storage is listed for '{fqn}' at {tuple(offset)}, where no chunk of it begins, or twice"
                )
            unstored.discard((fqn, tuple(offset)))
            hint = where.get("index")
            if hint is not None and _int(hint) is None:
                raise DamagedCheckpointError(f"a storage index of '{fqn}' is not an integer")
            stored = self.fields(
                info,
                "_StorageInfo",
                ("relative_path", "offset", "length", "transform_descriptors"),
                "torch.distributed.checkpoint.filesystem",
            )
            key = MetadataIndex(fqn=fqn, offset=offset, index=hint)
            storage[key] = self.stored_bytes(fqn, stored, tensors[fqn], offset)
        if unstored:
            fqn, offset = min(unstored)
            raise DamagedCheckpointError(f"no storage is listed for the chunk of '{fqn}' at {offset}")
        return storage

    def stored_bytes(
        self, fqn: str, stored: dict[str, Any], tensor: TensorStorageMetadata, offset: torch.Size
    ) -> _StorageInfo:
        name = stored.get("relative_path")
        if not (isinstance(name, str) and _DATA_FILE.fullmatch(name)):
            raise DamagedCheckpointError(
                f"'{fqn}' is stored in {name!r}, which is not a data file name inside the checkpoint"
            )
        start, length = _int(stored.get("offset")), _int(stored.get("length"))
        if start is None or length is None or start < 0 or length < 0:
            raise DamagedCheckpointError(f"the storage offset or length of '{fqn}' is not a non-negative integer")
        if stored.get("transform_descriptors"):
            raise DamagedCheckpointError(f"'{fqn}' is stored through transforms (compression?) Forge does not read")
        if start + length > self.file_size(name):
            raise DamagedCheckpointError(f"'{fqn}' is stored past the end of {name} (truncated?)")
        chunk = next(c for c in tensor.chunks if c.offsets == offset)  # there is one: storage() checked
        needed = math.prod(chunk.sizes) * _itemsize(tensor.properties.dtype)
        if needed > length:
            raise DamagedCheckpointError(
                f"'{fqn}' claims {tuple(chunk.sizes)} elements but only {length} bytes are stored for it"
            )
        return _StorageInfo(relative_path=name, offset=start, length=length)

    def file_size(self, name: str) -> int:
        if name not in self._file_sizes:
            if self.files.kind(name) != "file":
                raise DamagedCheckpointError(f"its data file {name} is missing or not a plain file")
            self._file_sizes[name] = self.files.size(name)
        return self._file_sizes[name]

    def planner_data(self, value: Any, tensors: dict[str, Any]) -> dict[str, tuple] | None:
        if value is None:
            return None
        out = {}
        for key, path in _dict(value, "planner_data").items():
            if not (isinstance(path, tuple | list) and all(isinstance(p, str | int) for p in path)):
                raise DamagedCheckpointError("planner_data is malformed")
            out[_string(key, "a planner_data key")] = tuple(path)
        return out


def _check_tiling(key: str, size: torch.Size, chunks: list[ChunkStorageMetadata]) -> None:
    """The chunks (each inside the tensor: checked) cover the tensor exactly once: no two overlap,
    and together they hold as many elements as it has. A gap would leave part of the tensor
    unloaded, at whatever it held before (a freshly initialised parameter), without a word."""
    if len({tuple(chunk.offsets) for chunk in chunks}) != len(chunks):
        raise DamagedCheckpointError(f"two chunks of '{key}' begin at the same place")
    if sum(math.prod(chunk.sizes) for chunk in chunks) != math.prod(size):
        raise DamagedCheckpointError(
            f"the chunks of '{key}' do not cover it: they hold {sum(math.prod(c.sizes) for c in chunks)} of its "
            f"{math.prod(size)} elements"
        )
    if not size:
        return  # a scalar: one chunk of one element, by the count above
    # Sweep along the first dimension: a chunk can overlap only the chunks still open where it
    # begins. Shardings Forge writes (rows, and rows by columns) keep few open at once; a budget
    # bounds the work a crafted file can ask for.
    boxes = sorted(
        (tuple(chunk.offsets), tuple(o + s for o, s in zip(chunk.offsets, chunk.sizes, strict=True)))
        for chunk in chunks
        if math.prod(chunk.sizes)
    )
    open_boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    budget = _OVERLAP_BUDGET
    for start, end in boxes:
        open_boxes = [box for box in open_boxes if box[1][0] > start[0]]
        budget -= len(open_boxes)
        if budget < 0:
            raise DamagedCheckpointError(f"the chunks of '{key}' are too many and too entangled to check")
        for other_start, other_end in open_boxes:
            if all(s < oe and os < e for s, e, os, oe in zip(start, end, other_start, other_end, strict=True)):
                raise DamagedCheckpointError(f"two chunks of '{key}' overlap, at {start} and {other_start}")
        open_boxes.append((start, end))


def _what(value: Any) -> str:
    return type(value).__name__ if isinstance(value, _Inert) else f"a {type(value).__name__}"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _string(value: Any, what: str) -> str:
    if not (isinstance(value, str) and 0 < len(value) <= 4096):
        raise DamagedCheckpointError(f"{what} is not a string")
    return value


def _dict(value: Any, what: str) -> dict:
    if type(value) is not dict:
        raise DamagedCheckpointError(f"{what} is not a dict")
    return value


def _list(value: Any, what: str) -> list:
    if type(value) is not list:
        raise DamagedCheckpointError(f"{what} is not a list")
    return value


def _itemsize(dtype: torch.dtype) -> float:
    return dtype.itemsize if dtype.itemsize else 0.125  # sub-byte dtypes: at least a bit each


class StepFiles(Protocol):
    """The files of one checkpoint, wherever they are kept (a local directory, an object-store
    prefix: :mod:`forge_lm.checkpoint._store`). Names are plain names inside the checkpoint."""

    def kind(self, name: str) -> str | None:
        """``"file"`` for a plain file; ``"link"``, ``"dir"`` or ``"other"``; None when missing."""

    def size(self, name: str) -> int: ...

    def read(self, name: str, limit: int) -> bytes:
        """The file's bytes; raises :class:`DamagedCheckpointError` past ``limit`` bytes."""


def read_metadata(directory: Path | StepFiles) -> Metadata:
    """DCP metadata of the checkpoint in ``directory`` (a local directory or the files of one
    kept elsewhere), read without running any code from it."""
    if isinstance(directory, str | Path):
        from forge_lm.checkpoint._local_store import LocalFiles  # here: the local store reads through this module

        directory = LocalFiles(Path(directory))
    kind = directory.kind(METADATA_FILE)
    if kind != "file":
        raise DamagedCheckpointError(f"{METADATA_FILE} is missing or not a plain file")
    if directory.size(METADATA_FILE) > MAX_METADATA_BYTES:
        raise DamagedCheckpointError(f"{METADATA_FILE} is larger than {MAX_METADATA_BYTES // 2**20} MiB")
    unpickler = _InertUnpickler(io.BytesIO(directory.read(METADATA_FILE, MAX_METADATA_BYTES)))
    try:
        root = unpickler.load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle fails in many ways; none is a bug here
        raise DamagedCheckpointError(f"{METADATA_FILE} is not readable: {type(exc).__name__}: {exc}") from None
    try:
        return _Builder(unpickler.labels, directory).metadata(root)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise DamagedCheckpointError(f"{METADATA_FILE} is malformed: {type(exc).__name__}: {exc}") from None


class _SafeMetadata:
    """Makes a DCP reader take its metadata from :func:`read_metadata` over ``files``."""

    files: StepFiles
    load_id: str

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise DamagedCheckpointError("per-rank metadata files are not used by Forge checkpoints")
        metadata = read_metadata(self.files)
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeReader(_SafeMetadata, FileSystemReader):
    """A DCP filesystem reader whose metadata comes from :func:`read_metadata`."""

    def __init__(self, path: str, files: StepFiles | None = None) -> None:
        super().__init__(path)
        if files is None:
            from forge_lm.checkpoint._local_store import LocalFiles

            files = LocalFiles(Path(path))
        self.files = files


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """Loads tensors; refuses any item stored as pickled bytes."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise UnsafeCheckpointError(
            f"refusing to load '{read_item.dest_index.fqn}': the checkpoint stores it as a pickled object, "
            "and Forge checkpoints hold tensors only (plain state lives in JSON)."
        )
