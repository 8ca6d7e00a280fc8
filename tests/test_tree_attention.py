"""Tree attention equals trajectory-wise causal attention (outputs and gradients, float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _strategies import shared_sequences as _shared_sequences
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_verl.ops.tree_attention import (
    build_attention_plan,
    tree_attention,
    tree_attention_dense_ref,
)
from harts_verl.tree.forest import RolloutForest

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny ops: intra-op threads only add wake-up latency (and contend with other jobs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- forests
def shared_sequences(max_new: int = 7):
    """This file's sizes: longer tails and extensions than the conv tests."""
    return _shared_sequences(max_new=max_new, short_tail=10, max_ext=12)


# ----------------------------------------------------------------------------- references
def traj_attention(q, k, v, rows, *, scale, gate=None):
    """Standard causal attention on one trajectory's own gathered rows (SDPA is_causal)."""
    rep = q.shape[1] // k.shape[1]
    qi = q[rows].transpose(0, 1)
    ki = k[rows].repeat_interleave(rep, dim=1).transpose(0, 1)
    vi = v[rows].repeat_interleave(rep, dim=1).transpose(0, 1)
    o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(0, 1)
    if gate is not None:
        o = o * torch.sigmoid(gate[rows])
    return o


def per_trajectory(forest, q, k, v, *, scale, gate=None):
    """``[S, Hq, Dv]``: every trajectory computed on its own, concatenated in CSR order."""
    outs = [
        traj_attention(q, k, v, torch.from_numpy(forest.rows_of(i)), scale=scale, gate=gate)
        for i in range(forest.num_trajectories)
    ]
    return torch.cat(outs, dim=0)


def semantic(forest, o):
    """Compact outputs restored per semantic position (shared rows: gradients are summed)."""
    return o[torch.from_numpy(forest.semantic_rows)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, with a 1e-4 floor on the denominator: a gradient that is exactly
    zero in the reference (a one-token trajectory's dq) may be ~1e-17 on the other side."""
    if not b.numel():
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-4))


def maxabs(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def make_inputs(c, hq, hkv, dqk, dv, *, gate, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(c, hq, dqk, generator=g, dtype=F64).to(dtype).requires_grad_()
    k = torch.randn(c, hkv, dqk, generator=g, dtype=F64).to(dtype).requires_grad_()
    v = torch.randn(c, hkv, dv, generator=g, dtype=F64).to(dtype).requires_grad_()
    gt = torch.randn(c, hq, dv, generator=g, dtype=F64).to(dtype).requires_grad_() if gate else None
    return q, k, v, gt


def grads(loss, tensors):
    leaves = [t for t in tensors if t is not None]
    return torch.autograd.grad(loss, leaves)


# ----------------------------------------------------------------------------- properties
@settings(max_examples=50, deadline=None)
@given(
    seqs=shared_sequences(),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    dims=st.sampled_from([(8, 8), (8, 6), (4, 10)]),
    use_gate=st.booleans(),
    ratio=st.sampled_from([0.0, 0.25, 1.0, math.inf]),
    budget=st.sampled_from([1, 64, 1 << 26]),
    seed=st.integers(0, 2**16),
)
def test_matches_trajectorywise(seqs, heads, dims, use_gate, ratio, budget, seed):
    forest = RolloutForest.from_sequences(seqs)
    (hq, hkv), (dqk, dv) = heads, dims
    c = forest.num_compact_tokens
    q, k, v, gate = make_inputs(c, hq, hkv, dqk, dv, gate=use_gate, seed=seed)
    scale = 0.7 / math.sqrt(dqk)
    plan = build_attention_plan(forest, max_pad_ratio=ratio, max_bucket_elements=budget)
    if math.isfinite(ratio):
        assert plan.padded_work <= (1 + ratio) * plan.rect_work * (1 + 1e-12)
    assert plan.work == int((forest.depth + 1).sum())

    o = tree_attention(q, k, v, plan, scale=scale, gate=gate)
    assert o.shape == (c, hq, dv) and o.dtype == F64
    ref = per_trajectory(forest, q, k, v, scale=scale, gate=gate)
    tree_sem = semantic(forest, o)
    assert maxabs(tree_sem - ref) <= 1e-10

    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(ref.shape, generator=g, dtype=F64)  # w_{i,t} · R_{i,t}
    g_tree = grads((tree_sem * w).sum(), (q, k, v, gate))
    g_ref = grads((ref * w).sum(), (q, k, v, gate))
    for a, b in zip(g_tree, g_ref):
        assert rel_err(a, b) <= 1e-9

    # Trajectory-wise layout through the same op: q/k/v gathered from the same compact leaves.
    fe = RolloutForest.expanded(seqs)
    sem = torch.from_numpy(forest.semantic_rows)
    plan_e = build_attention_plan(fe, max_pad_ratio=ratio, max_bucket_elements=budget)
    o_e = tree_attention(
        q[sem], k[sem], v[sem], plan_e, scale=scale, gate=None if gate is None else gate[sem]
    )
    exp_sem = semantic(fe, o_e)
    assert maxabs(exp_sem - ref) <= 1e-10
    g_exp = grads((exp_sem * w).sum(), (q, k, v, gate))
    for a, b in zip(g_exp, g_ref):
        assert rel_err(a, b) <= 1e-9


@settings(max_examples=30, deadline=None)
@given(seqs=shared_sequences(), use_gate=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_dense_oracle(seqs, use_gate, seed):
    forest = RolloutForest.from_sequences(seqs)
    c = forest.num_compact_tokens
    q, k, v, gate = make_inputs(c, 4, 2, 8, 8, gate=use_gate, seed=seed)
    o = tree_attention(q, k, v, build_attention_plan(forest), gate=gate)
    od = tree_attention_dense_ref(q, k, v, forest, gate=gate)
    assert maxabs(o - od) <= 1e-10
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    for a, b in zip(grads((o * w).sum(), (q, k, v, gate)), grads((od * w).sum(), (q, k, v, gate))):
        assert rel_err(a, b) <= 1e-9


# ----------------------------------------------------------------------------- fixed cases
SEQS = [
    [1, 2, 3, 4, 5, 6, 7, 8],
    [1, 2, 3, 4, 9, 9, 9],
    [1, 2, 3, 4, 9, 9, 9, 5, 5],  # extends another trajectory at its end
    [1, 2, 3],  # prefix of others
    [1, 2, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
    [2, 2, 2, 2],  # second root
    [1, 2, 3, 4, 5, 6, 7, 8],  # duplicate
]


def test_segments_and_fixed_forest():
    forest = RolloutForest.from_sequences(SEQS)
    plan = build_attention_plan(forest)
    assert plan.num_segments == len(forest.segments)
    c = forest.num_compact_tokens
    q, k, v, gate = make_inputs(c, 2, 2, 8, 8, gate=True, seed=3)
    o = tree_attention(q, k, v, plan, gate=gate)
    ref = per_trajectory(forest, q, k, v, scale=1 / math.sqrt(8), gate=gate)
    assert maxabs(semantic(forest, o) - ref) <= 1e-10


def test_gqa_shapes():
    forest = RolloutForest.from_sequences(SEQS)
    c = forest.num_compact_tokens
    q, k, v, _ = make_inputs(c, 4, 2, 16, 16, gate=False, seed=5)
    o = tree_attention(q, k, v, build_attention_plan(forest))
    assert o.shape == (c, 4, 16)
    ref = per_trajectory(forest, q, k, v, scale=0.25)
    assert maxabs(semantic(forest, o) - ref) <= 1e-10
    # Query heads 0,1 share kv head 0; heads 2,3 share kv head 1.
    o_h01 = tree_attention(q[:, :2], k[:, :1], v[:, :1], build_attention_plan(forest))
    assert maxabs(o[:, :2] - o_h01) <= 1e-12


def test_mla_shapes_shared_rope_key():
    """MLA: qk dim 24 = 16 (nope, per head) + 8 (rope, one key part shared by all heads), v 16."""
    forest = RolloutForest.from_sequences(SEQS)
    c, h = forest.num_compact_tokens, 3
    g = torch.Generator().manual_seed(11)
    q = torch.randn(c, h, 24, generator=g, dtype=F64, requires_grad=True)
    k_nope = torch.randn(c, h, 16, generator=g, dtype=F64, requires_grad=True)
    k_rope = torch.randn(c, 1, 8, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(c, h, 16, generator=g, dtype=F64, requires_grad=True)
    gate = torch.randn(c, h, 16, generator=g, dtype=F64, requires_grad=True)

    def make_k():
        return torch.cat([k_nope, k_rope.expand(c, h, 8)], dim=-1)

    scale = 1 / math.sqrt(24)
    o = tree_attention(q, make_k(), v, build_attention_plan(forest), scale=scale, gate=gate)
    assert o.shape == (c, h, 16)
    tree_sem = semantic(forest, o)
    ref = per_trajectory(forest, q, make_k(), v, scale=scale, gate=gate)
    assert maxabs(tree_sem - ref) <= 1e-10
    w = torch.randn(ref.shape, generator=g, dtype=F64)
    leaves = (q, k_nope, k_rope, v, gate)
    g_tree = grads((tree_sem * w).sum(), leaves)
    g_ref = grads((ref * w).sum(), leaves)
    for a, b in zip(g_tree, g_ref):
        assert rel_err(a, b) <= 1e-9
    assert float(g_tree[2].abs().max()) > 0  # the shared rope key receives gradient


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision(dtype):
    forest = RolloutForest.from_sequences(SEQS)
    c = forest.num_compact_tokens
    q, k, v, gate = make_inputs(c, 4, 2, 16, 8, gate=True, seed=7, dtype=dtype)
    plan = build_attention_plan(forest)
    o = tree_attention(q, k, v, plan, gate=gate)
    assert o.dtype == dtype and o.shape == (c, 4, 8)
    # Truth: float64 on the same rounded inputs.
    q64, k64, v64, g64 = (t.detach().double() for t in (q, k, v, gate))
    truth = tree_attention_dense_ref(q64, k64, v64, forest, gate=g64)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert maxabs(o.double() - truth) <= tol
    ref = per_trajectory(forest, q, k, v, scale=0.25, gate=gate)
    assert maxabs(semantic(forest, o).double() - ref.double()) <= tol
    o.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == dtype for t in (q, k, v, gate))
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v, gate))


def test_bucketing_pads_within_bound():
    # Many segments of assorted shapes: a root chain with forks at many depths.
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, 3, 60) + 5)]
    for _ in range(40):
        base = seqs[int(rng.integers(0, len(seqs)))]
        cut = int(rng.integers(1, len(base) + 1))
        seqs.append(base[:cut] + list(rng.integers(0, 5, int(rng.integers(1, 30)))))
    forest = RolloutForest.from_sequences(seqs)
    for ratio in (0.0, 0.1, 0.25, 0.5):
        plan = build_attention_plan(forest, max_pad_ratio=ratio)
        assert plan.padded_work <= (1 + ratio) * plan.rect_work * (1 + 1e-12)
        for b in plan.buckets:
            ql = b.q_len.numpy()
            kl = b.k_len.numpy()
            assert b.nb * b.lq * b.lk <= (1 + ratio) * float((ql * kl).sum()) * (1 + 1e-12)
    # inf: one bucket for all non-root segments (+ one per root length, here one root).
    assert len(build_attention_plan(forest, max_pad_ratio=math.inf).buckets) == 2
    # Plans are deterministic.
    p1 = build_attention_plan(forest)
    p2 = build_attention_plan(forest)
    assert torch.equal(p1.out_index, p2.out_index)
    assert all(torch.equal(a.k_index, b.k_index) for a, b in zip(p1.buckets, p2.buckets))


def test_float32_non_shared_forward_matches_expanded():
    forest = RolloutForest.from_sequences(SEQS)
    fe = RolloutForest.expanded(SEQS)
    c = forest.num_compact_tokens
    q, k, v, _ = make_inputs(c, 2, 2, 8, 8, gate=False, seed=9, dtype=torch.float32)
    sem = torch.from_numpy(forest.semantic_rows)
    o = semantic(forest, tree_attention(q, k, v, build_attention_plan(forest)))
    o_e = semantic(fe, tree_attention(q[sem], k[sem], v[sem], build_attention_plan(fe)))
    assert maxabs(o - o_e) <= 1e-5


def test_empty_forest():
    forest = RolloutForest.from_sequences([])
    plan = build_attention_plan(forest)
    q = torch.zeros(0, 2, 4)
    o = tree_attention(q, q, torch.zeros(0, 2, 3), plan)
    assert o.shape == (0, 2, 3)


def test_bad_shapes_raise():
    forest = RolloutForest.from_sequences(SEQS)
    plan = build_attention_plan(forest)
    c = forest.num_compact_tokens
    q, k, v = torch.zeros(c, 4, 8), torch.zeros(c, 2, 8), torch.zeros(c, 2, 8)
    with pytest.raises(ValueError, match="q"):
        tree_attention(q[:-1], k, v, plan)
    with pytest.raises(ValueError, match="k"):
        tree_attention(q, k[..., :4], v, plan)
    with pytest.raises(ValueError, match="k"):
        tree_attention(q, torch.zeros(c, 3, 8), v, plan)
    with pytest.raises(ValueError, match="q"):
        tree_attention(torch.zeros(c, 3, 8), k, v, plan)
    with pytest.raises(ValueError, match="v"):
        tree_attention(q, k, torch.zeros(c, 8), plan)
    with pytest.raises(ValueError, match="gate"):
        tree_attention(q, k, v, plan, gate=torch.zeros(c, 4, 7))
    for bad in (-1, True):
        with pytest.raises(ValueError, match="max_pad_ratio"):
            build_attention_plan(forest, max_pad_ratio=bad)
    # an int past float's range bins as inf does (it raised OverflowError)
    huge = build_attention_plan(forest, max_pad_ratio=10**400)
    assert huge.max_pad_ratio == math.inf
    assert len(huge.buckets) == len(build_attention_plan(forest, max_pad_ratio=math.inf).buckets)
    with pytest.raises(ValueError, match="max_bucket_elements"):
        build_attention_plan(forest, max_bucket_elements=0)


def traj_window_attention(q, k, v, rows, *, scale, window):
    """Causal attention over the last ``window`` keys (``i - j < window``) on one trajectory's
    own rows, from an explicit band mask."""
    rep = q.shape[1] // k.shape[1]
    n = len(rows)
    i = torch.arange(n)
    band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    qi = q[rows].transpose(0, 1)
    ki = k[rows].repeat_interleave(rep, dim=1).transpose(0, 1)
    vi = v[rows].repeat_interleave(rep, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(qi, ki, vi, attn_mask=band, scale=scale).transpose(0, 1)


@settings(max_examples=30, deadline=None)
@given(
    seqs=shared_sequences(),
    window=st.sampled_from([1, 2, 3, 7, 16, 1000]),
    ratio=st.sampled_from([0.0, 1.0, math.inf]),
    seed=st.integers(0, 2**16),
)
def test_sliding_window_matches_trajectorywise(seqs, window, ratio, seed):
    """With a sliding window every row equals windowed causal attention of each trajectory
    through it (outputs and q/k/v gradients), in uniform and padded buckets; the dense oracle
    agrees."""
    forest = RolloutForest.from_sequences(seqs)
    c = forest.num_compact_tokens
    q, k, v, _ = make_inputs(c, 4, 2, 8, 6, gate=False, seed=seed)
    plan = build_attention_plan(forest, max_pad_ratio=ratio)
    o = tree_attention(q, k, v, plan, scale=0.3, window=window)
    ref = torch.cat(
        [
            traj_window_attention(
                q, k, v, torch.from_numpy(forest.rows_of(i)), scale=0.3, window=window
            )
            for i in range(forest.num_trajectories)
        ]
    )
    tree_sem = semantic(forest, o)
    assert maxabs(tree_sem - ref) <= 1e-10
    dense = tree_attention_dense_ref(q, k, v, forest, scale=0.3, window=window)
    assert maxabs(dense - o) <= 1e-10
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    for a, b in zip(grads((tree_sem * w).sum(), (q, k, v)), grads((ref * w).sum(), (q, k, v))):
        assert rel_err(a, b) <= 1e-9
    if window == 1:  # each row sees only itself
        assert maxabs(o - v.repeat_interleave(2, dim=1)) <= 1e-12


def test_window_validation():
    forest = RolloutForest.from_sequences([[1, 2, 3]])
    q, k, v, _ = make_inputs(3, 2, 2, 4, 4, gate=False, seed=0)
    plan = build_attention_plan(forest)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="window"):
            tree_attention(q, k, v, plan, window=bad)


# ----------------------------------------------------------------------------- attention sinks
def traj_scores(q, k, v, rows, *, scale, window):
    """One trajectory's own rows: the causal (band) mask ``[n, n]``, the values per query head
    ``[Hq, n, Dv]`` and the scaled scores ``q kᵀ · scale`` ``[Hq, n, n]`` (GQA repeated)."""
    rep = q.shape[1] // k.shape[1]
    i = torch.arange(len(rows))
    allowed = i[:, None] >= i[None, :]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    qi = q[rows].transpose(0, 1)
    ki = k[rows].repeat_interleave(rep, dim=1).transpose(0, 1)
    vi = v[rows].repeat_interleave(rep, dim=1).transpose(0, 1)
    return allowed, vi, torch.matmul(qi, ki.transpose(-1, -2)) * scale


def traj_sink_attention(q, k, v, rows, *, scale, sinks, window=None, gate=None):
    """HF gpt-oss's ``eager_attention_forward`` on one trajectory's own rows: scores, causal
    (band) mask, the head's sink logit as one more column, max-shift, softmax, sink dropped."""
    hq, n = q.shape[1], len(rows)
    allowed, vi, s = traj_scores(q, k, v, rows, scale=scale, window=window)
    s = s.masked_fill(~allowed, float("-inf"))
    s = torch.cat([s, sinks.to(s.dtype).view(hq, 1, 1).expand(hq, n, 1)], dim=-1)
    s = s - s.max(dim=-1, keepdim=True).values
    o = torch.matmul(torch.softmax(s, dim=-1)[..., :-1], vi).transpose(0, 1)
    return o if gate is None else o * torch.sigmoid(gate[rows])


def _check_vs_trajectories(forest, qkv, plan, kw, traj_fn, seed, leaves):
    """Tree attention with keywords ``kw`` vs ``traj_fn`` (an HF eager attention) on each
    trajectory's own rows and vs the dense oracle (1e-10), and its gradients with respect to
    ``leaves`` vs the per-trajectory ones (1e-9 relative). Returns (the random output weights,
    the tree gradients, the dense output)."""
    q, k, v = qkv
    o = tree_attention(q, k, v, plan, **kw)
    assert o.shape == (forest.num_compact_tokens, q.shape[1], v.shape[2]) and o.dtype == F64
    rows = [torch.from_numpy(forest.rows_of(i)) for i in range(forest.num_trajectories)]
    ref = torch.cat([traj_fn(q, k, v, r, **kw) for r in rows])
    tree_sem = semantic(forest, o)
    assert maxabs(tree_sem - ref) <= 1e-10
    dense = tree_attention_dense_ref(q, k, v, forest, **kw)
    assert maxabs(dense - o) <= 1e-10
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    g_tree = grads((tree_sem * w).sum(), leaves)
    for a, b in zip(g_tree, grads((ref * w).sum(), leaves)):
        assert rel_err(a, b) <= 1e-9
    return w, g_tree, dense


def make_sinks(hq, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(hq, generator=g, dtype=F64)).to(dtype).requires_grad_()


@settings(max_examples=40, deadline=None)
@given(
    seqs=shared_sequences(),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    dims=st.sampled_from([(8, 8), (8, 6), (4, 10)]),
    window=st.sampled_from([None, 1, 3, 7]),
    use_gate=st.booleans(),
    ratio=st.sampled_from([0.0, 0.25, math.inf]),
    seed=st.integers(0, 2**16),
)
def test_sinks_match_trajectorywise_eager(seqs, heads, dims, window, use_gate, ratio, seed):
    """With attention sinks (GQA, Dv != Dqk, sliding windows, output gate, padded and uniform
    buckets) every row equals HF gpt-oss's eager attention of each trajectory through it, and
    the dense oracle; gradients of q, k, v, gate and sinks to 1e-9 relative."""
    forest = RolloutForest.from_sequences(seqs)
    (hq, hkv), (dqk, dv) = heads, dims
    c = forest.num_compact_tokens
    q, k, v, gate = make_inputs(c, hq, hkv, dqk, dv, gate=use_gate, seed=seed)
    sinks = make_sinks(hq, seed + 2)
    plan = build_attention_plan(forest, max_pad_ratio=ratio)
    kw = dict(scale=0.4, sinks=sinks, window=window, gate=gate)
    leaves = (q, k, v, gate, sinks)
    w, g_tree, dense = _check_vs_trajectories(
        forest, (q, k, v), plan, kw, traj_sink_attention, seed, leaves
    )
    g_dense = grads((semantic(forest, dense) * w).sum(), leaves)
    for a, b in zip(g_tree, g_dense):
        assert rel_err(a, b) <= 1e-9


def test_sinks_fixed_cases():
    """Sinks change the output; a sink far below every score is no sink; sinks in another float
    dtype than q; the root (is_causal) and non-root buckets both carry the sink; no sink path
    for an empty forest."""
    forest = RolloutForest.from_sequences(SEQS)
    c = forest.num_compact_tokens
    q, k, v, _ = make_inputs(c, 4, 2, 8, 8, gate=False, seed=21)
    plan = build_attention_plan(forest)
    assert any(b.uniform and b.lq == b.lk for b in plan.buckets)  # an is_causal root bucket
    assert any(b.lq != b.lk for b in plan.buckets)
    plain = tree_attention(q, k, v, plan)
    sinks = make_sinks(4, 22)
    o = tree_attention(q, k, v, plan, sinks=sinks)
    assert maxabs(o - plain) > 1e-2
    assert maxabs(o - tree_attention_dense_ref(q, k, v, forest, sinks=sinks)) <= 1e-12
    far = torch.full((4,), -1e4, dtype=F64)
    assert maxabs(tree_attention(q, k, v, plan, sinks=far) - plain) <= 1e-12
    o32 = tree_attention(q, k, v, plan, sinks=sinks.detach().float())
    ref32 = tree_attention_dense_ref(q, k, v, forest, sinks=sinks.detach().float().double())
    assert maxabs(o32 - ref32) <= 1e-12
    empty = build_attention_plan(RolloutForest.from_sequences([]))
    z = torch.zeros(0, 4, 8)
    assert tree_attention(z, z[:, :2], z[:, :2], empty, sinks=sinks.float()).shape == (0, 4, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sinks_low_precision(dtype):
    """Half and single precision with sinks (in the model's dtype, as gpt-oss keeps them):
    close to float64 truth on the same rounded inputs; finite gradients in the input dtype."""
    forest = RolloutForest.from_sequences(SEQS)
    c = forest.num_compact_tokens
    q, k, v, gate = make_inputs(c, 4, 2, 16, 8, gate=True, seed=23, dtype=dtype)
    sinks = make_sinks(4, 24, dtype)
    o = tree_attention(q, k, v, build_attention_plan(forest), gate=gate, window=5, sinks=sinks)
    assert o.dtype == dtype and o.shape == (c, 4, 8)
    q64, k64, v64, g64, s64 = (t.detach().double() for t in (q, k, v, gate, sinks))
    truth = tree_attention_dense_ref(q64, k64, v64, forest, gate=g64, window=5, sinks=s64)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert maxabs(o.double() - truth) <= tol
    o.float().square().sum().backward()
    leaves = (q, k, v, gate, sinks)
    assert all(t.grad is not None and t.grad.dtype == dtype for t in leaves)
    assert all(bool(torch.isfinite(t.grad).all()) for t in leaves)


def test_sinks_validation():
    forest = RolloutForest.from_sequences([[1, 2, 3]])
    q, k, v, _ = make_inputs(3, 4, 2, 4, 4, gate=False, seed=0)
    plan = build_attention_plan(forest)
    for bad, msg in (
        (torch.zeros(2, dtype=F64), r"\[4\] tensor"),
        (torch.zeros(1, 4, dtype=F64), r"\[4\] tensor"),
        (torch.zeros(4, dtype=torch.int64), "floating-point"),
        ([0.0] * 4, r"\[4\] tensor"),
    ):
        with pytest.raises(ValueError, match="sinks"):
            tree_attention(q, k, v, plan, sinks=bad)
        with pytest.raises(ValueError, match=msg):
            tree_attention_dense_ref(q, k, v, forest, sinks=bad)


# ----------------------------------------------------------------------------- logit soft-cap
def traj_softcap_attention(q, k, v, rows, *, scale, softcap, window=None, gate=None):
    """HF Gemma 2's ``eager_attention_forward`` on one trajectory's own rows: scores, soft-cap
    ``cap · tanh(s / cap)``, then the causal (band) mask as an additive ``-inf``, softmax."""
    n = len(rows)
    allowed, vi, s = traj_scores(q, k, v, rows, scale=scale, window=window)
    s = torch.tanh(s / softcap) * softcap
    s = s + torch.zeros(n, n, dtype=s.dtype).masked_fill(~allowed, float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), vi).transpose(0, 1)
    return o if gate is None else o * torch.sigmoid(gate[rows])


@settings(max_examples=30, deadline=None)
@given(
    seqs=shared_sequences(),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    dims=st.sampled_from([(8, 8), (8, 6)]),
    window=st.sampled_from([None, 1, 3, 7]),
    softcap=st.sampled_from([0.5, 2.0, 50.0]),
    use_gate=st.booleans(),
    ratio=st.sampled_from([0.0, 0.25, math.inf]),
    seed=st.integers(0, 2**16),
)
def test_softcap_matches_trajectorywise_eager(
    seqs, heads, dims, window, softcap, use_gate, ratio, seed
):
    """Attention logit soft-capping (Gemma 2; GQA, Dv != Dqk, sliding windows, padded and
    uniform buckets): every row equals HF's eager soft-capped attention of each trajectory
    through it and the dense oracle (1e-10); gradients of q, k, v, gate to 1e-9 relative."""
    forest = RolloutForest.from_sequences(seqs)
    (hq, hkv), (dqk, dv) = heads, dims
    c = forest.num_compact_tokens
    q, k, v, gate = make_inputs(c, hq, hkv, dqk, dv, gate=use_gate, seed=seed)
    plan = build_attention_plan(forest, max_pad_ratio=ratio)
    kw = dict(scale=0.9, softcap=softcap, window=window, gate=gate)
    leaves = tuple(t for t in (q, k, v, gate) if t is not None)
    _check_vs_trajectories(forest, (q, k, v), plan, kw, traj_softcap_attention, seed, leaves)


def test_softcap_fixed_cases_and_validation():
    """A small cap changes the output, a huge one does not; float32 and bfloat16 stay close to
    float64 truth; a varlen kernel with ``supports_softcap`` runs it, another is routed to the
    bucketed path (or refused without a fallback); bad caps and caps with sinks are refused."""
    from harts_verl.ops.backends import VarlenAttentionKernel
    from harts_verl.ops.backends.varlen_attention import sdpa_varlen_reference

    forest = RolloutForest.from_sequences(SEQS)
    c = forest.num_compact_tokens
    q, k, v, _ = make_inputs(c, 4, 2, 8, 8, gate=False, seed=31)
    q = q * 3.0  # scores well beyond a cap of 1
    plan = build_attention_plan(forest)
    plain = tree_attention(q, k, v, plan)
    capped = tree_attention(q, k, v, plan, softcap=1.0)
    assert maxabs(capped - plain) > 1e-2
    assert maxabs(tree_attention(q, k, v, plan, softcap=1e9) - plain) <= 1e-9
    truth = tree_attention_dense_ref(q, k, v, forest, softcap=1.0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        low = tree_attention(*(t.detach().to(dtype) for t in (q, k, v)), plan, softcap=1.0)
        assert low.dtype == dtype and maxabs(low.double() - truth) <= tol
    # a varlen kernel that takes softcap (flash-attn >= 2.6; here its CPU test double) runs it,
    # with or without a window; one that does not is routed to the bucketed path or refused
    varlen = VarlenAttentionKernel("t", sdpa_varlen_reference, require_half=False)
    vplan = varlen.build_plan(forest)
    assert maxabs(varlen(q, k, v, vplan, softcap=1.0) - capped) <= 1e-12
    windowed = tree_attention(q, k, v, plan, softcap=1.0, window=3)
    assert maxabs(varlen(q, k, v, vplan, softcap=1.0, window=3) - windowed) <= 1e-12

    def no_softcap(*args, **kwargs):
        assert "softcap" not in kwargs
        return sdpa_varlen_reference(*args, **kwargs)

    routed = VarlenAttentionKernel("t", no_softcap, sdpa_fallback=True)
    assert maxabs(routed(q, k, v, vplan, softcap=1.0) - capped) <= 1e-12
    strict = VarlenAttentionKernel("t", no_softcap, require_half=False)
    with pytest.raises(NotImplementedError, match="soft-capping"):
        strict(q, k, v, vplan, softcap=1.0)
    # a retained graph runs backward twice (the backward squared a saved tensor in place)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = tree_attention(qg, kg, vg, plan, softcap=1.0).sum()
    grads = torch.autograd.grad(out, (qg, kg, vg), retain_graph=True)
    again = torch.autograd.grad(out, (qg, kg, vg))
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    for bad in (0.0, -1.0, float("inf"), "2", True):
        with pytest.raises(ValueError, match="softcap"):
            tree_attention(q, k, v, plan, softcap=bad)
    with pytest.raises(NotImplementedError, match="sinks"):
        tree_attention(q, k, v, plan, softcap=1.0, sinks=torch.zeros(4, dtype=F64))
