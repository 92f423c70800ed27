"""Held-out splits: which documents (or windows) are "eval" and which are "train".

Item ``k`` of ``n`` is held out when ``floor((k + 1) * f) > floor(k * f)`` for the fraction
``f``: held-out items are spread evenly through the data (every 20th for ``f = 0.05``)
rather than bunched at its end, so the eval split samples every part of a corpus that is
stored in order (by source, by date). The rule needs no random state and no list of indices:
the ``j``-th item of either split is computed directly, which keeps sampling O(1) for corpora
of any size. ``f`` is read as an exact fraction (``0.05`` is ``1/20``) so that float rounding
cannot move an item between splits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import overload

from forge_lm.errors import ConfigError

SPLITS = ("train", "eval")


def _ratio(fraction: float) -> Fraction:
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"eval_fraction must be at least 0 and below 1, got {fraction!r}.")
    return Fraction(fraction).limit_denominator(1_000_000)


def held_out_rule(fraction: float) -> Callable[[int], bool]:
    """A test of whether item ``index`` belongs to the eval split (fraction parsed once)."""
    ratio = _ratio(fraction)
    p, q = ratio.numerator, ratio.denominator

    def is_held_out(index: int) -> bool:
        return (index + 1) * p // q > index * p // q

    return is_held_out


class SplitIndices(Sequence[int]):
    """The indices, in ``range(total)``, of the items in ``split``, as a lazy sequence."""

    def __init__(self, total: int, fraction: float, split: str) -> None:
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; the splits are 'train' and 'eval'.")
        ratio = _ratio(fraction)
        self._p, self._q = ratio.numerator, ratio.denominator
        self.total = total
        self.split = split
        held_out = total * self._p // self._q
        self._length = held_out if split == "eval" else total - held_out

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, item: int) -> int: ...

    @overload
    def __getitem__(self, item: slice) -> Sequence[int]: ...

    def __getitem__(self, item: int | slice) -> int | Sequence[int]:
        if isinstance(item, slice):
            return [self[j] for j in range(*item.indices(self._length))]
        if item < 0:
            item += self._length
        if not 0 <= item < self._length:
            raise IndexError(f"index {item} outside a split of {self._length} items")
        return self._eval_index(item) if self.split == "eval" else self._train_index(item)

    def _eval_index(self, j: int) -> int:
        # The smallest k with floor((k + 1) p / q) >= j + 1, i.e. (k + 1) p >= (j + 1) q.
        return -(-(j + 1) * self._q // self._p) - 1

    def _train_index(self, j: int) -> int:
        # The smallest K with K - floor(K p / q) >= j + 1, minus one. That count grows by 0 or
        # 1 per item and reaches j + 1 by K = ceil((j + 1) q / (q - p)): bisect below it.
        p, q = self._p, self._q
        low, high = j + 1, -(-(j + 1) * q // (q - p))
        while low < high:
            middle = (low + high) // 2
            if middle - middle * p // q >= j + 1:
                high = middle
            else:
                low = middle + 1
        return low - 1
