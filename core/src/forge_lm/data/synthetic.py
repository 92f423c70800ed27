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


class SyntheticTokens(torch.utils.data.IterableDataset):
    def __init__(self, context: DataContext) -> None:
        self.context = context
        self._next_index = context.dp_rank

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        seed = (self.context.seed << 32) + index
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.context.vocab_size, (self.context.seq_len + 1,), generator=generator)
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            index = self._next_index
            self._next_index += self.context.dp_size
            yield self.sample(index)

    def state_dict(self) -> dict[str, Any]:
        return {"next_index": self._next_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next_index = int(state["next_index"])


def build_synthetic(options, context: DataContext) -> SyntheticTokens:
    return SyntheticTokens(context)
