"""The dataset every built-in text corpus is: windows of a token stream, through the sampler.

It reads a batch at once (:class:`~forge_lm.components.ReadsBatches`), from a block of the
rank's next windows read ahead (about :data:`BLOCK_TOKENS` tokens): the sampler's windows for
the whole block, one gather of their tokens, one range check and the document ids in a few
numpy operations, after which each batch is a slice of the block. The same work per sample
costs about 80 µs a sample on a 2-core machine, most of a small model's fixed cost per step;
the block is only a cache (the state is still the sampler's position), and a batch is the same
whichever way it was read. The iterator hands out the block's rows one by one, so a mixture of
these datasets, which draws sample by sample, reads blocks too."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from forge_lm.components import DataContext
from forge_lm.data.packing import TokenStream, check_ids, num_windows, window_batch, window_sample
from forge_lm.data.sampler import WindowSampler
from forge_lm.data.splits import SplitIndices
from forge_lm.errors import ConfigError, ForgeError

BLOCK_TOKENS = 1 << 18
"""About how many tokens :meth:`WindowDataset.read_batch` reads ahead at once: 6 MiB of int64
inputs, labels and document ids, whatever ``seq_len`` is."""


class WindowDataset:
    """Samples from the windows of ``tokens``, in the sampler's order, for one rank.

    ``held_out``: when given, only the windows of ``context.split`` under that eval fraction
    (:mod:`forge_lm.data.splits`) are used; when None, every window is (the caller has split
    the data by documents already). ``source`` names the data in messages.
    """

    def __init__(
        self,
        tokens: TokenStream,
        context: DataContext,
        *,
        eos_id: int | None,
        source: str,
        held_out: float | None = None,
    ) -> None:
        self.tokens = tokens
        self.context = context
        self.eos_id = eos_id
        self.source = source
        total = num_windows(len(tokens), context.seq_len)
        if total < 1:
            raise ConfigError(
                f"{source} holds {len(tokens)} tokens, fewer than seq_len + 1 = {context.seq_len + 1}; "
                "lower [train] seq_len or give the dataset more data."
            )
        self.windows: Sequence[int] = range(total) if held_out is None else SplitIndices(total, held_out, context.split)
        if not self.windows:
            fix = "raise eval_fraction" if context.split == "eval" else "lower eval_fraction"
            raise ConfigError(
                f"the {context.split} split of {source} is empty ({total} windows of {context.seq_len + 1} "
                f"tokens, eval_fraction = {held_out}); {fix}, give the dataset more data, or lower "
                "[train] seq_len."
            )
        self.sampler = WindowSampler(
            len(self.windows), seed=context.seed, dp_rank=context.dp_rank, dp_size=context.dp_size
        )
        # The block read ahead: (the sampler position of its first row, its inputs, labels and
        # document ids as arrays [rows, seq_len]); row i is the draw at that position + i draws.
        self._ahead: tuple[int, tuple[np.ndarray, ...]] = (0, ())

    def __len__(self) -> int:
        """Windows in this split (one epoch, all ranks together)."""
        return len(self.windows)

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """The sample of window ``index`` of this split."""
        start = self.windows[index] * self.context.seq_len
        window = self.tokens.read(start, self.context.seq_len + 1)
        check_ids(window, self.context.vocab_size, self.source)
        return window_sample(window, self.eos_id)

    def read_batch(self, size: int) -> dict[str, torch.Tensor]:
        """The next ``size`` samples, stacked: what ``size`` draws of the iterator give."""
        position = self.sampler.position
        start, block = self._ahead
        row, misaligned = divmod(position - start, self.context.dp_size)
        if not block or misaligned or row < 0 or row + size > len(block[0]):
            rows = max(size, BLOCK_TOKENS // (self.context.seq_len + 1))
            self._ahead = start, block = position, self._read_block(self.sampler.peek_indices(rows))
            row = 0
        self.sampler.skip(size)
        inputs, labels, documents = (torch.from_numpy(array[row : row + size]) for array in block)
        return {"input_ids": inputs, "labels": labels, "document_ids": documents}

    def _read_block(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        """Inputs, labels and document ids of the windows ``indices`` of this split, checked."""
        windows = self.windows
        if isinstance(windows, range):
            chosen = indices if (windows.start, windows.step) == (0, 1) else windows.start + indices * windows.step
        else:
            chosen = np.fromiter((windows[int(i)] for i in indices), dtype=np.int64, count=len(indices))
        tokens = self.tokens.read_windows(chosen * self.context.seq_len, self.context.seq_len + 1)
        check_ids(tokens, self.context.vocab_size, self.source)
        batch = window_batch(tokens, self.eos_id)
        return tuple(batch[key].numpy() for key in ("input_ids", "labels", "document_ids"))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # The sampler advances before each yield, so the state always names the next sample,
        # including for an iterator that is already running when load_state_dict is called.
        # Each sample is a row of the block read_batch reads ahead: drawn one by one (a mixture's
        # source), a sample costs a slice instead of its own read and checks.
        while True:
            yield {key: value[0] for key, value in self.read_batch(1).items()}

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sampler" not in state:
            raise ForgeError(f"the saved data state {sorted(state)} is not the state of {self.source}.")
        self.sampler.load_state_dict(state["sampler"])
