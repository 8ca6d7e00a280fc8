"""Whole-model exactness: tree vs expanded (trajectory-wise) execution, float64 and bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _forked import forked_sequences

from harts_verl.models import HybridForCausalLM, preset
from harts_verl.runtime import ExpandedRunner, TreeRunner


def _forest_sequences(seed: int, vocab: int) -> list[list[int]]:
    """Shared prompt over > 2 chunks of 16, forks inside chunks (37, 40) and on a boundary
    (48), a prefix-of-another trajectory, an identical pair, a second root, a length-1
    trajectory."""
    return forked_sequences(
        seed, vocab, prompt=70, extension=40, forks=[(37, 30), (48, 20), (40, 9)], root=25
    )


def _loss_fn(n: int):
    w = torch.linspace(-1.0, 1.0, n, dtype=torch.float64)

    def loss(lps: list[torch.Tensor]) -> torch.Tensor:
        return sum((lp * w[i]).sum() + 0.1 * (lp**2).sum() for i, lp in enumerate(lps)) / 100.0

    return loss


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(ga: dict, gb: dict, rel: float = 1e-9) -> None:
    assert ga.keys() == gb.keys() and ga
    for n in gb:
        denom = gb[n].abs().max().item()
        err = (ga[n] - gb[n]).abs().max().item()
        assert err <= rel * max(denom, 1e-30), f"{n}: {err} vs scale {denom}"


def _check_model(
    model: torch.nn.Module, seqs, *, chunk_size: int, recompute: bool, capacity=None
) -> None:
    tree = TreeRunner(model, chunk_size=chunk_size, recompute=recompute, capacity_tokens=capacity)
    exp = ExpandedRunner(
        model, chunk_size=chunk_size, recompute=recompute, capacity_tokens=capacity
    )
    lt, et = tree.log_probs(seqs, temperature=0.7, with_entropy=True)
    le, ee = exp.log_probs(seqs, temperature=0.7, with_entropy=True)
    for i, s in enumerate(seqs):
        assert lt[i].shape == (len(s) - 1,)
        torch.testing.assert_close(lt[i], le[i], rtol=0, atol=1e-10)
        torch.testing.assert_close(et[i], ee[i], rtol=0, atol=1e-10)
    assert tree.last_stats.compact_tokens < exp.last_stats.compact_tokens
    loss = _loss_fn(len(seqs))
    model.zero_grad(set_to_none=True)
    out_t = tree.forward_backward(seqs, loss)
    gt = _grads(model)
    model.zero_grad(set_to_none=True)
    out_e = exp.forward_backward(seqs, loss)
    ge = _grads(model)
    assert abs(out_t["loss"] - out_e["loss"]) <= 1e-10 * max(1.0, abs(out_e["loss"]))
    _assert_grads_close(gt, ge)


@pytest.mark.parametrize("name", ["tiny", "kimi_tiny", "ling_tiny"])
@pytest.mark.parametrize("recompute", [False, True])
def test_native_model_tree_equals_expanded_float64(name, recompute):
    torch.manual_seed(0)
    cfg = preset(name, vocab_size=64, chunk_size=16)
    model = HybridForCausalLM.from_config(cfg).double()
    _check_model(model, _forest_sequences(1, 64), chunk_size=16, recompute=recompute)


def test_native_model_microbatched_float64():
    """Several microbatches (two-phase loss gradient) still equal the expanded run."""
    torch.manual_seed(1)
    cfg = preset("tiny", vocab_size=64, chunk_size=16, moe_layers=[])  # aux loss is per microbatch
    model = HybridForCausalLM.from_config(cfg).double()
    seqs = _forest_sequences(2, 64)
    _check_model(model, seqs, chunk_size=16, recompute=False, capacity=120)
    tree = TreeRunner(model, chunk_size=16, capacity_tokens=120)
    tree.log_probs(seqs)
    assert tree.last_stats.microbatches > 1


@pytest.mark.parametrize("separable", [False, True])
def test_moe_aux_loss_microbatched_same_partition(separable):
    """With MoE layers the router auxiliary loss is per microbatch (as HF's and veRL's), so it
    depends on the partition: run on the tree runner's partition (``last_stats.partition``),
    the expanded runner gives the same loss, aux loss and every gradient (float64); its own
    plan for the same capacity cuts the batch differently. ``aux_loss`` reports what entered
    the objective (0 without it, with one microbatch or several)."""
    torch.manual_seed(5)
    model = HybridForCausalLM.from_config(preset("tiny", vocab_size=64, chunk_size=16)).double()
    seqs = _forest_sequences(5, 64)
    loss_fn = _loss_fn(len(seqs))
    if separable:  # a per-trajectory sum
        loss_fn = lambda lps: sum((lp.sum() for lp in lps if lp is not None), torch.zeros(()))  # noqa: E731
    outs, grads = [], []
    tree = TreeRunner(model, chunk_size=16, capacity_tokens=120)
    expanded = ExpandedRunner(model, chunk_size=16, capacity_tokens=120)
    for run in (tree, expanded):
        kw = {"microbatches": tree.last_stats.partition} if run is expanded else {}
        model.zero_grad(set_to_none=True)
        outs.append(run.forward_backward(seqs, loss_fn, separable=separable, **kw))
        grads.append(_grads(model))
    assert outs[0]["microbatches"] > 1 and outs[0]["aux_loss"] > 0
    assert abs(outs[0]["aux_loss"] - outs[1]["aux_loss"]) <= 1e-12
    assert abs(outs[0]["loss"] - outs[1]["loss"]) <= 1e-10 * max(1.0, abs(outs[0]["loss"]))
    _assert_grads_close(grads[0], grads[1])
    own = expanded.forward_backward(seqs, loss_fn, separable=separable)
    assert [g.tolist() for g in expanded.last_stats.partition] != [
        g.tolist() for g in tree.last_stats.partition
    ]
    assert own["aux_loss"] != outs[0]["aux_loss"]
    for runner in (TreeRunner(model, chunk_size=16), tree):
        assert runner.forward_backward(seqs, loss_fn, include_aux_loss=False)["aux_loss"] == 0.0


def test_forward_backward_partition_validation():
    model = HybridForCausalLM.from_config(preset("tiny", vocab_size=64, chunk_size=16)).double()
    seqs = [[1, 2, 3], [1, 2, 4], [5]]
    runner = TreeRunner(model, chunk_size=16)
    loss = lambda lps: sum(lp.sum() for lp in lps)  # noqa: E731
    for bad, msg in (
        ([[0, 1]], "missing 1"),
        ([[0, 1], [1, 2]], "repeated 1"),
        ([[0, 1, 2, 3]], "out of range 1"),
        ([[0, 1], []], r"microbatches\[1\]: expected a non-empty"),
        ([[0.0, 1.0], [2]], r"microbatches\[0\]"),
    ):
        with pytest.raises(ValueError, match=msg):
            runner.forward_backward(seqs, loss, microbatches=bad)
    for bad in ([1.0, 2.0], 0.0, float("nan"), [1.0, -1.0, 1.0]):
        with pytest.raises(ValueError, match="temperature"):
            runner.forward_backward(seqs, loss, temperature=bad)
    out = runner.forward_backward(seqs, loss, microbatches=[[2], [0, 1]])
    assert out["microbatches"] == 2.0
    assert [g.tolist() for g in runner.last_stats.partition] == [[2], [0, 1]]


def test_partition_refuses_bools_among_indices_and_names_an_empty_microbatch():
    """A bool among a microbatch's indices is no trajectory index (numpy turned ``[0, True]``
    into ``[0, 1]``, which passed as trajectories 0 and 1), as ``subset`` and the planner's
    index checks refuse it; an empty microbatch is named as empty, not as "dtype float64"."""
    model = HybridForCausalLM.from_config(preset("tiny", vocab_size=64, chunk_size=16)).double()
    runner = TreeRunner(model, chunk_size=16)
    seqs = [[1, 2, 3], [1, 2, 4], [5]]
    loss = lambda lps: sum(lp.sum() for lp in lps)  # noqa: E731
    with pytest.raises(ValueError, match=r"microbatches\[0\]: .*got a bool"):
        runner.forward_backward(seqs, loss, microbatches=[[0, True], [2]])
    with pytest.raises(ValueError, match=r"microbatches\[1\]: .*got an empty one"):
        runner.forward_backward(seqs, loss, microbatches=[[0, 1, 2], []])


def test_per_trajectory_temperatures_float64():
    """One temperature per trajectory (microbatched, rows shared across temperatures): each
    trajectory's log-probs equal a run at its own temperature; the loss gradient equals the sum
    of per-temperature runs over the trajectories at that temperature."""
    torch.manual_seed(6)
    model = HybridForCausalLM.from_config(preset("tiny", vocab_size=64, chunk_size=16)).double()
    seqs = _forest_sequences(6, 64)
    temps = [(0.5, 1.0, 1.5)[i % 3] for i in range(len(seqs))]
    runner = TreeRunner(model, chunk_size=16, capacity_tokens=120)
    lps = runner.log_probs(seqs, temperature=temps)
    assert runner.last_stats.microbatches > 1
    for t in set(temps):
        ref = TreeRunner(model, chunk_size=16).log_probs(seqs, temperature=t)
        for i, ti in enumerate(temps):
            if ti == t:
                torch.testing.assert_close(lps[i], ref[i], rtol=0, atol=1e-12)

    def loss(lps):
        return sum((lp * (k + 1)).sum() for k, lp in enumerate(lps) if lp is not None) / 100.0

    model.zero_grad(set_to_none=True)
    runner.forward_backward(seqs, loss, temperature=temps, include_aux_loss=False)
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    for t in set(temps):
        idx = [i for i, ti in enumerate(temps) if ti == t]

        def part(lps, idx=idx):
            return loss([lp if i in idx else None for i, lp in enumerate(lps)])

        TreeRunner(model, chunk_size=16).forward_backward(
            seqs, part, temperature=t, include_aux_loss=False
        )
    _assert_grads_close(got, _grads(model))


def test_recompute_does_not_change_results():
    torch.manual_seed(2)
    model = HybridForCausalLM.from_config(preset("tiny", vocab_size=64, chunk_size=16)).double()
    seqs = _forest_sequences(3, 64)
    grads = []
    for rc in (False, True):
        model.zero_grad(set_to_none=True)
        TreeRunner(model, chunk_size=16, recompute=rc).forward_backward(seqs, _loss_fn(len(seqs)))
        grads.append(_grads(model))
    _assert_grads_close(grads[1], grads[0], rel=1e-12)


@pytest.mark.parametrize("recompute", [False, True])
def test_attention_key_rows_bound_does_not_change_results(recompute):
    """A runner whose layouts bound the attention key rows (below every microbatch's) gives
    the tree path's losses and gradients (float64), under per-layer recomputation too (the
    bucket checkpoints nest inside the layer's); bad bounds are refused by name."""
    torch.manual_seed(3)
    model = HybridForCausalLM.from_config(preset("tiny", vocab_size=64, chunk_size=16)).double()
    seqs = _forest_sequences(4, 64)
    out, grads = [], []
    for bound in (None, 8):
        model.zero_grad(set_to_none=True)
        runner = TreeRunner(
            model, chunk_size=16, recompute=recompute, capacity_tokens=150, attention_key_rows=bound
        )
        out.append(runner.forward_backward(seqs, _loss_fn(len(seqs)))["loss"])
        grads.append(_grads(model))
    assert abs(out[1] - out[0]) <= 1e-12 * max(1.0, abs(out[0]))
    _assert_grads_close(grads[1], grads[0], rel=1e-11)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="attention_key_rows"):
            TreeRunner(model, attention_key_rows=bad)


def test_runner_keeps_the_models_own_checkpointing_setting():
    """``recompute`` governs the runner's forwards; the model's own ``gradient_checkpointing``
    is what it was before (it used to be left at the runner's value)."""
    model = HybridForCausalLM.from_config(preset("tiny", vocab_size=64, chunk_size=16)).double()
    seqs = _forest_sequences(3, 64)
    seen = []
    model.register_forward_pre_hook(lambda m, _args: seen.append(m.gradient_checkpointing))
    model.gradient_checkpointing = True
    TreeRunner(model, chunk_size=16, recompute=False).forward_backward(seqs, _loss_fn(len(seqs)))
    assert seen == [False] and model.gradient_checkpointing is True
    model.gradient_checkpointing = False
    TreeRunner(model, chunk_size=16, recompute=True).log_probs(seqs)
    assert seen[1:] == [True] and model.gradient_checkpointing is False


def test_bf16_logit_cosine():
    """bf16 tree vs float64 expanded: mean logit cosine ≥ 0.9999 and no worse than expanded bf16."""
    torch.manual_seed(3)
    cfg = preset("tiny", vocab_size=64, chunk_size=16)
    ref_model = HybridForCausalLM.from_config(cfg).double()
    bf_model = HybridForCausalLM.from_config(cfg).to(torch.bfloat16)
    bf_model.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref_model.state_dict().items()})
    seqs = _forest_sequences(4, 64)
    ref = ExpandedRunner(ref_model, chunk_size=16).hidden_states(seqs)
    w = ref_model.lm_head.weight.detach()

    def mean_cos(hs):
        cs = [
            torch.nn.functional.cosine_similarity(h.double() @ w.T, r @ w.T, dim=-1)
            for h, r in zip(hs, ref)
        ]
        return torch.cat(cs).mean().item()

    cos_tree = mean_cos(TreeRunner(bf_model, chunk_size=16).hidden_states(seqs))
    cos_exp = mean_cos(ExpandedRunner(bf_model, chunk_size=16).hidden_states(seqs))
    assert cos_tree >= 0.9999
    assert cos_tree >= cos_exp - 1e-5


def _tiny_qwen3_next():
    pytest.importorskip("transformers")
    from harts_verl.workers.testing import tiny_hf_model

    return tiny_hf_model("qwen3_next", seed=5).double().eval()


def _hf_log_probs(model, seq) -> torch.Tensor:
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
    return torch.log_softmax(logits.double(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]


def _float64_gdn_kernel(
    query,
    key,
    value,
    g,
    beta,
    chunk_size=64,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    **_,
):
    """HF's torch fallback casts to float32; this keeps its signature in float64."""
    from harts_verl.ops.linear_attention import chunk_delta_rule_varlen

    outs = []
    for b in range(query.shape[0]):
        t = query.shape[1]
        res = chunk_delta_rule_varlen(
            query[b],
            key[b],
            value[b],
            g[b].to(value.dtype),
            beta[b].to(value.dtype),
            cu_seqlens=torch.tensor([0, t]),
            chunk_size=chunk_size,
            use_qk_l2norm=use_qk_l2norm_in_kernel,
        )
        outs.append(res.o)
    return torch.stack(outs), None


def test_qwen3_next_tree_equals_hf_per_trajectory(no_fla):
    """Tree log-probs vs HF's own per-trajectory forward of the same float64 model. HF's torch
    fallback kernel runs the gated delta rule in float32 and HF casts A_log/a to float32 for the
    gate, which bounds the agreement; with a float64 kernel in HF's place only the gate cast
    remains."""
    model = _tiny_qwen3_next()
    seqs = _forest_sequences(6, 64)
    tree_lp = TreeRunner(model, chunk_size=64).log_probs(seqs)
    hf32 = [_hf_log_probs(model, s) for s in seqs]
    for a, b in zip(tree_lp, hf32):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for mod in model.modules():
        if type(mod).__name__ == "Qwen3NextGatedDeltaNet":
            mod.chunk_gated_delta_rule = _float64_gdn_kernel
    hf64 = [_hf_log_probs(model, s) for s in seqs]
    for a, b in zip(tree_lp, hf64):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_qwen3_next_float32_tree_equals_hf(no_fla):
    """In float32 (a production dtype) the adapter's formulas are HF's own, bit for bit; the
    tree path matches HF's per-trajectory forward to kernel rounding."""
    model = _tiny_qwen3_next().float()
    seqs = _forest_sequences(8, 64)
    tree_lp = TreeRunner(model, chunk_size=64).log_probs(seqs)
    for a, s in zip(tree_lp, seqs):
        torch.testing.assert_close(a.double(), _hf_log_probs(model, s), rtol=0, atol=2e-5)


@pytest.mark.parametrize("recompute", [False, True])
def test_qwen3_next_tree_equals_expanded_float64(hf_float64, recompute):
    model = _tiny_qwen3_next()
    _check_model(model, _forest_sequences(7, 64), chunk_size=16, recompute=recompute)


def test_separable_microbatched_loss_equals_single_pass():
    torch.manual_seed(9)
    model = HybridForCausalLM.from_config(
        preset("tiny", vocab_size=64, chunk_size=16, moe_layers=[])
    ).double()
    seqs = _forest_sequences(10, 64)
    w = torch.linspace(0.5, 1.5, len(seqs), dtype=torch.float64)

    def loss(lps):
        return sum((lp * w[i]).sum() for i, lp in enumerate(lps) if lp is not None)

    grads = []
    for cap, sep in ((None, False), (120, True)):
        model.zero_grad(set_to_none=True)
        r = TreeRunner(model, chunk_size=16, capacity_tokens=cap)
        r.forward_backward(seqs, loss, separable=sep)
        grads.append(_grads(model))
    _assert_grads_close(grads[1], grads[0])


def _dense_tiny_float64(seed: int) -> torch.nn.Module:
    """The ``tiny`` preset without MoE (vocabulary 64, chunk 16), float64, seeded."""
    torch.manual_seed(seed)
    cfg = preset("tiny", vocab_size=64, chunk_size=16, moe_layers=[])
    return HybridForCausalLM.from_config(cfg).double()


@pytest.mark.parametrize("runner_cls", [TreeRunner, ExpandedRunner])
def test_loss_that_edits_its_list_gets_the_same_gradients_microbatched(runner_cls):
    """A loss_fn may rewrite or reorder the list it is given: with several microbatches (the
    two-phase gradient) every trajectory's gradient still reaches its own log-probs, as with
    one microbatch (it was halved for ``lps[i] = 2 * lps[i]`` and sent to the wrong trajectory
    after ``lps.reverse()``)."""
    model = _dense_tiny_float64(11)
    seqs = _forest_sequences(12, 64)
    w = torch.linspace(-1.0, 2.0, len(seqs), dtype=torch.float64)

    def rewrite(lps):
        for i in range(len(lps)):
            lps[i] = 2.0 * lps[i]
        return sum((lp * w[i]).sum() for i, lp in enumerate(lps))

    def reorder(lps):
        lps.reverse()
        return sum((lp * w[len(lps) - 1 - i]).sum() ** 2 for i, lp in enumerate(lps)) / 1e3

    for loss in (rewrite, reorder):
        _one_vs_several_microbatches(runner_cls, model, seqs, loss)


def _one_vs_several_microbatches(runner_cls, model, seqs, loss, extra=(), **kwargs) -> None:
    """``forward_backward`` of ``loss`` in one microbatch and in several (capacity 120) give
    the same loss value and gradients, the model's and the ``extra`` tensors' (each must get
    one)."""
    grads, values = [], []
    for cap in (None, 120):
        model.zero_grad(set_to_none=True)
        for t in extra:
            t.grad = None
        r = runner_cls(model, chunk_size=16, capacity_tokens=cap)
        values.append(r.forward_backward(seqs, loss, **kwargs)["loss"])
        assert (r.last_stats.microbatches > 1) == (cap is not None)
        grads.append({**_grads(model), **{f"extra{i}": t.grad for i, t in enumerate(extra)}})
    assert all(g is not None for g in grads[1].values())
    assert abs(values[1] - values[0]) <= 1e-10 * max(1.0, abs(values[0]))
    _assert_grads_close(grads[1], grads[0])


@pytest.mark.parametrize("runner_cls", [TreeRunner, ExpandedRunner])
def test_loss_terms_beyond_log_probs_get_their_gradients_microbatched(runner_cls):
    """A loss may reach other tensors than the log-probs: a learned baseline outside the model,
    a penalty on the model's parameters. With several microbatches (the two-phase gradient)
    they get the same gradients as with one (the baseline got none, the penalty's share of
    every parameter's gradient was lost)."""
    model = _dense_tiny_float64(13)
    seqs = _forest_sequences(14, 64)
    rewards = torch.linspace(-1.0, 1.0, len(seqs), dtype=torch.float64)
    baseline = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))

    def loss(lps):
        pg = -sum((r - baseline).detach() * lp.sum() for r, lp in zip(rewards, lps)) / 100.0
        value = ((rewards - baseline) ** 2).mean()
        return pg + value + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())

    _one_vs_several_microbatches(
        runner_cls, model, seqs, loss, extra=(baseline,), include_aux_loss=False
    )


def _tiny_float64(seed: int, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = preset("tiny", vocab_size=32, chunk_size=4, **overrides)
    return HybridForCausalLM.from_config(cfg).double()


_P = [5, 9, 1, 30, 2, 2, 7, 11, 4, 0, 19]
_ODD_BATCHES = {
    "single": ([_P], None),
    "one_token_only": ([[3], [3], [5]], None),
    "dups_prefixes_one_token": ([_P, _P, _P[:5], [_P[0]], [*_P[:9], 1, 2]], None),
    "capacity_below_one_trajectory": ([_P, _P, _P[:5], [3], [*_P[:9], 1, 2]], 4),
    "capacity_one": ([_P[:6], [3], [3], _P[:2]], 1),
}


@pytest.mark.parametrize("case", sorted(_ODD_BATCHES))
def test_odd_batches_tree_equals_expanded_float64(case):
    """Legal odd batches: tree == expanded (≤ 1e-10 log-probs/entropies/hidden states/loss,
    ≤ 1e-9 relative gradients), with one-token trajectories giving empty log-probs."""
    seqs, cap = _ODD_BATCHES[case]
    model = _tiny_float64(11, moe_layers=[])  # the aux loss is per microbatch
    w = torch.linspace(-1.0, 1.0, len(seqs), dtype=torch.float64)

    def loss(lps):  # a sum of per-trajectory terms (None: another microbatch's)
        terms = [
            (lp * w[i]).sum() + 0.1 * (lp**2).sum() for i, lp in enumerate(lps) if lp is not None
        ]
        return sum(terms) / 10.0

    for chunk in (1, 4):
        tree = TreeRunner(model, chunk_size=chunk, capacity_tokens=cap, rows_per_chunk=1)
        exp = ExpandedRunner(model, chunk_size=chunk, capacity_tokens=cap, rows_per_chunk=1)
        lt, et = tree.log_probs(seqs, temperature=0.7, with_entropy=True)
        le, ee = exp.log_probs(seqs, temperature=0.7, with_entropy=True)
        ht, he = tree.hidden_states(seqs), exp.hidden_states(seqs)
        for i, s in enumerate(seqs):
            assert lt[i].shape == et[i].shape == (len(s) - 1,)
            assert ht[i].shape[0] == len(s)
            torch.testing.assert_close(lt[i], le[i], rtol=0, atol=1e-10)
            torch.testing.assert_close(et[i], ee[i], rtol=0, atol=1e-10)
            torch.testing.assert_close(ht[i], he[i], rtol=0, atol=1e-10)
        for separable in (False, True):
            out, grads = [], []
            for runner in (tree, exp):
                model.zero_grad(set_to_none=True)
                out.append(runner.forward_backward(seqs, loss, separable=separable)["loss"])
                grads.append(_grads(model))
            assert abs(out[0] - out[1]) <= 1e-10
            assert grads[0].keys() == grads[1].keys()
            for n in grads[1]:
                err = (grads[0][n] - grads[1][n]).abs().max().item()
                assert err <= 1e-9 * grads[1][n].abs().max().item() + 1e-15, n


def test_empty_batch():
    """No trajectories: empty results from the inference calls; a training step on nothing is
    refused with a ValueError (not a reshape error from inside the model)."""
    model = _tiny_float64(12)
    for runner_cls in (TreeRunner, ExpandedRunner):
        runner = runner_cls(model, chunk_size=4, capacity_tokens=8)
        assert runner.log_probs([]) == []
        assert runner.log_probs([], with_entropy=True) == ([], [])
        assert runner.hidden_states([]) == []
        assert runner.last_stats.semantic_tokens == 0
        with pytest.raises(ValueError, match="sequences"):
            runner.forward_backward([], _loss_fn(1))
        with pytest.raises(ValueError, match="temperature"):  # checked for an empty batch too
            runner.log_probs([], temperature=-1.0)


def test_token_ids_outside_the_vocabulary_name_the_trajectory():
    model = _tiny_float64(13)  # vocabulary 32
    seqs = [[1, 2, 3], [1, 2, 32, 4]]
    for runner_cls in (TreeRunner, ExpandedRunner):
        runner = runner_cls(model, chunk_size=4)
        match = r"sequences\[1\]: token id 32 .*vocabulary"
        with pytest.raises(ValueError, match=match):
            runner.log_probs(seqs)
        with pytest.raises(ValueError, match=match):
            runner.hidden_states(seqs)
        with pytest.raises(ValueError, match=match):
            runner.forward_backward(seqs, _loss_fn(2))


def test_runner_argument_validation():
    model = _tiny_float64(14)
    seqs = [[1, 2, 3], [1, 2, 4]]
    ref = TreeRunner(model, chunk_size=4, capacity_tokens=8).log_probs(seqs)
    got = TreeRunner(model, chunk_size=np.int64(4), capacity_tokens=np.int32(8)).log_probs(seqs)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for kwargs, match in (
        ({"chunk_size": True}, "chunk_size"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 4.0}, "chunk_size"),
        ({"capacity_tokens": True}, "capacity_tokens"),
        ({"capacity_tokens": -1}, "capacity_tokens"),
        ({"rows_per_chunk": 0}, "rows_per_chunk"),
        ({"rows_per_chunk": 2.5}, "rows_per_chunk"),
    ):
        with pytest.raises(ValueError, match=match):
            TreeRunner(model, **kwargs)
    from harts_verl.ops.layout import TreeLayout
    from harts_verl.tree import RolloutForest

    forest = RolloutForest.from_sequences(seqs)
    assert TreeLayout(forest, chunk_size=np.int64(4)).chunk_size == 4  # numpy ints as in runner
    for bad in (True, 0, 4.0, 4097, 2**64):  # past 4096: [chunk, chunk] blocks per head
        with pytest.raises(ValueError, match="chunk_size"):
            TreeLayout(forest, chunk_size=bad)
        with pytest.raises(ValueError, match="chunk_size"):
            TreeRunner(model, chunk_size=bad)
    assert TreeLayout(forest, chunk_size=4096).chunk_size == 4096


def test_loss_independent_of_log_probs_gives_zero_gradients():
    """A loss that does not read the log-probs (e.g. a constant) trains nothing: zero gradients
    on the single-pass and on the multi-microbatch (non-separable) path, no error."""
    model = _tiny_float64(16)
    seqs = [[1, 2, 3, 5], [1, 2, 4], [7, 8, 9, 10]]
    for cap in (None, 4):
        model.zero_grad(set_to_none=True)
        runner = TreeRunner(model, chunk_size=4, capacity_tokens=cap)
        out = runner.forward_backward(
            seqs, lambda lps: torch.tensor(1.5, dtype=torch.float64), include_aux_loss=False
        )
        assert out["loss"] == 1.5
        for p in model.parameters():
            assert p.grad is None or float(p.grad.abs().max()) == 0.0


def test_loss_fn_must_return_a_scalar_tensor():
    model = _tiny_float64(15)
    seqs = [[1, 2, 3], [1, 2, 4]]
    for cap in (None, 3):
        runner = TreeRunner(model, chunk_size=4, capacity_tokens=cap)
        with pytest.raises(TypeError, match="loss_fn"):
            runner.forward_backward(seqs, lambda lps: 0.0)
        with pytest.raises(TypeError, match="loss_fn"):
            runner.forward_backward(
                seqs, lambda lps: torch.cat([lp for lp in lps if lp is not None])
            )


def test_separable_loss_may_return_a_constant_for_a_microbatch():
    """A separable loss over some trajectories returns ``sum()`` = 0 for a microbatch holding
    none of them: taken as a constant (no gradient), so the result does not depend on how the
    capacity cuts the batch (it was a TypeError with several microbatches only)."""
    model = _tiny_float64(17)
    seqs = [[1, 2, 3, 5], [1, 2, 4], [7, 8, 9, 10]]

    def loss(lps):  # trajectory 2 only
        return sum(lps[i].sum() for i in (2,) if lps[i] is not None)

    grads, values = [], []
    for cap in (None, 4):
        model.zero_grad(set_to_none=True)
        runner = TreeRunner(model, chunk_size=4, capacity_tokens=cap)
        out = runner.forward_backward(seqs, loss, separable=True, include_aux_loss=False)
        assert (runner.last_stats.microbatches > 1) == (cap is not None)
        values.append(out["loss"])
        grads.append(_grads(model))
    assert abs(values[1] - values[0]) <= 1e-12 * max(1.0, abs(values[0]))
    _assert_grads_close(grads[1], grads[0])
    with pytest.raises(TypeError, match="loss_fn: expected a scalar tensor, got bool"):
        TreeRunner(model, chunk_size=4).forward_backward(seqs, lambda lps: True, separable=True)
    with pytest.raises(TypeError, match="loss_fn: expected a finite number, got an int of"):
        TreeRunner(model, chunk_size=4).forward_backward(seqs, lambda lps: 10**400, separable=True)


@pytest.mark.parametrize("name", ["tiny", "bench", "kimi_tiny", "ling_tiny"])
def test_native_flop_model_matches_the_module_tree(name):
    """Row-wise FLOPs per token of the native model = 2 × (every Linear / short-conv weight,
    routed experts counted top-k times); the three Kimi-Linear switches (no output-gate bias, an
    ungated shared expert, NoPE MLA) change what the model holds and the count with it."""
    from harts_verl.models.layers import MoEFFN
    from harts_verl.models.mixers import ShortConv
    from harts_verl.runtime.flops import native_model_shape

    cfg = preset(name)
    model = HybridForCausalLM.from_config(cfg)
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear | ShortConv):
            total += m.weight.numel()
        elif isinstance(m, MoEFFN):  # one expert's weights, top-k experts per token
            one = sum(w[0].numel() for w in (m.w_gate, m.w_up, m.w_down))
            total += cfg.num_experts_per_tok * one
    assert native_model_shape(cfg).dense_per_token == pytest.approx(2.0 * total, rel=1e-12)


def test_model_and_op_inputs_are_checked_by_name():
    """Direct calls of the native model and of the tree linear-attention op name the bad input
    (instead of failing deep inside an embedding or a gather)."""
    from harts_verl.ops.layout import TreeLayout
    from harts_verl.tree import RolloutForest

    cfg = preset("tiny")
    model = HybridForCausalLM(cfg).double()
    forest = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4]])
    layout = TreeLayout(forest, chunk_size=2)
    ids = layout.token_ids
    with pytest.raises(TypeError, match="layout: expected a TreeLayout"):
        model(ids, forest)
    with pytest.raises(TypeError, match="input_ids: expected integer"):
        model(ids.double(), layout)
    with pytest.raises(ValueError, match=f"token id {cfg.vocab_size} is outside"):
        model(torch.tensor([1, 2, cfg.vocab_size, 4]), layout)
    with pytest.raises(ValueError, match="token id -1 is outside"):
        model(torch.tensor([1, 2, -1, 4]), layout)
    with pytest.raises(ValueError, match=r"input_ids: expected \[C\]"):
        model(ids[None], layout)
    with pytest.raises(TypeError, match="preset"):
        HybridForCausalLM.from_config("tiny")
    c = layout.num_rows
    q = torch.zeros(c, 2, 4, dtype=torch.float64)
    g, beta = torch.zeros(c, 2, dtype=torch.float64), torch.full((c, 2), 0.5, dtype=torch.float64)
    assert layout.linear_attention(q, q, q, g, beta).shape == (c, 2, 4)
    with pytest.raises(ValueError, match=r"q: expected \[C, H, K\], got shape \(4, 8\)"):
        layout.linear_attention(q.reshape(c, 8), q, q, g, beta)
    with pytest.raises(ValueError, match=r"beta: expected \[C, H\]"):
        layout.linear_attention(q, q, q, g, beta[..., None])


def test_forward_backward_refuses_to_train_nothing():
    """Under torch.no_grad() / inference_mode, or with every parameter frozen, forward_backward
    raises the same clear RuntimeError on every path (one microbatch, separable, coupled)
    before any work, instead of returning a loss with no gradients."""
    model = _tiny_float64(0)
    seqs = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9]]

    def loss(lps):
        return sum(x.sum() for x in lps if x is not None)

    for cap, sep in ((None, False), (4, True), (4, False)):
        runner = TreeRunner(model, capacity_tokens=cap)
        for ctx in (torch.no_grad, torch.inference_mode):
            with ctx(), pytest.raises(RuntimeError, match="gradients are disabled"):
                runner.forward_backward(seqs, loss, separable=sep)
        assert all(p.grad is None for p in model.parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(RuntimeError, match="no parameter of the model requires a gradient"):
        TreeRunner(model, capacity_tokens=4).forward_backward(seqs, loss)
    next(model.parameters()).requires_grad_(True)  # one trainable tensor is enough
    TreeRunner(model, capacity_tokens=4).forward_backward(seqs, loss)
    assert next(model.parameters()).grad is not None


def test_oversize_trajectories_are_counted_and_warned_once(caplog):
    """A trajectory longer than capacity_tokens runs whole (same log-probs as without a
    capacity), the runner WARNs once and last_stats counts such trajectories per call."""
    model = _tiny_float64(1)
    seqs = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [1, 2, 9], [4, 5]]
    ref = TreeRunner(model).log_probs(seqs)
    runner = TreeRunner(model, capacity_tokens=4)
    with caplog.at_level("WARNING", logger="harts_verl.runtime.runner"):
        got = runner.log_probs(seqs)
        assert runner.last_stats.oversize_trajectories == 2
        runner.log_probs(seqs)
    warned = [r for r in caplog.records if "longer than capacity_tokens=4" in r.getMessage()]
    assert len(warned) == 1
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b) or torch.allclose(a, b, atol=1e-12, rtol=0)
    runner.log_probs([[1, 2, 9], [4, 5]])
    assert runner.last_stats.oversize_trajectories == 0
    assert TreeRunner(model).last_stats.oversize_trajectories == 0
    caplog.clear()
    quiet = TreeRunner(model, capacity_tokens=4, warn_oversize=False)
    with caplog.at_level("WARNING", logger="harts_verl.runtime.runner"):
        quiet.log_probs(seqs)
    assert quiet.last_stats.oversize_trajectories == 2  # counted, not logged
    assert not [r for r in caplog.records if "longer than capacity_tokens" in r.getMessage()]


def test_lora_on_the_lm_head_is_refused_and_elsewhere_exact(no_fla):
    """A peft LoRA adapter on lm_head would be bypassed by the compact head (which reads the
    head's weight): TreeRunner refuses it by name. An adapter on the attention projections
    runs exactly (tree log-probs = HF's forward of the adapted model per trajectory), whether
    the runner gets the PeftModel or its base model."""
    peft = pytest.importorskip("peft")
    from harts_verl.workers.testing import tiny_hf_model

    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 7], [1, 2]]
    for targets, refused in ((["lm_head", "q_proj"], True), (["q_proj", "v_proj"], False)):
        model = tiny_hf_model("llama", seed=0).double().eval()
        cfg = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False
        )
        wrapped = peft.get_peft_model(model, cfg)
        hf = wrapped.get_base_model()
        if refused:
            for m in (hf, wrapped):
                with pytest.raises(TypeError, match=r"lm_head: expected a plain torch.nn.Linear"):
                    TreeRunner(m)
            continue
        direct = TreeRunner(wrapped).log_probs(seqs)  # the PeftModel itself: its base model
        with torch.no_grad():
            got = TreeRunner(hf, chunk_size=2).log_probs(seqs)
            for s, lp in zip(seqs, got, strict=True):
                ids = torch.tensor([s])
                logits = hf(ids, use_cache=False).logits[0]
                ref = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
                assert (lp - ref).abs().max().item() <= 1e-10
            for a, b in zip(direct, got, strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_gated_attention_dropout_in_training_is_refused(no_fla, kind):
    """Qwen3-Next / Qwen3.5 gated attention drops attention weights per call in training: tree
    mode refuses it (a shared row would share its mask) and runs it in eval mode."""
    from harts_verl.workers.testing import tiny_hf_config, tiny_hf_model

    cfg = tiny_hf_config(kind)
    cfg.attention_dropout = 0.5
    model = type(tiny_hf_model(kind))(cfg).double().train()
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 7]]
    with pytest.raises(NotImplementedError, match=r"attention dropout \(0.5\)"):
        TreeRunner(model).forward_backward(seqs, lambda lps: sum(x.sum() for x in lps))
    model.eval()
    with torch.no_grad():
        TreeRunner(model).log_probs(seqs)


@pytest.mark.parametrize("kind", ["qwen3_next", "jamba"])
def test_lora_on_a_short_conv_is_refused(no_fla, kind):
    """A peft LoRA adapter on a depthwise conv (whose weight the tree conv reads) is refused by
    name instead of silently computing the un-adapted conv."""
    peft = pytest.importorskip("peft")
    from harts_verl.workers.testing import tiny_hf_model

    model = tiny_hf_model(kind, seed=0).double().eval()
    groups = next(m for n, m in model.named_modules() if n.endswith("conv1d")).groups
    cfg = peft.LoraConfig(r=groups, target_modules=["conv1d"], lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, cfg)
    with (
        torch.no_grad(),
        pytest.raises(TypeError, match=r"conv1d: expected a plain torch.nn.Conv1d"),
    ):
        TreeRunner(wrapped).log_probs([[1, 2, 3, 4], [1, 2, 5]])


def test_expanded_runner_packs_as_verl():
    """The trajectory-wise runner (the bench's baseline) plans veRL's dynamic batching: the
    fewest microbatches the tokens allow (it planned by halving, up to a third more)."""
    from harts_verl.tree import RolloutForest
    from harts_verl.tree.microbatch import token_balanced_microbatches

    model = HybridForCausalLM.from_config(preset("tiny", vocab_size=64, chunk_size=16)).double()
    seqs = _forest_sequences(7, 64)
    forest = RolloutForest.expanded(seqs)
    runner = ExpandedRunner(model, chunk_size=16, capacity_tokens=150)
    plan = runner.plan(forest)
    assert len(plan) == -(-forest.num_semantic_tokens // 150)
    assert [p.tolist() for p in plan] == [
        b.tolist() for b in token_balanced_microbatches(forest.lengths, 150)
    ]


def test_planner_options_reach_the_tree_plan():
    """``planner_options`` go to plan_microbatches (here: the natural partition alone, which
    cuts the batch where the default search does not) and leave the numbers exact; bad ones
    fail at construction, naming the option."""
    from harts_verl.tree import RolloutForest, plan_microbatches

    model = _tiny_float64(15)
    seqs = _forest_sequences(3, 32)
    forest = RolloutForest.from_sequences(seqs)
    opts = {"strategies": ("natural",), "improve": False}
    cap = 110
    want = plan_microbatches(forest, capacity_tokens=cap, allow_oversize=True, **opts)
    default = plan_microbatches(forest, capacity_tokens=cap, allow_oversize=True)
    assert want.total_compact_tokens > default.total_compact_tokens  # the options matter here
    tree = TreeRunner(model, chunk_size=4, capacity_tokens=cap, planner_options=opts)
    got = tree.log_probs(seqs)
    assert tree.last_stats.compact_tokens == want.total_compact_tokens
    ref = ExpandedRunner(model, chunk_size=4).log_probs(seqs)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for bad, err, match in (
        ({"foo": 1}, TypeError, "foo"),
        ({"max_search_cells": -1}, ValueError, "max_search_cells"),
        ({"capacity_tokens": 5}, ValueError, "capacity_tokens"),
        ([("improve", False)], TypeError, "planner_options"),
    ):
        with pytest.raises(err, match=match):
            TreeRunner(model, capacity_tokens=cap, planner_options=bad)
