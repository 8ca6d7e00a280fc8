"""Vectorized range-minimum queries over an integer array (sparse table, numpy only)."""

from __future__ import annotations

import numpy as np

__all__ = ["RangeMin"]


class RangeMin:
    """Sparse table over ``values``: ``query(lo, hi)`` is ``min(values[lo:hi])`` for every pair of
    non-empty ranges ``lo < hi``, answered in O(1) each (vectorized over the pairs).

    Built in O(n log n) time and memory.
    """

    def __init__(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.int64)
        self.values = values
        table = [values]
        span = 1
        while 2 * span <= values.shape[0]:
            prev = table[-1]
            table.append(np.minimum(prev[:-span], prev[span:]))
            span *= 2
        # All levels in one array (level lv starts at _level_start[lv]): a query is one gather.
        self._flat = np.concatenate(table)
        sizes = np.array([t.shape[0] for t in table], dtype=np.int64)
        self._level_start = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

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
        if int(lo.min()) < 0 or int(hi.max()) > self.values.shape[0]:
            # (one flat table: an index past a level would read the next level silently)
            raise IndexError("RangeMin.query: range outside the values")
        # floor(log2(length)) exactly: frexp is exact for lengths below 2**53 (a length is at
        # most the table's size)
        level = np.frexp(length.astype(np.float64))[1].astype(np.int64) - 1
        base = self._level_start[level]
        return np.minimum(self._flat[base + lo], self._flat[base + hi - (np.int64(1) << level)])

    def query_one(self, lo: int, hi: int) -> int:
        """Scalar ``min(values[lo:hi])`` (``lo < hi``)."""
        lv = (hi - lo).bit_length() - 1
        base = int(self._level_start[lv])
        return int(min(self._flat[base + lo], self._flat[base + hi - (1 << lv)]))
