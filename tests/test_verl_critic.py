"""The critic through ``harts_fsdp2`` (``HartsFSDPValueEngine``) vs veRL's stock fsdp2 value-head
engine on CPU (gloo, FSDP2, fp32, tiny token classifiers with one label).

Parity: values at every position ≤ 1e-6 relative, veRL's ``value_loss`` grad_norm ≤ 1e-6
relative, its metrics per veRL micro-batch and parameters after one SGD step ≤ 1e-6, on a multi-turn tree batch with several
micro-batches; the tree path runs (``harts/fallback`` = 0) and each shared row once."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from _verl_cpu import assert_stock_metrics

pytest.importorskip("verl")

VOCAB = 64
KINDS = ("qwen2", "qwen3_next", "qwen3_moe", "minimax")
# Stock references that run padded rows: HF's linear-attention torch fallback (no fla) and
# MiniMax's lightning attention would carry state across packed rows.
_PADDED = ("qwen3_next", "minimax")


@pytest.fixture(scope="module")
def critics(tmp_path_factory):
    from _verl_cpu import verl_cpu_process

    testing = verl_cpu_process()
    root = tmp_path_factory.mktemp("critics")
    return testing, {k: testing.save_tiny_value_model(k, str(root / k), seed=5) for k in KINDS}


def _tree_batch(seed: int):
    """Shared task prompt, a first turn and tool output, three branches (one continues for two
    more turns), plus a second task with two samples; tool tokens are masked."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 15).tolist()
    t1, tool = rng.integers(0, VOCAB, 7).tolist(), rng.integers(0, VOCAB, 5).tolist()
    base = prompt + t1 + tool
    b = [rng.integers(0, VOCAB, n).tolist() for n in (9, 12, 6)]
    more = rng.integers(0, VOCAB, 8).tolist()
    p2, r2 = rng.integers(0, VOCAB, 11).tolist(), rng.integers(0, VOCAB, 10).tolist()
    seqs = [base + b[0], base + b[1], base + b[2] + more, p2 + r2, p2 + r2[:4]]
    plens = [15, 15, 15, 11, 11]
    spans = [(i, 7, 12) for i in range(3)]
    return seqs, plens, spans


def _run(testing, path, strategy, *, padded, harts=None, loss_agg_mode="token-mean"):
    from verl.workers.utils.losses import value_loss

    seqs, plens, spans = _tree_batch(3)
    cfg = testing.critic_config(
        strategy=strategy, harts=harts, max_token_len=48, loss_agg_mode=loss_agg_mode
    )
    engine = testing.build_engine(
        path, cfg, use_remove_padding=not padded, model_type="value_model"
    )
    mk = partial(testing.make_batch, seqs, plens, tool_spans=spans, max_token_len=48)
    with engine.eval_mode():
        inf = engine.infer_batch(mk(use_remove_padding=not padded))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with engine.train_mode():
        out = engine.train_batch(
            mk(use_remove_padding=not padded), loss_function=partial(value_loss, cfg)
        )
    after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return inf, out["metrics"], before, after


@pytest.mark.parametrize("kind", KINDS)
def test_critic_parity_with_stock_value_engine(critics, kind):
    testing, paths = critics
    # the stock reference runs padded rows where packed ones would mix (the tree engine's audit
    # does that by itself)
    ref = _run(testing, paths[kind], "fsdp2", padded=kind in _PADDED)
    tree = _run(testing, paths[kind], "harts_fsdp2", padded=False, harts={"audit_every": 1})
    _assert_parity(ref, tree)
    inf_t, met_r = tree[0], ref[1]
    # the engine's own audit of values, on its training call (veRL logs only those metrics)
    assert "harts/audit" not in inf_t["metrics"]
    assert len(met_r["critic/vf_clipfrac"]) >= 2


def _assert_parity(ref, tree) -> None:
    """The tree run (no fallback, several micro-batches, its audit ≤ 1e-6) equals the stock
    run: values at every position, grad_norm and every metric per veRL micro-batch ≤ 1e-6,
    the same parameters before and ≤ 1e-6 after one step, which moved them."""
    (inf_r, met_r, p0_r, p1_r), (inf_t, met_t, p0_t, p1_t) = ref, tree
    assert inf_t["metrics"]["harts/fallback"] == [0.0]
    assert met_t["harts/fallback"] == [0.0]
    assert inf_t["metrics"]["harts/microbatches"][0] >= 2  # capacity 48 rows
    assert met_t["harts/audit"][0] <= 1e-6
    seqs = _tree_batch(3)[0]
    for a, b, s in zip(
        inf_r["model_output"]["values"].unbind(),
        inf_t["model_output"]["values"].unbind(),
        seqs,
        strict=True,
    ):
        assert a.shape == b.shape == (len(s),)  # a value at every position
        assert float((a - b).abs().max()) <= 1e-6 * max(1.0, float(a.abs().max()))
    gr, gt = met_r["grad_norm"], met_t["grad_norm"]
    assert abs(gr - gt) <= 1e-6 * abs(gr), (gr, gt)
    # every metric per veRL micro-batch, vf_loss (a sum of global-batch-normalised parts),
    # vf_clipfrac and vpred_mean (means over each micro-batch) included
    assert_stock_metrics(met_r, met_t, tol=1e-6)
    moved = 0.0
    for n in p0_r:
        torch.testing.assert_close(p0_t[n], p0_r[n], rtol=0, atol=0)
        assert float((p1_t[n] - p1_r[n]).abs().max()) <= 1e-6, n
        moved = max(moved, float((p1_r[n] - p0_r[n]).abs().max()))
    assert moved > 1e-6  # the step did something


@pytest.fixture(scope="module")
def native_critic(critics, tmp_path_factory):
    """The native hybrid (every mixer, MoE) as a critic: its causal LM saved (the actor's
    checkpoint, which a critic starts from), and the token classifier that
    ``AutoModelForTokenClassification`` builds from it saved with its ``score`` (so that every
    load is identical, as in ``save_tiny_value_model``)."""
    from transformers import AutoModelForTokenClassification

    from harts_verl.models import preset
    from harts_verl.models.hf import HartsHybridConfig, HartsHybridForCausalLM

    cfg = HartsHybridConfig.from_hybrid_config(preset("tiny", vocab_size=VOCAB, chunk_size=16))
    torch.manual_seed(11)
    root = tmp_path_factory.mktemp("native")
    actor = HartsHybridForCausalLM(cfg).float()
    actor.save_pretrained(str(root / "actor"))
    torch.manual_seed(12)
    critic = AutoModelForTokenClassification.from_pretrained(str(root / "actor"), num_labels=1)
    critic.save_pretrained(str(root / "critic"))
    return critics[0], actor, critic, str(root / "critic")


def test_native_critic_parity_with_stock_value_engine(native_critic):
    """The native hybrid as a critic (``HartsHybridForTokenClassification``, loaded from the
    causal LM's checkpoint: its backbone, no LM head, a one-label ``score``): the stock engine
    runs its packed trajectory-wise forward and harts_fsdp2 the tree, with the same values,
    value-loss gradient and step."""
    from harts_verl.models.hf import HartsHybridForTokenClassification

    testing, actor, critic, path = native_critic
    assert isinstance(critic, HartsHybridForTokenClassification)
    assert not hasattr(critic.model, "lm_head") and critic.score.out_features == 1
    backbone = critic.model.state_dict()
    assert set(backbone) == {k for k in actor.model.state_dict() if not k.startswith("lm_head.")}
    for k, v in backbone.items():
        assert torch.equal(v, actor.model.state_dict()[k]), k
    ref = _run(testing, path, "fsdp2", padded=False)
    tree = _run(testing, path, "harts_fsdp2", padded=False, harts={"audit_every": 1})
    _assert_parity(ref, tree)
    params = ref[2]
    assert not any("lm_head" in n for n in params) and any(n.startswith("score.") for n in params)


def test_critic_split_dependent_loss_with_positional_config(critics):
    """``partial(value_loss, cfg)`` (config by position) with a loss that depends on the
    micro-batching (seq-mean-token-sum-norm without loss_scale_factor) runs on veRL's own
    micro-batches, as with the config by keyword: the stock engine's gradient and loss."""
    testing, paths = critics
    mode = "seq-mean-token-sum-norm"
    ref = _run(testing, paths["qwen2"], "fsdp2", padded=False, loss_agg_mode=mode)[1]
    tree = _run(testing, paths["qwen2"], "harts_fsdp2", padded=False, loss_agg_mode=mode)[1]
    assert tree["harts/stock_split_loss"] == [1.0]
    assert abs(ref["grad_norm"] - tree["grad_norm"]) <= 1e-6 * abs(ref["grad_norm"])
    got, want = (m["critic/vf_loss"].aggregate() for m in (tree, ref))
    assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (got, want)


def test_critic_engine_refuses_nothing_silently(critics):
    """The value engine reads no temperature (not even an invalid one), and a model without
    tree support takes the stock path with a named reason."""
    testing, paths = critics
    cfg = testing.critic_config()
    engine = testing.build_engine(paths["qwen2"], cfg, model_type="value_model")
    assert engine._tree_supported and engine._audit_key == "values"
    seqs, plens, spans = _tree_batch(4)
    td = testing.make_batch(seqs, plens, tool_spans=spans)
    assert engine._local_fallback_reasons(td, max(map(len, seqs)), True) == {}
    with engine.eval_mode():  # a greedy rollout's temperature 0 means nothing to a critic
        out = engine.infer_batch(testing.make_batch(seqs, plens, tool_spans=spans, temperature=0))
    assert out["metrics"]["harts/fallback"] == [0.0]
    engine._tree_supported = False
    assert "model" in engine._local_fallback_reasons(td, max(map(len, seqs)), True)
