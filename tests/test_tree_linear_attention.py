"""Tree linear attention (KDA / GDN over planned rounds) vs trajectory-wise execution."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harts_verl.ops.linear_attention import chunk_delta_rule_varlen, recurrent_delta_rule_ref
from harts_verl.ops.tree_linear_attention import build_linear_layout, tree_delta_rule
from harts_verl.tree import RolloutForest


@st.composite
def forests(draw, max_traj: int = 7, max_len: int = 150):
    """Sequences over a 3-token alphabet built by forking earlier ones at random depths, so forks
    fall inside chunks, on boundaries and several in one chunk; chains span ≥ 3 chunks of 16."""
    n = draw(st.integers(1, max_traj))
    seqs: list[list[int]] = []
    for _ in range(n):
        tail = draw(st.lists(st.integers(0, 2), min_size=0, max_size=max_len))
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            cut = draw(st.integers(0, len(base)))
            seq = base[:cut] + tail
        else:
            seq = [draw(st.integers(0, 2)), *tail]
        seqs.append(seq or [0])
    return seqs


def _inputs(c: int, kda: bool, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    h, hv, k, v = 2, 4, 8, 6
    q = torch.randn(c, h, k, generator=g, dtype=dtype)
    kk = torch.randn(c, h, k, generator=g, dtype=dtype)
    vv = torch.randn(c, hv, v, generator=g, dtype=dtype)
    shape = (c, hv, k) if kda else (c, hv)
    gate = -torch.rand(shape, generator=g, dtype=dtype) * 0.5
    beta = torch.rand(c, hv, generator=g, dtype=dtype)
    return [x.requires_grad_(True) for x in (q, kk, vv, gate, beta)]


@settings(max_examples=30, deadline=None)
@given(forests(), st.sampled_from([16, 32, 64]), st.booleans(), st.booleans())
@example(seqs=[[0], [0]], chunk=16, kda=True, delta_rule=False)  # gate gradient 0 in exact math
def test_tree_equals_trajectory_wise_float64(seqs, chunk, kda, delta_rule):
    """Tree == trajectory-wise == token-by-token (outputs and gradients through the state
    handoffs), for the delta rule and for gated linear attention (``delta_rule=False``)."""
    forest = RolloutForest.from_sequences(seqs)
    layout = build_linear_layout(forest, chunk_size=chunk)
    xs = _inputs(forest.num_compact_tokens, kda, torch.float64, len(seqs))
    flags = {"use_qk_l2norm": True, "delta_rule": delta_rule}
    o = tree_delta_rule(*xs, layout, **flags)
    # Expanded: gather every trajectory's rows from the same leaf tensors.
    rows = [torch.as_tensor(forest.rows_of(i)) for i in range(len(seqs))]
    idx = torch.cat(rows)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor([len(r) for r in rows]), 0).tolist()])
    gathered = [x.index_select(0, idx) for x in xs]
    ref = chunk_delta_rule_varlen(*gathered, cu_seqlens=cu, chunk_size=chunk, **flags).o
    rec, _ = recurrent_delta_rule_ref(*gathered, cu_seqlens=cu, **flags)
    torch.testing.assert_close(o.index_select(0, idx), ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(ref, rec, rtol=0, atol=1e-10)
    # Gradients w.r.t. every input through the state handoffs.
    w = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gt = torch.autograd.grad((o.index_select(0, idx) * w).sum(), xs)
    ge = torch.autograd.grad((ref * w).sum(), xs)
    # Relative to each input's largest gradient, with a floor: a gradient that is zero in exact
    # arithmetic (the gate's at a lone first token) holds rounding residue (~1e-17) on both sides.
    for a, b in zip(gt, ge):
        scale = max(b.abs().max().item(), 1e-6)
        assert (a - b).abs().max().item() <= 1e-9 * scale


@pytest.mark.parametrize("kda", [True, False])
def test_unshared_rows_bitwise_float32(kda):
    """Rows on one trajectory only: float32 outputs bitwise equal to a trajectory-wise run."""
    base = list(range(1, 101))
    seqs = [base + [7] * 60, base[:37] + [8] * 50, base[:64] + [9] * 70, base[:40] + [5] * 30]
    forest = RolloutForest.from_sequences(seqs)
    xs = [x.detach() for x in _inputs(forest.num_compact_tokens, kda, torch.float32, 3)]
    o = tree_delta_rule(*xs, build_linear_layout(forest, chunk_size=64), use_qk_l2norm=True)
    checked = 0
    for i in range(len(seqs)):
        r = torch.as_tensor(forest.rows_of(i))
        alone = chunk_delta_rule_varlen(
            *[x.index_select(0, r) for x in xs],
            cu_seqlens=torch.tensor([0, len(r)]),
            chunk_size=64,
            use_qk_l2norm=True,
        ).o
        own = torch.as_tensor(forest.multiplicity[r.numpy()] == 1)
        assert torch.equal(o.index_select(0, r)[own], alone[own])
        checked += int(own.sum())
    assert checked > 100
