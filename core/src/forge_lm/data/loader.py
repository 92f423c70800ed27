"""``BatchLoader``: samples of a dataset stacked into batches, resumable batch for batch.

The loader reads samples in the training process, one batch at a time, with no read-ahead:
the dataset's state then always names the first sample of the next batch, so saving it is
saving the loader. (Read-ahead in worker processes would make the saved state run ahead of
what training consumed.)

Given the model's ``vocab_size``, the loader checks every batch before the model sees it:
token ids must be integers the embedding holds (labels may also be the ignore index), whatever
dataset (a plugin's too) produced them. An id outside the vocabulary would otherwise be an
``IndexError`` deep in the embedding on CPU, or a device-side assert that kills the process on
CUDA; here it is a :class:`ForgeError` naming the data, the ids and the fix, at the first batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from forge_lm.components import IGNORE_INDEX
from forge_lm.errors import ForgeError


class BatchLoader:
    """Batches of ``batch_size`` samples: a dict of tensors ``[batch_size, *sample_shape]``.

    With ``vocab_size``, each batch's token ids are checked (:func:`check_token_ids`);
    ``source`` names the data in the message."""

    def __init__(self, dataset: Any, batch_size: int, vocab_size: int | None = None, source: str = "the data") -> None:
        if batch_size < 1:
            raise ForgeError(f"batch_size must be at least 1, got {batch_size}.")
        self.dataset = dataset
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.source = source
        self.batches = 0  # batches handed out since the start of the run (kept in the state)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # A fresh dataset iterator per call: after load_state_dict, iter(loader) starts at the
        # restored position even for datasets whose iterators keep their own position.
        samples = iter(self.dataset)
        while True:
            try:
                batch = [next(samples) for _ in range(self.batch_size)]
            except StopIteration:  # a finite dataset ends here; its incomplete last batch is dropped
                return
            self.batches += 1
            collated = collate(batch)
            if self.vocab_size is not None:
                check_token_ids(collated, self.vocab_size, f"{self.source} (batch {self.batches})")
            yield without_trivial_documents(collated)

    def state_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset.state_dict(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])
        self.batches = int(state.get("batches", 0))


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack each key of ``samples`` along a new first dimension."""
    keys = samples[0].keys()
    for sample in samples[1:]:
        if sample.keys() != keys:
            raise ForgeError(
                f"the dataset yields samples with different keys ({sorted(keys)} and {sorted(sample.keys())}); "
                "every sample of a dataset must have the same keys."
            )
    return {key: torch.stack([sample[key] for sample in samples]) for key in keys}


def without_trivial_documents(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` without its ``document_ids`` when every row holds one document.

    Attention is then plain causal attention, which the model runs with its fused causal
    kernels when it gets no document ids. Deciding it here, on the host, before the batch goes
    to the device, spares the model a check on the device, which would make the host wait for
    the device at every micro-batch."""
    ids = batch.get("document_ids")
    if ids is not None and ids.device.type == "cpu" and ids.numel() and bool((ids == ids[:, :1]).all()):
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
