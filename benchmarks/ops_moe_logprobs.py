"""Tree vs expanded timing of compact log-probs (fwd+bwd) and of MoE routing statistics.

Prints one JSON object. The tree run computes vocabulary work once per distinct hidden row (rows
with a child); the expanded run (``RolloutForest.expanded``: one row per semantic position) does
it once per semantic position with a label (S − N). ``work_ratio`` = (S − N) / H is the ideal
speed-up; ``speedup`` the measured one. Both runs see bitwise-equal hidden states (the expanded
ones are a gather of the row ones), and ``max_abs_diff_*`` reports their disagreement.

Usage: ``python benchmarks/ops_moe_logprobs.py [--scale 0.008] [--seed 2] [--vocab 32000]
[--dim 256] [--rows-per-chunk 4096] [--experts 64] [--top-k 6] [--repeats 1]``.
Defaults: SWE-like forest of ~8K compact rows, V=32000, D=256, float32 (< 1 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from harts_verl.benchmark import alternating_runs, wall_timed
from harts_verl.ops.logprobs import compact_log_probs
from harts_verl.ops.moe import (
    expert_load,
    load_balancing_loss,
    router_z_loss,
    sigmoid_grouped_topk_route,
    softmax_topk_route,
)
from harts_verl.tree._checks import finite_float_arg, int_arg
from harts_verl.tree.forest import RolloutForest
from harts_verl.tree.workloads import MAX_SCALE, swe_like


def _sequences(scale: float, seed: int, vocab: int) -> tuple[list[np.ndarray], str]:
    return [s % vocab for s in swe_like(scale, seed).sequences], f"swe_like({scale}, {seed})"


def _timed_pair(
    tree_fn: Callable[[], Any], exp_fn: Callable[[], Any], repeats: int
) -> tuple[float, Any, float, Any]:
    """Best wall seconds and last result of ``tree_fn`` and ``exp_fn`` over
    :func:`alternating_runs` (one untimed call of each, then ``repeats`` alternating)."""
    runs, out = alternating_runs(
        {"tree": wall_timed(tree_fn), "expanded": wall_timed(exp_fn)}, repeats
    )
    best = {key: min(t for (t,) in runs[key]) for key in runs}
    return best["tree"], out["tree"], best["expanded"], out["expanded"]


def _logprob_run(
    forest: RolloutForest,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    out = compact_log_probs(h, w, forest, with_entropy=True, rows_per_chunk=chunk, output="flat")
    ((out.log_probs * c1).sum() + (out.entropy * c2).sum()).backward()
    return out.log_probs.detach(), out.entropy.detach(), w.grad


def _moe_stats(
    logits: torch.Tensor,
    weights: np.ndarray | None,
    style: str,
    top_k: int,
    groups: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().requires_grad_(True)
    e = x.shape[1]
    if style == "softmax":
        r = softmax_topk_route(x, top_k)
    else:
        r = sigmoid_grouped_topk_route(
            x,
            top_k=top_k,
            correction_bias=torch.zeros(e),
            n_group=groups[0],
            topk_group=groups[1],
        )
    load = expert_load(r.experts, e, weights=weights)
    loss = load_balancing_loss(r.probs, r.experts, e, top_k, weights=weights)
    loss = loss + 1e-3 * router_z_loss(x, weights=weights)
    loss.backward()
    return load, loss.detach()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--scale", type=finite_float_arg(0, inclusive=False, hi=MAX_SCALE), default=0.008
    )
    ap.add_argument("--seed", type=int_arg(0), default=2)
    ap.add_argument("--vocab", type=int_arg(2), default=32000)
    ap.add_argument("--dim", type=int_arg(1), default=256)
    ap.add_argument("--rows-per-chunk", type=int_arg(1), default=4096)
    ap.add_argument("--experts", type=int_arg(1), default=64)
    ap.add_argument("--top-k", type=int_arg(1), default=6)
    ap.add_argument(
        "--n-group",
        type=int_arg(1),
        default=None,
        help="expert groups of the sigmoid grouped router (a divisor of --experts; default 8 "
        "where it divides, else 1)",
    )
    ap.add_argument(
        "--topk-group",
        type=int_arg(1),
        default=None,
        help="groups each token picks from (at most --n-group; default min(4, --n-group))",
    )
    ap.add_argument("--repeats", type=int_arg(1), default=1)
    args = ap.parse_args(argv)
    if args.top_k > args.experts:
        ap.error(f"--top-k: expected at most --experts ({args.experts}), got {args.top_k}")
    n_group = args.n_group or (8 if args.experts % 8 == 0 else 1)
    if args.experts % n_group:
        ap.error(f"--n-group: expected a divisor of --experts ({args.experts}), got {n_group}")
    topk_group = args.topk_group or min(4, n_group)
    if topk_group > n_group:
        ap.error(f"--topk-group: expected at most --n-group ({n_group}), got {topk_group}")
    if args.top_k > topk_group * (args.experts // n_group):
        ap.error(
            f"--top-k: the grouped router picks from {topk_group} of {n_group} groups of "
            f"{args.experts // n_group} experts: at most {topk_group * (args.experts // n_group)}, "
            f"got {args.top_k}"
        )

    seqs, source = _sequences(args.scale, args.seed, args.vocab)
    forest = RolloutForest.from_sequences(seqs)
    expanded = RolloutForest.expanded(seqs)
    sem = torch.from_numpy(forest.semantic_rows)
    s, n, c = forest.num_semantic_tokens, forest.num_trajectories, forest.num_compact_tokens
    h_rows = int((forest.num_children > 0).sum())

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(c, args.dim, generator=g)
    weight = torch.randn(args.vocab, args.dim, generator=g) * args.dim**-0.5
    c1 = torch.randn(s - n, generator=g)
    c2 = torch.randn(s - n, generator=g) * 0.1
    chunk = args.rows_per_chunk

    hidden_e = hidden[sem]  # the expanded rows, gathered outside the timer
    t_tree, (lp_t, ent_t, gw_t), t_exp, (lp_e, ent_e, gw_e) = _timed_pair(
        lambda: _logprob_run(forest, hidden, weight, c1, c2, chunk),
        lambda: _logprob_run(expanded, hidden_e, weight, c1, c2, chunk),
        args.repeats,
    )
    gw_rel = float((gw_t - gw_e).abs().max() / gw_e.abs().max())

    logits = torch.randn(c, args.experts, generator=g)
    logits_e = logits[sem]  # gathered outside the timer
    moe: dict[str, Any] = {}
    moe_repeats = max(3, args.repeats)  # cheap: take the best of a few runs
    for style in ("softmax", "sigmoid_grouped"):
        tt, (load_t, loss_t), te, (load_e, loss_e) = _timed_pair(
            lambda st=style: _moe_stats(
                logits, forest.multiplicity, st, args.top_k, (n_group, topk_group)
            ),
            lambda st=style: _moe_stats(logits_e, None, st, args.top_k, (n_group, topk_group)),
            moe_repeats,
        )
        moe[style] = {
            "tree_s": round(tt, 4),
            "expanded_s": round(te, 4),
            "speedup": round(te / tt, 2),
            "load_equal": bool(torch.equal(load_t, load_e)),
            "loss_abs_diff": float((loss_t - loss_e).abs()),
        }

    result = {
        "benchmark": "ops_moe_logprobs",
        "workload": source,
        "forest": forest.summary(),
        "dtype": "float32",
        "vocab": args.vocab,
        "dim": args.dim,
        "rows_per_chunk": chunk,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "log_probs": {
            "semantic_positions_S_minus_N": s - n,
            "distinct_hidden_rows_H": h_rows,
            "work_ratio": round((s - n) / max(h_rows, 1), 3),
            "tree_fwd_bwd_s": round(t_tree, 3),
            "expanded_fwd_bwd_s": round(t_exp, 3),
            "speedup": round(t_exp / t_tree, 3),
            "max_abs_diff_logp": float((lp_t - lp_e).abs().max()),
            "max_abs_diff_entropy": float((ent_t - ent_e).abs().max()),
            "grad_weight_rel_diff": gw_rel,
        },
        "moe_stats": {
            "experts": args.experts,
            "top_k": args.top_k,
            "n_group": n_group,
            "topk_group": topk_group,
            "rows": c,
            "semantic_positions": s,
            "work_ratio": round(s / c, 3),
            **moe,
        },
    }
    print(json.dumps(result, indent=2, allow_nan=False))
    return result


if __name__ == "__main__":
    main()
