"""Tree-aware data-parallel balancing (numpy only; used by the trainer's ``_balance_batch``).

veRL's dispatcher cuts the reordered batch into ``dp_size`` consecutive equal chunks, one per
rank, and each rank cuts its chunk into ``num_mini_batches`` consecutive equal mini-batches (one
optimizer step each, a synchronisation point of all ranks). :func:`tree_balanced_partition`
chooses which trajectories go to which (rank, mini-batch) *cell* so that

* trajectories of one tree stay in one cell whenever the equal-size constraint allows it. The
  trees are the children of the batch trie's lowest branch: the root rows, or the rows below a
  prefix every trajectory shares (a chat template makes the batch one trie, not one tree). A
  tree larger than a cell is first cut between leaf-order neighbours at its lowest common
  prefix (where cutting duplicates least work), the cut nearest a cell's size, recursively into
  *pieces* that fit a cell. Pieces are then placed whole: greedily (below) and, when the greedy
  placement would have to cut a piece, by an exact search over the pieces' sizes (cells must be
  filled exactly: a multi-way subset-sum, depth-first with memoised dead states and subset-sum
  pruning) for a placement that cuts none. That search balances work as it goes and suits up
  to ~32 cells; a second search fills the cells one at a time over the pieces' size counts
  (bin completion, :data:`_COMPLETE_BUDGET` completions; e.g. 256 cells of 16 built from
  trees of 4–16 in ~0.05 s). It runs first, for at most :data:`_PROOF_BUDGET` completions
  after two bin-packing bounds (:func:`_cells_needed`): when they prove there is no such
  placement, the exact search is skipped (it would spend its whole budget: 0.36 s of 2.1 s per
  round on 100 prompt groups of 8 and 32 padding samples at dp 8 × 4 mini-batches). The
  exact search may prove so too; only when it runs out of its :data:`_SEARCH_BUDGET` cell
  visits (many cells) does the size-count search go on with its whole budget, and its
  placement is taken (300 random batches: 14.4 s → 8.3 s in all, the slowest 0.91 s → 0.26 s,
  the same placements). When neither finds one, the largest piece cut from a tree is cut again, at its own
  lowest branch, and the searches run again (at most :data:`_REFINE_ROUNDS` times, batches of
  at most :data:`_REFINE_MAX_CELLS` cells, or more where only cells of padding only are left
  to fill), so a tree that fits a cell is not cut while one that
  is cut anyway can be cut elsewhere; when no piece cut from a tree is left, the largest whole
  tree is cut so (one cut tree instead of the greedy fills' arbitrary ones: 31 of 600 random
  GRPO batches cut more trees than a brute-force minimum before, none
  after). Of every placement found (the greedy ones with a piece cut
  between leaf-order neighbours to fill the cells among them), the one with the fewest cells
  of padding only wins (see below), then the one cutting the fewest trees, then the fewest
  subtrees (:func:`_subtrees`), then the one with the smallest largest cell work, then the
  smallest total work;
* the cells' work is balanced. Work is the planner's model
  (:func:`harts_verl.tree.microbatch.compact_work`: rows of the cell's own trie, what the tree
  engine runs): pieces are placed largest first on the feasible cell whose work after it is
  least (LPT, once with the prefix a piece shares with the cell's pieces counted once, once
  without; the exact search tries cells in order of least work, then spends at most
  :data:`_IMPROVE_BUDGET` more cell visits on a placement with a smaller largest cell), then
  pairwise swaps of equal-size pieces between the heaviest cell and another lower the largest
  cell's work (a swap is made only when the two cells' exact works both end below it);
* cells are grouped into mini-batches with the planner's slot placement
  (:func:`harts_verl.tree.microbatch.place_microbatches`: works sorted decreasingly, ``dp_size``
  consecutive cells per mini-batch, larger cells to ranks with less work so far), so the ranks'
  work is balanced inside every mini-batch and in total.

Padding trajectories (``padding``: veRL's upsampler fills a batch to a multiple of the cells with
identical samples that carry no loss) are placed as single-trajectory trees of their own,
after the real ones in the leaf-order view and sharing no prefix with them there (identical
padding samples in one cell count once, as the engine runs them; the cell works returned are
exact), so they fill cells one by one instead of being kept together at the cost of a cut real
tree. When no placement keeps the real trees whole, the largest one is cut at its own lowest
branch and the searches run again (as for pieces cut from a tree), so the padding info never
costs a cut tree that the chat template's one tree did not (at as few cells of padding only).
The placement found without the padding info (which may keep identical padding samples
together, in fewer cells) is ranked beside it by the same cells of padding only, trees,
subtrees and exact works, and the better one is kept. The real
trajectories are split into their trees even when they fit one cell (veRL may pad a batch to a
multiple larger than the cells), so they spread over the cells instead of one rank running
them all. A cell of padding only is a rank (or a rank's mini-batch) without a loss token: veRL
averages per-rank metrics over DP, so its zeros would halve ``ppo_kl``, ``pg_clipfrac``, ...; and
the rank idles while the others run the real trees. It is avoided wherever there are real
trajectories enough, before trees are kept whole (a prompt group cut to fill it costs its
prompt once more on a rank that would have idled; e.g. two prompt groups of 2 padded to 16
on 4 ranks: one trajectory per rank, not two ranks of padding only): the greedy also places
the real pieces before the padding (which then fills what they leave), no swap takes a
cell's last real piece, and while cells of padding only are left, pieces of a tree cut
anyway are cut finer (that cuts no more trees), else the largest whole tree is cut (and the
next largest, while there are fewer real pieces than cells to give one each), and the
searches run again. Among such placements, the fewest trees are cut (2,621 random small
padded batches: never a cell of padding only where a real trajectory could fill it, and
always the fewest cut trees a brute force over all placements finds).

Each cell's trajectories are listed in leaf order (prefix-sharing neighbours adjacent). The
result is a deterministic function of the sequences, ``dp_size``, ``num_mini_batches`` and
``padding``.

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

__all__ = ["padding_only_cells", "tree_balanced_cells", "tree_balanced_partition"]

_SWAP_ROUNDS = 64  # bound on improving swaps (each lowers the largest cell's work)
_SHARED_LEVELS = 4  # nodes above a piece whose shared prefix the greedy placement counts
_SWAP_TRIES = 16  # swaps tried per round, best estimate first, until one lowers it exactly
_SEARCH_BUDGET = 200_000  # bound on the search for a placement cutting no piece (cell visits)
_IMPROVE_BUDGET = 40_000  # then bound on the search for a better one (cell visits)
_COMPLETE_BUDGET = 20_000  # bound on the cell-by-cell search (completions tried)
_PROOF_BUDGET = 2_000  # ... on its first run, before the exact search (for a proof of none)
_REFINE_ROUNDS = 8  # bound on the pieces cut finer when no placement keeps them whole
_REFINE_MAX_CELLS = 256  # ... and on the cells of a batch where that is tried


class _Work:
    """Leaf-order view of a forest with its compact-work oracle, built once in O(n).

    Positions are leaf-order ranks. The work of a set of positions ``p_0 < … < p_k`` is
    ``Σ len(p_i) − Σ LCP(p_i, p_{i+1})`` with ``LCP(p, q) = min(adj[p:q])`` (the trie of the set:
    :func:`~harts_verl.tree.microbatch.compact_work`). With ``padding`` (a bool per
    trajectory), the padding trajectories take the last positions, in their leaf order, sharing
    no prefix with the real ones (so each is a tree of its own) but their true prefixes with
    each other (a cell's work counts veRL's identical padding samples once, as the engine runs
    them); ``padpos`` marks those positions (None without padding)."""

    def __init__(self, forest: RolloutForest, padding: np.ndarray | None = None) -> None:
        order = np.asarray(forest.leaf_order, np.int64)
        adj = np.asarray(forest.adjacent_lcp, np.int64)
        n = self.n = int(order.shape[0])
        self.n_real = n  # positions [n_real, n) are padding trajectories
        if padding is not None and padding.any():
            # real trajectories first, in leaf order, with their true neighbour LCPs (a min over
            # the padding between them); then the padding likewise, sharing nothing with them
            keep = np.flatnonzero(~padding[order])
            pads = np.flatnonzero(padding[order])
            real, same = (
                np.minimum.reduceat(adj[: int(p[-1])], p[:-1])
                if p.shape[0] > 1
                else np.zeros(0, np.int64)
                for p in (keep, pads)
            )
            self.n_real = int(keep.shape[0])
            order = np.concatenate([order[keep], order[pads]])
            adj = np.zeros(max(n - 1, 0), np.int64)
            adj[: real.shape[0]] = real
            adj[self.n_real : self.n_real + same.shape[0]] = same
        self.order = order
        self.padpos = np.arange(n) >= self.n_real if self.n_real < n else None
        self.rank = np.empty(n, np.int64)
        self.rank[self.order] = np.arange(n, dtype=np.int64)
        self.lens = np.asarray(forest.lengths, np.int64)[self.order]
        self.adj = adj
        self.cl = np.zeros(n + 1, np.int64)
        np.cumsum(self.lens, out=self.cl[1:])
        self.ca = np.zeros(max(n, 1), np.int64)
        if n > 1:
            np.cumsum(self.adj, out=self.ca[1:])

    def splits_real(self, share: int) -> bool:
        """Whether the real trajectories are split into their trees: when they exceed a cell of
        ``share``, and beside padding even when they fit one (so that they spread over the
        cells the padding would otherwise fill alone, one rank running them all)."""
        return self.n_real > share or 1 < self.n_real < self.n

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


class _Pieces:
    """Pieces of a batch: leaf-order position ranges ``[a, b)`` of at most ``share`` trajectories,
    each a subtree of the batch's trie or a union of sibling subtrees.

    A range larger than ``share`` is a *node* (``depth``: the prefix all its trajectories share,
    0 for unrelated trees), split at its lowest adjacent LCPs: the whole batch at every one of
    them (into its trees: the children of its lowest branch, so a prefix every trajectory
    shares, a chat template, costs nothing), a tree at the one nearest ``share`` (two parts,
    the fewest duplicated rows), recursively until every range fits. ``node_of[i]``: the node
    piece ``i`` was cut from (−1: the batch fits one cell, or a padding trajectory of
    :class:`_Work`, a piece of its own); ``parent[v]``: node ``v``'s node (−1 at the top). A
    cell holding another piece below node ``v`` shares ``depth[v]`` rows with piece ``i`` for
    each ancestor ``v`` of ``i``, the deepest one counting."""

    def __init__(self, lv: _Work, share: int) -> None:
        self.depth: list[int] = []
        self.parent: list[int] = []
        self._adj = lv.adj
        # padding trajectories are pieces of their own; the real ones are split as a batch
        self.ranges: list[tuple[int, int]] = [(p, p + 1) for p in range(lv.n_real, lv.n)]
        self.node_of: list[int] = [-1] * len(self.ranges)
        # the real trajectories' node (its children: the trees) when they are split, -1 else
        split = lv.splits_real(share)
        self._top = 0 if split else -1
        stack = [(0, lv.n_real, -1)] if lv.n_real else []
        while stack:
            a, b, up = stack.pop()
            if b - a <= share and not (split and up < 0):
                self.ranges.append((a, b))
                self.node_of.append(up)
            else:
                stack.extend(reversed(self._children(a, b, up, share if up >= 0 else None)))

    def _children(
        self, a: int, b: int, up: int, near: int | None = None
    ) -> list[tuple[int, int, int]]:
        """``[a, b)`` (two or more positions) as a new node below node ``up``: its children's
        ranges, cut at every lowest adjacent LCP, or (``near``) at the one nearest ``a + near``."""
        inner = self._adj[a : b - 1]
        low = int(inner.min())
        node = len(self.depth)
        self.depth.append(low)
        self.parent.append(up)
        cands = np.flatnonzero(inner == low) + 1
        if near is not None:
            cands = cands[[int(np.argmin(np.abs(cands - near)))]]
        cuts = [a, *(cands + a).tolist(), b]
        return [(x, y, node) for x, y in itertools.pairwise(cuts)]

    def ancestors(self, i: int, k: int) -> list[int]:
        """The (at most ``k``) nearest nodes above piece ``i`` that share rows (depth > 0),
        outermost first."""
        out, v = [], self.node_of[i]
        while v >= 0 and len(out) < k:
            if self.depth[v] > 0:
                out.append(v)
            v = self.parent[v]
        return out[::-1]

    def refine(self, more: int = 1, spread: int = 0) -> bool:
        """Split the largest piece cut from a tree (its node is below the top one, the batch,
        whose children are the trees; ties: the leftmost) one level, into the children of its
        own lowest branch, and so on until there are ``more`` pieces more. When no piece cut
        from a tree is left, the largest whole tree is split so, and no further one in this
        call (some tree must be cut: the searches then look for a placement that cuts only it,
        where the greedy fills could cut two) unless fewer than ``spread`` pieces were added so
        far (pieces any placement needs: a cell of padding only is filled by a real piece of
        its own, so cutting one tree per call and search could leave such cells after
        :data:`_REFINE_ROUNDS`). False when nothing was split: every piece is a single
        trajectory or the batch fits one cell."""
        added = 0
        while added < more:
            cut = [  # below a node below the top one (the batch): the top's children are trees
                (a - b, a, i)
                for i, (a, b) in enumerate(self.ranges)
                if b - a > 1 and self.node_of[i] >= 0 and self.parent[self.node_of[i]] >= 0
            ]
            tree = not cut
            if tree and self._top >= 0:
                cut = [
                    (a - b, a, i)
                    for i, (a, b) in enumerate(self.ranges)
                    if b - a > 1 and self.node_of[i] == self._top
                ]
            if not cut:
                break
            i = min(cut)[2]
            (a, b), up = self.ranges.pop(i), self.node_of.pop(i)
            children = self._children(a, b, up)
            for x, y, node in children:
                self.ranges.append((x, y))
                self.node_of.append(node)
            added += len(children) - 1
            if tree and added >= spread:  # one more tree cut per call, past the pieces needed
                break
        return added > 0

    def own_work(self, work: np.ndarray) -> np.ndarray:
        """Each piece's work below the prefix it shares with its siblings (its whole work for an
        unsplit tree): the additive estimate of a cell's work the searches balance."""
        shared = np.array([self.depth[v] if v >= 0 else 0 for v in self.node_of], np.int64)
        return work - shared


def _lpt(
    lv: _Work,
    pcs: _Pieces,
    size: np.ndarray,
    work: np.ndarray,
    share: int,
    cells: int,
    shared: bool = True,
    real: np.ndarray | None = None,
) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Pieces → cells of ``share`` trajectories: largest (size, work) first onto the feasible
    cell of least work after it. With ``shared``, a piece's work on a cell is its rows less the
    prefix it shares with the cell's pieces (``depth`` of its innermost ancestor node the cell
    already holds a piece below, among its :data:`_SHARED_LEVELS` nearest); else its own rows
    (the cell of least work so far). With ``real`` (whether each piece holds a real
    trajectory), the real pieces are placed before the padding ones (an empty cell has the
    least work, so the real pieces spread over as many cells as they can and the padding fills
    what is left, rather than a cell of padding only).
    Returns per cell its piece ids (−1: a fragment of a piece that fit nowhere whole) and its
    position ranges."""
    keys = [np.arange(len(pcs.ranges)), -work, -size]
    if real is not None:
        keys.append(~real)
    order = np.lexsort(keys).tolist()
    ids: list[list[int]] = [[] for _ in range(cells)]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(cells)]
    fill = np.zeros(cells, np.int64)
    loads = np.zeros(cells, np.int64)
    # node (of depth > 0) -> the cells holding a piece below it: a set while small, then a mask
    held: dict[int, set[int] | np.ndarray] = {}
    top = np.iinfo(np.int64).max
    for i in order:
        s = int(size[i])
        room = share - fill >= s
        if room.any():
            w = int(work[i])
            above = pcs.ancestors(i, _SHARED_LEVELS) if shared else []
            nodes = [v for v in above if v in held]
            if nodes:
                grow = np.full(cells, w, np.int64)
                for node in nodes:  # outermost first: deeper ones (smaller growth) overwrite
                    h = held[node]
                    grow[h if isinstance(h, np.ndarray) else list(h)] = w - pcs.depth[node]
                r = int(np.argmin(np.where(room, loads + grow, top)))  # ties: lowest cell
                w = int(grow[r])
            else:
                r = int(np.argmin(np.where(room, loads, top)))
            ids[r].append(i)
            ranges[r].append(pcs.ranges[i])
            fill[r] += s
            loads[r] += w
            nodes = above
            for node in nodes:
                h = held.setdefault(node, set())
                if isinstance(h, np.ndarray):
                    h[r] = True
                else:
                    h.add(r)
                    if len(h) >= 32:
                        mask = np.zeros(cells, bool)
                        mask[list(h)] = True
                        held[node] = mask
            continue
        a, b = pcs.ranges[i]  # no cell has room for the whole piece: fill the emptiest first
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


def _exact(
    size: np.ndarray, work: np.ndarray, share: int, cells: int
) -> tuple[list[list[int]] | None, bool]:
    """Whole pieces → cells filled exactly (``share`` trajectories each), or None when there is
    no such placement or none is found within :data:`_SEARCH_BUDGET` cell visits; and whether
    the search ran out of that budget (False with None: there is provably no such placement).

    Depth-first over the pieces in LPT order (size, then work, decreasing); a piece tries the
    cells with room in order of least work so far. A state (next piece, multiset of free rooms)
    proven infeasible is skipped, and a placement is pruned unless every free room stays a
    subset sum of the pieces still to place. Cells with equal room and work count once
    (interchangeable); after a first placement, the search goes on (branch and bound on the
    largest cell work, within the budget) for a placement with a smaller maximum."""
    p = int(size.shape[0])
    order = np.lexsort((np.arange(p), -work, -size)).tolist()
    sz = [int(size[i]) for i in order]
    wk = [int(work[i]) for i in order]
    full = (1 << (share + 1)) - 1
    reach = [1] * (p + 1)  # reach[k]: bit r set iff r is a subset sum of sz[k:]
    for k in range(p - 1, -1, -1):
        reach[k] = (reach[k + 1] | (reach[k + 1] << sz[k])) & full
    if not (reach[0] >> share) & 1:
        return None, False
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
            # cells alike in room and work are interchangeable (for feasibility and for the
            # maximum alike; frames built before a first placement are searched again after it)
            sym = (r, loads[c])
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
        return None, visits > limit
    ids: list[list[int]] = [[] for _ in range(cells)]
    for j in range(p):
        ids[best[j]].append(order[j])
    return ids, False


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


def _cells_needed(counts: np.ndarray, share: int) -> int:
    """A lower bound on the cells of ``share`` that whole pieces (``counts[v]``: how many of
    size ``v``, ``v <= share``) need: Martello and Toth's L2 (for every ``k <= share / 2``, the
    pieces larger than ``share − k`` and those larger than half a cell each need a cell of
    their own, and the pieces of ``k`` to half a cell fill what those leave, then more), and
    for every size ``t``, the pieces of at least ``t`` over the ``share // t`` a cell holds."""
    v = np.arange(counts.shape[0], dtype=np.int64)
    num = np.concatenate([[0], np.cumsum(counts)])  # num[x]: pieces of size < x
    tot = np.concatenate([[0], np.cumsum(counts * v)])  # tot[x]: their trajectories
    k = np.arange(share // 2 + 1, dtype=np.int64)
    half = share // 2  # sizes <= half are at most half a cell
    n1 = num[share + 1] - num[share - k + 1]  # larger than share − k
    n2 = num[share - k + 1] - num[half + 1]  # in (share / 2, share − k]
    s2 = tot[share - k + 1] - tot[half + 1]
    s3 = tot[half + 1] - tot[np.maximum(k, 1)]  # in [k, share / 2]
    rest = np.maximum(0, -(-(s3 - (n2 * share - s2)) // share))
    t = np.arange(1, share + 1, dtype=np.int64)  # and a cell holds share // t pieces of >= t
    count = -(-(num[-1] - num[t]) // (share // t))
    return int(max((n1 + n2 + rest).max(), count.max(initial=0)))


def _patterns(
    size: np.ndarray, share: int, cells: int, budget: int | None = None
) -> list[list[int]] | bool:
    """Each cell's piece count per size for whole pieces filling every cell exactly (bin
    completion); False when there is provably none, True when none is found within ``budget``
    completions (at most :data:`_COMPLETE_BUDGET`, the default; unknown).

    Feasibility depends only on how many pieces of each size remain, so the search runs over
    size counts: each cell takes the largest remaining size (cells are interchangeable) and a
    completion to exactly ``share``; count vectors proven infeasible are not revisited."""
    if int(size.max(initial=0)) > share or int(size.sum()) != share * cells:
        return False
    counts_np = np.bincount(size, minlength=share + 1)
    if _cells_needed(counts_np, share) > cells:  # e.g. more pieces over half a cell than cells
        return False
    counts = counts_np.tolist()
    limit = _COMPLETE_BUDGET if budget is None else min(budget, _COMPLETE_BUDGET)
    dead: set[tuple[int, ...]] = set()
    stack = [_completions(counts, share)]
    keys = [tuple(counts)]
    patterns: list[list[int]] = []
    tried = 0
    while stack:
        if tried >= limit:
            return True
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
            return patterns
        stack.append(_completions(rest, share))
        keys.append(key)
    return False


def _deal(patterns: list[list[int]], size: np.ndarray, work: np.ndarray) -> list[list[int]]:
    """Pieces → cells by each cell's size counts ``patterns`` (:func:`_patterns`): the pieces
    of each size, heaviest first, onto the cell taking that size with the least work so far."""
    cells = len(patterns)
    ids: list[list[int]] = [[] for _ in range(cells)]
    loads = np.zeros(cells, np.int64)
    for v in range(len(patterns[0]) - 1, 0, -1):
        need = np.array([p[v] for p in patterns], np.int64)
        for i in sorted(np.flatnonzero(size == v).tolist(), key=lambda i: (-int(work[i]), i)):
            c = int(np.argmin(np.where(need > 0, loads, np.iinfo(np.int64).max)))
            ids[c].append(i)
            need[c] -= 1
            loads[c] += int(work[i])
    return ids


def _swap(
    lv: _Work,
    pcs: _Pieces,
    size: np.ndarray,
    work: np.ndarray,
    ids: list[list[int]],
    real: np.ndarray | None = None,
) -> None:
    """Swap equal-size whole pieces between the heaviest cell and another cell while that lowers
    the pair's larger work. A swap is chosen on the additive estimate (a cell's work ≈ its exact
    work with ``work`` of the pieces moved: ``work`` is each piece's own work,
    :meth:`_Pieces.own_work`) and made only when the two cells' exact works
    (:meth:`_Work.set_work`) both end below the heaviest cell's, so the largest cell work never
    grows. Each round takes the swap with the smallest estimated pair maximum (ties: lowest
    other cell, then the pieces' order in their cells). With ``real`` (whether each piece holds
    a real trajectory), no swap leaves a cell that held a real piece with padding only. In place.

    Vectorized: for every piece ``a`` of the heaviest cell and every other cell, the best
    partner is the piece of equal size whose work is nearest ``work[a] − gap / 2`` (``gap``: the
    two cells' work difference), found by binary search in the pieces sorted by (cell, size,
    work)."""
    cells = len(ids)
    p = int(size.shape[0])
    if p == 0 or cells < 2:
        return

    def exact(c: int) -> int:
        return lv.set_work(_positions([pcs.ranges[i] for i in ids[c]]))

    cell = np.empty(p, np.int64)
    for c, members in enumerate(ids):
        cell[members] = c
    uw, wrank = np.unique(work, return_inverse=True)
    nu = int(uw.shape[0])
    smax = int(size.max()) + 1
    loads = np.array([exact(c) for c in range(cells)], np.int64)
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
        ia, jl = np.nonzero(best < lh)
        if ia.size == 0:
            return
        # candidates by estimated pair maximum (ties: lowest other cell, then order in cells);
        # the first whose exact works both end below the heaviest cell's is made
        tries = np.lexsort((ia, lo[jl], best[ia, jl]))[:_SWAP_TRIES]
        for t in tries.tolist():
            v = int(best[ia[t], jl[t]])
            pa, c_lo = int(a[ia[t]]), int(lo[jl[t]])
            cand = np.asarray(ids[c_lo], np.int64)
            wb = work[cand]
            wpa, llo = int(work[pa]), int(loads[c_lo])
            fit = (size[cand] == size[pa]) & (wb < wpa) & (wb > wpa - (lh - llo))
            fit &= np.maximum(lh - wpa + wb, llo + wpa - wb) == v
            pb = int(cand[np.flatnonzero(fit)[0]])
            if real is not None and real[pa] != real[pb]:  # a cell must keep a real piece
                c, moved = (hi, pa) if real[pa] else (c_lo, pb)
                if not any(real[j] for j in ids[c] if j != moved):
                    continue
            ja, jb = ids[hi].index(pa), ids[c_lo].index(pb)
            ids[hi][ja], ids[c_lo][jb] = pb, pa
            new_hi, new_lo = exact(hi), exact(c_lo)
            if max(new_hi, new_lo) < lh:
                cell[pa], cell[pb] = c_lo, hi
                loads[hi], loads[c_lo] = new_hi, new_lo
                break
            ids[hi][ja], ids[c_lo][jb] = pa, pb  # the estimate was wrong (shared prefixes)
        else:
            return


def _positions(ranges: list[tuple[int, int]]) -> np.ndarray:
    """The leaf-order positions of the position ``ranges`` ``[a, b)``, sorted (int64)."""
    if not ranges:
        return np.zeros(0, np.int64)
    return np.sort(np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges]))


def _subtrees(lv: _Work, share: int) -> np.ndarray:
    """Each leaf-order position's *subtree*: the real trajectories split at their lowest branch,
    and every part larger than ``share`` split again at its own lowest branch, until the parts
    fit a cell (a tree that must be cut anyway is then judged by the subtrees its cuts keep
    whole; a prefix the trajectories of a part share costs nothing); each padding position
    (:class:`_Work`) a subtree of its own."""
    sub = np.zeros(lv.n, np.int64)
    sub[lv.n_real :] = np.arange(1, lv.n - lv.n_real + 1)  # padding: a subtree each
    nxt = lv.n - lv.n_real + 1
    stack = [(0, lv.n_real)] if lv.splits_real(share) else []
    while stack:
        a, b = stack.pop()
        inner = lv.adj[a : b - 1]
        cuts = [a, *(np.flatnonzero(inner == inner.min()) + 1 + a).tolist(), b]
        for x, y in itertools.pairwise(cuts):
            sub[x:y] = nxt
            nxt += 1
            if y - x > share:
                stack.append((x, y))
    return sub


def _placement(
    lv: _Work, tree: np.ndarray, ranges: list[list[tuple[int, int]]], sub: np.ndarray
) -> tuple[tuple[int, int, int, int, int], list[np.ndarray], np.ndarray]:
    """A placement given as each cell's position ``ranges``: its rank ``(cells of padding only,
    trees cut, subtrees cut, largest cell work, total work)`` (``tree``: each position's tree;
    ``sub``: its subtree, :func:`_subtrees`), each cell's sorted positions and each cell's
    work. A cell of padding only is a rank (or a rank's mini-batch) without a loss token, whose
    zero metrics veRL's DP mean would average in (halving ``ppo_kl``, ``pg_clipfrac``, ...), and
    an idle one: a tree cut to fill it costs its shared prefix once more, on that rank."""
    return _ranked(lv, tree, [_positions(r) for r in ranges], sub, lv.padpos)


def _ranked(
    lv: _Work,
    tree: np.ndarray,
    members: list[np.ndarray],
    sub: np.ndarray,
    padpos: np.ndarray | None = None,
) -> tuple[tuple[int, int, int, int, int], list[np.ndarray], np.ndarray]:
    """:func:`_placement` of each cell's sorted positions ``members``; ``padpos``: which
    positions are padding (the rank then counts the cells holding padding only first)."""
    w = np.array([lv.set_work(m) for m in members], np.int64)
    idle = 0 if padpos is None else sum(bool(padpos[m].all()) for m in members)
    cell = np.repeat(np.arange(len(members), dtype=np.int64), [m.shape[0] for m in members])
    flat = np.concatenate(members)

    def cut_of(ids: np.ndarray) -> int:  # trees (subtrees) in two or more cells
        pairs = np.unique(ids[flat] * len(members) + cell) // len(members)
        return int(np.count_nonzero(np.bincount(pairs) > 1))

    return (idle, cut_of(tree), cut_of(sub), int(w.max(initial=0)), int(w.sum())), members, w


def _search(
    lv: _Work, share: int, cells: int
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """The best placement found on the view ``lv`` (see module doc): each cell's sorted
    positions and work, and each position's tree and subtree (:func:`_placement`)."""
    pcs = _Pieces(lv, share)
    # the trees: the children of the real trajectories' lowest branch (a prefix every one of
    # them shares, a chat template, is no reason to call the whole batch one tree); padding
    # trajectories (the last positions) are trees of their own
    inner = lv.adj[: max(lv.n_real - 1, 0)]  # the real trajectories' neighbour LCPs
    low = int(inner.min()) if lv.n > share and inner.size else -1
    tree = np.zeros(lv.n, np.int64)
    if lv.n:
        tree[1:] = np.cumsum(np.concatenate([inner == low, np.ones(lv.n - 1 - inner.size, bool)]))
    sub = _subtrees(lv, share)  # then by the subtrees they cut: a tree cut anyway (see there)
    options = []  # placements found, ranked as _placement says
    padded = lv.n_real < lv.n
    fewest_idle = max(cells - lv.n_real, 0)  # no placement has fewer cells of padding only
    for _ in range(_REFINE_ROUNDS + 1):
        size = np.array([b - a for a, b in pcs.ranges], np.int64)
        work = np.array([lv.range_work(a, b) for a, b in pcs.ranges], np.int64)
        own = pcs.own_work(work)
        real = np.array([a < lv.n_real for a, _ in pcs.ranges], bool) if padded else None
        placed = []  # placements of whole pieces
        # with and without the pieces' shared prefixes; with padding, also real pieces first
        # (against cells of padding only)
        greedy = ((True, None), (False, None), (True, real))[: 3 if padded else 2]
        for shared, real_first in greedy:
            ids, ranges = _lpt(lv, pcs, size, work, share, cells, shared, real_first)
            if all(-1 not in c for c in ids):
                placed.append(ids)
            else:  # greedy had to cut a piece (a candidate too)
                options.append(_placement(lv, tree, ranges, sub))
        if not placed:  # look for a placement that cuts no piece
            # by size counts first, briefly: a proof that there is none spares the exact
            # search its whole budget; else that search (it balances work as it goes, and may
            # prove there is none), and when it runs out (many cells), the cells filled by the
            # size counts (searched again with their whole budget)
            patterns = _patterns(size, share, cells, _PROOF_BUDGET)
            found, ran_out = None, False
            if patterns is not False:
                found, ran_out = _exact(size, own, share, cells)
            if found is None and ran_out and patterns is True:
                patterns = _patterns(size, share, cells)
            if found is None and isinstance(patterns, list):
                found = _deal(patterns, size, own)
            if found is not None:
                placed.append(found)
        for ids in placed:
            _swap(lv, pcs, size, own, ids, real)
            options.append(_placement(lv, tree, [[pcs.ranges[i] for i in c] for c in ids], sub))
        # else cut pieces finer and search again (few cells: the searches are short there):
        # when no placement keeps the pieces whole, or (with padding) while more cells hold
        # padding only than the real trajectories are too few to fill. Pieces of a tree cut
        # anyway go first (that cuts no more trees), else whole trees, largest first: one per
        # round, or as many as give every cell that can hold a real trajectory a real piece
        # of its own (12 prompt groups of 2 on 24 cells of 2: one per round left 4 cells of
        # padding only after the rounds)
        idle = min(o[0] for o in options)[0] - fewest_idle if padded else 0
        if placed and not idle:
            break
        # many cells: only to fill cells of padding only beside a placement of whole pieces
        # (the greedy's, in a round or two more; the searches run again at most once)
        if cells > _REFINE_MAX_CELLS and not (placed and idle):
            break
        spread = min(cells, lv.n_real) - int(real.sum()) if idle > 0 else 0
        if not pcs.refine(more=max(idle, 1), spread=spread):
            break
    _, members, cell_work = min(options, key=lambda o: o[0])  # ties: the earlier one
    return members, cell_work, tree, sub


def tree_balanced_partition(
    sequences: Sequence[Any] | RolloutForest,
    dp_size: int,
    num_mini_batches: int = 1,
    padding: Sequence[bool] | np.ndarray | None = None,
) -> list[list[int]]:
    """Split trajectories into ``dp_size`` parts of equal size, each the concatenation of
    ``num_mini_batches`` equal cells (``N`` must be divisible by ``dp_size · num_mini_batches``),
    keeping trees together and balancing compact work (see module doc).

    ``padding`` (one bool per trajectory, e.g. veRL's ``is_padding`` tags): trajectories that
    only fill the batch to a multiple of the cells. Each is placed as a tree of its own, so
    keeping them together never costs a cut real tree, and the trees are those of the real
    trajectories (a chat template they share is no tree); cell works stay exact."""
    return tree_balanced_cells(sequences, dp_size, num_mini_batches, padding)[0]


def padding_only_cells(
    parts: Sequence[Sequence[int]], num_mini_batches: int, padding: Sequence[bool] | np.ndarray
) -> int:
    """How many cells of a partition (``parts``: one list per rank of ``num_mini_batches``
    equal cells, as :func:`tree_balanced_partition` returns) hold padding trajectories only
    (``padding``: one bool per trajectory): ranks' mini-batches without a loss token."""
    pad = np.asarray(padding, bool)
    share = len(parts[0]) // num_mini_batches if len(parts) else 0
    return sum(
        bool(pad[np.asarray(p[k * share : (k + 1) * share], np.int64)].all())
        for p in parts
        for k in range(num_mini_batches)
    )


def _padding_mask(padding: Sequence[bool] | np.ndarray | None, n: int) -> np.ndarray | None:
    """``padding`` as a bool array of ``n`` (None when absent); ValueError naming it else."""
    if padding is None:
        return None
    arr = np.asarray(padding)
    if arr.shape != (n,) or (arr.dtype != np.bool_ and arr.size):
        raise ValueError(
            f"padding: expected one bool per trajectory ({n}), got shape {arr.shape} of "
            f"dtype {arr.dtype}"
        )
    return arr.astype(bool)


def tree_balanced_cells(
    sequences: Sequence[Any] | RolloutForest,
    dp_size: int,
    num_mini_batches: int = 1,
    padding: Sequence[bool] | np.ndarray | None = None,
) -> tuple[list[list[int]], np.ndarray]:
    """:func:`tree_balanced_partition` and the compact work of its cells: int64
    ``[num_mini_batches, dp_size]``, entry ``[k, r]`` the work of rank ``r``'s ``k``-th
    mini-batch (:func:`~harts_verl.tree.microbatch.compact_work` of its trajectories, padding
    included). ``padding``: see :func:`tree_balanced_partition`."""
    for name, v in (("dp_size", dp_size), ("num_mini_batches", num_mini_batches)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    forest = (
        sequences
        if isinstance(sequences, RolloutForest)
        else RolloutForest.from_sequences(sequences)
    )
    n = forest.num_trajectories
    pad = _padding_mask(padding, n)
    dp_size, num_mini_batches = int(dp_size), int(num_mini_batches)
    cells = dp_size * num_mini_batches
    if n % cells:
        raise ValueError(
            f"sequences: {n} trajectories are not divisible by dp_size={dp_size} x "
            f"num_mini_batches={num_mini_batches}"
        )
    share = n // cells
    lv = _Work(forest, pad)  # the one leaf-order view every work evaluation below uses
    members, cell_work, tree, sub = _search(lv, share, cells)
    cell_ids = [lv.order[m] for m in members]  # each cell's trajectories, in leaf order
    if lv.n_real < lv.n:
        # with the padding back in its leaf-order place and exact works (padding shares its
        # prefixes after all), ranked against the placement without the padding info (which
        # may keep identical padding samples in fewer cells) by the same trees and subtrees
        true = _Work(forest)
        by_id = np.empty((2, n), np.int64)
        by_id[:, lv.order] = tree, sub
        tree, sub = by_id[:, true.order]
        found = [[np.sort(true.rank[ids]) for ids in cell_ids], _search(true, share, cells)[0]]
        ranked = [_ranked(true, tree, pos, sub, pad[true.order]) for pos in found]
        _, pos, cell_work = min(ranked, key=lambda o: o[0])  # ties: with the padding info
        cell_ids = [true.order[p] for p in pos]
    slot, replica, _ = place_microbatches(cell_work, dp_size)
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    grid = np.zeros((num_mini_batches, dp_size), np.int64)
    for c in np.lexsort((replica, slot)).tolist():  # mini-batch 0 first on every rank
        parts[int(replica[c])].extend(cell_ids[c].tolist())
        grid[int(slot[c]), int(replica[c])] = cell_work[c]
    return parts, grid
