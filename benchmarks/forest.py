"""Forest build benchmark: semantic tokens/s on a large SWE-like step, and the speed ratio
against the naive dict-of-children trie on a >= 1M-token subset. Prints JSON to stdout.

    python benchmarks/forest.py [--scale 16] [--naive-tokens 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from harts_verl.tree import RolloutForest
from harts_verl.tree._checks import finite_float_arg, int_arg
from harts_verl.tree.naive import build_naive_trie
from harts_verl.tree.workloads import MAX_SCALE, WORKLOADS


def _best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="swe_like", choices=sorted(WORKLOADS))
    ap.add_argument(
        "--scale",
        type=finite_float_arg(0, inclusive=False, hi=MAX_SCALE),
        default=16.0,
        help="workload scale in (0, 256]: at least scale x 1M semantic tokens above the tiny range, in whole groups",
    )
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument("--repeats", type=int_arg(1), default=3, help="best-of runs (>= 1)")
    ap.add_argument("--naive-tokens", type=int_arg(1), default=1_000_000)
    args = ap.parse_args(argv)

    print(f"generating {args.workload} scale={args.scale} ...", file=sys.stderr)
    w = WORKLOADS[args.workload](scale=args.scale, seed=args.seed)
    seqs = w.sequences
    s_total = int(sum(len(s) for s in seqs))

    print("building forest ...", file=sys.stderr)
    t_build, forest = _best_of(
        lambda: RolloutForest.from_sequences(seqs, group_ids=w.group_ids), args.repeats
    )
    t_turns, f_turns = _best_of(lambda: RolloutForest.from_turns(w.turns), 1)
    assert f_turns.equals(forest, group_ids=False)  # turns carry no group ids

    # Naive comparison on a prefix of whole groups with >= naive_tokens semantic tokens.
    order = np.argsort(w.group_ids, kind="stable")
    cum = np.cumsum([len(seqs[i]) for i in order])
    k = int(np.searchsorted(cum, args.naive_tokens)) + 1
    sub_idx = np.sort(order[:k])
    # extend to whole groups
    groups = np.unique(w.group_ids[sub_idx])
    sub_idx = np.flatnonzero(np.isin(w.group_ids, groups))
    sub = [seqs[i] for i in sub_idx]
    sub_tokens = int(sum(len(s) for s in sub))
    print(f"naive trie on {sub_tokens} tokens ...", file=sys.stderr)
    # the naive build runs once (it takes long): the speed ratio compares it with the fast
    # build's first run, one cold run each (best-of beside it as fast_subset_seconds)
    t_fast_first, f_sub = _best_of(lambda: RolloutForest.from_sequences(sub), 1)
    t_fast_sub, f_sub = _best_of(lambda: RolloutForest.from_sequences(sub), args.repeats)
    t_naive, naive = _best_of(lambda: build_naive_trie(sub), 1)
    assert np.array_equal(naive.token_ids, f_sub.token_ids)
    assert np.array_equal(naive.parent, f_sub.parent)

    result = {
        "benchmark": "forest_build",
        "workload": args.workload,
        "scale": args.scale,
        "trajectories": forest.num_trajectories,
        "semantic_tokens": s_total,
        "compact_tokens": forest.num_compact_tokens,
        "compression": round(forest.compression, 4),
        "build_seconds": round(t_build, 4),
        "semantic_tokens_per_second": round(s_total / t_build),
        "from_turns_seconds": round(t_turns, 4),
        "naive_subset_tokens": sub_tokens,
        "naive_seconds": round(t_naive, 4),
        "fast_subset_seconds": round(t_fast_sub, 5),
        "fast_subset_first_seconds": round(t_fast_first, 5),
        "speedup_vs_naive": round(t_naive / t_fast_first, 1),
        "threads": "numpy single-threaded ops (sort/compare/copy)",
    }
    print(json.dumps(result, indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
