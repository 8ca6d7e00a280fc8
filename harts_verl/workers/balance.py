"""Tree-aware data-parallel balancing (numpy only; used by the trainer's ``_balance_batch``).

veRL's dispatcher cuts the reordered batch into ``dp_size`` consecutive equal chunks, one per
rank, and each rank cuts its chunk into ``num_mini_batches`` consecutive equal mini-batches (one
optimizer step each, a synchronisation point of all ranks). :func:`tree_balanced_partition`
chooses which trajectories go to which (rank, mini-batch) *cell* so that

* trajectories of one tree (same root row of the batch's token trie) stay in one cell whenever
  the equal-size constraint allows it. A tree larger than a cell is first cut between leaf-order
  neighbours at its lowest common prefix (where cutting duplicates least work) into *pieces*
  that fit a cell. Pieces are then placed whole: greedily (below) and, when the greedy placement
  would have to cut a piece, by an exact search over the pieces' sizes (cells must be filled
  exactly: a multi-way subset-sum, depth-first with memoised dead states and subset-sum
  pruning) for a placement that cuts none. That search balances work as it goes and suits up
  to ~32 cells; when it finds nothing within :data:`_SEARCH_BUDGET` cell visits (many cells), a
  second search fills the cells one at a time over the pieces' size counts (bin completion,
  :data:`_COMPLETE_BUDGET` completions; e.g. 256 cells of 16 built from trees of 4–16 in
  ~0.05 s). Only when neither finds a placement (none exists, or both budgets run out) is a
  piece cut between leaf-order neighbours to fill the cells;
* the cells' work is balanced. Work is the planner's model
  (:func:`harts_verl.tree.microbatch.compact_work`: rows of the cell's own trie, what the tree
  engine runs): pieces are placed largest first on the feasible cell with the least work (LPT;
  the exact search tries cells in the same order, then spends at most :data:`_IMPROVE_BUDGET`
  more cell visits on a placement with a smaller largest cell), then pairwise swaps of
  equal-size pieces lower the largest cell's work;
* cells are grouped into mini-batches with the planner's slot placement
  (:func:`harts_verl.tree.microbatch.place_microbatches`: works sorted decreasingly, ``dp_size``
  consecutive cells per mini-batch, larger cells to ranks with less work so far), so the ranks'
  work is balanced inside every mini-batch and in total.

Each cell's trajectories are listed in leaf order (prefix-sharing neighbours adjacent). The
result is a deterministic function of the sequences, ``dp_size`` and ``num_mini_batches``.

Work is evaluated on one leaf-order view of the batch built once per call (prefix sums of
lengths and neighbour LCPs): a piece's work in O(1), a cell's in O(its leaf-order span) (the
LCP of consecutive members is a minimum of neighbour LCPs), no pairwise LCP table.

Every rank gets the same number of trajectories here; the engine then plans each rank's
micro-batches by compact work and makes their number equal across ranks (see
:mod:`harts_verl.workers.engine`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from harts_verl.tree import RolloutForest
from harts_verl.tree.microbatch import place_microbatches

__all__ = ["partition_work", "tree_balanced_partition"]

_SWAP_ROUNDS = 64  # bound on improving swaps (each lowers the largest cell's work)
_SEARCH_BUDGET = 200_000  # bound on the search for a placement cutting no piece (cell visits)
_IMPROVE_BUDGET = 40_000  # then bound on the search for a better one (cell visits)
_COMPLETE_BUDGET = 20_000  # bound on the cell-by-cell search (completions tried)


class _Work:
    """Leaf-order view of a forest with its compact-work oracle, built once in O(n).

    Positions are leaf-order ranks. The work of a set of positions ``p_0 < … < p_k`` is
    ``Σ len(p_i) − Σ LCP(p_i, p_{i+1})`` with ``LCP(p, q) = min(adj[p:q])`` (the trie of the set:
    :func:`~harts_verl.tree.microbatch.compact_work`)."""

    def __init__(self, forest: RolloutForest) -> None:
        self.order = np.asarray(forest.leaf_order, np.int64)
        n = self.n = int(self.order.shape[0])
        self.rank = np.empty(n, np.int64)
        self.rank[self.order] = np.arange(n, dtype=np.int64)
        self.lens = np.asarray(forest.lengths, np.int64)[self.order]
        self.adj = np.asarray(forest.adjacent_lcp, np.int64)
        self.cl = np.zeros(n + 1, np.int64)
        np.cumsum(self.lens, out=self.cl[1:])
        self.ca = np.zeros(max(n, 1), np.int64)
        if n > 1:
            np.cumsum(self.adj, out=self.ca[1:])

    def range_work(self, a: int, b: int) -> int:
        """Work of the positions ``[a, b)``."""
        if b <= a:
            return 0
        return int(self.cl[b] - self.cl[a] - (self.ca[b - 1] - self.ca[a]))

    def set_work(self, pos: np.ndarray) -> int:
        """Work of the positions ``pos`` (sorted ascending, no duplicates), O(span)."""
        if pos.shape[0] == 0:
            return 0
        w = int(self.lens[pos].sum())
        if pos.shape[0] > 1:
            w -= int(np.minimum.reduceat(self.adj[: int(pos[-1])], pos[:-1]).sum())
        return w


def partition_work(forest: RolloutForest, part: Sequence[int]) -> int:
    """Compact rows of the trie of trajectories ``part`` (any order, a repeated index counts
    once; 0 for an empty part): the planner's work model,
    :func:`~harts_verl.tree.microbatch.compact_work`, in O(n) without the planner's leaf view."""
    if not isinstance(forest, RolloutForest):
        raise TypeError(f"forest: expected a RolloutForest, got {type(forest).__name__}")
    idx = np.asarray(part, np.int64)
    n = forest.num_trajectories
    if idx.ndim != 1:
        raise ValueError("trajectories: expected a 1-D array of integer trajectory indices")
    if idx.size == 0:
        return 0
    if int(idx.min()) < 0 or int(idx.max()) >= n:
        raise ValueError(f"trajectories: index out of range for {n} trajectories")
    lv = _Work(forest)
    return lv.set_work(np.unique(lv.rank[idx]))


def _pieces(lv: _Work, share: int) -> list[tuple[int, int]]:
    """Trees (maximal leaf-order ranges whose neighbours share a token), cut recursively at their
    lowest adjacent LCP (the cut nearest ``share`` among ties) until every piece fits one cell.
    Pieces as position ranges ``[a, b)``."""
    starts = np.concatenate([[0], np.flatnonzero(lv.adj == 0) + 1, [lv.n]]).tolist()
    pieces: list[tuple[int, int]] = []
    for a0, b0 in itertools.pairwise(starts):
        if b0 <= a0:
            continue
        stack = [(a0, b0)]
        while stack:
            a, b = stack.pop()
            if b - a <= share:
                pieces.append((a, b))
                continue
            inner = lv.adj[a : b - 1]
            cands = np.flatnonzero(inner == inner.min()) + 1
            cut = a + int(cands[np.argmin(np.abs(cands - share))])
            stack.extend([(cut, b), (a, cut)])
    return pieces


def _lpt(
    lv: _Work,
    pieces: list[tuple[int, int]],
    size: np.ndarray,
    work: np.ndarray,
    share: int,
    cells: int,
) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Pieces → cells of ``share`` trajectories: largest (size, work) first onto the feasible
    cell with the least work. Returns per cell its piece ids (−1: a fragment of a piece that fit
    nowhere whole) and its position ranges."""
    order = np.lexsort((np.arange(len(pieces)), -work, -size)).tolist()
    ids: list[list[int]] = [[] for _ in range(cells)]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(cells)]
    fill = np.zeros(cells, np.int64)
    loads = np.zeros(cells, np.int64)
    top = np.iinfo(np.int64).max
    for i in order:
        s = int(size[i])
        room = share - fill >= s
        if room.any():  # least work among the cells with room (ties: lowest cell)
            r = int(np.argmin(np.where(room, loads, top)))
            ids[r].append(i)
            ranges[r].append(pieces[i])
            fill[r] += s
            loads[r] += work[i]
            continue
        a, b = pieces[i]  # no cell has room for the whole piece: fill the emptiest first
        while a < b:
            free = share - fill
            r = int(np.argmin(np.where(free == free.max(), loads, top)))
            take = min(int(free[r]), b - a)
            ids[r].append(-1)
            ranges[r].append((a, a + take))
            fill[r] += take
            loads[r] += lv.range_work(a, a + take)
            a += take
    return ids, ranges


def _exact(size: np.ndarray, work: np.ndarray, share: int, cells: int) -> list[list[int]] | None:
    """Whole pieces → cells filled exactly (``share`` trajectories each), or None when there is
    no such placement or none is found within :data:`_SEARCH_BUDGET` cell visits.

    Depth-first over the pieces in LPT order (size, then work, decreasing); a piece tries the
    cells with room in order of least work so far. A state (next piece, multiset of free rooms)
    proven infeasible is skipped, and a placement is pruned unless every free room stays a
    subset sum of the pieces still to place. Until a first placement is found, cells with equal
    room count once (interchangeable for feasibility); after it, the search goes on (branch and
    bound on the largest cell work, within the budget) for a placement with a smaller maximum."""
    p = int(size.shape[0])
    order = np.lexsort((np.arange(p), -work, -size)).tolist()
    sz = [int(size[i]) for i in order]
    wk = [int(work[i]) for i in order]
    full = (1 << (share + 1)) - 1
    reach = [1] * (p + 1)  # reach[k]: bit r set iff r is a subset sum of sz[k:]
    for k in range(p - 1, -1, -1):
        reach[k] = (reach[k + 1] | (reach[k + 1] << sz[k])) & full
    if not (reach[0] >> share) & 1:
        return None
    lower = -(-sum(wk) // cells)  # no placement has a smaller maximum
    rooms = [share] * cells
    loads = [0] * cells
    cell_of = [-1] * p
    dead: set[tuple[int, tuple[int, ...]]] = set()  # infeasible whatever the loads
    best: list[int] | None = None
    best_max = 0
    visits, limit = 0, _SEARCH_BUDGET

    def candidates(k: int) -> list[int]:
        nonlocal visits
        visits += cells
        s, nxt = sz[k], reach[k + 1]
        bad = [r for r in set(rooms) if not (nxt >> r) & 1]  # rooms piece k itself must shrink
        if len(bad) > 1 or (bad and rooms.count(bad[0]) > 1):
            return []
        out, seen = [], set()
        for c in sorted(range(cells), key=lambda q: (loads[q], q)):
            r = rooms[c]
            if r < s or not (nxt >> (r - s)) & 1 or (bad and r != bad[0]):
                continue
            sym = r if best is None else (r, loads[c])
            if sym in seen:
                continue
            seen.add(sym)
            out.append(c)
        return out

    # frame: [state key, candidate cells, next candidate, a bound cut something below]
    frames: list[list[Any]] = [[(0, tuple(rooms)), candidates(0), 0, False]]
    while frames:
        k = len(frames) - 1
        frame = frames[-1]
        if cell_of[k] >= 0:  # back from a child (or a skipped one): undo piece k
            c = cell_of[k]
            rooms[c] += sz[k]
            loads[c] -= wk[k]
            cell_of[k] = -1
        if visits > limit:
            break
        if frame[2] == len(frame[1]):
            if not frame[3]:
                dead.add(frame[0])
            elif k:
                frames[-2][3] = True
            frames.pop()
            continue
        c = frame[1][frame[2]]
        frame[2] += 1
        if best is not None and loads[c] + wk[k] >= best_max:
            frame[3] = True
            continue
        rooms[c] -= sz[k]
        loads[c] += wk[k]
        cell_of[k] = c
        if k + 1 == p:
            if best is None:
                limit = visits + _IMPROVE_BUDGET
            best, best_max = list(cell_of), max(loads)
            frame[3] = True
            if best_max <= lower:
                break
            continue
        key = (k + 1, tuple(sorted(rooms)))
        if key not in dead:
            frames.append([key, candidates(k + 1), 0, False])
    if best is None:
        return None
    ids: list[list[int]] = [[] for _ in range(cells)]
    for j in range(p):
        ids[best[j]].append(order[j])
    return ids


def _completions(counts: list[int], share: int) -> Iterator[tuple[list[int], list[int]]]:
    """Fillings of one cell: one piece of the largest remaining size ``s`` plus a sub-multiset of
    the other pieces summing to ``share − s`` (sizes ``<= s``, larger sizes taken first). Yields
    ``(taken, rest)``: the cell's piece count per size and the counts that remain."""
    s = max(v for v, c in enumerate(counts) if c)
    rest = list(counts)
    rest[s] -= 1
    sizes = [v for v in range(s, 0, -1) if rest[v]]  # decreasing
    # below[j]: bitset of the sums of sub-multisets of the sizes sizes[j:]
    full = (1 << (share + 1)) - 1
    below = [1] * (len(sizes) + 1)
    for j in range(len(sizes) - 1, -1, -1):
        v, c, k, bits = sizes[j], rest[sizes[j]], 1, below[j + 1]
        while c > 0:  # a bounded multiset by binary splitting: blocks of 1, 2, 4, … pieces
            t = min(k, c)
            bits = (bits | (bits << (t * v))) & full
            c, k = c - t, k << 1
        below[j] = bits
    taken = [0] * len(counts)
    taken[s] = 1

    def go(j: int, need: int) -> Iterator[tuple[list[int], list[int]]]:
        if need == 0:
            yield list(taken), [c - t for c, t in zip(counts, taken, strict=True)]
            return
        if j == len(sizes) or not (below[j] >> need) & 1:
            return
        v = sizes[j]
        for k in range(min(rest[v], need // v), -1, -1):
            if (below[j + 1] >> (need - k * v)) & 1:
                taken[v] += k
                yield from go(j + 1, need - k * v)
                taken[v] -= k

    yield from go(0, share - s)


def _complete(size: np.ndarray, work: np.ndarray, share: int, cells: int) -> list[list[int]] | None:
    """Whole pieces → cells filled exactly, one cell at a time (bin completion), or None when
    there is none or none is found within :data:`_COMPLETE_BUDGET` completions.

    Feasibility depends only on how many pieces of each size remain, so the search runs over
    size counts: each cell takes the largest remaining size (cells are interchangeable) and a
    completion to exactly ``share``; count vectors proven infeasible are not revisited. Pieces
    of each size are then dealt to the cells that take that size, heaviest piece first onto the
    cell with the least work so far."""
    if int(size.max(initial=0)) > share or int(size.sum()) != share * cells:
        return None
    counts = np.bincount(size, minlength=share + 1).tolist()
    dead: set[tuple[int, ...]] = set()
    stack = [_completions(counts, share)]
    keys = [tuple(counts)]
    patterns: list[list[int]] = []
    tried = 0
    while stack:
        if tried >= _COMPLETE_BUDGET:
            return None
        nxt = next(stack[-1], None)
        if nxt is None:
            dead.add(keys.pop())
            stack.pop()
            if patterns:  # the filling that led here fails
                patterns.pop()
            continue
        tried += 1
        pattern, rest = nxt
        key = tuple(rest)
        if key in dead:
            continue
        patterns.append(pattern)
        if len(patterns) == cells:
            break
        stack.append(_completions(rest, share))
        keys.append(key)
    else:
        return None
    ids: list[list[int]] = [[] for _ in range(cells)]
    loads = np.zeros(cells, np.int64)
    for v in range(share, 0, -1):
        need = np.array([p[v] for p in patterns], np.int64)
        for i in sorted(np.flatnonzero(size == v).tolist(), key=lambda i: (-int(work[i]), i)):
            c = int(np.argmin(np.where(need > 0, loads, np.iinfo(np.int64).max)))
            ids[c].append(i)
            need[c] -= 1
            loads[c] += int(work[i])
    return ids


def _swap(size: np.ndarray, work: np.ndarray, ids: list[list[int]]) -> None:
    """Swap equal-size whole pieces between the heaviest cell and another cell while that lowers
    the pair's larger work (pieces are disjoint trees or tree parts, so cell work ≈ Σ piece
    work; exact for whole trees). Each round takes the swap with the smallest new pair maximum
    (ties: lowest other cell, then the pieces' order in their cells). In place.

    Vectorized: for every piece ``a`` of the heaviest cell and every other cell, the best
    partner is the piece of equal size whose work is nearest ``work[a] − gap / 2`` (``gap``: the
    two cells' work difference), found by binary search in the pieces sorted by (cell, size,
    work)."""
    cells = len(ids)
    p = int(size.shape[0])
    if p == 0 or cells < 2:
        return
    cell = np.empty(p, np.int64)
    for c, members in enumerate(ids):
        cell[members] = c
    uw, wrank = np.unique(work, return_inverse=True)
    nu = int(uw.shape[0])
    smax = int(size.max()) + 1
    loads = np.array([sum(int(work[i]) for i in c) for c in ids], np.int64)
    others = np.arange(cells, dtype=np.int64)
    for _ in range(_SWAP_ROUNDS):
        hi = int(np.argmax(loads))
        lh = int(loads[hi])
        lo = others[others != hi]
        gap = lh - loads[lo]
        lo, gap = lo[gap >= 2], gap[gap >= 2]  # a swap moves 0 < d < gap
        if lo.size == 0:
            return
        key = (cell * smax + size) * nu + wrank
        srt = np.argsort(key, kind="stable")
        ks = key[srt]
        a = np.asarray(ids[hi], np.int64)
        wa = work[a][:, None]
        g = gap[None, :]
        base = (lo[None, :] * smax + size[a][:, None]) * nu  # [a, lo]
        # partner below the ideal (work <= wa − ceil(gap/2)) and above it (>= wa − gap // 2)
        r1 = np.searchsorted(uw, wa - (g + 1) // 2, side="right") - 1
        i1 = np.searchsorted(ks, base + r1, side="right") - 1
        r2 = np.searchsorted(uw, wa - g // 2, side="left")
        i2 = np.searchsorted(ks, base + r2, side="left")
        best = np.full(base.shape, np.iinfo(np.int64).max, np.int64)
        ll = loads[lo][None, :]
        for i, ok in ((i1, i1 >= 0), (i2, i2 < p)):
            ic = np.clip(i, 0, p - 1)
            kc = ks[ic]
            wb = work[srt[ic]]
            ok = ok & (kc >= base) & (kc < base + nu) & (wb < wa) & (wb > wa - g)
            new_max = np.maximum(lh - wa + wb, ll + wa - wb)
            best = np.where(ok, np.minimum(best, new_max), best)
        v = int(best.min())
        if v >= lh:
            return
        ia, jl = np.nonzero(best == v)
        pick = np.lexsort((ia, lo[jl]))[0]
        pa, c_lo = int(a[ia[pick]]), int(lo[jl[pick]])
        cand = np.asarray(ids[c_lo], np.int64)
        wb = work[cand]
        wpa, llo = int(work[pa]), int(loads[c_lo])
        fit = (size[cand] == size[pa]) & (wb < wpa) & (wb > wpa - (lh - llo))
        fit &= np.maximum(lh - wpa + wb, llo + wpa - wb) == v
        pb = int(cand[np.flatnonzero(fit)[0]])
        ids[hi][ids[hi].index(pa)] = pb
        ids[c_lo][ids[c_lo].index(pb)] = pa
        cell[pa], cell[pb] = c_lo, hi
        d = wpa - int(work[pb])
        loads[hi] -= d
        loads[c_lo] += d


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
    lv = _Work(forest)  # the one leaf-order view every work evaluation below uses
    pieces = _pieces(lv, share)
    size = np.array([b - a for a, b in pieces], np.int64)
    work = np.array([lv.range_work(a, b) for a, b in pieces], np.int64)
    ids, ranges = _lpt(lv, pieces, size, work, share, cells)
    if any(-1 in c for c in ids):  # greedy had to cut a piece: look for a placement that doesn't
        found = _exact(size, work, share, cells)
        if found is None:  # none, or the search ran out (many cells): fill cell by cell
            found = _complete(size, work, share, cells)
        if found is not None:
            ids = found
    if all(-1 not in c for c in ids):
        _swap(size, work, ids)
        ranges = [[pieces[i] for i in c] for c in ids]
    members = [
        np.sort(np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in r]))
        if r
        else np.zeros(0, np.int64)
        for r in ranges
    ]  # positions, i.e. leaf order
    cell_work = np.array([lv.set_work(m) for m in members], np.int64)
    slot, replica, _ = place_microbatches(cell_work, int(dp_size))
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    for c in np.lexsort((replica, slot)).tolist():  # mini-batch 0 first on every rank
        parts[int(replica[c])].extend(lv.order[members[c]].tolist())
    return parts
