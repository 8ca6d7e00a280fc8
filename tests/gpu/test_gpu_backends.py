"""Fast backends on CUDA: each vs its torch reference, and tree vs trajectory-wise runs.

Tolerances: float32 tight; bfloat16 within fla's own test tolerances (error ratio
``rmse(x - ref) / rmse(ref)`` ≤ 5e-3..8e-3 forward, ≤ 2e-2 gradients). Tree vs trajectory-wise:
bitwise where the same kernel configurations run, else mean cosine ≥ 0.9999 (each comparison
records which in the session report). ``HARTS_REQUIRE_FAST=1`` turns a missing fast package into
a failure instead of a skip (``scripts/gpu_check.sh`` sets it).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _delta_rule_cases import err_ratio, per_trajectory
from _gpu_cases import (
    LINEAR_IDS,
    LINEAR_KINDS,
    dtype_id,
    gpu_forest,
    kernel_case,
    linear_inputs,
    model_case,
    model_loss,
)

from harts_verl.ops import backends
from harts_verl.ops.layout import TreeLayout
from harts_verl.ops.linear_attention import chunk_delta_rule_varlen
from harts_verl.ops.logprobs import mean_logit_cosine
from harts_verl.ops.tree_attention import build_attention_plan, tree_attention
from harts_verl.tree import RolloutForest

REQUIRE_FAST = os.environ.get("HARTS_REQUIRE_FAST", "") == "1"
COS_MIN = 0.9999


# ------------------------------------------------------------------------------ helpers
def _need(kind: str, name: str, device: torch.device):
    """The explicit backend ``name``, or skip (fail under HARTS_REQUIRE_FAST) if unavailable."""
    try:
        if kind == "linear":
            return backends.linear_kernel(name, device)
        return backends.attention_kernel(name, device)
    except backends.BackendUnavailableError as exc:
        if REQUIRE_FAST:
            pytest.fail(f"required fast backend missing: {exc}")
        pytest.skip(str(exc))


def mean_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().double().reshape(a.shape[0], -1)
    b = b.detach().double().reshape(b.shape[0], -1)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())


# ------------------------------------------------------------------------------ selection
def test_auto_selects_fast_backends_on_cuda(cuda, report):
    rep = backends.backend_report(cuda)
    report["backends"] = rep
    if REQUIRE_FAST:
        assert rep["linear_auto"] == "fla", rep
        assert rep["attention_auto"] in ("flash_attn", "torch_varlen"), rep
    layout = TreeLayout(gpu_forest(), device=cuda)
    assert layout.linear_kernel.name == rep["linear_auto"]
    assert layout.attention_kernel.name == rep["attention_auto"]


# ------------------------------------------------------------------------------ fla vs reference
# Kernel cases (tests/_gpu_cases.py): KDA, GatedDeltaNet, Mamba-2's SSD (fla's chunk_simple_gla;
# on Hopper with Triton < 3.7.1, GDN and SSD run as chunk_kda / chunk_gla: see scalar_gate_route).


def _assert_fla_matches_reference(kern, inputs, h0, cu, dtype, report, key, **kw) -> None:
    """fla (``kern``) vs the torch reference on ``inputs`` (q, k, v, g, beta) with initial
    states ``h0`` and a gradient into the final state: error ratios of outputs, final states and
    every gradient recorded under ``report[key]``, within fla's own tolerances for ``dtype``."""
    res = {}
    for name, fn in (("fla", kern), ("ref", chunk_delta_rule_varlen)):
        xs = [x.clone().requires_grad_(True) for x in (*inputs, h0)]
        out = fn(*xs[:5], cu_seqlens=cu, initial_state=xs[5], **kw)
        gen = torch.Generator(device=cu.device).manual_seed(0)
        do = torch.randn(out.o.shape, device=cu.device, generator=gen)
        dht = torch.randn(out.final_state.shape, device=cu.device, generator=gen)
        ((out.o.float() * do).sum() + (out.final_state * dht).sum()).backward()
        res[name] = (out.o.float(), out.final_state, [x.grad.float() for x in xs])
    tol_fwd, tol_bwd = (2e-3, 5e-3) if dtype == torch.float32 else (8e-3, 2e-2)
    errs = {
        "o": err_ratio(res["fla"][0], res["ref"][0]),
        "final_state": err_ratio(res["fla"][1], res["ref"][1]),
    }
    for gname, ga, gb in zip(
        ("dq", "dk", "dv", "dg", "dbeta", "dh0"), res["fla"][2], res["ref"][2]
    ):
        errs[gname] = err_ratio(ga, gb)
    report[key] = errs
    assert res["fla"][1].dtype == torch.float32
    assert res["fla"][1].shape == res["ref"][1].shape
    assert errs["o"] <= tol_fwd and errs["final_state"] <= tol_fwd, errs
    assert all(v <= tol_bwd for k_, v in errs.items() if k_.startswith("d")), errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", LINEAR_IDS)
def test_fla_vs_reference(cuda, report, kind, dtype):
    """KDA, GatedDeltaNet and SSD (2 key heads, 4 value heads of 64, in-kernel q/k norm, chunk
    64, varlen with a one-token sequence, initial states) vs the torch reference."""
    kern = _need("linear", "fla", cuda)
    inputs, h0, cu, kw = kernel_case(kind, dtype, cuda)
    key = f"fla_vs_ref_{kind}_{dtype_id(dtype)}"
    _assert_fla_matches_reference(kern, inputs, h0, cu, dtype, report, key, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_gla_one_channel_value_heads(cuda, report, dtype):
    """Mamba-1's selective scan (Jamba) through fla's ``chunk_gla``: one q/k head (C, B of 16
    state entries) shared by 64 value heads of one channel each (zero-padded to fla's value
    tile), a per-channel decay, write scale dt; vs the torch reference."""
    kern = _need("linear", "fla", cuda)
    inputs, h0, cu, kw = kernel_case("mamba1", dtype, cuda)
    key = f"fla_vs_ref_mamba1_{dtype_id(dtype)}"
    _assert_fla_matches_reference(kern, inputs, h0, cu, dtype, report, key, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_simple_gla_one_entry_heads(cuda, report, dtype):
    """RecurrentGemma's RG-LRU through fla's ``chunk_simple_gla`` (``chunk_gla`` with the gate
    broadcast where the scalar-gate kernels are refused): 64 heads of one channel with a one-entry
    state (q = k = 1; keys and values zero-padded to fla's tiles), a scalar decay per head and
    token, write scale 1; vs the torch reference."""
    kern = _need("linear", "fla", cuda)
    inputs, h0, cu, kw = kernel_case("rglru", dtype, cuda)
    key = f"fla_vs_ref_rglru_{dtype_id(dtype)}"
    _assert_fla_matches_reference(kern, inputs, h0, cu, dtype, report, key, **kw)


# ------------------------------------------------------------------------------ attention
def _varlen_kernel(name: str, cuda):
    """The named varlen attention kernel, or skip (``torch_varlen`` must exist with
    ``REQUIRE_FAST``; flash-attn is optional: torch_varlen covers the same packing)."""
    try:
        return backends.attention_kernel(name, cuda)
    except backends.BackendUnavailableError as exc:
        if name == "torch_varlen" and REQUIRE_FAST:
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def _varlen_vs_sdpa(kern, cuda, forest, base: list[torch.Tensor], scale: float, **kw) -> dict:
    """Error ratios of ``kern`` (bf16) against bucketed SDPA tree attention in float32 (and SDPA
    in bf16 for scale): outputs and q/k/v gradients of one random output weighting; ``kw``
    goes to both (e.g. ``window``). ``base``: CPU q, k, v ``[C, H, D]`` of ``forest``'s rows."""
    res = {}
    for tag, dtype, fn, plan in (
        ("fast", torch.bfloat16, kern, kern.build_plan(forest, device=cuda)),
        ("sdpa_bf16", torch.bfloat16, tree_attention, build_attention_plan(forest, device=cuda)),
        ("sdpa_fp32", torch.float32, tree_attention, build_attention_plan(forest, device=cuda)),
    ):
        xs = [x.detach().to(cuda, dtype).requires_grad_(True) for x in base]
        o = fn(*xs, plan, scale=scale, **kw)
        w = torch.randn(o.shape, generator=torch.Generator(device=cuda).manual_seed(1), device=cuda)
        (o.float() * w).sum().backward()
        res[tag] = (o.float(), [x.grad.float() for x in xs])
    errs = {
        "o_vs_fp32": err_ratio(res["fast"][0], res["sdpa_fp32"][0]),
        "o_vs_sdpa_bf16": err_ratio(res["fast"][0], res["sdpa_bf16"][0]),
        "sdpa_bf16_vs_fp32": err_ratio(res["sdpa_bf16"][0], res["sdpa_fp32"][0]),
    }
    for gname, ga, gb in zip(("dq", "dk", "dv"), res["fast"][1], res["sdpa_fp32"][1]):
        errs[gname] = err_ratio(ga, gb)
        errs[f"{gname}_max_abs"] = float(ga.abs().max())
    return errs


def _assert_varlen_close(errs: dict, window: int | None = None) -> None:
    assert errs["o_vs_fp32"] <= max(1e-2, 2 * errs["sdpa_bf16_vs_fp32"]), errs
    if window == 1:
        # each query sees only its own key: softmax is exactly 1, dq = dk = 0 analytically, so
        # both sides' dq / dk are rounding noise (a ratio of noise to noise is ~1): bound them
        # against dv instead
        assert errs["dv"] <= 2e-2, errs
        assert max(errs["dq_max_abs"], errs["dk_max_abs"]) <= 1e-2 * errs["dv_max_abs"], errs
        return
    assert all(errs[g] <= 2e-2 for g in ("dq", "dk", "dv")), errs


@pytest.mark.parametrize("name", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize(
    "hq,hkv,dqk,dv",
    [(4, 4, 64, 64), (8, 2, 64, 64), (4, 4, 96, 64), (8, 8, 192, 128)],
    ids=["mha", "gqa", "mla", "mla_bench"],  # mla_bench: the gpu_check model's MLA dims
)
def test_varlen_attention_vs_sdpa(cuda, report, name, hq, hkv, dqk, dv):
    kern = _varlen_kernel(name, cuda)
    forest = gpu_forest(2)
    c = forest.num_compact_tokens
    gen = torch.Generator(device="cpu").manual_seed(3)
    base = [torch.randn(c, h, d, generator=gen) for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv))]
    errs = _varlen_vs_sdpa(kern, cuda, forest, base, dqk**-0.5)
    report[f"attn_{name}_{hq}x{hkv}_{dqk}_{dv}"] = errs
    _assert_varlen_close(errs)


@pytest.mark.parametrize("name", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("window", [1, 7, 40])
def test_varlen_attention_sliding_window(cuda, report, name, window):
    """Sliding windows through the varlen kernel (``window_size=(w - 1, 0)``, bottom-right)
    vs the bucketed SDPA band in float32; GQA 8/2, head dim 64, bf16."""
    kern = _varlen_kernel(name, cuda)
    forest = gpu_forest(3)
    c = forest.num_compact_tokens
    gen = torch.Generator(device="cpu").manual_seed(4)
    base = [torch.randn(c, h, 64, generator=gen) for h in (8, 2, 2)]
    errs = _varlen_vs_sdpa(kern, cuda, forest, base, 0.125, window=window)
    errs["supports_window"] = bool(getattr(kern.varlen_fn, "supports_window", False))
    report[f"attn_window_{name}_{window}"] = errs
    _assert_varlen_close(errs, window)


@pytest.mark.parametrize("name", ["flash_attn", "torch_varlen"])
def test_varlen_attention_key_row_bound(cuda, report, name):
    """A key-row bound far below the plan's (grouped sequences, keys gathered again in
    backward) against the plain call of the same kernel, bf16, GQA 8/2, head dim 64: outputs
    and q/k/v gradients within bf16 rounding of each other (bitwise recorded); peak memory of
    each recorded."""
    kern = _varlen_kernel(name, cuda)
    forest = gpu_forest(2)
    c = forest.num_compact_tokens
    plan = kern.build_plan(forest, device=cuda)
    bound = max(64, plan.max_seqlen_k // 2)
    assert plan.num_key_rows > 4 * bound
    gen = torch.Generator(device="cpu").manual_seed(7)
    base = [torch.randn(c, h, 64, generator=gen) for h in (8, 2, 2)]
    res = {}
    for tag, kw in (("plain", {}), ("bound", {"max_key_rows": bound})):
        xs = [x.to(cuda, torch.bfloat16).requires_grad_(True) for x in base]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(cuda)
        start = torch.cuda.memory_allocated(cuda)
        o = kern(*xs, plan, scale=0.125, **kw)
        w = torch.randn(o.shape, generator=torch.Generator(device=cuda).manual_seed(1), device=cuda)
        (o.float() * w).sum().backward()
        torch.cuda.synchronize()
        res[tag] = (
            o.float(),
            [x.grad.float() for x in xs],
            torch.cuda.max_memory_allocated(cuda) - start,
        )
    errs = {"o": err_ratio(res["bound"][0], res["plain"][0])}
    errs["o_bitwise"] = bool(torch.equal(res["bound"][0], res["plain"][0]))
    for gname, ga, gb in zip(("dq", "dk", "dv"), res["bound"][1], res["plain"][1]):
        errs[gname] = err_ratio(ga, gb)
    errs.update(
        bound=bound,
        key_rows=plan.num_key_rows,
        peak_bytes_plain=res["plain"][2],
        peak_bytes_bound=res["bound"][2],
    )
    report[f"attn_key_row_bound_{name}"] = errs
    assert errs["o"] <= 1e-3 and all(errs[g] <= 1e-2 for g in ("dq", "dk", "dv")), errs


KEY_ROW_COST_SCALE = 0.05  # tau_like: 107,608 compact rows, 1,242,103 key rows (11.5 x)


@pytest.mark.parametrize("name", ["flash_attn", "torch_varlen"])
def test_varlen_attention_key_row_bound_cost(cuda, report, name):
    """What the key-row bound costs on a tau-like step (forward + backward of one attention
    layer, bf16, GQA 8/2, head dim 64; median of 3 after a warm-up): recorded, not asserted
    (speed is the benchmark's job); outputs within bf16 rounding of the plain call."""
    import time

    from harts_verl.tree import workloads

    kern = _varlen_kernel(name, cuda)
    w = workloads.tau_like(scale=KEY_ROW_COST_SCALE, seed=0)
    forest = RolloutForest.from_sequences(w.sequences, group_ids=w.group_ids)
    c = forest.num_compact_tokens
    plan = kern.build_plan(forest, device=cuda)
    bound = max(plan.num_key_rows // 10, plan.max_seqlen_k)
    gen = torch.Generator(device="cpu").manual_seed(11)
    base = [torch.randn(c, h, 64, generator=gen).to(cuda, torch.bfloat16) for h in (8, 2, 2)]
    rec: dict = {"rows": c, "key_rows": plan.num_key_rows, "bound": bound}
    rec["groups"] = len(plan.key_groups(bound))
    outs = {}
    for tag, kw in (("plain", {}), ("bound", {"max_key_rows": bound})):
        times = []
        for it in range(4):
            xs = [x.detach().requires_grad_(True) for x in base]
            torch.cuda.synchronize()
            if it == 1:
                torch.cuda.reset_peak_memory_stats(cuda)
                start = torch.cuda.memory_allocated(cuda)
            t0 = time.perf_counter()
            o = kern(*xs, plan, scale=0.125, **kw)
            o.float().square().mean().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rec[f"ms_{tag}"] = round(1e3 * float(np.median(times[1:])), 3)
        rec[f"peak_bytes_{tag}"] = torch.cuda.max_memory_allocated(cuda) - start
        outs[tag] = o.detach().float()
    rec["time_ratio"] = round(rec["ms_bound"] / max(rec["ms_plain"], 1e-9), 3)
    rec["o_err"] = err_ratio(outs["bound"], outs["plain"])
    report[f"attn_key_row_cost_{name}"] = rec
    assert rec["o_err"] <= 1e-3, rec


# ------------------------------------------------------------------------------ tree vs trajectories
@pytest.mark.parametrize("name", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("window", [None, 7])
def test_varlen_attention_softcap(cuda, report, name, window):
    """Gemma 2's attention logit soft-cap (50, and a small 2 that bends most scores) through
    the varlen kernel where it takes ``softcap`` (flash-attn >= 2.6), else (the kernel chosen
    by name refuses it, naming the ``auto`` backend) the bucketed explicit-score path that
    backend routes it to, vs the float32 bucketed path; bf16."""
    kern = _varlen_kernel(name, cuda)
    forest = gpu_forest(4)
    c = forest.num_compact_tokens
    gen = torch.Generator(device="cpu").manual_seed(5)
    base = [torch.randn(c, h, 64, generator=gen) for h in (8, 2, 2)]
    if not getattr(kern.varlen_fn, "supports_softcap", False):
        q, k, v = (x.to(cuda, torch.bfloat16) for x in base)
        with pytest.raises(NotImplementedError, match="'auto'"):
            kern(q, k, v, kern.build_plan(forest, device=cuda), scale=0.125, softcap=50.0)
        kern = backends.VarlenAttentionKernel(kern.name, kern.varlen_fn, sdpa_fallback=True)
    for cap in (50.0, 2.0):
        kw = {"softcap": cap} if window is None else {"softcap": cap, "window": window}
        errs = _varlen_vs_sdpa(kern, cuda, forest, base, 0.125, **kw)
        errs["supports_softcap"] = bool(getattr(kern.varlen_fn, "supports_softcap", False))
        report[f"attn_softcap_{name}_{cap}_{window}"] = errs
        _assert_varlen_close(errs)


def _compare(report, key, tree_sem: torch.Tensor, exp_sem: torch.Tensor) -> None:
    bitwise = bool(torch.equal(tree_sem, exp_sem))
    cos = mean_cos(tree_sem, exp_sem)
    report[key] = {
        "bitwise": bitwise,
        "mean_cos": cos,
        "max_abs": float((tree_sem.double() - exp_sem.double()).abs().max()),
    }
    assert bitwise or cos >= COS_MIN, report[key]


@pytest.mark.parametrize(("kda", "delta_rule"), LINEAR_KINDS, ids=LINEAR_IDS)
def test_tree_vs_trajectories_linear(cuda, report, kda, delta_rule):
    _need("linear", "fla", cuda)
    forest = gpu_forest(4)
    seqs = forest.sequences
    expanded = RolloutForest.expanded(seqs)
    tree_l = TreeLayout(forest, device=cuda, linear_backend="fla")
    exp_l = TreeLayout(expanded, device=cuda, linear_backend="fla")
    assert len(tree_l.linear_plan.rounds) > 1
    x = linear_inputs(forest.num_compact_tokens, kda, torch.bfloat16, cuda, seed=7)
    sem_rows = torch.as_tensor(
        np.concatenate([forest.rows_of(i) for i in range(forest.num_trajectories)]), device=cuda
    )
    xe = [t.index_select(0, sem_rows) for t in x]  # expanded rows = semantic order
    o_tree = tree_l.linear_attention(*x, use_qk_l2norm=True, delta_rule=delta_rule)
    o_exp = exp_l.linear_attention(*xe, use_qk_l2norm=True, delta_rule=delta_rule)
    _compare(
        report,
        f"tree_vs_traj_linear_{LINEAR_IDS[LINEAR_KINDS.index((kda, delta_rule))]}",
        per_trajectory(forest, o_tree),
        per_trajectory(expanded, o_exp),
    )


def test_tree_vs_trajectories_attention(cuda, report):
    kern = backends.attention_kernel("auto", cuda)
    if kern.name == "sdpa" and REQUIRE_FAST:
        pytest.fail("no varlen flash kernel on CUDA")
    forest = gpu_forest(5)
    expanded = RolloutForest.expanded(forest.sequences)
    gen = torch.Generator(device="cpu").manual_seed(4)
    c = forest.num_compact_tokens
    q, k, v = (torch.randn(c, h, 64, generator=gen).to(cuda, torch.bfloat16) for h in (8, 2, 2))
    sem_rows = torch.as_tensor(
        np.concatenate([forest.rows_of(i) for i in range(forest.num_trajectories)]), device=cuda
    )
    o_tree = TreeLayout(forest, device=cuda).attention(q, k, v)
    o_exp = TreeLayout(expanded, device=cuda).attention(
        *(t.index_select(0, sem_rows) for t in (q, k, v))
    )
    _compare(
        report,
        f"tree_vs_traj_attention_{kern.name}",
        per_trajectory(forest, o_tree),
        per_trajectory(expanded, o_exp),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["tiny", "kimi_tiny", "ling_tiny"])
def test_model_tree_vs_expanded(cuda, report, name, dtype):
    """The native hybrid model (KDA, MLA, GDN, GQA, MoE; Kimi-Linear's and Ling 3's
    architectures) with the auto backends: tree vs trajectory-wise log-probs and logits, plus
    one backward each (linear-attention head shapes as in the kernel cases). fp32: MeanCos ≥
    0.9999. bf16: MeanCos ≥ 0.9999, or, where bf16's own rounding is that large (two bf16 runs
    that are not bitwise equal differ by about twice a run's distance to float32; kimi_tiny:
    1 − 0.99988 per run on the CPU), the tree run no further from float32 (the same weights,
    torch reference kernels) than twice the trajectory-wise run."""
    from harts_verl.runtime import ExpandedRunner, TreeRunner

    model, seqs = model_case(name, cuda, dtype)
    tree, exp = TreeRunner(model, device=cuda), ExpandedRunner(model, device=cuda)
    lp_t, lp_e = tree.log_probs(seqs), exp.log_probs(seqs)
    dlogp = max(float((a.double() - b.double()).abs().max()) for a, b in zip(lp_t, lp_e))
    w = model.lm_head.weight

    def logit_cos(hs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
        # the bench's MeanCos: over semantic positions, full-vocabulary logits in float64
        return mean_logit_cosine(hs, refs, w)

    h_t, h_e = tree.hidden_states(seqs), exp.hidden_states(seqs)
    cos = logit_cos(h_t, h_e)
    tag = "fp32" if dtype == torch.float32 else "bf16"
    key = f"model_tree_vs_expanded_{tag}" + ("" if name == "tiny" else f"_{name}")
    report[key] = {"max_abs_dlogp": dlogp, "mean_logit_cos": cos}
    if dtype == torch.bfloat16:
        fp32 = ExpandedRunner(
            copy.deepcopy(model).float(),
            device=cuda,
            linear_backend="reference",
            attention_backend="sdpa",
        ).hidden_states(seqs)
        report[key]["tree_vs_fp32_cos"] = logit_cos(h_t, fp32)
        report[key]["expanded_vs_fp32_cos"] = logit_cos(h_e, fp32)
    tree.forward_backward(seqs, model_loss, separable=True)
    exp.forward_backward(seqs, model_loss, separable=True)
    if dtype == torch.float32 or cos >= COS_MIN:
        assert cos >= COS_MIN, report[key]
    else:
        d_tree = 1 - report[key]["tree_vs_fp32_cos"]
        d_exp = 1 - report[key]["expanded_vs_fp32_cos"]
        assert d_tree <= 2 * d_exp + 1e-6, report[key]


@pytest.mark.parametrize("window", [None, 7])
def test_attention_sinks_bf16(cuda, report, window):
    """gpt-oss attention sinks on CUDA (the sink key on an extra head-dim coordinate, padded to a
    multiple of 8 for the fused kernels) through the auto backend in bf16 vs the float32 dense
    reference: outputs and gradients (q, k, v, sinks) within the bf16 tolerances above."""
    from harts_verl.ops.tree_attention import tree_attention_dense_ref

    forest = gpu_forest(6)
    c = forest.num_compact_tokens
    gen = torch.Generator(device="cpu").manual_seed(8)
    base = [torch.randn(c, h, 64, generator=gen) for h in (8, 2, 2)]
    base.append(torch.randn(8, generator=gen))  # sinks
    kw = {} if window is None else {"window": window}
    res = {}
    for tag, dtype in (("fast", torch.bfloat16), ("ref", torch.float32)):
        xs = [
            x.to(cuda, dtype if x.ndim == 3 else torch.float32).clone().requires_grad_(True)
            for x in base
        ]
        if tag == "fast":
            o = TreeLayout(forest, device=cuda).attention(*xs[:3], scale=0.125, sinks=xs[3], **kw)
        else:
            o = tree_attention_dense_ref(*xs[:3], forest, scale=0.125, sinks=xs[3], **kw)
        w = torch.randn(o.shape, generator=torch.Generator(device=cuda).manual_seed(1), device=cuda)
        (o.float() * w).sum().backward()
        res[tag] = (o.float(), [x.grad.float() for x in xs])
    errs = {"o": err_ratio(res["fast"][0], res["ref"][0])}
    for gname, ga, gb in zip(("dq", "dk", "dv", "dsinks"), res["fast"][1], res["ref"][1]):
        errs[gname] = err_ratio(ga, gb)
    report[f"attn_sinks_window_{window}"] = errs
    assert errs["o"] <= 8e-3, errs
    assert all(errs[g] <= 2e-2 for g in ("dq", "dk", "dv", "dsinks")), errs


def test_every_autotune_config_of_kda_matches_reference(cuda, report):
    """fla's KDA forward + backward at the bench model's heads under every admissible autotune
    config of every Triton kernel it reaches, one kernel at a time, vs the float32 reference
    (``tests/gpu/autotune_sweep.py``, in a process of its own: a config that faults would
    poison this one's CUDA context)."""
    _need("linear", "fla", cuda)
    script = Path(__file__).with_name("autotune_sweep.py")
    # 80 s of configs (a cold compile cache leaves some unrun: reported, not failed), 40 s for
    # the process around them.
    res = subprocess.run(
        [sys.executable, str(script), "--budget-s", "80"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.stdout.strip(), res.stderr[-3000:]
    got = json.loads(res.stdout[res.stdout.index("{") :])
    report["autotune_sweep"] = got
    assert got["runs"] > 0, got
    assert not got["baseline_bad"], got["baseline"]
    assert not got["bad"], got["bad"][:10]
    assert res.returncode == 0, res.stderr[-3000:]
