"""Qwen3.5 (dense and MoE, the text-only causal LMs of transformers ``qwen3_5_text`` /
``qwen3_5_moe_text``) in tree mode, and the hybrid models' tree call without HF's C×C mask.

Qwen3.5 differs from Qwen3-Next in the GatedDeltaNet input projections (separate q|k|v, z, b,
a instead of head-interleaved qkvz/ba), multi-axis RoPE (text positions on all axes = plain
RoPE) and dense FFNs (Qwen3.5) or an always-normalised top-k router (Qwen3.5-MoE).
"""

from __future__ import annotations

import pytest
import torch
from test_runtime import _check_model, _forest_sequences, _hf_log_probs

pytest.importorskip("transformers")

from harts_verl.models.adapter import as_tree_model, patch_tree_mixers, tree_call
from harts_verl.ops.layout import TreeLayout
from harts_verl.runtime import TreeRunner
from harts_verl.tree import RolloutForest
from harts_verl.workers.testing import tiny_hf_model

KINDS = ["qwen3_5", "qwen3_5_moe"]


@pytest.mark.parametrize("kind", KINDS)
def test_tree_equals_expanded_float64(hf_float64, kind):
    """Log-probs/entropies ≤ 1e-10, loss ≤ 1e-10, every gradient ≤ 1e-9 relative."""
    model = tiny_hf_model(kind, seed=11).double().eval()
    _check_model(model, _forest_sequences(12, 64), chunk_size=16, recompute=kind == "qwen3_5_moe")


@pytest.mark.parametrize("kind", KINDS)
def test_float32_tree_equals_hf(no_fla, kind):
    """In float32 the adapter's formulas are HF's own: tree log-probs match HF's
    per-trajectory forward to kernel rounding."""
    model = tiny_hf_model(kind, seed=13).eval()
    seqs = _forest_sequences(14, 64)
    tree_lp = TreeRunner(model, chunk_size=64).log_probs(seqs)
    for a, s in zip(tree_lp, seqs):
        torch.testing.assert_close(a.double(), _hf_log_probs(model, s), rtol=0, atol=2e-5)


_MASK_FNS = {
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_moe": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
}
_MASK_FNS["qwen3_5_mm"] = _MASK_FNS["qwen3_5"]  # the multi-modal wrappers (their text model)
_MASK_FNS["qwen3_5_moe_mm"] = _MASK_FNS["qwen3_5_moe"]


@pytest.mark.parametrize("kind", ["qwen3_next", *KINDS, "qwen3_5_mm", "qwen3_5_moe_mm"])
def test_tree_call_builds_no_causal_mask(no_fla, monkeypatch, kind):
    """The engine's tree call (``model(input_ids=rows, position_ids=depths, harts_layout=...)``
    through HF's own model forward, the multi-modal wrappers' included) builds no [C, C] mask
    and equals the runtime's tree forward; without the text-model patch HF would build one (the
    spy sees it)."""
    import importlib

    from harts_verl.models import adapter

    mod = importlib.import_module(_MASK_FNS[kind])
    seen: list[tuple[int, ...] | None] = []
    original = mod.create_causal_mask

    def spy(*args, **kwargs):
        mask = original(*args, **kwargs)
        seen.append(None if mask is None else tuple(mask.shape))
        return mask

    monkeypatch.setattr(mod, "create_causal_mask", spy)
    model = tiny_hf_model(kind, seed=15).eval()
    forest = RolloutForest.from_sequences(_forest_sequences(16, 64))
    layout = TreeLayout(forest, chunk_size=16)
    c = layout.num_rows

    def tree_call_logits():
        with torch.no_grad(), tree_call():
            out = model(
                input_ids=layout.token_ids[None],
                position_ids=layout.position_ids[None],
                use_cache=False,
                harts_layout=layout,
            )
        return out.logits[0]

    assert patch_tree_mixers(model) > 0
    logits = tree_call_logits()
    assert seen and all(s is None or int(torch.Size(s).numel()) <= 1 for s in seen), seen
    with torch.no_grad():
        tm = as_tree_model(model)
        hidden, _ = tm(layout.token_ids, layout)
        ref = tm.lm_head(hidden)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-6)

    # Negative control: the same call with HF's text-model forward unwrapped builds C×C.
    for m in model.modules():
        if hasattr(m, adapter._PATCHED) and type(m).__name__ in adapter._HYBRID_TEXT_MODEL_CLASSES:
            m.forward = getattr(m, adapter._PATCHED)
    seen.clear()
    tree_call_logits()
    assert any(s is not None and s[-2:] == (c, c) for s in seen), seen


def test_dropped_layout_raises(no_fla):
    """A patched mixer reached without ``harts_layout`` inside a tree call raises (it would
    otherwise run the trajectory-wise code on compact rows)."""
    model = tiny_hf_model("qwen3_5", seed=17).eval()
    patch_tree_mixers(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(input_ids=ids)  # outside a tree call: HF's own forward
        with tree_call(), pytest.raises(RuntimeError, match="without harts_layout"):
            model(input_ids=ids)
