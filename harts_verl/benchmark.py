"""``harts-verl bench``: tree vs trajectory-wise (expanded) training speed and fidelity.

Both runners execute the same model with the same ops, capacity and recomputation setting; they
run interleaved in one process after at least one warm-up iteration (the first step of a process
pays one-time costs, which a timed run must not carry), in alternating order (expanded first in
even iterations, tree first in odd ones, so neither always runs in the other's wake), and the
median forward+backward(+grad) wall time of each gives ``speedup``. ``ideal_flop_ratio`` is the
analytic FLOP ratio for this model and forest (see :mod:`harts_verl.runtime.flops`),
``efficiency = speedup / ideal_flop_ratio``. When a sliding window shorter than a trajectory cut
attention calls of the timed iterations (``sliding_window_active``) and a varlen flash kernel
ran them (it skips the pairs outside the window), the ideal ratio counts each layer's windowed
pairs (``attention_windows``: the window of each softmax-attention layer, as the untimed tree
forward of the fidelity pass applied them). ``efficiency`` is ``null`` (with a note on stderr)
when SDPA ran windowed calls (a mask over the full square: no FLOP count is a yardstick for
it) or the forward did not show each layer's window.
Fidelity: ``max_abs_dlogp`` between tree and expanded log-probs in the run dtype, and
``mean_logit_cos`` (mean over semantic positions of the full-vocabulary logit cosine).
``kernel_calls``: per runner, the linear- and softmax-attention kernel calls of the timed
iterations by route (``linear/fla``, ``attention/flash_attn``, ``attention/sdpa (float32)``, ...:
:mod:`harts_verl.ops.backends.routes`), so a result says which kernels it measured.
``replay_tokens`` counts the chunked linear-attention replay of the tree layout (0 for a model
without linear-attention layers, which replays nothing). ``compact_tokens`` / ``compression``
describe the whole forest; ``run_compact_tokens`` / ``run_compression`` the work the tree runner
does over its microbatches (a tree the capacity cuts repeats its shared prefix in each part),
which is what ``ideal_flop_ratio`` (and so ``efficiency``) is computed from.

:func:`load_bench_inputs` checks every setting and reads the inputs (model, workload), then
:func:`prepare_bench` builds the forest, the runners and the plan, before :func:`measure_bench`
times anything: a bad setting or input file raises first, naming the setting, not after minutes
of measurement. The result is printed as strict JSON
(:func:`harts_verl.tree.inspect.json_text`: never NaN or Infinity).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from harts_verl.models import HybridForCausalLM, preset
from harts_verl.ops.backends import kernel_routes
from harts_verl.ops.layout import check_chunk_size, layer_windows, recording_attention_windows
from harts_verl.ops.logprobs import mean_logit_cosine
from harts_verl.ops.tree_attention import attention_key_rows
from harts_verl.runtime import ExpandedRunner, TreeRunner
from harts_verl.runtime.flops import ModelShape, ideal_flop_ratio, model_shape
from harts_verl.tree import RolloutForest
from harts_verl.tree._checks import INT64_MAX, SEED_MAX, check_int, finite_float
from harts_verl.tree._checks import is_int as _is_int
from harts_verl.tree.inspect import json_text, plot_path
from harts_verl.tree.linear_plan import plan_linear_calls
from harts_verl.tree.workloads import MAX_SCALE, WORKLOADS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}

# Generator options each workload gets when ``BenchConfig.workload_overrides`` is None: path caps
# that keep the trajectory-wise baseline within a 2-core CPU's reach at the default scale (0.05).
# swe_like: 21 trajectories, ≈86K semantic tokens, ≈5.7×; tau_like (its 4.6–5.0K system prompt
# needs a cap above 5.4K): 14 trajectories, ≈79K tokens, ≈9.5×; grpo_flat: 24, ≈56K, ≈2.1×.
BENCH_WORKLOAD_OPTIONS: dict[str, dict[str, Any]] = {
    "swe_like": {"path_caps": [4096], "prompt_tokens": [1500, 3000]},
    "tau_like": {"path_caps": [5632], "group_size": [4, 4]},
    "grpo_flat": {},
}


@dataclass
class BenchConfig:
    """Benchmark settings. The embedded default is one SWE-like issue with realistic turn lengths
    (group samples, turn forks, context rewrites; paths capped at 4K tokens so that the
    trajectory-wise baseline fits a 2-core CPU): 21 trajectories, ≈86K semantic tokens, ≈5.7×
    compression. ``workload_overrides`` None means the workload's entry of
    :data:`BENCH_WORKLOAD_OPTIONS`; a dict replaces all of them."""

    workload: str = "swe_like"
    scale: float = 0.05
    seed: int = 0
    workload_overrides: dict[str, Any] | None = None
    # A file of your own step's trajectories (a forest .npz, a token file .json / .jsonl, a
    # torch.save .pt dump: harts_verl.workers.check.load_sequences) instead of the generated
    # workload (workload, scale and workload_overrides are then not used). Token ids past the
    # model's vocabulary are renumbered densely in their order (the same forest).
    trajectories: str | None = None
    max_semantic_tokens: int | None = None
    preset: str = "bench"
    # An HF model directory or config.json (random weights, seeded) of any model that runs in
    # tree mode; when set it replaces ``preset``.
    model: str | None = None
    dtype: str = "float32"
    repeats: int = 3
    warmup: int = 1  # >= 1: the first iteration of a process is never timed
    chunk_size: int = 64
    capacity_tokens: int | None = 16384
    recompute: bool = True
    # bound on the key rows an attention layer keeps for backward (TreeLayout); None = none
    attention_key_rows: int | None = None
    device: str = "cpu"
    plot: str | None = None
    progress: bool = True


def _select(
    sequences: list[np.ndarray], group_ids: np.ndarray | None, budget: int | None
) -> list[int]:
    """Indices of a prefix (in generation order) of trajectories with at most ``budget`` semantic
    tokens (whole trajectories; at least one). Note: a prefix of a group shares less than the
    whole group; prefer choosing the workload's scale."""
    if budget is None:
        return list(range(len(sequences)))
    lens = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    k = int(np.searchsorted(np.cumsum(lens), budget, side="right"))
    return list(range(max(k, 1)))


def _grpo_like_loss(lengths: list[int], seed: int):
    """A policy-gradient style loss: Σ_i adv_i · Σ_t logp_i[t] / Σ tokens (fixed advantages;
    separable over trajectories, ``None`` entries are skipped)."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    total = float(max(sum(max(n - 1, 0) for n in lengths), 1))

    def loss_fn(log_probs: list[torch.Tensor]) -> torch.Tensor:
        terms = [
            lp.sum() * float(adv[i])
            for i, lp in enumerate(log_probs)
            if lp is not None and lp.numel()
        ]
        return torch.stack(terms).sum() / total

    return loss_fn


def bench_model(
    cfg: BenchConfig, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, Any, str]:
    """The benchmarked model on ``device`` in ``dtype``, its config and the model type of the
    config given (``harts_native`` for a preset): the native preset, or
    the HF model / config of ``cfg.model`` (MoE experts in transformers' eager implementation
    off CUDA; a multi-modal config gives its language model). Raises ``ValueError`` for a model
    that has no tree mode or no FLOP model."""
    if cfg.model is None:
        mcfg = preset(cfg.preset)
        torch.manual_seed(cfg.seed)
        return (
            HybridForCausalLM.from_config(mcfg).to(device=device, dtype=dtype),
            mcfg,
            "harts_native",
        )
    from harts_verl.models.checkpoints import read_config
    from harts_verl.workers.check import load_tree_model

    # The model type is checked (tree mode) before anything is built.
    model = load_tree_model(
        cfg.model, dtype=dtype, seed=cfg.seed, eager_experts=device.type != "cuda"
    )
    mcfg = model.config
    # The type written in the config (already checked by load_tree_model): Kimi-Linear stays
    # kimi_linear where its conversion runs as harts_hybrid.
    given = str(read_config(cfg.model)["model_type"])
    try:
        model_shape(mcfg)
    except ValueError as exc:  # names the model type without a FLOP model
        raise ValueError(f"model: {cfg.model!r}: {exc}") from exc
    return model.to(device), mcfg, given


def workload_options(cfg: BenchConfig) -> dict[str, Any]:
    """The generator options the run uses: ``cfg.workload_overrides``, or the workload's bench
    defaults when it is None (an unknown workload has none)."""
    if cfg.workload_overrides is None:
        return BENCH_WORKLOAD_OPTIONS.get(cfg.workload, {})
    return cfg.workload_overrides


def check_config(cfg: BenchConfig) -> tuple[torch.device, str | None]:
    """Every setting checked before anything is built (ValueError naming it); the device and
    the file the plot is written to (:func:`plot_path`; None without ``plot``)."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    if cfg.workload not in WORKLOADS:
        raise ValueError(f"workload: expected one of {sorted(WORKLOADS)}, got {cfg.workload!r}")
    check_chunk_size(cfg.chunk_size)
    check_int("seed", cfg.seed, 0, SEED_MAX)
    for name, lo in (("repeats", 1), ("warmup", 1)):
        v = getattr(cfg, name)
        if not _is_int(v) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    for name in ("max_semantic_tokens", "capacity_tokens"):
        v = getattr(cfg, name)
        if v is not None and (not _is_int(v) or not 1 <= v <= INT64_MAX):
            raise ValueError(f"{name}: expected None or an int in [1, 2**63 - 1], got {v!r}")
    scale = cfg.scale
    if (
        not isinstance(scale, int | float)
        or finite_float(scale) is None
        or scale <= 0
        or scale > MAX_SCALE
    ):
        raise ValueError(f"scale: expected a finite number in (0, {MAX_SCALE}], got {scale!r}")
    if cfg.workload_overrides is not None and not isinstance(cfg.workload_overrides, dict):
        raise ValueError(
            "workload_overrides: expected None or a dict, got "
            f"{type(cfg.workload_overrides).__name__}"
        )
    if "vocab_size" in workload_options(cfg):
        raise ValueError(
            "workload_overrides: vocab_size is the model's (token ids must fit its vocabulary)"
        )
    for own in ("seed", "scale"):  # the generator's own arguments, set by the config
        if own in workload_options(cfg):
            raise ValueError(
                f"workload_overrides: {own} is --{own} (the config's {own!r}), not a generator "
                "option"
            )
    if cfg.trajectories is not None:
        if not isinstance(cfg.trajectories, str | os.PathLike):
            raise ValueError(
                f"trajectories: expected a file path or None, got {type(cfg.trajectories).__name__}"
            )
        if cfg.workload_overrides:
            raise ValueError(
                "workload_overrides: generator options, but the trajectories come from "
                f"{os.fspath(cfg.trajectories)!r}"
            )
    plot = plot_path(cfg.plot) if cfg.plot is not None else None
    try:
        device = torch.device(cfg.device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {cfg.device!r} is not a torch device ({exc})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected cpu or cuda[:N], got {cfg.device!r}")
    if device.type == "cpu" and device.index not in (None, 0):
        raise ValueError(f"device: {cfg.device!r}: the CPU has one device, cpu (or cpu:0)")
    if device.type == "cpu":
        device = torch.device("cpu")  # cpu:0 is cpu: tensors report device "cpu"
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {cfg.device!r}, but CUDA is not available")
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device: {cfg.device!r}, but there are {torch.cuda.device_count()} CUDA devices"
            )
    return device, plot


@dataclass
class PreparedBench:
    """Everything :func:`measure_bench` times, built and checked by :func:`prepare_bench`."""

    cfg: BenchConfig
    device: torch.device
    plot: str | None  # the file the plot is written to (None: no plot)
    model: torch.nn.Module
    mcfg: Any  # the config of the model that runs (a multi-modal config's text config)
    seqs: list[np.ndarray]
    forest: RolloutForest
    tree: TreeRunner
    expanded: ExpandedRunner
    microbatches: int
    replay_tokens: int
    ideal_flop_ratio: float
    oversize_microbatches: int = 0  # compact work above capacity_tokens (a lone trajectory)
    run_compact_tokens: int = 0  # Σ compact rows of the microbatches (shared rows of split trees
    # count once per microbatch that holds them)
    notes: list[str] = field(default_factory=list)  # settings the run could not honour
    model_type: str = "harts_native"  # of the config given (``--model``), else the preset's
    # what ideal_flop_ratio is computed from (measure_bench recomputes it with the windows of
    # sliding-window layers, which only a forward shows)
    shape: ModelShape | None = None
    microbatch_forests: list[RolloutForest] = field(default_factory=list)
    microbatch_replays: list[int] = field(default_factory=list)
    token_ids_remapped: bool = False  # BenchInputs.token_ids_remapped


@dataclass
class BenchInputs:
    """The inputs of a bench run read and checked by :func:`load_bench_inputs`: the device, the
    plot file, the model (on the device) and its config and type, and the workload's
    trajectories (the ``max_semantic_tokens`` selection applied)."""

    device: torch.device
    plot: str | None
    model: torch.nn.Module
    mcfg: Any
    model_type: str
    seqs: list[np.ndarray]
    token_ids_remapped: bool = False  # ``trajectories``' ids renumbered into the vocabulary


def load_bench_inputs(cfg: BenchConfig) -> BenchInputs:
    """Check every setting, build the model and generate the workload: the steps whose errors
    are the user's (settings, model files, generator options).

    Raises ``ValueError`` whose message starts with the setting at fault (``dtype:``,
    ``workload:``, ``repeats:``, ``warmup:`` (>= 1), ``seed:``, ``chunk_size:``, ``scale:``,
    ``max_semantic_tokens:``, ``capacity_tokens:``, ``workload_overrides:`` (a generator option
    it does not know or cannot use, or any with ``trajectories``), ``trajectories:`` (the file:
    missing, unreadable, bad token ids, more distinct ids than the model's vocabulary), ``plot:`` (:func:`plot_path`), ``device:``, ``preset:``,
    ``model:`` (:func:`harts_verl.workers.check.load_tree_model`: missing or unreadable files,
    a model type without a tree mode, checked before the model is built; then a model whose
    token mixers have no tree mode, a vocabulary too small for the workload, or a
    length-dependent RoPE whose exact range the workload's longest trajectory exceeds)) before
    any model or workload is built for the settings checked up front; ``device:`` is ``cpu``
    (``cpu:0``) or an existing ``cuda[:N]``."""
    from harts_verl.models.adapter import as_tree_model, check_rope_lengths

    device, plot = check_config(cfg)
    dtype = DTYPES[cfg.dtype]
    model, mcfg, model_type = bench_model(cfg, dtype, device)
    try:
        as_tree_model(model)  # one the runners can run (its token mixers have a tree mode)
    except (ValueError, TypeError) as exc:
        raise _named("model", exc) from exc
    vocab_size = getattr(mcfg, "vocab_size", None) or mcfg.get_text_config().vocab_size
    remapped = False
    if cfg.trajectories is not None:
        from harts_verl.workers.check import load_trajectory_arrays

        try:
            sequences = load_trajectory_arrays(os.fspath(cfg.trajectories))
        except ValueError as exc:
            raise _named("trajectories", exc) from exc
        # the benched prefix (max_semantic_tokens) alone is fitted into the vocabulary: the
        # trajectories past it neither count against it nor mark the ids remapped
        benched = [sequences[i] for i in _select(sequences, None, cfg.max_semantic_tokens)]
        seqs, remapped = fit_vocabulary(benched, vocab_size)
    else:
        try:
            w = WORKLOADS[cfg.workload](
                scale=cfg.scale, seed=cfg.seed, vocab_size=vocab_size, **workload_options(cfg)
            )
        except (ValueError, TypeError) as exc:  # scale and seed are checked: the overrides,
            # or a vocabulary (the model's) too small for the workload
            if str(exc).startswith("vocab_size"):  # the model's vocabulary, with the options
                given = (
                    f" (with --workload-option {cfg.workload_overrides})"
                    if cfg.workload_overrides
                    else ""
                )
                raise ValueError(f"model: {exc}{given}") from exc
            raise _named("workload_overrides", exc) from exc
        seqs = [w.sequences[i] for i in _select(w.sequences, w.group_ids, cfg.max_semantic_tokens)]
    try:  # dynamic / longrope scaling: tree mode is exact only below the original context
        check_rope_lengths(model, max((len(t) for t in seqs), default=0))
    except NotImplementedError as exc:
        fix = "shorter trajectories" if cfg.trajectories else "a smaller --scale or path caps"
        raise ValueError(f"model: {exc} (this workload's; choose {fix})") from exc
    return BenchInputs(device, plot, model, mcfg, model_type, seqs, remapped)


def fit_vocabulary(seqs: list[np.ndarray], vocab_size: int) -> tuple[list[np.ndarray], bool]:
    """``seqs`` with token ids below ``vocab_size``, and whether they were renumbered.

    Unchanged when every id already is; else each distinct id becomes its rank among the
    distinct ids of all trajectories (order-preserving and one-to-one, so the forest, its
    compression and every planned figure are the same). Raises ``ValueError`` naming
    ``trajectories`` when there are more distinct ids than the vocabulary holds."""
    if not seqs or max(int(a.max()) for a in seqs) < vocab_size:
        return seqs, False
    ids, rank = np.unique(np.concatenate(seqs), return_inverse=True)
    if ids.size > vocab_size:
        raise ValueError(
            f"trajectories: {ids.size} distinct token ids, more than the model's vocabulary "
            f"({vocab_size}): bench a model with your tokenizer's vocabulary (--model)"
        )
    bounds = np.cumsum([a.shape[0] for a in seqs])[:-1]
    return [r.astype(np.int64, copy=False) for r in np.split(rank, bounds)], True


def _named(field: str, exc: BaseException) -> ValueError:
    """``exc`` as a ValueError whose message starts with ``field:`` (once)."""
    msg = str(exc) or type(exc).__name__
    return ValueError(msg if msg.startswith(field + ":") else f"{field}: {msg}")


def prepare_bench(cfg: BenchConfig, inputs: BenchInputs | None = None) -> PreparedBench:
    """Build the forest, the runners and the microbatch plan of ``inputs``
    (:func:`load_bench_inputs` of ``cfg`` when None, so settings are checked first, with its
    errors); nothing is timed. An error raised after the inputs are read is not the user's
    (the CLI shows its traceback). ``replay_tokens`` is 0 for a model without linear-attention
    layers."""
    if inputs is None:
        inputs = load_bench_inputs(cfg)
    device, plot, model, mcfg = inputs.device, inputs.plot, inputs.model, inputs.mcfg
    model_type, seqs = inputs.model_type, inputs.seqs
    forest = RolloutForest.from_sequences(seqs)
    kw = dict(
        chunk_size=cfg.chunk_size,
        capacity_tokens=cfg.capacity_tokens,
        recompute=cfg.recompute,
        device=device,
        warn_oversize=False,  # the bench prints its own note, once
        attention_key_rows=cfg.attention_key_rows,
    )
    tree, expanded = TreeRunner(model, **kw), ExpandedRunner(model, **kw)

    groups = tree.plan(forest)
    subs = [forest.subset(g) if len(groups) > 1 else forest for g in groups]
    notes = []
    if cfg.max_semantic_tokens is not None and forest.num_semantic_tokens > cfg.max_semantic_tokens:
        notes.append(
            f"max_semantic_tokens {cfg.max_semantic_tokens} is below the first trajectory's "
            f"{forest.num_semantic_tokens} tokens: it runs alone"
        )
    cap = cfg.capacity_tokens
    oversize = sum(s.num_compact_tokens > cap for s in subs) if cap else 0
    if oversize:
        notes.append(
            f"{oversize} microbatch{'es exceed' if oversize != 1 else ' exceeds'} "
            f"capacity_tokens {cap} (a single trajectory longer than the capacity runs alone)"
        )
    for note in notes:
        print(f"harts-verl bench: note: {note}", file=sys.stderr)
    shape = model_shape(mcfg)
    # Replay exists only where chunked linear attention runs.
    replays = [
        plan_linear_calls(s, chunk_size=cfg.chunk_size).replay_tokens
        if shape.linear_per_token
        else 0
        for s in subs
    ]
    ideal = _run_flop_ratio(shape, subs, replays, cfg.chunk_size)
    return PreparedBench(
        cfg=cfg,
        device=device,
        plot=plot,
        model=model,
        mcfg=mcfg,
        seqs=seqs,
        forest=forest,
        tree=tree,
        expanded=expanded,
        microbatches=len(groups),
        replay_tokens=int(sum(replays)),
        ideal_flop_ratio=ideal,
        oversize_microbatches=int(oversize),
        run_compact_tokens=int(sum(s.num_compact_tokens for s in subs)),
        notes=notes,
        model_type=model_type,
        shape=shape,
        microbatch_forests=subs,
        microbatch_replays=replays,
        token_ids_remapped=inputs.token_ids_remapped,
    )


def _run_flop_ratio(
    shape: ModelShape,
    subs: list[RolloutForest],
    replays: list[int],
    chunk_size: int,
    windows: list[int | None] | None = None,
) -> float:
    """Expanded ÷ tree forward FLOPs of the tree runner's microbatches ``subs`` (their replay
    tokens ``replays``; per-layer sliding ``windows``: see :func:`ideal_flop_ratio`)."""
    exp = tree = 0.0
    for s, r_tokens in zip(subs, replays, strict=True):
        r = ideal_flop_ratio(shape, s, r_tokens, chunk_size, windows)
        exp += r["expanded_flops"]
        tree += r["tree_flops"]
    return exp / tree if tree else 1.0


def timing_order(iteration: int) -> tuple[str, str]:
    """The runners' order in timing iteration ``iteration`` (warm-up included): expanded first
    in even iterations, tree first in odd ones."""
    return ("expanded", "tree") if iteration % 2 == 0 else ("tree", "expanded")


def alternating_runs(
    sides: Mapping[str, Callable[[], tuple[tuple[float, ...], Any]]], repeats: int
) -> tuple[dict[str, list[tuple[float, ...]]], dict[str, Any]]:
    """Time ``sides["tree"]`` and ``sides["expanded"]`` as the bench times its runners: one
    untimed call of each (one-off costs: iteration 0), then ``repeats`` (≥ 1) iterations, each
    in :func:`timing_order`. A side returns ``(seconds, result)``, ``seconds`` a tuple of the
    phases it timed itself. Returns each side's ``seconds`` of every timed call, in call order,
    and each side's last result."""
    if set(sides) != {"tree", "expanded"}:
        raise ValueError(f"sides: expected the keys 'tree' and 'expanded', got {sorted(sides)}")
    check_int("repeats", repeats, 1)
    outs = {key: sides[key]()[1] for key in timing_order(0)}
    runs: dict[str, list[tuple[float, ...]]] = {"tree": [], "expanded": []}
    for i in range(1, repeats + 1):
        for key in timing_order(i):
            seconds, outs[key] = sides[key]()
            runs[key].append(tuple(seconds))
    return runs, outs


def wall_timed(fn: Callable[[], Any]) -> Callable[[], tuple[tuple[float], Any]]:
    """``fn`` as an :func:`alternating_runs` side: its wall seconds (one phase) and result."""

    def timed() -> tuple[tuple[float], Any]:
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0,), out

    return timed


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result (every setting that shapes the
    measurement included, so a result reproduces from its own output): :func:`measure_bench` of
    :func:`prepare_bench`, so settings are checked first (ValueError naming the bad one)."""
    return measure_bench(prepare_bench(cfg))


def measure_bench(prep: PreparedBench) -> dict[str, Any]:
    """Time both runners (``warmup`` untimed then ``repeats`` timed iterations, order
    :func:`timing_order`), measure fidelity, and write the plot when one was asked for (a
    failed plot is reported as ``plot_error``; the measurements are returned either way)."""
    cfg, device, model, forest, seqs = prep.cfg, prep.device, prep.model, prep.forest, prep.seqs
    runners = {"expanded": prep.expanded, "tree": prep.tree}
    tree, expanded, mcfg, ideal = prep.tree, prep.expanded, prep.mcfg, prep.ideal_flop_ratio
    key_rows = [attention_key_rows(f) for f in prep.microbatch_forests]
    loss_fn = _grpo_like_loss([len(s) for s in seqs], cfg.seed)
    times: dict[str, list[float]] = {"expanded": [], "tree": []}
    calls: dict[str, Counter[str]] = {"expanded": Counter(), "tree": Counter()}
    peak: dict[str, float] = {}
    total_iters = cfg.warmup + cfg.repeats
    bar = None
    if cfg.progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=2 * total_iters, desc="bench", file=sys.stderr)
        except ImportError:  # pragma: no cover - tqdm is in the bench extra
            bar = None
    for it in range(total_iters):
        for name in timing_order(it):
            runner = runners[name]
            model.zero_grad(set_to_none=True)
            kernel_routes(reset=True)
            if device.type == "cuda":  # the bench's device (cuda:N), not the current one
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            runner.forward_backward(seqs, loss_fn, separable=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peak[name] = torch.cuda.max_memory_allocated(device) / 2**20
            dt = time.perf_counter() - t0
            if it >= cfg.warmup:
                times[name].append(dt)
                calls[name].update(kernel_routes(reset=True))
            if bar is not None:
                bar.update(1)
                bar.set_postfix({name: f"{dt:.2f}s"})
    if bar is not None:
        bar.close()
    t_exp, t_tree = statistics.median(times["expanded"]), statistics.median(times["tree"])
    speedup = t_exp / t_tree
    # A sliding window that cut an attention call (the layouts pass only effective windows):
    # the FLOP model counts full causal pairs, so the ideal ratio is no yardstick.
    windowed = any("window" in route for c in calls.values() for route in c)
    windowed_unknown = False  # ... and the FLOP model could not count those layers' windows

    if cfg.progress:  # untimed, about two expanded forwards: say what the wait is
        print("bench: fidelity: log-probs and logit cosine of both runners ...", file=sys.stderr)
    with recording_attention_windows() as window_log:  # the windows each layer applied
        lp_tree = tree.log_probs(seqs)
    windows = layer_windows(window_log)
    # SDPA runs a window as a mask over the keys it computes anyway (the full square), a varlen
    # flash kernel skips the pairs outside it: only then is the windowed work the yardstick
    masked = sorted(
        {r for c in calls.values() for r in c if r.startswith("attention/sdpa") and "window" in r}
    )
    known = bool(windows) and any(w is not None for w in windows) and prep.shape is not None
    if windowed and known and not masked:
        # the ideal counts each windowed layer's pairs (min(position + 1, window) per query)
        ideal = _run_flop_ratio(
            prep.shape, prep.microbatch_forests, prep.microbatch_replays, cfg.chunk_size, windows
        )
    elif windowed:
        windowed_unknown = True
        why = (
            f"the windowed calls ran as masks over full attention ({', '.join(masked)}), which "
            "computes the pairs outside the window too"
            if masked
            else "the tree forward did not show each layer's window"
        )
        print(
            "harts-verl bench: note: efficiency: null: a sliding window shorter than a "
            f"trajectory cut attention calls (kernel_calls), but {why}, so no FLOP count is a "
            "yardstick here (speedup is measured as usual)",
            file=sys.stderr,
        )
    lp_exp = expanded.log_probs(seqs)
    diffs = [
        float((a.double() - b.double()).abs().max()) for a, b in zip(lp_tree, lp_exp) if a.numel()
    ]
    # NaN anywhere is NaN here (Python's max drops a NaN that is not first); json_text refuses it
    max_dlogp = float(np.max(diffs)) if diffs else 0.0
    # the output head: HF models (harts_hybrid's wrapper included) name it themselves
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else model.lm_head
    cos = mean_logit_cosine(tree.hidden_states(seqs), expanded.hidden_states(seqs), head.weight)
    result = {
        "benchmark": "harts_bench",
        # a file's trajectories (trajectories_file) are no generated workload
        "workload": None if cfg.trajectories else cfg.workload,
        "scale": None if cfg.trajectories else cfg.scale,
        "trajectories_file": os.fspath(cfg.trajectories) if cfg.trajectories else None,
        "token_ids_remapped": prep.token_ids_remapped,
        "seed": cfg.seed,
        "preset": None if cfg.model else cfg.preset,
        "model": cfg.model,
        "model_type": prep.model_type,
        "text_model_type": getattr(mcfg, "model_type", "harts_native"),
        "dtype": cfg.dtype,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "trajectories": forest.num_trajectories,
        "semantic_tokens": forest.num_semantic_tokens,
        "compact_tokens": forest.num_compact_tokens,
        "compression": round(forest.compression, 4),
        # what the tree runner computes: the microbatches' rows (a tree cut by the capacity
        # repeats its shared prefix in each part); ideal_flop_ratio is of this work
        "run_compact_tokens": prep.run_compact_tokens,
        "run_compression": round(
            forest.num_semantic_tokens / prep.run_compact_tokens
            if prep.run_compact_tokens
            else 1.0,
            4,
        ),
        "microbatches": prep.microbatches,
        "oversize_microbatches": prep.oversize_microbatches,
        "replay_tokens": prep.replay_tokens,
        # rows a full-attention layer gathers as keys (each segment's root path), over the
        # tree microbatches: the largest microbatch's, and the sum over the compact rows
        "attention_key_rows_max": max(key_rows, default=0),
        "attention_key_rows_ratio": round(sum(key_rows) / prep.run_compact_tokens, 4)
        if prep.run_compact_tokens
        else None,
        "attention_key_rows": cfg.attention_key_rows,
        "ideal_flop_ratio": round(ideal, 4),
        "expanded_seconds_median": round(t_exp, 4),
        "tree_seconds_median": round(t_tree, 4),
        "expanded_seconds": [round(t, 4) for t in times["expanded"]],
        "tree_seconds": [round(t, 4) for t in times["tree"]],
        "speedup": round(speedup, 4),
        "efficiency": None if windowed_unknown else round(speedup / ideal, 4),
        # Best-of times are less sensitive to other jobs on a shared machine than the median.
        "speedup_best": round(min(times["expanded"]) / min(times["tree"]), 4),
        "efficiency_best": None
        if windowed_unknown
        else round(min(times["expanded"]) / min(times["tree"]) / ideal, 4),
        "sliding_window_active": windowed,
        # per softmax-attention layer, the window the FLOP model counted (null: full causal)
        "attention_windows": windows if windowed and not windowed_unknown else None,
        "max_abs_dlogp": max_dlogp,
        # the kernels the timed iterations ran, per runner (harts_verl.ops.backends.routes)
        "kernel_calls": {name: dict(sorted(c.items())) for name, c in calls.items()},
        "mean_logit_cos": cos,
        "recompute": cfg.recompute,
        "capacity_tokens": cfg.capacity_tokens,
        "chunk_size": cfg.chunk_size,
        "workload_overrides": None if cfg.trajectories else dict(workload_options(cfg)),
        "max_semantic_tokens": cfg.max_semantic_tokens,
        "repeats": cfg.repeats,
        "warmup": cfg.warmup,
    }
    if prep.notes:
        result["notes"] = list(prep.notes)
    if peak:
        result["peak_memory_mib"] = {k: round(v, 1) for k, v in peak.items()}
    else:
        result["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    if prep.plot:
        try:
            plot_bench(result, prep.plot)
            result["plot"] = prep.plot
        except Exception as exc:  # the measurements are kept (and printed) either way
            result["plot_error"] = f"{type(exc).__name__}: {exc}"
    return result


def plot_bench(result: dict[str, Any], path: str) -> None:
    """Bar chart of wall times and the speedup vs the ideal ratio, written to ``path`` as it
    stands (:func:`load_bench_inputs` resolves a path without suffix to ``.png`` beforehand)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    ax = axes[0]
    ax.bar(
        ["expanded", "tree"],
        [result["expanded_seconds_median"], result["tree_seconds_median"]],
        color=["#999", "#2a7"],
    )
    ax.set_ylabel("forward+backward seconds (median)")
    ax.set_title(
        f"{result['workload'] or os.path.basename(result['trajectories_file'])} · "
        f"{result['semantic_tokens']} tok · {result['compression']}× compression"
    )
    ax = axes[1]
    ax.bar(
        ["measured speedup", "ideal FLOP ratio"],
        [result["speedup"], result["ideal_flop_ratio"]],
        color=["#2a7", "#bbb"],
    )
    eff = result["efficiency"]
    ax.set_title("efficiency n/a (sliding window)" if eff is None else f"efficiency {eff:.3f}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def main_json(cfg: BenchConfig) -> int:
    """Run the benchmark and print its result as strict JSON (:func:`json_text`)."""
    print(json_text(run_bench(cfg)))
    return 0
