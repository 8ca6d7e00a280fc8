"""Inputs of the GPU tests' fla calls (``tests/gpu``), shared with their ahead-of-time compile
(``tests/gpu/precompile_cases.py``): one definition of the shapes, dtypes and options, so the
kernels compiled ahead are the ones the tests launch. Device-agnostic (CPU tensors for the
compile, CUDA for the tests)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from _delta_rule_cases import delta_rule_inputs

from harts_verl.tree import RolloutForest

# (kda, delta_rule): KDA, GatedDeltaNet, Mamba-2's SSD (gated linear attention, scalar decay).
LINEAR_KINDS = [(True, True), (False, True), (False, False)]
LINEAR_IDS = ["kda", "gdn", "ssd"]
# Single-channel heads: Jamba's Mamba-1 scan (chunk_gla) and RecurrentGemma's RG-LRU.
KERNEL_CASES = (*LINEAR_IDS, "mamba1", "rglru")
GPU_DTYPES = (torch.float32, torch.bfloat16)
MODEL_CASES = ("tiny", "kimi_tiny", "ling_tiny")


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def gpu_forest(seed: int = 0, chunk: int = 64, scale: int = 1) -> RolloutForest:
    """Main path with forks at/around chunk boundaries (mid-member kept states), nested forks,
    a prefix trajectory and a second root; unique tokens per branch."""
    rng = np.random.default_rng(seed)
    nxt = iter(range(10_000, 10_000_000))

    def fresh(n: int) -> list[int]:
        return [next(nxt) for _ in range(n)]

    main = fresh(scale * 7 * chunk + 5)
    seqs = [main]
    for f in (chunk - 1, 2 * chunk, 2 * chunk + 3, 3 * chunk + 7, 5 * chunk, 5 * chunk + 1):
        seqs.append(main[: f * scale] + fresh(int(rng.integers(1, 3 * chunk))))
    nested = seqs[3]
    seqs.append(nested[: len(nested) - 2] + fresh(2 * chunk))
    seqs.append(fresh(2 * chunk + 1))
    seqs.append(main[: 4 * chunk])
    return RolloutForest.from_sequences(seqs)


def linear_inputs(t: int, kda: bool, dtype: torch.dtype, device: Any, seed: int = 0):
    """Model-like inputs (2 key heads, 4 value heads of 64): q/k raw (l2-normalised in the
    kernel), gates from the model's gate functions, beta post-sigmoid (float32, as the mixers
    produce it); q/k/v in ``dtype``."""
    q, k, v, g, beta_logits = delta_rule_inputs(t, kda, h=2, hv=4, d=64, seed=seed)
    return (
        q.to(device, dtype),
        k.to(device, dtype),
        v.to(device, dtype),
        g.to(device),
        torch.sigmoid(beta_logits).to(device),
    )


def _cu(lens: list[int], device: Any) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), device=device)


def kernel_case(
    name: str, dtype: torch.dtype, device: Any
) -> tuple[tuple, torch.Tensor, Any, dict]:
    """``(inputs (q, k, v, g, beta), h0, cu_seqlens, kernel keywords)`` of one fla-vs-reference
    case: ``kda`` / ``gdn`` / ``ssd`` (2 key heads, 4 value heads of 64, in-kernel q/k norm,
    chunk 64), ``mamba1`` (one q/k head of 16 state entries shared by 64 one-channel value heads,
    per-channel decay, write scale dt) or ``rglru`` (64 one-entry heads, q = k = 1, scalar
    decay, write scale 1)."""
    if name in LINEAR_IDS:
        kda, delta_rule = LINEAR_KINDS[LINEAR_IDS.index(name)]
        lens = [100, 64, 1, 200, 37]
        inputs = linear_inputs(sum(lens), kda, dtype, device, seed=1)
        h0 = 0.1 * torch.randn(len(lens), 4, 64, 64, device=device)
        kw = {"use_qk_l2norm": True, "chunk_size": 64, "delta_rule": delta_rule}
        return inputs, h0, _cu(lens, device), kw
    lens = [100, 1, 200, 37]
    t = sum(lens)
    if name == "mamba1":
        gen = torch.Generator().manual_seed(3)
        q, k = (torch.randn(t, 1, 16, generator=gen).to(device, dtype) for _ in range(2))
        v = torch.randn(t, 64, 1, generator=gen).to(device, dtype)
        dt = torch.nn.functional.softplus(torch.randn(t, 64, generator=gen) - 2.0).to(device)
        a = torch.arange(1, 17, dtype=torch.float32).to(device)  # S4D-real A = -(1 .. N)
        h0 = 0.1 * torch.randn(len(lens), 64, 16, 1, generator=gen).to(device)
        inputs = (q, k, v, -dt[..., None] * a, dt)
    elif name == "rglru":
        gen = torch.Generator().manual_seed(4)
        ones = torch.ones(t, 64, 1).to(device, dtype)
        v = torch.randn(t, 64, 1, generator=gen).to(device, dtype)
        g = (-8.0 * torch.rand(t, 64, generator=gen) * torch.rand(64, generator=gen)).to(device)
        h0 = 0.1 * torch.randn(len(lens), 64, 1, 1, generator=gen).to(device)
        inputs = (ones, ones.clone(), v, g, torch.ones(t, 64, device=device))
    else:
        raise ValueError(f"unknown kernel case {name!r}, expected one of {KERNEL_CASES}")
    return inputs, h0, _cu(lens, device), {"scale": 1.0, "delta_rule": False}


def sweep_case(device: Any) -> tuple[tuple, torch.Tensor, Any, dict]:
    """KDA at the GPU check's bench model's linear-attention heads (8 key and value heads of
    128), bf16, chunk 64, in-kernel q/k norm, varlen with a one-token sequence, initial states:
    the calls whose every autotune config ``tests/gpu/autotune_sweep.py`` checks."""
    lens = [100, 64, 1, 200, 37]
    q, k, v, g, beta_logits = delta_rule_inputs(sum(lens), True, h=8, hv=8, d=128, seed=5)
    inputs = (
        *(x.to(device, torch.bfloat16) for x in (q, k, v)),
        g.to(device),
        torch.sigmoid(beta_logits).to(device),
    )
    h0 = 0.1 * torch.randn(len(lens), 8, 128, 128, generator=torch.Generator().manual_seed(6))
    kw = {"use_qk_l2norm": True, "chunk_size": 64}
    return inputs, h0.to(device), _cu(lens, device), kw


def sweep_workload(kernel: Any, device: Any) -> None:
    """One forward + backward of :func:`sweep_case` (its ahead-of-time compile, every config)."""
    inputs, h0, cu, kw = sweep_case(device)
    xs = [x.clone().requires_grad_(True) for x in (*inputs, h0)]
    out = kernel(*xs[:5], cu_seqlens=cu, initial_state=xs[5], **kw)
    (out.o.float().sum() + out.final_state.sum()).backward()


def model_case(
    name: str, device: Any, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.nn.Module, list[list[int]]]:
    """The native hybrid preset ``name`` (KDA, MLA, GDN, GQA, MoE) in ``dtype`` on ``device``,
    with the kernel cases' linear-attention head shapes, and four trajectories sharing
    prefixes."""
    from harts_verl.models import HybridForCausalLM, preset

    torch.manual_seed(0)
    cfg = preset(
        name,
        linear_num_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )
    model = HybridForCausalLM.from_config(cfg).to(device, dtype)
    rng = np.random.default_rng(0)
    base = rng.integers(0, cfg.vocab_size, 300).tolist()
    seqs = [
        base,
        base[:130] + rng.integers(0, cfg.vocab_size, 90).tolist(),
        base[:64] + rng.integers(0, cfg.vocab_size, 150).tolist(),
        [*base[:200], 3, 4, 5],
    ]
    return model, seqs


def model_loss(lps: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([lp.float().sum() for lp in lps]).sum() / 1000


def fla_workload(kernel: Any, device: Any) -> None:
    """Every fla call the GPU tests make, with ``kernel`` as the linear backend on ``device``:
    each kernel case forward + backward in both dtypes, the tree and trajectory-wise layouts of
    the linear tree test (forward), and the model cases' runners in both dtypes (forward,
    backward)."""
    from harts_verl.ops.layout import TreeLayout
    from harts_verl.runtime import ExpandedRunner, TreeRunner

    for name in KERNEL_CASES:
        for dtype in GPU_DTYPES:
            inputs, h0, cu, kw = kernel_case(name, dtype, device)
            xs = [x.clone().requires_grad_(True) for x in (*inputs, h0)]
            out = kernel(*xs[:5], cu_seqlens=cu, initial_state=xs[5], **kw)
            (out.o.float().sum() + out.final_state.sum()).backward()
    forest = gpu_forest(4)
    expanded = RolloutForest.expanded(forest.sequences)
    rows = torch.as_tensor(
        np.concatenate([forest.rows_of(i) for i in range(forest.num_trajectories)]), device=device
    )
    for kda, delta_rule in LINEAR_KINDS:
        x = linear_inputs(forest.num_compact_tokens, kda, torch.bfloat16, device, seed=7)
        TreeLayout(forest, device=device, linear_backend=kernel).linear_attention(
            *x, use_qk_l2norm=True, delta_rule=delta_rule
        )
        TreeLayout(expanded, device=device, linear_backend=kernel).linear_attention(
            *(t.index_select(0, rows) for t in x), use_qk_l2norm=True, delta_rule=delta_rule
        )
    for name in MODEL_CASES:
        for dtype in GPU_DTYPES:
            model, seqs = model_case(name, device, dtype)
            for cls in (TreeRunner, ExpandedRunner):
                runner = cls(model, device=device, linear_backend=kernel, attention_backend="sdpa")
                runner.log_probs(seqs)
                runner.forward_backward(seqs, model_loss, separable=True)
