"""A checkpoint's metadata must cover every tensor with its chunks exactly once, each chunk with
exactly one storage entry: otherwise part of a tensor would silently keep the values it had
before loading (a freshly initialised parameter, an empty optimizer buffer)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from forge_lm.checkpoint._safe import DamagedCheckpointError, read_metadata

KEY = "state.model.weight"


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A DCP checkpoint of a 4x6 matrix, a scalar and an empty tensor, written the way Forge writes one."""
    tensors = {KEY: torch.arange(24.0).reshape(4, 6), "state.optimizer.step": torch.tensor(3.0)}
    tensors["state.trainer.empty"] = torch.zeros(0, 5)
    dcp.save(tensors, checkpoint_id=str(tmp_path), no_dist=True)
    return tmp_path


def edit(directory: Path, change) -> None:
    path = directory / ".metadata"
    with path.open("rb") as handle:
        metadata = pickle.load(handle)  # written by dcp.save above
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def set_chunks(metadata, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], storage: bool = True) -> None:
    """Give KEY the chunks ``(offsets, sizes)`` and (with ``storage``) one storage entry each,
    every one pointing at the whole tensor's bytes (enough bytes for any chunk of it)."""
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == KEY]
    metadata.state_dict_metadata[KEY].chunks = [
        ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes
    ]
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != KEY}
    if storage:
        for index, (offsets, _) in enumerate(boxes):
            metadata.storage_data[MetadataIndex(KEY, torch.Size(offsets), index)] = info


def test_what_dcp_writes_is_accepted(saved):
    metadata = read_metadata(saved)
    assert metadata.state_dict_metadata[KEY].chunks[0].sizes == torch.Size([4, 6])


def test_a_grid_of_chunks_that_tiles_the_tensor_is_accepted(saved):
    edit(saved, lambda m: set_chunks(m, [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]))
    assert len(read_metadata(saved).state_dict_metadata[KEY].chunks) == 4


@pytest.mark.parametrize(
    ("boxes", "problem"),
    [
        ([], "do not cover it: they hold 0 of its 24"),
        ([((0, 0), (2, 6))], "do not cover it: they hold 12 of its 24"),
        ([((0, 0), (3, 6)), ((1, 0), (1, 6))], "overlap"),  # 24 elements, but rows 1 twice and 3 never
        ([((0, 0), (2, 6)), ((1, 0), (2, 6))], "overlap"),
        ([((0, 0), (4, 6)), ((0, 0), (0, 6))], "begin at the same place"),  # an empty chunk where another begins
        ([((0, 0), (4, 3)), ((0, 2), (4, 3))], "overlap"),  # 24 elements, column 2 twice, 5 never
        ([((0, 0), (4, 4)), ((0, 3), (4, 1)), ((0, 5), (4, 1))], "overlap"),  # column 3 twice, 4 never
    ],
    ids=["no-chunks", "half-the-rows", "overlap-with-a-gap", "overlap", "same-offset-twice", "columns", "col-gap"],
)
def test_chunks_that_do_not_tile_the_tensor_are_damage(saved, boxes, problem):
    edit(saved, lambda m: set_chunks(m, boxes))
    with pytest.raises(DamagedCheckpointError, match=problem):
        read_metadata(saved)


def test_a_chunk_without_storage_is_damage(saved):
    edit(saved, lambda m: set_chunks(m, [((0, 0), (4, 6))], storage=False))
    with pytest.raises(DamagedCheckpointError, match=r"no storage is listed for the chunk of 'state\.model\.weight'"):
        read_metadata(saved)


def test_storage_where_no_chunk_begins_is_damage(saved):
    def change(metadata) -> None:
        (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == KEY]
        metadata.storage_data[MetadataIndex(KEY, torch.Size([2, 0]), 1)] = info

    edit(saved, change)
    with pytest.raises(DamagedCheckpointError, match=r"at \(2, 0\), where no chunk of it begins"):
        read_metadata(saved)


def test_storage_without_an_offset_is_damage(saved):
    def change(metadata) -> None:
        (index,) = [k for k in metadata.storage_data if k.fqn == KEY]
        metadata.storage_data[MetadataIndex(KEY, None, 0)] = metadata.storage_data.pop(index)

    edit(saved, change)
    with pytest.raises(DamagedCheckpointError):
        read_metadata(saved)


@pytest.mark.parametrize("key", ["state.optimizer.step", "state.trainer.empty"])
def test_every_tensor_is_checked_scalars_and_empty_ones_too(saved, key):
    def change(metadata) -> None:
        tensor = metadata.state_dict_metadata[key]
        (chunk,) = tensor.chunks
        tensor.chunks = [chunk, chunk]  # twice: a scalar counted twice; an empty one's storage entry is shared

    edit(saved, change)
    with pytest.raises(DamagedCheckpointError):
        read_metadata(saved)
