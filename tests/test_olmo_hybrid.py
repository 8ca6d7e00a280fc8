"""OLMo Hybrid (transformers ``olmo_hybrid``: GatedDeltaNet + GQA full attention) in tree mode.

Differences from Qwen3-Next that the adapter reproduces: separate q/k/v/a/b projections and
q/k/v convolutions, q/k heads repeated to the value heads, ``beta`` × 2 with
``linear_allow_neg_eigval``, an output gate ``g_proj`` through the gated norm; attention with
q/k RMSNorm over all heads, RoPE or NoPE, no output gate; and a linear-attention decoder layer
that does not forward extra keywords to its GatedDeltaNet (the layout comes from the enclosing
tree call).

Measured (float64, the forest of ``_forest``, chunk 16 and 64): tree vs HF's per-trajectory
forward with the float32 islands lifted ≤ 4.5e-15 (log-probs) and ≤ 1.4e-14 relative
(gradients), asserted at 1e-12 / 1e-11; against the unmodified HF model (float32 torch fallback
kernel, float32 gate, norms and rotary table) ≤ 1.5e-6 (log-probs) and ≤ 4.5e-6 relative
(gradients), asserted at 1e-5 / 5e-5.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _forked import forked_sequences
from test_runtime import _assert_grads_close, _check_model, _grads, _hf_log_probs, _loss_fn

pytest.importorskip("transformers")

from harts_verl.models import adapter
from harts_verl.models.adapter import (
    TREE_MODEL_TYPES,
    HybridTreeModel,
    as_tree_model,
    patch_tree_mixers,
    tree_call,
)
from harts_verl.ops.layout import TreeLayout
from harts_verl.runtime import TreeRunner
from harts_verl.tree import RolloutForest
from harts_verl.workers.testing import tiny_hf_model

KINDS = ["olmo_hybrid", "olmo_hybrid_nope"]  # RoPE, beta in [0, 2], 2/4 heads; NoPE, [0, 1], 2/2
VOCAB = 256
HF_MODULE = "transformers.models.olmo_hybrid.modeling_olmo_hybrid"


def _model(kind: str, seed: int, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    return tiny_hf_model(kind, seed=seed, vocab_size=VOCAB).to(dtype).eval()


def _forest(seed: int) -> list[list[int]]:
    """Shared prompt over two 64-chunks; forks on a 64 boundary (64), on a 16 boundary inside a
    64-chunk (48), inside chunks (37, 70); a prefix-of-another trajectory, an identical pair, a
    second root, a length-1 trajectory."""
    forks = [(64, 30), (37, 25), (48, 20), (70, 15)]
    return forked_sequences(seed, VOCAB, prompt=100, extension=40, forks=forks, root=25)


def _hf_grads(model, seqs, loss_fn) -> tuple[list[torch.Tensor], float, dict]:
    """HF's own per-trajectory forward (``model(ids[None])``) and backward of ``loss_fn``."""
    model.zero_grad(set_to_none=True)
    lps = []
    for s in seqs:
        ids = torch.tensor([s])
        logits = model(ids, use_cache=False).logits[0]
        lps.append(torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None])[:, 0])
    loss = loss_fn(lps)
    loss.backward()
    return [lp.detach() for lp in lps], float(loss.detach()), _grads(model)


def _tree_grads(model, seqs, loss_fn, chunk_size: int) -> tuple[list[torch.Tensor], float, dict]:
    runner = TreeRunner(model, chunk_size=chunk_size)
    model.zero_grad(set_to_none=True)
    out = runner.forward_backward(seqs, loss_fn)
    return runner.log_probs(seqs), out["loss"], _grads(model)


def _max_rel(ga: dict, gb: dict) -> float:
    assert ga.keys() == gb.keys() and ga
    return max(
        (ga[n] - gb[n]).abs().max().item() / max(gb[n].abs().max().item(), 1e-30) for n in gb
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_tree_equals_hf_float64_lifted(hf_float64, kind, chunk_size):
    """Tree log-probs, loss and every parameter gradient vs HF's own per-trajectory forward /
    backward of the same float64 model, HF's float32 islands lifted (``_hf_float64``):
    log-probs ≤ 1e-12, loss ≤ 1e-12, gradients ≤ 1e-11 relative."""
    model = _model(kind, seed=21)
    seqs = _forest(22)
    loss_fn = _loss_fn(len(seqs))
    lp_t, loss_t, g_t = _tree_grads(model, seqs, loss_fn, chunk_size)
    lp_h, loss_h, g_h = _hf_grads(model, seqs, loss_fn)
    for a, b in zip(lp_t, lp_h, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert abs(loss_t - loss_h) <= 1e-12 * max(1.0, abs(loss_h))
    _assert_grads_close(g_t, g_h, rel=1e-11)
    # Every GatedDeltaNet parameter has a gradient that matters (the comparison is not vacuous).
    gdn = [n for n in g_h if ".linear_attn." in n]
    assert {n.rsplit(".", 2)[-2] for n in gdn} >= {"q_proj", "a_proj", "b_proj", "g_proj"}
    assert all(g_h[n].abs().max() > 1e-6 for n in gdn)


@pytest.mark.parametrize("kind", KINDS)
def test_tree_equals_unmodified_hf_float64(no_fla, kind):
    """Against the unmodified HF model (float32 torch fallback kernel, float32 gate, norms and
    rotary table): log-probs ≤ 1e-5, gradients ≤ 5e-5 relative."""
    model = _model(kind, seed=23)
    seqs = _forest(24)
    loss_fn = _loss_fn(len(seqs))
    lp_t, _, g_t = _tree_grads(model, seqs, loss_fn, 64)
    lp_h, _, g_h = _hf_grads(model, seqs, loss_fn)
    for a, b in zip(lp_t, lp_h, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert _max_rel(g_t, g_h) <= 5e-5


@pytest.mark.parametrize("kind", KINDS)
def test_float32_tree_equals_hf(no_fla, kind):
    """In float32 the adapter's formulas are HF's own: tree log-probs match HF's
    per-trajectory forward to kernel rounding."""
    model = _model(kind, seed=25, dtype=torch.float32)
    seqs = _forest(26)
    tree_lp = TreeRunner(model, chunk_size=64).log_probs(seqs)
    for a, s in zip(tree_lp, seqs, strict=True):
        torch.testing.assert_close(a.double(), _hf_log_probs(model, s), rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    ("kind", "recompute"), [("olmo_hybrid", False), ("olmo_hybrid_nope", True)]
)
def test_tree_equals_expanded_float64(hf_float64, kind, recompute):
    """Tree vs our expanded path: log-probs/entropies ≤ 1e-10, loss ≤ 1e-10, every gradient
    ≤ 1e-9 relative (with and without activation recomputation)."""
    _check_model(_model(kind, seed=27), _forest(28), chunk_size=16, recompute=recompute)


def test_lifted_islands_are_hf_formulas(no_fla, monkeypatch):
    """The float64 lift changes only the precision: in a float32 model the lifted norm, rotary
    table and GatedDeltaNet forward reproduce HF's own outputs bit for bit."""
    from _hf_float64 import lift_float32_islands

    model = _model("olmo_hybrid", seed=29, dtype=torch.float32)
    ids = torch.tensor([_forest(30)[0]])
    hidden = model.model.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    layer0 = model.model.layers[0]

    def outputs():
        return [
            layer0.input_layernorm(hidden),
            *model.model.rotary_emb(hidden, pos),
            layer0.linear_attn(hidden),
            layer0.linear_attn.o_norm(hidden[0, :, :8], hidden[0, :, 8:16]),
        ]

    with torch.no_grad():
        before = outputs()
        lift_float32_islands(monkeypatch)
        after = outputs()
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)


def test_as_tree_model_and_supported_types(no_fla):
    model = _model("olmo_hybrid_nope", seed=31)
    assert "olmo_hybrid" in TREE_MODEL_TYPES
    assert model.model.rotary_emb is None  # NoPE: no rotary table at all
    tm = as_tree_model(model)
    assert isinstance(tm, HybridTreeModel) and as_tree_model(tm) is tm
    patched = [type(m).__name__ for m in model.modules() if hasattr(m, adapter._PATCHED)]
    assert patched.count("OlmoHybridGatedDeltaNet") == 2
    assert patched.count("OlmoHybridAttention") == 2
    assert patched.count("OlmoHybridLinearAttentionDecoderLayer") == 2
    assert "OlmoHybridModel" in patched


def test_rope_changes_the_output(no_fla):
    """The RoPE variant's tree path really rotates (dropping the tables changes log-probs)."""
    model = _model("olmo_hybrid", seed=33)
    seqs = _forest(34)[:3]
    with_rope = TreeRunner(model, chunk_size=16).log_probs(seqs)
    model.model.rotary_emb = None
    without = TreeRunner(model, chunk_size=16).log_probs(seqs)
    assert max(float((a - b).abs().max()) for a, b in zip(with_rope, without)) > 1e-3


def _tree_call_logits(model, layout: TreeLayout, **kwargs) -> torch.Tensor:
    """The engine's tree call through HF's own model forward."""
    out = model(
        input_ids=layout.token_ids[None],
        position_ids=layout.position_ids[None],
        use_cache=False,
        **kwargs,
    )
    return out.logits[0]


@pytest.mark.parametrize("kind", KINDS)
def test_tree_call_through_hf_forward(no_fla, monkeypatch, kind):
    """``model(input_ids=rows, position_ids=depths, harts_layout=...)`` through HF's forward (the
    engine's call) builds no [C, C] mask and equals the runtime's tree forward; the layout may
    also come from ``tree_call(layout)`` alone. Without the text-model patch HF would build a
    [C, C] mask (the spy sees it)."""
    mod = importlib.import_module(HF_MODULE)
    seen: list[tuple[int, ...] | None] = []
    original = mod.create_causal_mask

    def spy(*args, **kwargs):
        mask = original(*args, **kwargs)
        seen.append(None if mask is None else tuple(mask.shape))
        return mask

    monkeypatch.setattr(mod, "create_causal_mask", spy)
    model = _model(kind, seed=35)
    layout = TreeLayout(RolloutForest.from_sequences(_forest(36)), chunk_size=16)
    c = layout.num_rows
    assert patch_tree_mixers(model) == 4
    with torch.no_grad():
        with tree_call():
            logits = _tree_call_logits(model, layout, harts_layout=layout)
        assert seen and all(s is None or int(torch.Size(s).numel()) <= 1 for s in seen), seen
        with tree_call(layout):
            from_context = _tree_call_logits(model, layout)
        tm = as_tree_model(model)
        ref = tm.lm_head(tm(layout.token_ids, layout)[0])
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(from_context, ref, rtol=0, atol=1e-12)

    for m in model.modules():  # negative control: HF's text-model forward unwrapped
        if type(m).__name__ == "OlmoHybridModel":
            m.forward = getattr(m, adapter._PATCHED)
    seen.clear()
    with torch.no_grad(), tree_call():
        _tree_call_logits(model, layout, harts_layout=layout)
    assert any(s is not None and s[-2:] == (c, c) for s in seen), seen


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing_in_tree_call(no_fla, reentrant):
    """HF's activation checkpointing re-runs each decoder layer during backward, after the tree
    call has ended: the wrapped linear-attention layer re-enters the layout (its GatedDeltaNet
    gets no keyword), so gradients equal those without checkpointing. Negative control, the
    layer's wrapper removed: the re-run computes HF's trajectory-wise GatedDeltaNet on the
    compact rows, which non-reentrant checkpointing detects (a different saved-tensor count)
    and reentrant checkpointing turns into silently wrong gradients."""
    from torch.utils.checkpoint import CheckpointError

    model = _model("olmo_hybrid", seed=37)
    layout = TreeLayout(RolloutForest.from_sequences(_forest(38)[:5]), chunk_size=16)
    patch_tree_mixers(model)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(layout.num_rows, VOCAB, dtype=torch.float64, generator=gen)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with tree_call():
            logits = _tree_call_logits(model, layout, harts_layout=layout)
        (logits * w).sum().backward()
        return _grads(model)

    model.train()
    ref = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    _assert_grads_close(grads(), ref, rel=1e-12)
    for m in model.modules():
        if type(m).__name__ == "OlmoHybridLinearAttentionDecoderLayer":
            m.forward = getattr(m, adapter._PATCHED)
    if reentrant:
        assert _max_rel(grads(), ref) > 1e-3
    else:
        with pytest.raises(CheckpointError):
            grads()


def test_dropped_layout_raises(no_fla):
    """A patched mixer reached without ``harts_layout`` inside a tree call that carries no
    layout raises (the OLMo linear-attention layer drops the keyword); outside a tree call HF's
    own forward runs; a layout of the wrong type is refused."""
    model = _model("olmo_hybrid", seed=39)
    patch_tree_mixers(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(input_ids=ids)  # outside a tree call: HF's own forward
        with tree_call(), pytest.raises(RuntimeError, match="without harts_layout"):
            model(input_ids=ids)
        with pytest.raises(TypeError, match="layout"):
            with tree_call("rows"):
                pass
        with pytest.raises(TypeError, match="harts_layout"):
            model.model.layers[0].linear_attn(model.model.embed_tokens(ids), harts_layout="rows")


def test_check_and_flop_model(no_fla, tmp_path, capsys):
    """``harts-verl check`` audits a saved OLMo Hybrid; the FLOP model counts every weight a
    token multiplies and 4·H·D per attention pair of each full-attention layer."""
    import json

    from test_verl_check import _batch, _param_flops

    from harts_verl.runtime.flops import model_shape
    from harts_verl.workers.check import main
    from harts_verl.workers.testing import save_tiny_model

    path = save_tiny_model("olmo_hybrid", str(tmp_path / "m"), seed=1)
    assert main(["--model", path, "--batch", _batch(tmp_path), "--chunk-size", "8"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["max_abs_dlogp"] <= 1e-6 and res["mean_cos"] > 0.999999
    assert len(res["per_layer_max_abs_diff"]) == 4 and res["first_divergent_layer"] is None
    assert res["ideal_flop_ratio"] > 1

    for kind in KINDS:
        model = tiny_hf_model(kind)
        shape = model_shape(model.config)
        assert shape.dense_per_token == pytest.approx(_param_flops(model), rel=1e-12)
        cfg = model.config
        hd = cfg.hidden_size // cfg.num_attention_heads
        assert shape.attention_per_pair == 4.0 * cfg.num_attention_heads * hd * 2
        assert shape.linear_per_token > 0


def test_engine_parity_vs_stock_fsdp2(tmp_path):
    """veRL's stock fsdp2 engine (padded rows: HF's own per-trajectory forward) vs harts_fsdp2
    in tree mode (the engine's call through HF's forward; several micro-batches) on a multi-turn
    tree batch: log-probs, entropy, grad norm and parameters after one SGD step ≤ 1e-5. In
    float32 this model's log-probs carry ≈ 4e-6 rounding against float64 on either path (HF's
    own forward 3.5e-6), above the 1e-6 of the Qwen tests."""
    pytest.importorskip("verl")

    from _verl_cpu import verl_cpu_process

    testing = verl_cpu_process()
    import test_verl_engine as ve

    path = testing.save_tiny_model("olmo_hybrid", str(tmp_path / "olmo_hybrid"), seed=3)
    data = ve.BATCHES["multiturn"](seed=len("olmo_hybrid") + len("multiturn"))
    ref = ve._run(testing, path, "fsdp2", data, loss_mode="vanilla", padded=True)
    harts = {"chunk_size": 8, "capacity_tokens": 48}
    tree = ve._run(testing, path, "harts_fsdp2", data, loss_mode="vanilla", harts=harts)
    ve._compare(ref, tree, tol=1e-5)
    assert tree[1]["harts/microbatches"][0] >= 2
    assert tree[1]["harts/compression"][0] > 1.0
