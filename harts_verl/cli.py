"""Command line: ``harts-verl demo | bench | inspect | check | convert | precompile``.

Exit status: 0 on success; 2 for a user error — a bad option value or input file, reported as
one line ``harts-verl <command>: <message>`` on stderr that names the option (``--capacity``,
``--model``, ...) or the file; 1 with a traceback for anything else (an internal error is never
turned into a one-line message). Only the steps that read and check inputs (options, model
configs and weights, forest and batch files, plot destinations) are treated as user errors:
their ValueError (``json.JSONDecodeError`` included), TypeError, OSError (FileNotFoundError,
...), ``pickle.UnpicklingError`` and EOFError. Set ``HARTS_VERL_DEBUG=1`` to get the full
traceback of a user error instead. Results are printed as strict JSON (never NaN or Infinity: a
non-finite figure is an error with a traceback, not output; ``check`` prints a non-finite
difference as null, names it and exits 3, as it does when ``--fail-above`` finds a disagreement;
``precompile`` stopped by SIGINT prints what it compiled, ``"interrupted": true``, and exits 130).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from harts_verl.tree._checks import check_int, finite_float_arg, int_arg

# `harts-verl demo`: the bench on a smaller SWE-like step (≈10K semantic tokens, ≈5.6×, one
# timed repeat after one warm-up; about a minute with one thread on a 2-core CPU: see
# docs/runtime.md for the measured figures).
DEMO_DEFAULTS = {"scale": 0.002, "workload_overrides": {"max_forks": 64}}

# Errors of the input-reading steps that are the user's (see the module doc).
_USER_ERRORS = (
    ValueError,  # json.JSONDecodeError included
    TypeError,
    OSError,  # FileNotFoundError, PermissionError, IsADirectoryError, ...
    pickle.UnpicklingError,
    EOFError,  # a truncated pickle
)

# Config / planner field names in messages -> the flags that set them.
_BENCH_FLAGS = {
    "capacity_tokens": "--capacity",
    "max_semantic_tokens": "--max-semantic-tokens",
    "workload_overrides": "--workload-option",
    "chunk_size": "--chunk-size",
    "workload": "--workload",
    "scale": "--scale",
    "seed": "--seed",
    "preset": "--preset",
    "model": "--model",
    "dtype": "--dtype",
    "repeats": "--repeats",
    "warmup": "--warmup",
    "device": "--device",
    "plot": "--plot",
    "trajectories": "--trajectories",
}
# `inspect` reports its planning on stderr from this many trajectories on (seconds to a minute),
# and for fewer once it has planned this many seconds (many replicas, restarts, work slack)
_PROGRESS_TRAJECTORIES = 1000
_PROGRESS_AFTER_S = 2.0

_INSPECT_FLAGS = {
    "capacity_tokens": "--capacity",
    "dp_size": "--dp",
    "chunk_size": "--chunk-size",
    "work_slack": "--work-slack",
    "seed": "--seed",
    "restarts": "--restarts",
    "plot": "--plot",
}


class _UserError(Exception):
    """A user error of a subcommand, its message phrased for the command line."""


def _debug() -> bool:
    return os.environ.get("HARTS_VERL_DEBUG", "") not in ("", "0")


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line ``harts-verl <command>: <message>`` (exit status
    2), as the module doc promises for every bad option value (argparse printed its usage
    text first: several lines)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def _phrase(exc: BaseException, flags: dict[str, str]) -> str:
    """The message of ``exc`` with a leading config field name (``capacity_tokens: ...``)
    replaced by its flag, and the flag in place of multi-word field names elsewhere where they
    stand as words (``capacity_tokens=64``), never inside a path or a name
    (``runs/chunk_size_64/x.npz`` stays as written)."""
    msg = str(exc) or type(exc).__name__
    for field, flag in flags.items():
        if msg.startswith(field + ":") or msg.startswith(field + "["):
            msg = flag + msg[len(field) :]
            break
    for field, flag in flags.items():
        if "_" in field:
            msg = re.sub(rf"(?<![\w./\\'\"-]){re.escape(field)}(?![\w/\\-]|\.\w)", flag, msg)
    return msg


@contextlib.contextmanager
def _inputs(flags: dict[str, str] | None = None) -> Iterator[None]:
    """Treat the user-error exceptions raised inside as user errors (:class:`_UserError`, or
    re-raised as they are with ``HARTS_VERL_DEBUG=1``)."""
    try:
        yield
    except _USER_ERRORS as exc:
        if _debug():
            raise
        raise _UserError(_phrase(exc, flags or {})) from exc
    except ModuleNotFoundError as exc:  # an optional dependency the input needs (transformers
        # for --model / check / convert); a missing module of this package stays a bug
        top = (exc.name or "").partition(".")[0]
        if _debug() or not top or top == "harts_verl":
            raise
        extra = {"transformers": "verl", "safetensors": "verl"}.get(top, "bench")
        raise _UserError(
            f"this input needs the Python package {top!r}, which is not installed "
            f"(pip install 'harts-verl[{extra}]')"
        ) from exc


def _add_bench_args(
    p: argparse.ArgumentParser, *, repeats: int, warmup: int, **defaults: object
) -> None:
    from harts_verl.benchmark import BENCH_WORKLOAD_OPTIONS, DTYPES, BenchConfig
    from harts_verl.models import PRESETS
    from harts_verl.tree.workloads import MAX_SCALE, WORKLOADS

    d = BenchConfig(**defaults)  # type: ignore[arg-type]
    p.set_defaults(_overrides_default=d.workload_overrides)
    p.set_defaults(_workload_default=d.workload, _scale_default=d.scale)
    p.add_argument(
        "--workload",
        default=None,
        choices=sorted(WORKLOADS),
        help=f"synthetic workload (default {d.workload})",
    )
    p.add_argument(
        "--scale",
        type=finite_float_arg(0, inclusive=False, hi=MAX_SCALE),
        default=None,
        help="workload scale: at least scale × 1M semantic tokens in whole groups (one group, "
        "a few M tokens, below that size; tiny shrunken groups below 0.05); in (0, 256] "
        f"(default {d.scale})",
    )
    p.add_argument(
        "--trajectories",
        default=None,
        metavar="FILE",
        help="your own step instead of a synthetic workload: a token file (.jsonl / .ndjson: "
        "one trajectory per line, a list of token ids or an object with input_ids; .json: a "
        "list of those), a forest .npz or a torch .pt dump (as check --batch reads it); ids "
        "past the model's vocabulary are renumbered densely in their order (same forest)",
    )
    p.add_argument("--seed", type=int_arg(0), default=d.seed)
    p.add_argument(
        "--workload-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="generator option (repeatable, value as JSON); any given replace all the "
        "defaults: " + _options_text(d.workload_overrides, BENCH_WORKLOAD_OPTIONS),
    )
    p.add_argument(
        "--generator-defaults",
        action="store_true",
        help="none of those defaults: the workload generator's own (no CPU path caps; "
        "--workload-option still applies)",
    )
    p.add_argument(
        "--max-semantic-tokens",
        type=int_arg(0),
        default=d.max_semantic_tokens or 0,
        help="use the first trajectories up to this many semantic tokens (0 = all)",
    )
    p.add_argument("--preset", default=d.preset, choices=sorted(PRESETS), help="model preset")
    p.add_argument(
        "--model",
        default=None,
        help="HF model dir or config.json (random init) of a model with a tree mode; "
        "replaces --preset",
    )
    p.add_argument("--dtype", default=d.dtype, choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int_arg(1), default=repeats, help="timed iterations")
    p.add_argument(
        "--warmup",
        type=int_arg(1),
        default=warmup,
        help="untimed iterations first (>= 1: a process's first step is never timed)",
    )
    p.add_argument("--chunk-size", type=int_arg(1), default=d.chunk_size)
    p.add_argument(
        "--capacity",
        type=int_arg(0),
        default=d.capacity_tokens or 0,
        help="tokens per microbatch (both runners; 0 = one microbatch)",
    )
    p.add_argument(
        "--recompute",
        action=argparse.BooleanOptionalAction,
        default=d.recompute,
        help="per-layer activation recomputation (both runners)",
    )
    p.add_argument(
        "--attention-key-rows",
        type=int_arg(0),
        default=d.attention_key_rows or 0,
        help="bound on the key rows an attention layer keeps for backward (both runners; "
        "above it keys are gathered again in backward, one more attention forward; 0 = none)",
    )
    p.add_argument("--device", default=d.device, help="torch device (cpu, cuda, cuda:1, ...)")
    p.add_argument(
        "--threads", type=int_arg(1, 4096), default=None, help="torch intra-op threads (1..4096)"
    )
    p.add_argument(
        "--plot",
        default=None,
        help="write a summary figure here (format from the suffix, png without one; the path "
        "written is reported as 'plot')",
    )
    p.add_argument("--no-progress", action="store_true")


def _options_text(given: dict | None, per_workload: dict[str, dict]) -> str:
    """The default generator options, for ``--help``."""

    def one(d: dict) -> str:
        return ",".join(f"{k}={v}" for k, v in d.items()) or "none"

    if given is not None:
        return one(given)
    return "; ".join(f"{w}: {one(d)}" for w, d in sorted(per_workload.items()))


def _parse_overrides(items: list[str] | None, default: dict | None) -> dict | None:
    """The ``--workload-option`` items as a dict; ``default`` (copied; None: the workload's own
    bench defaults) when none is given."""
    if items is None:
        return None if default is None else dict(default)
    out: dict = {}
    for it in items:
        key, sep, val = it.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--workload-option: expected KEY=VALUE, got {it!r}")
        if key in out:
            raise ValueError(f"--workload-option: {key!r} given twice")
        try:
            out[key] = json.loads(val)
        except json.JSONDecodeError:
            out[key] = val
    return out


def _print_json(obj: dict) -> None:
    from harts_verl.tree.inspect import json_text

    try:
        print(json_text(obj), flush=True)
    except BrokenPipeError:  # the reader went away (`| head`): no traceback, nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush is quiet


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from harts_verl.benchmark import BenchConfig, load_bench_inputs, measure_bench, prepare_bench

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with _inputs(_BENCH_FLAGS):
        if args.trajectories is not None:
            given = [
                flag
                for flag, value in (
                    ("--workload", args.workload),
                    ("--scale", args.scale),
                    ("--workload-option", args.workload_option),
                    ("--generator-defaults", args.generator_defaults or None),
                )
                if value is not None
            ]
            if given:
                raise ValueError(
                    f"{given[0]}: a synthetic workload's option, but --trajectories gives the step"
                )
        cfg = BenchConfig(
            workload=args.workload or args._workload_default,
            scale=args._scale_default if args.scale is None else args.scale,
            trajectories=args.trajectories,
            seed=args.seed,
            workload_overrides=None
            if args.trajectories is not None
            else _parse_overrides(
                args.workload_option, {} if args.generator_defaults else args._overrides_default
            ),
            max_semantic_tokens=args.max_semantic_tokens or None,
            preset=args.preset,
            model=args.model,
            dtype=args.dtype,
            repeats=args.repeats,
            warmup=args.warmup,
            chunk_size=args.chunk_size,
            capacity_tokens=args.capacity or None,
            recompute=args.recompute,
            attention_key_rows=args.attention_key_rows or None,
            device=args.device,
            plot=args.plot,
            progress=not args.no_progress,
        )
        inputs = load_bench_inputs(cfg)
    result = measure_bench(prepare_bench(cfg, inputs))
    if "plot_error" in result:
        print(f"harts-verl {args.command}: plot failed: {result['plot_error']}", file=sys.stderr)
    _print_json(result)
    return 0


def _inspected_forest(path: str, load_forest: Callable[[str], Any]) -> Any:
    """The forest of ``inspect``'s input: a token file (``.json`` / ``.jsonl`` / ``.ndjson``),
    a torch batch dump (``.pt`` / ``.pth``, read as ``check --batch`` reads it), else a saved
    forest (``load_forest``). Errors are ValueErrors naming the file."""
    from harts_verl.tree import RolloutForest
    from harts_verl.tree.token_files import is_token_file, read_token_lists

    if is_token_file(path):
        return RolloutForest.from_sequences(read_token_lists(path))
    if path.lower().endswith((".pt", ".pth")):
        from harts_verl.workers.check import load_trajectory_arrays

        # an empty or negative trajectory named with the file, not as `sequences[i]`
        return RolloutForest.from_sequences(load_trajectory_arrays(path))
    return load_forest(path)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from harts_verl.tree import check_plan_arguments
    from harts_verl.tree.inspect import forest_statistics, load_forest, plot_path, plot_statistics

    with _inputs(_INSPECT_FLAGS):
        if args.dp != 1 and not args.capacity:
            raise ValueError("--dp needs --capacity (the planned microbatches it places)")
        if args.work_slack and not args.capacity:
            raise ValueError("--work-slack needs --capacity (it balances the planned slots)")
        if args.restarts and not args.capacity:
            raise ValueError("--restarts needs --capacity (the planner's seeded restarts)")
        if args.seed and not args.restarts:
            raise ValueError("--seed needs --restarts (only the planner's restarts draw from it)")
        check_int("chunk_size", args.chunk_size, 1)  # argparse has no upper bound
        plan_args = {
            "dp_size": args.dp,
            "seed": args.seed,
            "work_slack": args.work_slack,
            "restarts": args.restarts,
        }
        if args.capacity:
            check_plan_arguments(capacity_tokens=args.capacity, **plan_args)
        plot = plot_path(args.plot) if args.plot is not None else None
    with _inputs():  # the file's own errors name it as given (a path is no flag)
        forest = _inspected_forest(args.forest, load_forest)
    # A plan of many trajectories can take a minute (3,600 GRPO responses at --work-slack 0.02
    # and --dp 64: ≈ 10 s), and fewer with many replicas or restarts: say so on stderr (at once
    # for many trajectories, else once it has taken _PROGRESS_AFTER_S), and how long it took.
    announced = threading.Event()

    def announce() -> None:
        print(
            f"harts-verl inspect: planning {forest.num_trajectories:,} trajectories "
            f"({forest.num_compact_tokens:,} compact tokens) at --capacity {args.capacity}, "
            f"--dp {args.dp} ...",
            file=sys.stderr,
            flush=True,
        )
        announced.set()

    timer = None
    if args.capacity and not args.no_progress:
        if forest.num_trajectories >= _PROGRESS_TRAJECTORIES:
            announce()
        else:
            timer = threading.Timer(_PROGRESS_AFTER_S, announce)
            timer.daemon = True
            timer.start()
    t0 = time.perf_counter()
    try:
        stats = forest_statistics(  # past the inputs: an error here is a bug, with its traceback
            forest, chunk_size=args.chunk_size, capacity_tokens=args.capacity or None, **plan_args
        )
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
    plan = stats.get("plan")
    if announced.is_set():
        print(
            f"harts-verl inspect: planned {plan['microbatches']:,} microbatches in "
            f"{plan['planning_seconds']:.1f} s (with the statistics: "
            f"{time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    if plan and plan["oversize_trajectories"]:  # no error: said, as bench says it
        print(
            f"harts-verl inspect: note: {plan['oversize_trajectories']} "
            f"{'trajectory is' if plan['oversize_trajectories'] == 1 else 'trajectories are'} "
            f"longer than --capacity {args.capacity}: each runs whole in a microbatch of its own, "
            f"above the capacity (plan.oversize_microbatches: {plan['oversize_microbatches']})",
            file=sys.stderr,
        )
    if plot:
        try:
            stats["plot"] = plot_statistics(stats, plot, title=str(args.forest))
        except Exception as exc:  # the statistics are printed either way
            if _debug():
                raise
            stats["plot_error"] = f"{type(exc).__name__}: {exc}"
            print(f"harts-verl inspect: plot failed: {stats['plot_error']}", file=sys.stderr)
    _print_json(stats)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from harts_verl.workers import check

    with _inputs():  # load_inputs names the flag at fault itself
        model, seqs = check.load_inputs(args)
    res = check.audit(model, seqs, args)
    _print_json(res)
    return check.audit_status(res)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help=_HELP["inspect"],
        description="Compression, depth and branching histograms, forks inside chunks, "
        "attention key rows, planned microbatches and within-slot imbalance of a step's "
        "trajectories: a saved "
        "forest (.npz), a token file (.json / .jsonl) or a torch batch dump (.pt / .pth).",
    )
    p.add_argument(
        "forest",
        metavar="FILE",
        help="a forest written by RolloutForest.save (.npz); a token file: JSON Lines "
        "(.jsonl / .ndjson, one trajectory per line: a list of token ids or an object with "
        "input_ids) or JSON (.json, a list of those, or an object whose input_ids is a list of "
        "token-id lists); or a torch.save batch dump (.pt / .pth, as check --batch reads it)",
    )
    p.add_argument(
        "--capacity",
        type=int_arg(0),
        default=0,
        help="compact tokens per microbatch (omitted or 0: no microbatch plan)",
    )
    p.add_argument(
        "--dp", type=int_arg(1), default=1, help="data-parallel replicas (with --capacity)"
    )
    p.add_argument("--chunk-size", type=int_arg(1), default=64, help="linear-attention chunk size")
    p.add_argument(
        "--restarts",
        type=int_arg(0),
        default=0,
        help="the planner's seeded perturb-and-improve rounds (with --capacity)",
    )
    p.add_argument(
        "--seed", type=int_arg(0), default=0, help="seed of the planner's restarts (--restarts)"
    )
    p.add_argument(
        "--work-slack",
        type=finite_float_arg(0, inclusive=True, hi=1, hi_inclusive=False),
        default=0.0,
        help="planner work_slack in [0, 1): extra compact tokens allowed for slot balance",
    )
    p.add_argument(
        "--plot",
        default=None,
        help="write a multi-panel figure here (format from the suffix, png without one; "
        "checked before the forest is read; a failed plot is reported as 'plot_error' and the "
        "statistics are printed anyway)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help=f"no planning progress on stderr (given for --capacity with >= "
        f"{_PROGRESS_TRAJECTORIES:,} trajectories, or once planning takes "
        f"{_PROGRESS_AFTER_S:g} s)",
    )
    p.set_defaults(func=_cmd_inspect)


def _add_check(sub: argparse._SubParsersAction) -> None:
    from harts_verl.workers import check

    p = sub.add_parser(
        "check",
        help=_HELP["check"],
        description="Tree vs expanded execution of a model on a dumped batch: max |Δlogp|, "
        "mean logit cosine, per-layer max difference and the first divergent layer.",
    )
    check.add_arguments(p)
    p.set_defaults(func=_cmd_check)


def _cmd_convert(args: argparse.Namespace) -> int:
    from harts_verl.models import checkpoints

    def progress(msg: str) -> None:
        print(f"harts-verl convert: {msg}", file=sys.stderr, flush=True)

    with _inputs():  # the checkpoint and config are the user's input
        summary = checkpoints.convert_checkpoint(
            args.src,
            args.dst,
            to=args.to,
            # finite and > 0 (argparse); past 2**33 GiB (int64 bytes) every model is one shard
            max_shard_bytes=max(int(min(args.max_shard_gib, 2.0**33) * 2**30), 1),
            config_only=args.config_only,
            progress=progress,
        )
    _print_json(summary)
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help=_HELP["convert"],
        description="Convert a Kimi-Linear (kimi_linear) or Ling 3 (bailing_hybrid) model "
        "directory (its own format, or what transformers >= 5.23 saves) into the native "
        "harts_hybrid model that veRL 0.9.1 loads, or a harts_hybrid back into one of them "
        "(vLLM / SGLang). Streams layer by layer; copies tokenizer files; prints a JSON summary.",
    )
    p.add_argument("src", help="source model directory (config.json + safetensors)")
    p.add_argument("dst", help="destination directory (created; must not hold a model)")
    p.add_argument(
        "--to",
        choices=("harts_hybrid", "kimi_linear", "bailing_hybrid"),
        default="harts_hybrid",
        help="target format (default harts_hybrid)",
    )
    p.add_argument(
        "--max-shard-gib",
        type=finite_float_arg(0, inclusive=False),
        default=5.0,
        help="largest safetensors shard written, in GiB (default 5)",
    )
    p.add_argument(
        "--config-only",
        action="store_true",
        help="write the harts_hybrid config.json alone: veRL's model.hf_config_path beside a "
        "Kimi-Linear / Ling 3 model.path (weights converted while loading, rollout serves it)",
    )
    p.set_defaults(func=_cmd_convert)


_PRECOMPILE_FLAGS = {
    "chunk_size": "--chunk-size",
    "preset": "--preset",
    "model": "--model",
    "dtype": "--dtype",
    "seed": "--seed",
    "target": "--target",
    "autotune": "--autotune",
}


def _cmd_precompile(args: argparse.Namespace) -> int:
    from harts_verl.benchmark import BenchConfig
    from harts_verl.precompile import check_precompile_config, precompile_model, target_device

    def progress(msg: str) -> None:
        if not args.no_progress:
            print(f"harts-verl precompile: {msg}", file=sys.stderr, flush=True)

    with _inputs(_PRECOMPILE_FLAGS):
        cfg = BenchConfig(
            preset=args.preset,
            model=args.model,
            dtype=args.dtype,
            chunk_size=args.chunk_size,
            recompute=args.recompute,
            seed=args.seed,
        )
        check_precompile_config(cfg)  # before the target is read or anything compiled
        device = target_device(args.target)
    try:
        out = precompile_model(
            cfg, device=device, autotune=args.autotune, jobs=args.jobs, progress=progress
        )
    except ValueError as exc:
        # the model's weights are read inside the compile (a directory without weights, ...):
        # load_tree_model's errors start with "model:"; any other keeps its traceback
        if not str(exc).startswith("model:") or _debug():
            raise
        raise _UserError(_phrase(exc, _PRECOMPILE_FLAGS)) from exc
    _print_json(out)
    return 130 if out.get("interrupted") else 0  # a SIGINT's status, after its summary


def _add_precompile(sub: argparse._SubParsersAction) -> None:
    from harts_verl.benchmark import DTYPES, BenchConfig
    from harts_verl.models import PRESETS
    from harts_verl.ops.backends.triton_cache import AUTOTUNE_MODES
    from harts_verl.precompile import TARGETS

    d = BenchConfig()
    p = sub.add_parser(
        "precompile",
        help=_HELP["precompile"],
        description="Run the model's tree and trajectory-wise forward + backward once on a "
        "small forest, on the CPU, with fla's kernels behind a stand-in CUDA driver, and "
        "compile every kernel specialization they reach for the target GPU, in parallel, into "
        "Triton's cache (TRITON_CACHE_DIR): the first GPU step then loads them instead of "
        "compiling each autotune config in turn. Needs fla and triton; run it before the job, "
        "with the same Triton and cache directory.",
    )
    p.add_argument("--preset", default=d.preset, choices=sorted(PRESETS), help="model preset")
    p.add_argument(
        "--model",
        default=None,
        help="HF model dir or config.json of a model with a tree mode; replaces --preset",
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(set(DTYPES) - {"float64"}))
    p.add_argument("--chunk-size", type=int_arg(1), default=d.chunk_size)
    p.add_argument(
        "--recompute",
        action=argparse.BooleanOptionalAction,
        default=d.recompute,
        help="per-layer activation recomputation (as the job runs it)",
    )
    p.add_argument("--seed", type=int_arg(0), default=d.seed)
    p.add_argument(
        "--target",
        default="current",
        choices=TARGETS,
        help="the GPU to compile for: the visible CUDA device, or an H100 (sm_90) stand-in",
    )
    p.add_argument(
        "--autotune",
        default="all",
        choices=AUTOTUNE_MODES,
        help="every autotune config (the job autotunes) or only the first (a job run with "
        "HARTS_TRITON_AUTOTUNE=first)",
    )
    p.add_argument(
        "--jobs", type=int_arg(1, 4096), default=None, help="compile threads (default: all cores)"
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_precompile)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help=_HELP["demo"],
        description="Tree vs expanded training (forward + backward) of the native bench model "
        "on a small SWE-like step (tiny-mode swe_like, ≈10K semantic tokens, ≈5.6×): one "
        "warm-up and one timed iteration; prints the bench JSON.",
    )
    _add_bench_args(p, repeats=1, warmup=1, **DEMO_DEFAULTS)
    p.set_defaults(func=_cmd_bench)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help=_HELP["bench"],
        description="Times forward + backward of one workload step in tree mode and "
        "trajectory-wise (expanded) with the same model, ops and microbatch capacity "
        "(interleaved, medians after warm-up) and compares their log-probs; prints JSON with "
        "both times, speedup, the analytic ideal FLOP ratio, efficiency = speedup / ideal "
        "ratio, the fidelity (max_abs_dlogp, mean_logit_cos) and the kernels that ran.",
    )
    _add_bench_args(p, repeats=3, warmup=1)
    p.set_defaults(func=_cmd_bench)


# One line of help per command (`harts-verl --help`), and how its parser is built.
_HELP = {
    "demo": "the embedded default job: tree vs expanded training on a SWE-like step",
    "bench": "tree vs expanded speed and fidelity (JSON)",
    "inspect": "forest statistics and planned microbatches (JSON), optional figure",
    "check": "fidelity audit: tree vs expanded on your model and batch (JSON)",
    "convert": "Kimi-Linear / Ling 3 checkpoint <-> harts_hybrid (train with veRL, serve again)",
    "precompile": "compile a model's fla (Triton) kernels for a GPU ahead of time (JSON)",
}
_ADD = {
    "demo": _add_demo,
    "bench": _add_bench,
    "inspect": _add_inspect,
    "check": _add_check,
    "convert": _add_convert,
    "precompile": _add_precompile,
}


def main(argv: list[str] | None = None) -> int:
    """Run ``harts-verl`` with ``argv``; the exit status (see the module doc): a user error is
    one line on stderr and 2, argparse's own errors exit 2 as well. Only the command that
    ``argv`` names gets its options built (the others' imports, torch's included, are not paid
    for: ``inspect`` reads numpy only); the rest get their line of ``harts-verl --help``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _Parser(
        prog="harts-verl",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="Exit status 2 = bad option or input file (one line on stderr; "
        "HARTS_VERL_DEBUG=1 shows its traceback), 1 = internal error (traceback), "
        "3 = check found a disagreement (--fail-above) or a non-finite difference.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add in _ADD.items():
        if argv and argv[0] == name:
            add(sub)
        else:
            sub.add_parser(name, help=_HELP[name])
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except _UserError as exc:
        print(f"harts-verl {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
