"""``harts-verl bench``: tree vs trajectory-wise (expanded) training speed and fidelity.

Both runners execute the same model with the same ops, capacity and recomputation setting; they
run interleaved in one process after a warm-up, and the median forward+backward(+grad) wall time
of each gives ``speedup``. ``ideal_flop_ratio`` is the analytic FLOP ratio for this model and
forest (see :mod:`harts_verl.runtime.flops`), ``efficiency = speedup / ideal_flop_ratio``.
Fidelity: ``max_abs_dlogp`` between tree and expanded log-probs in the run dtype, and
``mean_logit_cos`` (mean over semantic positions of the full-vocabulary logit cosine).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from harts_verl.models import HybridForCausalLM, preset
from harts_verl.runtime import ExpandedRunner, TreeRunner
from harts_verl.runtime.flops import ideal_flop_ratio, model_shape
from harts_verl.tree import RolloutForest
from harts_verl.tree._checks import is_int as _is_int
from harts_verl.tree.linear_plan import plan_linear_calls
from harts_verl.tree.workloads import WORKLOADS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class BenchConfig:
    """Benchmark settings. The embedded default is one SWE-like issue with realistic turn lengths
    (group samples, turn forks, context rewrites; paths capped at 4K tokens so that the
    trajectory-wise baseline fits a 2-core CPU): 21 trajectories, ≈86K semantic tokens, ≈5.7×
    compression."""

    workload: str = "swe_like"
    scale: float = 0.05
    seed: int = 0
    workload_overrides: dict[str, Any] = field(
        default_factory=lambda: {"path_caps": [4096], "prompt_tokens": [1500, 3000]}
    )
    max_semantic_tokens: int | None = None
    preset: str = "bench"
    # An HF model directory or config.json (random weights, seeded) of any model that runs in
    # tree mode; when set it replaces ``preset``.
    model: str | None = None
    dtype: str = "float32"
    repeats: int = 3
    warmup: int = 1
    chunk_size: int = 64
    capacity_tokens: int | None = 16384
    recompute: bool = True
    device: str = "cpu"
    plot: str | None = None
    progress: bool = True


def _select(sequences: list[np.ndarray], group_ids: np.ndarray, budget: int | None) -> list[int]:
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


def _logit_cosine(
    h_a: list[torch.Tensor], h_b: list[torch.Tensor], w: torch.Tensor, chunk: int = 2048
) -> float:
    """Mean over positions of cos(logits_a, logits_b), computed in float64, chunked."""
    wa = w.detach().double()
    acc, n = 0.0, 0
    for a, b in zip(h_a, h_b):
        for s in range(0, a.shape[0], chunk):
            la = a[s : s + chunk].double() @ wa.T
            lb = b[s : s + chunk].double() @ wa.T
            acc += float(torch.nn.functional.cosine_similarity(la, lb, dim=-1).sum())
            n += la.shape[0]
    return acc / max(n, 1)


def _bench_model(
    cfg: BenchConfig, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, Any]:
    """The benchmarked model on ``device`` in ``dtype`` and its config: the native preset, or
    the HF model / config of ``cfg.model`` (MoE experts in transformers' eager implementation
    off CUDA). Raises ``ValueError`` for a model that has no tree mode or no FLOP model."""
    if cfg.model is None:
        mcfg = preset(cfg.preset)
        torch.manual_seed(cfg.seed)
        return HybridForCausalLM.from_config(mcfg).to(device=device, dtype=dtype), mcfg
    from harts_verl.models.adapter import TREE_MODEL_TYPES
    from harts_verl.models.hf import load_causal_lm

    model = load_causal_lm(
        cfg.model, dtype=dtype, seed=cfg.seed, eager_experts=device.type != "cuda"
    )
    mcfg = model.config
    if mcfg.model_type not in TREE_MODEL_TYPES:
        raise ValueError(
            f"model: {cfg.model!r} is a {mcfg.model_type!r} model, which has no tree mode "
            f"(supported: {', '.join(TREE_MODEL_TYPES)})"
        )
    model_shape(mcfg)  # a ValueError here names the model type without a FLOP model
    return model.to(device), mcfg


def _check_config(cfg: BenchConfig) -> torch.device:
    """Every setting checked before anything is built (ValueError naming it); the device."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    if cfg.workload not in WORKLOADS:
        raise ValueError(f"workload: expected one of {sorted(WORKLOADS)}, got {cfg.workload!r}")
    for name, lo in (("repeats", 1), ("warmup", 0), ("chunk_size", 1)):
        v = getattr(cfg, name)
        if not _is_int(v) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    for name in ("max_semantic_tokens", "capacity_tokens"):
        v = getattr(cfg, name)
        if v is not None and (not _is_int(v) or v < 1):
            raise ValueError(f"{name}: expected None or an int >= 1, got {v!r}")
    if "vocab_size" in cfg.workload_overrides:
        raise ValueError(
            "workload_overrides: vocab_size is the model's (token ids must fit its vocabulary)"
        )
    if cfg.plot:
        parent = os.path.dirname(os.path.abspath(cfg.plot))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ValueError(f"plot: cannot write {cfg.plot!r} (no writable directory {parent!r})")
    try:
        device = torch.device(cfg.device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {cfg.device!r} is not a torch device ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {cfg.device!r}, but CUDA is not available")
    return device


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result (every setting that shapes the
    measurement included, so a result reproduces from its own output). Settings are checked
    first (ValueError naming the bad one)."""
    device = _check_config(cfg)
    dtype = DTYPES[cfg.dtype]
    model, mcfg = _bench_model(cfg, dtype, device)
    vocab_size = getattr(mcfg, "vocab_size", None) or mcfg.get_text_config().vocab_size
    w = WORKLOADS[cfg.workload](
        scale=cfg.scale, seed=cfg.seed, vocab_size=vocab_size, **cfg.workload_overrides
    )
    idx = _select(w.sequences, w.group_ids, cfg.max_semantic_tokens)
    seqs = [w.sequences[i] for i in idx]
    forest = RolloutForest.from_sequences(seqs)
    kw = dict(
        chunk_size=cfg.chunk_size,
        capacity_tokens=cfg.capacity_tokens,
        recompute=cfg.recompute,
        device=device,
    )
    tree, expanded = TreeRunner(model, **kw), ExpandedRunner(model, **kw)

    groups = tree.plan(forest)
    subs = [forest.subset(g) if len(groups) > 1 else forest for g in groups]
    replay = sum(plan_linear_calls(s, chunk_size=cfg.chunk_size).replay_tokens for s in subs)
    shape = model_shape(mcfg)
    flops = {"expanded_flops": 0.0, "tree_flops": 0.0}
    for s in subs:
        r = ideal_flop_ratio(
            shape, s, plan_linear_calls(s, chunk_size=cfg.chunk_size).replay_tokens
        )
        flops["expanded_flops"] += r["expanded_flops"]
        flops["tree_flops"] += r["tree_flops"]
    ideal = flops["expanded_flops"] / flops["tree_flops"]

    loss_fn = _grpo_like_loss([len(s) for s in seqs], cfg.seed)
    times: dict[str, list[float]] = {"expanded": [], "tree": []}
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
        for name, runner in (("expanded", expanded), ("tree", tree)):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            runner.forward_backward(seqs, loss_fn, separable=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
                peak[name] = torch.cuda.max_memory_allocated() / 2**20
            dt = time.perf_counter() - t0
            if it >= cfg.warmup:
                times[name].append(dt)
            if bar is not None:
                bar.update(1)
                bar.set_postfix({name: f"{dt:.2f}s"})
    if bar is not None:
        bar.close()
    t_exp, t_tree = statistics.median(times["expanded"]), statistics.median(times["tree"])
    speedup = t_exp / t_tree

    lp_tree = tree.log_probs(seqs)
    lp_exp = expanded.log_probs(seqs)
    max_dlogp = max(
        float((a.double() - b.double()).abs().max()) for a, b in zip(lp_tree, lp_exp) if a.numel()
    )
    cos = _logit_cosine(
        tree.hidden_states(seqs), expanded.hidden_states(seqs), model.lm_head.weight
    )
    result = {
        "benchmark": "harts_bench",
        "workload": cfg.workload,
        "scale": cfg.scale,
        "seed": cfg.seed,
        "preset": None if cfg.model else cfg.preset,
        "model": cfg.model,
        "model_type": getattr(mcfg, "model_type", "harts_native"),
        "dtype": cfg.dtype,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "trajectories": forest.num_trajectories,
        "semantic_tokens": forest.num_semantic_tokens,
        "compact_tokens": forest.num_compact_tokens,
        "compression": round(forest.compression, 4),
        "microbatches": len(groups),
        "replay_tokens": int(replay),
        "ideal_flop_ratio": round(ideal, 4),
        "expanded_seconds_median": round(t_exp, 4),
        "tree_seconds_median": round(t_tree, 4),
        "expanded_seconds": [round(t, 4) for t in times["expanded"]],
        "tree_seconds": [round(t, 4) for t in times["tree"]],
        "speedup": round(speedup, 4),
        "efficiency": round(speedup / ideal, 4),
        # Best-of times are less sensitive to other jobs on a shared machine than the median.
        "speedup_best": round(min(times["expanded"]) / min(times["tree"]), 4),
        "efficiency_best": round(min(times["expanded"]) / min(times["tree"]) / ideal, 4),
        "max_abs_dlogp": max_dlogp,
        "mean_logit_cos": cos,
        "recompute": cfg.recompute,
        "capacity_tokens": cfg.capacity_tokens,
        "chunk_size": cfg.chunk_size,
        "workload_overrides": dict(cfg.workload_overrides),
        "max_semantic_tokens": cfg.max_semantic_tokens,
        "repeats": cfg.repeats,
        "warmup": cfg.warmup,
    }
    if peak:
        result["peak_memory_mib"] = {k: round(v, 1) for k, v in peak.items()}
    else:
        result["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    if cfg.plot:
        try:
            plot_bench(result, cfg.plot)
            result["plot"] = cfg.plot
        except Exception as exc:  # the measurements are kept (and printed) either way
            result["plot_error"] = f"{type(exc).__name__}: {exc}"
    return result


def plot_bench(result: dict[str, Any], path: str) -> None:
    """Bar chart of wall times and the speedup vs the ideal ratio."""
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
        f"{result['workload']} · {result['semantic_tokens']} tok · {result['compression']}× compression"
    )
    ax = axes[1]
    ax.bar(
        ["measured speedup", "ideal FLOP ratio"],
        [result["speedup"], result["ideal_flop_ratio"]],
        color=["#2a7", "#bbb"],
    )
    ax.set_title(f"efficiency {result['efficiency']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_json(cfg: BenchConfig) -> int:
    print(json.dumps(run_bench(cfg), indent=2))
    return 0
