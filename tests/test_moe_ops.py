"""MoE ops: row-once routing and multiplicity-weighted statistics equal the expanded values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _strategies import sequence_lists
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_verl.ops.moe import (
    RouteResult,
    expert_load,
    load_balancing_loss,
    moe_forward,
    moe_forward_reference,
    router_z_loss,
    semantic_row_weights,
    sigmoid_grouped_topk_route,
    softmax_topk_route,
    stable_topk,
)
from harts_verl.tree.forest import RolloutForest

E = 8


def _row_logits(forest: RolloutForest, seed: int, quantized: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = forest.num_compact_tokens
    if quantized:  # many exact ties
        return torch.randint(0, 3, (c, E), generator=g).to(torch.float64)
    return torch.randn(c, E, generator=g, dtype=torch.float64) * 2.0


def _route(style: str, logits: torch.Tensor, bias: torch.Tensor) -> RouteResult:
    if style == "softmax":
        return softmax_topk_route(logits, 3, norm_topk_prob=True)
    return sigmoid_grouped_topk_route(
        logits,
        top_k=3,
        correction_bias=bias,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@settings(max_examples=40, deadline=None)
@given(
    seqs=sequence_lists(),
    seed=st.integers(0, 2**31 - 1),
    quantized=st.booleans(),
    style=st.sampled_from(["softmax", "sigmoid"]),
)
def test_row_routing_and_stats_equal_expanded(
    seqs: list[list[int]], seed: int, quantized: bool, style: str
) -> None:
    forest = RolloutForest.from_sequences(seqs)
    sem = torch.from_numpy(forest.semantic_rows)
    mult = forest.multiplicity
    bias = torch.linspace(-0.3, 0.2, E, dtype=torch.float64)

    row_logits = _row_logits(forest, seed, quantized).requires_grad_(True)
    exp_logits = row_logits[sem]  # rows of one trie node share their hidden state and logits
    r_rows = _route(style, row_logits, bias)
    r_exp = _route(style, exp_logits, bias)

    # Every semantic position takes its row's route (deterministic ties).
    assert torch.equal(r_exp.experts, r_rows.experts[sem])
    torch.testing.assert_close(r_exp.weights, r_rows.weights[sem], rtol=0, atol=1e-15)

    # Load counts: multiplicity-weighted row count == count over semantic positions (exact).
    load_rows = expert_load(r_rows.experts, E, weights=mult)
    assert load_rows.dtype == torch.int64
    assert torch.equal(load_rows, expert_load(r_exp.experts, E))
    assert int(load_rows.sum()) == 3 * forest.num_semantic_tokens

    # Aux losses: values and gradients w.r.t. the row logits.
    for name in ("lb", "z"):
        if name == "lb":
            tree = load_balancing_loss(r_rows.probs, r_rows.experts, E, 3, weights=mult)
            ref = load_balancing_loss(r_exp.probs, r_exp.experts, E, 3)
        else:
            tree = router_z_loss(row_logits, weights=mult)
            ref = router_z_loss(exp_logits)
        diff, scale = (tree - ref).detach().abs().item(), max(1.0, ref.detach().abs().item())
        assert diff <= 1e-12 * scale, name
        (g_tree,) = torch.autograd.grad(tree, row_logits, retain_graph=True)
        (g_ref,) = torch.autograd.grad(ref, row_logits, retain_graph=True)
        assert _rel(g_tree, g_ref) <= 1e-10, name

    # Routing weights: a loss over semantic positions differentiates through the row weights.
    c = torch.randn(
        r_exp.weights.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    (g_ref,) = torch.autograd.grad((r_exp.weights * c).sum(), row_logits, retain_graph=True)
    c_rows = torch.zeros_like(r_rows.weights).index_add_(0, sem, c)
    (g_tree,) = torch.autograd.grad((r_rows.weights * c_rows).sum(), row_logits)
    assert _rel(g_tree, g_ref) <= 1e-10


def test_semantic_row_weights_mask() -> None:
    forest = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4, 5], [1, 2, 3]])
    assert np.array_equal(semantic_row_weights(forest), forest.multiplicity)
    mask = np.ones(forest.num_semantic_tokens)
    mask[forest.row_offsets[:-1]] = 0  # e.g. drop the first token of each trajectory
    w = semantic_row_weights(forest, mask)
    logits = torch.randn(forest.num_compact_tokens, E, dtype=torch.float64)
    sem = torch.from_numpy(forest.semantic_rows)
    m = torch.from_numpy(mask)
    ref = (torch.logsumexp(logits[sem], -1) ** 2 * m).sum() / m.sum()
    torch.testing.assert_close(router_z_loss(logits, weights=w), ref, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="semantic_weights"):
        semantic_row_weights(forest, np.ones(3))


def test_ties_go_to_lower_index() -> None:
    logits = torch.zeros(4, E)
    r = softmax_topk_route(logits, 3)
    assert r.experts.tolist() == [[0, 1, 2]] * 4
    torch.testing.assert_close(r.weights, torch.full((4, 3), 1 / 3))
    r = sigmoid_grouped_topk_route(logits, top_k=3, n_group=4, topk_group=2)
    assert r.experts.tolist() == [[0, 1, 2]] * 4
    vals, idx = stable_topk(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]]), 3)
    assert idx.tolist() == [[1, 2, 4]] and vals.tolist() == [[3.0, 3.0, 3.0]]


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_stable_topk_equals_stable_sort(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    for scores in (
        torch.randint(0, 3, (200, E), generator=g).to(torch.float32),  # heavy ties
        torch.randn(3, 40, E, generator=g, dtype=torch.float64),
        torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")] * 2]),
    ):
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        vals, idx = stable_topk(scores, k)
        assert torch.equal(idx, order)
        assert torch.equal(vals, scores.gather(-1, order))


def test_softmax_route_matches_hf_formula() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, E, generator=g).to(torch.bfloat16)
    for norm in (True, False):
        r = softmax_topk_route(logits, 2, norm_topk_prob=norm)
        probs = F.softmax(logits, dim=1, dtype=torch.float)
        w, idx = torch.topk(probs, 2, dim=-1)
        if norm:
            w = w / w.sum(dim=-1, keepdim=True)
        assert r.weights.dtype == torch.float32 and r.probs.dtype == torch.float32
        assert torch.equal(r.experts, idx)
        torch.testing.assert_close(r.weights, w, rtol=0, atol=0)


def _hf_sigmoid_route(logits, bias, top_k, n_group, topk_group, scale, norm):
    scores = logits.float().sigmoid()
    choice = scores + bias
    e = logits.shape[1]
    group_scores = choice.view(-1, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e)
    masked = choice.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(masked, k=top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w * scale


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_route_matches_hf_formula(norm: bool) -> None:
    g = torch.Generator().manual_seed(1)
    e, n_group, topk_group, top_k = 16, 4, 2, 4
    logits = torch.randn(200, e, generator=g)
    bias = torch.randn(e, generator=g) * 0.5 - 1.0  # negative choice scores: -inf masking matters
    r = sigmoid_grouped_topk_route(
        logits,
        top_k=top_k,
        correction_bias=bias,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm,
    )
    idx, w = _hf_sigmoid_route(logits, bias, top_k, n_group, topk_group, 2.5, norm)
    order = torch.argsort(idx, dim=-1)
    mine = torch.argsort(r.experts, dim=-1)
    assert torch.equal(r.experts.gather(1, mine), idx.gather(1, order))
    torch.testing.assert_close(r.weights.gather(1, mine), w.gather(1, order), rtol=1e-6, atol=1e-7)
    # Chosen experts lie in at most topk_group groups.
    groups = r.experts // (e // n_group)
    assert all(len(set(row)) <= topk_group for row in groups.tolist())
    torch.testing.assert_close(r.probs, torch.sigmoid(logits))


def test_load_balancing_loss_matches_hf_formula() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, E, generator=g, dtype=torch.float64)
    r = softmax_topk_route(logits, 2)
    probs = torch.softmax(logits, dim=-1)
    _, sel = torch.topk(probs, 2, dim=-1)
    mask = F.one_hot(sel, E).to(torch.float64)
    hf = (mask.mean(dim=0) * probs.mean(dim=0).unsqueeze(0)).sum() * E
    torch.testing.assert_close(load_balancing_loss(r.probs, r.experts, E, 2), hf)
    torch.testing.assert_close(
        load_balancing_loss(r.probs, r.experts, E, 2, divide_by_top_k=True), hf / 2
    )
    # Integer weights == repeating rows.
    w = torch.randint(1, 4, (64,), generator=g)
    rep = torch.repeat_interleave(torch.arange(64), w)
    torch.testing.assert_close(
        load_balancing_loss(r.probs, r.experts, E, 2, weights=w),
        load_balancing_loss(r.probs[rep], r.experts[rep], E, 2),
    )
    # HF z-loss form: mean(logsumexp^2).
    torch.testing.assert_close(router_z_loss(logits), (torch.logsumexp(logits, -1) ** 2).mean())


def test_expert_load_float_weights() -> None:
    experts = torch.tensor([[0, 1], [1, 2], [2, 3]])
    load = expert_load(experts, 5, weights=torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64))
    assert load.tolist() == [0.5, 1.5, 3.0, 2.0, 0.0]
    assert expert_load(experts, 5).tolist() == [1, 2, 2, 1, 0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_moe_forward_matches_per_token_loop(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    t, d, f, e, k = 23, 6, 5, 7, 2
    x = torch.randn(t, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    logits = torch.randn(t, e, generator=g, dtype=torch.float64).to(dtype)
    logits[:, 6] = -50.0  # an expert that receives no token
    logits.requires_grad_(True)
    wg, wu = (torch.randn(e, d, f, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    wd = torch.randn(e, f, d, generator=g, dtype=torch.float64).to(dtype)
    params = [x, logits, wg.requires_grad_(True), wu.requires_grad_(True), wd.requires_grad_(True)]
    r = softmax_topk_route(logits, k)
    out = moe_forward(x, r.weights, r.experts, wg, wu, wd)
    ref = moe_forward_reference(x, r.weights, r.experts, wg, wu, wd)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    c = torch.randn(t, d, generator=g, dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad((out * c).sum(), params, retain_graph=True)
    grads_ref = torch.autograd.grad((ref * c).sum(), params)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_moe_forward_on_rows_equals_expanded() -> None:
    forest = RolloutForest.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3, 4], [2, 7]])
    sem = torch.from_numpy(forest.semantic_rows)
    g = torch.Generator().manual_seed(4)
    d, f = 4, 3
    x = torch.randn(forest.num_compact_tokens, d, generator=g, dtype=torch.float64)
    router = torch.randn(d, E, generator=g, dtype=torch.float64)
    wg, wu = (torch.randn(E, d, f, generator=g, dtype=torch.float64) for _ in range(2))
    wd = torch.randn(E, f, d, generator=g, dtype=torch.float64)
    r = softmax_topk_route(x @ router, 2)
    re = softmax_topk_route(x[sem] @ router, 2)
    out_rows = moe_forward(x, r.weights, r.experts, wg, wu, wd)
    out_exp = moe_forward(x[sem], re.weights, re.experts, wg, wu, wd)
    torch.testing.assert_close(out_rows[sem], out_exp, rtol=1e-13, atol=1e-13)


def test_validation_errors() -> None:
    logits = torch.randn(4, E)
    with pytest.raises(ValueError, match="router_logits"):
        softmax_topk_route(logits[0], 2)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk_route(logits, E + 1)
    with pytest.raises(ValueError, match="n_group"):
        sigmoid_grouped_topk_route(logits, top_k=2, n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        sigmoid_grouped_topk_route(logits, top_k=2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="top_k"):
        sigmoid_grouped_topk_route(logits, top_k=5, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="correction_bias"):
        sigmoid_grouped_topk_route(logits, top_k=2, correction_bias=torch.zeros(3))
    r = softmax_topk_route(logits, 2)
    with pytest.raises(ValueError, match="weights"):
        expert_load(r.experts, E, weights=torch.ones(3))
    with pytest.raises(ValueError, match="experts"):
        expert_load(r.experts, 2)
    with pytest.raises(ValueError, match="top_k"):
        load_balancing_loss(r.probs, r.experts, E, 3)
    with pytest.raises(ValueError, match="probs"):
        load_balancing_loss(r.probs[:, :4], r.experts, E, 2)
    for bad in (torch.zeros(4), torch.tensor([1.0, -1.0, 1.0, 1.0]), torch.full((4,), np.nan)):
        with pytest.raises(ValueError, match="weights"):  # a NaN loss otherwise
            load_balancing_loss(r.probs, r.experts, E, 2, weights=bad)
    with pytest.raises(ValueError, match="no tokens"):
        load_balancing_loss(r.probs[:0], r.experts[:0], E, 2)
    with pytest.raises(ValueError, match="no tokens"):
        router_z_loss(logits[:0])
    with pytest.raises(ValueError, match="w_down"):
        moe_forward(
            torch.randn(4, 3),
            r.weights,
            r.experts,
            torch.randn(E, 3, 2),
            torch.randn(E, 3, 2),
            torch.randn(E, 3, 3),
        )


def test_native_moe_counts_rows_shared_past_bf16_integers() -> None:
    """A bf16 native model's MoE layers weight each row by its exact multiplicity (257 here;
    bf16 holds integers only to 256), so its aux loss is the trajectory-wise mean."""
    from harts_verl.models.config import preset
    from harts_verl.models.hybrid import HybridForCausalLM
    from harts_verl.ops.layout import TreeLayout

    torch.manual_seed(0)
    cfg = preset("tiny")
    model = HybridForCausalLM(cfg).to(torch.bfloat16).eval()
    seqs = [[5, 6, 7 + j // 7, 7 + j % 7] for j in range(257)]  # rows 5 and 6: 257 trajectories
    forest = RolloutForest.from_sequences(seqs)
    layout = TreeLayout(forest, chunk_size=cfg.chunk_size)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, args, out):
        x, w = args
        _, route = module.route(x)
        rows = torch.as_tensor(forest.semantic_rows)
        expanded = load_balancing_loss(
            route.probs[rows], route.experts[rows], cfg.num_experts, cfg.num_experts_per_tok
        )
        seen.append((w, out[1], expanded))

    moe_layers = [layer for layer in model.layers if layer.is_moe]
    assert moe_layers
    handles = [layer.ffn.register_forward_hook(hook) for layer in moe_layers]
    with torch.no_grad():
        model(layout.token_ids, layout)
    for h in handles:
        h.remove()
    mult = torch.as_tensor(forest.multiplicity, dtype=torch.float64)
    assert int(mult.max()) == 257
    for w, aux, expanded in seen:
        assert torch.equal(w.double(), mult)
        assert abs(float(aux) - float(expanded)) <= 1e-6 * max(1.0, abs(float(expanded)))
