"""Tree-aware data-parallel balancing (numpy only; used by the trainer's ``_balance_batch``).

veRL's dispatcher cuts the reordered batch into ``dp_size`` consecutive equal chunks, one per
rank, and each rank cuts its chunk into ``num_mini_batches`` consecutive equal mini-batches (one
optimizer step each, a synchronisation point of all ranks). :func:`tree_balanced_partition`
chooses which trajectories go to which (rank, mini-batch) *cell* so that

* trajectories of one tree (same root row of the batch's token trie) stay in one cell whenever
  the equal-size constraint allows it (a tree larger than a cell is cut between leaf-order
  neighbours at its lowest common prefix, i.e. where cutting duplicates least work);
* the cells' work is balanced. Work is the planner's model
  (:func:`harts_verl.tree.microbatch.compact_work`: rows of the cell's own trie, what the tree
  engine runs): pieces are placed largest first on the feasible cell with the least work (LPT),
  then pairwise swaps of equal-size pieces lower the largest cell's work;
* cells are grouped into mini-batches with the planner's slot placement
  (:func:`harts_verl.tree.microbatch.place_microbatches`: works sorted decreasingly, ``dp_size``
  consecutive cells per mini-batch, larger cells to ranks with less work so far), so the ranks'
  work is balanced inside every mini-batch and in total.

Each cell's trajectories are listed in leaf order (prefix-sharing neighbours adjacent). The
result is a deterministic function of the sequences, ``dp_size`` and ``num_mini_batches``.

Every rank gets the same number of trajectories here; the engine then plans each rank's
micro-batches by compact work and makes their number equal across ranks (see
:mod:`harts_verl.workers.engine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from harts_verl.tree import RolloutForest
from harts_verl.tree.microbatch import compact_work, place_microbatches

__all__ = ["partition_work", "tree_balanced_partition"]

_SWAP_ROUNDS = 64  # bound on improving swaps (each lowers the largest cell's work)


def partition_work(forest: RolloutForest, part: Sequence[int]) -> int:
    """Compact rows of the trie of trajectories ``part`` (0 for an empty part): the planner's
    work model, :func:`~harts_verl.tree.microbatch.compact_work`."""
    return int(compact_work(forest, np.asarray(part, np.int64)))


def _trees(forest: RolloutForest) -> list[np.ndarray]:
    """Trajectory indices of each tree, in leaf order; trees in leaf order of their roots."""
    order = np.asarray(forest.leaf_order, np.int64)
    lcp = np.asarray(forest.adjacent_lcp, np.int64)
    cuts = np.flatnonzero(lcp == 0) + 1  # neighbours sharing no token start a new tree
    return [g for g in np.split(order, cuts) if g.shape[0]]


def _pieces(forest: RolloutForest, share: int) -> list[np.ndarray]:
    """Trees, cut recursively at their lowest adjacent LCP until every piece fits one cell."""
    pieces: list[np.ndarray] = []
    lcp_of = dict(zip(forest.leaf_order[1:].tolist(), forest.adjacent_lcp.tolist()))
    for tree in _trees(forest):
        stack = [tree]
        while stack:
            t = stack.pop()
            if t.shape[0] <= share:
                pieces.append(t)
                continue
            inner = np.array([lcp_of[int(j)] for j in t[1:]], np.int64)
            cands = np.flatnonzero(inner == inner.min()) + 1
            cut = int(cands[np.argmin(np.abs(cands - share))])
            stack.extend([t[cut:], t[:cut]])
    return pieces


def _lpt(
    forest: RolloutForest, pieces: list[np.ndarray], work: list[int], cells: int, share: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Pieces → cells of ``share`` trajectories: largest (size, work) first onto the feasible
    cell with the least work. Returns per cell its piece ids (−1: a fragment of a piece that fit
    nowhere whole) and its trajectories."""
    order = sorted(range(len(pieces)), key=lambda i: (-pieces[i].shape[0], -work[i], i))
    members: list[list[int]] = [[] for _ in range(cells)]
    ids: list[list[int]] = [[] for _ in range(cells)]
    loads = [0] * cells
    for i in order:
        piece = pieces[i]
        room = [r for r in range(cells) if share - len(members[r]) >= piece.shape[0]]
        if room:
            r = min(room, key=lambda q: (loads[q], q))
            members[r].extend(piece.tolist())
            ids[r].append(i)
            loads[r] += work[i]
            continue
        rest = piece.tolist()  # no cell has room for the whole piece: fill the emptiest first
        while rest:
            r = max(range(cells), key=lambda q: (share - len(members[q]), -loads[q], -q))
            take = share - len(members[r])
            members[r].extend(rest[:take])
            ids[r].append(-1)
            loads[r] += partition_work(forest, rest[:take])
            rest = rest[take:]
    return ids, members


def _swap(pieces: list[np.ndarray], work: list[int], ids: list[list[int]]) -> None:
    """Swap equal-size whole pieces between the heaviest cell and another cell while that lowers
    the pair's larger work (pieces are disjoint trees or tree parts, so cell work ≈ Σ piece
    work; exact for whole trees). In place."""
    if any(-1 in c for c in ids):
        return
    for _ in range(_SWAP_ROUNDS):
        loads = [sum(work[i] for i in c) for c in ids]
        hi = int(np.argmax(loads))
        best: tuple[int, int, int, int] | None = None  # (new pair max, other cell, a, b)
        for lo in range(len(ids)):
            if lo == hi:
                continue
            for a in ids[hi]:
                for b in ids[lo]:
                    if pieces[a].shape[0] != pieces[b].shape[0] or work[a] <= work[b]:
                        continue
                    d = work[a] - work[b]
                    new_max = max(loads[hi] - d, loads[lo] + d)
                    if new_max < loads[hi] and (best is None or new_max < best[0]):
                        best = (new_max, lo, a, b)
        if best is None:
            return
        _, lo, a, b = best
        ids[hi][ids[hi].index(a)] = b
        ids[lo][ids[lo].index(b)] = a


def tree_balanced_partition(
    sequences: Sequence[Any] | RolloutForest, dp_size: int, num_mini_batches: int = 1
) -> list[list[int]]:
    """Split trajectories into ``dp_size`` parts of equal size, each the concatenation of
    ``num_mini_batches`` equal cells (``N`` must be divisible by ``dp_size · num_mini_batches``),
    keeping trees together and balancing compact work (see module doc)."""
    for name, v in (("dp_size", dp_size), ("num_mini_batches", num_mini_batches)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    forest = (
        sequences
        if isinstance(sequences, RolloutForest)
        else RolloutForest.from_sequences(sequences)
    )
    n = forest.num_trajectories
    cells = int(dp_size) * int(num_mini_batches)
    if n % cells:
        raise ValueError(
            f"sequences: {n} trajectories are not divisible by dp_size={dp_size} x "
            f"num_mini_batches={num_mini_batches}"
        )
    share = n // cells
    pieces = _pieces(forest, share)
    work = [partition_work(forest, p) for p in pieces]
    ids, members = _lpt(forest, pieces, work, cells, share)
    if all(-1 not in c for c in ids):
        _swap(pieces, work, ids)
        members = [[j for i in c for j in pieces[i].tolist()] for c in ids]
    rank_of_leaf = np.empty(n, np.int64)
    rank_of_leaf[forest.leaf_order] = np.arange(n)
    members = [sorted(m, key=lambda j: int(rank_of_leaf[j])) for m in members]
    cell_work = np.array([partition_work(forest, m) for m in members], np.int64)
    slot, replica, _ = place_microbatches(cell_work, int(dp_size))
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    for c in np.lexsort((replica, slot)).tolist():  # mini-batch 0 first on every rank
        parts[int(replica[c])].extend(members[c])
    return parts
