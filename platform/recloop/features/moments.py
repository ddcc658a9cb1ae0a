"""Exact, mergeable sums of float64 values: the same mean and standard deviation however the values are split.

The feature job fixes the numeric scale (mean, std) with its first state. One process sums every value at
once; the Dask engine sums each lake file on its worker and merges on the driver. Floating-point sums depend
on their order, so the two would differ in the last bits and every standardized training column with them.
Here each value ``x = M·2^E`` (``M`` a 53-bit integer) is summed as integers per exponent and kept as an
exact ``Fraction``; ``x²`` likewise (``M²`` split into 27-bit halves so numpy's int64 never overflows).
Merging is addition, so any partition of the values gives the same ``Moments`` and the same floats.

Example::

    whole = Moments.of(values)
    parts = Moments.of(values[:10]) + Moments.of(values[10:])
    assert whole == parts and whole.mean() == parts.mean()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

_CHUNK = 256  # terms below 2^54 each: 256 of them stay below 2^62 in an int64
_LOW = (1 << 27) - 1


def _grouped_sums(terms: list[tuple[int, np.ndarray]], exponents: np.ndarray) -> Fraction:
    """Σ over groups of equal exponent ``e`` of ``Σ values · 2^(e + weight)`` for each ``(weight, values)``
    (int64 values below 2^54: summed by numpy in chunks of ``_CHUNK`` within a group, then as Python ints)."""
    order = np.argsort(exponents, kind="stable")
    exponents = exponents[order]
    starts = np.flatnonzero(np.r_[True, exponents[1:] != exponents[:-1]])
    bounds = np.union1d(starts, np.arange(0, len(exponents), _CHUNK))  # no chunk spans two groups
    group_of_chunk = np.searchsorted(starts, bounds, side="right") - 1
    total = Fraction(0)
    for weight, values in terms:
        chunk_sums = np.add.reduceat(values[order], bounds)
        for group, start in enumerate(starts):
            acc = sum(map(int, chunk_sums[group_of_chunk == group]))
            total += Fraction(acc) * Fraction(2) ** (int(exponents[start]) + weight)
    return total


@dataclass(frozen=True)
class Moments:
    """Count, exact sum and exact sum of squares of some finite float64 values (NaN and ±inf left out)."""

    count: int = 0
    total: Fraction = Fraction(0)
    squares: Fraction = Fraction(0)

    @classmethod
    def of(cls, values: np.ndarray) -> Moments:
        values = np.asarray(values, dtype=np.float64)
        values = values[np.isfinite(values)]
        if not len(values):
            return cls()
        mantissa, exponent = np.frexp(values)
        ints = (mantissa * 2.0**53).astype(np.int64)  # exact: |mantissa| < 1 has 53 significant bits
        exps = exponent.astype(np.int64) - 53
        total = _grouped_sums([(0, ints)], exps)
        magnitude = np.abs(ints)
        high, low = magnitude >> 27, magnitude & _LOW  # M² = high²·2^54 + 2·high·low·2^27 + low²
        squares = _grouped_sums([(54, high * high), (28, high * low), (0, low * low)], 2 * exps)
        return cls(len(values), total, squares)

    def __add__(self, other: Moments) -> Moments:
        return Moments(self.count + other.count, self.total + other.total, self.squares + other.squares)

    def mean(self, default: float = 0.0) -> float:
        return float(self.total / self.count) if self.count else default

    def std(self, default: float = 1.0) -> float:
        """The population standard deviation (numpy's ``std``), from the exact variance."""
        if self.count < 2:
            return default
        mean = self.total / self.count
        variance = max(self.squares / self.count - mean * mean, Fraction(0))
        try:
            return math.sqrt(float(variance))
        except OverflowError:  # values near float64's limit: their spread is not a float either
            return math.inf
