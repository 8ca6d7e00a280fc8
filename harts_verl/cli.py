"""Command line: ``harts-verl demo | bench | inspect | check``."""

from __future__ import annotations

import argparse
import json
import sys

# `harts-verl demo`: the bench on a smaller SWE-like step (≈10K semantic tokens, ≈5.6×) that
# finishes in about a minute on a 2-core CPU.
DEMO_DEFAULTS = {"scale": 0.002, "workload_overrides": {"max_forks": 64}}


def _add_bench_args(
    p: argparse.ArgumentParser, *, repeats: int, warmup: int, **defaults: object
) -> None:
    from harts_verl.benchmark import BenchConfig

    d = BenchConfig(**defaults)  # type: ignore[arg-type]
    p.set_defaults(_overrides_default=dict(d.workload_overrides))
    p.add_argument("--workload", default=d.workload, help="swe_like | tau_like | grpo_flat")
    p.add_argument(
        "--scale", type=float, default=d.scale, help="workload scale (≈ scale × 1M tokens)"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--workload-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="generator option (repeatable, value as JSON); any given replace all the "
        "defaults: " + ",".join(f"{k}={v}" for k, v in d.workload_overrides.items()),
    )
    p.add_argument(
        "--max-semantic-tokens",
        type=int,
        default=d.max_semantic_tokens,
        help="use the first trajectories up to this many semantic tokens (0 = all)",
    )
    p.add_argument("--preset", default=d.preset, help="model preset: tiny | bench | kimi_tiny")
    p.add_argument(
        "--model",
        default=None,
        help="HF model dir or config.json (random init) of a model with a tree mode; "
        "replaces --preset",
    )
    p.add_argument("--dtype", default=d.dtype, help="float32 | bfloat16 | float64")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--chunk-size", type=int, default=d.chunk_size)
    p.add_argument(
        "--capacity",
        type=int,
        default=d.capacity_tokens,
        help="tokens per microbatch (both runners; 0 = one microbatch)",
    )
    p.add_argument(
        "--recompute",
        action=argparse.BooleanOptionalAction,
        default=d.recompute,
        help="per-layer activation recomputation (both runners)",
    )
    p.add_argument("--device", default=d.device)
    p.add_argument(
        "--threads", type=_positive_int, default=None, help="torch intra-op threads (>= 1)"
    )
    p.add_argument("--plot", default=None, help="write a PNG summary here")
    p.add_argument("--no-progress", action="store_true")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {v}")
    return v


def _parse_overrides(items: list[str] | None, default: dict) -> dict:
    if items is None:
        return dict(default)
    out: dict = {}
    for it in items:
        key, sep, val = it.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SystemExit(f"--workload-option: expected KEY=VALUE, got {it!r}")
        if key in out:
            raise SystemExit(f"--workload-option: {key!r} given twice")
        try:
            out[key] = json.loads(val)
        except json.JSONDecodeError:
            out[key] = val
    return out


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from harts_verl.benchmark import BenchConfig, main_json

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = BenchConfig(
        workload=args.workload,
        scale=args.scale,
        seed=args.seed,
        workload_overrides=_parse_overrides(args.workload_option, args._overrides_default),
        max_semantic_tokens=args.max_semantic_tokens or None,
        preset=args.preset,
        model=args.model,
        dtype=args.dtype,
        repeats=args.repeats,
        warmup=args.warmup,
        chunk_size=args.chunk_size,
        capacity_tokens=args.capacity or None,
        recompute=args.recompute,
        device=args.device,
        plot=args.plot,
        progress=not args.no_progress,
    )
    return main_json(cfg)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from harts_verl.tree import RolloutForest
    from harts_verl.tree.inspect import forest_statistics, plot_statistics

    if args.dp != 1 and not args.capacity:
        raise SystemExit("inspect: --dp needs --capacity (the planned microbatches it places)")
    forest = RolloutForest.load(args.forest)
    stats = forest_statistics(
        forest,
        chunk_size=args.chunk_size,
        capacity_tokens=args.capacity or None,
        dp_size=args.dp,
        seed=args.seed,
        work_slack=args.work_slack,
    )
    if args.plot:
        plot_statistics(stats, args.plot, title=str(args.forest))
        stats["plot"] = str(args.plot)
    print(json.dumps(stats, indent=2))
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="forest statistics and planned microbatches (JSON), optional PNG",
        description="Compression, depth and branching histograms, forks inside chunks, "
        "planned microbatches and within-slot imbalance of a saved forest (.npz).",
    )
    p.add_argument("forest", help="a forest written by RolloutForest.save (.npz)")
    p.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="compact tokens per microbatch (omitted or 0: no microbatch plan)",
    )
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (with --capacity)")
    p.add_argument("--chunk-size", type=int, default=64, help="linear-attention chunk size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--work-slack",
        type=float,
        default=0.0,
        help="planner work_slack: extra compact tokens allowed for slot balance",
    )
    p.add_argument("--plot", default=None, help="write a multi-panel PNG here")
    p.set_defaults(func=_cmd_inspect)


def _add_check(sub: argparse._SubParsersAction) -> None:
    from harts_verl.workers import check

    p = sub.add_parser(
        "check",
        help="fidelity audit: tree vs expanded on your model and batch (JSON)",
        description="Tree vs expanded execution of a model on a dumped batch: max |Δlogp|, "
        "mean logit cosine, per-layer max difference and the first divergent layer.",
    )
    check.add_arguments(p)
    p.set_defaults(func=check.run_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harts-verl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="the embedded default job: tree vs expanded training on a SWE-like step"
    )
    _add_bench_args(demo, repeats=1, warmup=1, **DEMO_DEFAULTS)
    demo.set_defaults(func=_cmd_bench)
    bench = sub.add_parser("bench", help="tree vs expanded speed and fidelity (JSON)")
    _add_bench_args(bench, repeats=3, warmup=1)
    bench.set_defaults(func=_cmd_bench)
    _add_inspect(sub)
    _add_check(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
