"""Random token sequences, each reproducible from (seed, global sample index).

Sample ``i`` is drawn from a generator seeded by the run seed and ``i`` alone, so the stream
needs no stored random state: skipping ahead, resuming and sharding across data-parallel
ranks (rank ``r`` of ``n`` takes samples ``r, r + n, r + 2n, ...``) are all exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from forge_lm.components import DataContext

EVAL_OFFSET = 1 << 31


class SyntheticTokens(torch.utils.data.IterableDataset):
    def __init__(self, context: DataContext) -> None:
        self.context = context
        self._start = 0  # first global index no rank has drawn yet: the same on every rank

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        # The eval split draws from its own index range, so it never repeats a training sample.
        offset = EVAL_OFFSET if self.context.split == "eval" else 0
        generator = torch.Generator().manual_seed((self.context.seed << 32) + offset + index)
        tokens = torch.randint(0, self.context.vocab_size, (self.context.seq_len + 1,), generator=generator)
        # One document per sample: nothing is packed, so attention never needs a document mask.
        return {"input_ids": tokens[:-1], "labels": tokens[1:], "document_ids": torch.zeros_like(tokens[:-1])}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            index = self._start + self.context.dp_rank
            self._start += self.context.dp_size
            yield self.sample(index)

    def state_dict(self) -> dict[str, Any]:
        # Global, so a checkpoint written by rank 0 resumes any number of ranks exactly.
        return {"next_index": self._start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start = int(state["next_index"])


def build_synthetic(options, context: DataContext) -> SyntheticTokens:
    return SyntheticTokens(context)
