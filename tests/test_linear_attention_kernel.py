"""Chunkwise delta-rule reference kernels (KDA / GDN) against the token-by-token oracle.

Pins: float64 exactness and gradients (chunk vs recurrent), bitwise float32 batch invariance
(packing, chunk-boundary state handoff, mid-chunk stop), chunk-start states, gates, bf16.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_verl.ops.linear_attention import (
    chunk_delta_rule_varlen,
    gdn_gate,
    kda_gate,
    l2norm,
    recurrent_delta_rule_ref,
)

F64 = torch.float64
F32 = torch.float32


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add overhead (and spin on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cu(lengths: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int64)


def _inputs(
    lengths: list[int],
    *,
    kda: bool,
    H: int = 2,
    group: int = 2,
    K: int = 8,
    V: int = 6,
    dtype: torch.dtype = F64,
    seed: int = 0,
    with_h0: bool = True,
    decay: float = 1.0,
) -> dict[str, torch.Tensor | None]:
    """Random inputs: gates from the real gate formulas (so g <= 0), l2-normalised keys,
    beta in (0, 1), optional random initial states (float32, float64 for float64 inputs)."""
    gen = torch.Generator().manual_seed(seed)
    T, HV = sum(lengths), H * group

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    A_log = rnd(HV) * 0.5 + math.log(decay)
    if kda:
        g = kda_gate(rnd(T, HV, K), A_log, dt_bias=rnd(HV * K))
    else:
        g = gdn_gate(rnd(T, HV), A_log, rnd(HV))
    state_dtype = F64 if dtype == F64 else F32
    h0 = rnd(len(lengths), HV, K, V).to(state_dtype) if with_h0 else None
    return {
        "q": rnd(T, H, K).to(dtype),
        "k": l2norm(rnd(T, H, K)).to(dtype),
        "v": rnd(T, HV, V).to(dtype),
        "g": g.to(dtype if dtype == F64 else F32),
        "beta": torch.sigmoid(rnd(T, HV)).to(dtype),
        "initial_state": h0,
        "cu_seqlens": _cu(lengths),
    }


def _rows(x: dict, start: int, stop: int) -> dict:
    """Token slice [start, stop) as one member with no initial state."""
    out = {n: x[n][start:stop] for n in ("q", "k", "v", "g", "beta")}
    out["cu_seqlens"] = _cu([stop - start])
    out["initial_state"] = None
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------------------------
# Gates and l2norm
# --------------------------------------------------------------------------------------------


def test_kda_gate_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    T, HV, K = 5, 3, 4
    g_raw = torch.randn(T, HV, K, generator=gen, dtype=F64) * 5
    A_log = torch.randn(HV, generator=gen, dtype=F64)
    dt_bias = torch.randn(HV * K, generator=gen, dtype=F64)
    x = g_raw + dt_bias.view(HV, K)
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    expect = -A_log.exp()[:, None] * softplus
    got = kda_gate(g_raw, A_log, dt_bias)
    assert got.dtype == F64
    torch.testing.assert_close(got, expect, rtol=1e-14, atol=1e-14)
    assert (got <= 0).all()
    # no A_log -> unit scale; no bias
    torch.testing.assert_close(kda_gate(g_raw, None), -F.softplus(g_raw), rtol=0, atol=0)
    # fla's lower-bound (safe) gate: lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
    lb = kda_gate(g_raw, A_log, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(lb, -5.0 / (1 + torch.exp(-A_log.exp()[:, None] * x)))
    assert ((lb > -5.0) & (lb < 0)).all()
    # low-precision input -> float32 gate
    assert kda_gate(g_raw.bfloat16(), A_log.float(), dt_bias.float()).dtype == F32


def test_gdn_gate_formula() -> None:
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(7, 4, generator=gen, dtype=F64) * 4
    A_log = torch.randn(4, generator=gen, dtype=F64)
    dt_bias = torch.randn(4, generator=gen, dtype=F64)
    expect = -A_log.exp() * torch.log1p(torch.exp(a + dt_bias))
    torch.testing.assert_close(gdn_gate(a, A_log, dt_bias), expect, rtol=1e-14, atol=1e-14)
    assert gdn_gate(a.bfloat16(), A_log.float(), None).dtype == F32


def test_l2norm_formula() -> None:
    x = torch.randn(5, 3, 8, dtype=F64)
    expect = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(l2norm(x), expect, rtol=0, atol=0)
    assert l2norm(x.bfloat16()).dtype == torch.bfloat16


def test_kda_with_equal_channels_equals_gdn() -> None:
    x = _inputs([70, 45], kda=False, seed=3)
    K = x["q"].shape[-1]
    o_gdn, s_gdn, _ = chunk_delta_rule_varlen(**x, chunk_size=32)
    x_kda = dict(x, g=x["g"][..., None].expand(-1, -1, K).contiguous())
    o_kda, s_kda, _ = chunk_delta_rule_varlen(**x_kda, chunk_size=32)
    torch.testing.assert_close(o_kda, o_gdn, rtol=0, atol=1e-12)
    torch.testing.assert_close(s_kda, s_gdn, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# float64 exactness against the recurrent oracle
# --------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 130), min_size=1, max_size=4).filter(lambda ls: sum(ls) > 0),
    chunk_size=st.sampled_from([16, 32, 48, 64]),
    kda=st.booleans(),
    group=st.sampled_from([1, 2]),
    with_h0=st.booleans(),
    use_qk_l2norm=st.booleans(),
    use_beta_sigmoid=st.booleans(),
    delta_rule=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunk_matches_recurrent_float64(
    lengths: list[int],
    chunk_size: int,
    kda: bool,
    group: int,
    with_h0: bool,
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
    delta_rule: bool,
    seed: int,
) -> None:
    """Chunkwise == token-by-token (outputs, final and chunk-start states), for the delta rule
    and for gated linear attention without it (Mamba-2 SSD, ``delta_rule=False``)."""
    x = _inputs(lengths, kda=kda, group=group, seed=seed, with_h0=with_h0)
    flags = {
        "use_qk_l2norm": use_qk_l2norm,
        "use_beta_sigmoid": use_beta_sigmoid,
        "delta_rule": delta_rule,
    }
    _assert_chunk_matches_recurrent(x, flags, lengths, chunk_size, with_h0)


# Small states that run as a scan of the state (K * V <= 16; no delta rule): RecurrentGemma's
# RG-LRU (K = V = 1, scalar decay), Jamba's Mamba-1 scan (K = d_state, V = 1, per-entry decay),
# and the edges of the rule.
_SCAN_SHAPES = [
    (False, 1, 1, 1),
    (False, 3, 1, 1),
    (False, 2, 1, 3),
    (True, 1, 16, 1),
    (True, 2, 4, 4),
    (False, 1, 2, 8),
]


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
@pytest.mark.parametrize(("kda", "group", "K", "V"), _SCAN_SHAPES)
@pytest.mark.parametrize("with_h0", [False, True])
def test_small_state_scan_matches_recurrent_float64(
    chunk_size: int, kda: bool, group: int, K: int, V: int, with_h0: bool
) -> None:
    """No delta rule and at most 16 state entries a head: a within-chunk scan of the state
    instead of [C, C] scores; chunkwise == token-by-token, outputs, final and chunk-start
    states; strong decays included (cumulative log decays in the hundreds)."""
    lengths = [75, 0, 40, 64, 1, 130]
    x = _inputs(lengths, kda=kda, H=2, group=group, K=K, V=V, seed=3, with_h0=with_h0)
    ramp = torch.linspace(0.01, 30.0, x["g"].shape[0], dtype=F64)
    x["g"] = x["g"] * (ramp[:, None, None] if kda else ramp[:, None])
    for flags in ({"delta_rule": False}, {"delta_rule": False, "use_beta_sigmoid": True}):
        _assert_chunk_matches_recurrent(x, flags, lengths, chunk_size, with_h0)


@pytest.mark.parametrize(("kda", "group", "K", "V"), _SCAN_SHAPES)
def test_small_state_scan_gradients_match_recurrent_float64(
    kda: bool, group: int, K: int, V: int
) -> None:
    """Autograd gradients of the scan path (q, k, v, g, beta, h0) equal the recurrent
    oracle's, with in-kernel q/k L2 norm and beta sigmoid in the graph."""
    x = _inputs([75, 0, 40, 64], kda=kda, H=2, group=group, K=K, V=V, seed=11, decay=30.0)
    _assert_gradients_match_recurrent(x, chunk_size=16, delta_rule=False)


def _assert_chunk_matches_recurrent(
    x: dict, flags: dict, lengths: list[int], chunk_size: int, with_h0: bool
) -> None:
    """The chunk kernel on ``x`` equals the recurrent oracle to 1e-10 (float64): outputs, final
    states, and every chunk-start state (the oracle's final state of the member prefix)."""
    o, final, cs = chunk_delta_rule_varlen(
        **x, **flags, chunk_size=chunk_size, output_chunk_states=True
    )
    o_ref, final_ref = recurrent_delta_rule_ref(**x, **flags)
    assert o.dtype == F64 and final.dtype == F64
    assert (o - o_ref).abs().max().item() <= 1e-10
    assert (final - final_ref).abs().max().item() <= 1e-10

    # chunk-start states == recurrent final states of the member prefixes [start, start + c*C)
    assert cs is not None
    offsets = cs.chunk_offsets.tolist()
    starts = x["cu_seqlens"][:-1].tolist()
    pieces, prefix_lengths, members, where = [], [], [], []
    for n, L in enumerate(lengths):
        n_chunks = -(-L // chunk_size)
        assert offsets[n + 1] - offsets[n] == n_chunks
        for c in range(n_chunks):
            pieces.append(torch.arange(starts[n], starts[n] + c * chunk_size))
            prefix_lengths.append(c * chunk_size)
            members.append(n)
            where.append(offsets[n] + c)
    assert cs.states.shape[0] == offsets[-1] == len(where)
    idx = torch.cat(pieces)
    prefix = {name: x[name][idx] for name in ("q", "k", "v", "g", "beta")}
    h0 = x["initial_state"][members] if with_h0 else None
    _, prefix_states = recurrent_delta_rule_ref(
        **prefix, **flags, cu_seqlens=_cu(prefix_lengths), initial_state=h0
    )
    assert (cs.states[where] - prefix_states).abs().max().item() <= 1e-10


@pytest.mark.parametrize(
    ("kda", "chunk_size", "decay", "delta_rule"),
    [
        (True, 16, 1.0, True),
        (True, 64, 1.0, True),
        (True, 24, 1.0, True),
        (False, 32, 1.0, True),
        (True, 32, 30.0, True),
        (False, 64, 30.0, True),
        (False, 32, 1.0, False),
        (True, 16, 30.0, False),
    ],
)
def test_gradients_match_recurrent_float64(
    kda: bool, chunk_size: int, decay: float, delta_rule: bool
) -> None:
    """Autograd grads of the chunk kernel equal the recurrent oracle's (q, k, v, g, beta, h0);
    decay=30 makes in-chunk cumulative log decays reach the hundreds (overflow hazard);
    ``delta_rule=False``: gated linear attention (Mamba-2 SSD)."""
    x = _inputs([75, 0, 40, 64], kda=kda, seed=11, decay=decay)
    _assert_gradients_match_recurrent(x, chunk_size=chunk_size, delta_rule=delta_rule)


def _assert_gradients_match_recurrent(x: dict, *, chunk_size: int, delta_rule: bool) -> None:
    """Gradients (q, k, v, g, beta, h0) of a random linear functional of the chunk kernel's
    outputs and final states equal the recurrent oracle's (1e-9 relative, all finite), with
    in-kernel q/k L2 norm and beta sigmoid (``x["beta"]`` is replaced by its logit)."""
    x = dict(x, beta=torch.logit(x["beta"]))  # exercise use_beta_sigmoid in the graph
    names = ("q", "k", "v", "g", "beta", "initial_state")
    gen = torch.Generator().manual_seed(5)
    w_o = torch.randn(x["v"].shape, generator=gen, dtype=F64)
    w_s = torch.randn(x["initial_state"].shape, generator=gen, dtype=F64)

    def grads(fn: Callable[..., tuple]) -> list[torch.Tensor]:
        leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
        flags = dict(use_qk_l2norm=True, use_beta_sigmoid=True, delta_rule=delta_rule)
        out = fn(**leaves, cu_seqlens=x["cu_seqlens"], **flags)
        ((out[0] * w_o).sum() + (out[1] * w_s).sum()).backward()
        return [leaves[n].grad for n in names]

    g_chunk = grads(lambda **kw: chunk_delta_rule_varlen(**kw, chunk_size=chunk_size))
    g_ref = grads(recurrent_delta_rule_ref)
    for name, a, b in zip(names, g_chunk, g_ref, strict=True):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) <= 1e-9, (name, _rel(a, b))


def test_gradcheck_tiny() -> None:
    x = _inputs([7, 5], kda=True, H=1, group=2, K=3, V=2, seed=4)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kw = dict(zip(names, args, strict=True))
        o, s, _ = chunk_delta_rule_varlen(**kw, cu_seqlens=x["cu_seqlens"], chunk_size=4)
        return o, s

    args = tuple(x[n].detach().clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(fn, args, fast_mode=True)


def test_handoff_carries_gradient_to_prefix() -> None:
    """Split at a chunk boundary, the second member's initial_state is the first's final
    state: gradients w.r.t. the prefix tokens equal those of the straight run."""
    C, L = 32, 100
    x = _inputs([L], kda=True, seed=6, with_h0=False)
    names = ("q", "k", "v", "g", "beta")

    def run(split: bool) -> list[torch.Tensor]:
        leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
        if split:
            a = {n: leaves[n][:C] for n in names}
            b = {n: leaves[n][C:] for n in names}
            o1, s1, _ = chunk_delta_rule_varlen(**a, cu_seqlens=_cu([C]), chunk_size=C)
            o2, s2, _ = chunk_delta_rule_varlen(
                **b, cu_seqlens=_cu([L - C]), initial_state=s1, chunk_size=C
            )
            o, s = torch.cat([o1, o2]), s2
        else:
            o, s, _ = chunk_delta_rule_varlen(**leaves, cu_seqlens=_cu([L]), chunk_size=C)
        (o.square().sum() + s.sum()).backward()
        return [leaves[n].grad for n in names]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Bitwise float32 batch invariance
# --------------------------------------------------------------------------------------------

_NAMES = ("q", "k", "v", "g", "beta")


def _pack(parts: list[dict]) -> dict:
    """Pack single-member inputs (with their initial states) into one varlen call."""
    out = {n: torch.cat([p[n] for p in parts]) for n in _NAMES}
    out["cu_seqlens"] = _cu([p["q"].shape[0] for p in parts])
    h0 = [p["initial_state"] for p in parts]
    out["initial_state"] = torch.cat(h0) if all(h is not None for h in h0) else None
    return out


@settings(max_examples=15, deadline=None)
@given(
    before=st.lists(st.integers(0, 90), max_size=2),
    after=st.lists(st.integers(0, 90), max_size=2),
    length=st.integers(1, 150),
    chunk_size=st.sampled_from([16, 32, 64]),
    kda=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bitwise_packed_equals_alone(
    before: list[int], after: list[int], length: int, chunk_size: int, kda: bool, seed: int
) -> None:
    lengths = [*before, length, *after]
    x = _inputs(lengths, kda=kda, K=16, V=16, dtype=F32, seed=seed)
    i = len(before)
    start, stop = x["cu_seqlens"][i].item(), x["cu_seqlens"][i + 1].item()
    alone = _rows(x, start, stop)
    alone["initial_state"] = x["initial_state"][i : i + 1]
    o, s, cs = chunk_delta_rule_varlen(**x, chunk_size=chunk_size, output_chunk_states=True)
    o1, s1, cs1 = chunk_delta_rule_varlen(**alone, chunk_size=chunk_size, output_chunk_states=True)
    assert torch.equal(o[start:stop], o1)
    assert torch.equal(s[i], s1[0])
    assert cs is not None and cs1 is not None
    lo, hi = cs.chunk_offsets[i].item(), cs.chunk_offsets[i + 1].item()
    assert torch.equal(cs.states[lo:hi], cs1.states)


@pytest.mark.parametrize("kda", [True, False])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_bitwise_chunk_handoff(kda: bool, chunk_size: int) -> None:
    """Straight run == first chunk(s), then the rest from their final state (bitwise), also
    when the second part is packed with unrelated members."""
    C, L = chunk_size, 4 * chunk_size + 27
    x = _inputs([L, 50, 93], kda=kda, K=16, V=16, dtype=F32, seed=7)
    whole = _rows(x, 0, L)
    whole["initial_state"] = x["initial_state"][:1]
    o, s, cs = chunk_delta_rule_varlen(**whole, chunk_size=C, output_chunk_states=True)
    assert cs is not None
    for cut in (C, 2 * C):
        head = dict(_rows(x, 0, cut), initial_state=x["initial_state"][:1])
        o1, s1, _ = chunk_delta_rule_varlen(**head, chunk_size=C)
        assert torch.equal(s1[0], cs.states[cut // C])
        tail = dict(_rows(x, cut, L), initial_state=s1)
        o2, s2, _ = chunk_delta_rule_varlen(**tail, chunk_size=C)
        assert torch.equal(torch.cat([o1, o2]), o)
        assert torch.equal(s2, s)
        # the tail packed between other members (their own initial states)
        other1 = dict(_rows(x, L, L + 50), initial_state=x["initial_state"][1:2])
        other2 = dict(_rows(x, L + 50, L + 143), initial_state=x["initial_state"][2:3])
        packed = _pack([other1, tail, other2])
        op, sp, _ = chunk_delta_rule_varlen(**packed, chunk_size=C)
        assert torch.equal(op[50 : 50 + L - cut], o2)
        assert torch.equal(sp[1], s2[0])


@pytest.mark.parametrize("kda", [True, False])
def test_bitwise_with_intra_op_threads(kda: bool) -> None:
    """The invariances also hold with several intra-op threads (other tests run on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        test_bitwise_chunk_handoff(kda, 64)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kda", [True, False])
@pytest.mark.parametrize(("chunk_size", "stop"), [(64, 100), (64, 1), (32, 100), (16, 57)])
def test_bitwise_mid_chunk_stop(kda: bool, chunk_size: int, stop: int) -> None:
    """Padding rows never perturb: a member ending inside a chunk reproduces the same rows of a
    longer run bitwise, alone and packed."""
    x = _inputs([256, 40], kda=kda, K=16, V=16, dtype=F32, seed=8)
    full = dict(_rows(x, 0, 256), initial_state=x["initial_state"][:1])
    o, _, _ = chunk_delta_rule_varlen(**full, chunk_size=chunk_size)
    short = dict(_rows(x, 0, stop), initial_state=x["initial_state"][:1])
    o_short, _, _ = chunk_delta_rule_varlen(**short, chunk_size=chunk_size)
    assert torch.equal(o_short, o[:stop])
    other = dict(_rows(x, 256, 296), initial_state=x["initial_state"][1:])
    o_packed, _, _ = chunk_delta_rule_varlen(**_pack([other, short]), chunk_size=chunk_size)
    assert torch.equal(o_packed[40:], o[:stop])


@pytest.mark.parametrize("chunk_size", [32, 24])  # 24: one pairwise block per chunk (s = C)
@pytest.mark.parametrize("delta_rule", [True, False])
def test_pairwise_blocks_do_not_change_results(
    monkeypatch, delta_rule: bool, chunk_size: int
) -> None:
    """KDA's diagonal-block scores run in blocks of rows (bounded temporaries): with blocks of
    a few rows, whose boundaries fall elsewhere for each packing, outputs, states and every
    gradient are bitwise those of one block, and a member packed with others still equals it
    alone; in float64 the blocked gradients equal the token-by-token oracle's."""
    import harts_verl.ops.linear_attention as la

    def run(x: dict) -> tuple[torch.Tensor, ...]:
        leaves = {n: x[n].detach().clone().requires_grad_() for n in (*_NAMES, "initial_state")}
        o, s, _ = chunk_delta_rule_varlen(
            **leaves, cu_seqlens=x["cu_seqlens"], chunk_size=chunk_size, delta_rule=delta_rule
        )
        (o.sin().sum() + s.cos().sum()).backward()
        return (o.detach(), s.detach(), *(leaves[n].grad for n in leaves))

    x = _inputs([70, 45, 101], kda=True, K=16, V=16, dtype=F32, seed=21)
    whole = run(x)
    s = 16 if chunk_size % 16 == 0 else chunk_size
    monkeypatch.setattr(la, "_PAIRWISE_BLOCK_ELEMENTS", 3 * s * s * 16)  # 3 rows a block
    for got, want in zip(run(x), whole):
        assert torch.equal(got, want)
    alone = dict(_rows(x, 70, 115), initial_state=x["initial_state"][1:2])
    o1, s1, _ = chunk_delta_rule_varlen(**alone, chunk_size=chunk_size, delta_rule=delta_rule)
    assert torch.equal(o1, whole[0][70:115]) and torch.equal(s1[0], whole[1][1])

    x64 = _inputs([37, 64], kda=True, K=8, V=4, dtype=F64, seed=22)
    got = run(x64)
    leaves = {n: x64[n].detach().clone().requires_grad_() for n in (*_NAMES, "initial_state")}
    o, s = recurrent_delta_rule_ref(**leaves, cu_seqlens=x64["cu_seqlens"], delta_rule=delta_rule)
    (o.sin().sum() + s.cos().sum()).backward()
    for a, b in zip(got, (o.detach(), s.detach(), *(leaves[n].grad for n in leaves))):
        assert _rel(a, b) <= 1e-10


def test_one_row_chunks_packed_equal_alone() -> None:
    """Chunks of one row (the pairwise decay is 1) keep the packing invariance at a wide K
    (zero initial states: the recurrence's [1, K] @ [K, 1] products in batches of one matrix
    may round differently from batches of several, see the kernel's guarantees)."""
    x = _inputs([1, 1, 3], kda=True, H=1, group=1, K=512, V=1, dtype=F32, seed=23, with_h0=False)
    o, s, _ = chunk_delta_rule_varlen(**x, chunk_size=1, delta_rule=False)
    for i, (a, b) in enumerate([(0, 1), (1, 2), (2, 5)]):
        o1, s1, _ = chunk_delta_rule_varlen(**_rows(x, a, b), chunk_size=1, delta_rule=False)
        assert torch.equal(o1, o[a:b]) and torch.equal(s1[0], s[i])


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize(("kda", "K"), [(False, 1), (True, 16)])
def test_bitwise_small_state_scan_invariances(chunk_size: int, kda: bool, K: int) -> None:
    """The scan path (no delta rule, a small state: RG-LRU- and Mamba-1-shaped) keeps the
    float32 batch invariances: packed == alone, chunk-boundary handoff == straight run, a
    member ending inside a chunk == the same rows of a longer run."""
    C, L = chunk_size, 3 * chunk_size + 27
    x = _inputs([L, 50, 93], kda=kda, H=4, group=2, K=K, V=1, dtype=F32, seed=9)
    flags = {"chunk_size": C, "delta_rule": False}
    whole = dict(_rows(x, 0, L), initial_state=x["initial_state"][:1])
    o, s, cs = chunk_delta_rule_varlen(**whole, **flags, output_chunk_states=True)
    op, sp, _ = chunk_delta_rule_varlen(**x, **flags)
    assert torch.equal(op[:L], o) and torch.equal(sp[0], s[0])
    head = dict(_rows(x, 0, C), initial_state=x["initial_state"][:1])
    o1, s1, _ = chunk_delta_rule_varlen(**head, **flags)
    assert cs is not None and torch.equal(s1[0], cs.states[1])
    other = dict(_rows(x, L, L + 50), initial_state=x["initial_state"][1:2])
    tail = dict(_rows(x, C, L), initial_state=s1)
    o2, s2, _ = chunk_delta_rule_varlen(**_pack([other, tail]), **flags)
    assert torch.equal(torch.cat([o1, o2[50:]]), o) and torch.equal(s2[1], s[0])
    short = dict(_rows(x, 0, C + 5), initial_state=x["initial_state"][:1])
    o_short, _, _ = chunk_delta_rule_varlen(**short, **flags)
    assert torch.equal(o_short, o[: C + 5])


def test_bitwise_bf16_handoff() -> None:
    """bf16 inputs, fp32 states: the chunk-64 handoff is bitwise too."""
    x = _inputs([200], kda=True, K=16, V=16, dtype=torch.bfloat16, seed=9)
    o, s, _ = chunk_delta_rule_varlen(**x, chunk_size=64)
    assert o.dtype == torch.bfloat16 and s.dtype == F32
    head = dict(_rows(x, 0, 64), initial_state=x["initial_state"])
    o1, s1, _ = chunk_delta_rule_varlen(**head, chunk_size=64)
    o2, s2, _ = chunk_delta_rule_varlen(**dict(_rows(x, 64, 200), initial_state=s1))
    assert torch.equal(torch.cat([o1, o2]), o)
    assert torch.equal(s2, s)


# --------------------------------------------------------------------------------------------
# Low precision, layout, edge cases, validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kda", [True, False])
def test_bf16_close_to_float64(kda: bool) -> None:
    x64 = _inputs([120, 80], kda=kda, K=16, V=16, seed=10)
    x64["initial_state"] = x64["initial_state"] * 0.1
    xbf = {n: (t.bfloat16() if n in ("q", "k", "v", "beta") else t) for n, t in x64.items()}
    xbf["g"] = x64["g"].float()
    xbf["initial_state"] = x64["initial_state"].float()
    o, s, _ = chunk_delta_rule_varlen(**xbf, chunk_size=64)
    assert o.dtype == torch.bfloat16 and s.dtype == F32
    o_ref, s_ref = recurrent_delta_rule_ref(**x64)
    assert torch.isfinite(o).all()
    assert ((o.double() - o_ref).norm() / o_ref.norm()).item() < 2e-2
    assert ((s.double() - s_ref).norm() / s_ref.norm()).item() < 2e-2


def test_chunk_states_layout() -> None:
    lengths, C = [70, 0, 64, 1], 32
    x = _inputs(lengths, kda=False, seed=12)
    _, final, cs = chunk_delta_rule_varlen(**x, chunk_size=C, output_chunk_states=True)
    assert cs is not None
    assert cs.chunk_offsets.tolist() == [0, 3, 3, 5, 6]
    assert cs.chunk_offsets.dtype == torch.int64
    assert cs.states.shape == (6, 4, 8, 6)
    h0 = x["initial_state"]
    for n, first in ((0, 0), (2, 3), (3, 5)):
        assert torch.equal(cs.states[first], h0[n])  # chunk 0 holds the initial state
    assert torch.equal(final[1], h0[1])  # empty member: state passes through
    assert chunk_delta_rule_varlen(**x, chunk_size=C).chunk_states is None


def test_empty_and_default_arguments() -> None:
    x = _inputs([0, 0], kda=True, seed=13)
    o, s, cs = chunk_delta_rule_varlen(**x, output_chunk_states=True)
    assert o.shape == (0, 4, 6) and torch.equal(s, x["initial_state"])
    assert cs is not None and cs.states.shape == (0, 4, 8, 6)
    o_ref, s_ref = recurrent_delta_rule_ref(**x)
    assert o_ref.shape == (0, 4, 6) and torch.equal(s_ref, x["initial_state"])
    # cu_seqlens=None: one member; initial_state=None: zeros; explicit default scale
    y = _inputs([50], kda=False, seed=14, with_h0=False)
    o1, s1, _ = chunk_delta_rule_varlen(**dict(y, cu_seqlens=None), chunk_size=16)
    zeros = torch.zeros(1, 4, 8, 6, dtype=F64)
    o2, s2, _ = chunk_delta_rule_varlen(
        **dict(y, initial_state=zeros), chunk_size=16, scale=8**-0.5
    )
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_bad_arguments_raise() -> None:
    x = _inputs([20, 12], kda=True, seed=15)

    def call(**over: object) -> None:
        chunk_delta_rule_varlen(**{**x, **over})

    with pytest.raises(ValueError, match="q must be"):
        call(q=x["q"][None])
    with pytest.raises(ValueError, match="k must be"):
        call(k=x["k"][:, :1])
    with pytest.raises(ValueError, match="v must be"):
        call(v=x["v"][:, :3])
    with pytest.raises(ValueError, match="g must be"):
        call(g=x["g"][..., :3])
    with pytest.raises(ValueError, match="beta must be"):
        call(beta=x["beta"][:, None])
    with pytest.raises(ValueError, match="initial_state must be"):
        call(initial_state=x["initial_state"][:1])
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(cu_seqlens=torch.tensor([0, 5, 31]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(cu_seqlens=torch.tensor([0, 25, 20, 32]))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_delta_rule_varlen(**x, chunk_size=0)
    with pytest.raises(ValueError, match="initial_state"):
        y = _inputs([20], kda=True, dtype=F32, seed=16)
        chunk_delta_rule_varlen(**dict(y, initial_state=y["initial_state"].double()))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(x["g"], torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="A_log"):
        gdn_gate(x["beta"], torch.zeros(3), None)


@pytest.mark.parametrize("delta_rule", [True, False])
def test_autocast_keeps_the_compute_dtype(delta_rule: bool) -> None:
    """Inside a bf16 autocast region (the veRL engine's forward) the kernel computes in float32
    as outside it: bitwise the same outputs and states (autocast would run its matmuls in
    bf16)."""
    x = _inputs([40, 70], kda=False, seed=13, dtype=torch.float32)
    flags = {"chunk_size": 32, "delta_rule": delta_rule, "output_chunk_states": True}
    plain = chunk_delta_rule_varlen(**x, **flags)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = chunk_delta_rule_varlen(**x, **flags)
    assert auto.o.dtype == torch.float32
    assert torch.equal(auto.o, plain.o) and torch.equal(auto.final_state, plain.final_state)
    assert torch.equal(auto.chunk_states.states, plain.chunk_states.states)
