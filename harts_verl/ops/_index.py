"""Small numpy → torch index helpers shared by the tree ops (plans are built with numpy once per
microbatch, then moved to the device as int64 tensors)."""

from __future__ import annotations

import numpy as np
import torch

from harts_verl.tree._ranges import concat_ranges

__all__ = ["concat_ranges", "segment_ancestors", "to_index"]


def to_index(arr: np.ndarray, device: torch.device | str | None = None) -> torch.Tensor:
    """``arr`` (any integer numpy array) as a contiguous int64 tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64)).to(device)


def segment_ancestors(parent_segment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Root-first ancestor-or-self lists of every node of a forest given by parent pointers.

    Args:
      parent_segment: int64 ``[n]``, parent of each node (-1 at roots).

    Returns:
      ``(offsets [n + 1], flat)``: the ancestors-or-self of node ``s``, root first and ``s``
      last, are ``flat[offsets[s]:offsets[s + 1]]``. Built by pointer jumping: one vectorized
      step per level of the deepest chain (a loop over tree depth, not over nodes).
    """
    parent_segment = np.asarray(parent_segment, dtype=np.int64)
    n = parent_segment.shape[0]
    level = np.zeros(n, dtype=np.int64)
    cur = parent_segment.copy()
    alive = cur >= 0
    while alive.any():
        level[alive] += 1
        cur[alive] = parent_segment[cur[alive]]
        alive = cur >= 0
        if int(level.max(initial=0)) > n:
            raise ValueError("parent_segment: parent pointers form a cycle")
    counts = level + 1
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int64)
    node = np.arange(n, dtype=np.int64)
    up = 0  # distance from the node: the ancestor `up` levels above sits at index level - up
    cur = node.copy()
    alive = np.ones(n, dtype=bool)
    while alive.any():
        idx = np.flatnonzero(alive)
        flat[offsets[idx] + level[idx] - up] = cur[idx]
        nxt = parent_segment[cur[idx]]
        cur[idx] = nxt
        alive[idx] = nxt >= 0
        up += 1
    return offsets, flat
