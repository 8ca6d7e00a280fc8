"""Linear-attention call planner benchmark: planning time on SWE-like microbatches of ~32K-1M
compact tokens, its scaling (10x more rows should cost <= 12x time), rounds, and replay tokens /
compact tokens. Prints JSON to stdout.

Microbatches are contiguous leaf-order ranges of trajectories (what the microbatch planner
produces): the shortest range starting at a few spread-out offsets whose compact work reaches the
target. The forest (and its segments) is built once per microbatch, outside the timing; the timed
call is ``plan_linear_calls(forest, chunk_size=B)`` (array form, everything an op consumes).
Scaling uses best-of-N times (the machine may be shared); medians are reported too.
``object_view_ms`` additionally times building the per-member Python objects (``plan.rounds``).

    python benchmarks/linear_plan.py [--workload swe_like] [--scale 12] [--repeats 15] [--chunk-size 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from harts_verl.tree import RolloutForest, plan_linear_calls
from harts_verl.tree._checks import finite_float_arg, int_arg
from harts_verl.tree.workloads import MAX_SCALE, WORKLOADS

TARGETS = (32_000, 100_000, 320_000, 1_000_000)


def _time(fn, repeats: int) -> tuple[float, float, object]:
    """(median seconds, min seconds, last result) over ``repeats`` runs after one warm-up."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), out


def _microbatches(forest: RolloutForest, target: int, count: int) -> list[np.ndarray]:
    """Up to ``count`` disjoint contiguous leaf-order ranges of trajectories whose compact work
    lies in ``[0.95, 1.4] x target`` (the first such range from each start, scanning in order)."""
    order = forest.leaf_order
    lens = forest.lengths[order]
    lcp = np.concatenate([[0], forest.adjacent_lcp])
    new_rows = np.cumsum(lens - lcp)  # compact rows created up to each leaf (inclusive)
    # Work of the range [i, j] = new_rows[j] - new_rows[i] + lens[i], increasing in j.
    base = new_rows - lens
    ends = np.searchsorted(new_rows, base + 0.95 * target, side="left")
    ends = np.maximum(ends, np.arange(order.shape[0]))
    out: list[np.ndarray] = []
    i, n = 0, order.shape[0]
    while i < n and len(out) < count:
        j = int(ends[i])
        if j < n and new_rows[j] - base[i] <= 1.4 * target:
            out.append(order[i : j + 1])
            i = j + 1
        else:
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="swe_like", choices=sorted(WORKLOADS))
    ap.add_argument(
        "--scale",
        type=finite_float_arg(0, inclusive=False, hi=MAX_SCALE),
        default=12.0,
        help="workload scale in (0, 256]: at least scale x 1M semantic tokens above the tiny range, in whole groups",
    )
    ap.add_argument("--seed", type=int_arg(0), default=0)
    # the bound every runner and engine applies (harts_verl.ops.layout.MAX_CHUNK_SIZE; tree/ is numpy-only)
    ap.add_argument("--chunk-size", type=int_arg(1, 4096), default=64)
    ap.add_argument("--per-size", type=int_arg(1), default=3, help="microbatches per target size")
    ap.add_argument("--repeats", type=int_arg(1), default=15, help="timed runs (>= 1)")
    args = ap.parse_args(argv)

    print(f"generating {args.workload} scale={args.scale} ...", file=sys.stderr)
    w = WORKLOADS[args.workload](scale=args.scale, seed=args.seed)
    full = RolloutForest.from_sequences(w.sequences)

    sizes = []
    for target in TARGETS:
        rows = []
        for idx in _microbatches(full, target, args.per_size):
            mb = full.subset(idx)
            _ = mb.segments  # forest property, computed once outside the timing
            t_med, t_min, plan = _time(
                lambda mb=mb: plan_linear_calls(mb, chunk_size=args.chunk_size), args.repeats
            )
            t_obj, _, _ = _time(
                lambda mb=mb: plan_linear_calls(mb, chunk_size=args.chunk_size).rounds, 1
            )
            s = plan.summary()
            by_chunk = {}
            for b in (16, 32, 64):
                sb = plan_linear_calls(mb, chunk_size=b).summary()
                by_chunk[str(b)] = {
                    "rounds": sb["rounds"],
                    "replay_fraction": round(sb["replay_fraction"], 5),
                    "materialized_states": sb["materialized_states"],
                }
            rows.append(
                {
                    "trajectories": mb.num_trajectories,
                    "compact_tokens": mb.num_compact_tokens,
                    "semantic_tokens": mb.num_semantic_tokens,
                    "segments": len(mb.segments),
                    "rounds": s["rounds"],
                    "members": s["members"],
                    "replay_tokens": s["replay_tokens"],
                    "replay_fraction": round(s["replay_fraction"], 5),
                    "materialized_states": s["materialized_states"],
                    "plan_ms_median": round(t_med * 1e3, 3),
                    "plan_ms_min": round(t_min * 1e3, 3),
                    "object_view_ms": round(t_obj * 1e3, 3),
                    "ns_per_row": round(t_med * 1e9 / mb.num_compact_tokens, 1),
                    "by_chunk_size": by_chunk,
                }
            )
        if not rows:
            print(f"no microbatch of {target} tokens (raise --scale)", file=sys.stderr)
            continue
        sizes.append(
            {
                "target_compact_tokens": target,
                "microbatches": rows,
                "mean_compact_tokens": round(statistics.mean(r["compact_tokens"] for r in rows)),
                "mean_plan_ms": round(statistics.mean(r["plan_ms_median"] for r in rows), 3),
                "mean_plan_ms_min": round(statistics.mean(r["plan_ms_min"] for r in rows), 3),
            }
        )

    scaling = []
    by_target = {s["target_compact_tokens"]: s for s in sizes}
    for lo, hi in ((32_000, 320_000), (100_000, 1_000_000)):
        if lo in by_target and hi in by_target:
            a, b = by_target[lo], by_target[hi]
            rows_ratio = b["mean_compact_tokens"] / a["mean_compact_tokens"]
            # Best-of-N times (robust to a shared, noisy machine); medians reported alongside.
            time_ratio = b["mean_plan_ms_min"] / a["mean_plan_ms_min"]
            time_ratio_median = b["mean_plan_ms"] / a["mean_plan_ms"]
            scaling.append(
                {
                    "from_tokens": a["mean_compact_tokens"],
                    "to_tokens": b["mean_compact_tokens"],
                    "rows_ratio": round(rows_ratio, 2),
                    "time_ratio": round(time_ratio, 2),
                    "time_ratio_per_10x_rows": round(time_ratio * 10 / rows_ratio, 2),
                    "median_time_ratio_per_10x_rows": round(time_ratio_median * 10 / rows_ratio, 2),
                    "ok_le_12x": bool(time_ratio * 10 / rows_ratio <= 12),
                }
            )

    all_rows = [r for s in sizes for r in s["microbatches"]]
    result = {
        "benchmark": "linear_plan",
        "workload": args.workload,
        "scale": args.scale,
        "seed": args.seed,
        "chunk_size": args.chunk_size,
        "full_forest": full.summary(),
        "sizes": sizes,
        "scaling": scaling,
        # null when nothing was measured (no microbatch of any target size)
        "max_rounds": max((r["rounds"] for r in all_rows), default=None),
        "mean_replay_fraction": round(statistics.mean(r["replay_fraction"] for r in all_rows), 6)
        if all_rows
        else None,
    }
    print(json.dumps(result, indent=2, allow_nan=False))
    if not all_rows:
        print(
            f"linear_plan.py: nothing measured: the forest has {full.num_compact_tokens} compact "
            f"tokens, fewer than the smallest target ({min(TARGETS)}); raise --scale",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
