"""Held-out splits: exact counts, spread through the data, O(1) lookups equal to a brute force."""

from __future__ import annotations

import math

import pytest

from forge_lm.data.splits import SplitIndices, held_out_rule
from forge_lm.errors import ConfigError


def brute_force(total: int, fraction: float) -> tuple[list[int], list[int]]:
    """Item k is held out when the running count floor(n * f) steps up at n = k + 1."""
    held = [k for k in range(total) if math.floor((k + 1) * fraction + 1e-12) > math.floor(k * fraction + 1e-12)]
    return [k for k in range(total) if k not in held], held


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.05, 0.1, 0.25, 1 / 3, 0.5, 0.9])
@pytest.mark.parametrize("total", [0, 1, 19, 20, 113, 1000])
def test_split_indices_equal_the_brute_force_rule(total, fraction):
    train, held = brute_force(total, fraction)
    assert list(SplitIndices(total, fraction, "train")) == train
    assert list(SplitIndices(total, fraction, "eval")) == held


def test_five_percent_holds_out_every_twentieth_item():
    assert list(SplitIndices(100, 0.05, "eval")) == [19, 39, 59, 79, 99]
    assert len(SplitIndices(100, 0.05, "train")) == 95


def test_lookups_deep_into_a_large_split_match_the_rule():
    train, held = SplitIndices(10**9, 0.01, "train"), SplitIndices(10**9, 0.01, "eval")
    assert len(held) == 10**7
    assert held[123_456] == 12_345_699  # every 100th item: 100 * (j + 1) - 1
    assert train[123_456] == 124_703  # = j + items held out before it: 123_456 + 1_247
    rule = held_out_rule(0.01)
    assert rule(held[123_456])
    assert not rule(train[123_456])


def test_fractions_outside_zero_to_one_are_refused():
    with pytest.raises(ConfigError, match="eval_fraction"):
        SplitIndices(10, 1.0, "eval")
    with pytest.raises(ConfigError, match="'test'"):
        SplitIndices(10, 0.1, "test")
