"""Counter-based randomness: numbers computed from (seed, keys), with no generator state.

Whatever is drawn from these functions can be recomputed for any position directly, which is
what makes skipping ahead and resuming O(1): there is no random stream to replay.
"""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1


def mix64(value: int) -> int:
    """The splitmix64 finaliser: a bijection on 64-bit integers whose output bits each depend
    on every input bit, so that nearby inputs (seed, seed + 1) give unrelated outputs."""
    value &= MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def mix64_array(values: np.ndarray) -> np.ndarray:
    """:func:`mix64` of each of ``values`` (uint64; numpy's products wrap modulo 2**64 as the
    masks do)."""
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def hash_keys(*keys: int) -> int:
    """A 64-bit hash of a sequence of integers (negative ones included)."""
    state = 0x9E3779B97F4A7C15
    for key in keys:
        state = mix64(state ^ (key & MASK64)) + 0x9E3779B97F4A7C15
    return mix64(state)


def uniform(*keys: int) -> float:
    """A number in [0, 1) determined by ``keys``; 53 bits, the precision of a float."""
    return (hash_keys(*keys) >> 11) * 2.0**-53
