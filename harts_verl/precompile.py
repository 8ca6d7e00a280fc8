"""``harts-verl precompile``: compile a model's fla kernels for a GPU ahead of time.

The first tree or trajectory-wise step of a model on a GPU compiles fla's Triton kernels for every
linear-attention shape it meets — every autotune config, one at a time (KDA forward + backward at
one head shape: 227 compiles) — before anything is timed or trained. :func:`precompile_model`
runs the model's tree and trajectory-wise forward + backward once on a small forest, on the CPU,
with fla's kernels behind a stand-in CUDA driver
(:func:`harts_verl.ops.backends.triton_cache.compile_ahead`): every kernel specialization the
model's calls reach is compiled for the target GPU, in parallel, into Triton's on-disk cache. A
run on that GPU with the same Triton and ``TRITON_CACHE_DIR`` then loads them.

The warm-up forest (:func:`warmup_sequences`) has the round kinds of a real plan: first rounds
without initial states, later rounds from handed-on states, members whose final state is handed
on and members whose is not, a one-token trajectory, sequences of every length class; the
trajectory-wise run adds one round of whole trajectories. Linear attention runs on fla's kernels
through the route the target takes (:func:`~harts_verl.ops.backends.fla_linear.scalar_gate_route`
for the target's compute capability and this Triton); attention runs on the CPU's SDPA path
(flash kernels are not Triton kernels).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from harts_verl.benchmark import DTYPES, BenchConfig, bench_model, check_config
from harts_verl.models.config import preset
from harts_verl.ops.backends.fla_linear import (
    FlaLinearKernel,
    load_fla_gla_ops,
    load_fla_ops,
    scalar_gate_guard,
)
from harts_verl.ops.backends.triton_cache import DeviceInfo, check_triton, compile_ahead
from harts_verl.runtime import ExpandedRunner, TreeRunner
from harts_verl.tree import RolloutForest

__all__ = [
    "TARGETS",
    "check_precompile_config",
    "fla_kernel_for",
    "precompile_model",
    "target_device",
    "warmup_sequences",
]

TARGETS = ("current", "h100")


def warmup_sequences(chunk_size: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Token sequences whose forest's linear-attention plan has several rounds: a main path of
    seven chunks and a bit, branches forking before, at and after chunk boundaries, a nested
    branch, a prefix trajectory, a second root and a one-token trajectory. Deterministic in
    ``seed``; every id is below ``vocab_size``."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size: expected >= 2, got {vocab_size}")
    rng = np.random.default_rng(seed)
    c = int(chunk_size)

    def fresh(n: int) -> list[int]:
        return rng.integers(1, vocab_size, n).tolist()

    main = fresh(7 * c + 5)
    seqs = [main]
    for f in (c - 1, 2 * c, 2 * c + 3, 3 * c + 7, 5 * c, 5 * c + 1):
        seqs.append([*main[:f], 0, *fresh(int(rng.integers(1, 3 * c)))])
    nested = seqs[3]
    seqs.append([*nested[: len(nested) - 2], 0, *fresh(2 * c)])
    seqs.append([0, *fresh(2 * c)])
    seqs.append(main[: 4 * c])
    seqs.append([int(rng.integers(1, vocab_size))])
    return seqs


def target_device(name: str) -> DeviceInfo:
    """The GPU to compile for, after checking this process can compile for it: ``"current"``
    (the visible CUDA device) or ``"h100"`` (an sm_90 stand-in, on any machine).

    Raises:
      ValueError: an unknown target, ``"current"`` without a CUDA device, triton or fla
        missing, a triton the compile hooks do not know.
    """
    if name not in TARGETS:
        raise ValueError(f"target: unknown {name!r}, expected one of {TARGETS}")
    try:
        check_triton()
    except (ImportError, RuntimeError) as exc:
        raise ValueError(f"precompile needs triton 3.6 and fla (the [gpu] extra): {exc}") from exc
    if importlib.util.find_spec("fla") is None:
        raise ValueError("precompile needs fla-core / flash-linear-attention (the [gpu] extra)")
    if name == "h100":
        return DeviceInfo.hopper()
    if not torch.cuda.is_available():
        raise ValueError(
            "target: 'current' needs a visible CUDA device; use 'h100' to compile for an sm_90 "
            "GPU from any machine"
        )
    return DeviceInfo.current()


def fla_kernel_for(device: DeviceInfo) -> FlaLinearKernel:
    """fla's kernels (imported: call it once the stand-in driver is active) with the scalar-gate
    route ``device`` takes with this Triton."""
    import triton

    gla, simple_gla = load_fla_gla_ops()
    blocked = scalar_gate_guard(device.capability, triton.__version__)
    return FlaLinearKernel(
        *load_fla_ops(),
        chunk_gla=gla,
        chunk_simple_gla=simple_gla,
        scalar_gate="channels" if blocked else "native",
    )


def check_precompile_config(cfg: BenchConfig) -> torch.dtype:
    """The torch dtype of ``cfg`` after checking, before anything is built or compiled, what
    :func:`precompile_model` reads: ``dtype`` (not float64: no fla kernels run then),
    ``chunk_size``, ``seed``, and ``preset`` or ``model`` (its config is read and its type must
    have a tree mode; the weights are not loaded). ``ValueError`` naming the field otherwise."""
    check_config(cfg)  # the bench's checks: dtype, chunk_size, seed (the rest at defaults)
    dtype = DTYPES[cfg.dtype]
    if dtype == torch.float64:
        raise ValueError("dtype: float64 runs on the torch reference (no fla kernels to compile)")
    if cfg.model is None:
        preset(cfg.preset)  # an unknown preset is a ValueError naming it
    else:
        from harts_verl.workers.check import tree_model_config

        tree_model_config(cfg.model)
    return dtype


def precompile_model(
    cfg: BenchConfig,
    *,
    device: DeviceInfo,
    autotune: str = "all",
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Compile the fla kernels of ``cfg``'s model (``cfg.preset`` or ``cfg.model``, in
    ``cfg.dtype``, chunk ``cfg.chunk_size``, ``cfg.recompute``) for ``device`` (e.g.
    :func:`target_device`) into Triton's cache, with ``jobs`` compile threads (default: all
    cores); see the module doc. Must run before fla is imported in this process.

    Returns :func:`~harts_verl.ops.backends.triton_cache.compile_ahead`'s summary plus
    ``scalar_gate`` (the route compiled for), ``compact_tokens`` and ``semantic_tokens`` of the
    warm-up forest.

    Raises:
      ValueError: an unknown autotune mode, float64, a bad ``cfg`` (as the bench names it).
      RuntimeError: fla already imported, an unsupported triton (from
        :func:`~harts_verl.ops.backends.triton_cache.compile_ahead`).
    """
    if sys.modules.get("fla") is not None:
        raise RuntimeError(
            "precompile: fla is already imported in this process (it reads the GPU at import); "
            "run it in a process of its own"
        )
    dtype = check_precompile_config(cfg)
    stats: dict[str, Any] = {}

    def workload() -> None:
        kernel = fla_kernel_for(device)
        stats["scalar_gate"] = kernel.scalar_gate
        model, _mcfg, _ = bench_model(cfg, dtype, torch.device("cpu"))
        seqs = warmup_sequences(cfg.chunk_size, int(model.lm_head.weight.shape[0]), cfg.seed)
        kw: dict[str, Any] = dict(
            chunk_size=cfg.chunk_size,
            recompute=cfg.recompute,
            device="cpu",
            linear_backend=kernel,
            attention_backend="sdpa",
        )

        def loss(lps: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([lp.float().sum() for lp in lps]).sum()

        for runner_cls in (TreeRunner, ExpandedRunner):
            runner = runner_cls(model, **kw)
            if progress:
                progress(f"{runner_cls.__name__}: forward + backward on the warm-up forest")
            runner.forward_backward(seqs, loss, separable=True)
        forest = RolloutForest.from_sequences(seqs)
        stats["compact_tokens"] = int(forest.num_compact_tokens)
        stats["semantic_tokens"] = int(forest.num_semantic_tokens)

    out = compile_ahead(workload, device=device, autotune=autotune, threads=jobs, progress=progress)
    return {**out, **stats}
