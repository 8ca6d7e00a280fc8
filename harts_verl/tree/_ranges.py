"""Concatenated integer ranges, vectorized (numpy only): shared by the forest, the planners and
the ops' index builders."""

from __future__ import annotations

import numpy as np

__all__ = ["concat_ranges"]


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each ``(s, n)`` pair (int64), vectorized.

    ``lengths`` must be non-negative; zero-length ranges contribute nothing.
    """
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offs = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) + np.repeat(starts - offs, lengths)
