"""RolloutForest vs the naive trie, CSR exactness, from_turns, subset, save/load, bad inputs."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_verl.tree import RolloutForest, Turn
from harts_verl.tree.naive import build_naive_trie

# Random forests with much sharing: small alphabet, sequences built by extending/forking others.
tokens = st.integers(min_value=0, max_value=3)


@st.composite
def forests(draw, max_traj=12, max_len=20):
    n = draw(st.integers(1, max_traj))
    seqs: list[list[int]] = []
    for _ in range(n):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            cut = draw(st.integers(0, len(base)))
            tail = draw(st.lists(tokens, min_size=0 if cut else 1, max_size=max_len))
            seq = base[:cut] + tail
            if not seq:
                seq = [draw(tokens)]
        else:
            seq = draw(st.lists(tokens, min_size=1, max_size=max_len))
        seqs.append(seq)
    return seqs


@settings(max_examples=200, deadline=None)
@given(forests())
def test_forest_matches_naive_trie(seqs):
    f = RolloutForest.from_sequences(seqs)
    ref = build_naive_trie(seqs)
    for name in ("token_ids", "parent", "depth", "multiplicity", "subtree_size"):
        np.testing.assert_array_equal(getattr(f, name), getattr(ref, name), err_msg=name)
    assert f.num_compact_tokens == ref.token_ids.shape[0]
    assert f.num_semantic_tokens == sum(map(len, seqs))
    assert f.compression == pytest.approx(f.num_semantic_tokens / f.num_compact_tokens)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(f.rows_of(i), ref.trajectory_rows[i])
        # CSR rows reproduce the trajectory's tokens exactly (every position once, in order).
        np.testing.assert_array_equal(f.tokens_of(i), s)
        np.testing.assert_array_equal(f.depth[f.rows_of(i)], np.arange(len(s)))
    assert f.row_offsets[-1] == f.semantic_rows.shape[0]
    # Every row is used, multiplicity = number of semantic positions on it.
    np.testing.assert_array_equal(
        np.bincount(f.semantic_rows, minlength=f.num_compact_tokens), f.multiplicity
    )


@settings(max_examples=100, deadline=None)
@given(forests())
def test_preorder_ancestor_rule(seqs):
    f = RolloutForest.from_sequences(seqs)
    c = f.num_compact_tokens
    # Brute-force ancestor relation through parent pointers.
    anc = np.zeros((c, c), dtype=bool)
    for q in range(c):
        k = q
        while k >= 0:
            anc[k, q] = True
            k = f.parent[k]
    kk, qq = np.meshgrid(np.arange(c), np.arange(c), indexing="ij")
    np.testing.assert_array_equal(f.is_ancestor_or_self(kk, qq), anc)
    # Parents precede children (preorder), depth = parent depth + 1.
    has_p = f.parent >= 0
    assert np.all(f.parent[has_p] < np.flatnonzero(has_p))
    np.testing.assert_array_equal(f.depth[has_p], f.depth[f.parent[has_p]] + 1)
    assert np.all(f.depth[~has_p] == 0)


@settings(max_examples=100, deadline=None)
@given(forests())
def test_leaf_order_and_lcp(seqs):
    f = RolloutForest.from_sequences(seqs)
    expected = sorted(range(len(seqs)), key=lambda i: (seqs[i], i))
    np.testing.assert_array_equal(f.leaf_order, expected)
    for j in range(len(seqs) - 1):
        a, b = seqs[expected[j]], seqs[expected[j + 1]]
        m = 0
        while m < min(len(a), len(b)) and a[m] == b[m]:
            m += 1
        assert f.adjacent_lcp[j] == m
    # Leaf-order range work = sum len - sum adjacent LCP.
    assert f.num_compact_tokens == f.num_semantic_tokens - int(f.adjacent_lcp.sum())


@settings(max_examples=100, deadline=None)
@given(forests())
def test_segments(seqs):
    f = RolloutForest.from_sequences(seqs)
    seg = f.segments
    assert seg.length.sum() == f.num_compact_tokens
    np.testing.assert_array_equal(np.cumsum(np.r_[0, seg.length[:-1]]), seg.first_row)
    for s in range(len(seg)):
        rows = np.arange(seg.first_row[s], seg.first_row[s] + seg.length[s])
        # Inside a segment each row is the single child of the previous one.
        assert np.all(f.parent[rows[1:]] == rows[:-1])
        assert np.all(f.num_children[rows[:-1]] == 1)
        p = f.parent[rows[0]]
        if p < 0:
            assert seg.parent_segment[s] == -1
        else:
            assert f.num_children[p] != 1
            ps = seg.parent_segment[s]
            assert seg.first_row[ps] <= p < seg.first_row[ps] + seg.length[ps]
        assert seg.fork_position[s] == f.depth[rows[0]]
    np.testing.assert_array_equal(f.segment_of_row[seg.first_row], np.arange(len(seg)))


@settings(max_examples=100, deadline=None)
@given(forests(), st.data())
def test_subset_equals_rebuild(seqs, data):
    f = RolloutForest.from_sequences(seqs, group_ids=np.arange(len(seqs)) % 3)
    idx = data.draw(st.lists(st.integers(0, len(seqs) - 1), min_size=1, max_size=len(seqs) + 2))
    sub = f.subset(idx)
    ref = RolloutForest.from_sequences([seqs[i] for i in idx], group_ids=(np.asarray(idx) % 3))
    assert sub.equals(ref)
    np.testing.assert_array_equal(sub.group_ids, ref.group_ids)


def _turn_tree(seqs_data):
    """Turns of a random turn tree and the flattened trajectories in end-turn order."""
    turns, flat = [], {}
    for tid, (parent, toks, mark) in enumerate(seqs_data):
        p = None if parent is None or parent >= tid else parent
        turns.append(Turn(tid, p, toks, mark))
        flat[tid] = (flat[p] if p is not None else []) + toks
    has_child = {t.parent_turn_id for t in turns if t.parent_turn_id is not None}
    trajs = [flat[t.turn_id] for t in turns if t.is_trajectory_end or t.turn_id not in has_child]
    return turns, trajs


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(0, 10)),
            st.lists(tokens, min_size=1, max_size=6),
            st.booleans(),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_from_turns_equals_from_sequences(data):
    turns, trajs = _turn_tree(data)
    f = RolloutForest.from_turns(turns)
    assert f.equals(RolloutForest.from_sequences(trajs))
    # dict and tuple records are accepted too
    as_dicts = [
        dict(
            turn_id=t.turn_id,
            parent_turn_id=t.parent_turn_id,
            token_ids=t.token_ids,
            is_trajectory_end=t.is_trajectory_end,
        )
        for t in turns
    ]
    assert RolloutForest.from_turns(as_dicts).equals(f)
    assert RolloutForest.from_turns([tuple(d.values()) for d in as_dicts]).equals(f)


def test_save_load_round_trip(tmp_path):
    seqs = [[5, 6, 7], [5, 6, 8, 9], [5], [4, 4], [5, 6, 7]]
    f = RolloutForest.from_sequences(seqs, group_ids=[0, 0, 1, 2, 0])
    path = tmp_path / "forest.npz"
    f.save(path)
    g = RolloutForest.load(path)
    assert g.equals(f)
    np.testing.assert_array_equal(g.group_ids, f.group_ids)


def test_edge_cases():
    # identical, prefix-of-another, length-1, several roots, large ids (> 2**32)
    big = 2**40
    seqs = [[1, 2, 3], [1, 2, 3], [1, 2], [9], [big, 1], [big, 0]]
    f = RolloutForest.from_sequences(seqs)
    ref = build_naive_trie(seqs)
    np.testing.assert_array_equal(f.token_ids, ref.token_ids)
    np.testing.assert_array_equal(f.multiplicity, ref.multiplicity)
    assert f.roots.shape[0] == 3
    assert f.num_compact_tokens == 3 + 1 + 3
    np.testing.assert_array_equal(f.rows_of(0), f.rows_of(1))
    np.testing.assert_array_equal(f.rows_of(2), f.rows_of(0)[:2])
    empty = RolloutForest.from_sequences([])
    assert empty.num_compact_tokens == 0 and empty.compression == 1.0
    # numpy inputs of any integer dtype
    g = RolloutForest.from_sequences([np.array([1, 2], np.uint8), np.array([1, 3], np.int32)])
    assert g.num_compact_tokens == 3


@pytest.mark.parametrize(
    ("seqs", "match"),
    [
        ([[1, 2], []], r"sequences\[1\]: empty"),
        ([[1, 2], [1.5, 2.0]], r"sequences\[1\]: token ids must be integers"),
        ([[1, 2], [3, -1]], r"sequences\[1\]: negative token id"),
        ([[1, 2], [[1, 2], [3]]], r"sequences\[1\]: ragged"),
        ([[1], [[1, 2], [3, 4]]], r"sequences\[1\]: expected a 1-D"),
        ([[1], "abc"], r"sequences\[1\]: expected a 1-D sequence of token ids, got a string"),
        ([[True, False]], r"sequences\[0\]: token ids must be integers"),
        # a bool among ints: numpy would make [True, 5] int64 [1, 5]
        ([[1], [True, 5]], r"sequences\[1\]: token ids must be integers, got a bool"),
        ([[3, np.True_]], r"sequences\[0\]: token ids must be integers, got a bool"),
        ([bytearray(b"ab")], r"sequences\[0\]: expected a 1-D sequence of token ids, got a str"),
        # one trajectory passed as the whole batch: its first id is no trajectory
        ([5, 6], r"sequences\[0\]: expected a 1-D .* got the single value 5 .*wrap one"),
        ([5, 6], r"sequences is a list of trajectories: wrap one trajectory in a list"),
        # Python ints past int64 turn the array into floats/objects: name the value instead.
        ([[1], [-1, 2**63]], r"sequences\[1\]: token id 9223372036854775808 does not fit in int64"),
        ([[2**64]], r"sequences\[0\]: token id 18446744073709551616 does not fit in int64"),
        ([[2**63]], r"sequences\[0\]: token id 9223372036854775808 does not fit in int64"),
        ([[1, -(2**64)]], r"sequences\[0\]: negative token id -18446744073709551616"),
        ([np.array([2**64 - 1], np.uint64)], r"sequences\[0\]: token id 1844\d+ does not fit"),
        ([[1, None]], r"sequences\[0\]: expected integer token ids"),
    ],
)
def test_bad_inputs(seqs, match):
    with pytest.raises(ValueError, match=match):
        RolloutForest.from_sequences(seqs)


def test_token_tensors_with_a_gradient_are_judged_by_their_values():
    """A tensor that requires grad is read through ``detach`` (no RuntimeError from numpy):
    float ids are refused by name like any float ids."""
    torch = pytest.importorskip("torch")
    ids = torch.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(ValueError, match=r"sequences\[1\]: token ids must be integers"):
        RolloutForest.from_sequences([[1, 2], ids])
    f = RolloutForest.from_sequences([torch.tensor([1, 2, 3]), [1, 2, 4]])
    assert f.num_compact_tokens == 4


def test_unordered_batches_are_refused():
    """A mapping (it iterates over its keys) or a set (no order) is no batch: TypeError naming
    its type. An ordered iterable (a generator) is a batch."""
    for batch in ({"a": [1, 2]}, {(1, 2), (1, 3)}, frozenset({(1, 2)})):
        with pytest.raises(TypeError, match=rf"sequences: .*got {type(batch).__name__}"):
            RolloutForest.from_sequences(batch)
    assert RolloutForest.from_sequences(s for s in ([1, 2], [1, 3])).num_compact_tokens == 3


def test_bad_group_ids_and_turns():
    with pytest.raises(ValueError, match="group_ids"):
        RolloutForest.from_sequences([[1], [2]], group_ids=[0])
    with pytest.raises(ValueError, match="unknown parent_turn_id"):
        RolloutForest.from_turns([Turn(0, None, [1]), Turn(1, 7, [2])])
    with pytest.raises(ValueError, match="duplicate turn_id"):
        RolloutForest.from_turns([Turn(0, None, [1]), Turn(0, None, [2])])
    with pytest.raises(ValueError, match=r"turns\[1\]: empty"):
        RolloutForest.from_turns([Turn(0, None, [1]), Turn(1, 0, [])])
    with pytest.raises(ValueError, match="cycle"):
        RolloutForest.from_turns([Turn(0, 1, [1]), Turn(1, 0, [2])])
    with pytest.raises(ValueError, match="out of range"):
        RolloutForest.from_sequences([[1]]).rows_of(3)
    with pytest.raises(ValueError, match="trajectory_indices"):
        RolloutForest.from_sequences([[1]]).subset([1])
    # bools among ints are refused, as a bool array is (numpy would read True as 1)
    with pytest.raises(ValueError, match="group_ids: expected integers, got a bool"):
        RolloutForest.from_sequences([[1], [2]], group_ids=[True, 5])
    with pytest.raises(ValueError, match="trajectory_indices"):
        RolloutForest.from_sequences([[1, 2], [1, 3], [4]]).subset([True, 2])
    with pytest.raises(ValueError, match="k: expected integer row indices, got a bool"):
        RolloutForest.from_sequences([[1, 2], [1, 3]]).is_ancestor_or_self([True, 0], 1)


def test_group_ids_are_the_forests_own():
    """A forest copies the caller's group ids (it used to keep a view: writing the caller's
    array rewrote the forest's groups)."""
    gids = np.array([7, 8])
    f = RolloutForest.from_sequences([[1, 2], [1, 3]], group_ids=gids)
    e = RolloutForest.expanded([[1, 2], [1, 3]], group_ids=gids)
    gids[:] = -1
    assert f.group_ids.tolist() == [7, 8] and e.group_ids.tolist() == [7, 8]


@pytest.mark.parametrize(
    ("turns", "match"),
    [
        # a 2-cycle and a self-parent that no turn hangs off (used to be dropped silently)
        ([Turn("a", None, [1, 2]), Turn("x", "y", [7]), Turn("y", "x", [8])], r"'x' -> 'y' -> 'x'"),
        ([Turn("a", None, [1, 2]), Turn("s", "s", [9])], r"turns\[1\] \(turn_id 's'\).*cycle"),
        ([Turn("s", "s", [9], True)], r"turns\[0\].*cycle \('s' -> 's'\)"),
        # a chain hanging off a cycle: the cycle is named, not the chain
        (
            [Turn("a", None, [1]), Turn("c", "d", [2]), Turn("d", "c", [3]), Turn("e", "c", [4])],
            r"turns\[1\] \(turn_id 'c'\): parent links form a cycle \('c' -> 'd' -> 'c'\)",
        ),
        ([Turn(0, 1, [1]), Turn(1, 0, [2])], r"turns\[0\] \(turn_id 0\).*cycle"),
    ],
)
def test_from_turns_refuses_every_parent_cycle(turns, match):
    """Every turn must lead to a root: cycles are refused whether or not an end turn hangs off
    them (before, a cycle without a leaf under it vanished from the forest)."""
    with pytest.raises(ValueError, match=match):
        RolloutForest.from_turns(turns)


def test_from_turns_checks_ids_and_end_flags():
    with pytest.raises(TypeError, match=r"turns\[0\]\.turn_id"):
        RolloutForest.from_turns([Turn([1], None, [1])])
    with pytest.raises(TypeError, match=r"turns\[1\]\.parent_turn_id"):
        RolloutForest.from_turns(
            [Turn(0, None, [1]), {"turn_id": 1, "parent_turn_id": [0], "token_ids": [1]}]
        )
    # 'False' is truthy: a string flag is refused, not read as True
    for flag in ("False", 1, None):
        bad = {"turn_id": 0, "parent_turn_id": None, "token_ids": [1], "is_trajectory_end": flag}
        child = {"turn_id": 1, "parent_turn_id": 0, "token_ids": [2]}
        with pytest.raises(TypeError, match=r"turns\[0\]\.is_trajectory_end: expected a bool"):
            RolloutForest.from_turns([bad, child])
        with pytest.raises(TypeError, match=r"turns\[1\]\.is_trajectory_end"):
            RolloutForest.from_turns([(0, None, [1]), (1, 0, [2], flag)])
    # a misspelt key is refused: read as absent, it would drop the end of trajectory [1]
    typo = {"turn_id": 0, "parent_turn_id": None, "token_ids": [1], "is_trajectory_ends": True}
    child = {"turn_id": 1, "parent_turn_id": 0, "token_ids": [2]}
    with pytest.raises(ValueError, match=r"turns\[0\]: unknown keys \['is_trajectory_ends'\]"):
        RolloutForest.from_turns([typo, child])
    # numpy bools are bools
    f = RolloutForest.from_turns([Turn(0, None, [1], np.bool_(True)), Turn(1, 0, [2])])
    assert [s.tolist() for s in f.sequences] == [[1], [1, 2]]


@pytest.mark.parametrize(
    "group_ids",
    [
        np.array([2**64 - 1, 2**63], np.uint64),
        np.array([0, 2**63], np.uint64),
        [0, 2**63],
        [0, 2**64],
        [0, -(2**64)],
    ],
)
def test_group_ids_outside_int64_are_refused(group_ids):
    """They used to wrap around silently (2**64 - 1 became -1); ``load`` refuses them too."""
    with pytest.raises(ValueError, match=r"group_ids: value -?\d+ does not fit in int64"):
        RolloutForest.from_sequences([[1], [2]], group_ids=group_ids)


def test_group_ids_within_int64_are_kept():
    gids = np.array([0, 2**63 - 1], np.uint64)
    f = RolloutForest.from_sequences([[1], [2]], group_ids=gids)
    np.testing.assert_array_equal(f.group_ids, [0, 2**63 - 1])
    g = RolloutForest.from_sequences([[1], [2]], group_ids=[-5, 3])  # negative ids are ids
    np.testing.assert_array_equal(g.group_ids, [-5, 3])


def test_equals_compares_group_ids():
    a = RolloutForest.from_sequences([[1, 2], [1, 3]], group_ids=[0, 0])
    b = RolloutForest.from_sequences([[1, 2], [1, 3]], group_ids=[7, 9])
    assert not a.equals(b) and not b.equals(a)
    assert a.equals(b, group_ids=False)  # same rows when group ids do not matter
    assert a.equals(RolloutForest.from_sequences([[1, 2], [1, 3]]))  # default ids are zeros
    assert b.equals(RolloutForest.from_sequences([[1, 2], [1, 3]], group_ids=[7, 9]))
    # None counts as the default (all zeros)
    c = RolloutForest.from_sequences([[1, 2], [1, 3]])
    c.group_ids = None
    assert c.equals(a) and a.equals(c) and not c.equals(b)
    assert not a.equals([[1, 2], [1, 3]])  # type: ignore[arg-type]


def test_is_ancestor_or_self_checks_rows():
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4]])  # 4 rows
    assert bool(f.is_ancestor_or_self(0, 3)) and not bool(f.is_ancestor_or_self(2, 3))
    for k, q in ((10, 0), (-1, 0), (0, 4), (0, -1), (np.array([0, 4]), 0)):
        with pytest.raises(ValueError, match="out of range for 4 compact rows"):
            f.is_ancestor_or_self(k, q)
    with pytest.raises(ValueError, match="k: expected integer row"):
        f.is_ancestor_or_self(0.0, 1)
    with pytest.raises(ValueError, match="q: expected integer row"):
        f.is_ancestor_or_self(0, True)


@settings(max_examples=50, deadline=None)
@given(forests())
def test_expanded_layout(seqs):
    e = RolloutForest.expanded(seqs)
    assert e.num_compact_tokens == e.num_semantic_tokens == sum(map(len, seqs))
    np.testing.assert_array_equal(e.semantic_rows, np.arange(e.num_semantic_tokens))
    np.testing.assert_array_equal(e.multiplicity, 1)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(e.tokens_of(i), s)
        r = e.rows_of(i)
        assert e.parent[r[0]] == -1 and np.all(e.parent[r[1:]] == r[:-1])


def test_expanded_subset_stays_expanded_and_repeats_share():
    """A subset of an expanded layout shares nothing between distinct trajectories, identical
    ones included; a repeated index is one trajectory twice and shares all its rows."""
    seqs = [[1, 2, 3], [1, 2, 3], [1, 2, 4], [4, 5]]
    e = RolloutForest.expanded(seqs)
    assert e.subset([0, 1, 3]).equals(RolloutForest.expanded([seqs[0], seqs[1], seqs[3]]))
    assert e.subset([0, 1, 2]).num_compact_tokens == 9
    rep = e.subset([3, 3, 0])
    assert rep.num_compact_tokens == 2 + 3 and rep.num_semantic_tokens == 7
    np.testing.assert_array_equal(rep.rows_of(0), rep.rows_of(1))


def test_empty_forests_have_no_sequences():
    """An empty forest (no trajectories) lists no trajectories, however it was built."""
    empty = RolloutForest.from_sequences([])
    assert empty.sequences == []
    assert RolloutForest.from_sequences(np.zeros((0, 3), np.int64)).sequences == []
    assert RolloutForest.expanded([]).sequences == []
    f = RolloutForest.from_sequences([[1, 2], [1, 3]])
    assert f.subset([]).sequences == [] and f.subset([]).num_trajectories == 0


def test_save_writes_the_given_path(tmp_path):
    """``save(p)`` then ``load(p)`` round-trips for any file name (numpy would append .npz)."""
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4], [7]], group_ids=[3, 3, 4])
    for name in ("forest", "forest.npz", "forest.bin"):
        f.save(tmp_path / name)
        assert (tmp_path / name).exists()
        assert RolloutForest.load(tmp_path / name).equals(f)
        assert RolloutForest.load(str(tmp_path / name)).equals(f)
    e = RolloutForest.expanded([[1, 2], [1, 2]])  # a non-trie layout round-trips as is
    e.save(tmp_path / "expanded")
    assert RolloutForest.load(tmp_path / "expanded").equals(e)


def _write_forest_file(path, **overrides):
    arrays = {
        "format_version": np.int64(1),
        "flat_tokens": np.array([1, 2, 3, 1, 2, 4]),
        "row_offsets": np.array([0, 3, 6]),
        "group_ids": np.zeros(2, np.int64),
        "leaf_order": np.array([0, 1]),
        "adjacent_lcp": np.array([2]),
    }
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})


def test_load_names_an_npz_that_is_no_forest(tmp_path):
    path = tmp_path / "other.npz"
    np.savez(path, a=np.arange(3))
    with pytest.raises(ValueError, match=r"not a forest file .*'a'"):
        RolloutForest.load(path)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"row_offsets": None}, "missing array 'row_offsets'"),
        ({"row_offsets": np.array([0, 3, 9])}, "row_offsets"),
        ({"row_offsets": np.array([0, 3, 3, 6])}, "row_offsets"),  # an empty trajectory
        ({"flat_tokens": np.array([1.0, 2, 3, 1, 2, 4])}, "flat_tokens"),
        ({"flat_tokens": np.array([1, 2, 3, 1, -2, 4])}, "flat_tokens"),
        ({"group_ids": np.zeros(3, np.int64)}, "group_ids"),
        ({"leaf_order": np.array([0, 5])}, "leaf_order"),
        ({"leaf_order": np.array([1, 1])}, "leaf_order"),
        ({"adjacent_lcp": np.array([2, 0])}, "adjacent_lcp"),
        ({"adjacent_lcp": np.array([3])}, r"adjacent_lcp\[0\]"),  # claims a shared 3rd token
        ({"adjacent_lcp": np.array([-1])}, "adjacent_lcp"),
        # format_version: one integer, nothing that merely converts to 1
        ({"format_version": np.array([1, 1])}, r"format_version: expected one integer.*\(2,\)"),
        ({"format_version": np.array([1, "a"], dtype=object)}, "format_version"),
        ({"format_version": np.array("1")}, "format_version: expected one integer"),
        ({"format_version": np.float64(1.5)}, "format_version: expected one integer"),
        ({"format_version": np.float64(1.0)}, "format_version: expected one integer"),
        ({"format_version": np.bool_(True)}, "format_version: expected one integer"),
        ({"format_version": np.int64(2)}, "unsupported forest format version 2"),
    ],
)
def test_load_rejects_inconsistent_files(tmp_path, overrides, match):
    """A damaged or hand-made file raises ValueError naming the array, never a deep
    IndexError/KeyError or a forest with silently wrong tokens."""
    path = tmp_path / "bad.npz"
    _write_forest_file(path, **overrides)
    with pytest.raises(ValueError, match=match):
        RolloutForest.load(path)


def test_load_accepts_a_consistent_hand_made_file(tmp_path):
    path = tmp_path / "ok.npz"
    _write_forest_file(path)
    assert RolloutForest.load(path).equals(RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4]]))
    _write_forest_file(path, adjacent_lcp=np.array([0]))  # sharing less is a valid layout
    g = RolloutForest.load(path)
    assert g.num_compact_tokens == 6 and [s.tolist() for s in g.sequences] == [
        [1, 2, 3],
        [1, 2, 4],
    ]


def test_load_rejects_other_files(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(3))
    with pytest.raises(ValueError, match="not a forest file"):
        RolloutForest.load(tmp_path / "a.npy")
    (tmp_path / "t.txt").write_text("hello")  # numpy's "pickled data" is not the message
    with pytest.raises(ValueError, match=r"not a forest file \(expected an \.npz archive\)$"):
        RolloutForest.load(tmp_path / "t.txt")


def test_load_names_a_corrupted_member(tmp_path):
    """A flipped byte inside a compressed array (its CRC or its deflate stream fails when the
    member is read, after np.load opened the archive) is a ValueError naming the file, not a
    zlib.error / BadZipFile."""
    import zipfile

    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2], [4], [1, 2, 3]])
    good = tmp_path / "f.npz"
    f.save(good)
    raw = good.read_bytes()
    with zipfile.ZipFile(good) as zf:
        info = zf.getinfo("flat_tokens.npy")
    start = info.header_offset + 30 + int.from_bytes(raw[info.header_offset + 26 :][:2], "little")
    start += int.from_bytes(raw[info.header_offset + 28 :][:2], "little")
    for k in range(0, info.compress_size, 5):
        bad = bytearray(raw)
        bad[start + k] ^= 0xFF
        path = tmp_path / f"bad{k}.npz"
        path.write_bytes(bytes(bad))
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: corrupted forest file"):
            RolloutForest.load(path)


@pytest.mark.parametrize("member", ["flat_tokens", "format_version"])
def test_load_names_a_damaged_array_header(tmp_path, member):
    """An array header numpy cannot parse (an unbalanced bracket: tokenize.TokenError) or one
    claiming more data than the file holds (a huge shape: numpy allocated it first,
    MemoryError) is a ValueError naming the file and the array."""
    import zipfile

    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2], [4]])
    good = tmp_path / "f.npz"
    f.save(good)
    with zipfile.ZipFile(good) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    body = members[f"{member}.npy"]
    n = int.from_bytes(body[8:10], "little")  # a version 1.0 header
    header = body[10 : 10 + n].decode("latin1")
    shape = header[header.index("'shape': ") + 9 : header.index("), ") + 1]
    for name, new_shape in [("unbalanced", "(3(,)"), ("huge", "(9999999999999,)")]:
        text = header.replace(shape, new_shape).rstrip("\n").rstrip()
        text = text.ljust(n - 1) + "\n"
        assert len(text) == n
        path = tmp_path / f"{name}.npz"
        with zipfile.ZipFile(path, "w") as zf:
            for fn, data in members.items():
                zf.writestr(
                    fn,
                    body[:10] + text.encode("latin1") + body[10 + n :]
                    if fn == f"{member}.npy"
                    else data,
                )
        match = rf"{re.escape(str(path))}: corrupted forest file \(array '{member}'"
        with pytest.raises(ValueError, match=match):
            RolloutForest.load(path)


def test_unconvertible_token_tensor_names_the_trajectory():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"sequences\[1\]"):
        RolloutForest.from_sequences([[1, 2], torch.tensor([1.0, 2.0], dtype=torch.bfloat16)])
    # a meta tensor (no data): torch's NotImplementedError before
    with pytest.raises(ValueError, match=r"sequences\[1\]: a meta tensor holds no token ids"):
        RolloutForest.from_sequences([[1, 2], torch.tensor([1, 2], device="meta")])


def test_mixed_numpy_integer_scalars_are_exact():
    """A list mixing numpy uint64 and signed integer scalars (numpy promotes them to float64)
    is read exactly, not refused as floats; ids beyond int64 and real floats still are."""
    f = RolloutForest.from_sequences([[np.uint64(5), np.int64(3), 7], [np.uint8(5), np.int32(3)]])
    assert [s.tolist() for s in f.sequences] == [[5, 3, 7], [5, 3]]
    big = np.uint64(2**63 + 5)
    with pytest.raises(ValueError, match=r"sequences\[0\]: token id 9223372036854775813"):
        RolloutForest.from_sequences([[big, np.int64(3)]])
    with pytest.raises(ValueError, match="must be integers, got dtype float64"):
        RolloutForest.from_sequences([[np.uint64(5), 1.5]])


def test_rows_of_returns_a_copy():
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2]])
    before = f.semantic_rows.copy()
    r = f.rows_of(0)
    r[:] = 0
    assert np.array_equal(f.semantic_rows, before) and f.rows_of(1).tolist() == [0, 1]


def test_turn_errors_are_short_and_name_the_turn():
    """A long parent-link cycle is named by its start and end (not every turn); an empty turn
    is called a turn."""
    n = 5000
    turns = [Turn(0, None, [1])] + [Turn(k, k % (n - 1) + 1, [2]) for k in range(1, n)]
    with pytest.raises(ValueError, match=r"cycle \(1 -> 2 -> 3 -> 4 -> \.\.\. \(4994 more\)") as e:
        RolloutForest.from_turns(turns)
    assert len(str(e.value)) < 300
    with pytest.raises(ValueError, match=r"turns\[1\]: empty turn"):
        RolloutForest.from_turns([Turn(0, None, [1]), Turn(1, 0, [])])


def test_object_arrays_of_python_ints_are_token_sequences():
    """A 2-D object array of Python ints (e.g. ``np.array(list_of_int_arrays, dtype=object)``
    with equal lengths) builds the same forest as the lists; its bad items are still named."""
    lists = [[1, 2, 3], [1, 2, 4]]
    obj = np.array([np.array(x) for x in lists], dtype=object)
    assert obj.shape == (2, 3) and obj.dtype == object
    a, b = RolloutForest.from_sequences(obj), RolloutForest.from_sequences(lists)
    assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.parent, b.parent)
    bad = np.empty((2, 2), dtype=object)
    bad[0] = [1, 2]
    bad[1] = [3, True]
    with pytest.raises(ValueError, match=r"sequences\[1\]: .*bool"):
        RolloutForest.from_sequences(bad)
    bad[1] = [3, 2**70]
    with pytest.raises(ValueError, match=r"sequences\[1\]: token id .* does not fit in int64"):
        RolloutForest.from_sequences(bad)


def test_check_vocabulary_names_the_trajectory_and_checks_its_argument():
    f = RolloutForest.from_sequences([[1, 2], [1, 7, 3]])
    f.check_vocabulary(8)
    f.check_vocabulary(np.int64(8))
    with pytest.raises(ValueError, match=r"sequences\[1\]: token id 7 at position 1 .*size 7"):
        f.check_vocabulary(7)
    for bad in (None, 3.5, True, 0, "8"):
        with pytest.raises(ValueError, match="vocab_size: expected an int >= 1"):
            f.check_vocabulary(bad)


def test_from_turns_refuses_a_non_iterable():
    with pytest.raises(TypeError, match="turns: expected an iterable of turns, got NoneType"):
        RolloutForest.from_turns(None)


def test_constructor_checks_its_arrays():
    """The constructor takes the file arrays: consistent ones give the forest of
    ``from_sequences`` (or a valid non-trie layout with smaller LCPs); a false LCP or a leaf
    order that is no permutation is refused, naming the array."""
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4, 5], [1, 2], [7]], group_ids=[0, 1, 1, 2])
    arrays = (
        f.token_ids[f.semantic_rows],
        f.row_offsets,
        f.group_ids,
        f.leaf_order,
        f.adjacent_lcp,
    )
    assert RolloutForest(*arrays).equals(f)
    flat, off = np.array([1, 2, 3, 4]), np.array([0, 2, 4])
    low = RolloutForest(flat, off, None, np.array([0, 1]), np.array([0]))
    assert [s.tolist() for s in low.sequences] == [[1, 2], [3, 4]]
    assert low.num_compact_tokens == 4
    with pytest.raises(ValueError, match=r"adjacent_lcp\[0\].*differ"):
        RolloutForest(flat, off, np.zeros(2, np.int64), np.array([0, 1]), np.array([2]))
    with pytest.raises(ValueError, match=r"leaf_order.*permutation"):
        RolloutForest(flat, off, np.zeros(2, np.int64), np.array([0, 0]), np.array([0]))
    with pytest.raises(ValueError, match="row_offsets"):
        RolloutForest(flat, np.array([0, 2, 5]), None, np.array([0, 1]), np.array([0]))


def test_a_forest_built_without_checks_and_without_group_ids_saves_and_subsets(tmp_path):
    """``check=False`` with ``group_ids=None`` (the from_sequences default) gives all-zero group
    ids like the checked path: ``save`` wrote ``None`` as a pickled object array that ``load``
    refused ("not a forest file"), and ``subset`` raised a TypeError."""
    f = RolloutForest.from_sequences([[1, 2], [1, 3]])
    flat = f.token_ids[f.semantic_rows]
    g = RolloutForest(flat, f.row_offsets, None, f.leaf_order, f.adjacent_lcp, check=False)
    assert g.group_ids.tolist() == [0, 0] and g.equals(f)
    g.save(tmp_path / "g.npz")
    assert RolloutForest.load(tmp_path / "g.npz").equals(f)
    assert g.subset([1]).equals(f.subset([1]))
