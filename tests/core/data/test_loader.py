"""BatchLoader: stacked samples, and a plain-data state that resumes bit for bit."""

from __future__ import annotations

import gc
import io
import itertools
import threading
import time

import numpy as np
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


# -- reading ahead: what the training loop asks for on CUDA ------------------------------------


READER = "forge-batch-reader"


def reader_threads():
    return [thread for thread in threading.enumerate() if thread.name == READER]


class CountingDataset:
    """A dataset that counts the samples drawn and names the threads that drew them."""

    def __init__(self, dataset):
        self.dataset, self.drawn, self.threads = dataset, 0, set()

    def __iter__(self):
        for sample in self.dataset:
            self.drawn += 1
            self.threads.add(threading.current_thread().name)
            yield sample

    def state_dict(self):
        return self.dataset.state_dict()

    def load_state_dict(self, state):
        self.dataset.load_state_dict(state)


class ListDataset:
    """Given samples, in order, with their position as the state."""

    def __init__(self, samples):
        self.samples, self.position = samples, 0

    def __iter__(self):
        while self.position < len(self.samples):
            self.position += 1
            yield self.samples[self.position - 1]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def wait_for(condition):
    """Poll until ``condition()`` holds (the reader thread works on its own time); fail after a minute."""
    for _ in range(6000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("the reader thread did not get there")


def same_batches(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("name", "table"), [("python_stdlib", {}), ("synthetic", {})])
def test_a_reading_ahead_loader_saves_the_position_of_the_batches_handed_out(build_dataset, byte_context, name, table):
    """The state saved after k batches is the one the plain loader saves, although the reader
    has already drawn batch k + 1; a fresh loader restored from it yields the next batches."""
    reference_loader = BatchLoader(build_dataset(name, table, byte_context(seq_len=24)), 5)
    reference = take_batches(reference_loader, 11)
    reference_loader = BatchLoader(build_dataset(name, table, byte_context(seq_len=24)), 5)
    take_batches(reference_loader, 7)
    reference_state = plain(reference_loader.state_dict())

    counting = CountingDataset(build_dataset(name, table, byte_context(seq_len=24)))
    loader = BatchLoader(counting, 5, read_ahead=True)
    iterator = iter(loader)
    handed_out = [next(iterator) for _ in range(7)]
    wait_for(lambda: counting.drawn == 8 * 5)  # batch 8 is read while batch 7 is in use
    state = plain(loader.state_dict())
    assert state == reference_state
    assert state["batches"] == 7
    same_batches(handed_out, reference[:7])
    same_batches([next(iterator) for _ in range(2)], reference[7:9])  # saving did not disturb the run
    assert counting.threads == {READER}  # the samples were read off the training thread

    resumed = BatchLoader(build_dataset(name, table, byte_context(seq_len=24)), 5, read_ahead=True)
    resumed.load_state_dict(state)
    same_batches(take_batches(resumed, 4), reference[7:11])
    loader.close()
    resumed.close()
    assert not reader_threads()


def test_reading_ahead_pins_every_batch_in_the_reader_thread(build_dataset, byte_context, monkeypatch):
    """Pinning needs CUDA, which this machine lacks: Tensor.pin_memory is replaced by a recorder
    that returns a copy, as the real one does."""
    pinned = []

    def pin_memory(self, *args, **kwargs):
        pinned.append((threading.current_thread().name, tuple(self.shape)))
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    reference = take_batches(BatchLoader(build_dataset("synthetic", {}, byte_context(seq_len=8)), 3), 4)
    assert not pinned  # the plain loader pins nothing
    loader = BatchLoader(build_dataset("synthetic", {}, byte_context(seq_len=8)), 3, read_ahead=True, pin_memory=True)
    batches = take_batches(loader, 4)
    loader.close()
    same_batches(batches, reference)
    keys = len(reference[0])
    # Every tensor of the 4 batches handed out, and of the 5th read ahead, off the training thread.
    assert pinned[: 4 * keys] == [(READER, (3, 8))] * (4 * keys)
    assert len(pinned) in (4 * keys, 5 * keys)


def test_closing_ends_the_reader_and_puts_the_read_ahead_batch_back(build_dataset, byte_context):
    reference = take_batches(BatchLoader(build_dataset("synthetic", {}, byte_context()), 2), 6)
    counting = CountingDataset(build_dataset("synthetic", {}, byte_context()))
    loader = BatchLoader(counting, 2, read_ahead=True)
    same_batches(take_batches(loader, 3), reference[:3])
    assert len(reader_threads()) == 1
    wait_for(lambda: counting.drawn == 4 * 2)
    loader.close()
    assert not reader_threads()
    assert loader.state_dict()["batches"] == 3
    same_batches(take_batches(loader, 3), reference[3:6])  # iterating again goes on after batch 3
    loader.close()
    assert not reader_threads()


def test_a_bad_batch_read_ahead_fails_in_the_training_thread_at_its_turn(byte_context, build_dataset):
    samples = take_batches(BatchLoader(build_dataset("synthetic", {}, byte_context(seq_len=4)), 1), 5)
    samples = [{key: value[0] for key, value in sample.items()} for sample in samples]
    samples[3] = {**samples[3], "input_ids": torch.full((4,), 999)}  # outside a 257-id vocabulary
    loader = BatchLoader(ListDataset(samples), 1, vocab_size=257, read_ahead=True)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(3)]  # the reader has hit batch 4 meanwhile: not raised yet
    assert torch.equal(first[2]["input_ids"][0], samples[2]["input_ids"])
    with pytest.raises(ForgeError, match=r"the data \(batch 4\) holds input_ids outside .* 999"):
        next(iterator)
    assert not reader_threads()
    with pytest.raises(StopIteration):  # like a generator that raised
        next(iterator)
    assert loader.state_dict()["batches"] == 3


def test_a_dropped_reading_loader_lets_its_thread_end(build_dataset, byte_context):
    loader = BatchLoader(build_dataset("synthetic", {}, byte_context()), 2, read_ahead=True)
    take_batches(loader, 2)
    (thread,) = reader_threads()
    del loader
    gc.collect()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_loading_a_state_into_a_reading_loader_drops_the_batch_read_ahead(build_dataset, byte_context):
    """What a rollback does (resilience.nan_policy = "rollback"): the loader's state is loaded
    while its iterator is running; that same iterator then yields from the loaded position."""
    reference = take_batches(BatchLoader(build_dataset("python_stdlib", {}, byte_context()), 2), 8)
    loader = BatchLoader(build_dataset("python_stdlib", {}, byte_context()), 2, read_ahead=True)
    iterator = iter(loader)
    _ = [next(iterator) for _ in range(2)]
    at_two = loader.state_dict()
    same_batches([next(iterator) for _ in range(3)], reference[2:5])
    loader.load_state_dict(at_two)
    assert not reader_threads()  # stopped before the dataset was touched
    same_batches([next(iterator) for _ in range(6)], reference[2:8])
    loader.close()


def test_a_reading_ahead_loader_ends_a_finite_dataset_as_the_plain_one_does():
    samples = [{"input_ids": torch.arange(3) + i, "labels": torch.arange(3)} for i in range(7)]
    plain_loader = BatchLoader(ListDataset(samples), 2)
    reading = BatchLoader(ListDataset(samples), 2, read_ahead=True)
    same_batches(list(reading), list(plain_loader))  # 3 batches; the odd sample is dropped
    assert reading.state_dict() == plain_loader.state_dict() == {"dataset": {"position": 7}, "batches": 3}
    assert not reader_threads()


class BatchReadingDataset(ListDataset):
    """A :class:`ListDataset` that also reads whole batches, counting the calls of each kind."""

    def __init__(self, samples, batch=None):
        super().__init__(samples)
        self.batch_reads, self.threads, self.batch = 0, set(), batch

    def __iter__(self):
        raise AssertionError("a dataset that reads batches is not iterated by the loader")

    def read_batch(self, size):
        self.batch_reads += 1
        self.threads.add(threading.current_thread().name)
        if self.batch is not None:  # a stand-in for a broken read_batch
            return self.batch
        if self.position + size > len(self.samples):
            return None
        chosen, self.position = self.samples[self.position : self.position + size], self.position + size
        return {key: torch.stack([sample[key] for sample in chosen]) for key in chosen[0]}


def _counting_samples(count):
    return [{"input_ids": torch.arange(4) + i, "labels": torch.arange(1, 5) + i} for i in range(count)]


@pytest.mark.parametrize("read_ahead", [False, True])
def test_a_dataset_that_reads_batches_is_asked_for_whole_batches(read_ahead):
    dataset = BatchReadingDataset(_counting_samples(7))
    loader = BatchLoader(dataset, 3, vocab_size=16, seq_len=4, read_ahead=read_ahead)
    batches = list(loader)  # 7 samples: two batches of 3, the seventh dropped
    assert [batch["input_ids"][:, 0].tolist() for batch in batches] == [[0, 1, 2], [3, 4, 5]]
    assert torch.equal(batches[1]["labels"], torch.arange(1, 5) + torch.tensor([[3], [4], [5]]))
    assert dataset.batch_reads == 3  # the third found the end
    assert dataset.threads == ({READER} if read_ahead else {threading.current_thread().name})
    loader.close()


def test_the_text_datasets_batches_are_their_samples_read_one_by_one(byte_context):
    """The built-in datasets read batches (``read_batch``) and samples from a block read ahead;
    over shard boundaries, epochs, samples drawn between batches and a restore, each is what
    reading its window alone gives."""
    from forge_lm.data.loader import collate
    from forge_lm.data.packing import TokenStream
    from forge_lm.data.sampler import WindowSampler
    from forge_lm.data.windows import WindowDataset

    tokens = np.random.default_rng(1).integers(0, 257, 700)
    tokens[::37] = 256  # documents
    parts = [tokens[:100].astype(np.uint16), tokens[100:101], tokens[101:450], tokens[450:]]
    context = byte_context(seq_len=16, dp_rank=1, dp_size=2)

    def dataset():
        return WindowDataset(TokenStream(parts), context, eos_id=256, source="the stream")

    # The reference: each window read on its own (TokenStream.read, window_sample), in the order
    # a sampler of its own gives, position by position.
    by_batches, reference = dataset(), dataset()
    order = WindowSampler(len(reference), seed=context.seed, dp_rank=1, dp_size=2)
    samples = (reference.sample(order.next_index()) for _ in itertools.count())
    drawn_between = iter(by_batches)
    for index in range(9):  # 9 x 5 x 2 ranks > 43 windows: into the third epoch
        batch = by_batches.read_batch(5)
        expected = collate([next(samples) for _ in range(5)])
        assert batch.keys() == expected.keys()
        assert all(torch.equal(batch[key], expected[key]) and batch[key].is_contiguous() for key in batch)
        if index % 3 == 1:  # a sample drawn by the iterator between two batches: the batches move on past it
            between, alone = next(drawn_between), next(samples)
            assert all(torch.equal(value, alone[key]) for key, value in between.items())
    assert by_batches.state_dict() == {"sampler": order.state_dict()}
    resumed = dataset()
    resumed.load_state_dict(plain(by_batches.state_dict()))
    expected = collate([next(samples) for _ in range(4)])
    assert all(torch.equal(value, expected[key]) for key, value in resumed.read_batch(4).items())


@pytest.mark.parametrize(
    ("batch", "named"),
    [
        ([torch.zeros(3, 4)], "returned [tensor("),
        ({"input_ids": torch.zeros(3, 4, dtype=torch.long), "labels": [1, 2]}, "a dict holding Tensor, list"),
        ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}, "[2, 4]"),
        ({"input_ids": torch.zeros((), dtype=torch.long)}, "shape []"),
    ],
)
def test_a_read_batch_that_is_not_a_batch_of_the_size_asked_is_refused(batch, named):
    from forge_lm.data.loader import BadBatch

    loader = BatchLoader(BatchReadingDataset(_counting_samples(3), batch=batch), 3, vocab_size=16, seq_len=4)
    with pytest.raises(BadBatch, match="read_batch") as caught:
        next(iter(loader))
    assert named in str(caught.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_document_ids_that_go_down_are_refused_whatever_their_integer_type(dtype):
    """Unsigned ids too: a decrease is not read as a large step up (a wrap-around)."""
    from forge_lm.data.loader import BadBatch

    def sample(documents):
        return {
            "input_ids": torch.arange(4),
            "labels": torch.arange(4),
            "document_ids": torch.tensor(documents, dtype=dtype),
        }

    good = next(iter(BatchLoader([sample([0, 0, 1, 1]), sample([0, 1, 2, 3])], 2, vocab_size=8, seq_len=4)))
    assert good["document_ids"].tolist() == [[0, 0, 1, 1], [0, 1, 2, 3]]
    with pytest.raises(BadBatch, match="go down along a row"):
        next(iter(BatchLoader([sample([0, 0, 1, 1]), sample([0, 2, 1, 3])], 2, vocab_size=8, seq_len=4)))


@pytest.mark.parametrize(("ids", "bad"), [([0, 3, 8, 1], "8"), ([0, -1, 2, 1], "-1")])
def test_ids_outside_the_vocabulary_are_named(ids, bad):
    sample = {"input_ids": torch.tensor(ids), "labels": torch.tensor([1, 2, 3, 4])}
    with pytest.raises(ForgeError, match=rf"input_ids outside the model's vocabulary of 8 ids \(0 to 7\): {bad}\."):
        next(iter(BatchLoader([sample], 1, vocab_size=8, seq_len=4)))
    labels = {"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([1, -100, 2, 3])}  # the ignore index
    assert next(iter(BatchLoader([labels], 1, vocab_size=8, seq_len=4)))["labels"].tolist() == [[1, -100, 2, 3]]
