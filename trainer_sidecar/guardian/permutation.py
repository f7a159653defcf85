"""A shuffled order of ``n`` samples that is computed, never stored: O(1) memory for any dataset size.

``Permutation(n, seed).at(positions)`` maps positions ``0..n-1`` to sample indices, a bijection drawn
from ``seed``. It is a Feistel network over the smallest even-bit domain covering ``n`` (at most ``4n``)
with cycle walking, vectorised with NumPy: mapping a batch costs a few passes over the batch, whatever
``n`` is, so a billion-sample epoch starts at once and a resumed job jumps to any position without
computing the ones before it. It shuffles well enough for training (every sample exactly once per epoch,
no visible structure); it is not a cryptographic permutation.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_ROUNDS = 6
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(state: int) -> tuple[int, int]:
    state = (state + _GOLDEN) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def _mix(values: npt.NDArray[np.uint64], key: np.uint64) -> npt.NDArray[np.uint64]:
    """A 64-bit avalanche of ``values ^ key`` (wrapping multiplication: exactly what the uint64 arithmetic
    of NumPy does)."""
    z = values ^ key
    z = (z ^ (z >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)
    z = (z ^ (z >> np.uint64(33))) * np.uint64(0xC4CEB9FE1A85EC53)
    return z ^ (z >> np.uint64(33))


class Permutation:
    """A seeded bijection of ``range(n)`` onto itself; ``n`` may be up to 2^62."""

    def __init__(self, n: int, seed: int) -> None:
        if not 0 < n <= 1 << 62:
            raise ValueError(f"a permutation needs 1 <= n <= 2^62, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self._half = bits // 2
        self._half_mask = np.uint64((1 << self._half) - 1)
        state = seed & _MASK64
        keys = []
        for _ in range(_ROUNDS):
            state, key = _splitmix64(state)
            keys.append(np.uint64(key))
        self._keys = keys

    def _feistel(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        half, mask = np.uint64(self._half), self._half_mask
        left, right = x >> half, x & mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        result: npt.NDArray[np.uint64] = (left << half) | right
        return result

    def at(self, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """The sample index at each position (each in ``0..n-1``)."""
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions must be in [0, {self.n})")
        values = x.astype(np.uint64)
        limit = np.uint64(self.n)
        pending = np.ones(values.shape, dtype=bool)
        while pending.any():
            values[pending] = self._feistel(values[pending])
            pending = values >= limit  # cycle walking: a value outside [0, n) is permuted again
        return values.astype(np.int64)
