"""Critics in tree mode: HF token classifiers with one label (what veRL loads as a value model)
run their backbone once per compact row; every position takes its row's value.

Oracle: the classifier's own forward of each trajectory alone (float64, HF's float32 islands
lifted): values ≤ 1e-10 and every parameter gradient of a value loss ≤ 1e-9 relative, for a
full-attention, an MoE, an MLA, a hybrid (GatedDeltaNet) and a lightning-attention hybrid
(MiniMax) backbone, on a forest with forks,
a prefix trajectory, an identical pair and a second root."""

from __future__ import annotations

import pytest
import torch
from _forked import forked_sequences
from _hf_float64 import lift_lightning_decay_tables, spread_weights

from harts_verl.models.adapter import (
    FULL_ATTENTION_MODEL_TYPES,
    MASKED_TREE_MODEL_TYPES,
    patch_tree_mixers,
    tree_call,
    tree_mode_attention_mask,
)
from harts_verl.ops.layout import TreeLayout
from harts_verl.tree import RolloutForest
from harts_verl.workers.testing import tiny_hf_config

KINDS = ["qwen2", "qwen3_moe", "deepseek_v3", "qwen3_next", "minimax"]


@pytest.fixture
def lifted(monkeypatch, no_fla, request):
    """HF's float32 islands in float64: those of the full-attention families, or (hybrids)
    those of the gated-delta models."""
    from _hf_float64 import (
        lift_float32_islands,
        lift_full_attention_islands,
        lift_recurrent_hybrid_islands,
    )

    kind = request.node.callspec.params["kind"]
    if kind in FULL_ATTENTION_MODEL_TYPES:
        lift_full_attention_islands(monkeypatch)
    elif kind in MASKED_TREE_MODEL_TYPES:  # the recurrent hybrids
        lift_recurrent_hybrid_islands(monkeypatch)
    else:
        lift_float32_islands(monkeypatch)


def _critic(kind: str, seed: int) -> torch.nn.Module:
    """A float64 one-label token classifier of ``kind``, weights drawn from N(0, 0.2²) (norm
    weights 1 ± 0.2), in eval mode."""
    from transformers import AutoModelForTokenClassification

    cfg = tiny_hf_config(kind)
    cfg.num_labels, cfg.classifier_dropout = 1, 0.0
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(cfg).double().eval()
    return lift_lightning_decay_tables(spread_weights(model, seed))


def _tree_values(model: torch.nn.Module, seqs: list[list[int]], kind: str) -> list[torch.Tensor]:
    """Per-trajectory values from one tree-mode forward of the compact rows."""
    forest = RolloutForest.from_sequences(seqs)
    layout = TreeLayout(forest, chunk_size=4)
    assert patch_tree_mixers(model) > 0
    kwargs = (
        {"attention_mask": tree_mode_attention_mask()} if kind in MASKED_TREE_MODEL_TYPES else {}
    )
    with tree_call():
        out = model(
            input_ids=layout.token_ids[None],
            position_ids=layout.position_ids[None],
            harts_layout=layout,
            use_cache=False,
            **kwargs,
        )
    rows = out.logits[0, :, 0]
    assert rows.shape == (forest.num_compact_tokens,)  # each unique token once
    values = rows[torch.from_numpy(forest.semantic_rows)]
    return list(torch.split(values, forest.lengths.tolist()))


def _loss(values: list[torch.Tensor]) -> torch.Tensor:
    return sum(((v - 0.3 * i) ** 2).sum() for i, v in enumerate(values)) / 7.0


@pytest.mark.parametrize("kind", KINDS)
def test_critic_values_and_gradients_equal_per_trajectory_float64(lifted, kind):
    model = _critic(kind, seed=8)
    seqs = forked_sequences(3, 64, prompt=14, extension=9, forks=[(5, 7), (9, 4)], root=8)
    assert sum(map(len, seqs)) > RolloutForest.from_sequences(seqs).num_compact_tokens
    model.zero_grad(set_to_none=True)
    tree = _tree_values(model, seqs, kind)
    _loss(tree).backward()
    g_tree = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ref = [model(torch.tensor([s]), use_cache=False).logits[0, :, 0] for s in seqs]
    _loss(ref).backward()
    g_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for t, r in zip(tree, ref, strict=True):
        torch.testing.assert_close(t, r, rtol=0, atol=1e-10)
    assert g_tree.keys() == g_ref.keys() and g_ref
    for name, g in g_ref.items():
        scale = g.abs().max().item()
        err = (g_tree[name] - g).abs().max().item()
        assert err <= 1e-9 * max(scale, 1e-30), f"{name}: {err} vs scale {scale}"
