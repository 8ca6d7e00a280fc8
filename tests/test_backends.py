"""Kernel backends without the fast packages (CPU): selection and errors, the member-splitting
plan rewrite (exact with the reference kernel), fla's argument mapping through a stand-in, the
varlen flash-attention packing through an SDPA test double, and the GPU check script's dry run."""

from __future__ import annotations

import inspect
import logging
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_verl.models import HybridForCausalLM, preset
from harts_verl.ops import backends
from harts_verl.ops.backends import (
    BackendUnavailableError,
    FlaLinearKernel,
    ReferenceLinearKernel,
    SdpaAttentionKernel,
    VarlenAttentionKernel,
    attention_kernel,
    build_varlen_attention_plan,
    kernel_routes,
    linear_kernel,
    sdpa_varlen_reference,
    split_members_at_saved_boundaries,
    tree_attention_varlen,
)
from harts_verl.ops.backends.varlen_attention import load_torch_varlen
from harts_verl.ops.layout import TreeLayout
from harts_verl.ops.linear_attention import chunk_delta_rule_varlen
from harts_verl.ops.tree_attention import attention_key_rows, build_attention_plan, tree_attention
from harts_verl.ops.tree_linear_attention import build_linear_layout, tree_delta_rule
from harts_verl.tree import RolloutForest, plan_linear_calls

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """No fast package importable, no env override, fresh log-once memory, one thread."""
    for mod in ("fla", "fla.ops", "fla.ops.kda", "fla.ops.gated_delta_rule", "flash_attn"):
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.delenv(backends.LINEAR_ENV, raising=False)
    monkeypatch.delenv(backends.ATTENTION_ENV, raising=False)
    monkeypatch.setattr(backends, "_logged", set())
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_torch_varlen(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)


# ------------------------------------------------------------------------------ forests
def _forest(seed: int = 0, chunk: int = 16) -> RolloutForest:
    """A forest whose plan keeps states inside members: a long main path with branches forking
    at and around chunk boundaries, nested branches, a second root; unique tokens per branch."""
    rng = np.random.default_rng(seed)
    nxt = iter(range(10_000, 1_000_000))

    def fresh(n: int) -> list[int]:
        return [next(nxt) for _ in range(n)]

    main = fresh(7 * chunk + 5)
    seqs = [main]
    for f in (chunk - 1, 2 * chunk, 2 * chunk + 3, 3 * chunk + 7, 5 * chunk, 5 * chunk + 1):
        seqs.append(main[:f] + fresh(int(rng.integers(1, 3 * chunk))))
    nested = seqs[3]
    seqs.append(nested[: len(nested) - 2] + fresh(2 * chunk))
    seqs.append(nested[: 2 * chunk + 5] + fresh(chunk + 3))
    seqs.append(fresh(2 * chunk + 1))
    seqs.append(main[: 4 * chunk])  # a prefix trajectory
    return RolloutForest.from_sequences(seqs)


def _linear_inputs(c: int, kda: bool, dtype=torch.float32, seed: int = 0, heads=(2, 4), kd=8):
    gen = torch.Generator().manual_seed(seed)
    h, hv = heads
    q = torch.randn(c, h, kd, generator=gen, dtype=dtype)
    k = torch.randn(c, h, kd, generator=gen, dtype=dtype)
    v = torch.randn(c, hv, 6, generator=gen, dtype=dtype)
    shape = (c, hv, kd) if kda else (c, hv)
    g = -torch.rand(shape, generator=gen, dtype=torch.float32 if dtype != torch.float64 else dtype)
    g = g * 0.3
    beta = torch.rand(c, hv, generator=gen, dtype=g.dtype)
    return q, k, v, g, beta


# ------------------------------------------------------------------------------ registry
def test_fast_packages_absent_in_cpu_runs():
    """fla must not be importable in CPU runs (transformers would route to its Triton kernels)."""
    with pytest.raises(ImportError):
        backends.load_fla_ops()
    from harts_verl.ops.backends.varlen_attention import load_flash_attn_varlen

    with pytest.raises(ImportError, match="flash-attn unavailable"):
        load_flash_attn_varlen()


@pytest.mark.parametrize(
    "version,ok",
    [("2.0.9", False), ("1.0.9", False), ("", False), ("2.1.0", True), ("2.8.3+cu12", True)],
)
def test_flash_attn_before_2_1_is_refused(monkeypatch, version, ok):
    """flash-attn < 2.1 aligns its causal mask top-left (segments with ancestor keys need
    bottom-right): refused by the loader, so an explicit choice fails by name and ``auto`` moves
    on, never a silently wrong attention."""
    from harts_verl.ops.backends.varlen_attention import load_flash_attn_varlen

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
    ):
        raise AssertionError("not called")

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = flash_attn_varlen_func
    if version:
        fake.__version__ = version
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    if ok:
        fn = load_flash_attn_varlen()
        assert not fn.supports_window and not fn.supports_softcap
    else:
        with pytest.raises(ImportError, match=r"before 2\.1 its causal mask is aligned top-left"):
            load_flash_attn_varlen()


def test_auto_on_cpu_is_reference_without_log(caplog):
    caplog.set_level(logging.DEBUG, logger=backends.__name__)
    assert isinstance(linear_kernel("auto", "cpu"), ReferenceLinearKernel)
    assert isinstance(linear_kernel("auto", None), ReferenceLinearKernel)
    assert isinstance(attention_kernel("auto", "cpu"), SdpaAttentionKernel)
    assert not caplog.records
    layout = TreeLayout(_forest())
    assert layout.linear_kernel.name == "reference"
    assert layout.attention_kernel.name == "sdpa"
    assert not layout.linear_kernel.final_states_only


def test_auto_on_cuda_without_packages_falls_back_and_logs_once(caplog, no_torch_varlen):
    caplog.set_level(logging.INFO, logger=backends.__name__)
    for _ in range(3):
        assert linear_kernel("auto", "cuda").name == "reference"
        assert attention_kernel("auto", torch.device("cuda")).name == "sdpa"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, [r.getMessage() for r in caplog.records]
    msgs = " | ".join(r.getMessage() for r in warnings)
    assert "fla unavailable" in msgs and "torch reference" in msgs
    assert "flash-attn unavailable" in msgs and "torch varlen attention unavailable" in msgs


def test_auto_on_cuda_picks_fast_backends_when_importable(monkeypatch):
    monkeypatch.setattr(backends, "load_fla_ops", lambda: (_fake_chunk_kda, _fake_chunk_gdn))
    lk = linear_kernel("auto", "cuda")
    assert isinstance(lk, FlaLinearKernel) and lk.final_states_only and lk.float64_fallback
    monkeypatch.setitem(backends._ATTENTION_LOADERS, "torch_varlen", lambda: sdpa_varlen_reference)
    ak = attention_kernel("auto", "cuda")
    assert isinstance(ak, VarlenAttentionKernel)
    assert ak.name == "torch_varlen" and ak.sdpa_fallback


def test_pre_ampere_gpus_get_sdpa(monkeypatch, caplog):
    """flash-attn 2 and torch's varlen kernel refuse GPUs below compute capability 8.0 at call
    time: ``auto`` takes SDPA there (and says why), an explicit name is unavailable."""
    monkeypatch.setitem(backends._ATTENTION_LOADERS, "torch_varlen", lambda: sdpa_varlen_reference)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "_logged", set())  # log afresh
    for cap, fast in (((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert (attention_kernel("auto", "cuda").name == "torch_varlen") == fast
        if fast:
            assert attention_kernel("torch_varlen", "cuda").name == "torch_varlen"
        else:
            with pytest.raises(BackendUnavailableError, match=r"capability >= 8.0.*got 7\."):
                attention_kernel("torch_varlen", "cuda")
    assert "compute capability >= 8.0 (Ampere), got 7.5" in caplog.text


def test_explicit_unavailable_backend_raises_with_reason(no_torch_varlen):
    with pytest.raises(BackendUnavailableError, match="'fla' is unavailable") as ei:
        linear_kernel("fla", "cuda")
    assert isinstance(ei.value.__cause__, ImportError)
    assert "fla.ops.kda.chunk_kda" in str(ei.value)
    with pytest.raises(BackendUnavailableError, match="needs a CUDA device"):
        linear_kernel("fla", "cpu")
    for name in ("flash_attn", "torch_varlen"):
        with pytest.raises(BackendUnavailableError, match=f"'{name}' is unavailable"):
            attention_kernel(name, "cuda")
        with pytest.raises(BackendUnavailableError, match="needs a CUDA device"):
            attention_kernel(name, "cpu")
    with pytest.raises(ValueError, match="unknown 'flash'"):
        linear_kernel("flash", "cpu")
    with pytest.raises(ValueError, match="unknown 'xformers'"):
        attention_kernel("xformers", "cpu")
    with pytest.raises(TypeError, match="LinearKernel"):
        linear_kernel(42, "cpu")
    # An explicit choice through the layout fails when the op runs (lazily), never silently.
    layout = TreeLayout(_forest(), linear_backend="fla")
    with pytest.raises(BackendUnavailableError):
        layout.linear_plan  # noqa: B018


def test_env_override_is_explicit(monkeypatch):
    monkeypatch.setenv(backends.LINEAR_ENV, "fla")
    with pytest.raises(BackendUnavailableError, match="needs a CUDA device"):
        linear_kernel("auto", "cpu")
    assert linear_kernel("reference", "cpu").name == "reference"  # names beat the env
    monkeypatch.setenv(backends.LINEAR_ENV, "reference")
    monkeypatch.setattr(backends, "load_fla_ops", lambda: (_fake_chunk_kda, _fake_chunk_gdn))
    assert linear_kernel("auto", "cuda").name == "reference"
    monkeypatch.setenv(backends.ATTENTION_ENV, "nope")
    with pytest.raises(ValueError, match=r"from \$HARTS_ATTENTION_BACKEND"):
        attention_kernel("auto", "cpu")
    monkeypatch.delenv(backends.ATTENTION_ENV)
    report = backends.backend_report("cpu")
    assert report["linear_auto"] == "reference" and "fla" in report["packages"]
    assert report["fla_scalar_gate"]["route"] == "native"


def test_autotune_env_applies_when_fla_loads(monkeypatch, caplog):
    """``HARTS_TRITON_AUTOTUNE`` reaches ``limit_autotune`` when fla's kernels load (auto on CUDA
    and the explicit name); an unknown value names the variable; a Triton the hook refuses is
    one WARNING, not an error."""
    from harts_verl.ops.backends import triton_cache

    calls = []
    monkeypatch.setattr(triton_cache, "limit_autotune", calls.append)
    monkeypatch.setattr(backends, "load_fla_ops", lambda: (_fake_chunk_kda, _fake_chunk_gdn))
    monkeypatch.delenv(triton_cache.AUTOTUNE_ENV, raising=False)
    assert linear_kernel("auto", "cuda").name == "fla" and calls == []
    monkeypatch.setenv(triton_cache.AUTOTUNE_ENV, "first")
    linear_kernel("auto", "cuda")
    linear_kernel("fla", "cuda")
    assert calls == ["first", "first"]
    monkeypatch.setenv(triton_cache.AUTOTUNE_ENV, "fastest")
    with pytest.raises(ValueError, match=r"\$HARTS_TRITON_AUTOTUNE: unknown 'fastest'"):
        linear_kernel("auto", "cuda")

    def refuse(mode):
        raise RuntimeError("triton 3.9: the compile helpers hook Triton internals of 3.6 only")

    monkeypatch.setattr(triton_cache, "limit_autotune", refuse)
    monkeypatch.setenv(triton_cache.AUTOTUNE_ENV, "first")
    with caplog.at_level(logging.WARNING):
        assert linear_kernel("auto", "cuda").name == "fla"
    assert any("not applied" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------ plan split
@pytest.mark.parametrize("chunk", [8, 16, 32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_plan_invariants(chunk, seed):
    forest = _forest(seed, chunk)
    plan = plan_linear_calls(forest, chunk_size=chunk)
    arr = plan.arrays
    assert any(ra.needs_chunk_states for ra in arr.rounds), "forest must keep mid-member states"
    sp = split_members_at_saved_boundaries(arr)
    assert sp.num_states == arr.num_states and sp.chunk_size == chunk
    assert int(sp.state_offsets[-1]) == sp.num_states
    out_rows = []
    all_tokens_old = np.concatenate([ra.token_rows for ra in arr.rounds])
    all_tokens_new = np.concatenate([ra.token_rows for ra in sp.rounds])
    assert np.array_equal(np.sort(all_tokens_old), np.sort(all_tokens_new))  # no extra work
    for r, ra in enumerate(sp.rounds):
        assert not ra.needs_chunk_states
        n = ra.cu_seqlens.shape[0] - 1
        lens = np.diff(ra.cu_seqlens)
        assert (lens > 0).all()
        assert (ra.start_positions % chunk == 0).all()
        assert np.array_equal(ra.chunk_offsets, np.concatenate([[0], np.cumsum(-(-lens // chunk))]))
        assert (ra.save_src >= ra.chunk_offsets[-1]).all() and (
            ra.save_src < ra.chunk_offsets[-1] + n
        ).all()
        assert np.array_equal(ra.save_slot, np.arange(sp.state_offsets[r], sp.state_offsets[r + 1]))
        assert (ra.initial_slot < sp.state_offsets[r]).all()
        # Replay only at the head of a member, shorter than a chunk.
        for i in range(n):
            m = ra.output_mask[ra.cu_seqlens[i] : ra.cu_seqlens[i + 1]]
            rep = int((~m).sum())
            assert rep < chunk and m[rep:].all()
        out_rows.append(ra.token_rows[ra.output_mask])
    rows = np.concatenate(out_rows)
    assert np.array_equal(np.sort(rows), np.arange(forest.num_compact_tokens))
    assert len(sp.rounds) >= len(arr.rounds)
    assert split_members_at_saved_boundaries(sp) is sp  # nothing left to cut


@st.composite
def _random_forests(draw):
    """(sequences, chunk): forks of earlier trajectories anywhere (inside chunks, on boundaries,
    nested), prefixes, several roots; unique fresh tokens so only explicit prefixes are shared."""
    chunk = draw(st.sampled_from([4, 8, 16]))
    counter = iter(range(10_000, 10_000_000))
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, 9))):
        if not seqs or draw(st.integers(0, 5)) == 0:
            seqs.append([next(counter) for _ in range(draw(st.integers(1, 6 * chunk)))])
            continue
        base = seqs[draw(st.integers(0, len(seqs) - 1))]
        cut = draw(st.integers(0, len(base)))
        ext = draw(st.integers(0, 4 * chunk))
        seqs.append(base[:cut] + [next(counter) for _ in range(ext)] or [next(counter)])
    return seqs, chunk


@settings(max_examples=40, deadline=None)
@given(_random_forests())
def test_split_plan_exact_on_random_forests(case):
    seqs, chunk = case
    forest = RolloutForest.from_sequences(seqs)
    lay = build_linear_layout(forest, chunk_size=chunk)
    lay_split = build_linear_layout(forest, chunk_size=chunk, final_states_only=True)
    assert not any(rt.needs_chunk_states for rt in lay_split.rounds)
    inputs = _linear_inputs(forest.num_compact_tokens, False, seed=len(seqs), kd=4)
    o = tree_delta_rule(*inputs, lay)
    o_split = tree_delta_rule(*inputs, lay_split)
    assert torch.equal(o, o_split)


def test_split_plan_counts_the_rounds_that_run():
    """A path forked at five chunk boundaries: the plan has 2 rounds, the split layout a
    final-states-only kernel (fla) runs has 6, one kernel call each; ``num_rounds`` (the
    engine's ``harts/rounds``) is what runs (it reported the plan's 2)."""
    from harts_verl.ops.layout import TreeLayout

    calls = []

    class FinalStatesOnly:
        name, final_states_only = "final-states-only", True

        def __call__(self, *a, **kw):
            calls.append(1)
            assert not kw["output_chunk_states"]
            return chunk_delta_rule_varlen(*a, **kw)

    b = 4
    main = list(range(100, 100 + 6 * b))
    forks = (b, 2 * b + 1, 3 * b + 1, 4 * b + 1, 5 * b + 1)
    seqs = [main, *([*main[:f], 1000 + f] for f in forks)]
    forest = RolloutForest.from_sequences(seqs)
    layout = TreeLayout(forest, chunk_size=b, linear_backend=FinalStatesOnly())
    c = forest.num_compact_tokens
    q, k, v = (torch.randn(c, 1, 8, dtype=torch.float64) for _ in range(3))
    g, beta = -torch.rand(c, 1, dtype=torch.float64), torch.rand(c, 1, dtype=torch.float64)
    layout.linear_attention(q, k, v, g, beta)
    assert layout.linear_plan.plan.num_rounds == 2
    assert layout.linear_plan.num_rounds == len(calls) == 6
    assert build_linear_layout(forest, chunk_size=b).num_rounds == 2  # the reference: as planned


def test_split_plan_is_noop_without_mid_member_states():
    forest = RolloutForest.expanded([list(range(50)), list(range(100, 170))])
    arr = plan_linear_calls(forest, chunk_size=16).arrays
    assert split_members_at_saved_boundaries(arr) is arr


@pytest.mark.parametrize("kda", [True, False], ids=["kda", "gdn"])
def test_split_plan_exact_with_reference_kernel(kda):
    """Forward bitwise equal in float32 (and gradients to rounding) when members are cut."""
    chunk = 16
    forest = _forest(3, chunk)
    lay = build_linear_layout(forest, chunk_size=chunk)
    lay_split = build_linear_layout(forest, chunk_size=chunk, final_states_only=True)
    assert any(rt.needs_chunk_states for rt in lay.rounds)
    assert not any(rt.needs_chunk_states for rt in lay_split.rounds)
    inputs = _linear_inputs(forest.num_compact_tokens, kda)
    outs, grads = [], []
    for layout in (lay, lay_split):
        xs = [x.clone().requires_grad_(True) for x in inputs]
        o = tree_delta_rule(*xs, layout, use_qk_l2norm=True)
        (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        outs.append(o.detach())
        grads.append([x.grad for x in xs])
    assert torch.equal(outs[0], outs[1])
    for ga, gb in zip(*grads):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)


def test_split_plan_tree_equals_trajectories_float64():
    chunk = 16
    forest = _forest(4, chunk)
    q, k, v, g, beta = _linear_inputs(forest.num_compact_tokens, True, dtype=torch.float64)
    lay = build_linear_layout(forest, chunk_size=chunk, final_states_only=True)
    o = tree_delta_rule(q, k, v, g, beta, lay)
    for i in range(forest.num_trajectories):
        rows = torch.as_tensor(forest.rows_of(i))
        ref = chunk_delta_rule_varlen(
            q[rows], k[rows], v[rows], g[rows], beta[rows], cu_seqlens=None, chunk_size=chunk
        )
        torch.testing.assert_close(o[rows], ref.o, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------ fla stand-in
_CALLS: list[dict] = []


def _fake_fla(kind: str):
    """A stand-in with fla 0.6's calling conventions, asserting what fla asserts, computing with
    the reference kernel."""

    def fn(
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        cu_seqlens=None,
        **kw,
    ):
        assert q.dim() == 4 and q.shape[0] == 1, "fla varlen needs [1, T, H, K]"
        assert k.shape == q.shape and v.dim() == 4 and beta.dim() == 3
        assert g.dim() == (4 if kind == "kda" else 3)
        assert g.dtype == torch.float32
        assert cu_seqlens is None or cu_seqlens.dtype == torch.int64
        assert initial_state is None or initial_state.dtype == torch.float32
        if cu_seqlens is not None and initial_state is not None:
            assert initial_state.shape[0] == cu_seqlens.numel() - 1
        assert set(kw) <= {"chunk_size", "cu_seqlens_cpu"}
        host = kw.get("cu_seqlens_cpu")  # fla's host copy of the offsets: equal, on the CPU
        if host is not None:
            assert host.device.type == "cpu" and torch.equal(host, cu_seqlens.cpu())
        chunk = kw.get("chunk_size", 64)
        _CALLS.append(
            {"kind": kind, "chunk_size": kw.get("chunk_size"), "scale": scale, "host": host}
        )
        res = chunk_delta_rule_varlen(
            q[0],
            k[0],
            v[0],
            g[0],
            beta[0],
            cu_seqlens=cu_seqlens,
            initial_state=initial_state,
            scale=scale,
            chunk_size=chunk,
            use_qk_l2norm=use_qk_l2norm_in_kernel,
            use_beta_sigmoid=use_beta_sigmoid_in_kernel,
        )
        return res.o.unsqueeze(0).to(q.dtype), (res.final_state if output_final_state else None)

    return fn


_fake_chunk_kda = _fake_fla("kda")
_fake_chunk_gdn = _fake_fla("gdn")


def _fake_kernel(**kw) -> FlaLinearKernel:
    return FlaLinearKernel(_fake_chunk_kda, _fake_chunk_gdn, **kw)


@pytest.mark.parametrize("kda", [True, False], ids=["kda", "gdn"])
@pytest.mark.parametrize("chunk", [32, 64])
def test_fla_wrapper_maps_arguments(kda, chunk):
    _CALLS.clear()
    t_lens = [70, 5, 130]
    q, k, v, g, beta = _linear_inputs(sum(t_lens), kda, seed=5)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(t_lens)]), dtype=torch.int32)
    h0 = torch.randn(3, v.shape[1], q.shape[2], v.shape[2])
    kern = _fake_kernel()
    got = kern(
        q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, chunk_size=chunk, use_qk_l2norm=True
    )
    ref = chunk_delta_rule_varlen(
        q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, chunk_size=chunk, use_qk_l2norm=True
    )
    assert torch.equal(got.o, ref.o) and torch.equal(got.final_state, ref.final_state)
    assert got.chunk_states is None
    assert _CALLS[-1]["kind"] == ("kda" if kda else "gdn")
    assert _CALLS[-1]["chunk_size"] == (None if chunk == 64 else chunk)
    # Raw beta logits with the in-kernel sigmoid, explicit scale, no cu_seqlens.
    kernel_routes(reset=True)
    got = kern(q, k, v, g, beta, cu_seqlens=None, scale=0.3, use_beta_sigmoid=True)
    assert kernel_routes(reset=True) == {"linear/fla": 1}
    ref = chunk_delta_rule_varlen(
        q, k, v, g, beta, cu_seqlens=None, scale=0.3, use_beta_sigmoid=True
    )
    assert torch.equal(got.o, ref.o) and _CALLS[-1]["scale"] == 0.3


def test_fla_wrapper_refusals():
    q, k, v, g, beta = _linear_inputs(40, True)
    kern = _fake_kernel()
    with pytest.raises(NotImplementedError, match="final_states_only"):
        kern(q, k, v, g, beta, cu_seqlens=None, output_chunk_states=True)
    with pytest.raises(ValueError, match="chunk_size must be in"):
        kern(q, k, v, g, beta, cu_seqlens=None, chunk_size=16)
    kernel_routes(reset=True)
    with pytest.raises(ValueError, match="initial_state"):
        kern(q, k, v, g, beta, cu_seqlens=None, initial_state=torch.zeros(2, 4, 8, 6))
    # a state that is not float32 is refused as the reference refuses it (fla up-cast it)
    h0 = torch.zeros(1, v.shape[1], q.shape[2], v.shape[2], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="initial_state must be float32"):
        kern(q, k, v, g, beta, cu_seqlens=None, initial_state=h0)
    assert kernel_routes(reset=True) == {}  # refused calls are not tallied
    x64 = [t.double() for t in (q, k, v, g, beta)]
    with pytest.raises(TypeError, match="float64"):
        kern(*x64, cu_seqlens=None)
    got = _fake_kernel(float64_fallback=True)(*x64, cu_seqlens=None, output_chunk_states=True)
    ref = chunk_delta_rule_varlen(*x64, cu_seqlens=None, output_chunk_states=True)
    assert torch.equal(got.o, ref.o) and got.chunk_states is not None


@pytest.mark.parametrize("kda", [True, False], ids=["kda", "gdn"])
def test_layout_with_fla_standin_equals_reference_bitwise(kda):
    """The whole path a CUDA run takes (split plan + fla argument mapping), on CPU."""
    forest = _forest(1, 32)
    inputs = _linear_inputs(forest.num_compact_tokens, kda, seed=2)
    ref_layout = TreeLayout(forest, chunk_size=32)
    fla_layout = TreeLayout(forest, chunk_size=32, linear_backend=_fake_kernel())
    assert fla_layout.linear_kernel.final_states_only
    assert not any(rt.needs_chunk_states for rt in fla_layout.linear_plan.rounds)
    o_ref = ref_layout.linear_attention(*inputs, use_qk_l2norm=True)
    _CALLS.clear()
    o_fla = fla_layout.linear_attention(*inputs, use_qk_l2norm=True)
    assert torch.equal(o_ref, o_fla)
    # every round hands fla its offsets on the host too (fla read them off the device: one
    # sync per round and layer)
    assert len(_CALLS) == fla_layout.linear_plan.num_rounds > 1
    assert all(c["host"] is not None for c in _CALLS)


# ------------------------------------------------------------------------------ scalar gates
def _fake_gla(kind: str):
    """A stand-in with fla 0.6's ``chunk_gla`` / ``chunk_simple_gla`` conventions (g as a
    keyword, no beta), computing with the reference kernel."""

    def fn(
        q, k, v, *, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None
    ):
        assert q.dim() == 4 and q.shape[0] == 1 and k.shape == q.shape and v.dim() == 4
        assert q.shape[2] == v.shape[2], "GLA takes q/k repeated to the value heads"
        assert g.dim() == (4 if kind == "gla" else 3) and g.dtype == torch.float32
        assert g.is_contiguous()
        _CALLS.append({"kind": kind})
        res = chunk_delta_rule_varlen(
            q[0],
            k[0],
            v[0],
            g[0],
            torch.ones(v.shape[1:3], dtype=g.dtype),
            cu_seqlens=cu_seqlens,
            initial_state=initial_state,
            scale=scale,
            delta_rule=False,
        )
        return res.o.unsqueeze(0).to(q.dtype), (res.final_state if output_final_state else None)

    return fn


def _fake_hopper(monkeypatch, capability=(9, 0), triton_version="3.6.0") -> None:
    """Make ``scalar_gate_route`` see a CUDA device of ``capability`` and a Triton of
    ``triton_version`` (None: Triton not importable)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    fake = None if triton_version is None else types.SimpleNamespace(__version__=triton_version)
    monkeypatch.setitem(sys.modules, "triton", fake)


@pytest.mark.parametrize(
    "capability,version,route",
    [
        ((9, 0), "3.6.0", "channels"),
        ((9, 0), "3.4.0", "channels"),
        ((9, 0), "3.7.0+gitabc", "channels"),
        ((9, 0), "3.7.1", "native"),
        # fla compares with packaging.version: pre-releases sort below their release
        ((9, 0), "3.7.1rc1", "channels"),
        ((9, 0), "3.7.1a0", "channels"),
        ((9, 0), "3.4.0rc1", "native"),
        ((9, 0), "not-a-version", "native"),
        ((9, 0), "3.10.0", "native"),
        ((9, 0), "3.3.1", "native"),
        ((8, 0), "3.6.0", "native"),
        ((10, 0), "3.6.0", "native"),
        ((9, 0), None, "native"),
    ],
)
def test_scalar_gate_route_follows_flas_hopper_guard(monkeypatch, capability, version, route):
    """Scalar-gate calls go through the per-channel kernels exactly where fla 0.6 refuses its
    scalar-gate backward: Hopper (sm_90) with Triton in [3.4.0, 3.7.1)."""
    from harts_verl.ops.backends.fla_linear import SCALAR_GATE_ENV, scalar_gate_route

    monkeypatch.delenv(SCALAR_GATE_ENV, raising=False)
    _fake_hopper(monkeypatch, capability, version)
    got, why = scalar_gate_route("cuda")
    assert got == route, why
    if route == "channels":
        assert "#640" in why and version in why
    assert scalar_gate_route("cpu")[0] == "native"


@pytest.mark.parametrize(
    "version,expected",
    [
        ("3.6.0", (3, 6, 0)),
        ("3.7.0+gitabc", (3, 7, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.14.0a0+git1", (2, 14, 0)),
        ("2.15.0.dev20261201", (2, 15, 0)),
        ("3.10", (3, 10)),
        ("rc1", ()),
    ],
)
def test_release_tuple(version, expected):
    from harts_verl.ops._version import release_tuple

    assert release_tuple(version) == expected


def test_scalar_gate_route_overrides_and_errors(monkeypatch):
    from harts_verl.ops.backends.fla_linear import SCALAR_GATE_ENV, scalar_gate_route

    _fake_hopper(monkeypatch)
    monkeypatch.setenv(SCALAR_GATE_ENV, "native")
    assert scalar_gate_route("cuda") == ("native", f"${SCALAR_GATE_ENV}=native")
    assert scalar_gate_route("cuda", "channels")[0] == "channels"  # explicit beats the env
    monkeypatch.setenv(SCALAR_GATE_ENV, "fast")
    with pytest.raises(ValueError, match=r"\$HARTS_FLA_SCALAR_GATE: unknown 'fast'"):
        scalar_gate_route("cuda")
    with pytest.raises(ValueError, match="scalar_gate: unknown 'x'"):
        scalar_gate_route("cuda", "x")
    with pytest.raises(ValueError, match="scalar_gate: unknown"):
        FlaLinearKernel(_fake_chunk_kda, _fake_chunk_gdn, scalar_gate="x")


@pytest.mark.parametrize("delta_rule", [True, False], ids=["gdn", "ssd"])
def test_scalar_gates_through_channel_kernels(delta_rule):
    """``scalar_gate="channels"``: GatedDeltaNet runs on ``chunk_kda`` and SSD on ``chunk_gla``
    with the gate broadcast over key channels (contiguous), same results as the reference and
    the gate's gradient summed back over the channels; never the scalar-gate kernels."""

    def refuse(*_a, **_k):
        raise AssertionError("a scalar-gate kernel was called")

    kern = FlaLinearKernel(
        _fake_chunk_kda,
        refuse,
        chunk_gla=_fake_gla("gla"),
        chunk_simple_gla=refuse,
        scalar_gate="channels",
    )
    _CALLS.clear()
    lens = [23, 1, 41]
    q, k, v, g, beta = _linear_inputs(sum(lens), False, seed=4)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    h0 = 0.1 * torch.randn(3, v.shape[1], q.shape[2], v.shape[2])
    kw = {"cu_seqlens": cu, "chunk_size": 32, "use_qk_l2norm": True, "delta_rule": delta_rule}
    res = {}
    for name, fn in (("fla", kern), ("ref", chunk_delta_rule_varlen)):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
        out = fn(*xs[:5], initial_state=xs[5], **kw)
        (out.o.sum() + (out.final_state**2).sum()).backward()
        res[name] = [out.o, out.final_state, *(x.grad for x in xs)]
    assert [c["kind"] for c in _CALLS] == ["kda" if delta_rule else "gla"]
    for a, b in zip(res["fla"], res["ref"]):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if delta_rule:  # KDA's chunk sizes: GDN's 16 is refused, naming the route
        with pytest.raises(ValueError, match="GDN runs as KDA here"):
            kern(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16)


def test_scalar_gate_auto_route_on_fake_hopper(monkeypatch, caplog):
    """``auto`` resolves per device and is cached: scalar gates on the CPU reach
    ``chunk_gated_delta_rule``; on a (faked) Hopper with Triton 3.6 the route is the per-channel
    kernels, with one INFO naming the reason."""
    from harts_verl.ops.backends.fla_linear import SCALAR_GATE_ENV

    monkeypatch.delenv(SCALAR_GATE_ENV, raising=False)
    kern = _fake_kernel()
    q, k, v, g, beta = _linear_inputs(30, False, seed=6)
    _CALLS.clear()
    kern(q, k, v, g, beta, cu_seqlens=None)
    assert _CALLS[-1]["kind"] == "gdn"
    _fake_hopper(monkeypatch)
    with caplog.at_level(logging.INFO, logger="harts_verl.ops.backends.fla_linear"):
        assert kern._scalar_route(torch.device("cuda")) == "channels"
        assert kern._scalar_route(torch.device("cuda")) == "channels"
    logs = [r.getMessage() for r in caplog.records if "chunk_kda / chunk_gla" in r.getMessage()]
    assert len(logs) == 1 and "#640" in logs[0]
    assert kern._routes == {"cpu": "native", "cuda": "channels"}
    assert backends.backend_report("cuda")["fla_scalar_gate"]["route"] == "channels"


# ------------------------------------------------------------------------------ varlen attention
def _attn_inputs(c, hq=4, hkv=2, dqk=12, dv=12, dtype=torch.float32, seed=0, gate=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(c, hq, dqk, generator=gen, dtype=dtype)
    k = torch.randn(c, hkv, dqk, generator=gen, dtype=dtype)
    v = torch.randn(c, hkv, dv, generator=gen, dtype=dtype)
    gt = torch.randn(c, hq, dv, generator=gen, dtype=dtype) if gate else None
    return q, k, v, gt


@pytest.mark.parametrize(
    "hq,hkv,dqk,dv,gate",
    [(4, 4, 16, 16, False), (4, 2, 12, 12, True), (2, 2, 24, 16, False), (4, 1, 8, 20, True)],
    ids=["mha", "gqa-gate", "mla-dims", "mqa-dv-wide"],
)
def test_varlen_packing_matches_bucketed_sdpa(hq, hkv, dqk, dv, gate):
    forest = _forest(2, 16)
    c = forest.num_compact_tokens
    plan = build_varlen_attention_plan(forest)
    assert plan.q_index is None and plan.out_index is None  # preorder: queries need no gather
    assert plan.cu_seqlens_q.dtype == torch.int32 and plan.cu_seqlens_k.dtype == torch.int32
    assert int(plan.cu_seqlens_q[-1]) == c and plan.num_segments == len(forest.segments)
    assert plan.work == build_attention_plan(forest).work
    inputs = _attn_inputs(c, hq, hkv, dqk, dv, gate=gate, dtype=torch.float64)
    leaves = [x.clone().requires_grad_(True) if x is not None else None for x in inputs]
    o = tree_attention_varlen(
        *leaves[:3],
        plan,
        varlen_fn=sdpa_varlen_reference,
        scale=0.3,
        gate=leaves[3],
        require_half=False,
    )
    ref_leaves = [x.clone().requires_grad_(True) if x is not None else None for x in inputs]
    ref = tree_attention(
        *ref_leaves[:3], build_attention_plan(forest), scale=0.3, gate=ref_leaves[3]
    )
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-12)
    w = torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(9))
    (o * w).sum().backward()
    (ref * w).sum().backward()
    for a, b in zip(leaves, ref_leaves):
        if a is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11)


def test_varlen_packing_expanded_forest_and_empty():
    forest = RolloutForest.expanded([list(range(30)), list(range(5, 22))])
    plan = build_varlen_attention_plan(forest)
    assert plan.num_segments == 2 and plan.max_seqlen_k == 30
    assert torch.equal(plan.cu_seqlens_q, plan.cu_seqlens_k)  # roots: keys = own rows
    q, k, v, _ = _attn_inputs(forest.num_compact_tokens, dtype=torch.float64)
    o = tree_attention_varlen(q, k, v, plan, varlen_fn=sdpa_varlen_reference, require_half=False)
    torch.testing.assert_close(o, tree_attention(q, k, v, build_attention_plan(forest)))


def test_varlen_kernel_dtype_rules():
    forest = _forest(0, 16)
    q, k, v, _ = _attn_inputs(forest.num_compact_tokens)
    strict = VarlenAttentionKernel("flash_like", sdpa_varlen_reference)
    plan = strict.build_plan(forest)
    with pytest.raises(TypeError, match="float16/bfloat16"):
        strict(q, k, v, plan)
    # with a window it cannot take too: still refused (it used to run SDPA for the window)
    no_window = VarlenAttentionKernel(
        "flash_like", lambda *a, **kw: sdpa_varlen_reference(*a, **kw)
    )
    with pytest.raises(TypeError, match="float16/bfloat16"):
        no_window(q, k, v, no_window.build_plan(forest), window=3)
    auto_like = VarlenAttentionKernel("flash_like", sdpa_varlen_reference, sdpa_fallback=True)
    kernel_routes(reset=True)
    o = auto_like(q, k, v, plan)
    assert kernel_routes(reset=True) == {"attention/sdpa (float32)": 1}  # what ran is counted
    assert "sdpa" in plan.cache
    assert torch.equal(o, tree_attention(q, k, v, build_attention_plan(forest)))
    # bf16 runs the varlen kernel (the SDPA double here).
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    ob = auto_like(qb, kb, vb, plan)
    assert kernel_routes(reset=True) == {"attention/flash_like": 1}
    torch.testing.assert_close(
        ob.float(),
        tree_attention(qb, kb, vb, build_attention_plan(forest)).float(),
        rtol=2e-2,
        atol=2e-2,
    )


def test_varlen_kernel_runs_sliding_windows_on_the_sdpa_path():
    """A sliding-window call never reaches the varlen kernel (it takes no window here): it runs
    the bucketed SDPA path with the window, in every dtype; through a layout too."""

    def never(*_a, **_k):
        raise AssertionError("the varlen kernel ran a sliding-window call")

    forest = _forest(0, 16)
    q, k, v, _ = _attn_inputs(forest.num_compact_tokens, dtype=torch.bfloat16)
    kernel = VarlenAttentionKernel("flash_like", never)
    plan = kernel.build_plan(forest)
    o = kernel(q, k, v, plan, window=4)
    assert torch.equal(o, tree_attention(q, k, v, build_attention_plan(forest), window=4))
    layout = TreeLayout(forest, attention_backend=kernel)
    assert torch.equal(layout.attention(q, k, v, window=4), o)


def test_attention_sinks_through_kernels_and_layout():
    """Attention sinks (gpt-oss): the SDPA kernel passes them on; a varlen kernel has none, so
    with ``sdpa_fallback`` (``auto``) it runs them on the bucketed SDPA path (every dtype) and
    an explicit one raises naming sinks; a layout forwards them (and leaves the keyword out when
    None, so kernels without it still run)."""

    def never(*_a, **_k):
        raise AssertionError("the varlen kernel ran a call with attention sinks")

    forest = _forest(0, 16)
    q, k, v, gate = _attn_inputs(forest.num_compact_tokens, dtype=torch.bfloat16, gate=True)
    sinks = torch.linspace(-1.0, 2.0, 4, dtype=torch.bfloat16)
    ref = tree_attention(q, k, v, build_attention_plan(forest), gate=gate, window=5, sinks=sinks)
    sdpa = SdpaAttentionKernel()
    assert torch.equal(
        sdpa(q, k, v, sdpa.build_plan(forest), gate=gate, window=5, sinks=sinks), ref
    )
    auto_like = VarlenAttentionKernel("flash_like", never, sdpa_fallback=True)
    plan = auto_like.build_plan(forest)
    assert torch.equal(auto_like(q, k, v, plan, gate=gate, window=5, sinks=sinks), ref)
    layout = TreeLayout(forest, attention_backend=auto_like)
    assert torch.equal(layout.attention(q, k, v, gate=gate, window=5, sinks=sinks), ref)
    strict = VarlenAttentionKernel("flash_like", never)
    with pytest.raises(NotImplementedError, match=r"'flash_like'.*sinks"):
        strict(q, k, v, strict.build_plan(forest), sinks=sinks)
    assert "sinks" in inspect.signature(backends.AttentionKernel.__call__).parameters

    class NoSinks:  # a kernel object written before sinks existed
        name = "no_sinks"

        def build_plan(self, forest, *, device=None):
            return build_attention_plan(forest, device=device)

        def __call__(self, q, k, v, plan, *, scale=None, gate=None):
            return tree_attention(q, k, v, plan, scale=scale, gate=gate)

    plain = TreeLayout(forest, attention_backend=NoSinks()).attention(q, k, v, gate=gate)
    assert torch.equal(plain, tree_attention(q, k, v, build_attention_plan(forest), gate=gate))


def test_layout_with_varlen_standin_and_model_forward():
    """A tiny hybrid model (KDA, MLA, GDN, GQA) through a layout with both stand-ins equals the
    default (reference) layout: linear layers bitwise, attention to rounding."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    model = HybridForCausalLM.from_config(cfg)
    rng = np.random.default_rng(0)
    base = rng.integers(0, cfg.vocab_size, 150).tolist()
    seqs = [base, base[:40] + rng.integers(0, cfg.vocab_size, 60).tolist(), [*base[:97], 1, 2, 3]]
    forest = RolloutForest.from_sequences(seqs)
    varlen = VarlenAttentionKernel("sdpa_varlen", sdpa_varlen_reference, require_half=False)
    lay_ref = TreeLayout(forest, chunk_size=cfg.chunk_size)
    lay_fast = TreeLayout(
        forest, chunk_size=cfg.chunk_size, linear_backend=_fake_kernel(), attention_backend=varlen
    )
    with torch.no_grad():
        h_ref, _ = model(lay_ref.token_ids, lay_ref)
        h_fast, _ = model(lay_fast.token_ids, lay_fast)
    torch.testing.assert_close(h_fast, h_ref, rtol=1e-5, atol=1e-5)


def _fake_varlen_module(monkeypatch, *, new_api: bool) -> list[dict]:
    calls: list[dict] = []
    if new_api:

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                        enable_gqa=False):  # fmt: skip
            calls.append({"window_size": window_size, "enable_gqa": enable_gqa})
            assert enable_gqa or k.shape[1] == q.shape[1]
            return sdpa_varlen_reference(
                q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                window_size=window_size,
            )  # fmt: skip
    else:

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
            calls.append({"is_causal": is_causal})
            assert k.shape[1] == q.shape[1], "old API: no GQA"
            return sdpa_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal=is_causal)

    mod = types.ModuleType("torch.nn.attention.varlen")
    mod.varlen_attn = varlen_attn
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", mod)
    return calls


@pytest.mark.parametrize("new_api", [True, False], ids=["window_size", "is_causal"])
def test_torch_varlen_adapter(monkeypatch, new_api):
    calls = _fake_varlen_module(monkeypatch, new_api=new_api)
    fn = load_torch_varlen()
    forest = _forest(5, 16)
    q, k, v, _ = _attn_inputs(forest.num_compact_tokens, 4, 2, dtype=torch.float64)
    plan = build_varlen_attention_plan(forest)
    o = tree_attention_varlen(q, k, v, plan, varlen_fn=fn, scale=0.2, require_half=False)
    ref = tree_attention(q, k, v, build_attention_plan(forest), scale=0.2)
    torch.testing.assert_close(o, ref)
    if new_api:
        assert calls[-1] == {"window_size": (-1, 0), "enable_gqa": True}
    else:
        assert calls[-1] == {"is_causal": True}


@pytest.mark.parametrize("new_api", [True, False], ids=["window_size", "is_causal"])
def test_torch_varlen_adapter_windows(monkeypatch, new_api):
    """Newer torch takes sliding windows as ``window_size=(w - 1, 0)``; the older API has none:
    the adapter says so (``supports_window``) and the kernel then routes windows to SDPA."""
    calls = _fake_varlen_module(monkeypatch, new_api=new_api)
    fn = load_torch_varlen()
    assert fn.supports_window is new_api
    forest = _forest(5, 16)
    q, k, v, _ = _attn_inputs(forest.num_compact_tokens, 4, 2, dtype=torch.float64)
    ref = tree_attention(q, k, v, build_attention_plan(forest), scale=0.2, window=5)
    kernel = VarlenAttentionKernel("torch_varlen", fn, require_half=False)
    o = kernel(q, k, v, kernel.build_plan(forest), scale=0.2, window=5)
    torch.testing.assert_close(o, ref)
    if new_api:
        assert calls and calls[-1] == {"window_size": (4, 0), "enable_gqa": True}
    else:
        assert not calls
        plan = build_varlen_attention_plan(forest)
        with pytest.raises(NotImplementedError, match="no window"):
            tree_attention_varlen(q, k, v, plan, varlen_fn=fn, require_half=False, window=5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), window=st.sampled_from([1, 2, 5, 9, 64]))
def test_varlen_window_matches_bucketed_sdpa(seed, window):
    """Sliding windows through the varlen packing (bottom-right ``window_size=(w - 1, 0)``)
    equal the bucketed SDPA path's band: outputs and q/k/v gradients, float64."""
    forest = _forest(seed % 7, 16)
    xs = [
        x.requires_grad_()
        for x in _attn_inputs(forest.num_compact_tokens, 4, 2, dtype=torch.float64)[:3]
    ]
    plan = build_varlen_attention_plan(forest)
    o = tree_attention_varlen(
        *xs, plan, varlen_fn=sdpa_varlen_reference, scale=0.3, require_half=False, window=window
    )
    ref = tree_attention(*xs, build_attention_plan(forest), scale=0.3, window=window)
    assert float((o - ref).detach().abs().max()) <= 1e-12
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ga = torch.autograd.grad((o * w).sum(), xs)
    gb = torch.autograd.grad((ref * w).sum(), xs)
    for a, b in zip(ga, gb):
        assert float((a - b).abs().max()) <= 1e-10


def test_real_torch_varlen_signature_is_supported():
    """The installed torch's varlen_attn (if any) takes the keywords the adapter uses."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        pytest.skip("this torch has no varlen_attn")
    params = inspect.signature(varlen_attn).parameters
    assert "scale" in params and ("window_size" in params or "is_causal" in params)


# ------------------------------------------------------------------------------ script
def test_gpu_check_script_syntax_and_dry_run(tmp_path):
    assert SCRIPT.exists()
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    res = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "pip install" in out and "--no-index" in out
    assert "pytest tests/gpu" in out
    assert "bench" in out and "--device cuda" in out and "bench.json" in out
    # the generator's own workload (358K / 2.7M tokens), not the bench's CPU-capped default
    assert out.count("--generator-defaults --scale") == 2
    # two sizes, smallest first, each with its own JSON; the summary lists both
    assert out.index("--scale 0.02 ") < out.index("--scale 0.05 ")
    assert "bench_0.02.json" in out and "bench_0.05.json" in out
    assert "0.02:0 0.05:0" in out and "summary.json" in out
    assert "timeout" in out
    assert not (tmp_path / "out" / "bench.json").exists()
    # fla's kernels compiled ahead (tests: first config, bench model: every config), before
    # the tests, which run the first autotune config
    assert out.index("tests/gpu/precompile_cases.py --target current --autotune first") < out.index(
        "pytest tests/gpu"
    )
    assert out.index("precompile --preset gpu_check --dtype bfloat16") < out.index("pytest tests")
    assert "HARTS_TRITON_AUTOTUNE=first HARTS_GPU_REPORT=" in out
    # at most 8 files come back from $OUT: the script writes 7 there
    written = set(re.findall(re.escape(str(tmp_path / "out")) + r"/([\w.-]+)", out))
    assert written == {
        "env.json",
        "precompile.log",
        "gpu_report.json",
        "gpu_tests.txt",
        "bench.log",
        "bench.json",
        "summary.json",
    }, written


def test_gpu_check_script_leaves_a_partial_summary_when_stopped(tmp_path):
    """summary.json is written after every step: a run the device machine's time limit cuts
    off still brings back what its finished steps measured ("complete": false; it was written
    only at the very end)."""
    import json
    import signal
    import time

    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "PRECOMPILE": "0",
        "HARTS_REQUIRE_FAST": "0",
        "BENCH_DEVICE": "cpu",
        "BENCH_PRESET": "tiny",
        "BENCH_SCALES": "0.001",
        "WHEELS_DIR": str(tmp_path / "no_wheels"),
    }
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "summary.json").exists():  # the first step's partial summary
            assert proc.poll() is None and time.monotonic() < deadline, "no partial summary"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as a time limit would
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summary = json.loads((out / "summary.json").read_text())
    assert rc != 0 and summary["complete"] is False and summary["ok"] is False
    assert summary["steps"][0]["step"] == "env" and summary["env"].get("python")
    # statuses and seconds are numbers (a reader's `rc == 0` was False on the string "0")
    assert summary["steps"][0]["rc"] == 0 and isinstance(summary["steps"][0]["seconds"], int)
    assert not (out / "summary.json.tmp").exists()


def test_gpu_tests_have_no_init_and_skip_without_cuda():
    gpu = REPO / "tests" / "gpu"
    assert (gpu / "conftest.py").exists()
    assert not list((REPO / "tests").rglob("__init__.py"))
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU tests run for real")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", str(gpu), "-rs"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    progress = res.stdout.splitlines()[0]
    assert set(progress.split()[0]) == {"s"}, res.stdout  # every GPU test skipped
    assert "needs a CUDA device" in res.stdout


def test_same_device_treats_cuda_and_cuda0_alike(monkeypatch):
    from harts_verl.ops.tree_attention import same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    d = torch.device
    assert same_device(d("cpu"), d("cpu"))
    assert same_device(d("cuda"), d("cuda", 0)) and same_device(d("cuda", 0), d("cuda"))
    assert not same_device(d("cuda"), d("cuda", 1))
    assert not same_device(d("cuda", 0), d("cpu"))


def test_fla_wrapper_without_gla_kernels(no_fla, caplog):
    """``delta_rule=False`` (Mamba-2 SSD) on an fla build without ``chunk_simple_gla``: the
    ``auto`` kernel (``float64_fallback``) runs the torch reference with one WARNING, an
    explicit ``fla`` kernel raises the ImportError naming the missing functions."""
    q, k, v, g, beta = _linear_inputs(40, False, seed=3)
    cu = torch.tensor([0, 17, 40])
    with caplog.at_level("WARNING"):
        got = _fake_kernel(float64_fallback=True)(q, k, v, g, beta, cu_seqlens=cu, delta_rule=False)
    ref = chunk_delta_rule_varlen(q, k, v, g, beta, cu_seqlens=cu, delta_rule=False)
    assert torch.equal(got.o, ref.o) and torch.equal(got.final_state, ref.final_state)
    assert any("chunk_simple_gla" in r.getMessage() for r in caplog.records)
    with pytest.raises(ImportError, match="chunk_simple_gla"):
        _fake_kernel()(q, k, v, g, beta, cu_seqlens=cu, delta_rule=False)


# ------------------------------------------------------------------------------ key-row bound
def _saved_numel(fn) -> tuple[torch.Tensor, int]:
    """``fn()``'s output and the elements autograd saved for its backward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _grads_of(fn, inputs, w):
    leaves = [x.clone().requires_grad_(True) if x is not None else None for x in inputs]
    o, saved = _saved_numel(lambda: fn(leaves))
    (o * w).sum().backward()
    return o, [x.grad for x in leaves if x is not None], saved


@pytest.mark.parametrize("bound", [1, 40, 333])
@pytest.mark.parametrize(
    "kw", [{}, {"window": 9}, {"softcap": 2.0}], ids=["plain", "window", "softcap"]
)
def test_varlen_key_row_bound_same_numbers_less_saved(bound, kw):
    """With ``max_key_rows`` below the plan's key rows the varlen path runs key groups, keeps
    no gathered keys / values for backward and gives the same outputs (bitwise: each sequence
    is computed alone either way) and gradients (float64, summation order only)."""
    forest = _forest(3, 16)
    c = forest.num_compact_tokens
    plan = build_varlen_attention_plan(forest)
    assert plan.num_key_rows > 2 * c  # the forest shares long paths
    assert attention_key_rows(forest) == plan.num_key_rows
    assert attention_key_rows(RolloutForest.expanded([list(range(9)), [1, 2]])) == 11
    groups = plan.key_groups(bound)
    seq = np.diff(plan.cu_seqlens_host[1])
    assert sum(g.q1 - g.q0 for g in groups) == c and groups[0].q0 == 0 and groups[-1].q1 == c
    assert all(int(g.key_index.shape[0]) <= max(bound, int(seq.max())) for g in groups)
    assert torch.equal(torch.cat([g.key_index for g in groups]), plan.key_index)
    inputs = _attn_inputs(c, 4, 2, 12, 12, gate=True, dtype=torch.float64)
    w = torch.randn(c, 4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def run(max_key_rows):
        def fn(x):
            return tree_attention_varlen(
                *x[:3],
                plan,
                varlen_fn=sdpa_varlen_reference,
                scale=0.3,
                gate=x[3],
                require_half=False,
                max_key_rows=max_key_rows,
                **kw,
            )

        return _grads_of(fn, inputs, w)

    o0, g0, saved0 = run(None)
    o1, g1, saved1 = run(bound)
    assert torch.equal(o0, o1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13)
    kv_rows = plan.num_key_rows * 2 * 12  # gathered keys and values, [*, 2 heads, 12]
    assert saved0 >= kv_rows and saved1 < saved0 - kv_rows // 2
    # an unbinding bound is the plain call
    o2, g2, saved2 = run(plan.num_key_rows)
    assert torch.equal(o2, o0) and saved2 == saved0
    assert all(torch.equal(a, b) for a, b in zip(g0, g2))


def test_varlen_key_row_bound_backward_keeps_one_group_alive():
    """In backward, each key group's gathered keys (and its graph) are released before the
    next group's are gathered: at most one group's keys alive at a time (the previous group's
    stayed alive through its output's graph, doubling the transient bound)."""
    import weakref

    forest = _forest(4, 16)
    c = forest.num_compact_tokens
    plan = build_varlen_attention_plan(forest)
    bound = 64
    assert len(plan.key_groups(bound)) > 4
    keys: list = []
    alive_at_call: list[int] = []

    def spy(q, k, v, *args, **kwargs):
        alive_at_call.append(sum(r() is not None for r in keys))
        keys.append(weakref.ref(k))
        return sdpa_varlen_reference(q, k, v, *args, **kwargs)

    xs = [
        x.requires_grad_(True)
        for x in _attn_inputs(c, 4, 2, 16, 16, dtype=torch.float64, seed=3)[:3]
    ]
    o = tree_attention_varlen(*xs, plan, varlen_fn=spy, require_half=False, max_key_rows=bound)
    n_fwd = len(alive_at_call)
    o.square().sum().backward()
    assert n_fwd == len(plan.key_groups(bound)) and len(alive_at_call) == 2 * n_fwd
    assert max(alive_at_call) == 0, alive_at_call


def test_varlen_key_row_bound_replays_autocast_in_backward():
    """The grouped path reruns each group's forward in backward under the forward's autocast
    state (as activation checkpointing does): with float32 inputs under bfloat16 autocast its
    gradients equal the plain call's (they were those of a float32 rerun, 4e-3 apart)."""
    forest = _forest(3, 16)
    c = forest.num_compact_tokens
    plan = build_varlen_attention_plan(forest)
    inputs = _attn_inputs(c, 4, 2, 16, 16, dtype=torch.float32, seed=2)[:3]
    w = torch.linspace(-1, 1, 16)
    res = []
    for bound in (None, 16):
        xs = [x.clone().requires_grad_(True) for x in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o = tree_attention_varlen(
                *xs,
                plan,
                varlen_fn=sdpa_varlen_reference,
                require_half=False,
                max_key_rows=bound,
            )
        assert o.dtype == torch.bfloat16
        (o.float() * w).sum().backward()
        res.append([o.detach()] + [x.grad for x in xs])
    for a, b in zip(*res):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sinks", [False, True])
def test_sdpa_key_row_bound_checkpoints_buckets(sinks):
    """The bucketed SDPA path with a key-row bound below the plan's runs each bucket under
    activation checkpointing: same outputs and gradients (sinks too), less saved; without
    autograd it is the plain call."""
    forest = _forest(4, 16)
    c = forest.num_compact_tokens
    plan = build_attention_plan(forest)
    assert len(plan.buckets) > 1
    inputs = list(_attn_inputs(c, 4, 2, 16, 16, gate=True, dtype=torch.float64))
    gen = torch.Generator().manual_seed(5)
    inputs.append(torch.randn(4, dtype=torch.float64, generator=gen) if sinks else None)
    w = torch.randn(c, 4, 16, dtype=torch.float64, generator=gen)

    def run(max_key_rows):
        def fn(x):
            return tree_attention(
                *x[:3], plan, gate=x[3], sinks=x[4], max_key_rows=max_key_rows, scale=0.25
            )

        return _grads_of(fn, inputs, w)

    o0, g0, saved0 = run(None)
    o1, g1, saved1 = run(16)
    assert torch.equal(o0, o1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13)
    assert saved1 < saved0 // 2
    with torch.no_grad():
        assert torch.equal(
            tree_attention(
                *inputs[:3], plan, gate=inputs[3], sinks=inputs[4], max_key_rows=16, scale=0.25
            ),
            o0,
        )


@pytest.mark.parametrize("pad", [0.25, float("inf")], ids=["uniform", "padded"])
@pytest.mark.parametrize(
    "kw",
    [{}, {"window": 4}, {"sinks": True}, {"softcap": 2.0}],
    ids=["plain", "window", "sinks", "softcap"],
)
def test_sdpa_key_row_bound_splits_a_bucket(pad, kw, monkeypatch):
    """A GRPO-like group puts all its responses in one bucket (``nb·Lk`` key rows far above
    the bound); under the bound every SDPA call, forward or backward rerun, gathers at most
    the bound's key rows, with the same outputs and gradients."""
    rng = np.random.default_rng(7)
    prompt = list(range(1000, 1020))
    lens = [6] * 12 if pad == 0.25 else rng.integers(3, 9, size=12).tolist()
    nxt = iter(range(2000, 9000))
    forest = RolloutForest.from_sequences([prompt + [next(nxt) for _ in range(n)] for n in lens])
    c = forest.num_compact_tokens
    plan = build_attention_plan(forest, max_pad_ratio=pad)
    big = max(plan.buckets, key=lambda b: b.nb * b.lk)
    assert big.nb == 12 and big.nb * big.lk > 200
    sinks = kw.get("sinks", False)
    kw = {k: v for k, v in kw.items() if k != "sinks"}
    inputs = list(_attn_inputs(c, 4, 2, 16, 16, gate=True, dtype=torch.float64))
    gen = torch.Generator().manual_seed(5)
    inputs.append(torch.randn(4, dtype=torch.float64, generator=gen) if sinks else None)
    w = torch.randn(c, 4, 16, dtype=torch.float64, generator=gen)
    gathered: list[int] = []
    module = sys.modules[tree_attention.__module__]
    sdpa, soft = module.F.scaled_dot_product_attention, module._softcapped_attention

    def spy_sdpa(q, k, v, **kws):
        gathered.append(k.shape[0] * k.shape[2])
        return sdpa(q, k, v, **kws)

    def spy_soft(q, k, v, *args):
        gathered.append(k.shape[0] * k.shape[2])
        return soft(q, k, v, *args)

    def run(max_key_rows):
        def fn(x):
            return tree_attention(
                *x[:3], plan, gate=x[3], sinks=x[4], max_key_rows=max_key_rows, **kw
            )

        gathered.clear()
        with monkeypatch.context() as m:
            m.setattr(module.F, "scaled_dot_product_attention", spy_sdpa)
            m.setattr(module, "_softcapped_attention", spy_soft)
            out = _grads_of(fn, inputs, w)
        return (*out, list(gathered))

    o0, g0, saved0, calls0 = run(None)
    o1, g1, saved1, calls1 = run(60)
    assert max(calls0) > 200 and len(calls1) > 2 * len(calls0)  # forward + backward reruns
    assert max(calls1) <= 60
    assert torch.equal(o0, o1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13)
    assert saved1 < saved0


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_key_row_bound_refuses_bad_values(bad):
    forest = _forest(0, 16)
    q, k, v, _ = _attn_inputs(forest.num_compact_tokens, dtype=torch.float64)
    z = torch.zeros(0, 2, 8, dtype=torch.float64)
    # an empty call too (it returned before looking at the bound)
    for f, xs in ((forest, (q, k, v)), (RolloutForest.from_sequences([]), (z, z, z))):
        with pytest.raises(ValueError, match="max_key_rows"):
            tree_attention(*xs, build_attention_plan(f), max_key_rows=bad)
        with pytest.raises(ValueError, match="max_key_rows"):
            tree_attention_varlen(
                *xs,
                build_varlen_attention_plan(f),
                varlen_fn=sdpa_varlen_reference,
                require_half=False,
                max_key_rows=bad,
            )
    with pytest.raises(ValueError, match="attention_key_rows"):
        TreeLayout(forest, attention_key_rows=bad)


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_layout_key_row_bound_model_gradients(backend):
    """A tiny hybrid model (KDA, MLA, GDN, GQA) in float64 through layouts with and without a
    key-row bound: the same hidden states and parameter gradients."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    model = HybridForCausalLM.from_config(cfg).double()
    rng = np.random.default_rng(0)
    base = rng.integers(0, cfg.vocab_size, 150).tolist()
    seqs = [base, base[:40] + rng.integers(0, cfg.vocab_size, 60).tolist(), [*base[:97], 1, 2, 3]]
    forest = RolloutForest.from_sequences(seqs)
    att = (
        "sdpa"
        if backend == "sdpa"
        else VarlenAttentionKernel("sdpa_varlen", sdpa_varlen_reference, require_half=False)
    )
    results = []
    for bound in (None, 30):
        lay = TreeLayout(
            forest, chunk_size=cfg.chunk_size, attention_backend=att, attention_key_rows=bound
        )
        model.zero_grad()
        h, _ = model(lay.token_ids, lay)
        (h * torch.linspace(-1, 1, h.shape[-1], dtype=h.dtype)).sum().backward()
        results.append(
            (
                h.detach(),
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
        )
    (h0, g0), (h1, g1) = results
    torch.testing.assert_close(h1, h0, rtol=1e-12, atol=1e-12)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-10, atol=1e-12, msg=n)
