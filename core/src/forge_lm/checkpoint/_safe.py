"""Reading DCP checkpoints without unpickling anything but checkpoint metadata.

torch.distributed.checkpoint stores its metadata as a pickle and non-tensor items as pickled
bytes. Forge writes only tensors through DCP (everything else goes to JSON), and reads with:

- :class:`SafeReader`: the metadata pickle is read by an unpickler that can build DCP's own
  metadata classes, torch dtypes and sizes, and nothing else;
- :class:`TensorsOnlyPlanner`: a checkpoint that offers a pickled object where Forge expects a
  tensor is refused instead of unpickled.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from forge_lm.errors import ForgeError

_TORCH_NAMES = {"Size"} | {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
_ALLOWED = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}


class UnsafeCheckpointError(ForgeError):
    """A checkpoint would need arbitrary unpickling to load; it is refused."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and name in _TORCH_NAMES)
            or (module, name) in _ALLOWED
        )
        if not allowed:
            raise UnsafeCheckpointError(
                f"refusing to load this checkpoint: its metadata would import '{module}.{name}', which "
                "checkpoint metadata never needs. Only load checkpoints you trust, and this one not at all."
            )
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """A DCP filesystem reader whose metadata unpickler builds only known, harmless types."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"'{path}' does not hold checkpoint metadata.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """Loads tensors; refuses any item stored as pickled bytes."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise UnsafeCheckpointError(
            f"refusing to load '{read_item.dest_index.fqn}': the checkpoint stores it as a pickled object, "
            "and Forge checkpoints hold tensors only (plain state lives in JSON)."
        )
