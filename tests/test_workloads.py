"""Synthetic workloads: determinism, calibration, turn tree ≡ sequences, shape features, caps,
tiny mode, bad arguments."""

from __future__ import annotations

import time

import numpy as np
import pytest

from harts_verl.tree import RolloutForest
from harts_verl.tree.workloads import WORKLOADS, Workload, grpo_flat, swe_like, tau_like

FOREST_ARRAYS = ("token_ids", "parent", "depth", "multiplicity", "row_offsets", "semantic_rows")


def _forest(w: Workload) -> RolloutForest:
    return RolloutForest.from_sequences(w.sequences, group_ids=w.group_ids)


def _same(a: Workload, b: Workload) -> bool:
    return (
        len(a.sequences) == len(b.sequences)
        and all(np.array_equal(x, y) for x, y in zip(a.sequences, b.sequences))
        and np.array_equal(a.group_ids, b.group_ids)
        and len(a.turns) == len(b.turns)
        and all(
            (s.parent_turn_id, s.is_trajectory_end) == (t.parent_turn_id, t.is_trajectory_end)
            and np.array_equal(s.token_ids, t.token_ids)
            for s, t in zip(a.turns, b.turns)
        )
    )


def test_registry_and_types():
    assert set(WORKLOADS) == {"swe_like", "tau_like", "grpo_flat"}
    for name, gen in WORKLOADS.items():
        w = gen(scale=0.002, seed=3)
        assert isinstance(w, Workload) and w.name == name
        assert w.group_ids.dtype == np.int64 and w.group_ids.shape == (w.num_trajectories,)
        assert all(s.dtype == np.int64 and s.ndim == 1 and s.size > 0 for s in w.sequences)
        vocab = w.params["vocab_size"]
        assert all(int(s.min()) >= 0 and int(s.max()) < vocab for s in w.sequences)
        assert w.num_semantic_tokens == sum(len(s) for s in w.sequences)
        # Groups are numbered 0.. in order of appearance.
        assert w.group_ids[0] == 0 and np.all(np.diff(w.group_ids) >= 0)
        assert w.params["scale"] == 0.002 and w.params["seed"] == 3


@pytest.mark.parametrize("gen", [swe_like, tau_like, grpo_flat])
def test_deterministic_per_seed(gen):
    assert _same(gen(scale=0.01, seed=7), gen(scale=0.01, seed=7))
    assert not _same(gen(scale=0.01, seed=7), gen(scale=0.01, seed=8))


@pytest.mark.parametrize(
    ("gen", "target", "tol"),
    [(swe_like, 5.6, 0.4), (tau_like, 9.4, 0.6)],
)
@pytest.mark.parametrize(("scale", "seed"), [(0.5, 0), (0.5, 1), (1.0, 2), (2.0, 3)])
def test_compression_calibrated(gen, target, tol, scale, seed):
    w = gen(scale=scale, seed=seed)
    f = _forest(w)
    assert abs(f.compression - target) <= tol, f.summary()
    # The trie is exactly the turn tree, and S >= scale x 1M.
    assert f.num_compact_tokens == w.num_turn_tokens
    assert w.compression == pytest.approx(f.compression)
    assert f.num_semantic_tokens >= scale * 1_000_000


@pytest.mark.parametrize("scale", [0.3, 0.01, 0.001])
def test_flat_is_one_level(scale):
    """Also in tiny mode (scale < 0.05: its minimum of 2 steps made every trajectory
    multi-turn)."""
    w = grpo_flat(scale=scale, seed=0)
    f = _forest(w)
    assert w.params["steps"] == (1, 1)
    if scale >= 0.05:
        assert 1.3 < f.compression < 2.2
    assert w.stats["fork_events"] == w.stats["rewrites"] == 0
    # Two turns per trajectory (prompt, response); branch points only at the prompt's last row.
    by_id = {t.turn_id: t for t in w.turns}
    ends = [t for t in w.turns if t.is_trajectory_end]
    assert len(ends) == w.num_trajectories
    assert all(by_id[t.parent_turn_id].parent_turn_id is None for t in ends)
    branch_rows = np.flatnonzero(f.num_children >= 2)
    prompt_lens = {g: len(by_id[t.parent_turn_id].token_ids) for g, t in zip(w.group_ids, ends)}
    assert sorted(f.depth[branch_rows] + 1) == sorted(prompt_lens.values())


@pytest.mark.parametrize(
    ("gen", "scale"), [(swe_like, 0.002), (swe_like, 0.02), (tau_like, 0.01), (grpo_flat, 0.05)]
)
def test_from_turns_equals_from_sequences(gen, scale):
    w = gen(scale=scale, seed=1)
    a = RolloutForest.from_turns(w.turns)
    b = RolloutForest.from_sequences(w.sequences)
    for name in FOREST_ARRAYS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    # Turn ids are list positions, parents come first, no turn is empty.
    for i, t in enumerate(w.turns):
        assert t.turn_id == i and len(t.token_ids) > 0
        assert t.parent_turn_id is None or t.parent_turn_id < i
    # Trajectories are pairwise distinct.
    assert len({s.tobytes() for s in w.sequences}) == w.num_trajectories


def _group_prompt_children(w: Workload) -> dict[int, int]:
    """Children of each group's prompt turn (the parent of the group's first assistant turns)."""
    children: dict[int, int] = {}
    for t in w.turns:
        if t.parent_turn_id is not None:
            children[t.parent_turn_id] = children.get(t.parent_turn_id, 0) + 1
    return children


def _features(w: Workload) -> dict[str, bool]:
    f = _forest(w)
    turn_depth = np.zeros(len(w.turns), dtype=np.int64)
    for t in w.turns:
        if t.parent_turn_id is not None:
            turn_depth[t.turn_id] = turn_depth[t.parent_turn_id] + 1
    children = _group_prompt_children(w)
    first_level = 2 if w.params["num_systems"] > 0 else 1  # depth of the group's first samples
    fork_turns = [p for p, c in children.items() if c >= 2 and turn_depth[p] >= first_level]
    # A rewrite copies turns verbatim under a new parent: equal tokens, different parents.
    seen: dict[bytes, set] = {}
    for t in w.turns:
        seen.setdefault(t.token_ids.tobytes(), set()).add(t.parent_turn_id)
    copies = any(len(parents) > 1 for parents in seen.values())
    # A trajectory that is a proper prefix of another ends on a row with children.
    last_rows = f.semantic_rows[f.row_offsets[1:] - 1]
    return {
        "group_samples": any(
            c >= 2 and turn_depth[p] == first_level - 1 for p, c in children.items()
        ),
        "forks": bool(fork_turns) and bool((f.num_children[f.depth > 0] >= 2).any()),
        "rewrites": w.stats["rewrites"] > 0 and copies,
        "prefix": bool((f.num_children[last_rows] > 0).any()),
    }


@pytest.mark.parametrize("gen", [swe_like, tau_like])
def test_shape_features_present(gen):
    w = gen(scale=0.5, seed=0)
    feats = _features(w)
    assert all(feats.values()), feats
    assert w.stats["fork_events"] > 0 and w.stats["prefix_ends"] > 0
    # Each group prompt has group_size samples below it (forks never start at the prompt).
    depth = {}
    for t in w.turns:
        depth[t.turn_id] = 0 if t.parent_turn_id is None else depth[t.parent_turn_id] + 1
    children = _group_prompt_children(w)
    prompt_depth = 1 if w.params["num_systems"] > 0 else 0
    prompts = [i for i, d in depth.items() if d == prompt_depth]
    lo, hi = w.params["group_size"]
    assert len(prompts) == w.stats["groups"] == int(w.group_ids.max()) + 1
    assert all(lo <= children[p] <= hi for p in prompts)


def test_tiny_mode_size_and_shape():
    seen = dict.fromkeys(("group_samples", "forks", "rewrites", "prefix"), False)
    for seed in range(8):
        w = swe_like(scale=0.001, seed=seed)
        assert 100 <= w.num_semantic_tokens <= 5000, w.num_semantic_tokens
        assert w.params["length_factor"] == pytest.approx(0.02)
        feats = _features(w)
        assert feats["group_samples"] and feats["forks"]
        for k, v in feats.items():
            seen[k] |= v
    assert all(seen.values()), seen
    assert 100 <= tau_like(scale=0.001).num_semantic_tokens <= 5000
    assert grpo_flat(scale=0.001).num_semantic_tokens <= 5000


@pytest.mark.parametrize(
    ("gen", "scale"), [(swe_like, 0.002), (swe_like, 1.0), (tau_like, 0.5), (grpo_flat, 0.001)]
)
def test_path_caps_respected(gen, scale):
    w = gen(scale=scale, seed=2)
    caps = w.params["path_caps"]
    lengths = np.array([len(s) for s in w.sequences])
    limit = np.array([caps[g % len(caps)] for g in w.group_ids])
    assert np.all(lengths <= limit)
    # Trajectories stopped by the cap end exactly at it (last turn truncated, never dropped).
    assert w.stats["capped"] == int((lengths == limit).sum())


def test_large_scale_is_fast_and_uses_every_cap():
    t0 = time.perf_counter()
    w = swe_like(scale=16, seed=0)
    elapsed = time.perf_counter() - t0
    assert w.num_semantic_tokens >= 16_000_000
    assert elapsed < 5.0, elapsed
    assert abs(w.compression - 5.6) <= 0.4
    caps = w.params["path_caps"]
    lengths = np.array([len(s) for s in w.sequences])
    limit = np.array([caps[g % len(caps)] for g in w.group_ids])
    assert set(limit.tolist()) == set(caps)
    assert np.all(lengths <= limit)
    assert w.stats["capped"] == int((lengths == limit).sum()) > 0


def test_overrides():
    w = swe_like(
        scale=0.01, seed=0, target_compression=0, max_forks=0, max_rewrites=0, group_size=(3, 3)
    )
    assert w.stats["fork_events"] == w.stats["rewrites"] == 0
    assert w.stats["samples"] == 3 * w.stats["groups"]
    # Without forks and rewrites every trajectory is a leaf and C = prompts + samples.
    assert w.num_trajectories == w.stats["samples"]
    w = tau_like(scale=0.01, seed=0, vocab_size=1000, path_caps=[2048])
    assert max(int(s.max()) for s in w.sequences) < 1000
    assert max(len(s) for s in w.sequences) <= 2048
    assert w.params["path_caps"] == (2048,)
    # A tiny-mode prompt override is literal and the derived (not overridden) caps fit it.
    w = swe_like(scale=0.001, seed=0, prompt_tokens=(300, 600))
    assert w.params["prompt_tokens"] == (300, 600)
    assert min(w.params["path_caps"]) > 600 + w.params["system_tokens"][1]
    assert max(len(s) for s in w.sequences) <= max(w.params["path_caps"])


def test_small_vocab_keeps_turn_structure():
    # Siblings still differ in their first token, so the trie is the turn tree for any vocab.
    w = swe_like(scale=0.005, seed=4, vocab_size=16)
    f = _forest(w)
    assert max(int(s.max()) for s in w.sequences) < 16
    assert f.num_compact_tokens == w.num_turn_tokens
    assert RolloutForest.from_turns(w.turns).equals(RolloutForest.from_sequences(w.sequences))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"scale": 0}, "scale"),
        ({"scale": -1.0}, "scale"),
        ({"scale": float("nan")}, "scale"),
        ({"scale": float("inf")}, "scale"),
        ({"scale": 257}, "scale"),
        ({"scale": "1"}, "scale"),
        ({"scale": True}, "scale"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"bogus": 1}, "bogus"),
        ({"group_size": (0, 4)}, "group_size"),
        ({"group_size": (5, 4)}, "group_size"),
        ({"steps": 10}, "steps"),
        ({"fork_k": (1, 2)}, "fork_k"),
        ({"path_caps": (100,)}, "path_caps"),
        ({"path_caps": ()}, "path_caps"),
        ({"thinking_prob": 1.5}, "thinking_prob"),
        ({"vocab_size": 1}, "vocab_size"),
        ({"vocab_size": 2**70, "scale": 0.01}, "vocab_size: expected an int in"),  # int64 ids
        ({"vocab_size": 2, "scale": 0.01}, "vocab_size"),  # more sibling turns than ids
        ({"fork_tail": 0.0}, "fork_tail"),
        ({"target_compression": 0.5}, "target_compression"),
        ({"target_compression": float("inf")}, "target_compression: expected 0 .* finite"),
        ({"observation_p95": 10}, "observation_p95"),
        ({"max_forks": -1}, "max_forks"),
        # past float / int64 / array range: one line naming the option (were tracebacks)
        ({"steps": (1, 10**309)}, r"steps: expected bounds <= 2\*\*31 - 1"),
        ({"assistant_tokens": (1, 10**309)}, "assistant_tokens"),
        ({"group_size": (1, 2**64)}, "group_size"),
        ({"fork_k": (2, 2**64)}, "fork_k"),
        ({"placeholder_tokens": 2**64}, r"placeholder_tokens: expected an int <= 2\*\*31 - 1"),
        ({"path_caps": (2**64,)}, "path_caps"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        swe_like(**kwargs)


def test_huge_observation_sizes_do_not_overflow():
    """An observation_p95 / observation_max past float range draws observations clipped at
    the max in log space (exp() overflowed: a traceback from the bench)."""
    f = swe_like(0.002, seed=1, observation_p95=10**300, observation_max=10**300)
    g = swe_like(0.002, seed=1)
    assert f.num_semantic_tokens >= 2000 and g.num_semantic_tokens >= 2000


@pytest.mark.parametrize("gen", [swe_like, tau_like, grpo_flat])
def test_a_scale_past_float_range_is_named(gen):
    """``scale=10**400`` raised OverflowError from float(); it is a ValueError naming scale."""
    with pytest.raises(ValueError, match="scale: expected a finite number > 0"):
        gen(10**400)
