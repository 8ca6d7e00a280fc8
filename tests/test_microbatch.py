"""Microbatch / DP / slot planner: invariants, exact contiguous search vs brute force, lower
bound vs brute-force optimum, determinism, capacity edge cases, oversize, CP-SAT smoke test."""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_verl.tree import (
    Microbatch,
    MicrobatchPlan,
    RolloutForest,
    check_plan_arguments,
    plan_microbatches,
)
from harts_verl.tree.microbatch import (
    MAX_DP_SIZE,
    compact_work,
    lcp_interval_tree,
    lower_bound_work,
    natural_partition,
    optimal_contiguous_partition,
    partition_works,
    place_microbatches,
    slot_imbalance,
    validate_options,
)

tokens = st.integers(min_value=0, max_value=3)


@st.composite
def forests(draw, max_traj=12, max_len=16):
    """Random forests with much sharing: new trajectories extend/fork earlier ones."""
    n = draw(st.integers(1, max_traj))
    seqs: list[list[int]] = []
    for _ in range(n):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            cut = draw(st.integers(0, len(base)))
            tail = draw(st.lists(tokens, min_size=0 if cut else 1, max_size=max_len))
            seq = base[:cut] + tail or [draw(tokens)]
        else:
            seq = draw(st.lists(tokens, min_size=1, max_size=max_len))
        seqs.append(seq)
    return RolloutForest.from_sequences(seqs)


def naive_work(forest: RolloutForest, idx) -> int:
    """Compact rows of a subset, by building its forest."""
    idx = np.asarray(idx, dtype=np.int64)
    return forest.subset(idx).num_compact_tokens if idx.size else 0


def check_plan(forest: RolloutForest, plan: MicrobatchPlan, cap: int, dp: int) -> None:
    n = forest.num_trajectories
    seen = np.zeros(n, dtype=np.int64)
    assert plan.dp_size == dp
    assert len(plan.microbatches) == plan.num_slots * dp
    for k, mb in enumerate(plan.microbatches):
        assert isinstance(mb, Microbatch)
        assert (mb.slot, mb.replica) == (k // dp, k % dp)
        assert mb.trajectories.dtype == np.int64
        seen[mb.trajectories] += 1
        assert mb.compact_tokens == naive_work(forest, mb.trajectories)
        if mb.compact_tokens > cap:  # only an oversize path with its copies and prefixes
            toks = [forest.tokens_of(int(i)) for i in mb.trajectories]
            longest = max(toks, key=len)
            assert mb.compact_tokens == longest.shape[0]
            assert all(np.array_equal(longest[: t.shape[0]], t) for t in toks)
        # trajectories listed in leaf order
        pos = np.empty(n, dtype=np.int64)
        pos[forest.leaf_order] = np.arange(n)
        assert np.all(np.diff(pos[mb.trajectories]) > 0)
    np.testing.assert_array_equal(seen, np.ones(n, dtype=np.int64))
    sw = plan.slot_work
    assert sw.shape == (plan.num_slots, dp)
    assert plan.total_compact_tokens == int(sw.sum())
    assert plan.slot_critical_work == int(sw.max(axis=1).sum()) if plan.num_slots else True
    np.testing.assert_array_equal(plan.replica_work, sw.sum(axis=0))
    assert (plan.slot_imbalance() >= 0).all() and (plan.slot_imbalance() <= 1).all()
    # Layout (place_microbatches): the works, sorted decreasingly, fill the slots dp at a time,
    # so there are ceil(K / dp) slots, every work in a slot is >= every work in the next slot,
    # and the padding (empty, work-0) microbatches all sit in the last slot, fewer than dp.
    k = plan.num_microbatches
    assert plan.num_slots == -(-k // dp)
    for mb in plan.microbatches:
        assert (mb.compact_tokens == 0) == (mb.trajectories.size == 0)
        if mb.trajectories.size == 0:
            assert mb.slot == plan.num_slots - 1
    if plan.num_slots > 1:
        assert np.all(sw[:-1].min(axis=1) >= sw[1:].max(axis=1))
    # Inside a slot, larger works go to replicas with less cumulative work before the slot
    # (ties: lower replica id): along that replica order the slot's works do not increase.
    cum = np.zeros(dp, dtype=np.int64)
    for s in range(plan.num_slots):
        along = sw[s, np.lexsort((np.arange(dp), cum))]
        assert np.all(np.diff(along) <= 0), (s, cum, sw[s])
        cum += sw[s]
    assert np.array_equal(plan.assignment(n) >= 0, np.ones(n, bool))
    # natural partition covers everything once, contiguous in leaf order
    flat = np.concatenate(plan.natural_partition) if plan.natural_partition else np.zeros(0)
    np.testing.assert_array_equal(flat, forest.leaf_order)


@settings(max_examples=100, deadline=None)
@given(forests(), st.integers(0, 40), st.sampled_from([1, 2, 3, 8]))
def test_plan_invariants(forest, extra, dp):
    cap = int(forest.lengths.max()) + extra
    plan = plan_microbatches(forest, capacity_tokens=cap, dp_size=dp)
    check_plan(forest, plan, cap, dp)
    lb = lower_bound_work(forest, cap)
    assert forest.num_compact_tokens <= lb <= plan.total_compact_tokens
    # never worse than the natural partition or the exact contiguous optimum (both candidates)
    nat = sum(naive_work(forest, p) for p in natural_partition(forest, cap))
    best_contig = optimal_contiguous_partition(forest, cap)
    assert best_contig is not None
    assert plan.total_compact_tokens <= min(nat, best_contig[0])


@settings(max_examples=60, deadline=None)
@given(forests(max_traj=8), st.integers(0, 30), st.sampled_from([1, 2, 4]))
def test_slack_mode_invariants(forest, extra, dp):
    cap = int(forest.lengths.max()) + extra
    strict = plan_microbatches(forest, capacity_tokens=cap, dp_size=dp)
    slack = plan_microbatches(forest, capacity_tokens=cap, dp_size=dp, work_slack=0.05)
    check_plan(forest, slack, cap, dp)
    assert slack.total_compact_tokens <= strict.total_compact_tokens * 1.05 + 1e-9
    assert slack.slot_critical_work <= strict.slot_critical_work


def _all_contiguous(n: int):
    """Every composition of range(n) into contiguous parts, as cut lists."""
    for mask in range(1 << max(n - 1, 0)):
        cuts = [c + 1 for c in range(n - 1) if mask >> c & 1]
        yield [0, *cuts, n]


@settings(max_examples=100, deadline=None)
@given(forests(max_traj=9), st.integers(0, 25))
def test_exact_contiguous_search_equals_brute_force(forest, extra):
    cap = int(forest.lengths.max()) + extra
    order = forest.leaf_order
    n = forest.num_trajectories
    best_any: int | None = None
    best_k: dict[int, int] = {}
    for bounds in _all_contiguous(n):
        parts = [order[a:b] for a, b in itertools.pairwise(bounds)]
        works = [naive_work(forest, p) for p in parts]
        if max(works) > cap:
            continue
        total = sum(works)
        best_any = total if best_any is None else min(best_any, total)
        k = len(parts)
        best_k[k] = min(best_k.get(k, total), total)
    got = optimal_contiguous_partition(forest, cap)
    assert got is not None and best_any is not None
    assert got[0] == best_any
    assert got[0] == sum(naive_work(forest, p) for p in got[1])
    for k in range(1, n + 1):
        res = optimal_contiguous_partition(forest, cap, num_parts=k)
        if k in best_k:
            assert res is not None and res[0] == best_k[k] and len(res[1]) == k
            assert all(naive_work(forest, p) <= cap for p in res[1])
        else:
            assert res is None


def _set_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
        yield [[first], *part]


@settings(max_examples=60, deadline=None)
@given(forests(max_traj=6, max_len=10), st.integers(0, 12))
def test_lower_bound_and_optimum_vs_all_set_partitions(forest, extra):
    cap = int(forest.lengths.max()) + extra
    n = forest.num_trajectories
    opt = min(
        sum(naive_work(forest, p) for p in part)
        for part in _set_partitions(list(range(n)))
        if all(naive_work(forest, p) <= cap for p in part)
    )
    assert lower_bound_work(forest, cap) <= opt
    plan = plan_microbatches(forest, capacity_tokens=cap)
    assert plan.total_compact_tokens >= opt
    # tiny instances: the planner finds the optimum
    assert plan.total_compact_tokens == opt


@settings(max_examples=50, deadline=None)
@given(forests())
def test_interval_tree_weights(forest):
    t = lcp_interval_tree(forest)
    assert int(t.weight.sum()) == forest.num_compact_tokens
    n = forest.num_trajectories
    np.testing.assert_array_equal(t.lo[t.leaf_node], np.arange(n))
    for p in range(n):  # path weights sum to the trajectory length
        v, s = int(t.leaf_node[p]), 0
        while v >= 0:
            assert t.lo[v] <= p < t.hi[v]
            s += int(t.weight[v])
            v = int(t.parent[v])
        assert s == forest.lengths[forest.leaf_order[p]]


def test_compact_work_matches_subset():
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5], [2, 2], [1, 2, 3, 9]])
    for r in range(1, 6):
        for idx in itertools.combinations(range(5), r):
            assert compact_work(f, list(idx)) == naive_work(f, list(idx))
            assert compact_work(f, list(reversed(idx))) == naive_work(f, list(idx))


@settings(max_examples=60, deadline=None)
@given(forests(), st.data())
def test_partition_works_equal_each_parts_trie(forest, data):
    """partition_works: every part's work is the row count of its own trie (overlapping parts,
    repeated and unsorted indices, empty parts), in one pass."""
    n = forest.num_trajectories
    parts = data.draw(st.lists(st.lists(st.integers(0, n - 1), max_size=2 * n), max_size=5))
    works = partition_works(forest, [np.asarray(p, dtype=np.int64) for p in parts])
    assert works.dtype == np.int64 and works.shape == (len(parts),)
    assert works.tolist() == [naive_work(forest, sorted(set(p))) for p in parts]
    with pytest.raises(ValueError, match=r"parts\[1\]: index out of range"):
        partition_works(forest, [[0], [n]])
    with pytest.raises(ValueError, match=r"parts\[0\]: expected a 1-D"):
        partition_works(forest, [[[0]]])


@settings(max_examples=30, deadline=None)
@given(forests(), st.integers(0, 10_000))
def test_deterministic(forest, seed):
    cap = int(forest.lengths.max()) + 5
    for opts in ({}, {"restarts": 2}):
        a = plan_microbatches(forest, capacity_tokens=cap, dp_size=3, seed=seed, **opts)
        b = plan_microbatches(forest, capacity_tokens=cap, dp_size=3, seed=seed, **opts)
        assert a.strategy == b.strategy and a.candidates == b.candidates
        assert len(a.microbatches) == len(b.microbatches)
        for x, y in zip(a.microbatches, b.microbatches):
            assert (x.slot, x.replica, x.compact_tokens) == (y.slot, y.replica, y.compact_tokens)
            np.testing.assert_array_equal(x.trajectories, y.trajectories)
        check_plan(forest, a, cap, 3)


def _disjoint(n: int, length: int) -> RolloutForest:
    return RolloutForest.from_sequences([[i + 1] + [0] * (length - 1) for i in range(n)])


def test_capacity_equal_to_one_trajectory():
    # No sharing and capacity = one trajectory: every trajectory alone.
    f = _disjoint(10, 7)
    plan = plan_microbatches(f, capacity_tokens=7, dp_size=4)
    check_plan(f, plan, 7, 4)
    assert plan.num_microbatches == 10 and plan.num_slots == 3
    assert plan.total_compact_tokens == 70
    # With sharing: a shared prefix still cannot be packed beyond capacity.
    g = RolloutForest.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [9, 9, 9, 9]])
    plan = plan_microbatches(g, capacity_tokens=4)
    check_plan(g, plan, 4, 1)
    assert plan.total_compact_tokens == 16


def test_capacity_at_least_whole_forest():
    f = RolloutForest.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [7, 8]])
    c = f.num_compact_tokens
    for cap in (c, c + 1, 10**9):
        plan = plan_microbatches(f, capacity_tokens=cap)
        check_plan(f, plan, cap, 1)
        assert plan.num_microbatches == 1 and plan.total_compact_tokens == c
        plan8 = plan_microbatches(f, capacity_tokens=cap, dp_size=8)
        check_plan(f, plan8, cap, 8)
        assert plan8.total_compact_tokens == c and plan8.num_slots == 1


def test_empty_forest():
    f = RolloutForest.from_sequences([])
    plan = plan_microbatches(f, capacity_tokens=10, dp_size=2)
    assert plan.num_slots == 0 and plan.microbatches == () and plan.total_compact_tokens == 0


def test_oversize_raises_or_runs_alone():
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [1, 2, 9]])
    with pytest.raises(ValueError, match=r"trajectory 1 .*7 tokens"):
        plan_microbatches(f, capacity_tokens=5)
    plan = plan_microbatches(f, capacity_tokens=5, allow_oversize=True, dp_size=2)
    check_plan(f, plan, 5, 2)
    # Trajectory 0 is a prefix of the oversize trajectory 1: it rides along for free.
    alone = [mb for mb in plan.microbatches if 1 in mb.trajectories.tolist()]
    assert len(alone) == 1 and alone[0].trajectories.tolist() == [0, 1]
    assert alone[0].compact_tokens == 7
    assert plan.total_compact_tokens == 7 + naive_work(f, [2])
    assert plan.strategy in plan.candidates
    only = plan_microbatches(f, capacity_tokens=2, allow_oversize=True)  # nothing to search
    check_plan(f, only, 2, 1)
    assert only.strategy == "none" and only.num_microbatches == 2


def test_bad_arguments():
    f = RolloutForest.from_sequences([[1, 2], [1, 3]])
    with pytest.raises(ValueError, match="capacity_tokens"):
        plan_microbatches(f, capacity_tokens=0)
    with pytest.raises(ValueError, match="dp_size"):
        plan_microbatches(f, capacity_tokens=5, dp_size=0)
    with pytest.raises(TypeError, match="unknown option"):
        plan_microbatches(f, capacity_tokens=5, nonsense=1)
    with pytest.raises(ValueError, match="strategies"):
        plan_microbatches(f, capacity_tokens=5, strategies=["magic"])
    with pytest.raises(TypeError, match="RolloutForest"):
        plan_microbatches([[1, 2]], capacity_tokens=5)  # type: ignore[arg-type]
    # a DP world past MAX_DP_SIZE would allocate bins and repair arrays per replica
    with pytest.raises(ValueError, match=r"dp_size: expected an int <= 65536"):
        plan_microbatches(f, capacity_tokens=5, dp_size=2**40)
    assert MAX_DP_SIZE == 2**16
    with pytest.raises(ValueError, match="dp_size"):
        place_microbatches(np.array([3, 2]), 0)
    with pytest.raises(ValueError, match="works"):
        place_microbatches(np.array([3.5, 2.0]), 2)
    with pytest.raises(ValueError, match="trajectories"):
        compact_work(f, [True, 1])  # a bool among ints (numpy would read it as 1)
    with pytest.raises(ValueError, match="works"):
        place_microbatches([True, 3], 1)


@pytest.mark.parametrize("name", ["work_slack", "effort"])
def test_an_int_past_float_range_is_named(name):
    """``10**400`` raised OverflowError from float(); it is a ValueError naming the option, in
    the planner and in the config-time check."""
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4], [5, 6]])
    with pytest.raises(ValueError, match=name):
        plan_microbatches(f, capacity_tokens=4, **{name: 10**400})
    with pytest.raises(ValueError, match=name):
        validate_options({name: 10**400})


@pytest.mark.parametrize("seed", [-1, -(2**70), 1.0, True, None])
def test_bad_seed_is_refused_up_front(seed):
    """A negative seed used to pass the check and fail (or not) deep in numpy, depending on
    whether restarts ran: it is refused before any planning, whatever the forest."""
    easy = RolloutForest.from_sequences([[1, 2], [3, 4]])
    hard = RolloutForest.from_sequences(
        [
            [2, 2, 1, 2, 2, 1, 2],
            [2, 1, 2, 0, 1],
            [2, 1, 1, 0, 1, 1],
            [2, 0, 2, 1, 1, 2],
            [0, 0, 2, 1, 1],
            [2, 1, 0],
            [0, 0, 2, 1, 0, 0, 1],
        ]
    )
    for f, cap in ((easy, 2), (hard, 11)):
        with pytest.raises(ValueError, match="seed"):
            plan_microbatches(f, capacity_tokens=cap, seed=seed, restarts=1)
    # a huge non-negative seed is a valid numpy seed
    assert plan_microbatches(hard, capacity_tokens=11, seed=2**70, restarts=1).num_slots >= 1


@pytest.mark.parametrize("cap", [2**63, 2**64, 2**70])
def test_capacity_beyond_int64_is_a_value_error(cap):
    """Capacities past int64 raised OverflowError from numpy; they are refused naming the field
    (2**63 - 1 still plans)."""
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4], [5, 6], [5, 7, 8]])
    calls = (
        lambda: plan_microbatches(f, capacity_tokens=cap),
        lambda: plan_microbatches(f, capacity_tokens=cap, dp_size=2, work_slack=0.1),
        lambda: lower_bound_work(f, cap),
        lambda: optimal_contiguous_partition(f, cap),
        lambda: natural_partition(f, cap),
    )
    for call in calls:
        with pytest.raises(ValueError, match="capacity_tokens"):
            call()
    with pytest.raises(ValueError, match="dp_size"):
        plan_microbatches(f, capacity_tokens=4, dp_size=cap)
    top = 2**63 - 1
    assert plan_microbatches(f, capacity_tokens=top, dp_size=2).total_compact_tokens == 8
    assert lower_bound_work(f, top) == optimal_contiguous_partition(f, top)[0] == 8


def test_lower_bound_work_needs_a_forest():
    with pytest.raises(TypeError, match="forest"):
        lower_bound_work([[1, 2]], 3)  # type: ignore[arg-type]


def test_assignment_checks_its_length():
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4], [5]])
    plan = plan_microbatches(f, capacity_tokens=4)
    assert plan.assignment().shape == (3,) and (plan.assignment() >= 0).all()
    padded = plan.assignment(5)  # longer is fine: indices no microbatch holds get -1
    np.testing.assert_array_equal(padded[:3], plan.assignment())
    np.testing.assert_array_equal(padded[3:], [-1, -1])
    for bad in (2, 0):
        with pytest.raises(ValueError, match="num_trajectories"):
            plan.assignment(bad)
    for bad in (-1, 3.0, True):
        with pytest.raises(ValueError, match="num_trajectories"):
            plan.assignment(bad)  # type: ignore[arg-type]


def test_each_strategy_family_alone_is_valid():
    rng = np.random.default_rng(0)
    seqs = []
    for g in range(6):
        prompt = [g + 1, *rng.integers(0, 5, 30).tolist()]
        for _ in range(5):
            seqs.append(prompt + rng.integers(0, 5, int(rng.integers(5, 40))).tolist())
    f = RolloutForest.from_sequences(seqs)
    cap = 120
    for fam in ("natural", "contiguous", "tree", "greedy"):
        plan = plan_microbatches(f, capacity_tokens=cap, dp_size=4, strategies=[fam])
        check_plan(f, plan, cap, 4)
        assert plan.strategy.startswith(fam)


def test_placement_sorted_slots_and_lpt():
    works = np.array([5, 9, 1, 7, 3, 8, 2])
    slot, replica, num_slots = place_microbatches(works, 3)
    assert num_slots == 3
    # slot 0 holds the three largest, slot 2 the smallest
    assert sorted(works[slot == 0].tolist()) == [7, 8, 9]
    assert works[slot == 2].tolist() == [1]
    for s in range(num_slots):
        assert len(set(replica[slot == s].tolist())) == (slot == s).sum()


def test_placement_and_partition_works_refuse_bad_arguments():
    """uint64 works past int64 are refused (they would wrap negative and sort last); a
    ``parts`` that is no sequence is named."""
    with pytest.raises(ValueError, match=r"works: expected .* < 2\*\*63"):
        place_microbatches(np.array([5, 2**63 + 1], dtype=np.uint64), 1)
    slot, _, _ = place_microbatches(np.array([5, 2**63 - 1], dtype=np.uint64), 1)
    assert slot.tolist() == [1, 0]  # the larger work first
    f = RolloutForest.from_sequences([[1, 2], [1, 3]])
    with pytest.raises(TypeError, match="parts: expected a sequence of index arrays, got int"):
        partition_works(f, 5)


def test_slot_imbalance_definition():
    f = _disjoint(4, 5)
    plan = plan_microbatches(f, capacity_tokens=5, dp_size=4)
    np.testing.assert_allclose(plan.slot_imbalance(), [0.0])
    plan = plan_microbatches(f, capacity_tokens=5, dp_size=8)
    # one slot: four replicas with 5, four empty -> (5 - 2.5) / 5
    np.testing.assert_allclose(plan.slot_imbalance(), [0.5])
    s = plan.summary()
    assert s["slot_imbalance_p95"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="slot_work"):  # not an OverflowError
        slot_imbalance([[10**400, 1]])


def _load_benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "planner.py"
    spec = importlib.util.spec_from_file_location("planner_benchmark", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


def test_cpsat_baseline_tiny_instance_matches_brute_force():
    pytest.importorskip("ortools")
    bench = _load_benchmark()
    f = RolloutForest.from_sequences(
        [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 8, 8], [9, 9, 9], [9, 9, 1]]
    )
    cap = 7
    opt = min(
        sum(naive_work(f, p) for p in part)
        for part in _set_partitions(list(range(6)))
        if all(naive_work(f, p) <= cap for p in part)
    )
    res = bench.cpsat_partition(f, cap, time_limit=2.0)
    assert res["status"] == "OPTIMAL"
    assert res["objective"] == opt
    assert sum(naive_work(f, b) for b in res["bins"]) == opt
    assert plan_microbatches(f, capacity_tokens=cap).total_compact_tokens == opt


def test_range_min_fallback_matches_dense(monkeypatch):
    """Above the dense-matrix size the planner uses sparse-table LCPs: same plans."""
    import harts_verl.tree.microbatch as mb

    rng = np.random.default_rng(3)
    seqs = []
    for g in range(5):
        prompt = [g + 10, *rng.integers(0, 3, 20).tolist()]
        for _ in range(8):
            seqs.append(prompt + rng.integers(0, 3, int(rng.integers(3, 40))).tolist())
    f = RolloutForest.from_sequences(seqs)
    dense = plan_microbatches(f, capacity_tokens=90, dp_size=4, work_slack=0.02)
    monkeypatch.setattr(mb, "_DENSE_LCP_MAX", 0)
    sparse = plan_microbatches(f, capacity_tokens=90, dp_size=4, work_slack=0.02)
    check_plan(f, sparse, 90, 4)
    assert dense.candidates == sparse.candidates
    assert [m.trajectories.tolist() for m in dense.microbatches] == [
        m.trajectories.tolist() for m in sparse.microbatches
    ]


@pytest.mark.parametrize("swap_pairs", [None, 50])
def test_slack_repair_aligns_slots_within_budget(monkeypatch, swap_pairs):
    """With work_slack the imbalance repair may spend up to the bound: capacity and the work
    bound hold, slot-critical work never exceeds the strict plan's, and the within-slot
    imbalance does not get worse than the strict plan's; also with the swap screen forced to
    thin its pieces (``swap_pairs``)."""
    import harts_verl.tree.microbatch as mb
    from harts_verl.tree import workloads

    if swap_pairs is not None:
        monkeypatch.setattr(mb, "_SWAP_PAIRS", swap_pairs)
    w = workloads.swe_like(scale=1.0, seed=0, path_caps=(16384,))
    f = RolloutForest.from_sequences(w.sequences, group_ids=w.group_ids)
    cap, dp = 32768, 4
    strict = plan_microbatches(f, capacity_tokens=cap, dp_size=dp)
    slack = plan_microbatches(f, capacity_tokens=cap, dp_size=dp, work_slack=0.02)
    check_plan(f, slack, cap, dp)
    assert slack.total_compact_tokens <= strict.total_compact_tokens * 1.02
    assert slack.slot_critical_work <= strict.slot_critical_work
    assert slack.summary()["slot_imbalance_p95"] <= strict.summary()["slot_imbalance_p95"] + 1e-12


def test_thin_pieces_keeps_each_bins_range_within_the_pair_bound(monkeypatch):
    """The swap screen's piece thinning: everything under the pair bound; above it every bin
    keeps its whole-bin piece, its least- and its largest-gain piece and the same share ``f`` of
    its pieces (``f² · hot · P`` = the bound), deterministically."""
    import harts_verl.tree.microbatch as mb

    rng = np.random.default_rng(0)
    sizes = np.array([10, 1, 30, 200])
    pb = np.repeat(np.arange(sizes.size), sizes)
    pt = np.concatenate([np.arange(s) for s in sizes])
    gain = rng.integers(0, 50, pb.size)
    hot = 40
    monkeypatch.setattr(mb, "_SWAP_PAIRS", hot * pb.size)
    assert mb._thin_pieces(pb, pt, gain, hot).tolist() == list(range(pb.size))
    monkeypatch.setattr(mb, "_SWAP_PAIRS", 1000)
    keep = mb._thin_pieces(pb, pt, gain, hot)
    assert np.array_equal(keep, mb._thin_pieces(pb, pt, gain, hot))
    assert np.array_equal(np.unique(keep), keep)
    frac = np.sqrt(1000 / (hot * pb.size))
    for b, size in enumerate(sizes):
        mine = keep[pb[keep] == b]
        assert (pt[mine] == 0).any()  # the whole bin
        rest = np.flatnonzero(pb == b)
        assert gain[mine].min() == gain[rest].min()
        assert gain[mine].max() == gain[rest].max()
        assert int(size * frac) <= len(mine) <= max(int(size * frac), 1) + 2


def test_slot_penalty_matches_definition():
    import harts_verl.tree.microbatch as mb

    works = np.array([[10, 9, 8, 0, 5, 5]])
    pen = mb._slot_penalty(works, 3, tau=0.0)
    imb = mb.slot_imbalance(np.array([[10, 9, 8], [5, 5, 0]]))
    assert pen[0, 0] == 0.0  # no slot-critical limit
    assert pen[0, 2] == pytest.approx(float((imb**2).sum()))
    assert pen[0, 1] == pytest.approx(float((imb**2).sum()))
    assert mb._slot_penalty(works, 3, tau=0.2)[0, 1] == pytest.approx(
        float((np.maximum(imb - 0.2, 0) ** 2).sum())
    )
    assert mb._slot_penalty(works, 3, crit_limit=12.0)[0, 0] == 3.0  # slot maxima 10 + 5


def test_slot_imbalance_checks_its_input():
    from harts_verl.tree.microbatch import slot_imbalance

    np.testing.assert_allclose(slot_imbalance([[10, 5], [0, 0], [4, 4]]), [0.25, 0.0, 0.0])
    assert slot_imbalance(np.zeros((0, 3))).shape == (0,)
    assert slot_imbalance(np.zeros((0, 0))).shape == (0,)  # an empty plan's slot_work
    for bad in ([1, 2], np.zeros((2, 0)), np.zeros((1, 2, 2)), [[1, -1]], [[1, np.nan]], "x"):
        with pytest.raises(ValueError, match="slot_work"):
            slot_imbalance(bad)


def test_work_slack_reaches_slot_balance_on_a_realistic_swe_step():
    """A SWE-like step at dp 8 with 66 least-work microbatches (not a multiple of 8): strict
    planning leaves a padding slot (P95 imbalance far above 2 %); work_slack=0.02 aligns K to
    a multiple of dp and balances every slot to <= 2 % within the work bound, without a larger
    slot-critical work."""
    from harts_verl.tree import workloads

    w = workloads.swe_like(scale=8.0, seed=1, path_caps=(16384,))
    f = RolloutForest.from_sequences(w.sequences, group_ids=w.group_ids)
    cap, dp = 32768, 8
    strict = plan_microbatches(f, capacity_tokens=cap, dp_size=dp)
    assert strict.num_microbatches % dp != 0
    assert strict.summary()["slot_imbalance_p95"] > 0.10
    slack = plan_microbatches(f, capacity_tokens=cap, dp_size=dp, work_slack=0.02)
    check_plan(f, slack, cap, dp)
    assert slack.num_microbatches % dp == 0 and slack.num_microbatches >= 64
    assert slack.total_compact_tokens <= strict.total_compact_tokens * 1.02
    assert slack.slot_critical_work <= strict.slot_critical_work
    assert slack.summary()["slot_imbalance_p95"] <= 0.02


def test_work_slack_repairs_the_least_work_plan_when_an_aligned_start_cannot_win():
    """GRPO responses at dp 4: the strict plan (96 microbatches, already a multiple of dp)
    leaves slots near 3 %. The repaired aligned start balances its slots but cannot get its
    slot-critical work down to the strict choice's, so it never wins; the search must go on
    to repair the least-work plan (it stopped there, returning the strict plan)."""
    from harts_verl.tree import workloads

    w = workloads.grpo_flat(scale=2.0, seed=5)
    f = RolloutForest.from_sequences(w.sequences, group_ids=w.group_ids)
    cap, dp = 16384, 4
    strict = plan_microbatches(f, capacity_tokens=cap, dp_size=dp)
    assert strict.slot_imbalance().max() > 0.025
    slack = plan_microbatches(f, capacity_tokens=cap, dp_size=dp, work_slack=0.02)
    check_plan(f, slack, cap, dp)
    assert slack.strategy.endswith("+repair")
    assert slack.slot_imbalance().max() <= 0.02
    assert slack.slot_critical_work <= strict.slot_critical_work
    assert slack.total_compact_tokens <= strict.total_compact_tokens * 1.02


def _grpo_like_step(seed: int) -> tuple[list[list[int]], int, int, float]:
    """Prompt groups with responses and a few forks, a capacity, dp and work slack."""
    rng = np.random.default_rng(seed)
    nxt = itertools.count(10)
    seqs = []
    for _ in range(rng.integers(3, 12)):
        prompt = [next(nxt) for _ in range(rng.integers(5, 200))]
        for _ in range(rng.integers(1, 9)):
            s = prompt + [next(nxt) for _ in range(rng.integers(1, 150))]
            seqs.append(s)
            if rng.random() < 0.3:
                cut = int(rng.integers(1, len(s)))
                seqs.append(s[:cut] + [next(nxt) for _ in range(rng.integers(1, 80))])
    longest = max(len(s) for s in seqs)
    over = rng.random() < 0.3
    hi = 3 * longest if over else 4 * longest
    cap = int(rng.integers(max(50, longest // 2) if over else longest, hi))
    return seqs, cap, int(rng.choice([2, 3, 4, 8])), float(rng.choice([0.02, 0.05, 0.2]))


@pytest.mark.parametrize("seed", [3, 33, 286])
def test_work_slack_never_worse_than_the_strict_plan(seed):
    """The slack guarantees refer to the strict call's plan. A slack search builds another
    pool (its K-aligned contiguous starts change where the local search, fewer-bins and balance
    start), whose least-work candidate had a larger slot-critical work than the strict plan
    (seed 33: strict natural+fb 5221 / 2639, slack 5281 / 2657 with the bound 2694)."""
    seqs, cap, dp, slack = _grpo_like_step(seed)
    f = RolloutForest.from_sequences(seqs)
    kw = dict(capacity_tokens=cap, dp_size=dp, allow_oversize=True)
    strict = plan_microbatches(f, **kw)
    plan = plan_microbatches(f, work_slack=slack, **kw)
    check_plan(f, plan, cap, dp)
    assert plan.slot_critical_work <= strict.slot_critical_work
    assert plan.total_compact_tokens <= strict.total_compact_tokens * (1 + slack)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"work_slack": None}, "work_slack"),
        ({"work_slack": "0.1"}, "work_slack"),
        ({"work_slack": True}, "work_slack"),
        ({"restarts": -1}, "restarts"),
        ({"restarts": 1.5}, "restarts"),
        ({"effort": -1.0}, "effort"),
        ({"effort": float("nan")}, "effort"),
        ({"effort": None}, "effort"),
        ({"max_layers_work": -5}, "max_layers_work"),
        ({"max_search_cells": -1}, "max_search_cells"),
        ({"max_search_cells": 2.5}, "max_search_cells"),
        ({"strategies": ["tree", 3]}, "strategies"),
        ({"strategies": []}, "strategies"),
    ],
)
def test_bad_option_values_name_the_option(options, match):
    """Illegal option values raise ValueError naming the option (no bare float() TypeError, no
    silent truncation of 1.5 restarts or a negative effort)."""
    f = RolloutForest.from_sequences([[1, 2], [1, 3], [4]])
    with pytest.raises(ValueError, match=match):
        plan_microbatches(f, capacity_tokens=5, dp_size=2, **options)
    with pytest.raises(ValueError, match=match):
        check_plan_arguments(capacity_tokens=5, dp_size=2, **options)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_tokens": 0},
        {"capacity_tokens": 2**63},
        {"capacity_tokens": 4.0},
        {"capacity_tokens": 5, "dp_size": 0},
        {"capacity_tokens": 5, "dp_size": MAX_DP_SIZE + 1},
        {"capacity_tokens": 5, "seed": -1},
        {"capacity_tokens": 5, "nonsense": 1},
        {"capacity_tokens": 5, "allow_oversize": "yes"},
        {"capacity_tokens": 5, "strategies": "magic"},
    ],
)
def test_check_plan_arguments_is_planning_s_check(kwargs):
    """``check_plan_arguments`` raises what planning raises for the same arguments (type and
    message), and accepts what planning accepts."""
    f = RolloutForest.from_sequences([[1, 2], [1, 3], [4]])
    with pytest.raises((TypeError, ValueError)) as planned:
        plan_microbatches(f, **kwargs)
    with pytest.raises(type(planned.value), match=re.escape(str(planned.value))):
        check_plan_arguments(**kwargs)
    ok = {"capacity_tokens": 2**63 - 1, "dp_size": 2**12, "seed": 2**70, "work_slack": 0.5}
    assert check_plan_arguments(**ok) is None
    plan_microbatches(f, **ok)


def test_single_strategy_name_is_one_family():
    """``strategies="tree"`` means the tree family, not the letters t, r, e."""
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5], [2, 2]])
    a = plan_microbatches(f, capacity_tokens=5, strategies="tree")
    b = plan_microbatches(f, capacity_tokens=5, strategies=["tree"])
    assert a.strategy == b.strategy and a.strategy.startswith("tree")
    assert a.total_compact_tokens == b.total_compact_tokens


def test_helpers_validate_their_arguments():
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4], [5]])
    with pytest.raises(ValueError, match="trajectories"):
        compact_work(f, [0, 3])
    with pytest.raises(ValueError, match="trajectories"):
        compact_work(f, [-1])
    with pytest.raises(ValueError, match="trajectories"):
        compact_work(f, [0.0])
    assert compact_work(f, [0, 0, 1]) == compact_work(f, [0, 1]) == 4  # duplicates count once
    for bad in (0, -3, 2.5, None, True):
        with pytest.raises(ValueError, match="capacity_tokens"):
            natural_partition(f, bad)
        with pytest.raises(ValueError, match="capacity_tokens"):
            optimal_contiguous_partition(f, bad)
        with pytest.raises(ValueError, match="capacity_tokens"):
            lower_bound_work(f, bad)
    with pytest.raises(ValueError, match="num_parts"):
        optimal_contiguous_partition(f, 5, -1)


@settings(max_examples=30, deadline=None)
@given(
    forests(max_traj=10),
    st.integers(1, 6),
    st.sampled_from([1, 2, 3, 16]),
    st.sampled_from([0.0, 0.05]),
)
def test_oversize_plans_cover_every_trajectory_once(forest, cap, dp, slack):
    """Capacities below the longest trajectory with ``allow_oversize``, any dp (also > N), with
    and without work slack: every trajectory once, exact works, consistent accounting."""
    plan = plan_microbatches(
        forest, capacity_tokens=cap, dp_size=dp, work_slack=slack, allow_oversize=True
    )
    check_plan(forest, plan, cap, dp)
    seqs = forest.sequences
    held = np.zeros(forest.num_trajectories, bool)
    for mb in plan.microbatches:
        if mb.compact_tokens > cap:  # an oversize path with its copies and prefixes
            longest = max((seqs[int(i)] for i in mb.trajectories), key=len)
            assert mb.compact_tokens == longest.shape[0]
            for i in mb.trajectories:
                s = seqs[int(i)]
                assert np.array_equal(longest[: s.shape[0]], s)
            held[mb.trajectories] = True
    # No trajectory outside them is a prefix of a held oversize one (it would ride for free).
    big = [seqs[i] for i in np.flatnonzero(held) if seqs[i].shape[0] > cap]
    for i in np.flatnonzero(~held):
        s = seqs[i]
        assert not any(b.shape[0] >= s.shape[0] and np.array_equal(b[: s.shape[0]], s) for b in big)


@settings(max_examples=25, deadline=None)
@given(forests(max_traj=10), st.integers(2, 8), st.sampled_from([2, 3, 4]))
def test_oversize_plans_score_the_whole_plan(forest, cap, dp):
    """The oversize microbatches are part of every candidate's score: the chosen candidate's
    score is the final plan's, and a slack plan is never worse in slot-critical work than the
    strict one (its K aligned with the oversize microbatches counted)."""
    kw = dict(capacity_tokens=cap, dp_size=dp, allow_oversize=True)
    strict = plan_microbatches(forest, **kw)
    slack = plan_microbatches(forest, work_slack=0.2, **kw)
    for plan in (strict, slack):
        if plan.strategy != "none":
            total, crit, max_rep, _ = plan.candidates[plan.strategy]
            assert (total, crit) == (plan.total_compact_tokens, plan.slot_critical_work)
            assert max_rep == int(plan.replica_work.max())
    assert slack.slot_critical_work <= strict.slot_critical_work
    assert slack.total_compact_tokens <= strict.total_compact_tokens * 1.2 + 1e-9


def test_slack_with_oversize_chain_regression():
    """A chain of 1..50 tokens at capacity 30, dp 3: aligning K without the 20 oversize
    microbatches used to give a slack plan worse than the strict one (846 / 291 / 8 slots vs
    840 / 287 / 7)."""
    f = RolloutForest.from_sequences([[1] * k for k in range(1, 51)])
    kw = dict(capacity_tokens=30, dp_size=3, allow_oversize=True)
    strict = plan_microbatches(f, **kw)
    slack = plan_microbatches(f, work_slack=0.2, **kw)
    check_plan(f, slack, 30, 3)
    assert slack.slot_critical_work <= strict.slot_critical_work
    assert slack.num_slots <= strict.num_slots


def test_oversize_copies_share_one_microbatch():
    """Identical copies of an oversize trajectory run together: they cost one copy."""
    long_a, long_b = list(range(100, 110)), list(range(200, 208))
    seqs = [long_a, [1, 2], long_b, long_a, [1, 3], long_a, long_b]
    f = RolloutForest.from_sequences(seqs)
    plan = plan_microbatches(f, capacity_tokens=5, allow_oversize=True, dp_size=2)
    check_plan(f, plan, 5, 2)
    groups = sorted(mb.trajectories.tolist() for mb in plan.microbatches if mb.compact_tokens > 5)
    assert groups == [[0, 3, 5], [2, 6]]
    assert plan.total_compact_tokens == 10 + 8 + naive_work(f, [1, 4])


def test_oversize_paths_hold_their_prefixes():
    """A trajectory that is a prefix of an oversize one (oversize itself or not) adds no row to
    its microbatch and runs there: [1..20] with [1..5] at capacity 10 is one microbatch of 20
    rows (was 25 in two), and a chain of oversize prefixes is one microbatch."""
    f = RolloutForest.from_sequences([list(range(1, 21)), list(range(1, 6)), [7, 8]])
    plan = plan_microbatches(f, capacity_tokens=10, allow_oversize=True)
    check_plan(f, plan, 10, 1)
    got = sorted((mb.trajectories.tolist(), mb.compact_tokens) for mb in plan.microbatches)
    assert got == [([1, 0], 20), ([2], 2)]  # members in leaf order
    chain = RolloutForest.from_sequences([[1] * k for k in (30, 12, 20, 3, 30)])
    plan = plan_microbatches(chain, capacity_tokens=10, dp_size=2, allow_oversize=True)
    check_plan(chain, plan, 10, 2)
    assert plan.total_compact_tokens == 30 and plan.num_slots == 1
    assert sorted(plan.microbatches[0].trajectories.tolist()) == [0, 1, 2, 3, 4]
    # In an expanded layout nothing is shared, so nothing rides along.
    e = RolloutForest.expanded([list(range(1, 21)), list(range(1, 6))])
    assert plan_microbatches(e, capacity_tokens=10, allow_oversize=True).total_compact_tokens == 25


def test_work_slack_with_one_token_trajectories_and_capacity_one():
    """The aligned starts of the slack repair shrink the capacity by 0.1 % steps; at capacity 1
    that used to reach 0 (ZeroDivisionError). The reduced capacity never drops below the
    longest trajectory."""
    for n, dp in ((2, 2), (3, 2), (4, 4)):
        f = RolloutForest.from_sequences([[t] for t in range(n)])
        plan = plan_microbatches(f, capacity_tokens=1, dp_size=dp, work_slack=0.05)
        check_plan(f, plan, 1, dp)
        assert plan.total_compact_tokens == n


@settings(max_examples=40, deadline=None)
@given(forests(), st.integers(0, 20), st.sampled_from([1, 2, 4]), st.sampled_from([0.0, 0.05]))
def test_bounded_search_skips_its_phases_and_stays_a_valid_plan(forest, extra, dp, slack):
    """With ``max_search_cells`` below n·K the greedy family and the local search / balance /
    repair (whose state is two ``[n, K]`` tables) are skipped and named in ``skipped_phases``;
    the plan keeps every guarantee and its work is at most the natural partition's (times
    ``1 + work_slack``)."""
    cap = int(forest.lengths.max()) + extra
    opts = {"dp_size": dp, "work_slack": slack, "max_search_cells": 0}
    plan = plan_microbatches(forest, capacity_tokens=cap, **opts)
    check_plan(forest, plan, cap, dp)
    assert not any(name.startswith("greedy") or "+" in name for name in plan.candidates)
    assert set(plan.skipped_phases) <= {
        "greedy",
        "improve",
        "restarts",
        "fewer_bins",
        "balance",
        "repair",
    }
    assert plan.summary()["skipped_phases"] == list(plan.skipped_phases)
    nat = sum(naive_work(forest, p) for p in natural_partition(forest, cap))
    assert lower_bound_work(forest, cap) <= plan.total_compact_tokens <= int(nat * (1 + slack))
    full = plan_microbatches(forest, capacity_tokens=cap, dp_size=dp, work_slack=slack)
    assert full.skipped_phases == ()
    # every phase the full search ran is named (the candidates before it are the same)
    ran = {
        "greedy": any(name.startswith("greedy") for name in full.candidates),
        "improve": any("+ls" in name for name in full.candidates),
        "balance": dp > 1,
        "repair": dp > 1 and slack > 0,
    }
    assert {phase for phase, did in ran.items() if did} <= set(plan.skipped_phases)


def test_greedy_alone_above_the_bound_plans_the_natural_partition():
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4], [5, 6], [5, 7, 8], [9]])
    plan = plan_microbatches(f, capacity_tokens=5, strategies="greedy", max_search_cells=0)
    check_plan(f, plan, 5, 1)
    assert plan.strategy == "natural" and "greedy" in plan.skipped_phases
    ok = plan_microbatches(f, capacity_tokens=5, strategies="greedy")
    assert ok.strategy.startswith("greedy") and ok.skipped_phases == ()


def _grouped_forest(rng: np.random.Generator) -> RolloutForest:
    """20-120 trajectories: a few shared prompts with random continuations."""
    prompts = [list(rng.integers(0, 50, rng.integers(5, 40))) for _ in range(rng.integers(1, 6))]
    return RolloutForest.from_sequences(
        [
            prompts[rng.integers(len(prompts))] + list(rng.integers(0, 50, rng.integers(1, 40)))
            for _ in range(int(rng.integers(20, 120)))
        ]
    )


@pytest.mark.parametrize("seed", range(6))
def test_no_search_state_exceeds_max_search_cells(seed, monkeypatch):
    """Every local-search state the planner builds or grows (restart kicks, balance and repair
    padding, aligned starts) stays within ``max_search_cells`` n·K cells, at bounds spread
    between n and the unbounded search's peak (the kicks and the slack balance's second
    padding once went past it)."""
    from harts_verl.tree import microbatch as mb

    peak = [0]
    init, add_bins = mb._State.__init__, mb._State.add_bins

    def tracked_init(self, lv, label, k, cap):
        init(self, lv, label, k, cap)
        peak[0] = max(peak[0], lv.n * self.k)

    def tracked_add(self, extra_bins):
        add_bins(self, extra_bins)
        peak[0] = max(peak[0], self.lv.n * self.k)

    monkeypatch.setattr(mb._State, "__init__", tracked_init)
    monkeypatch.setattr(mb._State, "add_bins", tracked_add)
    rng = np.random.default_rng(seed)
    for _ in range(4):
        forest = _grouped_forest(rng)
        cap = int(forest.lengths.max()) + int(rng.integers(0, 150))
        opts = {
            "dp_size": int(rng.choice([2, 4, 8])),
            "work_slack": float(rng.choice([0.0, 0.05])),
            "restarts": int(rng.choice([0, 3])),
        }
        peak[0] = 0
        plan_microbatches(forest, capacity_tokens=cap, max_search_cells=10**12, **opts)
        for bound in np.linspace(forest.num_trajectories, peak[0], 6).astype(int).tolist():
            peak[0] = 0
            plan = plan_microbatches(forest, capacity_tokens=cap, max_search_cells=bound, **opts)
            assert peak[0] <= bound, (bound, peak[0], plan.skipped_phases)
            check_plan(forest, plan, cap, opts["dp_size"])


def test_many_short_trajectories_plan_without_the_n_by_k_state():
    """10,000 short trajectories with room for about 15 per microbatch: the search skips its
    ``[n, K]`` phases (n·K = 6.4M cells > the default 4M; they took 6 s here, 100 s at 40,000
    trajectories, and ran out of memory at 100,000, 9.5 GB) and still plans within 0.1 % of the
    lower bound (the full search found the same plan)."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 50_000, (100, 30))
    seqs = [
        np.concatenate([prompts[i // 100], rng.integers(0, 50_000, rng.integers(5, 30))])
        for i in range(10_000)
    ]
    forest = RolloutForest.from_sequences(seqs)
    plan = plan_microbatches(forest, capacity_tokens=300)
    assert {"greedy", "improve"} <= set(plan.skipped_phases)
    check_plan(forest, plan, 300, 1)
    lb = lower_bound_work(forest, 300)
    assert lb <= plan.total_compact_tokens <= 1.001 * lb


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 60), max_size=40), st.integers(1, 200))
def test_token_balanced_microbatches_as_verl_dynamic_batching(lengths, cap):
    """The trajectory-wise baseline's microbatches (the expanded plan halved the batch: up to a
    third more microbatches than dynamic batching): every trajectory once, each microbatch
    within the capacity but for an oversize trajectory alone, no two that would fit in one."""
    from harts_verl.tree.microbatch import token_balanced_microbatches

    bins = token_balanced_microbatches(lengths, cap)
    n = len(lengths)
    assert sorted(i for b in bins for i in b.tolist()) == list(range(n))
    assert all(b.dtype == np.int64 and np.all(np.diff(b) > 0) for b in bins)
    loads = [sum(lengths[i] for i in b) for b in bins]
    for b, load in zip(bins, loads):
        assert load <= cap or len(b) == 1, (lengths, cap, bins)
    fitting = sorted(v for b, v in zip(bins, loads) if v <= cap)
    assert len(fitting) < 2 or fitting[0] + fitting[1] > cap  # none could be merged
    small = sum(v for v in lengths if v <= cap)  # oversize ones run alone
    assert len(fitting) >= -(-small // cap)
    with pytest.raises(ValueError, match="capacity_tokens"):
        token_balanced_microbatches(lengths, 0)


def test_token_balanced_microbatches_refuses_lengths_past_int64():
    # 2**63 wrapped to -2**63 in int64: it "fit" a capacity of 4 beside another trajectory.
    from harts_verl.tree.microbatch import token_balanced_microbatches

    with pytest.raises(ValueError, match="lengths"):
        token_balanced_microbatches(np.array([2**63, 3], np.uint64), 4)
    # a bool among the lengths is no length (numpy made [True, 5] the lengths [1, 5]), as
    # place_microbatches refuses it among works
    with pytest.raises(ValueError, match="lengths"):
        token_balanced_microbatches([True, 5], 8)
    # lengths that each fit but whose int64 sums wrap: never one microbatch over the capacity
    cap = 2**63 - 1
    for lens in ([2**62] * 3, [2**61] * 5):
        parts = token_balanced_microbatches(np.array(lens, np.int64), cap)
        assert all(sum(np.asarray(lens)[p].tolist()) <= cap for p in parts), parts
        assert sorted(np.concatenate(parts).tolist()) == list(range(len(lens)))


def test_token_balanced_microbatches_no_more_than_verl():
    """No more microbatches than veRL 0.9.1's own dynamic batching on the same lengths
    (its 2 for [3, 4, 5, 4, 2] at 9: the balanced split made 3), each within the capacity."""
    pytest.importorskip("verl")
    import torch
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    from harts_verl.tree.microbatch import token_balanced_microbatches

    def verl_count(lengths, cap):
        n = len(lengths)
        mask = torch.zeros(n, max(lengths), dtype=torch.int64)
        for i, m in enumerate(lengths):
            mask[i, :m] = 1
        batch = TensorDict({"attention_mask": mask, "input_ids": mask}, batch_size=[n])
        return len(rearrange_micro_batches(batch, max_token_len=cap)[1])

    assert len(token_balanced_microbatches([3, 4, 5, 4, 2], 9)) == verl_count([3, 4, 5, 4, 2], 9)
    rng = np.random.default_rng(0)
    for _ in range(300):
        cap = int(rng.integers(8, 300))
        lengths = rng.integers(1, cap + 1, int(rng.integers(1, 40))).tolist()
        ours = token_balanced_microbatches(lengths, cap)
        assert len(ours) <= verl_count(lengths, cap), (lengths, cap)
        assert all(sum(lengths[i] for i in b) <= cap for b in ours)


def test_fewer_microbatches_for_the_same_work():
    """The natural partition reaches the work bound, but a tree cut in halves that each repeat
    its prefix leaves room: cut unevenly, the small parts share microbatches with other trees.
    10 trees of 820 rows and 6 of 60 at capacity 700: 14 microbatches of the same 8,760 rows
    (the natural partition's 21)."""
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(10):
        p = rng.integers(1000, 2000, 20).tolist()
        seqs += [p + rng.integers(1, 1000, 200).tolist() for _ in range(4)]
    seqs += [rng.integers(1, 1000, 60).tolist() for _ in range(6)]
    f = RolloutForest.from_sequences(seqs)
    for dp in (1, 2):
        plan = plan_microbatches(f, capacity_tokens=700, dp_size=dp)
        check_plan(f, plan, 700, dp)
        assert plan.total_compact_tokens == lower_bound_work(f, 700) == 8760
        assert plan.num_microbatches == 14 and plan.candidates["natural"][3] == 21, plan.candidates
    small = RolloutForest.from_sequences(
        [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [5, 6, 7, 8]]
    )
    plan = plan_microbatches(small, capacity_tokens=8)
    check_plan(small, plan, 8, 1)
    assert plan.num_microbatches == 2 and plan.total_compact_tokens == 15 == lower_bound_work(
        small, 8
    )
    # without the local search (improve=False) the phase does not run
    assert plan_microbatches(small, capacity_tokens=8, improve=False).num_microbatches == 3


def test_range_min_matches_brute_force():
    """The sparse table's range minima equal numpy's over every non-empty range (lengths on
    both sides of powers of two), vectorized over any shape, scalar queries too."""
    from harts_verl.tree._rangemin import RangeMin

    rng = np.random.default_rng(0)
    for n in [1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 200]:
        v = rng.integers(-(2**40), 2**40, n)
        rmq = RangeMin(v)
        lo, hi = np.triu_indices(n + 1, 1)
        want = np.array([v[a:b].min() for a, b in zip(lo, hi)])
        np.testing.assert_array_equal(rmq.query(lo, hi), want)
        np.testing.assert_array_equal(rmq.query(lo[:, None], hi[:, None])[:, 0], want)
        assert [rmq.query_one(int(a), int(b)) for a, b in zip(lo, hi)] == want.tolist()
    with pytest.raises(ValueError, match="empty range"):
        RangeMin(np.arange(4)).query(np.array([1]), np.array([1]))
    for lo, hi in ((2, 5), (-1, 2)):  # one flat table: past a level would read the next one
        with pytest.raises(IndexError, match="outside"):
            RangeMin(np.arange(4)).query(np.array([lo]), np.array([hi]))


@st.composite
def leaf_views(draw):
    """A planner leaf view over a random forest, its dense LCP matrix dropped (the sparse
    table path of forests above 2,500 trajectories) or kept."""
    import harts_verl.tree.microbatch as mb

    forest = draw(forests(max_traj=40, max_len=24))
    lv = mb._Leaves.of(forest)
    if draw(st.booleans()):
        lv.mat = None
    return lv


@given(leaf_views(), st.integers(1, 60), st.booleans())
@settings(max_examples=60, deadline=None)
def test_greedy_leaf_is_the_direct_pass(lv, cap, reverse):
    """The greedy pass (running LCP minima per bin) labels exactly as the direct definition:
    each position joins the feasible bin of least marginal work (LCP with the bin's last member
    from ``pair_lcp``), ties fullest then lowest index, else opens a bin."""
    import harts_verl.tree.microbatch as mb

    label, last, loads = [0] * lv.n, [], []
    for p in range(lv.n - 1, -1, -1) if reverse else range(lv.n):
        marg = [int(lv.lens[p] - lv.pair_lcp(b, p)) for b in last]
        feas = [b for b in range(len(last)) if loads[b] + marg[b] <= cap]
        if feas:
            b = min(feas, key=lambda b: (marg[b], -(loads[b] + marg[b]), b))
            label[p], loads[b], last[b] = b, loads[b] + marg[b], p
        else:
            label[p] = len(last)
            loads.append(int(lv.lens[p]))
            last.append(p)
    assert mb._greedy_leaf(lv, cap, reverse).tolist() == label


@given(leaf_views(), st.integers(2, 6), st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None)
def test_local_search_tables_after_moves(lv, k, rnd):
    """After piece moves (the tables refreshed only around each piece), the works and the
    nearest-member tables equal those of a state built afresh from the labels, and the exact
    marginal work of a piece equals the work difference of the sets."""
    import harts_verl.tree.microbatch as mb

    label = np.array([rnd.randrange(k) for _ in range(lv.n)], dtype=np.int64)
    st_ = mb._State(lv, label, k, cap=10**9)
    for _ in range(6):
        a = rnd.randrange(k)
        if st_.works[a] == 0:
            continue
        pc = st_.pieces(a)
        marg = st_.marginals(pc, a)
        t, b = rnd.randrange(len(pc.runs)), rnd.choice([x for x in range(k) if x != a])
        piece = pc.piece(t)
        rest = np.setdiff1d(st_.members(a), piece)
        with_piece = np.union1d(st_.members(b), piece)
        assert marg[t, b] == lv.set_work(with_piece) - st_.works[b]
        st_.move(piece, a, b, lv.set_work(rest), lv.set_work(with_piece))
        fresh = mb._State(lv, st_.label, k, cap=10**9)
        np.testing.assert_array_equal(st_.works, fresh.works)
        np.testing.assert_array_equal(st_.nl, fresh.nl)
        np.testing.assert_array_equal(st_.nr, fresh.nr)


@pytest.mark.parametrize("best_fit", [False, True])
def test_fit_decreasing_of_many_items_is_the_direct_fit(best_fit):
    """Above 64 items the packing's fit runs over numpy loads: the same labels as the direct
    definition (items by decreasing size, ties by index; first fit: the lowest bin with room;
    best fit: the least room left, lowest bin on ties; else a new bin)."""
    import harts_verl.tree.microbatch as mb

    rng = np.random.default_rng(7)
    for trial in range(40):
        m = int(rng.integers(65, 400))
        room = int(rng.integers(10, 300))
        sizes = rng.integers(0, room + 1, m).tolist()
        loads: list[int] = []
        want = [0] * m
        for t in sorted(range(m), key=lambda t: (-sizes[t], t)):
            left = [(room - ld - sizes[t], b) for b, ld in enumerate(loads)]
            ok = [(r, b) for r, b in left if r >= 0]
            if ok:
                b = min(ok)[1] if best_fit else ok[0][1]
                loads[b] += sizes[t]
            else:
                b = len(loads)
                loads.append(sizes[t])
            want[t] = b
        assert mb._pack_sizes(sizes, room, best_fit, node_limit=1000) == want, trial
