"""Micro-benchmark: tree vs expanded chunkwise linear attention (KDA / GDN) over planned rounds.

Times forward+backward of ``tree_delta_rule`` on a SWE-like microbatch in its tree layout and in
the trajectory-wise layout (``RolloutForest.expanded``: one member per trajectory, one round), and
reports the work ratio: processed tokens (expanded S vs tree C + replay) and chunk-padded tokens,
and the outputs' max difference (same inputs position by position). Each side runs once untimed,
then ``--repeats`` times in alternating order (best time). Prints JSON.

    python benchmarks/ops_linear_attention.py [--kind kda|gdn] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import torch

from harts_verl.benchmark import alternating_runs
from harts_verl.ops.layout import MAX_CHUNK_SIZE
from harts_verl.ops.tree_linear_attention import build_linear_layout, tree_delta_rule
from harts_verl.tree import RolloutForest
from harts_verl.tree._checks import int_arg
from harts_verl.tree.workloads import swe_like


def _inputs(forest: RolloutForest, args: argparse.Namespace) -> list[torch.Tensor]:
    """q, k, v, g, beta of ``forest``'s rows (seeded)."""
    c = forest.num_compact_tokens
    g = torch.Generator().manual_seed(0)
    h, hv, k, v = args.heads, args.heads, args.head_dim, args.head_dim
    return [
        torch.randn(c, h, k, generator=g),
        torch.randn(c, h, k, generator=g),
        torch.randn(c, hv, v, generator=g),
        -torch.rand((c, hv, k) if args.kind == "kda" else (c, hv), generator=g) * 0.3,
        torch.rand(c, hv, generator=g),
    ]


def _time_pair(
    sides: dict[str, tuple[Any, list[torch.Tensor]]], repeats: int
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Best forward+backward seconds of each side (``layout``, inputs) over
    :func:`alternating_runs`, and each side's last output."""

    def once(key: str) -> tuple[tuple[float], torch.Tensor]:
        layout, xs = sides[key]
        for x in xs:
            x.grad = None
        t0 = time.perf_counter()
        o = tree_delta_rule(*xs, layout, use_qk_l2norm=True)
        o.sum().backward()
        return (time.perf_counter() - t0,), o.detach()

    runs, outs = alternating_runs({key: lambda k=key: once(k) for key in sides}, repeats)
    return {key: min(t for (t,) in runs[key]) for key in runs}, outs


def _stats(layout: Any, forest: RolloutForest, args: argparse.Namespace) -> dict:
    c = forest.num_compact_tokens
    plan = layout.plan
    lens = np.concatenate([np.diff(r.cu_seqlens) for r in plan.arrays.rounds])
    stats = {
        "rows": c,
        "rounds": plan.num_rounds,
        "members": plan.num_members,
        "replay_tokens": plan.replay_tokens,
        "processed_tokens": int(lens.sum()),
        "chunk_padded_tokens": int((np.ceil(lens / args.chunk_size) * args.chunk_size).sum()),
    }
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kind", choices=["kda", "gdn"], default="kda")
    ap.add_argument("--repeats", type=int_arg(1), default=2)
    ap.add_argument("--chunk-size", type=int_arg(1, MAX_CHUNK_SIZE), default=64)
    ap.add_argument("--heads", type=int_arg(1), default=4)
    ap.add_argument("--head-dim", type=int_arg(1), default=64)
    ap.add_argument("--threads", type=int_arg(1), default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # One SWE-like issue with realistic turn lengths, paths capped at 4K (the bench default).
    w = swe_like(scale=0.05, seed=0, path_caps=[4096], prompt_tokens=[1500, 3000])
    tree = RolloutForest.from_sequences(w.sequences)
    expanded = RolloutForest.expanded(w.sequences)
    print(
        f"tree {tree.num_compact_tokens} rows, expanded {expanded.num_compact_tokens}",
        file=sys.stderr,
    )
    lay_t = build_linear_layout(tree, chunk_size=args.chunk_size)
    lay_e = build_linear_layout(expanded, chunk_size=args.chunk_size)
    xs_t = _inputs(tree, args)
    sem = torch.from_numpy(np.asarray(tree.semantic_rows, dtype=np.int64))
    # the same inputs position by position: the expanded rows gathered from the tree's
    xs_e = [x[sem].clone().requires_grad_(True) for x in xs_t]
    xs_t = [x.requires_grad_(True) for x in xs_t]
    best, outs = _time_pair({"tree": (lay_t, xs_t), "expanded": (lay_e, xs_e)}, args.repeats)
    t_tree, t_exp = best["tree"], best["expanded"]
    s_tree = {**_stats(lay_t, tree, args), "fwd_bwd_seconds": round(t_tree, 4)}
    s_exp = {**_stats(lay_e, expanded, args), "fwd_bwd_seconds": round(t_exp, 4)}
    out = {
        "benchmark": "ops_linear_attention",
        "kind": args.kind,
        "shape": {"H": args.heads, "HV": args.heads, "K": args.head_dim, "V": args.head_dim},
        "compression": round(tree.compression, 4),
        "tree": s_tree,
        "expanded": s_exp,
        "work_ratio_tokens": round(s_exp["processed_tokens"] / s_tree["processed_tokens"], 4),
        "work_ratio_padded": round(s_exp["chunk_padded_tokens"] / s_tree["chunk_padded_tokens"], 4),
        "time_ratio": round(t_exp / t_tree, 4),
        # the same outputs (the tree's rows gathered to semantic positions)
        "max_abs_diff": float((outs["tree"][sem] - outs["expanded"]).abs().max()),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(out, indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
