"""MoE routing, expert dispatch and multiplicity-weighted load statistics (invariant 7).

In tree mode every compact row is routed exactly once. Rows of the same trie node carry the same
hidden state, hence the same router logits and the same route, so routing ``C`` rows gives the
route of all ``S`` semantic positions (position ``s`` takes the route of row
``semantic_rows[s]``). Routing is deterministic top-k without capacity or token dropping: equal
scores are broken toward the lower expert index, so the route of a row never depends on which
other rows share its batch.

Statistics and auxiliary losses take per-row ``weights``; with ``weights = multiplicity`` (or,
more generally, the number of counted semantic positions on each row, see
:func:`semantic_row_weights`) they equal the trajectory-wise values over all semantic positions:
a weighted sum over rows is the plain sum over positions, and a weighted mean is the plain mean.
Gradients w.r.t. the router logits agree too: trajectory-wise, the gradient of a shared row is
the sum over its positions, which is exactly what the weight does.

Routers (float32 math for low-precision logits, float64 stays float64):

* :func:`softmax_topk_route` — Qwen2-MoE / Qwen3-MoE / Qwen3-Next: softmax over experts, top-k,
  optional renormalization of the k weights.
* :func:`sigmoid_grouped_topk_route` — DeepSeek-V3 / Kimi-Linear: sigmoid scores, bias-corrected
  choice scores, group-limited top-k, weights are the uncorrected scores (renormalized, scaled).

The expert FFN is row-wise and runs unchanged on compact rows: :func:`moe_forward` is a grouped
SwiGLU dispatch (loop over experts, not tokens); :func:`moe_forward_reference` is a per-token
loop used as the test oracle.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from harts_verl.ops._dtypes import compute_dtype

__all__ = [
    "RouteResult",
    "expert_load",
    "load_balancing_loss",
    "moe_forward",
    "moe_forward_reference",
    "router_z_loss",
    "semantic_row_weights",
    "sigmoid_grouped_topk_route",
    "softmax_topk_route",
    "stable_topk",
]


class RouteResult(NamedTuple):
    """Route of T tokens (rows) over E experts.

    Attributes:
      weights: [T, k] combine weights of the chosen experts (float32, or float64 for float64
        logits); differentiable w.r.t. the router logits.
      experts: [T, k] int64 chosen expert ids, in descending order of their choice score (equal
        scores: lower expert index first).
      probs: [T, E] router probabilities (softmax router) or sigmoid scores (sigmoid router), in
        the weights' dtype; the input of :func:`load_balancing_loss`.
    """

    weights: Tensor
    experts: Tensor
    probs: Tensor


def _check_logits(router_logits: Tensor, name: str = "router_logits") -> None:
    if not isinstance(router_logits, Tensor) or router_logits.ndim != 2:
        shape = tuple(router_logits.shape) if isinstance(router_logits, Tensor) else None
        raise ValueError(f"{name}: expected a [T, E] tensor, got shape {shape}")
    if not router_logits.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {router_logits.dtype}")


def _check_top_k(top_k: int, num: int, name: str = "top_k", what: str = "experts") -> None:
    if not isinstance(top_k, int | np.integer) or isinstance(top_k, bool) or not 1 <= top_k <= num:
        raise ValueError(f"{name}: expected an int in [1, {num}] ({num} {what}), got {top_k!r}")


def stable_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Deterministic top-k along the last dim: values and int64 indices in descending order of
    score; equal scores are ordered by lower index first — the first k of a stable descending
    sort, on every device and for every batch composition.

    ``scores``: [..., E] floating point (no NaN); returns ([..., k], [..., k]). Computed as
    ``torch.topk`` for the k-th largest value, then the elements above it plus the
    lowest-index elements equal to it, sorted stably (cheaper than sorting all E scores).
    """
    s = scores.detach()
    e = s.shape[-1]
    if k >= e:
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices
        return scores.gather(-1, order), order
    thr = torch.topk(s, k, dim=-1, sorted=True).values[..., -1:]
    above = s > thr
    tie = s == thr
    need = k - above.sum(dim=-1, keepdim=True)
    chosen = above | (tie & (torch.cumsum(tie, dim=-1) <= need))
    # Exactly k chosen per row; their ascending indices, then a stable sort of k values.
    ar = torch.arange(e, device=s.device).expand_as(s)
    idx = ar.masked_select(chosen).view(*s.shape[:-1], k)
    sub = torch.sort(s.gather(-1, idx), dim=-1, descending=True, stable=True).indices
    order = idx.gather(-1, sub)
    return scores.gather(-1, order), order


def softmax_topk_route(
    router_logits: Tensor, top_k: int, *, norm_topk_prob: bool = True
) -> RouteResult:
    """Softmax top-k routing (Qwen2-MoE, Qwen3-MoE, Qwen3-Next).

    ``probs = softmax(router_logits.float(), -1)``; the k largest probabilities are the weights,
    divided by their sum if ``norm_topk_prob`` (Qwen3-Next: True, Qwen2-MoE: config default
    False). ``router_logits``: [T, E] floating point. Ties go to the lower expert index.
    Weights and probs are float32 (float64 for float64 logits), differentiable w.r.t. the logits.
    """
    _check_logits(router_logits)
    _check_top_k(top_k, router_logits.shape[1])
    probs = torch.softmax(router_logits.to(compute_dtype(router_logits.dtype)), dim=-1)
    weights, experts = stable_topk(probs, int(top_k))
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return RouteResult(weights, experts, probs)


def sigmoid_grouped_topk_route(
    router_logits: Tensor,
    *,
    top_k: int,
    correction_bias: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    norm_topk_prob: bool = True,
) -> RouteResult:
    """Sigmoid group-limited top-k routing (DeepSeek-V3, Kimi-Linear, GLM-4.5 MoE).

    ``scores = sigmoid(router_logits.float())``; choice scores ``scores + correction_bias``
    (the aux-loss-free balancing bias, [E], not differentiated); the E experts form ``n_group``
    contiguous groups, a group's score is the sum of its two largest choice scores, the
    ``topk_group`` best groups are kept, and the ``top_k`` experts with the largest choice scores
    among them are chosen (experts of dropped groups can never be chosen). The weights are the
    *uncorrected* scores of the chosen experts, divided by their sum (+1e-20) if
    ``norm_topk_prob``, times ``routed_scaling_factor``. Ties (groups and experts) go to the lower
    index. ``probs`` of the result are the sigmoid scores [T, E].
    """
    _check_logits(router_logits)
    t, e = router_logits.shape
    if not isinstance(n_group, int | np.integer) or n_group < 1 or e % n_group:
        raise ValueError(f"n_group: expected a positive divisor of E={e}, got {n_group!r}")
    group_size = e // int(n_group)
    _check_top_k(topk_group, int(n_group), "topk_group", "groups")
    _check_top_k(top_k, int(topk_group) * group_size, "top_k", "experts in the kept groups")
    cdt = compute_dtype(router_logits.dtype)
    scores = torch.sigmoid(router_logits.to(cdt))
    choice = scores.detach()
    if correction_bias is not None:
        if not isinstance(correction_bias, Tensor) or correction_bias.shape != (e,):
            shape = tuple(correction_bias.shape) if isinstance(correction_bias, Tensor) else None
            raise ValueError(f"correction_bias: expected shape ({e},), got {shape}")
        choice = choice + correction_bias.detach().to(device=choice.device, dtype=cdt)
    grouped = choice.view(t, int(n_group), group_size)
    top2 = min(2, group_size)
    group_scores = stable_topk(grouped, top2)[0].sum(dim=-1)  # [T, n_group]
    kept_groups = stable_topk(group_scores, int(topk_group))[1]
    group_mask = torch.zeros(t, int(n_group), dtype=torch.bool, device=choice.device)
    group_mask.scatter_(1, kept_groups, True)
    expert_mask = group_mask.repeat_interleave(group_size, dim=1)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    experts = stable_topk(masked, int(top_k))[1]
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return RouteResult(weights, experts, scores)


# ---------------------------------------------------------------------------------- weights
def semantic_row_weights(forest: Any, semantic_weights: Any = None) -> np.ndarray:
    """Per-row weights that turn row sums into semantic sums.

    ``forest``: a RolloutForest. Without ``semantic_weights`` returns ``forest.multiplicity``
    (int64 [C]). With ``semantic_weights`` ([S] numbers or bools, e.g. a loss mask over the flat
    semantic positions in CSR order) returns float64 [C] with ``w[r] = Σ_{s: row(s)=r}
    semantic_weights[s]``. Either way ``Σ_r w[r]·f(r) == Σ_s semantic_weights[s]·f(row(s))``.
    """
    if semantic_weights is None:
        return np.asarray(forest.multiplicity, dtype=np.int64)
    sw = np.asarray(
        semantic_weights.detach().cpu()
        if isinstance(semantic_weights, Tensor)
        else semantic_weights
    )
    s = forest.num_semantic_tokens
    if sw.shape != (s,):
        raise ValueError(f"semantic_weights: expected shape ({s},), got {sw.shape}")
    return np.bincount(
        forest.semantic_rows, weights=sw.astype(np.float64), minlength=forest.num_compact_tokens
    )


def _as_weights(weights: Any, t: int, device: torch.device, name: str = "weights") -> Tensor | None:
    if weights is None:
        return None
    w = torch.as_tensor(weights)  # host data stays on the host until checked
    if w.shape != (t,):
        raise ValueError(f"{name}: expected shape ({t},), got {tuple(w.shape)}")
    if w.dtype == torch.bool or w.is_complex():
        raise ValueError(f"{name}: expected real row weights, got {w.dtype}")
    if w.device.type == "cpu" and t:  # checked where it costs no device sync (host data)
        wf = w.double()
        if not bool(torch.isfinite(wf).all()) or float(wf.min()) < 0:
            raise ValueError(f"{name}: expected finite non-negative row weights")
    return w.to(device)


def _check_experts(experts: Tensor, num_experts: int) -> None:
    if not isinstance(experts, Tensor) or experts.ndim != 2:
        shape = tuple(experts.shape) if isinstance(experts, Tensor) else None
        raise ValueError(f"experts: expected a [T, k] int tensor, got shape {shape}")
    if experts.is_floating_point() or experts.dtype == torch.bool:
        raise ValueError(f"experts: expected integer expert ids, got {experts.dtype}")
    if not isinstance(num_experts, int | np.integer) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
        raise ValueError(f"experts: ids must lie in [0, {num_experts})")


# ---------------------------------------------------------------------------------- stats
def expert_load(experts: Tensor, num_experts: int, weights: Any = None) -> Tensor:
    """Weighted number of routed assignments per expert: ``load[e] = Σ_t w_t · #{j: experts[t,j]
    = e}`` ([E]).

    ``experts``: [T, k] int; ``weights``: [T] (tensor or numpy; default all ones). Integer or
    absent weights give an exact int64 count; float weights give a float sum in their dtype.
    With ``weights = multiplicity`` it equals the count over the expanded (trajectory-wise) rows.
    """
    _check_experts(experts, num_experts)
    t, k = experts.shape
    w = _as_weights(weights, t, experts.device)
    flat = experts.reshape(-1).long()
    if w is None:
        return torch.bincount(flat, minlength=int(num_experts))
    wk = w.repeat_interleave(k)
    if not w.is_floating_point():
        out = torch.zeros(int(num_experts), dtype=torch.int64, device=experts.device)
        return out.index_add_(0, flat, wk.long())
    return torch.zeros(int(num_experts), dtype=w.dtype, device=experts.device).index_add_(
        0, flat, wk
    )


def _weighted_mean(values: Tensor, w: Tensor | None) -> Tensor:
    """Mean over dim 0 of ``values`` [T, ...] with row weights ``w`` [T] (None: plain mean).
    Raises ValueError for T = 0 or (weights on the CPU) weights summing to 0."""
    if values.shape[0] == 0:
        raise ValueError("tokens: no tokens to average over (T = 0)")
    if w is None:
        return values.mean(dim=0)
    if w.device.type == "cpu" and float(w.double().sum()) == 0:
        raise ValueError("weights: sum to 0 (no token to average over)")
    w = w.to(values.dtype)
    shape = (-1,) + (1,) * (values.ndim - 1)
    return (values * w.view(shape)).sum(dim=0) / w.sum()


def load_balancing_loss(
    probs: Tensor,
    experts: Tensor,
    num_experts: int,
    top_k: int,
    weights: Any = None,
    *,
    divide_by_top_k: bool = False,
) -> Tensor:
    """Switch / Qwen load-balancing loss ``E · Σ_e f_e · P_e`` (scalar, ``probs``' dtype).

    ``f_e``: weighted mean over tokens of the number of the token's k assignments that go to
    expert e (as ``transformers``' ``load_balancing_loss_func``: Σ_e f_e = k); with
    ``divide_by_top_k`` it is divided by k, i.e. the fraction of all routed assignments (Megatron
    form, Σ_e f_e = 1). ``P_e``: weighted mean router probability of expert e. ``probs``: [T, E]
    (e.g. ``RouteResult.probs``), ``experts``: [T, k], ``weights``: [T] row weights (multiplicity
    gives the trajectory-wise value; default: plain means). Differentiable through ``probs``
    (``f`` is a count and carries no gradient, as in the reference).
    """
    _check_logits(probs, "probs")
    _check_experts(experts, num_experts)
    t, e = probs.shape
    if e != num_experts:
        raise ValueError(f"probs: expected {num_experts} experts in dim 1, got {e}")
    if experts.shape[0] != t:
        raise ValueError(f"experts: expected {t} rows (as probs), got {experts.shape[0]}")
    if experts.shape[1] != top_k:
        raise ValueError(f"top_k: experts has {experts.shape[1]} columns, got top_k={top_k}")
    w = _as_weights(weights, t, probs.device)
    counts = torch.zeros(t, e, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(
        1, experts.long(), torch.ones(experts.shape, dtype=probs.dtype, device=probs.device)
    )
    f = _weighted_mean(counts, w)
    if divide_by_top_k:
        f = f / top_k
    p = _weighted_mean(probs, w)
    return (f * p).sum() * num_experts


def router_z_loss(router_logits: Tensor, weights: Any = None) -> Tensor:
    """ST-MoE router z-loss: weighted mean over tokens of ``logsumexp(logits)²`` (scalar).

    ``router_logits``: [T, E]; computed in float32 (float64 stays float64); ``weights``: [T] row
    weights (multiplicity gives the trajectory-wise mean).
    """
    _check_logits(router_logits)
    z = torch.logsumexp(router_logits.to(compute_dtype(router_logits.dtype)), dim=-1)
    return _weighted_mean(z * z, _as_weights(weights, router_logits.shape[0], z.device))


# ---------------------------------------------------------------------------------- dispatch
def _check_moe(
    x: Tensor, weights: Tensor, experts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor
) -> None:
    if x.ndim != 2:
        raise ValueError(f"x: expected [T, D], got shape {tuple(x.shape)}")
    t, d = x.shape
    if w_gate.ndim != 3 or w_gate.shape[1] != d:
        raise ValueError(f"w_gate: expected [E, {d}, F], got shape {tuple(w_gate.shape)}")
    e, _, f = w_gate.shape
    if w_up.shape != (e, d, f):
        raise ValueError(f"w_up: expected {(e, d, f)}, got {tuple(w_up.shape)}")
    if w_down.shape != (e, f, d):
        raise ValueError(f"w_down: expected {(e, f, d)}, got {tuple(w_down.shape)}")
    _check_experts(experts, e)
    if experts.shape[0] != t:
        raise ValueError(f"experts: expected {t} rows (as x), got {experts.shape[0]}")
    if weights.shape != experts.shape:
        raise ValueError(
            f"weights: expected shape {tuple(experts.shape)} (as experts), got {tuple(weights.shape)}"
        )


def _swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def moe_forward(
    x: Tensor, weights: Tensor, experts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor
) -> Tensor:
    """Grouped SwiGLU expert dispatch: ``out[t] = Σ_j weights[t,j] · FFN_{experts[t,j]}(x[t])``.

    ``x``: [T, D]; ``weights``/``experts``: [T, k] (a :class:`RouteResult`'s fields);
    ``w_gate``, ``w_up``: [E, D, F]; ``w_down``: [E, F, D]; ``FFN_e(v) = (silu(v W_gate[e]) ⊙
    v W_up[e]) W_down[e]``. Assignments are grouped by expert with a stable argsort and each
    expert runs once on its tokens (loop over experts that received tokens). Returns [T, D] in
    ``x``'s dtype (the weights are cast to it); differentiable w.r.t. x, weights and the expert
    weights. Row-wise: on compact rows it equals the trajectory-wise output gathered by row.
    """
    _check_moe(x, weights, experts, w_gate, w_up, w_down)
    t, k = experts.shape
    out = torch.zeros_like(x)
    if t == 0:
        return out
    flat = experts.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    token_of = torch.div(order, k, rounding_mode="floor")
    counts = torch.bincount(flat, minlength=w_gate.shape[0]).tolist()
    w_sorted = weights.reshape(-1)[order].to(x.dtype)
    outputs = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            y = _swiglu(x[token_of[start : start + n]], w_gate[e], w_up[e], w_down[e])
            outputs.append(y * w_sorted[start : start + n, None])
            start += n
    return out.index_add_(0, token_of, torch.cat(outputs))


def moe_forward_reference(
    x: Tensor, weights: Tensor, experts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor
) -> Tensor:
    """Per-token loop oracle of :func:`moe_forward` (same signature and result; slow)."""
    _check_moe(x, weights, experts, w_gate, w_up, w_down)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            acc = (
                acc
                + weights[t, j].to(x.dtype)
                * _swiglu(x[t : t + 1], w_gate[e], w_up[e], w_down[e])[0]
            )
        rows.append(acc)
    return torch.stack(rows) if rows else torch.zeros_like(x)
