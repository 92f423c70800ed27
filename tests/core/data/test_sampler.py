"""The window sampler: per-epoch permutations, disjoint rank shards, O(1) seeking, state."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from forge_lm.data.sampler import KeyedPermutation, WindowSampler
from forge_lm.errors import ForgeError


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 100, 1000, 4097])
def test_keyed_permutation_is_a_bijection_of_the_range(size):
    permutation = KeyedPermutation(size, key=12345)
    assert sorted(permutation[i] for i in range(size)) == list(range(size))


@pytest.mark.parametrize("size", [1, 2, 4, 5, 16, 17, 1000, 4097, 70001])
def test_take_computes_in_numpy_what_indexing_gives_one_by_one(size):
    permutation = KeyedPermutation(size, key=987)
    indices = np.arange(size) if size <= 5000 else np.random.default_rng(0).integers(0, size, 3000)
    assert permutation.take(indices).tolist() == [permutation[int(i)] for i in indices]
    assert permutation.take(indices[:3]).tolist() == [permutation[int(i)] for i in indices[:3]]  # few: the scalar walk
    with pytest.raises(IndexError):
        permutation.take(np.array([size]))


def _windows_position_by_position(num_windows, seed, rank, dp_size, draws, start=0):
    """The reference: each draw's window computed alone from its global position."""
    reference = WindowSampler(num_windows, seed=seed, dp_rank=rank, dp_size=dp_size)
    return [reference.window_at(start + rank + draw * dp_size) for draw in range(draws)]


@pytest.mark.parametrize(("num_windows", "dp_size"), [(1, 1), (2, 3), (5, 2), (37, 3), (3000, 2), (100_003, 1)])
def test_many_draws_at_once_are_the_windows_drawn_one_at_a_time(num_windows, dp_size):
    for rank in range(dp_size):
        sampler = WindowSampler(num_windows, seed=6, dp_rank=rank, dp_size=dp_size)
        drawn = [sampler.next_index() for _ in range(5)]
        drawn += sampler.next_indices(12).tolist() + sampler.next_indices(2500).tolist()
        drawn += [sampler.next_index() for _ in range(3)]
        assert drawn == _windows_position_by_position(num_windows, 6, rank, dp_size, len(drawn))
        assert sampler.state_dict() == {
            "epoch": len(drawn) * dp_size // num_windows,
            "position": len(drawn) * dp_size % num_windows,
            "num_windows": num_windows,
        }


def test_draws_after_a_skip_or_a_restore_are_computed_from_the_new_position():
    sampler = WindowSampler(500, seed=3, dp_rank=1, dp_size=2)
    _ = sampler.next_indices(10)  # a block computed ahead from position 1
    sampler.skip(7)
    assert sampler.next_indices(4).tolist() == _windows_position_by_position(500, 3, 1, 2, 4, start=2 * 17)
    state = sampler.state_dict()
    _ = sampler.next_indices(50)
    sampler.load_state_dict(state)  # back: the block computed ahead is not what follows
    assert sampler.next_indices(6).tolist() == _windows_position_by_position(500, 3, 1, 2, 6, start=2 * 21)


def test_different_keys_give_different_orders_of_the_same_elements():
    first = [KeyedPermutation(50, key=1)[i] for i in range(50)]
    second = [KeyedPermutation(50, key=2)[i] for i in range(50)]
    assert first != second
    assert sorted(first) == sorted(second) == list(range(50))


def test_each_element_is_equally_likely_first_across_keys():
    # Over 4000 keys, which of 8 elements comes first should be uniform: 500 each, with a
    # binomial standard deviation of sqrt(4000 * 1/8 * 7/8) = 20.9; allow 5 of them.
    counts = [0] * 8
    for key in range(4000):
        counts[KeyedPermutation(8, key)[0]] += 1
    assert all(abs(count - 500) < 105 for count in counts), counts


def test_unshuffled_sampler_visits_windows_in_order_epoch_after_epoch():
    sampler = WindowSampler(4, shuffle=False)
    assert list(itertools.islice(sampler, 10)) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def test_each_epoch_is_a_new_permutation_of_every_window():
    sampler = WindowSampler(30, seed=5)
    epochs = [[sampler.next_index() for _ in range(30)] for _ in range(3)]
    assert all(sorted(epoch) == list(range(30)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize(("num_windows", "dp_size"), [(10, 3), (12, 4), (5, 2), (2, 3)])
def test_ranks_get_disjoint_windows_that_cover_each_epoch(num_windows, dp_size):
    draws = 3 * num_windows  # whole epochs, whatever dp_size: every rank draws this many
    by_epoch: dict[int, list[int]] = {}
    for rank in range(dp_size):
        sampler = WindowSampler(num_windows, seed=9, dp_rank=rank, dp_size=dp_size)
        for t in range(draws):
            epoch = (rank + t * dp_size) // num_windows  # the global position's epoch
            by_epoch.setdefault(epoch, []).append(sampler.next_index())
    for epoch in range(3 * dp_size):
        assert sorted(by_epoch[epoch]) == list(range(num_windows)), epoch  # disjoint and covering


def test_skipping_ahead_lands_where_iterating_would():
    walked = WindowSampler(37, seed=2, dp_rank=1, dp_size=3)
    expected = [walked.next_index() for _ in range(500)][450:]
    jumped = WindowSampler(37, seed=2, dp_rank=1, dp_size=3)
    jumped.skip(450)
    assert [jumped.next_index() for _ in range(50)] == expected


def test_state_round_trip_continues_the_same_indices():
    sampler = WindowSampler(23, seed=4, dp_rank=0, dp_size=2)
    _ = [sampler.next_index() for _ in range(40)]
    state = sampler.state_dict()
    expected = [sampler.next_index() for _ in range(30)]
    resumed = WindowSampler(23, seed=4, dp_rank=0, dp_size=2)
    resumed.load_state_dict(state)
    assert [resumed.next_index() for _ in range(30)] == expected
    assert state == {"epoch": 3, "position": 11, "num_windows": 23}  # 40 draws x 2 ranks = position 80


def test_the_state_is_the_same_on_every_rank_and_resumes_each():
    ranks = [WindowSampler(11, seed=1, dp_rank=r, dp_size=3) for r in range(3)]
    for sampler in ranks:
        _ = [sampler.next_index() for _ in range(7)]
    states = [sampler.state_dict() for sampler in ranks]
    assert states[0] == states[1] == states[2]
    for rank, sampler in enumerate(ranks):
        resumed = WindowSampler(11, seed=1, dp_rank=rank, dp_size=3)
        resumed.load_state_dict(states[0])  # rank 0's checkpoint
        assert [resumed.next_index() for _ in range(5)] == [sampler.next_index() for _ in range(5)]


def test_resuming_with_fewer_ranks_continues_at_the_first_undrawn_window():
    before = [WindowSampler(20, seed=8, dp_rank=r, dp_size=4) for r in range(4)]
    seen = [s.next_index() for _ in range(2) for s in before]  # 8 of the first epoch's 20
    after = [WindowSampler(20, seed=8, dp_rank=r, dp_size=2) for r in range(2)]
    for sampler in after:
        sampler.load_state_dict(before[0].state_dict())
    rest = [s.next_index() for _ in range(6) for s in after]  # the other 12
    assert sorted(seen + rest) == list(range(20))


def test_loading_a_state_of_another_dataset_size_is_refused():
    sampler = WindowSampler(10)
    with pytest.raises(ForgeError, match="10 windows"):
        WindowSampler(12).load_state_dict(sampler.state_dict())


def test_a_sampler_needs_windows_and_a_valid_rank():
    with pytest.raises(ForgeError, match="no windows"):
        WindowSampler(0)
    with pytest.raises(ForgeError, match="rank 2"):
        WindowSampler(5, dp_rank=2, dp_size=2)
