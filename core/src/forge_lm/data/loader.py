"""``BatchLoader``: samples of a dataset stacked into batches, resumable batch for batch.

By default the loader reads samples in the training thread, one batch at a time: the
dataset's state then always names the first sample of the next batch, so saving it is saving
the loader. With ``read_ahead`` (what the training loop asks for on CUDA), a background thread
reads the next batch while training uses the current one, and ``pin_memory`` puts each batch in
page-locked memory, from which the ``non_blocking`` copy to the GPU runs asynchronously. The
saved state still describes the batches handed out, not the one read ahead: the thread reads
only between two hand-outs, so the dataset is touched by one thread at a time, and at each
hand-out the loader notes the dataset's state (then the position after the batch handed out)
before letting the thread read on. That note is taken in the training thread, once per batch,
and the dataset's iterator runs in the background thread: it must draw its randomness from its
own generators, as the built-in datasets do, not from the global ones that training also uses.
The note is the dataset's ``local_state_dict()`` where it has one (:func:`local_state`): this
rank's position alone, for a dataset whose ``state_dict()`` gathers every data-parallel rank's
position (a collective, such as the streaming ``hf_text``'s), which would otherwise run once per
batch. The full state is then built when it is asked for (a checkpoint): the reader stops, the
dataset goes back to the noted position and gives its ``state_dict()``, and the batch that was
read ahead is read again after it.

Given the model's ``vocab_size``, the loader checks every batch before the model sees it:
token ids must be integers the embedding holds (labels may also be the ignore index), whatever
dataset (a plugin's too) produced them. An id outside the vocabulary would otherwise be an
``IndexError`` deep in the embedding on CPU, or a device-side assert that kills the process on
CUDA; here it is a :class:`ForgeError` naming the data, the ids and the fix, at the first batch.
A batch the training loop cannot use as it is (a sample that is not a dict of tensors, ids that
are not int64, labels or document ids of another shape than the inputs, sequences of another
length than the run's, document ids that go down along a row) is a :class:`BadBatch`: the
dataset's fault, which the loop reports naming it (:mod:`forge_lm.train.guards`). All of these
checks read the batch on the host, before it goes to the device.

A dataset that reads a whole batch at once (:class:`~forge_lm.components.ReadsBatches`, as the
built-in text datasets do) is asked for each batch with ``read_batch(batch_size)`` instead of
``batch_size`` draws of its iterator; what it returns is checked as a stacked batch is (a dict
of tensors, each ``batch_size`` samples), then as any batch.
"""

from __future__ import annotations

import copy
import functools
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from forge_lm.components import IGNORE_INDEX, ReadsBatches, SavesLocalState
from forge_lm.errors import ForgeError


class BadBatch(ForgeError):
    """A batch whose samples break the dataset contract (see the module docstring)."""


class BatchLoader:
    """Batches of ``batch_size`` samples: a dict of tensors ``[batch_size, *sample_shape]``.

    With ``vocab_size``, each batch's token ids are checked (:func:`check_token_ids`);
    ``source`` names the data in the message; with ``seq_len``, every sequence must have that
    length (:func:`check_layout`). ``read_ahead``: read the next batch in a
    background thread (see the module docstring); ``pin_memory``: hand out batches in pinned
    host memory (needs CUDA). :meth:`close` stops the thread."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        vocab_size: int | None = None,
        source: str = "the data",
        *,
        read_ahead: bool = False,
        pin_memory: bool = False,
        seq_len: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ForgeError(f"batch_size must be at least 1, got {batch_size}.")
        self.dataset = dataset
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.source = source
        self.read_ahead = read_ahead
        self.pin_memory = pin_memory
        self.seq_len = seq_len
        self.batches = 0  # batches handed out since the start of the run (kept in the state)
        self._reader: _ReadAhead | None = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # A fresh dataset iterator per call: after load_state_dict, iter(loader) starts at the
        # restored position even for datasets whose iterators keep their own position.
        if self.read_ahead:
            self.close()  # the dataset has one position: one reader at a time
            self._reader = _ReadAhead(self)
            return self._reader
        return self._read_here()

    def _read_here(self) -> Iterator[dict[str, torch.Tensor]]:
        draw = batch_drawer(self.dataset)
        while True:
            batch = _read_batch(draw, self.batches + 1, **self._read_options())
            if batch is None:
                return
            self.batches += 1
            yield batch

    def _read_options(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "vocab_size": self.vocab_size,
            "source": self.source,
            "pin_memory": self.pin_memory,
            "seq_len": self.seq_len,
        }

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out (a batch read ahead is not counted)."""
        reader = self._reader
        if reader is not None and reader.handed_out is not None:
            if not reader.noted_locally:
                return copy.deepcopy(reader.handed_out)
            # A local note: back to it, for the dataset's full state (the module docstring).
            reader.stop(rewind=True)
        return {"dataset": self.dataset.state_dict(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._reader is not None:  # a batch read ahead came from the old position: dropped
            self._reader.stop(rewind=False)
        self.dataset.load_state_dict(state["dataset"])
        self.batches = int(state.get("batches", 0))

    def close(self) -> None:
        """End the background thread, if any, and put the dataset back at the position after the
        last batch handed out (a batch read ahead is dropped). Iterating again starts there."""
        if self._reader is not None:
            reader, self._reader = self._reader, None
            reader.close()


def local_state(dataset: Any) -> tuple[Any, bool]:
    """``(state, local)``: the dataset's ``local_state_dict()`` (``local`` True) where it has one,
    else its ``state_dict()``. A dataset whose ``state_dict()`` talks to other ranks offers
    ``local_state_dict()``: this rank's position without any collective, which its
    ``load_state_dict`` restores on the same rank."""
    if isinstance(dataset, SavesLocalState) and callable(dataset.local_state_dict):
        return dataset.local_state_dict(), True
    return dataset.state_dict(), False


_STOP = 0  # a request to the reader thread: the number of the batch to read, or this


class _ReadAhead:
    """A :class:`BatchLoader`'s batches, each read in a background thread while the one before it
    is in use. The thread reads one batch per request and waits between requests."""

    def __init__(self, loader: BatchLoader) -> None:
        self._loader = loader
        self._thread: threading.Thread | None = None  # started by the first next()
        self._requests: queue.Queue[int] = queue.Queue()
        self._results: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._finished = False
        # The loader's state after the last batch handed out, noted while the thread waited, and
        # whether its dataset part is the dataset's local_state_dict() (see local_state).
        self.handed_out: dict[str, Any] | None = None
        self.noted_locally = False

    def __iter__(self) -> _ReadAhead:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._finished:
            raise StopIteration
        if self._thread is None:
            self._start()
        kind, value = self._results.get()
        loader = self._loader
        if kind == "error":
            self._finished = True
            self._join()
            raise value
        if kind == "batch":
            loader.batches += 1
        # The thread waits for the next request: the dataset stands right after what was handed out.
        self._note()
        if kind == "end":
            self._finished = True
            self._join()
            raise StopIteration
        self._requests.put(loader.batches + 1)  # the next batch is read while this one is used
        return value

    def _note(self) -> None:
        """Note the loader's position while the thread waits (the dataset is not being read)."""
        state, self.noted_locally = local_state(self._loader.dataset)
        self.handed_out = {"dataset": copy.deepcopy(state), "batches": self._loader.batches}

    def _start(self) -> None:
        loader = self._loader
        self._note()
        # Pinned memory is allocated through the current GPU's context; a new thread's current
        # GPU is GPU 0, so without this every rank of a node would open a context there.
        device = torch.cuda.current_device() if loader.pin_memory and torch.cuda.is_available() else None
        self._requests, self._results = queue.Queue(), queue.Queue()
        # The thread holds no reference to the loader (nor to this reader): a loader dropped
        # without close() is collected, and __del__ below tells the thread to end.
        read = functools.partial(_read_batch, batch_drawer(loader.dataset), **loader._read_options())
        self._thread = threading.Thread(
            target=_read_batches,
            args=(read, self._requests, self._results, device),
            name="forge-batch-reader",
            daemon=True,  # a dataset stuck in a read never keeps the process from exiting
        )
        self._thread.start()
        self._requests.put(loader.batches + 1)

    def _join(self) -> None:
        if self._thread is not None:
            self._requests.put(_STOP)  # heard once the thread has finished a read in progress
            self._thread.join()
            self._thread = None

    def stop(self, rewind: bool) -> None:
        """End the thread; ``rewind``: put the dataset back after the last batch handed out. The
        next ``next()`` starts a thread again, from wherever the dataset then stands."""
        started = self._thread is not None
        self._join()
        if rewind and started and self.handed_out is not None:
            self._loader.dataset.load_state_dict(self.handed_out["dataset"])
        self.handed_out = None

    def close(self) -> None:
        self.stop(rewind=True)
        self._finished = True

    def __del__(self) -> None:
        if self._thread is not None:  # dropped without close(): let the thread end on its own
            self._requests.put(_STOP)


def _read_batches(
    read: Callable[[int], dict[str, torch.Tensor] | None],
    requests: queue.Queue[int],
    results: queue.Queue[tuple[str, Any]],
    device: int | None,
) -> None:
    """The reader thread: one batch per request, until told to stop or the data ends or fails."""
    if device is not None:
        torch.cuda.set_device(device)
    while (number := requests.get()) != _STOP:
        try:
            batch = read(number)
        except BaseException as exc:  # noqa: BLE001 - raised again in the training thread
            results.put(("error", exc))
            return
        if batch is None:
            results.put(("end", None))
            return
        results.put(("batch", batch))


def batch_drawer(dataset: Any) -> Callable[[int], dict[str, torch.Tensor] | None]:
    """A function that takes the next ``size`` samples of ``dataset`` stacked (None at its end):
    its ``read_batch`` (:class:`~forge_lm.components.ReadsBatches`), checked, or draws of one
    iterator of it, collated."""
    if isinstance(dataset, ReadsBatches) and callable(dataset.read_batch):
        return functools.partial(_read_whole_batch, dataset.read_batch)
    samples = iter(dataset)

    def draw(size: int) -> dict[str, torch.Tensor] | None:
        try:
            batch = [next(samples) for _ in range(size)]
        except StopIteration:
            return None
        return collate(batch)

    return draw


def _read_whole_batch(read_batch: Callable[[int], Any], size: int) -> dict[str, torch.Tensor] | None:
    batch = read_batch(size)
    if batch is None:
        return None
    if not isinstance(batch, Mapping) or not batch or not all(isinstance(v, torch.Tensor) for v in batch.values()):
        got = (
            f"a dict holding {', '.join(sorted({type(v).__name__ for v in batch.values()}))}"
            if isinstance(batch, Mapping) and batch
            else f"{batch!r}"[:80]
        )
        raise BadBatch(f"returned {got} from read_batch({size}); a batch is a dict of tensors [batch_size, ...]")
    for key, value in batch.items():
        if value.ndim < 1 or value.shape[0] != size:
            raise BadBatch(
                f"returned {key} of shape {list(value.shape)} from read_batch({size}); each tensor of a batch "
                f"holds batch_size = {size} samples along its first dimension"
            )
    return dict(batch)


def _read_batch(
    draw: Callable[[int], dict[str, torch.Tensor] | None],
    number: int,
    *,
    batch_size: int,
    vocab_size: int | None,
    source: str,
    pin_memory: bool,
    seq_len: int | None = None,
) -> dict[str, torch.Tensor] | None:
    """Batch ``number`` (counted over the run) from ``draw`` (:func:`batch_drawer`), checked and
    ready to hand out; None at the end of a finite dataset (its incomplete last batch is dropped)."""
    collated = draw(batch_size)
    if collated is None:
        return None
    steps = document_steps(collated.get("document_ids"))
    if vocab_size is not None:
        check_token_ids(collated, vocab_size, f"{source} (batch {number})")
        check_layout(collated, seq_len, f"batch {number}", steps)
    collated = without_trivial_documents(collated, steps)
    if pin_memory:
        collated = {key: value.pin_memory() for key, value in collated.items()}
    return collated


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack each key of ``samples`` along a new first dimension."""
    for index, sample in enumerate(samples):
        if not isinstance(sample, Mapping) or not all(isinstance(v, torch.Tensor) for v in sample.values()):
            got = "None" if sample is None else f"a {type(sample).__name__}"
            if isinstance(sample, Mapping):
                got = f"a dict holding {', '.join(sorted({type(v).__name__ for v in sample.values()}))}"
            raise BadBatch(f"yielded {got} as a sample (sample {index} of a batch); a sample is a dict of tensors")
    keys = samples[0].keys()
    for sample in samples[1:]:
        if sample.keys() != keys:
            raise ForgeError(
                f"the dataset yields samples with different keys ({sorted(keys)} and {sorted(sample.keys())}); "
                "every sample of a dataset must have the same keys."
            )
    shapes = {key: {tuple(sample[key].shape) for sample in samples} for key in keys}
    uneven = {key: sorted(found) for key, found in shapes.items() if len(found) > 1}
    if uneven:
        key, found = next(iter(uneven.items()))
        raise BadBatch(
            f"yielded samples whose {key} have different shapes ({', '.join(str(list(s)) for s in found[:3])}); "
            "every sample of a run has the same shape"
        )
    return {key: torch.stack([sample[key] for sample in samples]) for key in keys}


def document_steps(documents: torch.Tensor | None) -> tuple[int, int] | None:
    """The least and the greatest change of the document id from one position of a row to the
    next (``(0, 0)`` for rows of one position), read from the host: one reduction for both checks
    that use it. None when there are no document ids on the host to read (none, or on a device)."""
    if (
        not isinstance(documents, torch.Tensor)
        or documents.device.type != "cpu"
        or documents.ndim != 2
        or documents.dtype.is_floating_point
        or documents.dtype.is_complex
        or documents.dtype == torch.bool
    ):
        return None
    if documents.shape[0] == 0 or documents.shape[1] < 2:
        return (0, 0)
    # In numpy, on a view of the tensor: a few microseconds where torch's dispatch costs ten times
    # that between two steps. As int64, so that a decrease of unsigned ids is not a wrap-around.
    steps = np.diff(documents.detach().numpy().astype(np.int64, copy=False), axis=1)
    return int(steps.min()), int(steps.max())


def _id_range(ids: torch.Tensor) -> tuple[int, int]:
    """The least and the greatest of integer ``ids`` (not empty); read in numpy on the host."""
    if ids.device.type == "cpu":
        array = ids.detach().numpy()
        return int(array.min()), int(array.max())
    low, high = torch.aminmax(ids)
    return int(low), int(high)


def check_layout(
    batch: dict[str, torch.Tensor], seq_len: int | None, where: str, steps: tuple[int, int] | None = None
) -> None:
    """What the model and the loss need of a training batch beyond its ids' range (a
    :class:`BadBatch` otherwise): ``input_ids`` and ``labels`` int64 ``[batch, seq_len]``,
    ``document_ids`` (optional) integers of the same shape, never decreasing along a row (a
    document is one run of tokens). Shapes and dtypes are metadata; the order of document ids
    is read on the host, where the batch still is (``steps``: :func:`document_steps` of them,
    when the caller has it already)."""
    inputs = batch.get("input_ids")
    if inputs is None or "labels" not in batch:
        raise BadBatch(f"yielded samples without {'input_ids' if inputs is None else 'labels'} ({where})")
    for key in ("input_ids", "labels"):
        ids = batch[key]
        if ids.dtype != torch.int64:
            raise BadBatch(f"yielded {key} of dtype {_dtype(ids)} ({where}); token ids must be int64 (torch.long)")
    if inputs.ndim != 2 or (seq_len is not None and inputs.shape[1] != seq_len):
        per_sample = list(inputs.shape[1:])
        wanted = f"[{seq_len}] ([train] seq_len)" if seq_len is not None else "[seq_len]"
        raise BadBatch(f"yielded input_ids of shape {per_sample} per sample ({where}); the run's samples are {wanted}")
    for key in ("labels", "document_ids"):
        other = batch.get(key)
        if other is not None and other.shape != inputs.shape:
            raise BadBatch(
                f"yielded {key} of shape {list(other.shape[1:])} per sample beside input_ids of shape "
                f"{list(inputs.shape[1:])} ({where}); they must have the same shape"
            )
    documents = batch.get("document_ids")
    if documents is None:
        return
    if documents.dtype.is_floating_point or documents.dtype.is_complex or documents.dtype == torch.bool:
        raise BadBatch(f"yielded document_ids of dtype {_dtype(documents)} ({where}); document ids are integers")
    if steps is None:
        steps = document_steps(documents)
    if steps is not None and steps[0] < 0:
        raise BadBatch(
            f"yielded document_ids that go down along a row ({where}); a document is one run of tokens, its id "
            "is the number of documents before it in the row (never decreasing)"
        )


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def without_trivial_documents(
    batch: dict[str, torch.Tensor], steps: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """``batch`` without its ``document_ids`` when every row holds one document.

    Attention is then plain causal attention, which the model runs with its fused causal
    kernels when it gets no document ids. Deciding it here, on the host, before the batch goes
    to the device, spares the model a check on the device, which would make the host wait for
    the device at every micro-batch. ``steps``: :func:`document_steps` of the document ids, when
    the caller has it already (one row holds one document when no id changes along it)."""
    ids = batch.get("document_ids")
    if ids is None or not ids.numel():
        return batch
    if steps is None:
        steps = document_steps(ids)
    if steps == (0, 0):
        batch = {key: value for key, value in batch.items() if key != "document_ids"}
    return batch


def check_token_ids(batch: dict[str, torch.Tensor], vocab_size: int, where: str) -> None:
    """Refuse token ids the model cannot embed (``input_ids``) or predict (``labels``, which
    may also be the ignore index), and ids that are not integers."""
    for key in ("input_ids", "labels"):
        ids = batch.get(key)
        if ids is None:
            continue
        if (
            not isinstance(ids, torch.Tensor)
            or ids.dtype.is_floating_point
            or ids.dtype.is_complex
            or ids.dtype == torch.bool
        ):
            kind = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ForgeError(
                f"{where} holds {key} of type {kind}; token ids must be integer tensors. The dataset is wrong: "
                "fix it (or the files it reads), or choose another [data] name."
            )
        if not ids.numel():
            continue
        low, high = _id_range(ids)
        if low >= 0 and high < vocab_size:  # the usual batch: one pass over the ids
            continue
        valid = (ids >= 0) & (ids < vocab_size)
        if key == "labels":
            valid |= ids == IGNORE_INDEX
        if not bool(valid.all()):
            bad = ids[~valid].unique()
            shown = ", ".join(str(int(v)) for v in bad[:5]) + (", ..." if len(bad) > 5 else "")
            raise ForgeError(
                f"{where} holds {key} outside the model's vocabulary of {vocab_size} ids (0 to {vocab_size - 1}): "
                f"{shown}. The data was made with another tokenizer: set [tokenizer] to the one it was prepared "
                "with (or a larger [model] vocab_size), or prepare the data again with this tokenizer."
            )
