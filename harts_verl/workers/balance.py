"""Tree-aware data-parallel balancing (numpy only; used by the trainer's ``_balance_batch``).

veRL's dispatcher cuts the reordered batch into ``dp_size`` consecutive equal chunks, one per
rank. :func:`tree_balanced_partition` chooses which trajectories go to which rank so that

* trajectories of one tree (same root row of the batch's token trie) stay on one rank whenever
  the equal-size constraint allows it (a tree larger than a rank's share is cut between leaf-
  order neighbours at its lowest common prefix, i.e. where cutting duplicates least work);
* the ranks' compact work (rows of their own trie, what the tree engine runs) is balanced:
  trees are placed largest-work first on the feasible rank with the least work (LPT).

Each rank's trajectories are listed in leaf order (prefix-sharing neighbours adjacent). The
result is a deterministic function of the sequences and ``dp_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from harts_verl.tree import RolloutForest

__all__ = ["partition_work", "tree_balanced_partition"]


def partition_work(forest: RolloutForest, part: Sequence[int]) -> int:
    """Compact rows of the trie of trajectories ``part`` (0 for an empty part)."""
    if len(part) == 0:
        return 0
    return int(forest.subset(np.asarray(part, np.int64)).num_compact_tokens)


def _trees(forest: RolloutForest) -> list[np.ndarray]:
    """Trajectory indices of each tree, in leaf order; trees in leaf order of their roots."""
    order = np.asarray(forest.leaf_order, np.int64)
    lcp = np.asarray(forest.adjacent_lcp, np.int64)
    cuts = np.flatnonzero(lcp == 0) + 1  # neighbours sharing no token start a new tree
    return [g for g in np.split(order, cuts) if g.shape[0]]


def tree_balanced_partition(
    sequences: Sequence[Any] | RolloutForest, dp_size: int
) -> list[list[int]]:
    """Split trajectories into ``dp_size`` parts of equal size (``N`` must be divisible by
    ``dp_size``), keeping trees together and balancing compact work (see module doc)."""
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size: expected a positive int, got {dp_size!r}")
    forest = (
        sequences
        if isinstance(sequences, RolloutForest)
        else RolloutForest.from_sequences(sequences)
    )
    n = forest.num_trajectories
    if n % dp_size:
        raise ValueError(f"sequences: {n} trajectories are not divisible by dp_size={dp_size}")
    share = n // dp_size
    pieces: list[np.ndarray] = []
    lcp_of = dict(zip(forest.leaf_order[1:].tolist(), forest.adjacent_lcp.tolist()))
    for tree in _trees(forest):
        stack = [tree]
        while stack:  # cut trees larger than one share at their lowest LCP
            t = stack.pop()
            if t.shape[0] <= share:
                pieces.append(t)
                continue
            inner = np.array([lcp_of[int(j)] for j in t[1:]], np.int64)
            cands = np.flatnonzero(inner == inner.min()) + 1
            cut = int(cands[np.argmin(np.abs(cands - share))])
            stack.extend([t[cut:], t[:cut]])
    work = [partition_work(forest, p) for p in pieces]
    order = sorted(range(len(pieces)), key=lambda i: (-pieces[i].shape[0], -work[i], i))
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in order:
        piece = pieces[i]
        room = [r for r in range(dp_size) if share - len(parts[r]) >= piece.shape[0]]
        if room:
            r = min(room, key=lambda q: (loads[q], q))
            parts[r].extend(piece.tolist())
            loads[r] += work[i]
            continue
        rest = piece.tolist()  # no rank has room for the whole piece: fill the emptiest first
        while rest:
            r = max(range(dp_size), key=lambda q: (share - len(parts[q]), -loads[q], -q))
            take = share - len(parts[r])
            parts[r].extend(rest[:take])
            loads[r] += partition_work(forest, rest[:take])
            rest = rest[take:]
    rank_of_leaf = {int(t): k for k, t in enumerate(forest.leaf_order.tolist())}
    return [sorted(p, key=rank_of_leaf.__getitem__) for p in parts]
