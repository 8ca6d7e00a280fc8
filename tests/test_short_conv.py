"""Tree short causal conv equals per-trajectory conv1d (outputs and gradients, float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _strategies import shared_sequences
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_verl.ops.short_conv import (
    conv_window_index,
    short_conv_expanded_ref,
    tree_short_conv,
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


def per_trajectory(forest, x, weight, bias, activation):
    """``[S, D]``: conv1d on each trajectory's own gathered rows, in CSR order."""
    outs = [
        short_conv_expanded_ref(x[torch.from_numpy(forest.rows_of(i))], weight, bias, activation)
        for i in range(forest.num_trajectories)
    ]
    return torch.cat(outs, dim=0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (denominator floored at 1e-4 for exactly-zero references)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-4))


def maxabs(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


@settings(max_examples=50, deadline=None)
@given(
    seqs=shared_sequences(),
    width=st.sampled_from([1, 2, 3, 4]),
    d=st.sampled_from([3, 12]),
    use_bias=st.booleans(),
    activation=st.sampled_from(["silu", None]),
    seed=st.integers(0, 2**16),
)
def test_matches_trajectorywise(seqs, width, d, use_bias, activation, seed):
    forest = RolloutForest.from_sequences(seqs)
    c = forest.num_compact_tokens
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, d, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(d, width, generator=g, dtype=F64, requires_grad=True)
    bias = torch.randn(d, generator=g, dtype=F64, requires_grad=True) if use_bias else None
    leaves = [t for t in (x, weight, bias) if t is not None]

    win = conv_window_index(forest, width)
    y = tree_short_conv(x, weight, bias, win, activation=activation)
    assert y.shape == (c, d) and y.dtype == F64
    sem = torch.from_numpy(forest.semantic_rows)
    tree_sem = y[sem]
    ref = per_trajectory(forest, x, weight, bias, activation)
    assert maxabs(tree_sem - ref) <= 1e-10

    r = torch.randn(ref.shape, generator=g, dtype=F64)  # w_{i,t} · R_{i,t}
    g_tree = torch.autograd.grad((tree_sem * r).sum(), leaves)
    g_ref = torch.autograd.grad((ref * r).sum(), leaves)
    for a, b in zip(g_tree, g_ref):
        assert rel_err(a, b) <= 1e-9

    # Trajectory-wise layout through the same op, gathered from the same compact leaves.
    fe = RolloutForest.expanded(seqs)
    y_e = tree_short_conv(x[sem], weight, bias, conv_window_index(fe, width), activation=activation)
    exp_sem = y_e[torch.from_numpy(fe.semantic_rows)]
    assert maxabs(exp_sem - ref) <= 1e-10
    g_exp = torch.autograd.grad((exp_sem * r).sum(), leaves)
    for a, b in zip(g_exp, g_ref):
        assert rel_err(a, b) <= 1e-9


SEQS = [
    [1, 2, 3, 4, 5, 6],
    [1, 2, 3, 9, 9],
    [1, 7],  # forks at depth 1 (< W - 1)
    [1],  # one-token trajectory, prefix of others
    [2, 2, 2],  # second root
]


@pytest.mark.parametrize("width", [2, 4])
def test_window_index_zeros_past_root(width):
    forest = RolloutForest.from_sequences(SEQS)
    win = conv_window_index(forest, width).numpy()
    depth = forest.depth
    assert np.array_equal(win[:, -1], np.arange(forest.num_compact_tokens))
    for j in range(width):  # column j holds the ancestor (W-1-j) levels up, or -1 past the root
        up = width - 1 - j
        valid = depth >= up
        assert np.array_equal(win[:, j] >= 0, valid)
        assert np.array_equal(depth[win[valid, j]], depth[valid] - up)
        assert forest.is_ancestor_or_self(win[valid, j], np.flatnonzero(valid)).all()


@pytest.mark.parametrize("width", [2, 4])
def test_fused_channels_equal_separate(width):
    """q/k/v channels fused into one wide conv equal three separate convs (depthwise)."""
    forest = RolloutForest.from_sequences(SEQS)
    c = forest.num_compact_tokens
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(c, dd, generator=g, dtype=F64) for dd in (4, 4, 6)]
    ws = [torch.randn(p.shape[1], width, generator=g, dtype=F64) for p in parts]
    bs = [torch.randn(p.shape[1], generator=g, dtype=F64) for p in parts]
    win = conv_window_index(forest, width)
    fused = tree_short_conv(torch.cat(parts, 1), torch.cat(ws, 0), torch.cat(bs, 0), win)
    sep = torch.cat([tree_short_conv(p, w, b, win) for p, w, b in zip(parts, ws, bs)], 1)
    assert torch.equal(fused, sep)
    ref = per_trajectory(forest, torch.cat(parts, 1), torch.cat(ws, 0), torch.cat(bs, 0), "silu")
    assert maxabs(fused[torch.from_numpy(forest.semantic_rows)] - ref) <= 1e-10


def test_rows_near_root_see_zeros():
    forest = RolloutForest.from_sequences([[5, 6, 7]])
    x = torch.tensor([[1.0], [2.0], [4.0]], dtype=F64)
    w = torch.tensor([[1000.0, 100.0, 10.0, 1.0]], dtype=F64)
    y = tree_short_conv(x, w, None, conv_window_index(forest, 4), activation=None)
    assert y[:, 0].tolist() == [1.0, 12.0, 124.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision(dtype):
    forest = RolloutForest.from_sequences(SEQS)
    c = forest.num_compact_tokens
    g = torch.Generator().manual_seed(1)
    x = torch.randn(c, 8, generator=g).to(dtype).requires_grad_()
    w = torch.randn(8, 4, generator=g).to(dtype).requires_grad_()
    b = torch.randn(8, generator=g).to(dtype).requires_grad_()
    win = conv_window_index(forest, 4)
    y = tree_short_conv(x, w, b, win)
    assert y.dtype == dtype
    # fp32 accumulation: equals the float64 math on the same inputs up to the final rounding.
    y64 = tree_short_conv(x.detach().double(), w.detach().double(), b.detach().double(), win)
    assert maxabs(y.double() - y64) <= (1e-2 if dtype == torch.bfloat16 else 1e-6) * (
        1 + maxabs(y64)
    )
    ref = per_trajectory(forest, x, w, b, "silu")
    assert maxabs(y[torch.from_numpy(forest.semantic_rows)].double() - ref.double()) <= (
        2e-2 if dtype == torch.bfloat16 else 1e-6
    )
    y.float().square().sum().backward()
    assert x.grad.dtype == dtype and w.grad.dtype == dtype and b.grad.dtype == dtype


def test_conv1d_weight_layout_and_errors():
    forest = RolloutForest.from_sequences(SEQS)
    c = forest.num_compact_tokens
    x = torch.randn(c, 6, dtype=F64)
    w = torch.randn(6, 3, dtype=F64)
    win = conv_window_index(forest, 3)
    assert torch.equal(
        tree_short_conv(x, w, None, win), tree_short_conv(x, w[:, None, :], None, win)
    )
    assert torch.equal(tree_short_conv(x, w, window_index=win), tree_short_conv(x, w, None, win))
    with pytest.raises(ValueError, match="x"):
        tree_short_conv(x[None], w, None, win)
    with pytest.raises(ValueError, match="weight"):
        tree_short_conv(x, w[:5], None, win)
    with pytest.raises(ValueError, match="bias"):
        tree_short_conv(x, w, torch.zeros(5, dtype=F64), win)
    with pytest.raises(ValueError, match="window_index"):
        tree_short_conv(x, w, None, conv_window_index(forest, 4))
    with pytest.raises(ValueError, match="window_index"):
        tree_short_conv(x, w)
    with pytest.raises(ValueError, match="activation"):
        tree_short_conv(x, w, None, win, activation="gelu")
    with pytest.raises(ValueError, match="width"):
        conv_window_index(forest, 0)
