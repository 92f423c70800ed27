"""Pre-tokenized shards on disk: ``.npy`` arrays and raw ``.bin`` files with their metadata.

A ``.bin`` shard is the token ids as raw little-endian integers, nothing else, so its dtype
cannot be read from it (an even number of uint16 tokens has the size of half as many uint32
tokens). Its metadata file, the same name with ``.json``, states the dtype; it is required.
A ``.npy`` file carries its dtype; its metadata file is optional. Metadata keys:

- ``dtype`` (required for ``.bin``): one of :data:`DTYPES`;
- ``num_tokens``: checked against the file's size, which catches truncated copies;
- ``eos_id``, ``vocab_size``, ``tokenizer``: what the tokens were made with
  (``forge prepare-data`` writes them), checked against the run's tokenizer.

Shards are opened memory-mapped: only the windows read are loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from forge_lm.errors import ForgeError
from forge_lm.run_links import write_text

METADATA_FORMAT = "forge-lm-tokens/1"
DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype holding every id below ``vocab_size``: uint16 up to 65536 ids (ids
    0..65535), else uint32; little-endian, as shards are stored."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def metadata_path(shard: Path) -> Path:
    """The metadata file of ``shard``: ``tokens_000.bin`` -> ``tokens_000.json``."""
    return shard.with_suffix(".json")


@attrs.frozen
class Shard:
    path: Path
    tokens: np.ndarray  # 1-D, memory-mapped
    metadata: dict[str, Any]


def _little_endian(name: str, where: Path) -> np.dtype:
    if name not in DTYPES:
        raise ForgeError(f"{where} states dtype {name!r}, which is not a token dtype; use one of {', '.join(DTYPES)}.")
    return np.dtype(name).newbyteorder("<")


def read_metadata(shard: Path, *, required: bool) -> dict[str, Any]:
    path = metadata_path(shard)
    if not path.is_file():
        if required:
            raise ForgeError(
                f"shard '{shard}' has no metadata file '{path}'. A .bin file is raw token ids whose "
                f"dtype cannot be told from its size; write '{path}' containing "
                '{"dtype": "uint16"} (or the dtype it was written with: '
                f"{', '.join(DTYPES)}), or make the shards with 'forge prepare-data'."
            )
        return {}
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 and bad JSON are ValueErrors; nesting recurses
        raise ForgeError(
            f"metadata file '{path}' is not valid JSON ({exc}); fix it or prepare the data again."
        ) from None
    if not isinstance(metadata, dict):
        raise ForgeError(f'metadata file \'{path}\' must hold a JSON object such as {{"dtype": "uint16"}}.')
    for key, (kinds, what) in _METADATA_TYPES.items():
        value = metadata.get(key)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) or _negative(value)):
            raise ForgeError(
                f"metadata file '{path}' states {key} = {json.dumps(value)}, which is not {what}; fix it or prepare "
                "the data again."
            )
    return metadata


# The type each known metadata key must have: a file is data, and data is untrusted.
_METADATA_TYPES: dict[str, tuple[type | tuple[type, ...], str]] = {
    "dtype": (str, "a dtype name"),
    "num_tokens": (int, "a count of tokens"),
    "eos_id": (int, "a token id"),
    "vocab_size": (int, "a vocabulary size"),
    "tokenizer": ((str, dict), "a tokenizer's name or description"),
}


def _negative(value: Any) -> bool:
    return isinstance(value, int) and value < 0


def _check_count(shard: Path, metadata: dict[str, Any], count: int) -> None:
    stated = metadata.get("num_tokens")
    if stated is not None and stated != count:
        raise ForgeError(
            f"shard '{shard}' holds {count} tokens but its metadata states num_tokens = {stated}: the file "
            "is truncated or does not belong to this metadata. Copy it again or prepare the data again."
        )


def open_shard(path: Path) -> Shard:
    """The shard at ``path`` (``.bin`` or ``.npy``), memory-mapped and checked."""
    if path.suffix == ".npy":
        return _open_npy(path)
    if path.suffix == ".bin":
        return _open_bin(path)
    raise ForgeError(f"'{path}' is not a token shard; shards are .bin (with .json metadata) or .npy files.")


def _open_bin(path: Path) -> Shard:
    metadata = read_metadata(path, required=True)
    if "dtype" not in metadata:
        raise ForgeError(
            f"metadata file '{metadata_path(path)}' does not state the dtype of '{path}'; add "
            f'"dtype": one of {", ".join(DTYPES)}.'
        )
    dtype = _little_endian(metadata["dtype"], metadata_path(path))
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ForgeError(
            f"shard '{path}' has {size} bytes, not a whole number of {metadata['dtype']} tokens: the file is "
            "truncated or its metadata states the wrong dtype."
        )
    _check_count(path, metadata, size // dtype.itemsize)
    tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
    return Shard(path, tokens, metadata)


def _open_npy(path: Path) -> Shard:
    metadata = read_metadata(path, required=False)
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ForgeError(f"'{path}' is not a readable .npy file ({exc}); write it again with numpy.save.") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ForgeError(
            f"'{path}' holds a {tokens.ndim}-D array of {tokens.dtype}; a token shard is a 1-D integer array."
        )
    stated = metadata.get("dtype")
    if stated is not None and _little_endian(stated, metadata_path(path)) != tokens.dtype.newbyteorder("<"):
        raise ForgeError(f"'{path}' holds {tokens.dtype} but its metadata states dtype {stated!r}; fix the metadata.")
    _check_count(path, metadata, len(tokens))
    return Shard(path, tokens, metadata)


def write_shard_metadata(shard: Path, metadata: dict[str, Any]) -> None:
    """Create the metadata file of ``shard``. Anything already at its name, a link included, is never
    written through nor replaced: ``FileExistsError``."""
    body = {"format": METADATA_FORMAT, **metadata}
    write_text(metadata_path(shard), json.dumps(body, indent=2, sort_keys=True) + "\n", new=True)
