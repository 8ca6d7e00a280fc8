"""Compact log-probs/entropy: equal to the trajectory-wise log-softmax, never S×V (invariant 8)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _strategies import sequence_lists
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import harts_verl.ops.logprobs as lp
from harts_verl.ops.logprobs import (
    LogitTransform,
    compact_log_probs,
    expanded_log_probs_ref,
    label_rows,
    semantic_to_row_index,
)
from harts_verl.tree.forest import RolloutForest

V, D = 11, 5


def _params(c: int, seed: int, dtype: torch.dtype = torch.float64, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(c, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    cast = [
        t.to(dtype).requires_grad_(True) if t is not None else None for t in (hidden, weight, b)
    ]
    return cast


def _reference(
    forest, hidden, weight, bias, temperature, with_entropy, with_sq=False, transform=None
):
    """Trajectory-wise oracle over expanded hidden states (a gather of the row hidden states)."""
    expanded = hidden[torch.from_numpy(forest.semantic_rows)]
    logps, ents, sqs = [], [], []
    for i in range(forest.num_trajectories):
        s0, s1 = int(forest.row_offsets[i]), int(forest.row_offsets[i + 1])
        labels = torch.from_numpy(forest.tokens_of(i)[1:])
        lp_i, ent_i, sq_i = expanded_log_probs_ref(
            expanded[s0:s1],
            weight,
            labels,
            lm_head_bias=bias,
            temperature=temperature,
            with_entropy=with_entropy,
            with_sum_pi_squared=with_sq,
            logit_transform=transform,
        )
        logps.append(lp_i)
        ents.append(ent_i)
        sqs.append(sq_i)
    if with_sq:
        return torch.cat(logps), (torch.cat(ents) if with_entropy else None), torch.cat(sqs)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def _max_abs(x: torch.Tensor) -> float:
    return float(x.detach().abs().max()) if x.numel() else 0.0


def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if b is None:
        assert a is None
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) if b.numel() else 0.0


@settings(max_examples=50, deadline=None)
@given(
    seqs=sequence_lists(),
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([1.0, 0.7, 1.6]),
    chunk=st.sampled_from([1, 3, 7, 4096]),
    with_entropy=st.booleans(),
    with_sq=st.booleans(),
    bias=st.booleans(),
    transform=st.sampled_from(
        [None, LogitTransform(0.25), LogitTransform(softcap=1.5), LogitTransform(1.7, 2.0)]
    ),
)
def test_compact_equals_trajectory_wise_float64(
    seqs: list[list[int]],
    seed: int,
    temperature: float,
    chunk: int,
    with_entropy: bool,
    with_sq: bool,
    bias: bool,
    transform: LogitTransform | None,
) -> None:
    """Also with the models' own logit transforms (scaling, soft-capping: small caps, so that
    tanh saturates on part of the vocabulary)."""
    forest = RolloutForest.from_sequences(seqs)
    hidden, weight, b = _params(forest.num_compact_tokens, seed, bias=bias)
    out = compact_log_probs(
        hidden,
        weight,
        forest,
        lm_head_bias=b,
        temperature=temperature,
        with_entropy=with_entropy,
        with_sum_pi_squared=with_sq,
        rows_per_chunk=chunk,
        output="flat",
        logit_transform=transform,
    )
    ref_lp, ref_ent, ref_sq = _reference(
        forest, hidden, weight, b, temperature, with_entropy, with_sq=True, transform=transform
    )
    assert out.log_probs.dtype == torch.float64
    assert out.log_probs.shape == (forest.num_semantic_tokens - forest.num_trajectories,)
    assert out.offsets.tolist() == [0, *np.cumsum(forest.lengths - 1).tolist()]
    assert _max_abs(out.log_probs - ref_lp) <= 1e-10
    if with_entropy:
        assert _max_abs(out.entropy - ref_ent) <= 1e-10
    else:
        assert out.entropy is None
    if with_sq:  # Σp² of each position's distribution
        assert _max_abs(out.sum_pi_squared - ref_sq) <= 1e-10
    else:
        assert out.sum_pi_squared is None

    # Gradients of an arbitrary loss over semantic positions (row gradient = sum over positions).
    g = torch.Generator().manual_seed(seed + 1)
    c1 = torch.randn(ref_lp.shape, generator=g, dtype=torch.float64)
    c2 = torch.randn(ref_lp.shape, generator=g, dtype=torch.float64)
    c3 = torch.randn(ref_lp.shape, generator=g, dtype=torch.float64)
    params = [p for p in (hidden, weight, b) if p is not None]

    def loss(lp_: torch.Tensor, ent_: torch.Tensor | None, sq_: torch.Tensor | None):
        total = (lp_ * c1).sum()
        total = total + (ent_ * c2).sum() if ent_ is not None else total
        return total + (sq_ * c3).sum() if sq_ is not None else total

    if ref_lp.numel() == 0:
        return
    grads = torch.autograd.grad(loss(out.log_probs, out.entropy, out.sum_pi_squared), params)
    grads_ref = torch.autograd.grad(
        loss(ref_lp, ref_ent if with_entropy else None, ref_sq if with_sq else None), params
    )
    for a, r in zip(grads, grads_ref):
        assert _rel(a, r) <= 1e-9


def test_nested_output_and_length_one() -> None:
    seqs = [[3], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2], [5], [1, 2, 6, 0]]
    forest = RolloutForest.from_sequences(seqs)
    hidden, weight, b = _params(forest.num_compact_tokens, 0)
    nested = compact_log_probs(hidden, weight, forest, lm_head_bias=b, with_entropy=True)
    flat = compact_log_probs(
        hidden, weight, forest, lm_head_bias=b, with_entropy=True, output="flat"
    )
    assert [t.shape[0] for t in nested.log_probs] == [len(s) - 1 for s in seqs]
    assert [t.shape[0] for t in nested.entropy] == [len(s) - 1 for s in seqs]
    assert torch.equal(torch.cat(nested.log_probs), flat.log_probs)
    assert torch.equal(torch.cat(nested.entropy), flat.entropy)
    assert torch.equal(nested.offsets, flat.offsets)
    # Identical trajectories get identical values; shared prefixes share values.
    assert torch.equal(nested.log_probs[1], nested.log_probs[2])
    assert torch.equal(nested.log_probs[1][:1], nested.log_probs[3])
    # Accepts the [1, C, D] compact batch.
    again = compact_log_probs(hidden[None], weight, forest, lm_head_bias=b, output="flat")
    assert torch.equal(again.log_probs, flat.log_probs)


def test_all_length_one_trajectories_have_zero_gradient() -> None:
    forest = RolloutForest.from_sequences([[1], [2], [1]])
    hidden, weight, _ = _params(forest.num_compact_tokens, 0, bias=False)
    out = compact_log_probs(hidden, weight, forest, with_entropy=True, output="flat")
    assert out.log_probs.shape == (0,) and out.entropy.shape == (0,)
    assert out.offsets.tolist() == [0, 0, 0, 0]
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert hidden.grad is not None and float(hidden.grad.abs().max()) == 0.0


def test_expanded_forest_gives_same_result() -> None:
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3, 4], [2, 7], [1, 2]]
    tree = RolloutForest.from_sequences(seqs)
    flat_layout = RolloutForest.expanded(seqs)
    hidden, weight, b = _params(tree.num_compact_tokens, 5)
    hid_exp = hidden.detach()[torch.from_numpy(tree.semantic_rows)]
    a = compact_log_probs(hidden, weight, tree, lm_head_bias=b, with_entropy=True, output="flat")
    e = compact_log_probs(
        hid_exp, weight, flat_layout, lm_head_bias=b, with_entropy=True, output="flat"
    )
    torch.testing.assert_close(a.log_probs, e.log_probs, rtol=0, atol=1e-12)
    torch.testing.assert_close(a.entropy, e.entropy, rtol=0, atol=1e-12)


def test_label_rows_and_semantic_index() -> None:
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [9], [1, 2, 3, 4], [2, 7]]
    forest = RolloutForest.from_sequences(seqs)
    pairs = label_rows(forest)
    assert pairs.child_rows.shape[0] == forest.num_compact_tokens - forest.roots.shape[0]
    assert np.array_equal(pairs.hidden_rows, forest.parent[pairs.child_rows])
    assert np.array_equal(pairs.labels, forest.token_ids[pairs.child_rows])
    idx = semantic_to_row_index(forest)
    assert idx.shape == (forest.num_semantic_tokens - forest.num_trajectories,)
    pos = 0
    for i, s in enumerate(seqs):
        rows = forest.rows_of(i)
        for t in range(len(s) - 1):
            child = idx[pos]
            assert forest.parent[child] == rows[t]  # hidden row of (i, t)
            assert forest.token_ids[child] == s[t + 1]  # label x_i[t+1]
            pos += 1


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor produced by any aten op (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_vocab_work_is_chunked_and_once_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    trunk = rng.integers(0, 50, 40).tolist()
    seqs = [trunk + rng.integers(0, 50, int(n)).tolist() for n in rng.integers(1, 30, 24)]
    seqs += [trunk[:10], trunk]  # prefix trajectories
    forest = RolloutForest.from_sequences(seqs)
    v, d, chunk = 512, 8, 4
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(forest.num_compact_tokens, d, generator=g).requires_grad_(True)
    weight = (torch.randn(v, d, generator=g) * 0.1).requires_grad_(True)
    bias = torch.zeros(v).requires_grad_(True)

    calls: list[int] = []
    real = lp._chunk_logits

    def spy(h, w, b, out):
        calls.append(h.shape[0])
        return real(h, w, b, out)

    monkeypatch.setattr(lp, "_chunk_logits", spy)
    mode = _MaxNumel()
    with mode:
        out = compact_log_probs(
            hidden,
            weight,
            forest,
            lm_head_bias=bias,
            with_entropy=True,
            rows_per_chunk=chunk,
            output="flat",
        )
        n_fwd = len(calls)
        (out.log_probs.sum() + out.entropy.sum()).backward()
    distinct_hidden = int((forest.num_children > 0).sum())
    s_minus_n = forest.num_semantic_tokens - forest.num_trajectories
    assert s_minus_n > 2 * distinct_hidden  # enough sharing to make the check meaningful
    # Forward computes logits once per distinct hidden row; backward recomputes each once.
    assert sum(calls[:n_fwd]) == distinct_hidden and sum(calls[n_fwd:]) == distinct_hidden
    assert max(calls) <= chunk
    # No op output is larger than a chunk of logits or the weight (gradient): never S×V/C×V.
    assert mode.max_numel <= max(chunk * v, v * d)
    assert forest.num_compact_tokens * v > max(chunk * v, v * d)
    assert hidden.grad is not None and weight.grad is not None and bias.grad is not None


def test_bf16_runs_and_is_close() -> None:
    seqs = [[1, 2, 3, 4, 0], [1, 2, 3, 5, 6], [1, 2, 3, 4, 0, 7], [2, 7, 8]]
    forest = RolloutForest.from_sequences(seqs)
    h64, w64, b64 = _params(forest.num_compact_tokens, 3)
    hb, wb, bb = (t.detach().to(torch.bfloat16).requires_grad_(True) for t in (h64, w64, b64))
    out = compact_log_probs(
        hb, wb, forest, lm_head_bias=bb, temperature=0.8, with_entropy=True, output="flat"
    )
    assert out.log_probs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    ref_lp, ref_ent = _reference(forest, hb, wb, bb, 0.8, True)  # same dtype policy
    torch.testing.assert_close(out.log_probs, ref_lp, rtol=0, atol=2e-2)
    torch.testing.assert_close(out.entropy, ref_ent, rtol=0, atol=2e-2)
    ref64, _ = _reference(forest, h64, w64, b64, 0.8, False)
    torch.testing.assert_close(out.log_probs.double(), ref64, rtol=0, atol=0.15)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    assert torch.isfinite(hb.grad.float()).all() and torch.isfinite(wb.grad.float()).all()


def test_validation_errors() -> None:
    forest = RolloutForest.from_sequences([[1, 2, 3], [1, 4]])
    c = forest.num_compact_tokens
    h, w, b = _params(c, 0)
    with pytest.raises(ValueError, match="hidden"):
        compact_log_probs(h[:-1], w, forest)
    with pytest.raises(ValueError, match="lm_head_weight"):
        compact_log_probs(h, w[:, :-1], forest)
    with pytest.raises(ValueError, match="lm_head_weight"):
        compact_log_probs(h, w.float(), forest)
    with pytest.raises(ValueError, match="lm_head_bias"):
        compact_log_probs(h, w, forest, lm_head_bias=b[:-1])
    with pytest.raises(ValueError, match="forest"):
        compact_log_probs(h, w[:3], forest)
    with pytest.raises(ValueError, match="temperature"):
        compact_log_probs(h, w, forest, temperature=0.0)
    with pytest.raises(ValueError, match="rows_per_chunk"):
        compact_log_probs(h, w, forest, rows_per_chunk=0)
    with pytest.raises(ValueError, match="output"):
        compact_log_probs(h, w, forest, output="padded")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="labels"):
        expanded_log_probs_ref(h, w, torch.zeros(c, dtype=torch.int64))
    for bad in (LogitTransform(0.0), LogitTransform(float("nan")), LogitTransform(1.0, -2.0)):
        with pytest.raises(ValueError, match=r"logit_transform\.(scale|softcap)"):
            compact_log_probs(h, w, forest, logit_transform=bad)
    with pytest.raises(TypeError, match="logit_transform"):
        compact_log_probs(h, w, forest, logit_transform=30.0)  # type: ignore[arg-type]


def test_logit_transform_matches_hf_formulas() -> None:
    """The transform is what the HF causal LMs compute: Gemma 2's ``cap · tanh(x / cap)``,
    Granite's ``x / logits_scaling``, Cohere's ``x · logit_scale`` (written out here)."""
    forest = RolloutForest.from_sequences([[1, 2, 3, 4], [1, 2, 5], [6]])
    h, w, b = _params(forest.num_compact_tokens, 3)
    x = (h @ w.t() + b).detach()
    for transform, logits in (
        (LogitTransform(softcap=2.5), 2.5 * torch.tanh(x / 2.5)),
        (LogitTransform(1 / 8.0), x / 8.0),
        (LogitTransform(0.0625), x * 0.0625),
    ):
        out = compact_log_probs(h, w, forest, lm_head_bias=b, logit_transform=transform)
        for i in range(forest.num_trajectories):
            rows = torch.from_numpy(forest.rows_of(i))
            ref = torch.log_softmax(logits[rows[:-1]], dim=-1)
            ref = ref.gather(1, torch.from_numpy(forest.tokens_of(i)[1:])[:, None])[:, 0]
            assert _max_abs(out.log_probs[i] - ref) <= 1e-12


def test_validation_errors_name_the_argument() -> None:
    forest = RolloutForest.from_sequences([[1, 2, 3], [1, 4]])
    h, w, _ = _params(forest.num_compact_tokens, 0)
    for bad in (None, "hot", [1.0], float("nan"), -1.0, True, 10**400, [10**400, 1.0]):
        with pytest.raises(ValueError, match="temperature"):  # 10**400: not an OverflowError
            compact_log_probs(h, w, forest, temperature=bad)
    with pytest.raises(TypeError, match="forest"):
        compact_log_probs(h, w, [[1, 2, 3], [1, 4]])
    with pytest.raises(ValueError, match="rows_per_chunk"):
        compact_log_probs(h, w, forest, rows_per_chunk=True)


def test_temperature_entropy_one_row_per_chunk_gradients() -> None:
    """temperature != 1, with_entropy and rows_per_chunk=1 together, with gradients from the
    entropy only, the log-probs only, and both (numpy / 0-d tensor temperatures accepted)."""
    seqs = [[3], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2], [5], [1, 2, 6, 0], [1, 2, 3, 4, 5, 6, 7]]
    forest = RolloutForest.from_sequences(seqs)
    for temperature in (0.3, np.float32(2.5), torch.tensor(0.7, dtype=torch.float64)):
        hidden, weight, bias = _params(forest.num_compact_tokens, 3)
        out = compact_log_probs(
            hidden,
            weight,
            forest,
            lm_head_bias=bias,
            temperature=temperature,
            with_entropy=True,
            rows_per_chunk=1,
            output="flat",
        )
        ref_lp, ref_ent = _reference(forest, hidden, weight, bias, float(temperature), True)
        assert _max_abs(out.log_probs - ref_lp) <= 1e-10
        assert _max_abs(out.entropy - ref_ent) <= 1e-10
        for pick in (lambda a, b: (b**2).sum(), lambda a, b: a.sum(), lambda a, b: (a * b).sum()):
            params = (hidden, weight, bias)
            got = torch.autograd.grad(pick(out.log_probs, out.entropy), params, retain_graph=True)
            want = torch.autograd.grad(pick(ref_lp, ref_ent), params, retain_graph=True)
            for a, r in zip(got, want):
                assert _rel(a, r) <= 1e-9


@settings(max_examples=30, deadline=None)
@given(
    seqs=sequence_lists(),
    seed=st.integers(0, 2**31 - 1),
    temps=st.lists(st.sampled_from([0.5, 1.0, 1.75]), min_size=1, max_size=64),
    chunk=st.sampled_from([1, 4096]),
    transform=st.sampled_from([None, LogitTransform(0.5, 2.0)]),
)
def test_per_trajectory_temperatures_float64(seqs, seed, temps, chunk, transform) -> None:
    """One temperature per trajectory (veRL's per-sample temperatures; rows shared across
    temperatures): every trajectory's log-probs, entropy and Σp² equal its own trajectory-wise
    log-softmax at its temperature (≤ 1e-10), gradients too (≤ 1e-9 relative)."""
    forest = RolloutForest.from_sequences(seqs)
    n = forest.num_trajectories
    t = np.array([temps[i % len(temps)] for i in range(n)])
    hidden, weight, b = _params(forest.num_compact_tokens, seed)
    out = compact_log_probs(
        hidden,
        weight,
        forest,
        lm_head_bias=b,
        temperature=torch.from_numpy(t).float(),  # veRL's float32 tensor (exact values)
        with_entropy=True,
        with_sum_pi_squared=True,
        rows_per_chunk=chunk,
        logit_transform=transform,
    )
    expanded = hidden[torch.from_numpy(forest.semantic_rows)]
    refs = []
    for i in range(n):
        s0, s1 = int(forest.row_offsets[i]), int(forest.row_offsets[i + 1])
        ref = expanded_log_probs_ref(
            expanded[s0:s1],
            weight,
            torch.from_numpy(forest.tokens_of(i)[1:]),
            lm_head_bias=b,
            temperature=float(t[i]),
            with_entropy=True,
            with_sum_pi_squared=True,
            logit_transform=transform,
        )
        refs.append(ref)
        for got, want in zip((out.log_probs[i], out.entropy[i], out.sum_pi_squared[i]), ref):
            assert got.shape == want.shape and _max_abs(got - want) <= 1e-10
    g = torch.Generator().manual_seed(seed)
    total = sum(sum(o.shape[0] for o in r[:1]) for r in refs)
    if total == 0:
        return
    c = [torch.randn(total, generator=g, dtype=torch.float64) for _ in range(3)]
    params = [hidden, weight, b]

    def loss(cols):
        return sum((torch.cat(col) * ck).sum() for col, ck in zip(cols, c))

    got = torch.autograd.grad(loss([out.log_probs, out.entropy, out.sum_pi_squared]), params)
    want = torch.autograd.grad(loss([[r[k] for r in refs] for k in range(3)]), params)
    for a, r in zip(got, want):
        assert _rel(a, r) <= 1e-9


def test_per_trajectory_temperature_validation() -> None:
    forest = RolloutForest.from_sequences([[1, 2, 3], [1, 4], [5]])
    h, w, _ = _params(forest.num_compact_tokens, 0)
    same = compact_log_probs(h, w, forest, temperature=[0.7, 0.7, 0.7], output="flat")
    scalar = compact_log_probs(h, w, forest, temperature=0.7, output="flat")
    assert torch.equal(same.log_probs, scalar.log_probs)  # all equal: the one-temperature path
    for one in (np.array(0.7), np.array([0.7]), torch.tensor([0.7], dtype=torch.float64)):
        got = compact_log_probs(h, w, forest, temperature=one, output="flat")  # one temperature
        assert torch.equal(got.log_probs, scalar.log_probs)
    for bad, msg in (
        ([1.0, 2.0], r"shape \(3,\)"),
        (np.ones((3, 1)), r"shape \(3,\)"),
        ([1.0, 0.0, 1.0], r"temperature\[1\]"),
        (torch.tensor([1.0, float("nan"), 2.0]), r"temperature\[1\]"),
        (torch.tensor([True, False, True]), "real numbers"),
        (["a", "b", "c"], r"temperature\[0\]: expected a number, got 'a'"),
        # numbers written as strings are not read as numbers (numpy would convert them)
        (["1", "2", "3"], r"temperature\[0\]: expected a number, got '1'"),
        ([1.0, b"2", 1.0], r"temperature\[1\]: expected a number, got b'2'"),
        ([1.0, None, 1.0], r"temperature\[1\]: expected a number, got None"),
        (np.array(["0.5", "2", "1"]), "expected numbers, got dtype <U3"),
        (np.array(True), "finite positive number"),
        (np.array([-0.5]), "finite positive number"),
        ([True, 1.0, 2.0], "got a bool"),  # numpy would read True as 1.0
        (np.array([True, False, True]), "got a bool"),
    ):
        with pytest.raises(ValueError, match=msg):
            compact_log_probs(h, w, forest, temperature=bad)
    empty = RolloutForest.from_sequences([])
    out = compact_log_probs(h[:0], w, empty, temperature=torch.zeros(0))
    assert out.log_probs == []


def test_temperature_floor_of_the_compute_dtype() -> None:
    """A positive temperature below 1 / sqrt(max) of the compute dtype (where logits /
    temperature could overflow into NaN) is refused by name, per trajectory too, in the compact
    head and the reference alike; the floor itself is accepted and finite."""
    f = RolloutForest.from_sequences([[1, 2, 3], [1, 4]])
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        hidden, weight, bias = _params(f.num_compact_tokens, 0)
        hidden, weight, bias = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        floor = float(torch.finfo(cdt).max) ** -0.5
        with pytest.raises(ValueError, match=r"^temperature: .* below"):
            compact_log_probs(hidden, weight, f, lm_head_bias=bias, temperature=floor / 2)
        with pytest.raises(ValueError, match=r"^temperature\[1\]: .* below"):
            compact_log_probs(hidden, weight, f, temperature=[1.0, floor / 10])
        with pytest.raises(ValueError, match=r"^temperature: .* below"):
            expanded_log_probs_ref(hidden[:3], weight, torch.tensor([2, 3]), temperature=1e-320)
        res = compact_log_probs(hidden, weight, f, temperature=floor, with_entropy=True)
        assert all(torch.isfinite(x).all() for x in res.log_probs)
    with pytest.raises(ValueError, match="below"):  # float64 floor 7.5e-155; 1e-40 is legal
        compact_log_probs(*_params(f.num_compact_tokens, 0)[:2], f, temperature=1e-160)
    compact_log_probs(*_params(f.num_compact_tokens, 0)[:2], f, temperature=1e-40)


def test_mean_logit_cosine_counts_equal_rows_as_one():
    """mean_logit_cosine (bench's mean_logit_cos, check's mean_cos): the mean over positions of
    the LM-head logits' cosine, chunking not changing it; two exactly equal rows count 1, zero
    logits included (torch's cosine of two zero vectors is 0: identical outputs read as total
    disagreement); NaN without positions; mismatched inputs are named."""
    from harts_verl.ops.logprobs import mean_logit_cosine

    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 3, generator=g, dtype=torch.float64)
    a = [torch.randn(5, 3, generator=g, dtype=torch.float64), torch.zeros(2, 3)]
    b = [a[0] + 0.1 * torch.randn(5, 3, generator=g, dtype=torch.float64), torch.zeros(2, 3)]
    la, lb = a[0] @ w.T, b[0] @ w.T
    want = (float(torch.nn.functional.cosine_similarity(la, lb, dim=-1).sum()) + 2) / 7
    for rows in (1, 2, 4096):
        assert abs(mean_logit_cosine(a, b, w, rows_per_chunk=rows) - want) <= 1e-15
    assert mean_logit_cosine([torch.zeros(3, 3)], [torch.zeros(3, 3)], w) == 1.0
    assert math.isnan(mean_logit_cosine([], [], w))
    with pytest.raises(ValueError, match="hidden_b: 1 trajectories, hidden_a has 2"):
        mean_logit_cosine(a, b[:1], w)
    with pytest.raises(ValueError, match=r"hidden_b\[1\]: shape \(1, 3\) != \(2, 3\)"):
        mean_logit_cosine(a, [b[0], torch.zeros(1, 3)], w)
