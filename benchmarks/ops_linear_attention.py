"""Micro-benchmark: tree vs expanded chunkwise linear attention (KDA / GDN) over planned rounds.

Times forward+backward of ``tree_delta_rule`` on a SWE-like microbatch in its tree layout and in
the trajectory-wise layout (``RolloutForest.expanded``: one member per trajectory, one round), and
reports the work ratio: processed tokens (expanded S vs tree C + replay) and chunk-padded tokens.
Prints JSON.

    python benchmarks/ops_linear_attention.py [--kind kda|gdn] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from harts_verl.ops.tree_linear_attention import build_linear_layout, tree_delta_rule
from harts_verl.tree import RolloutForest
from harts_verl.tree._checks import int_arg
from harts_verl.tree.workloads import swe_like


def _time(forest: RolloutForest, args: argparse.Namespace) -> tuple[float, dict]:
    layout = build_linear_layout(forest, chunk_size=args.chunk_size)
    c = forest.num_compact_tokens
    g = torch.Generator().manual_seed(0)
    h, hv, k, v = args.heads, args.heads, args.head_dim, args.head_dim
    xs = [
        torch.randn(c, h, k, generator=g),
        torch.randn(c, h, k, generator=g),
        torch.randn(c, hv, v, generator=g),
        -torch.rand((c, hv, k) if args.kind == "kda" else (c, hv), generator=g) * 0.3,
        torch.rand(c, hv, generator=g),
    ]
    xs = [x.requires_grad_(True) for x in xs]
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        o = tree_delta_rule(*xs, layout, use_qk_l2norm=True)
        o.sum().backward()
        best = min(best, time.perf_counter() - t0)
    plan = layout.plan
    lens = np.concatenate([np.diff(r.cu_seqlens) for r in plan.arrays.rounds])
    stats = {
        "rows": c,
        "rounds": plan.num_rounds,
        "members": plan.num_members,
        "replay_tokens": plan.replay_tokens,
        "processed_tokens": int(lens.sum()),
        "chunk_padded_tokens": int((np.ceil(lens / args.chunk_size) * args.chunk_size).sum()),
        "fwd_bwd_seconds": round(best, 4),
    }
    return best, stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kind", choices=["kda", "gdn"], default="kda")
    ap.add_argument("--repeats", type=int_arg(1), default=2)
    ap.add_argument("--chunk-size", type=int_arg(1), default=64)
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
    t_tree, s_tree = _time(tree, args)
    t_exp, s_exp = _time(expanded, args)
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
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(out, indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
