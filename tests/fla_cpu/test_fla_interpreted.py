"""fla 0.6's real ``chunk_kda`` / ``chunk_gated_delta_rule`` on the CPU (Triton interpreter),
float32, behind :class:`~harts_verl.ops.backends.fla_linear.FlaLinearKernel`:

- the kernel vs the torch reference: outputs, final states and every gradient (``dq`` … ``dh0``,
  with a gradient flowing into the final state), for each argument mapping we use (in-kernel
  q/k l2-norm, in-kernel beta sigmoid, chunk sizes, varlen with a one-token sequence);
- tree-with-fla vs tree-with-reference through :class:`~harts_verl.ops.layout.TreeLayout` (split
  plans: kept mid-member states become final states), outputs and input gradients, and (GDN)
  tree vs trajectory-wise on fla;
- the native hybrid model (KDA, MLA, GDN, GQA, MoE) in tree mode: log-probs and parameter
  gradients with fla vs the reference kernel (the reference's tree = trajectory-wise identity is
  tested exactly in float64 by the default suite).

The interpreter computes in float32 numpy, so fla and the reference agree to float32 rounding
(error ratios ≈ 1e-7; bound 2e-5). Shapes are tiny: interpreted KDA costs seconds per call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _delta_rule_cases import delta_rule_inputs, err_ratio, per_trajectory

from harts_verl.ops.layout import TreeLayout
from harts_verl.ops.linear_attention import chunk_delta_rule_varlen
from harts_verl.tree import RolloutForest

TOL = 2e-5


def _inputs(t: int, kda: bool, *, seed: int = 0):
    """Tiny heads (1 key head, 2 value heads of 16): interpreted kernels are slow."""
    return delta_rule_inputs(t, kda, h=1, hv=2, d=16, seed=seed)


# ------------------------------------------------------------------------------ kernel vs reference
def _assert_fla_matches_reference(fla_kernel, lens, inputs, **kw) -> None:
    """fla (through ``fla_kernel``) vs our reference in float32 and the float64 truth, with
    initial states and a gradient into the final state: outputs, final states and every
    gradient; fla's float32 error against the truth stays within a small multiple of our float32
    reference's own error (dg of GDN sums long products: both land near 1e-5 there)."""
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    kdim, (hv, vdim) = inputs[0].shape[-1], inputs[2].shape[1:]
    state = (len(lens), hv, kdim, vdim)
    h0 = 0.1 * torch.randn(state, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(sum(lens), hv, vdim, generator=gen)
    dht = torch.randn(state, generator=gen)
    res = {}
    for name, fn, dtype in (
        ("fla", fla_kernel, torch.float32),
        ("ref32", chunk_delta_rule_varlen, torch.float32),
        ("ref64", chunk_delta_rule_varlen, torch.float64),
    ):
        xs = [x.detach().to(dtype).clone().requires_grad_(True) for x in (*inputs, h0)]
        out = fn(*xs[:5], cu_seqlens=cu, initial_state=xs[5], **kw)
        ((out.o * do.to(dtype)).sum() + (out.final_state * dht.to(dtype)).sum()).backward()
        res[name] = (out.o, out.final_state, *(x.grad for x in xs))
    fla_o, fla_state = res["fla"][:2]
    assert fla_state.dtype == torch.float32
    assert fla_o.shape == res["ref32"][0].shape and fla_o.dtype == torch.float32
    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    for n, a, b, truth in zip(names, res["fla"], res["ref32"], res["ref64"]):
        e_fla, e_ref = err_ratio(a, truth), err_ratio(b, truth)
        assert e_fla <= max(TOL, 8 * e_ref), f"{n}: fla {e_fla:.2e}, fp32 reference {e_ref:.2e}"


@pytest.mark.parametrize(
    "kda,chunk,l2,beta_in_kernel,route",
    [
        (True, 64, True, False, "native"),
        (True, 32, False, True, "native"),
        (False, 64, True, True, "native"),
        (False, 32, False, False, "native"),
        (False, 16, True, False, "native"),
        (False, 64, True, True, "channels"),
        (False, 32, False, False, "channels"),
    ],
    ids=[
        "kda-c64-l2",
        "kda-c32-sigmoid",
        "gdn-c64-l2-sigmoid",
        "gdn-c32",
        "gdn-c16-l2",
        "gdn-as-kda-c64-l2-sigmoid",
        "gdn-as-kda-c32",
    ],
)
def test_fla_matches_reference(
    fla_kernel, fla_channels_kernel, kda, chunk, l2, beta_in_kernel, route
):
    """Each argument mapping vs the reference; ``channels``: GatedDeltaNet (scalar gate) through
    fla's ``chunk_kda`` with the gate broadcast over the key channels (the Hopper route), ``dg``
    summed back over the channels."""
    lens = [37, 1, 64, 70]
    q, k, v, g, beta_logits = _inputs(sum(lens), kda, seed=chunk + (route == "channels"))
    if not l2:  # the kernel then expects normalised q/k, as models without in-kernel norm give
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    beta = beta_logits if beta_in_kernel else torch.sigmoid(beta_logits)
    _assert_fla_matches_reference(
        fla_channels_kernel if route == "channels" else fla_kernel,
        lens,
        (q, k, v, g, beta),
        chunk_size=chunk,
        use_qk_l2norm=l2,
        use_beta_sigmoid=beta_in_kernel,
    )


@pytest.mark.parametrize("kda", [False, True], ids=["simple_gla", "gla"])
def test_fla_gla_matches_reference(fla_kernel, kda):
    """``delta_rule=False`` (Mamba-2 SSD / GLA) through fla's ``chunk_simple_gla`` /
    ``chunk_gla``: beta scales v, grouped heads repeated."""
    lens = [37, 1, 70]
    q, k, v, g, beta_logits = _inputs(sum(lens), kda, seed=7)
    inputs = (q, k, v, g, torch.sigmoid(beta_logits))
    _assert_fla_matches_reference(fla_kernel, lens, inputs, scale=0.3, delta_rule=False)


def test_fla_gla_one_channel_value_heads(fla_kernel):
    """Mamba-1's selective scan through ``chunk_gla``: one q/k head (B, C) shared by 3 value
    heads of one channel each (zero-padded to fla's 16-wide value tile), a per-channel decay
    over the 16 state entries, write scale dt."""
    lens = [37, 1, 70]
    q, k, _, g, beta_logits = _inputs(sum(lens), True, seed=9)
    gen = torch.Generator().manual_seed(10)
    v = torch.randn(sum(lens), 3, 1, generator=gen)
    g = g[:, :1].expand(-1, 3, -1) * torch.tensor([1.0, 0.5, 2.0])[:, None]
    beta = torch.nn.functional.softplus(beta_logits[:, :1]).expand(-1, 3).contiguous()
    inputs = (q, k, v, g.contiguous(), beta)
    _assert_fla_matches_reference(fla_kernel, lens, inputs, scale=1.0, delta_rule=False)


def test_fla_simple_gla_one_entry_heads(fla_kernel):
    """RecurrentGemma's RG-LRU through ``chunk_simple_gla``: 5 heads of one channel each, a
    one-entry state (q = k = 1, keys and values zero-padded to fla's 16-wide tiles), a scalar
    decay per head and token, write scale 1."""
    lens = [37, 1, 70]
    t = sum(lens)
    gen = torch.Generator().manual_seed(11)
    ones = torch.ones(t, 5, 1)
    v = torch.randn(t, 5, 1, generator=gen)
    g = -8.0 * torch.rand(t, 5, generator=gen) * torch.tensor([0.05, 0.3, 0.7, 1.0, 2.0])
    inputs = (ones, ones.clone(), v, g, torch.ones(t, 5))
    _assert_fla_matches_reference(fla_kernel, lens, inputs, scale=1.0, delta_rule=False)


# fla's GLA kernel rescales masked rows (past a sequence's end) by exp2 of the chunk's gate sum,
# which overflows there for strong decays (those rows are never stored); numpy warns about it.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_ssd_and_one_entry_heads_through_gla(fla_channels_kernel):
    """Mamba-2's SSD (scalar gate, grouped heads) and RecurrentGemma's one-entry RG-LRU heads
    (keys and values zero-padded) through ``chunk_gla`` with the gate broadcast over the key
    channels (the Hopper route) vs the reference."""
    lens = [37, 1, 70]
    q, k, v, g, beta_logits = _inputs(sum(lens), False, seed=12)
    inputs = (q, k, v, g, torch.sigmoid(beta_logits))
    _assert_fla_matches_reference(fla_channels_kernel, lens, inputs, scale=0.3, delta_rule=False)
    t = sum(lens)
    gen = torch.Generator().manual_seed(13)
    ones = torch.ones(t, 3, 1)
    v = torch.randn(t, 3, 1, generator=gen)
    g = -8.0 * torch.rand(t, 3, generator=gen) * torch.tensor([0.05, 0.7, 2.0])
    inputs = (ones, ones.clone(), v, g, torch.ones(t, 3))
    _assert_fla_matches_reference(fla_channels_kernel, lens, inputs, scale=1.0, delta_rule=False)


def test_fla_refuses_chunk_states_and_float64(fla_kernel):
    q, k, v, g, beta = _inputs(8, False)
    cu = torch.tensor([0, 8])
    with pytest.raises(NotImplementedError, match="chunk-start states"):
        fla_kernel(q, k, v, g, beta.sigmoid(), cu_seqlens=cu, output_chunk_states=True)
    with pytest.raises(TypeError, match="float64"):
        fla_kernel(*(x.double() for x in (q, k, v, g, beta)), cu_seqlens=cu)


# ------------------------------------------------------------------------------ tree layouts
def _forest(chunk: int, seed: int = 0) -> RolloutForest:
    """A main path with forks just before, on and after chunk boundaries (kept mid-member
    states), a nested fork, a prefix trajectory and a second root; unique tokens per branch."""
    rng = np.random.default_rng(seed)
    nxt = iter(range(10_000, 10_000_000))

    def fresh(n: int) -> list[int]:
        return [next(nxt) for _ in range(n)]

    main = fresh(3 * chunk + 5)
    seqs = [main]
    for f in (chunk - 1, chunk, 2 * chunk + 3):
        seqs.append(main[:f] + fresh(int(rng.integers(1, chunk))))
    seqs.append(seqs[3][:-2] + fresh(chunk + 3))
    seqs.append(fresh(chunk + 1))
    seqs.append(main[: 2 * chunk])
    return RolloutForest.from_sequences(seqs)


def _run_layout(layout: TreeLayout, inputs, seed: int, delta_rule: bool = True):
    xs = [x.clone().requires_grad_(True) for x in inputs]
    o = layout.linear_attention(*xs, use_qk_l2norm=True, delta_rule=delta_rule)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed))
    (o * w).sum().backward()
    return o.detach(), [x.grad for x in xs]


def _layout_inputs(forest: RolloutForest, kda: bool):
    q, k, v, g, beta_logits = _inputs(forest.num_compact_tokens, kda, seed=3)
    return q, k, v, g, torch.sigmoid(beta_logits)


@pytest.mark.parametrize(
    "kda,chunk,delta_rule",
    [(True, 32, True), (False, 16, True), (False, 16, False)],
    ids=["kda", "gdn", "ssd"],
)
def test_tree_layout_fla_vs_reference(fla_kernel, kda, chunk, delta_rule):
    forest = _forest(chunk)
    inputs = _layout_inputs(forest, kda)
    tree_fla = TreeLayout(forest, chunk_size=chunk, linear_backend=fla_kernel)
    ref_layout = TreeLayout(forest, chunk_size=chunk, linear_backend="reference")
    assert len(tree_fla.linear_plan.rounds) > 1
    # The forest keeps mid-member states; with fla they became final states of split members.
    assert any(r.needs_chunk_states for r in ref_layout.linear_plan.rounds)
    assert not any(r.needs_chunk_states for r in tree_fla.linear_plan.rounds)
    o_fla, grads_fla = _run_layout(tree_fla, inputs, seed=5, delta_rule=delta_rule)
    o_ref, grads_ref = _run_layout(ref_layout, inputs, seed=5, delta_rule=delta_rule)
    errs = {"o": err_ratio(o_fla, o_ref)}
    errs.update({n: err_ratio(a, b) for n, a, b in zip("qkvgb", grads_fla, grads_ref)})
    assert max(errs.values()) <= TOL, str(errs)


def test_tree_vs_trajectories_on_fla(fla_kernel):
    """Every trajectory's rows of the tree layout vs the trajectory-wise layout, both on fla (GDN:
    interpreted KDA is slow; for KDA this follows from the test above, since tree = trajectory-wise
    holds exactly on the reference in the float64 suite)."""
    chunk = 16
    forest = _forest(chunk)
    inputs = _layout_inputs(forest, kda=False)
    kern = fla_kernel
    o_tree = TreeLayout(forest, chunk_size=chunk, linear_backend=kern).linear_attention(
        *inputs, use_qk_l2norm=True
    )
    expanded = RolloutForest.expanded(forest.sequences)
    sem = torch.as_tensor(
        np.concatenate([forest.rows_of(i) for i in range(forest.num_trajectories)])
    )
    o_exp = TreeLayout(expanded, chunk_size=chunk, linear_backend=kern).linear_attention(
        *(x.index_select(0, sem) for x in inputs), use_qk_l2norm=True
    )
    a, b = per_trajectory(forest, o_tree), per_trajectory(expanded, o_exp)
    assert err_ratio(a, b) <= TOL
    assert float((a - b).abs().max()) <= 1e-4


# ------------------------------------------------------------------------------ whole model
def test_model_fla_vs_reference_kernel(fla_kernel):
    from harts_verl.models import HybridForCausalLM, preset
    from harts_verl.ops.logprobs import compact_log_probs

    torch.manual_seed(0)
    cfg = preset("tiny", chunk_size=32)
    model = HybridForCausalLM.from_config(cfg)
    rng = np.random.default_rng(0)
    base = rng.integers(0, cfg.vocab_size, 90).tolist()
    seqs = [
        base,
        base[:40] + rng.integers(0, cfg.vocab_size, 30).tolist(),
        base[:32] + rng.integers(0, cfg.vocab_size, 20).tolist(),
        [*base[:70], 3, 4, 5],
    ]

    def run(forest: RolloutForest, backend):
        model.zero_grad(set_to_none=True)
        layout = TreeLayout(forest, chunk_size=cfg.chunk_size, linear_backend=backend)
        hidden, aux = model(layout.token_ids, layout)
        lps = compact_log_probs(
            hidden, model.lm_head.weight, forest, lm_head_bias=model.lm_head.bias
        ).log_probs
        (torch.stack([lp.sum() for lp in lps]).sum() / 100 + aux).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return [lp.detach() for lp in lps], grads

    class Counting:
        """fla's kernel, counting KDA (g ``[T, HV, K]``) and GDN (g ``[T, HV]``) calls."""

        name, final_states_only = fla_kernel.name, fla_kernel.final_states_only

        def __init__(self) -> None:
            self.calls = {"kda": 0, "gdn": 0}

        def __call__(self, q, k, v, g, beta, **kw):
            self.calls["kda" if g.dim() == 3 else "gdn"] += 1
            return fla_kernel(q, k, v, g, beta, **kw)

    counting = Counting()
    tree = RolloutForest.from_sequences(seqs)
    lp_fla, g_fla = run(tree, counting)
    assert counting.calls["kda"] > 1 and counting.calls["gdn"] > 1, counting.calls
    lp_ref, g_ref = run(tree, "reference")
    assert g_fla.keys() == g_ref.keys()
    assert {"layers.0.mixer.A_log", "layers.2.mixer.A_log"} <= g_fla.keys()
    for a, b in zip(lp_fla, lp_ref):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-4
    worst = max(err_ratio(g_fla[n], g_ref[n]) for n in g_fla)
    assert worst <= 1e-4, worst


# ------------------------------------------------------------------------------ autotune sweep
def test_autotune_sweep_forces_each_config(fla_kernel):
    """``tests/gpu/autotune_sweep.py``'s sweep on the interpreter (one cheap kernel of KDA's
    forward + backward): every config of the kernel is run once, each run uses the config it
    forced (a different one each time), the others stay at their first, and the results match
    the reference."""
    import importlib.util
    from pathlib import Path

    from harts_verl.ops.backends.triton_cache import limit_autotune

    path = Path(__file__).resolve().parents[1] / "gpu" / "autotune_sweep.py"
    spec = importlib.util.spec_from_file_location("autotune_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    lens = [37, 1, 30]
    q, k, v, g, beta_logits = _inputs(sum(lens), True, seed=21)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    h0 = 0.1 * torch.randn(len(lens), 2, 16, 16, generator=torch.Generator().manual_seed(22))
    name = "chunk_local_cumsum_vector_kernel"
    limit_autotune("first")
    try:
        out = sweep.run_sweep(
            fla_kernel,
            (q, k, v, g, torch.sigmoid(beta_logits)),
            h0,
            cu,
            {"use_qk_l2norm": True, "chunk_size": 32},
            kernels=(name,),
        )
    finally:
        limit_autotune("all")
    entry = out["kernels"][name]
    assert entry["configs"] >= 2 and entry["ran"] + entry["skipped"] == entry["configs"], out
    assert entry["ran"] >= 2 and len(set(out["forced"][name])) == entry["ran"], out
    assert list(out["kernels"]) == [name]
    assert not out["bad"] and not out["baseline_bad"], out
    assert max(entry["worst"].values()) <= 1e-5, entry
