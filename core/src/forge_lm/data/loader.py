"""``BatchLoader``: samples of a dataset stacked into batches, resumable batch for batch.

The loader reads samples in the training process, one batch at a time, with no read-ahead:
the dataset's state then always names the first sample of the next batch, so saving it is
saving the loader. (Read-ahead in worker processes would make the saved state run ahead of
what training consumed.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from forge_lm.errors import ForgeError


class BatchLoader:
    """Batches of ``batch_size`` samples: a dict of tensors ``[batch_size, *sample_shape]``."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        if batch_size < 1:
            raise ForgeError(f"batch_size must be at least 1, got {batch_size}.")
        self.dataset = dataset
        self.batch_size = batch_size
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
            yield collate(batch)

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
