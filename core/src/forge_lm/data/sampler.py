"""The order in which a dataset's windows are visited: shuffled, sharded, endless, seekable.

The windows are laid out in one endless stream of epochs; epoch ``e`` is a permutation of
``range(num_windows)`` keyed by ``(seed, e)``. Global position ``g`` of the stream is window
``permutation_e[g % num_windows]`` with ``e = g // num_windows``. Data-parallel ranks advance
through the stream in lockstep: at each draw the ``dp_size`` ranks take the next ``dp_size``
positions, rank ``r`` the ``r``-th of them. So within an epoch the ranks' windows are disjoint
and together cover every window, whatever ``num_windows`` is.

The permutation is a keyed Feistel network over the smallest power-of-four domain that holds
``num_windows`` indices, restricted to ``range(num_windows)`` by cycle walking. Any position's
window is computed directly, without materialising the permutation, so memory is O(1) and
seeking to any position is O(1). The sampler computes a rank's windows a block at a time
(:data:`BLOCK` positions, in numpy, about 1 µs each against 13 µs one by one in Python) and
keeps that one block: what it hands out is the same as position by position.

The state is the first position that no rank has drawn yet, as ``epoch`` and ``position``.
It is the same on every rank, so a checkpoint written by rank 0 resumes every rank, and it
stays exact when a run resumes with a different number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from forge_lm.data._random import hash_keys, mix64, mix64_array
from forge_lm.errors import ForgeError

_ROUNDS = 6  # Feistel rounds; more than the 4 that make a good pseudo-random permutation
BLOCK = 1024
"""Positions a :class:`WindowSampler` computes at once. A vectorised cycle walk pays for its
longest orbit in every element's pass; over a block that cost is shared by many elements."""
_SCALAR_BELOW = 8  # elements still walking: below this many, Python's per-element loop is faster


class KeyedPermutation:
    """A pseudo-random bijection of ``range(size)`` chosen by ``key``; O(1) per lookup."""

    def __init__(self, size: int, key: int) -> None:
        if size < 1:
            raise ValueError(f"a permutation needs at least one element, got size={size}")
        self.size = size
        # Each half holds ceil(bits / 2) bits, so the domain 4**half_bits is < 4 * size and a
        # cycle walk leaves it after fewer than 4 steps on average.
        self._half_bits = max(1, ((size - 1).bit_length() + 1) // 2)
        self._mask = (1 << self._half_bits) - 1
        self._round_keys = [hash_keys(key, index) for index in range(_ROUNDS)]

    def _encrypt(self, value: int) -> int:
        left, right = value >> self._half_bits, value & self._mask
        for round_key in self._round_keys:
            left, right = right, left ^ (mix64(right ^ round_key) & self._mask)
        return (left << self._half_bits) | right

    def _encrypt_array(self, values: np.ndarray) -> np.ndarray:
        """:meth:`_encrypt` of each of ``values`` (uint64), in numpy."""
        half_bits, mask = np.uint64(self._half_bits), np.uint64(self._mask)
        left, right = values >> half_bits, values & mask
        for round_key in self._round_keys:
            left, right = right, left ^ (mix64_array(right ^ np.uint64(round_key)) & mask)
        return (left << half_bits) | right

    def take(self, indices: np.ndarray) -> np.ndarray:
        """``[self[i] for i in indices]`` as an int64 array, computed in numpy."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.size):
            raise IndexError(f"indices outside a permutation of {self.size}")
        values = self._encrypt_array(indices.astype(np.uint64))
        walking = np.flatnonzero(values >= self.size)
        while len(walking) >= _SCALAR_BELOW:  # cycle walking, every element still outside at once
            values[walking] = self._encrypt_array(values[walking])
            walking = walking[values[walking] >= self.size]
        result = values.astype(np.int64)
        for position in walking:  # the few longest orbits, one by one
            value = int(result[position])
            while value >= self.size:
                value = self._encrypt(value)
            result[position] = value
        return result

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} outside a permutation of {self.size}")
        value = self._encrypt(index)
        while value >= self.size:  # cycle walking: the orbit of index returns into range(size)
            value = self._encrypt(value)
        return value


class WindowSampler:
    """Indices of windows in ``range(num_windows)`` for one data-parallel rank, forever."""

    def __init__(
        self,
        num_windows: int,
        *,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        if num_windows < 1:
            raise ForgeError("the dataset has no windows to sample from; give it more data or lower seq_len.")
        if not 0 <= dp_rank < dp_size:
            raise ForgeError(f"data-parallel rank {dp_rank} is not in range(dp_size={dp_size}).")
        self.num_windows = num_windows
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self._start = 0  # first global position of the next draw (shared by all ranks)
        self._epoch_order: tuple[int, KeyedPermutation] | None = None
        # This rank's windows computed ahead: (the global position of the first, the windows at it
        # and every dp_size-th position after). Only a cache: the state is _start alone.
        self._ahead: tuple[int, np.ndarray] = (0, np.empty(0, dtype=np.int64))

    def order(self, epoch: int) -> KeyedPermutation | range:
        """The order of the windows in ``epoch``."""
        if not self.shuffle:
            return range(self.num_windows)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, KeyedPermutation(self.num_windows, hash_keys(self.seed, epoch)))
        return self._epoch_order[1]

    def window_at(self, position: int) -> int:
        """The window at global ``position`` of the endless stream of epochs."""
        epoch, offset = divmod(position, self.num_windows)
        return self.order(epoch)[offset]

    def next_index(self) -> int:
        """This rank's next window; advances the state by one draw."""
        return int(self.next_indices(1)[0])

    def next_indices(self, count: int) -> np.ndarray:
        """This rank's next ``count`` windows (int64); advances the state by ``count`` draws."""
        windows = self.peek_indices(count)
        self._start += count * self.dp_size
        return windows

    @property
    def position(self) -> int:
        """The first global position of the next draw (the same on every rank): what the state is."""
        return self._start

    def peek_indices(self, count: int) -> np.ndarray:
        """This rank's next ``count`` windows (int64), without drawing them."""
        first = self._start + self.dp_rank
        start, windows = self._ahead
        offset, misaligned = divmod(first - start, self.dp_size)
        if misaligned or offset < 0 or offset + count > len(windows):
            # At most about one epoch per block, so that a block spans two epochs at most.
            block = max(count, min(BLOCK, -(-self.num_windows // self.dp_size)))
            self._ahead = start, windows = first, self._windows_from(first, block)
            offset = 0
        return windows[offset : offset + count].copy()  # the block stays as computed, whatever the caller does

    def _windows_from(self, first: int, count: int) -> np.ndarray:
        """The windows at positions ``first``, ``first + dp_size``, ... (``count`` of them)."""
        positions = first + self.dp_size * np.arange(count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_windows)
        windows = np.empty(count, dtype=np.int64)
        for epoch in range(int(epochs[0]), int(epochs[-1]) + 1):
            here = epochs == epoch
            order = self.order(epoch)
            windows[here] = offsets[here] if isinstance(order, range) else order.take(offsets[here])
        return windows

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.next_index()

    def skip(self, draws: int) -> None:
        """Advance by ``draws`` draws without computing them: O(1)."""
        if draws < 0:
            raise ValueError(f"cannot skip a negative number of draws ({draws})")
        self._start += draws * self.dp_size

    def state_dict(self) -> dict[str, Any]:
        epoch, position = divmod(self._start, self.num_windows)
        return {"epoch": epoch, "position": position, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = int(state["num_windows"])
        if saved != self.num_windows:
            raise ForgeError(
                f"the saved data position is for a dataset of {saved} windows, but this one has "
                f"{self.num_windows}: the data or seq_len changed since the checkpoint was written. "
                "Resume with the same data and seq_len, or start a new run."
            )
        self._start = int(state["epoch"]) * self.num_windows + int(state["position"])
