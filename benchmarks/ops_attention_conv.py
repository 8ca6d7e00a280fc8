"""Tree vs expanded (trajectory-wise) cost of tree attention and the short causal conv.

Prints one JSON object: forward+backward wall time of :func:`tree_attention` and
:func:`tree_short_conv` on a SWE-like microbatch in the tree layout and in the expanded layout
(``RolloutForest.expanded``: every trajectory its own chain; attention planned with
``max_pad_ratio=0`` so every trajectory is one unpadded ``is_causal`` call, like varlen), the
ideal work ratios (attention: Σ(depth + 1) expanded / tree; conv: S / C), plan statistics and
the max |Δ| between the two layouts' per-trajectory outputs.

The microbatch: one 4K-token prompt, a group of 8 samples, each a multi-turn episode
(assistant turns and heavy-tailed tool observations); some samples fork at a turn boundary
into two continuations. Random token ids (vocab 32K) so siblings diverge at their first token.
(``harts_verl.tree.workloads.swe_like`` trees are full-size batches of 10⁵–10⁶ compact tokens,
far above one CPU microbatch, hence this self-contained generator.)

Usage: ``python benchmarks/ops_attention_conv.py [--own-tokens 1000] [--repeats 1] [--threads N]``
(defaults keep the run under ~2 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from harts_verl.benchmark import alternating_runs
from harts_verl.ops.short_conv import conv_window_index, tree_short_conv
from harts_verl.ops.tree_attention import build_attention_plan, tree_attention
from harts_verl.tree._checks import int_arg
from harts_verl.tree.forest import RolloutForest


def swe_microbatch(
    seed: int = 0,
    prompt: int = 4096,
    samples: int = 8,
    own_tokens: int = 1000,
    fork_prob: float = 0.5,
    branch_tokens: int = 500,
) -> list[np.ndarray]:
    """Token sequences of one SWE-like group (see module doc)."""
    rng = np.random.default_rng(seed)
    vocab = 32000

    def turns(budget: int) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        total = 0
        while total < budget:  # stops at the first turn pair reaching the budget
            a = int(rng.integers(80, 400))  # assistant turn
            obs = int(np.clip(rng.lognormal(np.log(250), 0.9), 16, 1500))  # tool observation
            out += [rng.integers(0, vocab, a), rng.integers(0, vocab, obs)]
            total += a + obs
        return out

    root = rng.integers(0, vocab, prompt)
    seqs: list[np.ndarray] = []
    for _ in range(samples):
        trunk = turns(int(own_tokens * rng.uniform(0.6, 1.4)))
        if rng.random() < fork_prob and len(trunk) >= 4:
            cut = 2 * int(rng.integers(1, len(trunk) // 2))  # a turn boundary
            for _ in range(2):
                branch = turns(int(branch_tokens * rng.uniform(0.6, 1.4)))
                seqs.append(np.concatenate([root, *trunk[:cut], *branch]))
        else:
            seqs.append(np.concatenate([root, *trunk]))
    return seqs


def _fb_once(fn, inputs: list[torch.Tensor]) -> tuple[tuple[float, float], torch.Tensor]:
    """Wall seconds of one forward and one backward (loss = Σ out · R, R fixed), and the
    (detached) output: an :func:`alternating_runs` side."""
    for t in inputs:
        t.grad = None
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    # R drawn outside the timer (its cost grows with the side's rows: no op's backward)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
    t2 = time.perf_counter()
    (out * r).sum().backward()
    t3 = time.perf_counter()
    return (t1 - t0, t3 - t2), out.detach()


def _time_pair(
    tree_fn, tree_in, exp_fn, exp_in, repeats: int
) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """Tree and expanded timings of :func:`alternating_runs` (minimum of each phase, ``fb_s``
    unrounded beside the rounded figures as ``fb_raw``), and the last outputs of both."""
    runs, outs = alternating_runs(
        {
            "tree": lambda: _fb_once(tree_fn, tree_in),
            "expanded": lambda: _fb_once(exp_fn, exp_in),
        },
        repeats,
    )
    out = []
    for key in ("tree", "expanded"):
        f = min(r[0] for r in runs[key])
        b = min(r[1] for r in runs[key])
        fb = min(r[0] + r[1] for r in runs[key])
        out.append({"fwd_s": round(f, 4), "bwd_s": round(b, 4), "fb_s": round(fb, 4), "fb_raw": fb})
    return out[0], out[1], outs["tree"], outs["expanded"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    seqs = swe_microbatch(args.seed, own_tokens=args.own_tokens)
    t0 = time.perf_counter()
    tree = RolloutForest.from_sequences(seqs)
    exp = RolloutForest.expanded(seqs)
    forest_s = time.perf_counter() - t0
    c, s = tree.num_compact_tokens, tree.num_semantic_tokens
    sem_np = tree.semantic_rows
    sem = torch.from_numpy(sem_np)
    h, d, dconv, w = args.heads, args.head_dim, args.conv_channels, args.conv_width
    g = torch.Generator().manual_seed(args.seed)
    result: dict[str, Any] = {
        "forest": tree.summary(),
        "torch_threads": torch.get_num_threads(),
        "repeats": {"attention": args.repeats, "conv": args.conv_repeats},
        "forest_build_s": round(forest_s, 4),
    }

    # ---------------------------------------------------------------- attention (fp32)
    t0 = time.perf_counter()
    plan_t = build_attention_plan(tree)
    t1 = time.perf_counter()
    plan_e = build_attention_plan(exp, max_pad_ratio=0.0)
    plan_s = (t1 - t0, time.perf_counter() - t1)
    q = torch.randn(c, h, d, generator=g).requires_grad_()
    k = torch.randn(c, h, d, generator=g).requires_grad_()
    v = torch.randn(c, h, d, generator=g).requires_grad_()
    # Expanded inputs are leaf copies (the expanded path would have computed them per position).
    qe, ke, ve = (t.detach()[sem].clone().requires_grad_() for t in (q, k, v))
    warm = RolloutForest.from_sequences([[1, 2, 3, 4], [1, 2, 5]])  # warm up kernels
    wq = torch.randn(warm.num_compact_tokens, h, d, requires_grad=True)
    tree_attention(wq, wq, wq, build_attention_plan(warm)).sum().backward()
    tt, te, o_t, o_e = _time_pair(
        lambda: tree_attention(q, k, v, plan_t),
        [q, k, v],
        lambda: tree_attention(qe, ke, ve, plan_e),
        [qe, ke, ve],
        args.repeats,
    )
    att_ratio = te.pop("fb_raw") / max(tt.pop("fb_raw"), 1e-12)  # of unrounded times
    diff = (o_t[sem] - o_e).abs()
    result["attention"] = {
        "shape": {"H": h, "D": d, "dtype": "float32"},
        "tree": {**tt, "plan_build_s": round(plan_s[0], 4), **plan_t.summary()},
        "expanded": {**te, "plan_build_s": round(plan_s[1], 4), **plan_e.summary()},
        "work_ratio": round(plan_e.work / plan_t.work, 4),
        "time_ratio_fb": round(att_ratio, 4),
        "max_abs_diff": float(diff.max()),
    }

    # ---------------------------------------------------------------- short conv (fp32)
    x = torch.randn(c, dconv, generator=g).requires_grad_()
    wt = torch.randn(dconv, w, generator=g).requires_grad_()
    b = torch.randn(dconv, generator=g).requires_grad_()
    xe = x.detach()[sem].clone().requires_grad_()
    t0 = time.perf_counter()
    win_t = conv_window_index(tree, w)
    t1 = time.perf_counter()
    win_e = conv_window_index(exp, w)
    idx_s = (t1 - t0, time.perf_counter() - t1)
    ct, ce, y_t, y_e = _time_pair(
        lambda: tree_short_conv(x, wt, b, win_t),
        [x, wt, b],
        lambda: tree_short_conv(xe, wt, b, win_e),
        [xe, wt, b],
        args.conv_repeats,
    )
    conv_ratio = ce.pop("fb_raw") / max(ct.pop("fb_raw"), 1e-12)
    cdiff = (y_t[sem] - y_e).abs()
    result["short_conv"] = {
        "shape": {"D": dconv, "W": w, "dtype": "float32"},
        "tree": {**ct, "window_index_s": round(idx_s[0], 4), "rows": c},
        "expanded": {**ce, "window_index_s": round(idx_s[1], 4), "rows": s},
        "work_ratio": round(s / c, 4),
        "time_ratio_fb": round(conv_ratio, 4),
        "max_abs_diff": float(cdiff.max()),
    }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int_arg(0), default=0)
    p.add_argument(
        "--own-tokens", type=int_arg(1), default=1000, help="mean tokens per sample trunk"
    )
    p.add_argument("--repeats", type=int_arg(1), default=1, help="attention timing repeats (min)")
    p.add_argument("--conv-repeats", type=int_arg(1), default=2, help="conv timing repeats (min)")
    p.add_argument("--heads", type=int_arg(1), default=8)
    p.add_argument("--head-dim", type=int_arg(1), default=64)
    p.add_argument("--conv-channels", type=int_arg(1), default=1024)
    p.add_argument("--conv-width", type=int_arg(1), default=4)
    p.add_argument("--threads", type=int_arg(0), default=0, help="torch threads (0: default)")
    print(json.dumps(run(p.parse_args()), indent=2, allow_nan=False))


if __name__ == "__main__":
    main()
