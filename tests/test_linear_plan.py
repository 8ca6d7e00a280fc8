"""Linear-attention call planner: plan invariants, minimal rounds vs a brute force over all
continuation choices, and the array form run end to end on a chunk-sensitive toy recurrence."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_verl.tree import (
    LinearCallPlan,
    RolloutForest,
    plan_linear_calls,
)

CHUNKS = (16, 32, 64)
tokens = st.integers(min_value=0, max_value=3)


# ------------------------------------------------------------------------------ strategies
@st.composite
def forest_cases(draw, max_traj=8, max_len=200, chunks=CHUNKS):
    """(sequences, chunk_size): trajectories built by forking/extending earlier ones, with forks
    inside chunks, exactly on boundaries (and ±1), several forks in one chunk, nested forks in
    later chunks (several rounds), long chains, prefixes of other trajectories, several roots.
    Token ids come from a seeded generator over a 4-letter alphabet (long sequences are cheap)."""
    chunk = draw(st.sampled_from(chunks))
    n = draw(st.integers(1, max_traj))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    seqs: list[list[int]] = []
    forks: list[int] = []  # depth where each trajectory left its base

    def fresh(k: int) -> list[int]:
        return rng.integers(0, 4, size=k).tolist()

    for _ in range(n):
        kind = draw(st.integers(0, 7))
        if not seqs or kind == 0:  # a fresh root (maybe sharing a first token by chance)
            seqs.append(fresh(draw(st.integers(1, max_len))))
            forks.append(0)
            continue
        if kind >= 6:  # nested: fork below another trajectory's own fork
            j = draw(st.integers(0, len(seqs) - 1))
            base = seqs[j]
            lo = min(len(base), forks[j] + 1)
            cut = draw(st.integers(lo, len(base)))
        else:
            j = draw(st.integers(0, len(seqs) - 1))
            base = seqs[j]
            if kind in (1, 5):  # anywhere
                cut = draw(st.integers(0, len(base)))
            elif kind == 2:  # on / next to a chunk boundary
                k = draw(st.integers(0, len(base) // chunk))
                cut = min(len(base), max(0, k * chunk + draw(st.integers(-1, 1))))
            else:  # inside a chunk, possibly next to another fork of the same chunk
                k = draw(st.integers(0, len(base) // chunk))
                cut = min(len(base), k * chunk + draw(st.integers(0, chunk - 1)))
        if kind == 5 and cut > 0:  # a prefix of another trajectory
            seq = base[:cut]
        else:
            # A different next token forces a real fork at ``cut``.
            first = [] if cut == len(base) else [(base[cut] + int(rng.integers(1, 4))) % 4]
            seq = (base[:cut] + first + fresh(draw(st.integers(0, max_len))))[:max_len]
            seq = seq or fresh(1)
        seqs.append(seq)
        forks.append(cut)
    return seqs, chunk


@st.composite
def tree_cases(draw, max_nodes=12, chunks=CHUNKS):
    """(sequences, chunk_size) from an explicit random segment tree: bushy nested forks whose
    children are short (several forks in one chunk, producers above the parent segment) or span
    several chunks, so several rounds are needed and the continuation choice matters."""
    chunk = draw(st.sampled_from(chunks))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    short = max(1, chunk // 4)

    def seg_len() -> int:
        if draw(st.booleans()):
            return draw(st.integers(1, short))
        return draw(st.integers(1, 3 * chunk))

    # Nodes: (parent, length); children added breadth-first up to max_nodes.
    nodes: list[tuple[int, int]] = [(-1, seg_len())]
    frontier = [0]
    while frontier and len(nodes) < max_nodes:
        p = frontier.pop(0)
        k = draw(st.sampled_from((0, 2, 2, 3)))
        for _ in range(min(k, max_nodes - len(nodes))):
            nodes.append((p, seg_len()))
            frontier.append(len(nodes) - 1)
    children: list[list[int]] = [[] for _ in nodes]
    for i, (p, _) in enumerate(nodes):
        if p >= 0:
            children[p].append(i)
    body: list[list[int]] = []
    for i, (p, length) in enumerate(nodes):
        # Sibling segments differ in their first token (their index among siblings).
        head = children[p].index(i) if p >= 0 else 0
        body.append([head, *rng.integers(0, 4, size=length - 1).tolist()])
    paths: list[list[int]] = [[] for _ in nodes]
    seqs: list[list[int]] = []
    for i, (p, _) in enumerate(nodes):  # parents precede children
        paths[i] = (paths[p] if p >= 0 else []) + body[i]
        if not children[i] or draw(st.integers(0, 4)) == 0:  # leaves and some prefix ends
            seqs.append(paths[i])
    # A single child would merge with its parent segment: fine, the forest handles it.
    return seqs, chunk


# ------------------------------------------------------------------------------ oracles
def _path_rows(forest: RolloutForest, row: int, lo: int) -> list[int]:
    """Rows of the path ending at ``row`` with depths ``[lo, depth(row)]``, root side first."""
    out = []
    while row >= 0 and forest.depth[row] >= lo:
        out.append(int(row))
        row = int(forest.parent[row])
    return out[::-1]


def brute_force_rounds(forest: RolloutForest, chunk: int) -> int:
    """Fewest rounds over every continuation choice (each child of a fork, or none), by the
    model's definition: a new member's round is 1 + the round of the member owning its path's
    row at depth b − 1 (1 when b = 0); a continuing child shares its parent's member."""
    seg = forest.segments
    n = len(seg)
    if n == 0:
        return 0
    seg_of_row = forest.segment_of_row
    parent = seg.parent_segment.tolist()
    children = [[] for _ in range(n)]
    for s, p in enumerate(parent):
        if p >= 0:
            children[p].append(s)
    # Segment holding the path's row at depth b-1 (fixed by the tree), -1 when b == 0.
    prod_seg = []
    for s in range(n):
        f = int(seg.fork_position[s])
        b = f // chunk * chunk
        if b == 0:
            prod_seg.append(-1)
        else:
            row = int(seg.first_row[s])
            for _ in range(f - b + 1):
                row = int(forest.parent[row])
            assert forest.depth[row] == b - 1
            prod_seg.append(int(seg_of_row[row]))
    forks = [t for t in range(n) if children[t]]
    options = [[*children[t], -1] for t in forks]
    best = None
    for choice in itertools.product(*options):
        cont = dict(zip(forks, choice))
        rnd = [0] * n
        for s in range(n):  # preorder: parents and producers come first
            p = parent[s]
            if p >= 0 and cont[p] == s:
                rnd[s] = rnd[p]
            else:
                rnd[s] = 1 if prod_seg[s] < 0 else rnd[prod_seg[s]] + 1
        worst = max(rnd)
        best = worst if best is None else min(best, worst)
    return best


def check_plan(forest: RolloutForest, plan: LinearCallPlan, chunk: int) -> None:
    """Every invariant of the issue, checked from the forest's parent pointers."""
    c = forest.num_compact_tokens
    members = plan.members
    assert plan.num_rounds == len(plan.rounds) == len(plan.arrays.rounds)
    assert [m.index for m in members] == list(range(len(members)))
    # Every compact row output by exactly one member.
    own = np.concatenate([m.rows for m in members]) if members else np.zeros(0, np.int64)
    np.testing.assert_array_equal(np.sort(own), np.arange(c))
    seg_cover = np.concatenate([m.segments for m in members]) if members else np.zeros(0)
    np.testing.assert_array_equal(np.sort(seg_cover), np.arange(len(forest.segments)))
    replay_total = 0
    for r, call in enumerate(plan.rounds):
        lens = [m.length for m in call.members]
        np.testing.assert_array_equal(call.cu_seqlens, np.concatenate([[0], np.cumsum(lens)]))
        for m in call.members:
            assert m.round == r
            rows = m.rows
            assert rows.size > 0
            f = int(forest.depth[rows[0]])
            assert m.fork_position == f
            # Members start on boundaries; replay < chunk and equals the path rows [b, f).
            assert m.start_position % chunk == 0
            assert m.start_position == f // chunk * chunk
            assert m.replay_rows.shape[0] == f - m.start_position < chunk
            path = _path_rows(forest, int(rows[0]), m.start_position)
            np.testing.assert_array_equal(m.replay_rows, path[:-1])
            # Own rows run down one path.
            np.testing.assert_array_equal(forest.parent[rows[1:]], rows[:-1])
            replay_total += m.replay_rows.shape[0]
            # Initial state: the path's state at b, produced in an earlier round.
            b = m.start_position
            if b == 0:
                assert m.initial_state is None
            else:
                init = m.initial_state
                assert init is not None and init.position == b
                prod = members[init.producer]
                assert prod.round < m.round
                assert m.round == prod.round + 1  # ASAP
                assert (b - prod.start_position) % chunk == 0 and b > prod.start_position
                prod_tokens = np.concatenate([prod.replay_rows, prod.rows])
                assert prod_tokens.shape[0] >= b - prod.start_position
                # The producer's run up to b is exactly this path's rows [start_P, b).
                want = _path_rows(forest, int(rows[0]), prod.start_position)[
                    : b - prod.start_position
                ]
                np.testing.assert_array_equal(prod_tokens[: b - prod.start_position], want)
                # The producer owns (outputs) the path's row at depth b-1.
                assert want[-1] in set(prod.rows.tolist())
                ms = plan.materialized_states[init.slot]
                assert (ms.producer, ms.position) == (init.producer, b)
    assert replay_total == plan.replay_tokens
    # Materialized states: distinct (producer, position), each used, slots round by round.
    keys = [(s.producer, s.position) for s in plan.materialized_states]
    assert len(set(keys)) == len(keys)
    used = {m.initial_state.slot for m in members if m.initial_state is not None}
    assert used == set(range(len(keys)))
    for s in plan.materialized_states:
        p = members[s.producer]
        assert s.round == p.round
        assert s.position == p.start_position + s.local_chunk * chunk
        assert 1 <= s.local_chunk <= -(-p.length // chunk)
    rounds_of_states = [s.round for s in plan.materialized_states]
    assert rounds_of_states == sorted(rounds_of_states)
    so = plan.arrays.state_offsets
    for r in range(plan.num_rounds):
        assert all(s.round == r for s in plan.materialized_states[so[r] : so[r + 1]])


# ------------------------------------------------------------------------------ toy kernel
P = 1_000_000_007


def _row_value(forest: RolloutForest) -> list[int]:
    """A per-row input (stands for q/k/v/g/beta of the row)."""
    return ((forest.token_ids * 7 + forest.depth * 13 + 5) % 1009).tolist()


def toy_kernel(x: list[int], cu: list[int], init: list[int], chunk: int):
    """A chunk-partition-sensitive recurrence over packed varlen members (like the real kernel:
    chunks are local to each member). Returns outputs, final states, chunk-start states and
    chunk offsets (chunk c of member n at ``chunk_offsets[n] + c``)."""
    out = [0] * len(x)
    finals, chunk_states, chunk_offsets = [], [], [0]
    for n in range(len(cu) - 1):
        s = init[n]
        for c0 in range(cu[n], cu[n + 1], chunk):
            chunk_states.append(s)
            c1 = min(c0 + chunk, cu[n + 1])
            acc = 0
            for i in range(c0, c1):
                acc = (acc + x[i] * (i - c0 + 1)) % P
                out[i] = (s * 31 + acc * 17 + (i - c0)) % P
            s = (s * 1_000_003 + acc * 7 + (c1 - c0)) % P
        finals.append(s)
        chunk_offsets.append(len(chunk_states))
    return out, finals, chunk_states, chunk_offsets


def run_plan_arrays(forest: RolloutForest, plan: LinearCallPlan) -> list[int]:
    """Execute the array form exactly as documented for an op; returns the output of each row."""
    arrays = plan.arrays
    val = _row_value(forest)
    out = [None] * forest.num_compact_tokens
    saved: list[int] = []
    for r, ra in enumerate(arrays.rounds):
        assert len(saved) == arrays.state_offsets[r]
        assert (ra.initial_slot < arrays.state_offsets[r]).all()
        x = [val[t] for t in ra.token_rows.tolist()]
        init = [saved[s] if s >= 0 else 0 for s in ra.initial_slot.tolist()]
        o, finals, cstates, coffs = toy_kernel(x, ra.cu_seqlens.tolist(), init, plan.chunk_size)
        np.testing.assert_array_equal(ra.chunk_offsets, coffs)
        assert ra.needs_chunk_states == bool((ra.save_src < coffs[-1]).any())
        for t, row in enumerate(ra.token_rows.tolist()):
            if ra.output_mask[t]:
                assert out[row] is None, "row written twice"
                out[row] = o[t]
        src = cstates + finals
        saved.extend(src[i] for i in ra.save_src.tolist())
        np.testing.assert_array_equal(
            ra.save_slot, np.arange(len(saved) - ra.save_src.size, len(saved))
        )
    assert len(saved) == arrays.num_states
    assert all(v is not None for v in out)
    return out


def check_against_trajectories(forest: RolloutForest, plan: LinearCallPlan) -> None:
    """Tree outputs equal each trajectory run alone with absolute chunk alignment."""
    out = np.asarray(run_plan_arrays(forest, plan), dtype=np.int64)
    val = _row_value(forest)
    for i in range(forest.num_trajectories):
        rows = forest.rows_of(i)
        x = [val[r] for r in rows.tolist()]
        ref, *_ = toy_kernel(x, [0, len(x)], [0], plan.chunk_size)
        np.testing.assert_array_equal(out[rows], ref, err_msg=f"trajectory {i}")


# ------------------------------------------------------------------------------ properties
@settings(max_examples=200, deadline=None)
@given(forest_cases())
def test_plan_invariants_and_minimal_rounds(case):
    seqs, chunk = case
    forest = RolloutForest.from_sequences(seqs)
    plan = plan_linear_calls(forest, chunk_size=chunk)
    check_plan(forest, plan, chunk)
    assert plan.num_rounds == brute_force_rounds(forest, chunk)


@settings(max_examples=120, deadline=None)
@given(forest_cases(max_traj=10))
def test_array_form_reproduces_trajectory_wise_recurrence(case):
    seqs, chunk = case
    forest = RolloutForest.from_sequences(seqs)
    plan = plan_linear_calls(forest, chunk_size=chunk)
    check_against_trajectories(forest, plan)


@settings(max_examples=60, deadline=None)
@given(forest_cases(max_traj=7, max_len=40, chunks=(1, 2, 3, 5, 8)))
def test_small_chunks_exercise_deep_rounds(case):
    """Tiny chunk sizes make many boundaries per path: many rounds, producers far up the path."""
    seqs, chunk = case
    forest = RolloutForest.from_sequences(seqs)
    if True:
        plan = plan_linear_calls(forest, chunk_size=chunk)
        check_plan(forest, plan, chunk)
        assert plan.num_rounds == brute_force_rounds(forest, chunk)
        check_against_trajectories(forest, plan)


@settings(max_examples=150, deadline=None)
@given(st.one_of(tree_cases(), tree_cases(max_nodes=14, chunks=(1, 2, 3, 4, 8))))
def test_bushy_trees_minimal_rounds_and_exact_states(case):
    seqs, chunk = case
    forest = RolloutForest.from_sequences(seqs)
    plan = plan_linear_calls(forest, chunk_size=chunk)
    check_plan(forest, plan, chunk)
    assert plan.num_rounds == brute_force_rounds(forest, chunk)
    check_against_trajectories(forest, plan)


@settings(max_examples=50, deadline=None)
@given(forest_cases())
def test_deterministic(case):
    seqs, chunk = case
    f1 = RolloutForest.from_sequences(seqs)
    f2 = RolloutForest.from_sequences([list(s) for s in seqs])
    a, b = plan_linear_calls(f1, chunk_size=chunk), plan_linear_calls(f2, chunk_size=chunk)
    assert a.summary() == b.summary()
    np.testing.assert_array_equal(a.segment_member, b.segment_member)
    for ra, rb in zip(a.arrays.rounds, b.arrays.rounds, strict=True):
        for name in (
            "cu_seqlens",
            "token_rows",
            "output_mask",
            "start_positions",
            "initial_slot",
            "chunk_offsets",
            "save_src",
            "save_slot",
        ):
            np.testing.assert_array_equal(getattr(ra, name), getattr(rb, name), err_msg=name)


@settings(max_examples=50, deadline=None)
@given(forest_cases())
def test_expanded_layout_is_one_round(case):
    seqs, chunk = case
    forest = RolloutForest.expanded(seqs)
    plan = plan_linear_calls(forest, chunk_size=chunk)
    assert plan.num_rounds == 1
    assert plan.replay_tokens == 0
    assert plan.arrays.num_states == 0
    assert len(plan.members) == len(seqs)
    check_plan(forest, plan, chunk)
    check_against_trajectories(forest, plan)


# ------------------------------------------------------------------------------ examples
def _plan(seqs, chunk):
    forest = RolloutForest.from_sequences(seqs)
    plan = plan_linear_calls(forest, chunk_size=chunk)
    check_plan(forest, plan, chunk)
    check_against_trajectories(forest, plan)
    assert plan.num_rounds == brute_force_rounds(forest, chunk)
    return forest, plan


def _branch(prefix, tok, n):
    return [*prefix, *([tok] * n)]


def test_fork_on_boundary_needs_no_replay():
    trunk = [0] * 32
    _, plan = _plan([_branch(trunk, 1, 10), _branch(trunk, 2, 10), _branch(trunk, 3, 5)], 16)
    assert plan.num_rounds == 2
    assert plan.replay_tokens == 0
    new = [m for m in plan.members if m.start_position > 0]
    assert [m.start_position for m in new] == [32, 32]
    # One boundary state shared by both new members: the trunk member's chunk 2.
    assert len(plan.materialized_states) == 1
    ms = plan.materialized_states[0]
    assert (ms.position, ms.local_chunk, ms.producer) == (32, 2, 0)


def test_forks_in_one_chunk_share_one_state_and_replay():
    # Forks at 20 and 25 (chunk 16..32) on one path share the state at 16.
    a = _branch([0] * 20, 1, 30)
    b = _branch([0] * 20, 2, 5) + [3] * 20  # forks from a at 20
    c = [*b[:25], 1, 1, 1]  # forks from b at 25
    _, plan = _plan([a, b, c], 16)
    assert plan.num_rounds == 2
    assert len(plan.materialized_states) == 1
    replays = sorted(len(m.replay_rows) for m in plan.members)
    assert replays == [0, 4, 9]  # 20-16 and 25-16
    assert plan.replay_tokens == 13


def test_producer_is_ancestor_above_parent_segment():
    # Forks at 40 and 45 inside chunk [32, 48). The heavy leaf a continues the trunk member, so
    # the 5-row segment [40, 45) starts a new member M; the branch at 45 that does not continue
    # M needs the state at 32, produced by the trunk member (owner of depth 31), not by M: it
    # runs in round 2 beside M, not in round 3.
    trunk = [0] * 40
    a = [*trunk, 1, *([1] * 100)]
    b = [*trunk, 2, 2, 2, 2, 2, *([7] * 20)]
    c = [*trunk, 2, 2, 2, 2, 2, *([8] * 20)]
    forest, plan = _plan([a, b, c], 16)
    assert plan.num_rounds == 2
    trunk_member = plan.members[int(plan.segment_member[0])]
    new = [m for m in plan.members if m.start_position > 0]
    assert sorted(m.fork_position for m in new) == [40, 45]
    for m in new:
        assert m.start_position == 32
        assert m.initial_state.producer == trunk_member.index
        np.testing.assert_array_equal(m.replay_rows, forest.rows_of(1)[32 : m.fork_position])
    assert len(plan.materialized_states) == 1
    assert plan.replay_tokens == 8 + 13


def test_nested_forks_along_a_chain_over_many_chunks():
    # Forks at 20, 70, 120, 170, each in a later chunk than the previous one. Continuing the deep
    # branch at every fork keeps one member down the whole chain (13 chunks); each side leaf is
    # a new member in round 2, producer: that member.
    base = [0] * 200
    s1 = [*base[:20], *([1] * 180)]
    s2 = [*s1[:70], *([2] * 130)]
    s3 = [*s2[:120], *([3] * 80)]
    s4 = [*s3[:170], *([1] * 30)]
    _, plan = _plan([base, s1, s2, s3, s4], 16)
    assert plan.num_rounds == 2
    first = plan.members[0]
    assert first.start_position == 0 and first.rows.shape[0] == 200
    assert sorted(m.start_position for m in plan.members[1:]) == [16, 64, 112, 160]
    assert {m.initial_state.producer for m in plan.members[1:]} == {0}
    assert sorted(s.local_chunk for s in plan.materialized_states) == [1, 4, 7, 10]


def test_prefix_trajectory_and_several_roots():
    a = [0] * 100
    b = a[:70]  # prefix of a: an internal endpoint, no fork
    c = [1] * 30
    d = [2]
    forest, plan = _plan([a, b, c, d], 32)
    assert forest.roots.size == 3
    assert plan.num_rounds == 1
    assert plan.replay_tokens == 0
    assert len(plan.members) == 3


def test_continuation_choice_matters():
    # Child x has nested forks in later chunks; child y is a short leaf. If y continued the trunk
    # member, x would start a new member (round 2) and x's own forks would need round 3.
    # Continuing x keeps everything in 2 rounds.
    trunk = [0] * 40
    x = [*trunk, 1, *([1] * 60)]
    x2 = [*x[:80], 2, *([2] * 40)]
    x3 = [*x2[:110], 3, *([3] * 40)]
    y = [*trunk, 2, 2, 2]
    forest, plan = _plan([x, x2, x3, y], 16)
    assert plan.num_rounds == 2
    seg = forest.segments
    x_seg = int(forest.segment_of_row[forest.rows_of(0)[41]])
    y_seg = int(forest.segment_of_row[forest.rows_of(3)[41]])
    trunk_member = plan.segment_member[0]
    assert plan.segment_member[x_seg] == trunk_member != plan.segment_member[y_seg]
    assert len(seg) == 7


def test_deep_light_child_continues_over_heavy_shallow_child():
    # y is a very long leaf (most rows), x is short but forks again in later chunks. Continuing
    # the heavy y would give x round 2 and x's own forks round 3; the planner continues x.
    trunk = [0] * 40
    x = [*trunk, 1, *([1] * 100)]
    x2 = [*x[:80], 2, *([2] * 20)]
    x3 = [*x[:110], 3, *([3] * 20)]
    y = [*trunk, 2, *([2] * 600)]
    forest, plan = _plan([x, x2, x3, y], 16)
    assert plan.num_rounds == 2
    y_seg = int(forest.segment_of_row[forest.rows_of(3)[41]])
    assert plan.segment_member[y_seg] != plan.segment_member[0]


def test_summary_and_empty_forest():
    _, plan = _plan([[0] * 50, [0] * 20 + [1] * 10], 16)
    s = plan.summary()
    for key in (
        "rounds",
        "members",
        "replay_tokens",
        "compact_tokens",
        "replay_fraction",
        "materialized_states",
    ):
        assert key in s
    assert s["replay_fraction"] == pytest.approx(s["replay_tokens"] / s["compact_tokens"])
    assert "rounds=" in repr(plan)
    empty = plan_linear_calls(RolloutForest.from_sequences([]), chunk_size=16)
    assert empty.num_rounds == 0 and empty.members == () and empty.summary()["members"] == 0


@pytest.mark.parametrize("bad", [0, -64, 1.5, True, "64", None, 2**63, 2**64])
def test_chunk_size_validation(bad):
    """Also past int64 (was an OverflowError from numpy); 2**63 - 1 still plans."""
    forest = RolloutForest.from_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match="chunk_size"):
        plan_linear_calls(forest, chunk_size=bad)


def test_numpy_int_chunk_size_accepted():
    forest = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4]])
    assert plan_linear_calls(forest, chunk_size=np.int64(2)).chunk_size == 2
    huge = plan_linear_calls(forest, chunk_size=2**63 - 1)
    assert huge.num_rounds == 1 and huge.replay_tokens == 2  # one chunk: replay [0, 2)


@pytest.mark.parametrize("bad", [[[1, 2, 3]], np.array([[1, 2]]), None])
def test_forest_type_validation(bad):
    with pytest.raises(TypeError, match="RolloutForest"):
        plan_linear_calls(bad, chunk_size=16)


@pytest.mark.parametrize("chunk", [1, 2, 16, 64])
def test_single_row_and_forks_at_every_position_of_a_chunk(chunk):
    """A one-row forest, and a trunk with a fork (and a prefix end) at every position of its
    first chunks: valid, exact against trajectory-wise runs, fewest rounds."""
    single = RolloutForest.from_sequences([[7], [7]])
    plan = plan_linear_calls(single, chunk_size=chunk)
    check_plan(single, plan, chunk)
    assert plan.num_rounds == 1 and plan.num_members == 1 and plan.replay_tokens == 0
    trunk = [int(x) for x in np.arange(2 * chunk + 3) % 3]
    seqs = [trunk] + [[*trunk[:f], 3, 0, 1] for f in range(len(trunk))] + [trunk[:5]]
    forest = RolloutForest.from_sequences(seqs)
    plan = plan_linear_calls(forest, chunk_size=chunk)
    check_plan(forest, plan, chunk)
    check_against_trajectories(forest, plan)
    assert plan.num_rounds == 2  # forks need the trunk's state (position 0: a new root)
