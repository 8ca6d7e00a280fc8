"""Whole models over random rollout forests (hypothesis, bounded): tree execution equals
trajectory-wise execution for forests the fixed cases do not spell out — forks anywhere, several
roots, duplicates, prefixes, one-token trajectories — at random chunk sizes, capacities
(micro-batches, down to one token), with and without recomputation, separable or not.

- native hybrids (``tiny``, ``kimi_tiny``, ``ling_tiny``; float64): tree vs ``ExpandedRunner``,
  log-probs and entropies ≤ 1e-10, loss ≤ 1e-10, every gradient ≤ 1e-9 relative;
- every tiny HF kind (float64 with the family's float32 islands lifted): tree vs HF's own
  per-trajectory forward / backward, log-probs and entropies ≤ 1e-9, gradients ≤ 1e-9 relative.
"""

from __future__ import annotations

import sys

import pytest
import torch
from _hf_float64 import (
    lift_float32_islands,
    lift_full_attention_islands,
    lift_lightning_decay_tables,
    lift_recurrent_hybrid_islands,
    spread_state_space_params,
    spread_weights,
    trajectory_loss,
)
from _strategies import shared_sequences
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harts_verl.models import HybridForCausalLM, preset
from harts_verl.models.adapter import FULL_ATTENTION_MODEL_TYPES, HYBRID_MODEL_TYPES
from harts_verl.runtime import ExpandedRunner, TreeRunner
from harts_verl.workers.testing import TINY_KINDS, tiny_hf_config, tiny_hf_model

_NATIVE: dict[str, torch.nn.Module] = {}
_HF: dict[str, torch.nn.Module] = {}


def _native(name: str) -> torch.nn.Module:
    if name not in _NATIVE:
        torch.manual_seed(3)
        # tiny without MoE so that micro-batching leaves the (per-micro-batch) aux loss alone
        extra = {"moe_layers": []} if name == "tiny" else {}
        cfg = preset(name, vocab_size=16, chunk_size=4, **extra)
        _NATIVE[name] = HybridForCausalLM.from_config(cfg).double()
    return _NATIVE[name]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys() and ref
    for name, g in ref.items():
        scale = g.abs().max().item()
        err = (got[name] - g).abs().max().item()
        # absolute floor: a gradient that is 0 in exact math (e.g. keys seen only by a query
        # that attends to itself alone) holds rounding residue on both sides
        assert err <= max(1e-9 * scale, 1e-12), f"{name}: {err} vs scale {scale}"


@settings(max_examples=25, deadline=None)
@given(
    seqs=shared_sequences(max_new=10, max_ext=12),
    name=st.sampled_from(["tiny", "kimi_tiny", "ling_tiny"]),
    chunk=st.integers(1, 9),
    capacity=st.one_of(st.none(), st.integers(1, 60)),
    recompute=st.booleans(),
    separable=st.booleans(),
)
def test_native_tree_equals_expanded_float64(seqs, name, chunk, capacity, recompute, separable):
    model = _native(name)
    if name != "tiny":
        capacity = None  # their MoE aux loss is per micro-batch: one micro-batch each
    kw = dict(chunk_size=chunk, capacity_tokens=capacity, recompute=recompute)
    tree, exp = TreeRunner(model, **kw), ExpandedRunner(model, **kw)
    lt, et = tree.log_probs(seqs, temperature=0.7, with_entropy=True)
    le, ee = exp.log_probs(seqs, temperature=0.7, with_entropy=True)
    assert len(lt) == len(seqs)
    for i, s in enumerate(seqs):
        assert lt[i].shape == et[i].shape == (len(s) - 1,)
        torch.testing.assert_close(lt[i], le[i], rtol=0, atol=1e-10)
        torch.testing.assert_close(et[i], ee[i], rtol=0, atol=1e-10)
    assert tree.last_stats.compact_tokens <= exp.last_stats.compact_tokens
    if all(len(s) == 1 for s in seqs):
        return  # nothing to train
    out, grads = [], []
    for runner in (tree, exp):
        model.zero_grad(set_to_none=True)
        out.append(runner.forward_backward(seqs, trajectory_loss, separable=separable)["loss"])
        grads.append(_grads(model))
    assert abs(out[0] - out[1]) <= 1e-10 * max(1.0, abs(out[1]))
    _assert_grads_close(grads[0], grads[1])


def _hf_lift(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The float32 islands of ``kind``'s family computed in float64 (``_hf_float64``)."""
    monkeypatch.setitem(sys.modules, "fla", None)
    model_type = tiny_hf_config(kind).model_type
    if model_type in FULL_ATTENTION_MODEL_TYPES:
        lift_full_attention_islands(monkeypatch)
    elif model_type in HYBRID_MODEL_TYPES:
        lift_float32_islands(monkeypatch)
    else:
        lift_recurrent_hybrid_islands(monkeypatch)


def _hf(kind: str) -> torch.nn.Module:
    """A float64 tiny model of ``kind``: weights N(0, 0.2²) (norm weights 1 ± 0.2), state-space
    parameters in their own ranges (``spread_state_space_params``), MiniMax's decay tables in
    float64."""
    if kind not in _HF:
        model = spread_weights(tiny_hf_model(kind, seed=2).double().eval(), 2)
        lift_lightning_decay_tables(model)
        _HF[kind] = spread_state_space_params(model, 2)
    return _HF[kind]


@settings(max_examples=40, deadline=None)
@example(seqs=[[10, 0]], kind="qwen3_5", chunk=1, capacity=None, recompute=False, separable=False)
@given(
    seqs=shared_sequences(max_new=5, max_ext=8),
    chunk=st.sampled_from([1, 3, 16, 64]),
    capacity=st.one_of(st.none(), st.integers(1, 40)),
    recompute=st.booleans(),
    separable=st.booleans(),
    kind=st.sampled_from(TINY_KINDS),
)
def test_hf_tree_equals_hf_per_trajectory_float64(
    seqs, chunk, capacity, recompute, separable, kind
):
    model = _hf(kind)
    with pytest.MonkeyPatch.context() as mp:
        _hf_lift(kind, mp)
        runner = TreeRunner(model, chunk_size=chunk, capacity_tokens=capacity, recompute=recompute)
        with torch.no_grad():
            lps, ents = runner.log_probs(seqs, with_entropy=True)
        model.zero_grad(set_to_none=True)
        ref_lps = []
        for s, lp, ent in zip(seqs, lps, ents, strict=True):
            ids = torch.tensor([s])
            logp = torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)[:-1]
            ref_lps.append(logp.gather(1, ids[0, 1:, None])[:, 0])
            torch.testing.assert_close(lp, ref_lps[-1].detach(), rtol=0, atol=1e-9)
            torch.testing.assert_close(
                ent, -(logp.exp() * logp).sum(-1).detach(), rtol=0, atol=1e-9
            )
        if all(len(s) == 1 for s in seqs):
            return  # nothing to train
        ref_loss = trajectory_loss(ref_lps)
        ref_loss.backward()
        ref = _grads(model)
        model.zero_grad(set_to_none=True)
        out = runner.forward_backward(seqs, trajectory_loss, separable=separable)
        assert abs(out["loss"] - ref_loss.item()) <= 1e-10 * max(1.0, abs(ref_loss.item()))
        _assert_grads_close(_grads(model), ref)
