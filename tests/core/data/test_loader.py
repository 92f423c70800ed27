"""BatchLoader: stacked samples, and a plain-data state that resumes bit for bit."""

from __future__ import annotations

import io

import pytest
import torch

from forge_lm.data.loader import BatchLoader
from forge_lm.errors import ForgeError


def plain(state):
    """Saved and loaded as a checkpoint is: torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def take_batches(loader, count):
    iterator = iter(loader)
    return [next(iterator) for _ in range(count)]


def test_batches_stack_consecutive_samples(build_dataset, byte_context):
    dataset = build_dataset("python_stdlib", {}, byte_context(seq_len=32))
    reference = build_dataset("python_stdlib", {}, byte_context(seq_len=32))
    samples = iter(reference)
    for batch in take_batches(BatchLoader(dataset, 4), 3):
        expected = [next(samples) for _ in range(4)]
        stacked = {key: torch.stack([sample[key] for sample in expected]) for key in expected[0]}
        documents = stacked["document_ids"]
        one_each = bool((documents == documents[:, :1]).all())
        # Document ids go only with batches that need them (see the next test).
        assert set(batch) == {"input_ids", "labels"} | (set() if one_each else {"document_ids"})
        for key, value in batch.items():
            assert value.shape == (4, 32)
            assert value.dtype == torch.long
            assert torch.equal(value, stacked[key])


def test_a_batch_of_single_document_rows_carries_no_document_ids():
    """Plain causal attention then: decided on the host, so the model need not ask the device."""

    def sample(first_doc: int, second_doc: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor([first_doc] * 3 + [second_doc] * 3)
        return {"input_ids": torch.arange(6), "labels": torch.arange(6), "document_ids": ids}

    single = next(iter(BatchLoader([sample(0, 0), sample(4, 4)], 2)))
    assert set(single) == {"input_ids", "labels"}
    mixed = next(iter(BatchLoader([sample(0, 0), sample(1, 2)], 2)))
    assert torch.equal(mixed["document_ids"], torch.tensor([[0] * 6, [1] * 3 + [2] * 3]))


@pytest.mark.parametrize(("name", "table"), [("python_stdlib", {}), ("synthetic", {})])
def test_a_loader_resumed_from_a_saved_state_yields_the_same_batches(build_dataset, byte_context, name, table):
    loader = BatchLoader(build_dataset(name, table, byte_context(seq_len=24)), 5)
    iterator = iter(loader)
    _ = [next(iterator) for _ in range(7)]
    state = plain(loader.state_dict())
    expected = [next(iterator) for _ in range(4)]
    resumed = BatchLoader(build_dataset(name, table, byte_context(seq_len=24)), 5)
    resumed.load_state_dict(state)
    for batch, again in zip(expected, take_batches(resumed, 4), strict=True):
        assert batch.keys() == again.keys()
        assert all(torch.equal(batch[k], again[k]) for k in batch)
    assert state["batches"] == 7


def test_loading_a_state_rewinds_a_loader_to_the_same_batches(build_dataset, byte_context):
    loader = BatchLoader(build_dataset("python_stdlib", {}, byte_context(split="eval")), 2)
    start = loader.state_dict()
    first = take_batches(loader, 3)
    loader.load_state_dict(start)
    second = take_batches(loader, 3)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, second, strict=True))


def test_a_finite_dataset_ends_the_loader_dropping_the_incomplete_batch():
    class Finite:
        def __iter__(self):
            return iter([{"x": torch.tensor([i])} for i in range(5)])

        def state_dict(self):
            return {}

    batches = list(BatchLoader(Finite(), 2))
    assert [batch["x"].tolist() for batch in batches] == [[[0], [1]], [[2], [3]]]


def test_samples_with_different_keys_are_an_error():
    class Ragged:
        def __iter__(self):
            yield {"input_ids": torch.zeros(2)}
            yield {"input_ids": torch.zeros(2), "labels": torch.zeros(2)}

    with pytest.raises(ForgeError, match="different keys"):
        next(iter(BatchLoader(Ragged(), 2)))
    with pytest.raises(ForgeError, match="batch_size must be at least 1"):
        BatchLoader(Ragged(), 0)
