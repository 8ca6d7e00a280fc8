"""Prefix-aware microbatch, DP-replica and slot planner (numpy only).

**Work.** The work of a set of trajectories is the number of compact rows of their trie. In the
forest's leaf order (lexicographic), a set sorted by leaf position costs
``Σ len − Σ lcp(consecutive members)``, where the LCP of leaf positions ``a < b`` is
``min(adjacent_lcp[a:b])`` (sparse-table range minimum, vectorized). A contiguous leaf range
costs ``Σ len − Σ adjacent_lcp`` inside it, so cutting between two neighbours costs their LCP.

**Candidates.** Partitions of the trajectories into microbatches of at most ``capacity_tokens``
compact rows:

* ``natural`` — the natural partition P0: split recursively at the lowest adjacent-LCP valley
  (ties: the valley that best halves the work) until every part fits.
* ``contiguous`` / ``contiguous-k{K}`` — exact contiguous-partition search: dynamic programming
  over cut points minimising Σ cut LCPs (= minimum total work over all partitions into leaf-order
  ranges), for free K and for fixed K (the fewest parts, and K rounded up to a multiple of
  ``dp_size``).
* ``tree-ffd`` / ``tree-bfd`` — bottom-up packing over the LCP-interval tree (the trie's branch
  points): at a branch point of depth ``d`` the pieces coming from its children are bin-packed
  with size = work beyond ``d`` and room = ``capacity − d`` (first/best fit decreasing, then a
  bounded branch-and-bound for fewer bins), so merges happen at the deepest shared prefix first.
* ``greedy-leaf`` / ``greedy-reverse`` — one pass in leaf order (or reversed): each trajectory
  joins the feasible microbatch with the smallest marginal work ``len − LCP`` (ties: the
  fullest), or opens a new one.

**Lower bound.** :func:`lower_bound_work`: a microbatch touching a branch point of depth ``d``
holds at most ``capacity − d`` rows below it, so at least ``⌈below / (capacity − d)⌉``
microbatches pay that branch point's rows. Candidate generation (in the order above, aligned
K after the tree family) and the improvement stop as soon as a plan reaches the bound.

**Improvement** (the best candidate and the best one of another family): a local search over
*piece moves* — a piece is a node of a microbatch's own LCP-interval tree (one trajectory, a
subtree, or the whole microbatch, which makes the move a merge) — moved to the microbatch where
the exact change of total work is most negative; and *eliminations* — the smallest microbatches
are dissolved, piece by piece (splitting a piece at its lowest valley when it fits nowhere),
when that lowers total work. Deltas are exact (nearest members in leaf order, LCPs from a dense
matrix up to 2,500 trajectories, a sparse table above). ``restarts > 0`` adds seeded
perturb-and-improve rounds. Then *fewer bins* (with ``improve``, also at the lower bound): the
best plan's smallest microbatches are dissolved the same way while a dissolution costs no work,
since every microbatch is one more forward, backward and FSDP all-gather (a tree cut in two
halves that each repeat its prefix is cut unevenly instead, and its small part shares a
microbatch with another tree: 10 trees of 820 rows and 6 of 60 at capacity 700, 21 → 14
microbatches of the same 8,760 rows). The local search (and the balance and repair below) keeps two
nearest-member tables of ``n × K`` int64 per state (an elimination try copies the state), and
the greedy family costs ``n·K`` too: a phase whose ``n·K`` could exceed the
``max_search_cells`` option (default 4M cells; K counted with the bins a phase may add: the
kicked bins of a restart, the padding of K to a multiple of ``dp_size``) is skipped and named
in the plan's ``skipped_phases``; when that leaves no candidate (``strategies="greedy"``), the
natural partition is the plan (measured: 10,000 trajectories of 35–60 tokens at capacity
300, K = 638: 0.09 s instead of 6 s for the same plan; 100,000: 2.8 s, where the tables needed
9.5 GB).

**Balance and placement** (``dp_size > 1``). From the best plans, piece moves that keep total
work equal are applied when they lower the slot-critical work (then the squared idle time
inside slots); K is aligned to a multiple of ``dp_size`` by offering empty microbatches to these
moves (a piece that shares no prefix with the rest of its microbatch moves for free). Placement: works sorted decreasingly
are cut into consecutive groups of ``dp_size`` (padded with empty microbatches so every replica
gets the same number of slots) — this minimises Σ over slots of the slot's largest work for the
given works; inside a slot the largest microbatch goes to the replica with the least cumulative
work (LPT).

**Choice.** Candidates are compared lexicographically by (total compact work, slot-critical work,
max replica work, number of microbatches); ties keep the earlier candidate. With
``allow_oversize``, the oversize microbatches (fixed: one per maximal oversize path of the
layout — in a trie, per distinct oversize sequence — holding its copies and the trajectories
that share all their rows with it) are part of every score, of the balance and repair objectives
and of K's alignment to ``dp_size``, so each candidate is scored as the whole plan it becomes.
With ``work_slack=ε > 0`` (default 0) the first key is relaxed: any plan within ``(1 + ε)`` of
the least total work (of the whole plan, oversize microbatches included) whose slot-critical work is no worse than the strict choice's is compared on
the excess of its slot imbalances over ``_REPAIR_TAU`` (1.5 %) first. The strict choice is the
plan a strict call returns, searched first and kept as a candidate (the slack search's own pool
differs: its K-aligned starts change where the local search starts, and its least-work plan had
a larger slot-critical work than the strict plan in 6 of 300 random GRPO-like steps; one strict
search more: ≈ 0.2 s at 3,600 responses, dp 8; ≈ 1.5 s at dp 64). Balance moves may then
spend work up to that bound, and an imbalance *repair* (:func:`_repair`) runs with K = the next
multiple of ``dp_size``: first from an *aligned start* (:func:`_aligned_starts`: the tree packer
at the largest reduced capacity that yields exactly K microbatches — smaller capacities give
more, more even microbatches — improved by the local search), then from the least-work plan
with empty microbatches added, until one reaches every slot <= 1.8 % with no larger
slot-critical work than the strict choice's (a start that balances its slots above that work
never wins, so the next start is repaired). The repair's work bound is also ``dp_size`` × that
work (Σ over slots of the largest work is at least the total over ``dp_size``), which drops the
aligned starts above it. The repair is a local
search over piece moves and piece *swaps* between two microbatches (screened with insertion
costs, verified exactly; with many small pieces the swap screen pairs an even, gain-ordered
share of each microbatch's pieces, at most ``_SWAP_PAIRS`` pairs a round), minimising
(slot-critical work above the strict choice's, Σ excess², Σ imbalance²) under sorted grouping,
with a bounded tabu walk out of local minima. Each round refreshes only the insertion costs
into the two microbatches the last change touched, for all microbatches' pieces at once
(vectorized). Planning times (2 CPU cores): 3,600 GRPO responses at capacity 8192, dp 8: 6.0 s
(strict 0.3 s), with every slot <= 1.4 % at the least work; dp 64: 9.5 s (strict 1.2 s);
3,000 trajectories of ≈ 31 tokens at dp 8: 3.2 s at capacity 512, 2.4 s at 4096. Measured
(``benchmarks/planner.py``, SWE-like steps at dp 8, 32K capacity, 66–74 least-work
microbatches): ε = 0.02 gives K = 72 and P95 within-slot imbalance 1.41–1.43 % for
+1.93–1.95 % compact tokens (64K / 128K capacity: 1.45–1.61 % for +1.41–2.0 %), never a larger slot-critical work (strict: 24–46 %, dominated by the
padding slot when K is not a multiple of dp). Where aligning K costs more than ε (e.g. 16K
capacity with 8K trajectories: ≈ 3 %) the target is not reached. Everything is a deterministic
function of the forest, the capacity, ``dp_size``, the options and ``seed`` (no wall-clock
limits).

**Within-slot imbalance** (:meth:`MicrobatchPlan.slot_imbalance`): for each slot,
``(max − mean) / max`` of the ``dp_size`` replicas' microbatch works in that slot (empty
microbatches count as 0; a slot with only empty microbatches has imbalance 0) — the fraction of
the slot's replica-time spent waiting for the slowest replica.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from harts_verl.tree._checks import INT64_MAX, finite_float, holds_bool
from harts_verl.tree._checks import check_int as _check_int
from harts_verl.tree._rangemin import RangeMin
from harts_verl.tree._ranges import concat_ranges
from harts_verl.tree.forest import RolloutForest

__all__ = [
    "MAX_DP_SIZE",
    "IntervalTree",
    "Microbatch",
    "MicrobatchPlan",
    "compact_work",
    "lcp_interval_tree",
    "lower_bound_work",
    "natural_partition",
    "optimal_contiguous_partition",
    "partition_works",
    "place_microbatches",
    "plan_microbatches",
    "planner_options",
    "slot_imbalance",
    "token_balanced_microbatches",
    "validate_options",
]

# The most DP replicas a plan takes: a replica with nothing to run still gets an empty bin,
# and the slot repair's candidate arrays are [candidates, bins] (measured: 3.6 s, 450 MiB for
# 300 trajectories at 2**16 replicas; 2**20 needed 17 GiB for 3 trajectories).
MAX_DP_SIZE = 1 << 16
_INF = np.int64(1) << 62
_DENSE_LCP_MAX = 2500  # below this many trajectories, keep the full LCP matrix
# window positions per vectorized chunk of exact marginals (~100 B each)
_INTERLEAVED_CHUNK = 1 << 20
# (piece, bin) cells per vectorized chunk of the repair's marginals and move candidates
_MARGINAL_CELLS = 1 << 20
_BAL_GROUPS, _BAL_SOURCES, _BAL_CANDS = 16, 8, 16  # balance search breadth

_DEFAULT_OPTIONS: dict[str, Any] = {
    "allow_oversize": False,
    "strategies": None,  # None = all families; else an iterable of family names
    "improve": True,  # piece-move local search + eliminations
    "balance": True,  # zero-cost balance moves
    "work_slack": 0.0,
    "restarts": 0,
    "effort": 1.0,  # scales the local-search move budgets
    "max_layers_work": 4_000_000,  # bound on K·n (memory) for the fixed-K contiguous DP
    # bound on K·n for the greedy pass and the local-search states (two int64 [n, K] tables)
    "max_search_cells": 4_000_000,
}
_FAMILIES = ("natural", "contiguous", "tree", "greedy")


# ============================================================================ results
@dataclass(frozen=True)
class Microbatch:
    """One microbatch: ``trajectories`` (int64 trajectory indices in leaf order; empty for a
    padding microbatch), its ``compact_tokens`` (rows of their trie), and where it runs:
    DP ``replica`` and synchronized ``slot``."""

    trajectories: np.ndarray
    compact_tokens: int
    replica: int
    slot: int


@dataclass(frozen=True)
class MicrobatchPlan:
    """A microbatch / DP-replica / slot plan.

    Guarantees: every trajectory is in exactly one microbatch; every microbatch has at most
    ``capacity_tokens`` compact rows (except, with ``allow_oversize=True``, one holding the
    copies of one oversize trajectory and the trajectories that are its prefixes, which add no
    row; its work is that trajectory's length); every replica has exactly ``num_slots`` microbatches (padding ones
    are empty), one per slot; ``microbatches`` is ordered by (slot, replica).

    ``total_compact_tokens`` = Σ microbatch works; ``slot_critical_work`` = Σ over slots of the
    largest work in the slot; ``replica_work`` (int64 per replica) = Σ of its microbatch works;
    ``natural_partition`` = P0 (tuple of trajectory-index arrays); ``strategy`` = winning
    candidate (``"none"`` when no trajectory is left to plan: an empty forest, or only oversize
    ones and trajectories that ride in their microbatches); ``candidates`` = name → ``(total, slot_critical, max_replica, microbatches)``;
    ``skipped_phases`` = the search phases left out because their ``[n, K]`` state could exceed
    the ``max_search_cells`` option (``greedy``, ``improve``, ``restarts``, ``balance``,
    ``repair``; empty when the search ran whole).
    """

    microbatches: tuple[Microbatch, ...]
    num_slots: int
    dp_size: int
    capacity_tokens: int
    total_compact_tokens: int
    slot_critical_work: int
    replica_work: np.ndarray
    natural_partition: tuple[np.ndarray, ...]
    planning_seconds: float
    strategy: str = ""
    candidates: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    skipped_phases: tuple[str, ...] = ()

    @property
    def num_microbatches(self) -> int:
        """Non-empty microbatches."""
        return sum(1 for mb in self.microbatches if mb.trajectories.size)

    @property
    def slot_work(self) -> np.ndarray:
        """int64 ``[num_slots, dp_size]``: work of each replica's microbatch in each slot."""
        out = np.zeros((self.num_slots, self.dp_size), dtype=np.int64)
        for mb in self.microbatches:
            out[mb.slot, mb.replica] = mb.compact_tokens
        return out

    def slot_imbalance(self) -> np.ndarray:
        """Per slot ``(max − mean) / max`` over the replicas' works (0 for an all-empty slot)."""
        return slot_imbalance(self.slot_work)

    def assignment(self, num_trajectories: int | None = None) -> np.ndarray:
        """Index into ``microbatches`` of each trajectory's microbatch (int64, length
        ``num_trajectories``, default: the number of planned trajectories; -1 for an index no
        microbatch holds). ValueError when ``num_trajectories`` is not an int or is smaller than
        a planned trajectory index + 1."""
        planned = sum(int(mb.trajectories.size) for mb in self.microbatches)
        top = max(
            (int(mb.trajectories.max()) for mb in self.microbatches if mb.trajectories.size),
            default=-1,
        )
        if num_trajectories is None:
            n = planned
        else:
            n = _check_int("num_trajectories", num_trajectories, 0)
            if n <= top:
                raise ValueError(
                    f"num_trajectories: {n} is too small, the plan holds trajectory {top}"
                )
        out = np.full(n, -1, dtype=np.int64)
        for k, mb in enumerate(self.microbatches):
            out[mb.trajectories] = k
        return out

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures of the plan."""
        imb = self.slot_imbalance()
        rw = self.replica_work
        return {
            "microbatches": self.num_microbatches,
            "slots": self.num_slots,
            "dp_size": self.dp_size,
            "capacity_tokens": self.capacity_tokens,
            "total_compact_tokens": self.total_compact_tokens,
            "slot_critical_work": self.slot_critical_work,
            "max_replica_work": int(rw.max(initial=0)),
            "replica_imbalance": _imb(rw),
            "slot_imbalance_p50": float(np.percentile(imb, 50)) if imb.size else 0.0,
            "slot_imbalance_p95": float(np.percentile(imb, 95)) if imb.size else 0.0,
            "slot_imbalance_max": float(imb.max(initial=0.0)),
            "natural_partition_parts": len(self.natural_partition),
            "strategy": self.strategy,
            "skipped_phases": list(self.skipped_phases),
            "planning_seconds": self.planning_seconds,
        }


def _imb(x: np.ndarray) -> float:
    m = float(np.max(x, initial=0))
    return (m - float(np.mean(x))) / m if m > 0 else 0.0


def slot_imbalance(slot_work: np.ndarray) -> np.ndarray:
    """``(max − mean) / max`` of each row of ``slot_work`` ([slots, replicas], finite works
    >= 0; no slots is fine, no replicas is not); 0 where max = 0. float64, length slots.
    ValueError naming ``slot_work`` for another shape or a negative / non-finite work."""
    try:
        w = np.asarray(slot_work, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("slot_work: expected a numeric [slots, replicas] array") from None
    if w.ndim != 2 or (w.shape[0] and w.shape[1] == 0):
        raise ValueError(
            f"slot_work: expected a [slots, replicas] array with replicas >= 1, got shape {w.shape}"
        )
    if w.shape[0] == 0:
        return np.zeros(0)
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("slot_work: expected finite works >= 0")
    mx = w.max(axis=1)
    return np.where(mx > 0, (mx - w.mean(axis=1)) / np.where(mx > 0, mx, 1.0), 0.0)


# ============================================================================ leaf-order costs
class _Leaves:
    """Trajectories in leaf order (positions 0..n-1) with the work oracle."""

    def __init__(self, traj: np.ndarray, lens: np.ndarray, adj: np.ndarray) -> None:
        self.traj = traj
        self.lens = lens
        self.adj = adj
        self.n = n = int(lens.shape[0])
        self.rmq = RangeMin(adj)
        cl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=cl[1:])
        ca = np.zeros(n + 1, dtype=np.int64)
        if n > 1:
            np.cumsum(adj, out=ca[1:n])
        if n:
            ca[n] = ca[n - 1]
        # work of the range [i, j) = h[j] − g[i]; g is nondecreasing (adj <= len).
        self.g = cl - ca
        self.h = np.zeros(n + 1, dtype=np.int64)
        if n:
            self.h[1:] = cl[1:] - ca[:n]
        # Dense LCP matrix for small n, padded with a zero row/column at index n (= -1), so
        # "no such member" (-1 or n) reads as LCP 0.
        self.mat: np.ndarray | None = None
        if 0 < n <= _DENSE_LCP_MAX:
            dt = np.int32 if int(lens.max()) < 2**31 else np.int64
            mat = np.zeros((n + 1, n + 1), dtype=dt)
            mat[np.arange(n), np.arange(n)] = lens
            for a in range(n - 1):
                row = np.minimum.accumulate(adj[a:])
                mat[a, a + 1 : n] = row
                mat[a + 1 : n, a] = row
            self.mat = mat

    @classmethod
    def of(cls, forest: RolloutForest, keep: np.ndarray | None = None) -> _Leaves:
        """Leaf-order view of ``forest`` restricted to the trajectories with ``keep`` true."""
        order = np.asarray(forest.leaf_order, dtype=np.int64)
        lens = np.asarray(forest.lengths, dtype=np.int64)[order]
        adj = np.asarray(forest.adjacent_lcp, dtype=np.int64)
        if keep is None or bool(keep[order].all()):
            return cls(order, lens, adj)
        pos = np.flatnonzero(keep[order])
        sub_adj = RangeMin(adj).query(pos[:-1], pos[1:]) if pos.size > 1 else np.zeros(0, np.int64)
        return cls(order[pos], lens[pos], sub_adj)

    def range_work(self, a: int, b: int) -> int:
        return int(self.h[b] - self.g[a])

    def lcp(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """LCP of leaf positions ``a <= b`` elementwise (length of the trajectory if equal)."""
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        same = a == b
        if not same.any():
            return self.rmq.query(a, b)
        out = self.lens[a].copy()
        if (~same).any():
            out[~same] = self.rmq.query(a[~same], b[~same])
        return out

    def pair_lcp(self, a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
        """LCP of positions a and b in any order, elementwise; -1 or n in either means "none"
        and gives 0."""
        if self.mat is not None:
            return self.mat[a, b].astype(np.int64)
        n = self.n
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        if a.shape != b.shape:
            a, b = np.broadcast_arrays(a, b)
        lo, hi = np.minimum(a, b), np.maximum(a, b)
        out = np.zeros(lo.shape, dtype=np.int64)
        ok = (lo >= 0) & (hi < n)
        same = ok & (lo == hi)
        out[same] = self.lens[lo[same]]
        dif = ok & (lo != hi)
        if dif.any():
            out[dif] = self.rmq.query(lo[dif], hi[dif])
        return out

    def consec(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """LCP of positions ``a < b`` elementwise."""
        if self.mat is not None:
            return self.mat[a, b].astype(np.int64)
        return self.rmq.query(a, b)

    def set_work(self, pos: np.ndarray) -> int:
        """Work of a set of positions sorted ascending (no duplicates)."""
        if pos.size == 0:
            return 0
        w = int(self.lens[pos].sum())
        if pos.size > 1:
            w -= int(self.consec(pos[:-1], pos[1:]).sum())
        return w

    def works(self, labels: np.ndarray, k: int) -> np.ndarray:
        """Works of the bins of a labelling (bins 0..k-1, positions in leaf order)."""
        order = np.argsort(labels, kind="stable")
        lab = labels[order]
        w = np.bincount(labels, weights=self.lens, minlength=k)
        same = lab[:-1] == lab[1:]
        if same.any():
            lc = self.consec(order[:-1][same], order[1:][same])
            w -= np.bincount(lab[:-1][same], weights=lc, minlength=k)
        return np.rint(w).astype(np.int64)

    def lo_window(self, cap: int) -> np.ndarray:
        """lo[j] = smallest i with work(i, j) <= cap, for j = 0..n."""
        return np.searchsorted(self.g, self.h - cap, side="left").astype(np.int64)


def _labels_from_bins(bins: Sequence[np.ndarray], n: int) -> np.ndarray:
    label = np.full(n, -1, dtype=np.int64)
    for b, mem in enumerate(bins):
        label[mem] = b
    return label


def _canonical(label: np.ndarray) -> tuple[np.ndarray, int]:
    """Relabel bins 0..k-1 by first member (drops empty bins)."""
    if label.size == 0:
        return label.copy(), 0
    _, first = np.unique(label, return_index=True)
    ranks = np.argsort(np.argsort(first))
    uniq = np.unique(label)
    remap = np.empty(int(uniq.max()) + 1, dtype=np.int64)
    remap[uniq] = ranks
    return remap[label], int(uniq.size)


# ============================================================================ natural partition
def _natural(lv: _Leaves, cap: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    stack = [(0, lv.n)] if lv.n else []
    while stack:
        a, b = stack.pop()
        if b - a == 1 or lv.range_work(a, b) <= cap:
            out.append((a, b))
            continue
        seg = lv.adj[a : b - 1]
        cuts = np.flatnonzero(seg == seg.min()) + a + 1  # boundary c: [a, c) | [c, b)
        left = lv.h[cuts] - lv.g[a]
        right = lv.h[b] - lv.g[cuts]
        c = int(cuts[np.argmin(np.abs(left - right))])
        stack.append((c, b))
        stack.append((a, c))
    return out


def _ranges_to_labels(parts: list[tuple[int, int]], n: int) -> np.ndarray:
    label = np.empty(n, dtype=np.int64)
    for k, (a, b) in enumerate(parts):
        label[a:b] = k
    return label


# ============================================================================ contiguous DP
def _contiguous_free(lv: _Leaves, cap: int) -> list[tuple[int, int]]:
    """Minimum Σ cut LCP over all contiguous partitions (ties: fewer parts)."""
    n = lv.n
    if n == 0:
        return []
    lo = lv.lo_window(cap).tolist()
    # key = cost·(n+1) + parts is additive, so a monotone-deque window minimum applies.
    cut_key = [1, *(lv.adj * (n + 1) + 1).tolist()]
    f = [0] * (n + 1)
    arg = [0] * (n + 1)
    dq: list[int] = []
    vals: list[int] = []
    head = 0
    for j in range(1, n + 1):
        i_new = j - 1
        v = f[i_new] + cut_key[i_new]
        while len(dq) > head and vals[-1] >= v:
            dq.pop()
            vals.pop()
        dq.append(i_new)
        vals.append(v)
        lj = lo[j]
        while dq[head] < lj:
            head += 1
        arg[j] = dq[head]
        f[j] = vals[head]
    parts: list[tuple[int, int]] = []
    j = n
    while j > 0:
        parts.append((arg[j], j))
        j = arg[j]
    parts.reverse()
    return parts


def _min_parts(lv: _Leaves, cap: int) -> int:
    """Fewest contiguous parts (greedy from the right is optimal for ranges)."""
    k, j = 0, lv.n
    lo = lv.lo_window(cap)
    while j > 0:
        j = int(lo[j])
        k += 1
    return k


def _contiguous_k(lv: _Leaves, cap: int, ks: Sequence[int]) -> dict[int, list[tuple[int, int]]]:
    """Minimum Σ cut LCP over contiguous partitions into exactly K parts for each K in ``ks``
    (layered DP with a windowed range minimum per layer). Equal-cost backtrack choices prefer
    parts whose work is closest to the remaining average."""
    n = lv.n
    out: dict[int, list[tuple[int, int]]] = {}
    ks = sorted({int(k) for k in ks if 1 <= k <= n})
    if not ks:
        return out
    lo = lv.lo_window(cap)
    jj = np.arange(1, n + 1, dtype=np.int64)
    valid = lo[1:] < jj
    cut = np.zeros(n + 1, dtype=np.int64)
    cut[1:n] = lv.adj
    layers = [np.full(n + 1, _INF, dtype=np.int64)]
    layers[0][0] = 0
    for _k in range(ks[-1]):
        prev = layers[-1]
        g = np.where(prev >= _INF, _INF, prev + cut)
        f = np.full(n + 1, _INF, dtype=np.int64)
        f[1:][valid] = RangeMin(g).query(lo[1:][valid], jj[valid])
        layers.append(f)
    for k in ks:
        if layers[k][n] >= _INF:
            continue
        parts: list[tuple[int, int]] = []
        j, target = n, int(layers[k][n])
        for kk in range(k, 0, -1):
            cand = np.arange(int(lo[j]), j, dtype=np.int64)
            prev = layers[kk - 1][cand]
            ok = cand[(prev < _INF) & (prev + cut[cand] == target)]
            avg = (lv.h[j] - lv.g[0]) / kk
            i = int(ok[np.argmin(np.abs(lv.h[j] - lv.g[ok] - avg))])
            parts.append((i, j))
            target = int(layers[kk - 1][i])
            j = i
        parts.reverse()
        out[k] = parts
    return out


# ============================================================================ bin packing
def _pack_sizes(sizes: list[int], room: int, best_fit: bool, node_limit: int) -> list[int]:
    """Bin label per item: first/best fit decreasing, then a bounded branch-and-bound for
    fewer bins when FFD is above the lower bound."""
    m = len(sizes)
    order = sorted(range(m), key=lambda t: (-sizes[t], t))
    if m > 64:  # no branch and bound: the same fit over numpy loads (O(bins) per item)
        return _fit_decreasing(sizes, order, room, best_fit)
    loads: list[int] = []
    label = [0] * m
    for t in order:
        e = sizes[t]
        chosen = -1
        if best_fit:
            best = room + 1
            for b, ld in enumerate(loads):
                r = room - ld - e
                if 0 <= r < best:
                    best, chosen = r, b
        else:
            for b, ld in enumerate(loads):
                if ld + e <= room:
                    chosen = b
                    break
        if chosen < 0:
            loads.append(e)
            label[t] = len(loads) - 1
        else:
            loads[chosen] += e
            label[t] = chosen
    total = sum(sizes)
    big = sum(1 for s in sizes if 2 * s > room)
    lb = max(-(-total // room) if room > 0 else len(loads), big, 1)
    if len(loads) <= lb or node_limit <= 0:
        return label
    # Branch and bound over items in decreasing size; bins with equal loads are symmetric.
    s_sorted = [sizes[t] for t in order]
    suffix = [0] * (m + 1)
    for i in range(m - 1, -1, -1):
        suffix[i] = suffix[i + 1] + s_sorted[i]
    best_count = len(loads)
    best_assign: list[int] | None = None
    cur_loads: list[int] = []
    assign = [0] * m
    nodes = 0

    def dfs(i: int) -> bool:
        nonlocal best_count, best_assign, nodes
        nodes += 1
        if nodes > node_limit:
            return True
        if i == m:
            if len(cur_loads) < best_count:
                best_count = len(cur_loads)
                best_assign = assign.copy()
            return best_count <= lb
        free = len(cur_loads) * room - (suffix[0] - suffix[i])  # items 0..i-1 fill the bins
        need = len(cur_loads) + max(0, -(-(suffix[i] - free) // room))
        if need >= best_count:
            return False
        e = s_sorted[i]
        tried: set[int] = set()
        for b, ld in enumerate(cur_loads):
            if ld + e <= room and ld not in tried:
                tried.add(ld)
                cur_loads[b] += e
                assign[i] = b
                if dfs(i + 1):
                    return True
                cur_loads[b] -= e
        if len(cur_loads) + 1 < best_count:
            cur_loads.append(e)
            assign[i] = len(cur_loads) - 1
            if dfs(i + 1):
                return True
            cur_loads.pop()
        return False

    dfs(0)
    if best_assign is None:
        return label
    out = [0] * m
    for i, t in enumerate(order):
        out[t] = best_assign[i]
    return out


def _fit_decreasing(sizes: list[int], order: list[int], room: int, best_fit: bool) -> list[int]:
    """:func:`_pack_sizes`' first / best fit of the items in ``order``, vectorized over the
    bins: first fit takes the lowest bin with room, best fit the least room left (lowest bin on
    ties), else a new bin."""
    m = len(sizes)
    loads = np.zeros(m, dtype=np.int64)
    label = [0] * m
    k = 0
    for t in order:
        e = sizes[t]
        chosen = k  # a new bin, unless one has room
        if k:
            r = room - e - loads[:k]  # room left in each bin after the item
            # best fit: the least non-negative room; first fit: the first non-negative one
            b = int(np.argmin(np.where(r >= 0, r, INT64_MAX)) if best_fit else np.argmax(r >= 0))
            chosen = b if r[b] >= 0 else k
        if chosen == k:
            k += 1
        loads[chosen] += e
        label[t] = chosen
    return label


def _tree_pack(lv: _Leaves, cap: int, best_fit: bool, node_limit: int) -> np.ndarray:
    """Bottom-up packing over the LCP-interval tree; returns a bin label per position."""
    n = lv.n
    adj = lv.adj.tolist()
    lens = lv.lens.tolist()
    stack_d: list[int] = []
    stack_items: list[list[tuple[int, list[int]]]] = []

    def pack(items: list[tuple[int, list[int]]], d: int) -> list[tuple[int, list[int]]]:
        if len(items) == 1:
            return items
        lab = _pack_sizes([w - d for w, _ in items], cap - d, best_fit, node_limit)
        k = max(lab) + 1
        works = [d] * k
        members: list[list[int]] = [[] for _ in range(k)]
        for (w, pos), b in zip(items, lab):
            works[b] += w - d
            members[b].extend(pos)
        return list(zip(works, members))

    for p in range(n):
        carry: list[tuple[int, list[int]]] = [(lens[p], [p])]
        lval = adj[p] if p < n - 1 else 0
        while stack_d and stack_d[-1] > lval:
            d = stack_d.pop()
            items = stack_items.pop()
            items.extend(carry)
            carry = pack(items, d)
        if stack_d and stack_d[-1] == lval:
            stack_items[-1].extend(carry)
        else:
            stack_d.append(lval)
            stack_items.append(carry)
    final: list[tuple[int, list[int]]] = []
    while stack_d:
        d = stack_d.pop()
        final = pack(stack_items.pop() + final, d)
    label = np.empty(n, dtype=np.int64)
    for b, (_, mem) in enumerate(final):
        label[mem] = b
    return label


def _greedy_leaf(lv: _Leaves, cap: int, reverse: bool) -> np.ndarray:
    """One pass in leaf order (or reversed): join the feasible bin with the smallest marginal
    work (its nearest member is its last one), ties: fullest, then lowest index."""
    n = lv.n
    label = np.empty(n, dtype=np.int64)
    lens, adj = lv.lens, lv.adj
    # per bin: its load and the LCP of its last member with the current position, a running
    # minimum of the adjacent LCPs in between (the last member's own slot starts at +inf)
    loads = np.empty(n, dtype=np.int64)
    run = np.empty(n, dtype=np.int64)
    k = 0
    big = np.iinfo(np.int64).max
    for step in range(n):
        p = n - 1 - step if reverse else step
        if k:
            np.minimum(run[:k], adj[p] if reverse else adj[p - 1], out=run[:k])
            marg = lens[p] - run[:k]
            new = loads[:k] + marg
            feas = np.flatnonzero(new <= cap)
            if feas.size:
                b = int(feas[np.lexsort((feas, -new[feas], marg[feas]))[0]])
                label[p] = b
                loads[b] = new[b]
                run[b] = big
                continue
        label[p] = k
        loads[k] = lens[p]
        run[k] = big
        k += 1
    return label


# ============================================================================ local search
@dataclass
class _Pieces:
    """Pieces of one bin: nodes of its LCP-interval tree (runs ``mem[i:j]`` of its members),
    with first/last positions, own work, removal gain and internal LCP (depth)."""

    mem: np.ndarray
    runs: list[tuple[int, int]]
    s1: np.ndarray
    sm: np.ndarray
    w: np.ndarray
    gain: np.ndarray
    d: np.ndarray

    def piece(self, t: int) -> np.ndarray:
        i, j = self.runs[t]
        return self.mem[i:j]

    def run_array(self) -> np.ndarray:
        """``runs`` as an int64 ``[P, 2]`` array."""
        return np.asarray(self.runs, dtype=np.int64).reshape(-1, 2)


def _concat_pieces(pcs: Sequence[_Pieces]) -> _Pieces:
    """The pieces of several bins as one :class:`_Pieces` (runs index the concatenated
    ``mem``), in the order given; for vectorized marginals only (``piece`` still works)."""
    offs = np.cumsum([0] + [int(p.mem.size) for p in pcs[:-1]])
    runs = np.concatenate([p.run_array() + o for p, o in zip(pcs, offs)])
    return _Pieces(
        np.concatenate([p.mem for p in pcs]),
        runs,  # type: ignore[arg-type]
        *(np.concatenate([getattr(p, f) for p in pcs]) for f in ("s1", "sm", "w", "gain", "d")),
    )


def _bin_chunks(sizes: Sequence[int], cols: int) -> list[slice]:
    """Consecutive groups of bins (``sizes`` pieces each) with at most ``_MARGINAL_CELLS``
    (piece, column) cells per group, one bin at least."""
    out: list[slice] = []
    a, cells = 0, 0
    for i, size in enumerate(sizes):
        c = int(size) * max(cols, 1)
        if i > a and cells + c > _MARGINAL_CELLS:
            out.append(slice(a, i))
            a, cells = i, 0
        cells += c
    if a < len(sizes):
        out.append(slice(a, len(sizes)))
    return out


class _State:
    """A labelling with per-bin works and nearest-member tables for exact move deltas.

    ``nl[b, p]`` = largest member of bin b below p (-1 if none); ``nr[b, p]`` = smallest member
    of bin b above p (n if none)."""

    def __init__(self, lv: _Leaves, label: np.ndarray, k: int, cap: int) -> None:
        self.lv = lv
        self.cap = cap
        self.label = label.copy()
        self.k = k
        self.works = lv.works(self.label, k)
        n = lv.n
        # stored bin-major ([k, n]): a bin's column is contiguous for the updates after a move
        self.nl = np.empty((k, n), dtype=np.int64)
        self.nr = np.empty((k, n), dtype=np.int64)
        self._idx = np.arange(n, dtype=np.int64)
        for b in range(k):
            self._refresh(b)

    def copy(self) -> _State:
        new = object.__new__(_State)
        new.lv, new.cap, new.k, new._idx = self.lv, self.cap, self.k, self._idx
        new.label = self.label.copy()
        new.works = self.works.copy()
        new.nl = self.nl.copy()
        new.nr = self.nr.copy()
        return new

    def assign(self, other: _State) -> None:
        self.label, self.works, self.nl, self.nr, self.k = (
            other.label,
            other.works,
            other.nl,
            other.nr,
            other.k,
        )

    def add_bins(self, extra: int) -> None:
        n = self.lv.n
        self.k += extra
        self.works = np.concatenate([self.works, np.zeros(extra, np.int64)])
        self.nl = np.concatenate([self.nl, np.full((extra, n), -1, np.int64)], axis=0)
        self.nr = np.concatenate([self.nr, np.full((extra, n), n, np.int64)], axis=0)

    def _refresh(self, b: int) -> None:
        """Recompute bin b's columns of ``nl`` / ``nr`` at every position."""
        self._refresh_window(b, 0, self.lv.n - 1, -1, self.lv.n)

    def members(self, b: int) -> np.ndarray:
        return np.flatnonzero(self.label == b)

    def pieces(self, b: int, whole_only: bool = False) -> _Pieces:
        """Nodes of bin b's own LCP-interval tree, the whole bin first."""
        lv = self.lv
        mem = self.members(b)
        m = int(mem.size)
        c = lv.consec(mem[:-1], mem[1:]).tolist() if m > 1 else []
        lens = lv.lens[mem].tolist()
        runs: list[tuple[int, int]] = [(0, m)]
        depth: list[int] = [min(c) if c else (lens[0] if m else 0)]
        if m > 1 and not whole_only:
            stack: list[tuple[int, int]] = []
            for i in range(m):
                cv = c[i] if i < m - 1 else -1
                lb = i
                while stack and stack[-1][0] > cv:
                    d, lb = stack.pop()
                    if (lb, i + 1) != (0, m):
                        runs.append((lb, i + 1))
                        depth.append(d)
                if not stack or stack[-1][0] < cv:
                    stack.append((cv, lb))
            runs.extend((i, i + 1) for i in range(m))
            depth.extend(lens)
        csum = np.zeros(m, dtype=np.int64)
        if m > 1:
            np.cumsum(c, out=csum[1:])
        lsum = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(lens, out=lsum[1:])
        cpad = np.concatenate([[0], c, [0]]).astype(np.int64)
        ii = np.fromiter((r[0] for r in runs), dtype=np.int64, count=len(runs))
        jj = np.fromiter((r[1] for r in runs), dtype=np.int64, count=len(runs))
        w = lsum[jj] - lsum[ii] - (csum[jj - 1] - csum[ii])
        gain = w - np.maximum(cpad[ii], cpad[jj])
        return _Pieces(mem, runs, mem[ii], mem[jj - 1], w, gain, np.asarray(depth, np.int64))

    def single(self, piece: np.ndarray) -> _Pieces:
        """A free-standing piece (gain unused)."""
        lv = self.lv
        w = lv.set_work(piece)
        d = (
            int(lv.lens[piece[0]])
            if piece.size == 1
            else int(lv.consec(piece[:-1], piece[1:]).min())
        )
        one = np.asarray([0], dtype=np.int64)
        return _Pieces(
            piece,
            [(0, int(piece.size))],
            piece[:1].copy(),
            piece[-1:].copy(),
            one + w,
            one + w,
            one + d,
        )

    def marginals(
        self, pc: _Pieces, src: int | np.ndarray, cols: np.ndarray | None = None
    ) -> np.ndarray:
        """[pieces, bins]: exact work added to each bin by inserting each piece (_INF at its
        source bin ``src``: one bin, or one per piece); only the bins ``cols`` (in that order)
        when given."""
        lv = self.lv
        s1 = pc.s1[:, None]
        sm = pc.sm[:, None]
        if cols is None:
            cols = np.arange(self.k)
            nl, nr = self.nl, self.nr
        else:
            cols = np.asarray(cols, dtype=np.int64)
            nl, nr = self.nl[cols], self.nr[cols]
        nl_s1, nl_sm, nr_sm = nl[:, pc.s1].T, nl[:, pc.sm].T, nr[:, pc.sm].T
        lp = lv.pair_lcp(nl_s1, s1)
        ls = lv.pair_lcp(sm, nr_sm)
        # lcp(pred, succ) = min(lp, depth, ls); 0 when either neighbour is missing.
        marg = pc.w[:, None] - lp - ls + np.minimum(np.minimum(lp, ls), pc.d[:, None])
        is_src = cols[None, :] == np.asarray(src, dtype=np.int64).reshape(-1, 1)
        marg[np.broadcast_to(is_src, marg.shape)] = _INF
        inter = (nl_sm > s1) & ~is_src
        if inter.any():  # the bin has members inside the piece's span: compute exactly
            tt, cc = np.nonzero(inter)
            marg[tt, cc] = self._interleaved_marginals(
                pc, tt, cols[cc], nl_s1[tt, cc], nr_sm[tt, cc]
            )
        return marg

    def marginals_many(
        self, pcs: Sequence[_Pieces], srcs: Sequence[int], cols: np.ndarray | None = None
    ) -> list[np.ndarray]:
        """:meth:`marginals` of each bin's pieces ``pcs[i]`` (source bin ``srcs[i]``), the same
        arrays, computed over groups of bins at once (at most ``_MARGINAL_CELLS`` cells each)."""
        sizes = [len(p.runs) for p in pcs]
        out: list[np.ndarray] = []
        for g in _bin_chunks(sizes, self.k if cols is None else len(cols)):
            src = np.repeat(np.asarray(srcs[g], dtype=np.int64), sizes[g])
            marg = self.marginals(_concat_pieces(pcs[g]), src, cols)
            out.extend(np.split(marg, np.cumsum(sizes[g])[:-1]))
        return out

    def _interleaved_marginals(
        self,
        pc: _Pieces,
        tt: np.ndarray,
        bins: np.ndarray,
        before: np.ndarray,
        after: np.ndarray,
    ) -> np.ndarray:
        """Exact ``set_work(members(b) | piece t) - set_work(members(b))`` for each pair
        ``(tt[e], bins[e])`` whose bin has members inside the piece's span, vectorized over the
        pairs: only the window from the bin's member ``before`` the piece to the one ``after`` it
        (-1 / n: none) changes, so the difference is the piece's lengths minus the change of the
        consecutive LCPs inside that window. Pairs are taken in chunks of at most
        ``_INTERLEAVED_CHUNK`` window positions (bounded memory)."""
        n = self.lv.n
        runs = pc.run_array()
        # the bin's members strictly inside (s1, sm): one sorted (bin, position) key array
        order = np.argsort(self.label, kind="stable")
        keys = self.label[order] * (n + 1) + order
        lo = np.searchsorted(keys, bins * (n + 1) + pc.s1[tt], side="right")
        hi = np.searchsorted(keys, bins * (n + 1) + pc.sm[tt], side="left")
        p0 = runs[tt, 0]
        p_n = runs[tt, 1] - p0
        size = np.cumsum(hi - lo + p_n + 2)
        out = np.empty(tt.shape[0], dtype=np.int64)
        a = 0
        while a < tt.shape[0]:
            base = int(size[a - 1]) if a else 0
            b = max(a + 1, int(np.searchsorted(size, base + _INTERLEAVED_CHUNK, side="right")))
            out[a:b] = self._window_deltas(
                pc.mem,
                order[concat_ranges(lo[a:b], hi[a:b] - lo[a:b])],
                hi[a:b] - lo[a:b],
                p0[a:b],
                p_n[a:b],
                before[a:b],
                after[a:b],
            )
            a = b
        return out

    def _window_deltas(
        self,
        mem: np.ndarray,
        inside: np.ndarray,
        inside_n: np.ndarray,
        p0: np.ndarray,
        p_n: np.ndarray,
        before: np.ndarray,
        after: np.ndarray,
    ) -> np.ndarray:
        """:meth:`_interleaved_marginals` of one chunk of pairs: ``inside`` the bins' members
        inside each piece's span (``inside_n`` per pair), the pieces ``mem[p0 : p0 + p_n]``."""
        lv, n = self.lv, self.lv.n
        m = p0.shape[0]
        cell = np.arange(m, dtype=np.int64)
        piece = mem[concat_ranges(p0, p_n)]
        has_b, has_a = before >= 0, after < n
        pos = np.concatenate([before[has_b], inside, after[has_a], piece])
        owner = np.concatenate(
            [cell[has_b], np.repeat(cell, inside_n), cell[has_a], np.repeat(cell, p_n)]
        )
        in_piece = np.zeros(pos.shape[0], dtype=bool)
        in_piece[pos.shape[0] - piece.shape[0] :] = True
        srt = np.lexsort((pos, owner))
        pos, owner, in_piece = pos[srt], owner[srt], in_piece[srt]

        def chain_lcp(keep: np.ndarray | None) -> np.ndarray:
            p, o = (pos, owner) if keep is None else (pos[keep], owner[keep])
            same = o[1:] == o[:-1]
            out = np.zeros(m, dtype=np.int64)
            if same.any():
                np.add.at(out, o[:-1][same], lv.consec(p[:-1][same], p[1:][same]))
            return out

        lens_piece = np.zeros(m, dtype=np.int64)
        np.add.at(lens_piece, np.repeat(cell, p_n), lv.lens[piece])
        return lens_piece - chain_lcp(None) + chain_lcp(~in_piece)

    def _refresh_window(self, b: int, lo: int, hi: int, before: int, after: int) -> None:
        """Recompute columns ``b`` of ``nl`` / ``nr`` for positions ``lo..hi`` (inclusive) only:
        ``before`` / ``after`` are bin b's nearest members below ``lo`` / above ``hi`` (-1 / n
        if none), which a move inside the window leaves unchanged."""
        mem = np.flatnonzero(self.label[lo : hi + 1] == b) + lo
        ext = np.concatenate([[before], mem, [after]])
        idx = self._idx[lo : hi + 1]
        self.nl[b, lo : hi + 1] = ext[np.searchsorted(mem, idx, side="left")]
        self.nr[b, lo : hi + 1] = ext[np.searchsorted(mem, idx, side="right") + 1]

    def move(self, piece: np.ndarray, src: int, dst: int, w_src: int, w_dst: int) -> None:
        # Only the positions between each bin's nearest members around the piece change (the
        # members outside that window stay, so their neighbours do too): O(window), not O(n).
        n = self.lv.n
        p0, p1 = int(piece.min()), int(piece.max())
        windows = []
        for b in (src, dst):
            lo = max(int(self.nl[b, p0]), 0)
            hi = int(self.nr[b, p1])
            hi = n - 1 if hi >= n else hi
            windows.append((b, lo, hi, int(self.nl[b, lo]), int(self.nr[b, hi])))
        self.label[piece] = dst
        self.works[src] = w_src
        self.works[dst] = w_dst
        for b, lo, hi, before, after in windows:
            self._refresh_window(b, lo, hi, before, after)

    def total(self) -> int:
        return int(self.works.sum())


class _CostCache:
    """Pieces of some bins of a :class:`_State` and their insertion costs into every bin
    (:meth:`_State.marginals`), kept across changes: a change of bins a and b alters only
    their own pieces and the costs of inserting into a and b."""

    def __init__(self, st: _State) -> None:
        self.st = st
        self.pieces: dict[int, _Pieces] = {}
        self.margs: dict[int, np.ndarray] = {}  # per bin: [its pieces, bins]

    def ensure(self, bins: Sequence[int]) -> None:
        """Entries for ``bins`` (the missing ones computed at once, added in that order)."""
        fresh = [a for a in bins if a not in self.pieces]
        for a in fresh:
            self.pieces[a] = self.st.pieces(a)
        pcs = [self.pieces[a] for a in fresh]
        self.margs.update(zip(fresh, self.st.marginals_many(pcs, fresh)))

    def changed(self, a: int, b: int) -> None:
        """Bins a and b changed (the state already updated): their entries are dropped, the
        others' costs of inserting into a and b recomputed."""
        for x in (a, b):
            self.pieces.pop(x, None)
            self.margs.pop(x, None)
        kept = list(self.pieces)
        cols = np.asarray([a, b], dtype=np.int64)
        pcs = [self.pieces[x] for x in kept]
        for x, m in zip(kept, self.st.marginals_many(pcs, kept, cols)):
            self.margs[x][:, cols] = m


def _pick(ok: np.ndarray, *keys: np.ndarray) -> tuple[int, int]:
    """(row, col) of the first True entry of ``ok`` in lexicographic order of ``keys``."""
    rows, cols = np.nonzero(ok)
    sel = np.lexsort((cols, rows, *[k[rows, cols] for k in reversed(keys)]))[0]
    return int(rows[sel]), int(cols[sel])


def _improve(st: _State, budget: int, min_bins: int = 1) -> int:
    """Piece moves with negative exact delta, then eliminations of small bins (not below
    ``min_bins``, a lower bound on the number of microbatches); repeat while total work drops
    (at most ``budget`` moves). Returns the number of moves."""
    cap = st.cap
    moves = 0
    while moves < budget:
        changed = False
        order = np.lexsort((np.arange(st.k), st.works)).tolist()
        for a in order:
            while st.works[a] > 0 and moves < budget:
                pc = st.pieces(a)
                marg = st.marginals(pc, a)
                new = st.works[None, :] + marg
                delta = marg - pc.gain[:, None]
                ok = (new <= cap) & (delta < 0)
                if not ok.any():
                    break
                t, b = _pick(ok, delta, -new)
                st.move(pc.piece(t), a, b, int(st.works[a] - pc.gain[t]), int(new[t, b]))
                moves += 1
                changed = True
        if moves < budget and _eliminate(st, min_bins=min_bins):
            changed = True
            moves += 1
        if not changed:
            break
    return moves


def _dissolve(st: _State, a: int) -> _State | None:
    """A copy of ``st`` with bin ``a`` dissolved into the other bins piece by piece (each piece
    to the feasible bin with the least added work; a piece that fits nowhere is split at its
    lowest valley); None when a single trajectory fits nowhere."""
    lv, cap = st.lv, st.cap
    trial = st.copy()
    queue = [trial.members(a)]
    while queue:
        piece = queue.pop()
        pc = trial.single(piece)
        marg = trial.marginals(pc, a)
        new = trial.works[None, :] + marg
        feas = (new <= cap) & (trial.works[None, :] > 0)  # never into an empty bin
        if feas.any():
            _, b = _pick(feas, marg, -new)
            mask = trial.label == a
            mask[piece] = False
            trial.move(piece, a, b, lv.set_work(np.flatnonzero(mask)), int(new[0, b]))
            continue
        if piece.size == 1:
            return None
        c = lv.consec(piece[:-1], piece[1:])
        cuts = np.flatnonzero(c == c.min()) + 1
        queue.extend(reversed(np.split(piece, cuts)))
    return trial


def _eliminate(st: _State, tries: int = 6, min_bins: int = 1, same_work: bool = False) -> bool:
    """Dissolve a bin (smallest first) into the others (:func:`_dissolve`); commit the first
    dissolution that lowers total work (``same_work``: or keeps it). Nothing to try at
    ``min_bins`` live bins or fewer."""
    live = np.flatnonzero(st.works > 0)
    if live.size < 2 or live.size <= min_bins:
        return False
    limit = st.total() - (0 if same_work else 1)  # integer works
    for a in live[np.lexsort((live, st.works[live]))][:tries].tolist():
        trial = _dissolve(st, a)
        if trial is not None and trial.total() <= limit:
            st.assign(trial)
            return True
    return False


def _fewer_bins(st: _State, budget: int, min_bins: int = 1) -> int:
    """:func:`_eliminate` with ``same_work`` while it dissolves a bin: fewer microbatches for
    the same work (each one is a forward, backward and FSDP all-gather more). At most
    ``budget`` dissolutions, never below ``min_bins`` live bins. Returns the number made."""
    done = 0
    while done < budget and _eliminate(st, min_bins=min_bins, same_work=True):
        done += 1
    return done


_NO_FIXED = np.zeros(0, np.int64)


def _with_fixed(works: np.ndarray, fixed: np.ndarray) -> np.ndarray:
    """``fixed`` (the works of the oversize microbatches, which no move changes) before the
    bins' ``works`` along the last axis; a 2-D ``works`` gets them in every row."""
    if fixed.size == 0:
        return works
    w = np.asarray(works)
    if w.ndim == 1:
        return np.concatenate([fixed.astype(w.dtype), w])
    return np.concatenate([np.broadcast_to(fixed.astype(w.dtype), (w.shape[0], fixed.size)), w], 1)


def _aligned(k: int, nf: int, dp: int) -> int:
    """The least K >= ``k`` with ``K + nf`` a multiple of ``dp`` (``nf`` fixed microbatches)."""
    return -(-(k + nf) // dp) * dp - nf


def _crit(works: np.ndarray, dp: int) -> int:
    return int(np.sort(works)[::-1][::dp].sum())


def _score_works(
    works: np.ndarray, dp: int, fixed: np.ndarray = _NO_FIXED
) -> tuple[int, int, int, int]:
    """(total, slot-critical, max replica, microbatches) of the non-empty bins with these works
    and the ``fixed`` (oversize) microbatches after them, as :func:`_build_plan` places them."""
    w = np.asarray(works, dtype=np.int64)
    w = np.concatenate([w[w > 0], fixed])
    if w.size == 0:
        return 0, 0, 0, 0
    _, replica, _ = place_microbatches(w, dp)
    rep = np.bincount(replica, weights=w, minlength=dp)
    return int(w.sum()), _crit(w, dp), int(rep.max()), int(w.size)


def _slot_objective(works: np.ndarray, dp: int, fixed: np.ndarray = _NO_FIXED) -> tuple[int, float]:
    """(slot-critical work, Σ over slots of Σ (slot max − work)²) for sorted grouping of the
    bins and the ``fixed`` microbatches."""
    w = np.sort(_with_fixed(works, fixed))[::-1]
    pad = (-w.shape[0]) % dp
    if pad:
        w = np.concatenate([w, np.zeros(pad, w.dtype)])
    g = w.reshape(-1, dp)
    mx = g[:, 0]
    return int(mx.sum()), float(((mx[:, None] - g).astype(np.float64) ** 2).sum())


def _balance(
    st: _State, dp: int, budget: int, work_limit: int, fixed: np.ndarray = _NO_FIXED
) -> int:
    """Piece moves, keeping the bins' total work <= ``work_limit``, that lower the slot
    objective (slot-critical work, then the squared idle inside slots, which lets the search
    cross plateaus of equal maxima) of the bins and the ``fixed`` (oversize) microbatches.
    Empty bins are offered so K plus the fixed ones can grow to a multiple of ``dp``.
    Sources: bins above their slot's mean, worst slots first; each source's candidates are
    screened by the larger of the two resulting works, then by the work they add. Best move
    first; stops when none improves or after ``budget`` moves. Returns the moves made."""
    cap = st.cap
    nf = int(fixed.size)
    live = int((st.works > 0).sum())
    want = _aligned(live, nf, dp)
    if want > live:
        st.add_bins(want - live)
    cur = _slot_objective(st.works, dp, fixed)
    moves = 0
    k = st.k
    pad = (-(k + nf)) % dp
    cache = _CostCache(st)  # the sources' pieces and insertion costs, kept across rounds
    while moves < budget:
        w = st.works
        wx = _with_fixed(w, fixed)
        total = int(w.sum())
        order = np.lexsort((np.arange(k + nf), -wx))
        groups = np.concatenate([order, np.full(pad, -1)]).reshape(-1, dp)
        gw = np.where(groups >= 0, wx[np.maximum(groups, 0)], 0)
        idle = (gw[:, :1] - gw).sum(axis=1)
        cands: list[tuple[tuple[int, float], int, tuple[int, int, int, int, int]]] = []
        sources: list[int] = []  # bins above their slot's mean, worst slots first
        for s in np.argsort(-idle, kind="stable")[:_BAL_GROUPS].tolist():
            if idle[s] == 0:
                break
            mean = gw[s].mean()
            for a in [int(a) - nf for a in groups[s] if a >= nf and wx[a] > mean][:_BAL_SOURCES]:
                if a not in sources:
                    sources.append(a)
        cache.ensure(sources)
        for a in sources:
            pa, marg = cache.pieces[a], cache.margs[a]
            new = w[None, :] + marg
            delta = marg - pa.gain[:, None]
            after_a = w[a] - pa.gain
            ok = (new <= cap) & (new < w[a]) & (total + delta <= work_limit)
            if not ok.any():
                continue
            rows, cols = np.nonzero(ok)
            pair_max = np.maximum(after_a[rows], new[rows, cols])
            sel = np.lexsort((cols, rows, delta[rows, cols], pair_max))[:_BAL_CANDS]
            for t, b in zip(rows[sel].tolist(), cols[sel].tolist()):
                trial = w.copy()
                trial[a] = after_a[t]
                trial[b] = new[t, b]
                obj = _slot_objective(trial, dp, fixed)
                if obj < cur:
                    cands.append((obj, len(cands), (a, b, t, int(after_a[t]), int(new[t, b]))))
        if not cands:
            break
        obj, _, (a, b, t, wa, wb) = min(cands, key=lambda c: (c[0], c[1]))
        st.move(cache.pieces[a].piece(t), a, b, wa, wb)
        cache.changed(a, b)
        cur = obj
        moves += 1
    return moves


_REPAIR_TAU = 0.015  # slot imbalance the repair pass aims below (the issue's target is 2 %)
_REPAIR_CANDS = 1000  # moves per round whose exact slot objective is evaluated
_REPAIR_GOAL = 0.018  # a repaired plan with every slot at or below this ends the search
_REPAIR_VERIFY = 24  # most candidates judged exactly per round and mode
_TABU_TENURE, _TABU_STALL = 8, 20  # repair: rounds a bin pair stays tabu; non-improving rounds


def _slot_penalty(
    works: np.ndarray,
    dp: int,
    tau: float = _REPAIR_TAU,
    crit_limit: float = np.inf,
    fixed: np.ndarray = _NO_FIXED,
) -> np.ndarray:
    """[C, 3] for works [C, k] (and the ``fixed`` microbatches in every row) under sorted
    grouping: (excess of the slot-critical work over ``crit_limit`` (0 if none), Σ over slots
    of max(imbalance − tau, 0)², Σ over slots of imbalance²), compared lexicographically.
    Empty bins count as empty microbatches."""
    w = _with_fixed(np.atleast_2d(np.asarray(works, dtype=np.float64)), fixed)
    c, k = w.shape
    s = -np.sort(-w, axis=1)
    pad = (-k) % dp
    if pad:
        s = np.concatenate([s, np.zeros((c, pad))], axis=1)
    g = s.reshape(c, -1, dp)
    mx = g[:, :, 0]
    imb = np.where(mx > 0, (mx - g.mean(axis=2)) / np.maximum(mx, 1.0), 0.0)
    over = np.maximum(mx.sum(axis=1) - crit_limit, 0.0)
    return np.stack(
        [over, (np.maximum(imb - tau, 0.0) ** 2).sum(axis=1), (imb**2).sum(axis=1)], axis=1
    )


def _lex_less(obj: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """Rows of ``obj`` [C, 3] lexicographically below ``cur`` [3] (1e-12 tolerance on the
    float keys)."""
    less = np.zeros(obj.shape[0], dtype=bool)
    equal = np.ones(obj.shape[0], dtype=bool)
    for c in range(obj.shape[1]):
        less |= equal & (obj[:, c] < cur[c] - 1e-12)
        equal &= np.abs(obj[:, c] - cur[c]) <= 1e-12
    return less


def _fixed_slot_drop(
    works: np.ndarray, dp: int, a: np.ndarray, b: np.ndarray, wa: np.ndarray, wb: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Screen for candidate changes (bins ``a``/``b`` get works ``wa``/``wb``): the drop of
    (slot-critical work, Σ over slots of max(imbalance − tau, 0)², Σ imbalance²) if every bin
    kept its slot of the current sorted grouping (exact when the sort order does not change)."""
    slot, ids = _sorted_slots(works, dp)
    g = np.where(ids >= 0, works[np.maximum(ids, 0)], 0).astype(np.float64)
    ssum = g.sum(axis=1)
    top = ids[:, :3] if dp >= 3 else np.concatenate([ids, np.full((ids.shape[0], 3 - dp), -1)], 1)
    topw = np.where(top >= 0, works[np.maximum(top, 0)], 0).astype(np.float64)

    def imb(mx: np.ndarray, sm: np.ndarray) -> np.ndarray:
        return np.where(mx > 0, (mx - sm / dp) / np.maximum(mx, 1.0), 0.0)

    def pen(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.maximum(x - _REPAIR_TAU, 0.0) ** 2, x**2

    old_imb = imb(g[:, 0], ssum)
    sa, sb = slot[a], slot[b]
    same = sa == sb
    wa = wa.astype(np.float64)
    wb = wb.astype(np.float64)

    def max_excl(s_: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        t, tw = top[s_], topw[s_]
        ok = (t != x[:, None]) & (t != y[:, None])
        first = np.argmax(ok, axis=1)
        return np.where(ok.any(axis=1), tw[np.arange(t.shape[0]), first], 0.0)

    none = np.full(a.shape[0], -2)
    # slot of a: a replaced (and b too when in the same slot)
    mx_a = np.maximum(max_excl(sa, a, np.where(same, b, none)), wa)
    mx_a = np.where(same, np.maximum(mx_a, wb), mx_a)
    sum_a = ssum[sa] - works[a] + wa - np.where(same, works[b] - wb, 0.0)
    new_a = imb(mx_a, sum_a)
    mx_b = np.maximum(max_excl(sb, b, none), wb)
    new_b = imb(mx_b, ssum[sb] - works[b] + wb)
    oa, ob = pen(old_imb[sa]), pen(old_imb[sb])
    na, nb = pen(new_a), pen(new_b)
    d0 = oa[0] - na[0] + np.where(same, 0.0, ob[0] - nb[0])
    d1 = oa[1] - na[1] + np.where(same, 0.0, ob[1] - nb[1])
    dc = g[sa, 0] - mx_a + np.where(same, 0.0, g[sb, 0] - mx_b)
    return dc, d0, d1


def _sorted_slots(works: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted grouping of bins into slots (works decreasing, ties by index, ``dp`` per slot):
    the slot of each bin, and ``[slots, dp]`` bin ids per slot (-1 pads the last slot)."""
    k = works.shape[0]
    order = np.lexsort((np.arange(k), -works))
    slot = np.empty(k, dtype=np.int64)
    slot[order] = np.arange(k) // dp
    ids = np.concatenate([order, np.full((-k) % dp, -1)]).reshape(-1, dp)
    return slot, ids


def _slot_of_bins(
    works: np.ndarray, dp: int, fixed: np.ndarray = _NO_FIXED
) -> tuple[np.ndarray, np.ndarray]:
    """Slot of each bin under sorted grouping (of the bins and the ``fixed`` microbatches, which
    come first), and each slot's imbalance."""
    wx = _with_fixed(works, fixed)
    slot, ids = _sorted_slots(wx, dp)
    return slot[fixed.size :], slot_imbalance(np.where(ids >= 0, wx[np.maximum(ids, 0)], 0))


def _move_candidates(
    st: _State, pieces: dict[int, _Pieces], margs: dict[int, np.ndarray], work_limit: int
) -> tuple[np.ndarray, ...]:
    """All feasible single piece moves as arrays (a, t, b, wa, wb, delta), bins in the order
    of ``pieces``, then pieces, then target bins."""
    w, cap = st.works, st.cap
    total = int(w.sum())
    bins = list(pieces)
    sizes = [len(pieces[a].runs) for a in bins]
    parts: list[tuple[np.ndarray, ...]] = []
    for g in _bin_chunks(sizes, st.k):  # vectorized over groups of bins
        pa = np.repeat(np.asarray(bins[g], dtype=np.int64), sizes[g])
        pt = np.concatenate([np.arange(size) for size in sizes[g]])
        gain = np.concatenate([pieces[a].gain for a in bins[g]])
        marg = np.concatenate([margs[a] for a in bins[g]])
        new = w[None, :] + marg
        delta = marg - gain[:, None]
        ok = (new <= cap) & (new < w[pa][:, None]) & (total + delta <= work_limit)
        if ok.any():
            r, c = np.nonzero(ok)
            parts.append((pa[r], pt[r], c, w[pa[r]] - gain[r], new[r, c], delta[r, c]))
    if not parts:
        return tuple(np.zeros(0, np.int64) for _ in range(6))
    return tuple(np.concatenate(x) for x in zip(*parts))


_SWAP_PAIRS = 200_000  # most (hot piece, piece) pairs a repair round screens for swaps


def _thin_pieces(pb: np.ndarray, pt: np.ndarray, gain: np.ndarray, hot_count: int) -> np.ndarray:
    """Indices of the pieces (bins ``pb``, piece ids ``pt``, removal gains ``gain``; P of them,
    ``hot_count`` in hot bins) the swap screen pairs: all when ``hot_count · P <=
    _SWAP_PAIRS``, else in each bin its whole-bin piece, its largest-gain piece and the same
    fraction ``f`` of its pieces, evenly spaced in their order by gain from the least (so the
    gains, which set a swap's work change, keep their range), with ``f² · hot_count · P =
    _SWAP_PAIRS``. Deterministic."""
    p = pb.shape[0]
    if hot_count * p <= _SWAP_PAIRS:
        return np.arange(p)
    frac = float(np.sqrt(_SWAP_PAIRS / (hot_count * p)))
    order = np.lexsort((pt, gain, pb))  # by bin, then gain, then piece id
    sb = pb[order]
    starts = np.flatnonzero(np.r_[True, sb[1:] != sb[:-1]])
    sizes = np.diff(np.r_[starts, p])
    rank = np.arange(p) - np.repeat(starts, sizes)  # rank by gain inside the bin
    size = np.repeat(sizes, sizes)
    want = np.repeat(np.maximum((sizes * frac).astype(np.int64), 1), sizes)
    j = (rank * want + size - 1) // size  # kept ranks: (j · size) // want, j < want
    picked = ((j < want) & ((j * size) // want == rank)) | (rank == size - 1)
    sel = order[picked]
    return np.union1d(sel, np.flatnonzero(pt == 0))


def _swap_candidates(
    st: _State,
    pieces: dict[int, _Pieces],
    margs: dict[int, np.ndarray],
    work_limit: int,
    hot: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """Piece swaps between two bins, at least one of them ``hot`` (bool per bin), screened with
    the insertion costs of the unchanged bins: arrays (a, t, b, u, wa, wb, delta) with
    approximate works (callers verify with :func:`_swap_exact`)."""
    w, cap = st.works, st.cap
    total = int(w.sum())
    bins = sorted(pieces)
    pb = np.concatenate([np.full(len(pieces[a].runs), a) for a in bins])
    pt = np.concatenate([np.arange(len(pieces[a].runs)) for a in bins])
    gain = np.concatenate([pieces[a].gain for a in bins])
    marg = np.concatenate([margs[a] for a in bins])  # [P, k]
    keep = _thin_pieces(pb, pt, gain, int(hot[pb].sum()))
    pb, pt, gain, marg = pb[keep], pt[keep], gain[keep], marg[keep]
    whole = pt == 0
    hot_p = np.flatnonzero(hot[pb])
    hb = pb[hot_p]
    r, jj = np.nonzero(
        (hb[:, None] != pb[None, :])
        & ~(whole[hot_p][:, None] & whole[None, :])
        & (~hot[pb][None, :] | (hb[:, None] < pb[None, :]))  # hot-hot pairs once
    )
    ii = hot_p[r]
    a, b = pb[ii], pb[jj]
    wa = w[a] - gain[ii] + marg[jj, a]
    wb = w[b] - gain[jj] + marg[ii, b]
    delta = wa + wb - w[a] - w[b]
    ok = (wa <= cap) & (wb <= cap) & (total + delta <= work_limit) & (wa != w[a])
    ii, jj = ii[ok], jj[ok]
    return pb[ii], pt[ii], pb[jj], pt[jj], wa[ok], wb[ok], delta[ok]


def _swap_exact(
    st: _State, pieces: dict[int, _Pieces], a: int, t: int, b: int, u: int
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Members and exact works of bins a and b after swapping piece t of a with piece u of b."""
    lv = st.lv
    pa, pb = pieces[a].piece(t), pieces[b].piece(u)
    ma = np.union1d(np.setdiff1d(st.members(a), pa, assume_unique=True), pb)
    mb = np.union1d(np.setdiff1d(st.members(b), pb, assume_unique=True), pa)
    return ma, mb, lv.set_work(ma), lv.set_work(mb)


def _repair(
    st: _State,
    dp: int,
    budget: int,
    work_limit: int,
    crit_limit: float = np.inf,
    fixed: np.ndarray = _NO_FIXED,
) -> int:
    """Slot-imbalance repair: piece moves (any bin to any bin, empty bins offered so K reaches
    a multiple of ``dp``) and piece swaps between two bins (one of them in a slot above
    ``_REPAIR_TAU``), keeping total work <= ``work_limit``, that lower :func:`_slot_penalty`
    lexicographically (the excess of each slot's imbalance over ``_REPAIR_TAU``, then
    Σ imbalance²) under sorted grouping, the ``fixed`` (oversize) microbatches included (they
    never move; ``work_limit`` bounds the bins' work). Each round screens the candidates by the drop of
    Σ (work − mean)² (free ones first, then per token of extra work), evaluates the exact slot
    objective of the best ``_REPAIR_CANDS`` (swap works made exact first) and makes the best
    free improving change, else the improving one with the largest gain per extra token.
    Returns the changes made."""
    nf = int(fixed.size)
    live = int((st.works > 0).sum())
    want = _aligned(live, nf, dp)
    if want > st.k:
        st.add_bins(want - st.k)
    k = st.k
    cur = _slot_penalty(st.works, dp, crit_limit=crit_limit, fixed=fixed)[0]
    best = (tuple(cur), st.label.copy(), st.works.copy())
    # Bin pairs changed in the last _TABU_TENURE rounds (keys a * k + b, both orders) and the
    # round each changed: a few entries, whatever k (a dense k x k table would not fit a
    # large DP world).
    tabu_keys, tabu_rounds = np.zeros(0, np.int64), np.zeros(0, np.int64)
    stall = 0
    # every non-empty bin's pieces and insertion costs (only a change's two bins empty)
    cache = _CostCache(st)
    pieces, margs = cache.pieces, cache.margs
    moves = 0
    while moves < budget and (cur[0] > 0 or cur[1] > 0):
        w = st.works
        total = int(w.sum())
        mean = total / k
        cache.ensure(np.flatnonzero(w > 0).tolist())
        wx = _with_fixed(w, fixed)
        slotx, imb = _slot_of_bins(wx, dp)  # the fixed microbatches first
        slot = slotx[nf:]
        # Bins that must change: in a slot above _REPAIR_TAU, its largest or at most its mean.
        smax = np.zeros(imb.size)
        np.maximum.at(smax, slotx, wx)
        smean = np.bincount(slotx, weights=wx, minlength=imb.size) / dp
        hot = (imb[slot] > _REPAIR_TAU) & ((w >= smax[slot]) | (w <= smean[slot]))
        ma, mt, mb_, mwa, mwb, md = _move_candidates(st, pieces, margs, work_limit)
        sa, st_, sb, su, swa, swb, sd = _swap_candidates(st, pieces, margs, work_limit, hot)
        a_ = np.concatenate([ma, sa])
        t_ = np.concatenate([mt, st_])
        b_ = np.concatenate([mb_, sb])
        u_ = np.concatenate([np.full(ma.size, -1), su])
        wa_ = np.concatenate([mwa, swa]).astype(np.int64)
        wb_ = np.concatenate([mwb, swb]).astype(np.int64)
        d_ = np.concatenate([md, sd]).astype(np.int64)
        if a_.size == 0:
            break
        drop = (w[a_] - mean) ** 2 + (w[b_] - mean) ** 2 - (wa_ - mean) ** 2 - (wb_ - mean) ** 2
        screen = np.where(d_ <= 0, drop + 1e30, drop / np.maximum(d_, 1))
        fc, f0, f1 = _fixed_slot_drop(wx, dp, a_ + nf, b_ + nf, wa_, wb_)
        fs = fc if cur[0] > 0 else (f0 if cur[1] > 0 else f1)
        fscreen = np.where(d_ <= 0, fs + 1e30, fs / np.maximum(d_, 1))
        half = _REPAIR_CANDS // 2
        sel = np.unique(
            np.concatenate(
                [
                    np.lexsort((np.arange(screen.size), -screen))[:half],
                    np.lexsort((np.arange(fscreen.size), -fscreen))[:half],
                ]
            )
        )
        feas = (wa_[sel] <= st.cap) & (wb_[sel] <= st.cap) & (total + d_[sel] <= work_limit)
        rows = np.arange(sel.size)
        trial = np.repeat(w[None, :], sel.size, axis=0)
        trial[rows, a_[sel]] = wa_[sel]
        trial[rows, b_[sel]] = wb_[sel]
        obj = _slot_penalty(trial, dp, crit_limit=crit_limit, fixed=fixed)
        recent = tabu_rounds >= moves - _TABU_TENURE
        tabu_keys, tabu_rounds = tabu_keys[recent], tabu_rounds[recent]
        pair = a_[sel].astype(np.int64) * k + b_[sel]
        allowed = feas & ~np.isin(pair, tabu_keys)
        better = allowed & _lex_less(obj, cur)
        # Preference: free improving changes (least objective), then improving ones by gain
        # per extra token; when stuck, the least-worsening allowed change (tabu walk), at most
        # _TABU_STALL times without a new best. Swap works are approximate until verified:
        # a swap whose exact works differ is skipped.
        free = np.flatnonzero(better & (d_[sel] <= 0))
        paid = np.flatnonzero(better & (d_[sel] > 0))
        col = 0 if cur[0] > 0 else (1 if cur[1] > 0 else 2)
        gain = (cur[col] - obj[paid, col]) / np.maximum(d_[sel][paid], 1)
        prefs = [
            free[np.lexsort((free, obj[free, 2], obj[free, 1], obj[free, 0]))],
            paid[np.lexsort((paid, -gain))],
        ]
        walk = np.flatnonzero(allowed)
        walk = walk[np.lexsort((walk, d_[sel][walk], obj[walk, 2], obj[walk, 1], obj[walk, 0]))]
        chosen, walking, exact_obj = -1, False, None
        for mode, cand in ((False, np.concatenate(prefs)), (True, walk)):
            if mode and stall >= _TABU_STALL:
                break
            for j in cand[:_REPAIR_VERIFY].tolist():
                i = int(sel[j])
                if u_[i] >= 0:
                    mem_a, mem_b, ewa, ewb = _swap_exact(
                        st, pieces, int(a_[i]), int(t_[i]), int(b_[i]), int(u_[i])
                    )
                    if ewa != wa_[i] or ewb != wb_[i]:  # approximation off: judge exactly
                        if (
                            max(ewa, ewb) > st.cap
                            or total + ewa + ewb - w[a_[i]] - w[b_[i]] > work_limit
                        ):
                            continue
                        tw = w.copy()
                        tw[a_[i]], tw[b_[i]] = ewa, ewb
                        eo = _slot_penalty(tw, dp, crit_limit=crit_limit, fixed=fixed)[0]
                        if not mode and not _lex_less(eo[None, :], cur)[0]:
                            continue
                        wa_[i], wb_[i], exact_obj = ewa, ewb, eo
                chosen, walking = j, mode
                break
            if chosen >= 0:
                break
        if chosen < 0:
            break
        stall += int(walking)
        j, i = chosen, int(sel[chosen])
        a, t, b = int(a_[i]), int(t_[i]), int(b_[i])
        if u_[i] < 0:
            st.move(pieces[a].piece(t), a, b, int(wa_[i]), int(wb_[i]))
        else:
            st.label[mem_a] = a
            st.label[mem_b] = b
            st.works[a], st.works[b] = int(wa_[i]), int(wb_[i])
            st._refresh(a)
            st._refresh(b)
        cache.changed(a, b)
        tabu_keys = np.append(tabu_keys, [a * k + b, b * k + a])
        tabu_rounds = np.append(tabu_rounds, [moves, moves])
        cur = obj[j] if exact_obj is None else exact_obj
        moves += 1
        if tuple(cur) < best[0]:
            best = (tuple(cur), st.label.copy(), st.works.copy())
            stall = 0
    if tuple(cur) > best[0]:  # end on the best state seen
        st.label, st.works = best[1], best[2]
        for x in range(k):
            st._refresh(x)
    return moves


# ============================================================================ placement
_BALANCED_TRIES = 4  # microbatch counts from the lower bound a balanced split is tried at
_DIFFERENCING_MAX = 64  # the most microbatches a differencing split is tried for (O(n·k log k))


def _counts(name: str, values: Any) -> np.ndarray:
    """``values`` as a 1-D int64 array of non-negative integers < 2**63; ValueError naming
    ``name`` otherwise (bools included: numpy would read them as 0 / 1)."""
    raw = np.asarray(values)
    if (
        holds_bool(values)
        or raw.ndim != 1
        or (
            raw.size
            and (raw.dtype.kind not in "iu" or int(raw.min()) < 0 or int(raw.max()) > INT64_MAX)
        )
    ):
        raise ValueError(f"{name}: expected a 1-D array of non-negative integer {name} < 2**63")
    return raw.astype(np.int64, copy=False)


def token_balanced_microbatches(
    lengths: Sequence[int] | np.ndarray, capacity_tokens: int
) -> list[np.ndarray]:
    """Trajectory-wise microbatches as a packing dynamic batching would make them (the
    expanded baseline's; veRL's ``rearrange_micro_batches`` raises its count from
    ``ceil(S / capacity)`` until a balanced split fits): a trajectory longer than the capacity
    alone in one; the others into the fewest microbatches of at most ``capacity_tokens`` tokens
    found: a token-balanced split (longest first onto the microbatch with the fewest tokens,
    else for at most :data:`_DIFFERENCING_MAX` microbatches the largest differencing method by
    tokens, then by veRL's workload estimate)
    at the first of :data:`_BALANCED_TRIES` counts from ``ceil(S / capacity)`` where it fits,
    else at best-fit decreasing's count (at most 11/9 of the fewest possible, plus one) where
    it fits, else best-fit decreasing's own packing. Returns the non-empty microbatches' trajectory
    indices (int64, ascending), ordered by their first index; every index in exactly one.
    ValueError for lengths that are not non-negative integers or a capacity below 1."""
    import bisect
    import heapq

    _check_int("capacity_tokens", capacity_tokens, 1, INT64_MAX)
    cap = int(capacity_tokens)
    lens = _counts("lengths", lengths)
    n = int(lens.shape[0])
    if n == 0:
        return []
    order = np.lexsort((np.arange(n), -lens))
    over = order[lens[order] > cap]
    fits = order[lens[order] <= cap].tolist()
    # best fit decreasing: the fullest microbatch with room; (free tokens, microbatch) sorted
    free: list[tuple[int, int]] = []
    bin_of = np.empty(n, np.int64)
    k = 0
    for i in fits:
        need = int(lens[i])
        j = bisect.bisect_left(free, (need, -1))
        if j < len(free):
            room, b = free.pop(j)
        else:
            room, b = cap, k
            k += 1
        bin_of[i] = b
        bisect.insort(free, (room - need, b))

    def greedy(count: int) -> np.ndarray | None:
        """The token-balanced split into ``count`` microbatches (longest first onto the one
        with the fewest tokens), if each fits."""
        heap = [(0, b) for b in range(count)]
        out = np.empty(n, np.int64)
        for i in fits:
            load, b = heapq.heappop(heap)
            out[i] = b
            heapq.heappush(heap, (load + int(lens[i]), b))
        return out if max(load for load, _ in heap) <= cap else None

    def differencing(count: int, weight: Any) -> np.ndarray | None:
        """The ``count``-way largest differencing split (Karmarkar-Karp, what veRL balances
        with) by ``weight(length)``, if each part's tokens fit: partial splits merged two at a
        time, the widest spreads first, the heavier parts of one with the lighter of the
        other."""
        heap = []
        for t, i in enumerate(fits):
            w = weight(int(lens[i]))
            parts = [(w, [i])] + [(0, []) for _ in range(count - 1)]
            heap.append((-w, t, parts))
        heapq.heapify(heap)
        tick = len(heap)
        while len(heap) > 1:
            _, _, a = heapq.heappop(heap)
            _, _, b = heapq.heappop(heap)
            a.sort(key=lambda p: -p[0])
            b.sort(key=lambda p: p[0])
            merged = [(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b)]
            loads = [m[0] for m in merged]
            heapq.heappush(heap, (min(loads) - max(loads), tick, merged))
            tick += 1
        parts = heap[0][2]
        if max(sum(lens[p[1]].tolist()) for p in parts) > cap:  # exact (int64 sums wrap)
            return None
        out = np.empty(n, np.int64)
        for b, (_, members) in enumerate(parts):
            out[members] = b
        return out

    def balanced(count: int) -> np.ndarray | None:
        split = greedy(count)
        if count <= _DIFFERENCING_MAX:  # by tokens, then by veRL's workload (24576·L + L²)
            for weight in (lambda v: v, lambda v: 24576 * v + v * v):
                split = differencing(count, weight) if split is None else split
        return split

    # fewer microbatches where a balanced split fits in them (a few counts up from the lower
    # bound, as dynamic batching tries them), else best fit's count, balanced when that fits
    low = max(1, -(-sum(lens[fits].tolist()) // cap)) if fits else 0
    for count in [*range(low, min(k, low + _BALANCED_TRIES)), k] if k > 1 else []:
        split = balanced(count)
        if split is not None:
            bin_of, k = split, count
            break
    bin_of[over] = k + np.arange(over.shape[0])  # each oversize trajectory alone
    k += int(over.shape[0])
    counts = np.bincount(bin_of, minlength=k)
    bins = np.split(np.argsort(bin_of, kind="stable"), np.cumsum(counts)[:-1])
    bins = [b for b in bins if b.size]
    bins.sort(key=lambda b: int(b[0]))
    return bins


def place_microbatches(works: np.ndarray, dp_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Slot and replica of each microbatch, and the number of slots.

    Works sorted decreasingly (ties by index) are cut into consecutive groups of ``dp_size``,
    one group per slot: Σ over slots of the slot's largest work is then minimal for these works.
    Within a slot, larger microbatches go to replicas with less cumulative work so far (ties:
    lower replica id). Raises ValueError for a ``dp_size`` outside ``[1, MAX_DP_SIZE]`` or
    ``works`` that are not a 1-D array of non-negative integers."""
    _check_int("dp_size", dp_size, 1, MAX_DP_SIZE)
    works = _counts("works", works)
    k = works.shape[0]
    num_slots = -(-k // dp_size) if k else 0
    order = np.lexsort((np.arange(k), -works))
    slot = np.empty(k, dtype=np.int64)
    replica = np.empty(k, dtype=np.int64)
    cum = np.zeros(dp_size, dtype=np.int64)
    ids = np.arange(dp_size)
    for s in range(num_slots):
        members = order[s * dp_size : (s + 1) * dp_size]
        reps = np.lexsort((ids, cum))[: members.shape[0]]
        slot[members] = s
        replica[members] = reps
        cum[reps] += works[members]
    return slot, replica, num_slots


# ============================================================================ public API
def _check_forest(forest: Any) -> None:
    if not isinstance(forest, RolloutForest):
        raise TypeError(f"forest: expected a RolloutForest, got {type(forest).__name__}")


def _check_arguments(
    capacity_tokens: Any, dp_size: Any, seed: Any, options: dict[str, Any]
) -> dict[str, Any]:
    """The options merged with the defaults, after checking every argument (ValueError naming
    it; TypeError for an unknown option)."""
    _check_int("capacity_tokens", capacity_tokens, 1)
    _check_int("dp_size", dp_size, 1, MAX_DP_SIZE)
    _check_int("seed", seed, 0, None)  # numpy's generators take any non-negative int
    return _check_options(options)


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options merged with the defaults, each value checked (ValueError naming it)."""
    unknown = sorted(set(options) - set(_DEFAULT_OPTIONS))
    if unknown:
        raise TypeError(f"plan_microbatches: unknown option {unknown[0]!r}")
    opt = {**_DEFAULT_OPTIONS, **options}
    strategies = opt["strategies"]
    if isinstance(strategies, str):  # one family name
        strategies = (strategies,)
    try:  # a mapping would pass as the set of its keys
        families = (
            set()
            if isinstance(strategies, Mapping)
            else set(_FAMILIES)
            if strategies is None
            else set(strategies)
        )
    except TypeError:  # not an iterable of names
        families = set()
    if not families or families - set(_FAMILIES):
        raise ValueError(
            f"strategies: expected a non-empty subset of {list(_FAMILIES)}, got {opt['strategies']!r}"
        )
    opt["strategies"] = families
    for name, lo, hi in (("work_slack", 0.0, 1.0), ("effort", 0.0, np.inf)):
        v = opt[name]
        f = finite_float(v)
        if f is None or not lo <= f < hi:
            interval = "a fraction in [0, 1)" if hi == 1.0 else "a finite number >= 0"
            raise ValueError(f"{name}: expected {interval}, got {v!r}")
        opt[name] = f
    opt["restarts"] = _check_int("restarts", opt["restarts"], 0)
    opt["max_layers_work"] = _check_int("max_layers_work", opt["max_layers_work"], 0)
    opt["max_search_cells"] = _check_int("max_search_cells", opt["max_search_cells"], 0)
    for name in ("allow_oversize", "improve", "balance"):
        if not isinstance(opt[name], bool | np.bool_):
            raise ValueError(f"{name}: expected a bool, got {opt[name]!r}")
        opt[name] = bool(opt[name])
    return opt


def planner_options() -> tuple[str, ...]:
    """The names of the keyword options :func:`plan_microbatches` takes besides
    ``capacity_tokens`` / ``dp_size`` / ``seed``, sorted; :func:`validate_options` knows exactly
    these."""
    return tuple(sorted(_DEFAULT_OPTIONS))


def validate_options(options: dict[str, Any]) -> None:
    """Check ``plan_microbatches`` keyword options (the planner's own, without ``forest`` /
    ``capacity_tokens`` / ``dp``) as the planner would, before any planning: ``TypeError`` for
    an unknown option, ``ValueError`` naming the option and what it expects."""
    _check_options(dict(options))


def _oversize(forest: RolloutForest, cap: int, allow: bool) -> np.ndarray:
    big = np.flatnonzero(forest.lengths > cap)
    if big.size and not allow:
        i = int(big[0])
        more = f" (and {big.size - 1} more)" if big.size > 1 else ""
        raise ValueError(
            f"trajectory {i} has {int(forest.lengths[i])} tokens, more than capacity_tokens="
            f"{cap}{more}; raise the capacity or pass allow_oversize=True to run it in a microbatch of its own"
        )
    return big


def check_plan_arguments(
    *, capacity_tokens: int, dp_size: int = 1, seed: int = 0, **options: Any
) -> None:
    """Check the arguments of :func:`plan_microbatches` (all but the forest) without planning:
    the same TypeError / ValueError naming the argument or option that planning would raise
    for them, so a caller can tell its user's bad settings from planning itself."""
    _check_arguments(capacity_tokens, dp_size, seed, options)


def plan_microbatches(
    forest: RolloutForest,
    *,
    capacity_tokens: int,
    dp_size: int = 1,
    seed: int = 0,
    **options: Any,
) -> MicrobatchPlan:
    """Plan microbatches, DP replicas and slots for ``forest`` (see the module docstring).

    Options: ``allow_oversize`` (default False: a trajectory longer than ``capacity_tokens``
    raises ValueError naming it; True: it runs in its own microbatch, together with the
    trajectories whose rows all lie on its path — in a trie its identical copies and its
    prefixes, oversize or not — which cost nothing more);
    ``strategies``
    (subset of ``natural``, ``contiguous``, ``tree``, ``greedy``, or one such name; default
    all); ``improve``
    (local search, default True); ``balance`` (balance moves, default True); ``work_slack``
    (fraction in [0, 1), default 0.0, see the module docstring); ``restarts`` (int >= 0, seeded
    perturb-and-improve rounds, default 0 — only they use ``seed``); ``effort`` (number >= 0,
    scales move budgets); ``max_layers_work`` (int >= 0, bound on K·n for the fixed-K contiguous
    DP); ``max_search_cells`` (int >= 0, default 4,000,000: bound on K·n for the greedy family
    and for the local search, restarts, fewer bins, balance and repair, whose state holds two int64
    ``[n, K]`` tables; a phase whose K could exceed it is skipped and named in the plan's
    ``skipped_phases``, see the module docstring). An unknown option raises TypeError, an illegal value ValueError naming the option;
    ``capacity_tokens`` must be an int in ``[1, 2**63 - 1]``, ``dp_size`` one in
    ``[1, MAX_DP_SIZE]`` (2**16) and ``seed`` an int
    ``>= 0`` (ValueError naming it, checked before any planning).

    Guarantees: each trajectory is in exactly one microbatch; no microbatch exceeds the
    capacity (except the copies of one oversize path with its prefixes, when allowed);
    every replica gets the same number of slots; the plan is a deterministic function of the inputs and ``seed``.
    """
    t0 = time.perf_counter()
    _check_forest(forest)
    opt = _check_arguments(capacity_tokens, dp_size, seed, options)
    families = opt["strategies"]
    cap, dp = int(capacity_tokens), int(dp_size)
    big = _oversize(forest, cap, bool(opt["allow_oversize"]))
    keep = np.ones(forest.num_trajectories, dtype=bool)
    keep[big] = False
    # The oversize microbatches (with the prefixes they hold for free) are fixed; the search
    # scores every plan with them.
    big_groups, fixed, absorbed = _oversize_groups(forest, big, keep)
    keep[absorbed] = False
    lv = _Leaves.of(forest, keep)
    n = lv.n
    natural = _natural(lv, cap)
    scores: dict[str, tuple[int, int, int, int]] = {}
    best_name, best_lab = "none", np.zeros(0, np.int64)  # nothing left to plan
    skipped: list[str] = []
    if n:
        best_name, best_lab = _search(
            lv, cap, dp, natural, families, opt, int(seed), scores, fixed, skipped
        )
    label, k = _canonical(best_lab)
    plan = _build_plan(
        forest, lv, label, k, (big, big_groups, fixed), cap, dp, natural, t0, best_name, scores
    )
    return replace(plan, skipped_phases=tuple(dict.fromkeys(skipped)))


_ALIGN_STEP, _ALIGN_STEPS, _ALIGN_STARTS = 0.001, 3, 1


def _aligned_starts(
    lv: _Leaves,
    cap: int,
    dp: int,
    k_target: int,
    work_limit: int,
    node_limit: int,
    budget: int,
    lower: int,
    max_cells: int | None = None,
) -> list[tuple[str, np.ndarray]]:
    """Starts for the imbalance repair with exactly ``k_target`` microbatches (``k_target`` plus
    the oversize ones a multiple of ``dp``): tree packings at a reduced capacity (smaller capacities give more, more even
    microbatches). The largest capacity ``c`` whose first-fit packing has >= ``k_target``
    microbatches is found by bisection; packings (first and best fit) at ``c·(1 − j·δ)``,
    j < _ALIGN_STEPS, are improved by the local search at their capacity and kept when they
    have ``k_target`` microbatches and total work <= ``work_limit``; returns the
    ``_ALIGN_STARTS`` with the least work, as (name, labels)."""

    def count(c: int) -> int:
        return int(_tree_pack(lv, c, False, node_limit).max()) + 1

    lo, hi = int(lv.lens.max()), cap  # invariant: count(lo) >= k_target > count(hi)
    if count(hi) >= k_target:
        lo = hi
    elif count(lo) < k_target:
        return []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) >= k_target:
            lo = mid
        else:
            hi = mid
    found: dict[bytes, tuple[int, str, np.ndarray]] = {}
    # Reduced capacities, largest first, never below the longest trajectory (0 at lo = 1).
    longest = int(lv.lens.max())
    caps = {max(int(lo * (1.0 - j * _ALIGN_STEP)), longest) for j in range(_ALIGN_STEPS)}
    for c in sorted(caps, reverse=True):
        for best_fit in (False, True):
            st0 = _tree_pack(lv, c, best_fit, node_limit)
            if max_cells is not None and (int(st0.max()) + 1) * lv.n > max_cells:
                continue  # its local-search state would exceed the bound
            st = _State(lv, st0, int(st0.max()) + 1, c)
            _improve(st, budget, -(-lower // c))
            lab, k = _canonical(st.label)
            total = int(st.works.sum())
            if k == k_target and total <= work_limit:
                name = f"tree-{'bfd' if best_fit else 'ffd'}@{c}"
                found.setdefault(lab.tobytes(), (total, name, lab))
    ranked = sorted(found.values(), key=lambda x: (x[0], x[1]))
    return [(name, lab) for _, name, lab in ranked[:_ALIGN_STARTS]]


_Cand = tuple[tuple[int, int, int, int], str, np.ndarray]


def _search(
    lv: _Leaves,
    cap: int,
    dp: int,
    natural: list[tuple[int, int]],
    families: set[str],
    opt: dict[str, Any],
    seed: int,
    scores: dict[str, tuple[int, int, int, int]],
    fixed: np.ndarray = _NO_FIXED,
    skipped: list[str] | None = None,
) -> tuple[str, np.ndarray]:
    """The chosen candidate (name, labels) of the fitting trajectories ``lv``; every score
    counts the ``fixed`` (oversize) microbatches too, so ``scores`` are the whole plan's. A
    phase whose ``[n, K]`` state could exceed ``max_search_cells`` is skipped and its name
    appended to ``skipped``."""
    n = lv.n
    skipped = [] if skipped is None else skipped

    def fits(phase: str, k: int) -> bool:  # the phase's [n, k] state within the bound
        if k * n <= opt["max_search_cells"]:
            return True
        skipped.append(phase)
        return False

    nf, fsum = int(fixed.size), int(fixed.sum())
    effort = float(opt["effort"])
    slack = float(opt["work_slack"])
    # The strict choice (work_slack = 0) as a strict call makes it, which the slack guarantees
    # refer to: a slack search's own pool differs (its K-aligned contiguous starts change the
    # plans the local search, fewer-bins and balance start from), so its least-work candidate
    # can have a larger slot-critical work than the strict plan's.
    strict_ref: tuple[str, np.ndarray, tuple[int, int, int, int]] | None = None
    if slack > 0 and dp > 1:
        s_name, s_lab = _search(
            lv, cap, dp, natural, families, {**opt, "work_slack": 0.0}, seed, {}, fixed, skipped
        )
        s_lab, s_k = _canonical(s_lab)
        strict_ref = (s_name, s_lab, _score_works(lv.works(s_lab, s_k), dp, fixed))
    lower = lower_bound_work(lv, cap)
    budget = int(max(50, 4 * n) * effort)  # local-search moves
    min_bins = max(1, -(-lower // cap))  # no partition has fewer microbatches
    pool: list[_Cand] = []
    seen: set[bytes] = set()

    def add(name: str, label: np.ndarray) -> None:
        lab, k = _canonical(label)
        key = lab.tobytes()
        if key in seen:
            return
        seen.add(key)
        sc = _score_works(lv.works(lab, k), dp, fixed)
        scores[name] = sc
        pool.append((sc, name, lab))

    def at_lower_bound() -> bool:  # no candidate can have less total work
        return bool(pool) and min(t[0][0] for t in pool) <= lower + fsum

    free: list[tuple[int, int]] = []
    if "natural" in families:
        add("natural", _ranges_to_labels(natural, n))
    if "contiguous" in families and not at_lower_bound():
        free = _contiguous_free(lv, cap)
        add("contiguous", _ranges_to_labels(free, n))
    if "tree" in families and not at_lower_bound():
        limit = int(2000 * effort)
        add("tree-ffd", _tree_pack(lv, cap, False, limit))
        add("tree-bfd", _tree_pack(lv, cap, True, limit))
    if "contiguous" in families and dp > 1 and (slack > 0 or not at_lower_bound()):
        # K aligned to dp_size, with the oversize microbatches (the fewest parts and the free
        # optimum's K, rounded up).
        kmin = _min_parts(lv, cap)
        ks = {_aligned(kmin, nf, dp), _aligned(max(len(free), 1), nf, dp)} - {len(free)}
        ks = {k for k in ks if k * n <= opt["max_layers_work"]}
        for k, parts in sorted(_contiguous_k(lv, cap, sorted(ks)).items()):
            add(f"contiguous-k{k}", _ranges_to_labels(parts, n))
    if (
        "greedy" in families
        and not at_lower_bound()
        and fits("greedy", min(int(t[2].max()) + 1 for t in pool) if pool else min_bins)
    ):
        add("greedy-leaf", _greedy_leaf(lv, cap, reverse=False))
        add("greedy-reverse", _greedy_leaf(lv, cap, reverse=True))
    if not pool:  # every allowed family was skipped (greedy alone, above the bound)
        add("natural", _ranges_to_labels(natural, n))
    pool.sort(key=lambda t: t[0])

    if opt["improve"] and pool[0][0][0] > lower + fsum:
        # The best start, and the best start of another family.
        picked = [pool[0]]
        fam0 = pool[0][1].split("-")[0]
        other = [c for c in pool[1:] if c[1].split("-")[0] != fam0]
        if other:
            picked.append(other[0])
        for _, name, lab in picked:
            if not fits("improve", int(lab.max()) + 1):
                continue
            st = _State(lv, lab, int(lab.max()) + 1, cap)
            _improve(st, budget, min_bins)
            add(name + "+ls", st.label)
        pool.sort(key=lambda t: t[0])
        restarts = int(opt["restarts"])
        if (
            restarts > 0
            and pool[0][0][0] > lower + fsum
            and fits("restarts", _kicked_bins(pool[0][2]))
        ):
            rng = np.random.default_rng(seed)
            _, name, lab = pool[0]
            for r in range(restarts):
                st = _State(lv, lab, int(lab.max()) + 1, cap)
                _kick(st, rng)
                _improve(st, budget, min_bins)
                add(f"{name}+r{r}", st.label)
            pool.sort(key=lambda t: t[0])

    # Fewer microbatches at the least work (the score's last key): the best plan's bins
    # dissolved into the others where that costs no work (a tree cut in halves whose prefix
    # both repeat leaves room: split unevenly, its small parts share bins with other trees).
    _, name, lab = pool[0]
    k0 = int(lab.max()) + 1
    if opt["improve"] and k0 > min_bins and fits("fewer_bins", k0):
        st = _State(lv, lab, k0, cap)
        if _fewer_bins(st, budget, min_bins):
            add(name + "+fb", st.label)
            pool.sort(key=lambda t: t[0])

    min_total = pool[0][0][0]
    # the work bound: (1 + slack) x the strict plan's work
    limit = int((min_total if strict_ref is None else strict_ref[2][0]) * (1.0 + slack))
    if opt["balance"] and dp > 1:
        # Zero-cost balance from the best starts; with slack, continue each with the budget
        # (so the slack result is never worse in slot-critical work than the strict one).
        bal_budget = int(max(20, n) * effort)
        rep_budget = int(max(20, n // 4) * effort)
        for i, (sc, name, lab) in enumerate([c for c in pool if c[0][0] == min_total][:2]):
            # _balance pads K to a multiple of dp; the slack call may pad once more.
            grown = _aligned(int(lab.max()) + 1, nf, dp) + (dp - 1 if slack > 0 and i == 0 else 0)
            if not fits("balance", grown):
                continue
            st = _State(lv, lab, int(lab.max()) + 1, cap)
            _balance(st, dp, bal_budget, sc[0] - fsum, fixed)
            add(name + "+bal", st.label)
            if slack > 0 and i == 0:
                _balance(st, dp, bal_budget, limit - fsum, fixed)
                add(name + "+bal+slack", st.label)
        if slack > 0 and fits("repair", _aligned(int(pool[0][2].max()) + 1, nf, dp)):
            # Imbalance repair within the work bound, from the least-work plan (K grown to a
            # multiple of dp_size) and from tree packings at reduced capacities whose K is one.
            # Aligned starts first; stop at the first repaired plan with every slot at or
            # below _REPAIR_GOAL and no larger slot-critical work than the strict choice's
            # (which also bounds the work: Σ over slots of the largest work >= total / dp).
            crit = min(pool, key=lambda t: t[0])[0][1]  # the strict choice's slot-critical work
            if strict_ref is not None:
                crit = min(crit, strict_ref[2][1])
            rep_limit = min(limit, dp * crit) - fsum
            k_target = _aligned(int(pool[0][2].max()) + 1, nf, dp)
            starts = _aligned_starts(
                lv,
                cap,
                dp,
                k_target,
                rep_limit,
                int(2000 * effort),
                budget,
                lower,
                opt["max_search_cells"],
            )
            starts.append((pool[0][1], pool[0][2]))
            for name, lab in starts:
                rep = _State(lv, lab, int(lab.max()) + 1, cap)
                _repair(rep, dp, rep_budget, rep_limit, crit, fixed)
                add(name + "+repair", rep.label)
                wx = _with_fixed(rep.works, fixed)
                if (
                    _crit(wx, dp) <= crit
                    and _slot_of_bins(wx, dp)[1].max(initial=0.0) <= _REPAIR_GOAL
                ):
                    break

    if strict_ref is not None:  # a candidate: some plan is never worse than it
        s_name = strict_ref[0]
        add(s_name + "+strict" if s_name in scores else s_name, strict_ref[1])
    strict_best = min(pool, key=lambda t: t[0])
    # no worse than this slot-critical work (the strict plan's, or less)
    crit_bound = (
        strict_best[0][1] if strict_ref is None else min(strict_best[0][1], strict_ref[2][1])
    )

    def rank(t: _Cand) -> tuple[Any, ...]:
        sc = t[0]
        if slack > 0:
            # Within the work bound and no worse than the strict choice in slot-critical work:
            # least excess slot imbalance (over _REPAIR_TAU) first, then the strict keys.
            worse = sc[0] > limit or sc[1] > crit_bound
            works = lv.works(t[2], int(t[2].max()) + 1)
            pen = float(_slot_penalty(works, dp, fixed=fixed)[0, 1]) if dp > 1 else 0.0
            return (worse, pen, sc[1], sc[2], sc[0], sc[3])
        return sc

    best = min(pool, key=rank)
    return best[1], best[2]


def _kicked_bins(label: np.ndarray) -> int:
    """The most bins :func:`_kick` can leave from ``label`` (canonical, bins 0..K-1): its two
    largest bins split into single trajectories."""
    counts = np.sort(np.bincount(label))
    return int(counts.size - min(counts.size, 2) + counts[-2:].sum())


def _kick(st: _State, rng: np.random.Generator) -> None:
    """Perturbation for restarts: two random microbatches are split into single trajectories
    (new bins); the following local search re-inserts them."""
    live = np.flatnonzero(st.works > 0)
    if live.size < 2:
        return
    chosen = rng.choice(live, size=2, replace=False)
    label = st.label.copy()
    freed = np.flatnonzero(np.isin(label, chosen))
    label[freed] = st.k + rng.permutation(freed.size)
    lab, k = _canonical(label)
    st.assign(_State(st.lv, lab, k, st.cap))


# ============================================================================ lower bound
@dataclass(frozen=True)
class IntervalTree:
    """The LCP-interval tree of a leaf order: internal nodes are the trie's branch points
    (plus a depth-0 root), leaves are the trajectories. Node ``v`` covers the leaf positions
    ``[lo[v], hi[v])`` and carries ``weight[v] = depth[v] − depth[parent[v]]`` rows, exactly the
    rows shared by all trajectories of its range (Σ weight = compact tokens). Leaf position ``p``
    is node ``leaf_node[p]``; internal nodes come first; ``parent = -1`` at the root."""

    depth: np.ndarray
    parent: np.ndarray
    weight: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    leaf_node: np.ndarray


def _interval_tree(lens: np.ndarray, adj: np.ndarray) -> IntervalTree:
    n = int(lens.shape[0])
    lens_l = lens.tolist()
    adj_l = adj.tolist()
    depth: list[int] = []
    lo: list[int] = []
    hi: list[int] = []
    parent: list[int] = []
    leaf_parent = [-1] * n
    stack: list[int] = []
    for p in range(n):
        child, is_leaf = p, True
        lval = adj_l[p] if p < n - 1 else 0
        while stack and depth[stack[-1]] > lval:
            top = stack.pop()
            hi[top] = p + 1
            if is_leaf:
                leaf_parent[child] = top
            else:
                parent[child] = top
            child, is_leaf = top, False
        if stack and depth[stack[-1]] == lval:
            top = stack[-1]
        else:
            top = len(depth)
            depth.append(lval)
            lo.append(lo[child] if not is_leaf else p)
            hi.append(p + 1)
            parent.append(-1)
            stack.append(top)
        if is_leaf:
            leaf_parent[child] = top
        else:
            parent[child] = top
    for top in stack:
        hi[top] = n
    m = len(depth)
    d = np.asarray(depth + lens_l, dtype=np.int64)
    par = np.asarray(parent + leaf_parent, dtype=np.int64)
    w = np.where(par >= 0, d - d[np.maximum(par, 0)], d)
    lo_a = np.asarray(lo + list(range(n)), dtype=np.int64)
    hi_a = np.asarray(hi + list(range(1, n + 1)), dtype=np.int64)
    return IntervalTree(d, par, w, lo_a, hi_a, np.arange(m, m + n, dtype=np.int64))


def lcp_interval_tree(forest: RolloutForest) -> IntervalTree:
    """The LCP-interval tree of ``forest``'s leaf order (positions index ``forest.leaf_order``)."""
    return _interval_tree(
        np.asarray(forest.lengths, np.int64)[forest.leaf_order],
        np.asarray(forest.adjacent_lcp, np.int64),
    )


def lower_bound_work(lv: _Leaves | RolloutForest, cap: int) -> int:
    """A lower bound on the total work of any partition into microbatches of <= ``cap`` rows.

    A bin that touches node ``v`` holds ``depth(v)`` rows of its path, so at most
    ``cap − depth(v)`` rows below it: at least ``⌈below(v) / (cap − depth(v))⌉`` bins touch v
    (and at least as many as touch any child); each pays ``weight(v)`` rows.

    TypeError when ``lv`` is not a :class:`RolloutForest` (or the planner's leaf view);
    ValueError naming ``capacity_tokens`` unless ``1 <= cap <= 2**63 - 1``."""
    if not isinstance(lv, _Leaves):
        _check_forest(lv)
    cap = _check_int("capacity_tokens", cap, 1)
    if isinstance(lv, RolloutForest):
        lv = _Leaves.of(lv)
    if lv.n == 0:
        return 0
    t = _interval_tree(lv.lens, lv.adj)
    below = lv.h[t.hi] - lv.g[t.lo] - t.depth
    room = cap - t.depth
    need = np.where(room > 0, -(-below // np.maximum(room, 1)), 1)
    need = np.maximum(need, 1)
    for v in np.argsort(-t.depth, kind="stable").tolist():
        pv = int(t.parent[v])
        if pv >= 0 and need[v] > need[pv]:
            need[pv] = need[v]
    return int((t.weight * need).sum())


def _build_plan(
    forest: RolloutForest,
    lv: _Leaves,
    label: np.ndarray,
    k: int,
    oversize: tuple[np.ndarray, list[np.ndarray], np.ndarray],
    cap: int,
    dp: int,
    natural: list[tuple[int, int]],
    t0: float,
    strategy: str,
    scores: dict[str, tuple[int, int, int, int]],
) -> MicrobatchPlan:
    """The plan of the fitting trajectories' labels and the ``oversize`` microbatches
    ``(oversize trajectories, groups, works)`` of :func:`_oversize_groups`."""
    big, big_groups, big_works = oversize
    order = np.argsort(label, kind="stable")
    counts = np.bincount(label, minlength=k) if k else np.zeros(0, np.int64)
    groups = [lv.traj[g] for g in np.split(order, np.cumsum(counts)[:-1])] if k else []
    groups += big_groups
    works = np.concatenate([lv.works(label, k), big_works]).astype(np.int64)
    slot, replica, num_slots = place_microbatches(works, dp)
    table = {
        (int(s), int(r)): Microbatch(g.astype(np.int64), int(w), int(r), int(s))
        for g, w, s, r in zip(groups, works.tolist(), slot.tolist(), replica.tolist())
    }
    empty = np.zeros(0, np.int64)
    mbs = tuple(
        table.get((s, r), Microbatch(empty, 0, r, s)) for s in range(num_slots) for r in range(dp)
    )
    rep = np.zeros(dp, dtype=np.int64)
    np.add.at(rep, replica, works)
    sw = np.zeros((num_slots, dp), dtype=np.int64)
    sw[slot, replica] = works
    return MicrobatchPlan(
        microbatches=mbs,
        num_slots=num_slots,
        dp_size=dp,
        capacity_tokens=cap,
        total_compact_tokens=int(works.sum()),
        slot_critical_work=int(sw.max(axis=1).sum()) if num_slots else 0,
        replica_work=rep,
        natural_partition=_natural_full(forest, lv, natural, big, cap),
        planning_seconds=time.perf_counter() - t0,
        strategy=strategy,
        candidates=scores,
    )


def _oversize_groups(
    forest: RolloutForest, big: np.ndarray, fitting: np.ndarray | None = None
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The microbatches of the oversize trajectories ``big``: ``(groups, works, absorbed)``.

    One group per *maximal* oversize path (one that is no prefix of another oversize path, in
    this layout): its copies and every oversize trajectory that is a prefix of it share its
    rows — the first such path in row order when there are several. Its work is the path's
    length; groups are ordered by their first oversize trajectory index. With ``fitting`` (a
    bool mask of trajectories within the capacity), each fitting trajectory whose rows all lie
    on a maximal oversize path joins that group the same way — it adds no row there;
    ``absorbed`` lists them (int64, ascending). Members of a group are in leaf order."""
    empty = np.zeros(0, np.int64)
    if big.size == 0:
        return [], empty, empty
    # A trajectory's last row determines its whole path from the root. In preorder, a row's
    # descendants follow it directly: a path is maximal unless the next one passes through it.
    last_all = forest.semantic_rows[forest.row_offsets[1:] - 1]
    rows = np.unique(last_all[big])  # ascending
    paths = rows[np.append(~forest.is_ancestor_or_self(rows[:-1], rows[1:]), True)]

    def onto(traj: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask, path index): the first maximal path through each trajectory's last row."""
        r = last_all[traj]
        j = np.searchsorted(paths, r, side="left")
        ok = j < paths.size
        ok[ok] = forest.is_ancestor_or_self(r[ok], paths[j[ok]])
        return ok, j

    member = big.astype(np.int64)
    group = onto(member)[1]  # every oversize trajectory lies on a maximal path
    absorbed = empty
    if fitting is not None:
        cand = np.flatnonzero(fitting).astype(np.int64)
        ok, j = onto(cand)
        absorbed = cand[ok]
        member = np.concatenate([member, absorbed])
        group = np.concatenate([group, j[ok]])
    order = np.lexsort((forest.leaf_position[member], group))
    parts = np.split(member[order], np.cumsum(np.bincount(group, minlength=paths.size))[:-1])
    first = np.full(paths.size, forest.num_trajectories, np.int64)
    np.minimum.at(first, group[: big.size], big)
    rank = np.argsort(first, kind="stable")
    works = (forest.depth[paths] + 1).astype(np.int64)
    return [parts[g] for g in rank], works[rank], absorbed


def _natural_full(
    forest: RolloutForest,
    lv: _Leaves,
    natural: list[tuple[int, int]],
    big: np.ndarray,
    cap: int,
) -> tuple[np.ndarray, ...]:
    """P0 of the whole forest (oversize trajectories are parts of their own)."""
    if big.size:
        full = _Leaves.of(forest)
        return tuple(full.traj[a:b].copy() for a, b in _natural(full, cap))
    return tuple(lv.traj[a:b].copy() for a, b in natural)


# ============================================================================ helpers
def compact_work(forest: RolloutForest, trajectories: Sequence[int] | np.ndarray) -> int:
    """Compact rows of the trie of the given trajectories (any order; a repeated index counts
    once)."""
    _check_forest(forest)
    idx = _indices("trajectories", trajectories, forest.num_trajectories)
    return int(_partition_works(forest, [idx])[0])


def _indices(name: str, part: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """``part`` as int64 trajectory indices; ValueError naming ``name`` unless it is a 1-D
    integer array with every index in ``[0, n)``."""
    idx = np.asarray(part)
    bad_dtype = idx.size and (idx.dtype.kind not in "iu" or idx.dtype == np.bool_)
    if idx.ndim != 1 or bad_dtype or holds_bool(part):
        raise ValueError(f"{name}: expected a 1-D array of integer trajectory indices")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"{name}: index out of range for {n} trajectories")
    return idx.astype(np.int64)


def partition_works(
    forest: RolloutForest, parts: Sequence[Sequence[int] | np.ndarray]
) -> np.ndarray:
    """int64 ``[len(parts)]``: the compact rows of each part's trie, ``compact_work`` of every
    part in one pass over the forest (parts may overlap; a repeated index counts once per part).
    ValueError naming ``parts[i]`` for an index array that is not 1-D integer or out of range."""
    _check_forest(forest)
    n = forest.num_trajectories
    if isinstance(parts, str | bytes) or not hasattr(parts, "__iter__"):
        raise TypeError(f"parts: expected a sequence of index arrays, got {type(parts).__name__}")
    return _partition_works(forest, [_indices(f"parts[{i}]", p, n) for i, p in enumerate(parts)])


def _partition_works(forest: RolloutForest, arrays: list[np.ndarray]) -> np.ndarray:
    """:func:`partition_works` of checked int64 index arrays."""
    k = len(arrays)
    sizes = np.array([a.size for a in arrays], dtype=np.int64)
    if not k or not sizes.sum():
        return np.zeros(k, dtype=np.int64)
    lab = np.repeat(np.arange(k, dtype=np.int64), sizes)
    pos = np.asarray(forest.leaf_position, dtype=np.int64)[np.concatenate(arrays)]
    order = np.lexsort((pos, lab))
    lab, pos = lab[order], pos[order]
    first = np.ones(lab.size, dtype=bool)
    first[1:] = (lab[1:] != lab[:-1]) | (pos[1:] != pos[:-1])
    lab, pos = lab[first], pos[first]
    lens = np.asarray(forest.lengths, dtype=np.int64)[np.asarray(forest.leaf_order)][pos]
    works = np.zeros(k, dtype=np.int64)
    np.add.at(works, lab, lens)
    same = np.flatnonzero(lab[:-1] == lab[1:])
    if same.size:
        lcp = RangeMin(np.asarray(forest.adjacent_lcp, dtype=np.int64)).query(
            pos[same], pos[same + 1]
        )
        np.subtract.at(works, lab[same], lcp)
    return works


def natural_partition(forest: RolloutForest, capacity_tokens: int) -> list[np.ndarray]:
    """P0 as trajectory-index arrays in leaf order (a part exceeds the capacity only when it is
    a single oversize trajectory)."""
    _check_forest(forest)
    cap = _check_int("capacity_tokens", capacity_tokens, 1)
    lv = _Leaves.of(forest)
    return [lv.traj[a:b].copy() for a, b in _natural(lv, cap)]


def optimal_contiguous_partition(
    forest: RolloutForest, capacity_tokens: int, num_parts: int | None = None
) -> tuple[int, list[np.ndarray]] | None:
    """Exact minimum-work partition of the leaf order into contiguous ranges of work at most
    ``capacity_tokens`` (exactly ``num_parts`` ranges when given). Returns
    ``(total_work, parts)``, or None when no such partition exists."""
    _check_forest(forest)
    cap = _check_int("capacity_tokens", capacity_tokens, 1)
    if num_parts is not None:
        _check_int("num_parts", num_parts, 0)
    lv = _Leaves.of(forest)
    if lv.n == 0:
        return (0, []) if num_parts in (None, 0) else None
    if int(lv.lens.max()) > cap:
        return None
    if num_parts is None:
        parts = _contiguous_free(lv, cap)
    else:
        got = _contiguous_k(lv, cap, [num_parts])
        if num_parts not in got:
            return None
        parts = got[num_parts]
    total = sum(lv.range_work(a, b) for a, b in parts)
    return total, [lv.traj[a:b].copy() for a, b in parts]
