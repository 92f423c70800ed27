"""The files of a Hugging Face model directory: ``config.json`` and safetensors weights (one file,
or the shards of an index), written without following links and read as untrusted input.
``safetensors`` (the core's ``hf`` extra) is imported inside the functions that use it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from forge_lm.errors import ForgeError
from forge_lm.model.hf_fields import CONFIG_FILE
from forge_lm.run_links import LinkInRunDir
from forge_lm.safe_write import replacing, write_atomically

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"  # sharded checkpoints, as save_pretrained writes them


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ForgeError(
            "Hugging Face export and import need the safetensors package: pip install 'forge-lm[hf]'"
        ) from exc
    return safetensors.torch


def write_hf(out_dir: str | Path, hf_config: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    """Write a Hugging Face model directory: ``config.json`` and ``model.safetensors``.

    Neither is written through a link: a link at either name is refused (before anything is
    written). Each is written whole beside its place and renamed over it
    (:mod:`forge_lm.safe_write`), so an interrupted export leaves the files that were there."""
    st = _safetensors()
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in state.items()}
    out = make_export_dir(out_dir)
    refuse_export_links(out, (CONFIG_FILE, WEIGHTS_FILE))
    write_export_file(out / CONFIG_FILE, (json.dumps(hf_config, indent=2) + "\n").encode("utf-8"))
    with replacing(out / WEIGHTS_FILE) as partial:  # safetensors truncates it in place: it keeps its mode
        st.save_file(tensors, partial, metadata={"format": "pt"})
    return out


def check_export_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a path, refused when it is there and is not a directory."""
    out = Path(out_dir)
    if os.path.lexists(out) and not out.is_dir():
        raise ForgeError(
            f"'{out}' exists and is not a directory; give a directory to export into (a new one, or one of yours "
            "that holds no export)."
        )
    return out


def make_export_dir(out_dir: str | Path) -> Path:
    """``out_dir``, created if missing; a path that is there and is not a directory is refused."""
    out = check_export_dir(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:  # a level above it is a file
        raise ForgeError(f"cannot create the export directory '{out}': {exc.strerror}: '{exc.filename}'.") from None
    return out


def write_export_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole (:func:`forge_lm.safe_write.write_atomically`), never
    through a link there (``OSError`` ELOOP), a new file getting the mode ``open()`` gives one:
    an export is the user's files, not a run's."""
    write_atomically(path, data)


def refuse_export_links(out: Path, names: Iterable[str]) -> None:
    """Refuse (:class:`LinkInRunDir`, exit 2) the first of ``out``'s entries ``names`` that is a link."""
    for name in sorted(set(names)):
        path = out / name
        if os.path.islink(path):
            try:
                target = f" (to '{os.readlink(path)}')"
            except OSError:
                target = ""
            raise LinkInRunDir(
                f"'{path}' is a symbolic link{target}; an export does not write through links, so that it never "
                f"writes outside '{out}'. Remove the link, or export into another directory."
            )


def read_hf(hf_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json as a dict, Hugging Face state dict)`` of a model directory."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ForgeError(f"'{hf_dir}' has no {CONFIG_FILE}; give a directory written by save_pretrained or export_hf.")
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise ForgeError(f"'{config_path}' is not a JSON object; it is not a model's config.")
    return config, read_weights(hf_dir)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ForgeError(f"'{path}' is not valid JSON: {exc}") from None


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    st = _safetensors()
    try:
        return st.load_file(path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for a damaged file
        raise ForgeError(f"'{path}' is not a readable safetensors file: {exc}") from None


def read_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    if (hf_dir / WEIGHTS_FILE).is_file():
        return _load_safetensors(hf_dir / WEIGHTS_FILE)
    index = hf_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        listing = read_json(index)
        weight_map = listing.get("weight_map") if isinstance(listing, dict) else None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ForgeError(f"'{index}' has no weight_map of tensor names to shard files.")
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            path = hf_dir / shard
            # A shard is a file of this directory: never a path out of it, never a link.
            if Path(shard).name != shard or shard.startswith(".") or path.is_symlink() or not path.is_file():
                raise ForgeError(f"'{index}' names the shard {shard!r}, which is not a file in '{hf_dir}'.")
            state.update(_load_safetensors(path))
        return state
    raise ForgeError(
        f"'{hf_dir}' has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}; only safetensors weights import "
        "(re-save a .bin checkpoint with save_pretrained(safe_serialization=True))."
    )
