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
        self._table = table

    def __len__(self) -> int:
        return int(self.values.shape[0])

    def query(self, lo: np.ndarray | int, hi: np.ndarray | int) -> np.ndarray:
        """``min(values[lo[i]:hi[i]])`` elementwise; every range must be non-empty."""
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        lo, hi = np.broadcast_arrays(lo, hi)
        if lo.size == 0:
            return np.zeros(lo.shape, np.int64)
        length = hi - lo
        if int(length.min()) <= 0:
            raise ValueError("RangeMin.query: empty range")
        # floor(log2(length)) exactly, without float rounding.
        level = np.zeros(length.shape, dtype=np.int64)
        rest = length >> 1
        while bool(rest.any()):
            level += rest > 0
            rest >>= 1
        out = np.empty(lo.shape, dtype=np.int64)
        for lv in np.unique(level).tolist():
            sel = level == lv
            t = self._table[lv]
            out[sel] = np.minimum(t[lo[sel]], t[hi[sel] - (1 << lv)])
        return out

    def query_one(self, lo: int, hi: int) -> int:
        """Scalar ``min(values[lo:hi])`` (``lo < hi``)."""
        lv = (hi - lo).bit_length() - 1
        t = self._table[lv]
        return int(min(t[lo], t[hi - (1 << lv)]))
