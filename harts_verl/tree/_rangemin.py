"""Vectorized range-minimum queries over an integer array (sparse table, numpy only)."""

from __future__ import annotations

import numpy as np

__all__ = ["RangeMin"]


class RangeMin:
    """Sparse table over ``values``: ``query(lo, hi)`` is ``min(values[lo:hi])`` for every pair of
    non-empty ranges ``lo < hi``, answered in O(1) each (vectorized over the pairs: one gather per
    side, whatever the mix of range lengths).

    Built in O(n log n) time and memory.
    """

    def __init__(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.int64)
        self.values = values
        n = int(values.shape[0])
        # row lv holds min(values[i : i + 2**lv]) at i <= n - 2**lv (the rest is never read)
        levels = max(1, n.bit_length())
        table = np.empty((levels, n), dtype=np.int64)
        table[0] = values
        span = 1
        for lv in range(1, levels):
            m = n - 2 * span + 1
            np.minimum(table[lv - 1, :m], table[lv - 1, span : span + m], out=table[lv, :m])
            span *= 2
        self._table = table

    def __len__(self) -> int:
        return int(self.values.shape[0])

    def query(self, lo: np.ndarray | int, hi: np.ndarray | int) -> np.ndarray:
        """``min(values[lo[i]:hi[i]])`` elementwise; every range must be non-empty."""
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        if lo.shape != hi.shape:
            lo, hi = np.broadcast_arrays(lo, hi)
        if lo.size == 0:
            return np.zeros(lo.shape, np.int64)
        length = hi - lo
        if int(length.min()) <= 0:
            raise ValueError("RangeMin.query: empty range")
        # floor(log2(length)): frexp's exponent is exact (lengths <= n < 2**53 convert exactly)
        level = np.frexp(length.astype(np.float64))[1] - 1
        t = self._table
        return np.minimum(t[level, lo], t[level, hi - (np.int64(1) << level)])

    def query_one(self, lo: int, hi: int) -> int:
        """Scalar ``min(values[lo:hi])`` (``lo < hi``)."""
        lv = (hi - lo).bit_length() - 1
        t = self._table[lv]
        return int(min(t[lo], t[hi - (1 << lv)]))
