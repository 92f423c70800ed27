"""Dataset contract: ``factory(options, context: DataContext) -> dataset``, an iterable of
``{"input_ids", "labels"}`` samples with ``state_dict()``/``load_state_dict()``.

Extra: ``context=DataContext(...)`` when the dataset needs particular sizes.
"""

from __future__ import annotations

import itertools

import torch

from forge_lm.components import IGNORE_INDEX, DataContext, ReadsBatches, SavesLocalState
from forge_lm.testing._kit import Subject, category_check, skip_check
from forge_lm.testing._tiny import plain_round_trip

DEFAULT_CONTEXT = DataContext(seq_len=16, vocab_size=64, seed=7)


def _context(subject: Subject, **changes: int) -> DataContext:
    import attrs

    return attrs.evolve(subject.extras.get("context", DEFAULT_CONTEXT), **changes)


def _take(dataset: object, count: int) -> list[dict[str, torch.Tensor]]:
    return list(itertools.islice(iter(dataset), count))


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True)
    )


def _first_difference(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> str:
    if len(a) != len(b):
        return f"{len(a)} samples against {len(b)}"
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return f"sample {index} differs"
    return "no difference"


@category_check("datasets")
def check_samples_have_the_documented_form(subject: Subject) -> None:
    context = _context(subject)
    for sample in _take(subject.build(context), 4):
        for key in ("input_ids", "labels"):
            value = sample.get(key)
            assert isinstance(value, torch.Tensor) and value.dtype == torch.long, (
                f"{subject.label}: sample['{key}'] is "
                f"{getattr(value, 'dtype', type(value).__name__)}; the kit expects a torch.long tensor"
            )
            assert value.shape == (context.seq_len,), (
                f"{subject.label}: sample['{key}'] has shape {tuple(value.shape)}; the kit expects "
                f"(seq_len,) = ({context.seq_len},)"
            )
        ids, labels = sample["input_ids"], sample["labels"]
        assert ids.min() >= 0 and ids.max() < context.vocab_size, (
            f"{subject.label}: token ids range from {ids.min().item()} to {ids.max().item()}; the kit expects "
            f"them within [0, vocab_size) = [0, {context.vocab_size})"
        )
        counted = labels[labels != IGNORE_INDEX]
        assert counted.numel() == 0 or (counted.min() >= 0 and counted.max() < context.vocab_size), (
            f"{subject.label}: labels range from {counted.min().item()} to {counted.max().item()}; the kit "
            f"expects them within [0, vocab_size) = [0, {context.vocab_size}) or equal to IGNORE_INDEX"
        )


@category_check("datasets")
def check_is_reproducible(subject: Subject) -> None:
    context = _context(subject)
    first, second = _take(subject.build(context), 5), _take(subject.build(context), 5)
    assert _same(first, second), (
        f"{subject.label}: two datasets built from the same context yield different samples "
        f"({_first_difference(first, second)}); the kit expects their first 5 samples identical"
    )


@category_check("datasets")
def check_state_round_trip_restores_the_next_sample(subject: Subject) -> None:
    """``state_dict()`` and, where the dataset has one, ``local_state_dict()`` (what a loader
    reading ahead notes per batch; see ``forge_lm.data.loader.local_state``)."""
    context = _context(subject)
    takers = [("state_dict", lambda dataset: dataset.state_dict())]
    if isinstance(subject.build(context), SavesLocalState):
        takers.append(("local_state_dict", lambda dataset: dataset.local_state_dict()))
    for method, take_state in takers:
        dataset = subject.build(context)
        iterator = iter(dataset)
        _ = [next(iterator) for _ in range(3)]
        state = plain_round_trip(take_state(dataset))
        expected = [next(iterator) for _ in range(4)]
        resumed = subject.build(context)
        resumed.load_state_dict(state)
        got = _take(resumed, 4)
        assert _same(got, expected), (
            f"{subject.label}: after load_state_dict of its {method}() the dataset does not continue where the "
            f"state was taken ({_first_difference(got, expected)} after 3 samples were taken); the kit expects "
            "the next 4 samples identical"
        )


@category_check("datasets")
def check_data_parallel_ranks_get_distinct_samples(subject: Subject) -> None:
    rank0 = _take(subject.build(_context(subject, dp_rank=0, dp_size=2)), 3)
    rank1 = _take(subject.build(_context(subject, dp_rank=1, dp_size=2)), 3)
    overlap = [i for i, a in enumerate(rank0) for b in rank1 if torch.equal(a["input_ids"], b["input_ids"])]
    assert not overlap, (
        f"{subject.label}: ranks 0 and 1 of 2 receive the same samples ({len(overlap)} of rank 0's first 3 "
        "also reach rank 1); the kit expects 0 in common"
    )


@category_check("datasets")
def check_read_batch_is_the_samples_stacked(subject: Subject) -> None:
    """A :class:`~forge_lm.components.ReadsBatches` dataset's ``read_batch(size)`` gives what
    ``size`` draws of its iterator give, stacked, and leaves the dataset where they would: the
    loader calls it instead of the iterator, so a difference would change what a run trains on."""
    context = _context(subject)
    if not isinstance(subject.build(context), ReadsBatches):
        skip_check(f"{subject.label} has no read_batch(): the loader draws its samples one by one")
    from forge_lm.data.loader import collate

    for size in (1, 3):
        reader, drawn = subject.build(context), subject.build(context)
        _ = reader.read_batch(2), _take(drawn, 2)  # the first batch is not special
        iterator = iter(drawn)
        expected = collate([next(iterator) for _ in range(size)])
        batch = reader.read_batch(size)
        assert batch is not None and dict(batch).keys() == expected.keys(), (
            f"{subject.label}: read_batch({size}) returned "
            f"{'None' if batch is None else sorted(dict(batch))} where {size} samples stack to keys "
            f"{sorted(expected)}; the kit expects the same keys"
        )
        different = [
            key
            for key, value in expected.items()
            if not isinstance(batch[key], torch.Tensor)
            or batch[key].dtype != value.dtype
            or not torch.equal(batch[key], value)
        ]
        assert not different, (
            f"{subject.label}: read_batch({size}) differs from {size} samples of its iterator stacked, in "
            f"{', '.join(different)}; the kit expects the same values and dtypes (the loader calls read_batch "
            "instead of the iterator)"
        )
        state = plain_round_trip(reader.state_dict())
        resumed = subject.build(context)
        resumed.load_state_dict(state)
        assert _same(_take(resumed, 2), [next(iterator) for _ in range(2)]), (
            f"{subject.label}: after read_batch(2) and read_batch({size}) its state_dict() does not name the "
            f"position after {2 + size} samples; the kit expects read_batch to advance the dataset as that many "
            "draws of its iterator do"
        )
