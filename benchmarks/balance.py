"""Tree-aware DP balancing benchmark (``harts_verl.workers.balance``): time per call and what
the placement achieves on seeded GRPO-shaped batches, with and without veRL's padding samples.
Prints JSON to stdout.

A batch is ``groups`` prompt groups (a prompt of 5-2,000 tokens, ``n`` samples of 50-1,500
tokens below it; 30% of the groups hold a random 1..n samples, as HARTS' fork sampler or
filtering leaves them), padded as veRL's upsampler does to a multiple of ``dp × mini_batches``
(plus ``extra`` whole cells' worth of padding) with identical 128-token padding samples tagged
``padding``. Per case: the best and median seconds of ``tree_balanced_cells`` over ``repeats``
calls (after one warm-up), the prompt groups cut (in two or more cells), the cells of padding
only and the fewest any placement can have (``max(cells - real, 0)``), the largest and mean
cell work (:func:`~harts_verl.tree.microbatch.compact_work`) and the compression (trajectory
tokens / Σ cell work).

    python benchmarks/balance.py [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from harts_verl.tree import RolloutForest
from harts_verl.tree._checks import int_arg
from harts_verl.workers.balance import padding_only_cells, tree_balanced_cells

PAD = [151645] * 128
# (groups, n, dp, mini_batches, extra cells of padding)
CASES = (
    (2, 2, 4, 1, 3),
    (2, 8, 8, 1, 1),
    (5, 4, 16, 2, 1),
    (8, 8, 64, 1, 0),
    (19, 2, 16, 2, 0),
    (480, 2, 64, 8, 0),
    (16, 8, 8, 4, 0),
    (66, 16, 8, 4, 0),
    (100, 8, 8, 4, 1),
    (64, 8, 16, 4, 0),
    (256, 16, 8, 4, 1),
    (512, 8, 8, 4, 0),
    (2048, 8, 8, 4, 0),
)
QUICK = CASES[:6]


def batch(groups: int, n: int, cells: int, extra: int, seed: int = 0):
    """Sequences, each one's prompt group (-1: padding) and the padding tags."""
    rng = np.random.default_rng(seed)
    seqs: list[list[int]] = []
    group: list[int] = []
    for g in range(groups):
        prompt = [1000 + g, *rng.integers(3, 9000, int(rng.integers(5, 2000))).tolist()]
        size = n if rng.random() < 0.7 else int(rng.integers(1, n + 1))
        for _ in range(size):
            seqs.append(prompt + rng.integers(3, 9000, int(rng.integers(50, 1500))).tolist())
            group.append(g)
    npad = (-len(seqs)) % cells + extra * cells
    seqs += [PAD] * npad
    group += [-1] * npad
    return seqs, np.array(group), np.array(group) < 0


def measure(groups: int, n: int, dp: int, nm: int, extra: int, repeats: int) -> dict:
    cells = dp * nm
    seqs, group, padding = batch(groups, n, cells, extra)
    forest = RolloutForest.from_sequences(seqs)
    tree_balanced_cells(forest, dp, nm, padding)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        parts, grid = tree_balanced_cells(forest, dp, nm, padding)
        times.append(time.perf_counter() - t0)
    share = len(seqs) // cells
    cell_of = np.empty(len(seqs), np.int64)
    for r, part in enumerate(parts):
        for k in range(nm):
            cell_of[part[k * share : (k + 1) * share]] = r * nm + k
    real = ~padding
    pairs = np.unique(group[real] * cells + cell_of[real]) // cells
    real_n = int(real.sum())
    return {
        "groups": groups,
        "n": n,
        "dp": dp,
        "mini_batches": nm,
        "trajectories": len(seqs),
        "padding": int(padding.sum()),
        "seconds_best": round(min(times), 4),
        "seconds_median": round(statistics.median(times), 4),
        "groups_cut": int(np.count_nonzero(np.bincount(pairs) > 1)),
        "padding_only_cells": padding_only_cells(parts, nm, padding),
        "fewest_padding_only_cells": max(cells - real_n, 0),
        "max_cell_work": int(grid.max()),
        "mean_cell_work": round(float(grid.mean()), 1),
        "compression": round(sum(map(len, seqs)) / float(grid.sum()), 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int_arg(1), default=3, help="timed calls per case")
    ap.add_argument("--quick", action="store_true", help=f"the first {len(QUICK)} cases only")
    args = ap.parse_args(argv)
    cases = [measure(*c, args.repeats) for c in (QUICK if args.quick else CASES)]
    out = {
        "cases": cases,
        "total_seconds_best": round(sum(c["seconds_best"] for c in cases), 3),
        "padding_only_cells_avoidable": sum(
            c["padding_only_cells"] - c["fewest_padding_only_cells"] for c in cases
        ),
    }
    print(json.dumps(out, indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
