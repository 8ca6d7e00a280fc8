"""Gemma 3's multi-modal wrapper (transformers ``gemma3``, ``Gemma3ForConditionalGeneration``,
every released Gemma 3 from 4B up) in tree mode.

Text-only batches run in tree mode through the wrapper: its text model (``model.language_model``,
a ``gemma3_text`` model: scaled embeddings, sliding and full layers with a rotary table each) is
the one the text-only Gemma 3 runs; the wrapper's own forward adds nothing on a text-only batch
(no image-token clamping while the image id lies inside the vocabulary, as in every released
checkpoint; the 1-element tree-mode mask is returned as is by both of its mask builders).
Batches with vision inputs take the engine's stock path.

Measured (float64, RMSNorms lifted by ``_hf_float64``, weights spread by ``spread_weights``, the
forest of ``_forest``, with a 4-token sliding window on the first layer and without): tree vs
HF's per-trajectory forward of the same wrapper ≤ 3.6e-15 (log-probs), 0 (loss), ≤ 1.3e-15
relative (text-model gradients), asserted at 1e-10 / 1e-10 / 1e-9. Engine (fp32, vs veRL's stock
fsdp2): text-only multi-turn batch in tree mode ≤ 1.2e-7 (log-probs), ≤ 2.3e-7 (entropy),
2.3e-7 relative (grad norm), ≤ 3.7e-9 (parameters after one step), asserted 1e-6; a batch with
an image takes the stock path and equals it exactly (log-probs, grad norm), text-only batches of
the same engine ≤ 4.8e-7 (asserted 1e-6); the image moves the log-probs by 0.27.
"""

from __future__ import annotations

import pytest
import torch
from _forked import forked_sequences
from _hf_float64 import hf_log_probs

pytest.importorskip("transformers")

from harts_verl.models.adapter import HFCausalTreeModel, as_tree_model
from harts_verl.runtime import TreeRunner
from harts_verl.workers.testing import TINY_IMAGE_TOKEN_ID, tiny_hf_config, tiny_hf_model

KIND = "gemma3_mm"
TEXT_VOCAB = TINY_IMAGE_TOKEN_ID  # text tokens; the ids above are the image marks


def _model(seed: int, window: int | None = 4) -> torch.nn.Module:
    """The float64 tiny wrapper with spread weights (vision tower included), in eval mode; a
    ``window``-token sliding window on its first (sliding) layer."""
    import transformers
    from _hf_float64 import spread_weights

    cfg = tiny_hf_config(KIND)
    if window is not None:
        cfg.text_config.sliding_window = window
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).double().eval()
    return spread_weights(model, seed)


def _forest(seed: int) -> list[list[int]]:
    """A shared prompt, forks (9, 17), a prefix of another trajectory, an identical pair, a
    second root, a one-token trajectory. Text tokens only."""
    return forked_sequences(
        seed, TEXT_VOCAB, prompt=24, extension=14, forks=[(9, 11), (17, 6)], root=13
    )


def _loss_fn(lps: list[torch.Tensor]) -> torch.Tensor:
    w = torch.linspace(-1.0, 1.0, len(lps), dtype=torch.float64)
    return sum((lp * w[i]).sum() + 0.1 * (lp**2).sum() for i, lp in enumerate(lps)) / 10.0


def _text_grads(model) -> dict[str, torch.Tensor]:
    """Gradients of the text model and the (tied) LM head; the vision tower and projector are
    not on a text-only path."""
    return {
        n: p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None and n.startswith("model.language_model.")
    }


@pytest.fixture
def lifted(monkeypatch, no_fla):
    from _hf_float64 import lift_full_attention_islands

    lift_full_attention_islands(monkeypatch)


def test_wrapper_is_a_tree_model():
    """``gemma3`` runs through :class:`HFCausalTreeModel` on the wrapper's text model, with no
    logit transform (released Gemma 3 leaves ``final_logit_softcapping`` None)."""
    model = tiny_hf_model(KIND)
    assert model.config.model_type == "gemma3"
    assert model.config.text_config.final_logit_softcapping is None
    tree = as_tree_model(model)
    assert isinstance(tree, HFCausalTreeModel)
    assert tree.base is model.model.language_model
    assert tree.lm_head is model.lm_head


def test_text_config_soft_cap_not_applied_by_the_wrapper(no_fla):
    """HF's wrapper forward does not soft-cap its logits, whatever
    ``text_config.final_logit_softcapping`` says (the text-only Gemma 3 forward does): tree mode
    follows the wrapper, log-probs equal its own per-trajectory forward."""
    from harts_verl.models.adapter import logit_transform_of

    model = _model(seed=5)
    model.config.text_config.final_logit_softcapping = 2.0
    assert logit_transform_of(model).is_identity
    seqs = _forest(5)
    with torch.no_grad():
        for lp, ref in zip(TreeRunner(model).log_probs(seqs), hf_log_probs(model, seqs)):
            torch.testing.assert_close(lp, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("window", [4, None])
def test_tree_equals_hf_float64(lifted, window):
    """Tree log-probs (microbatched), loss and every text-model gradient vs HF's own
    per-trajectory forward / backward of the same float64 wrapper: log-probs ≤ 1e-10, loss
    ≤ 1e-10, gradients ≤ 1e-9 relative; with the 4-token window (shorter than the
    trajectories) the sliding layer's window is in effect."""
    model = _model(seed=3, window=window)
    seqs = _forest(4)
    runner = TreeRunner(model, capacity_tokens=48)
    with torch.no_grad():
        lp_t = runner.log_probs(seqs)
    assert runner.last_stats.compact_tokens < sum(len(s) for s in seqs)
    assert runner.last_stats.microbatches > 1
    model.zero_grad(set_to_none=True)
    loss_t = TreeRunner(model, chunk_size=16).forward_backward(seqs, _loss_fn)["loss"]
    g_t = _text_grads(model)
    model.zero_grad(set_to_none=True)
    lp_h = hf_log_probs(model, seqs)
    loss_h = _loss_fn(lp_h)
    loss_h.backward()
    g_h = _text_grads(model)
    for a, b in zip(lp_t, lp_h, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-10)
    loss_h = float(loss_h.detach())
    assert abs(loss_t - loss_h) <= 1e-10 * max(1.0, abs(loss_h))
    assert g_t.keys() == g_h.keys() and len(g_h) > 10
    for n in g_h:
        scale = max(g_h[n].abs().max().item(), 1e-30)
        assert (g_t[n] - g_h[n]).abs().max().item() <= 1e-9 * scale, n


def test_wrapper_call_builds_no_mask(lifted, monkeypatch):
    """The engine's tree call through the wrapper's own forward
    (``model(input_ids=rows, position_ids=depths, attention_mask=<1-element mask>,
    harts_layout=...)``): the wrapper's two mask builders (full and sliding-window; the text
    model takes their results as a dict and builds none) return the 1-element mask as is, no
    ``[C, C]`` mask is built, and the logits equal the runtime's tree forward on the text model
    (≤ 1e-12, float64)."""
    import transformers.models.gemma3.modeling_gemma3 as mod

    from harts_verl.models.adapter import tree_call, tree_mode_attention_mask
    from harts_verl.ops.layout import TreeLayout
    from harts_verl.tree import RolloutForest

    seen: list[tuple[int, ...] | None] = []
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        original = getattr(mod, name)

        def spy(*args, _original=original, **kwargs):
            mask = _original(*args, **kwargs)
            seen.append(None if mask is None else tuple(mask.shape))
            return mask

        monkeypatch.setattr(mod, name, spy)
    model = _model(seed=5)
    tm = as_tree_model(model)
    layout = TreeLayout(RolloutForest.from_sequences(_forest(6)), chunk_size=16)
    with torch.no_grad():
        with tree_call():
            logits = model(
                input_ids=layout.token_ids[None],
                position_ids=layout.position_ids[None],
                attention_mask=tree_mode_attention_mask(),
                use_cache=False,
                harts_layout=layout,
            ).logits[0]
        hidden, _ = tm(layout.token_ids, layout)
        ref = tm.lm_head(hidden)
    assert len(seen) == 2 and all(s == (1, 1, 1, 1) for s in seen), seen
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-12)


def test_window_in_effect(lifted):
    """Negative control: the 4-token window changes HF's log-probs (> 1e-3), so the test above
    compares the sliding layer with its window applied."""
    seqs = _forest(4)[:2]
    with torch.no_grad():
        a = hf_log_probs(_model(seed=3, window=4), seqs)
        b = hf_log_probs(_model(seed=3, window=None), seqs)
    assert max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) > 1e-3


# ---------------------------------------------------------------------------------- engine


@pytest.fixture
def verl_engine():
    """CPU platform shim and a world-size-1 gloo group; returns (``harts_verl.workers.testing``,
    the ``test_verl_engine`` module)."""
    pytest.importorskip("verl")

    from _verl_cpu import verl_cpu_process

    testing = verl_cpu_process()
    import test_verl_engine as ve

    return testing, ve


def _save(testing, path: str, seed: int) -> str:
    """The tiny fp32 wrapper with its image projector drawn from N(0, 1) (HF initialises it to
    zero: images would reach the text model as zero embeddings), saved to ``path``."""
    model = tiny_hf_model(KIND, seed=seed)
    proj = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        proj.copy_(torch.randn(proj.shape, generator=torch.Generator().manual_seed(seed)))
    model.save_pretrained(path)
    return path


def test_engine_text_batch_in_tree_mode(verl_engine, tmp_path):
    """veRL's stock fsdp2 engine (padded rows: the wrapper's per-trajectory forward) vs
    harts_fsdp2 in tree mode (the engine's call through the wrapper's forward, gradient
    checkpointing on, several micro-batches) on a multi-turn tree batch: log-probs, entropy,
    grad norm and parameters after one SGD step ≤ 1e-6."""
    testing, ve = verl_engine
    path = testing.save_tiny_model(KIND, str(tmp_path / KIND), seed=3)
    seqs, prompt_lens, spans = ve.BATCHES["multiturn"](seed=5)
    data = ([[t % TEXT_VOCAB for t in s] for s in seqs], prompt_lens, spans)
    ref = ve._run(testing, path, "fsdp2", data, loss_mode="vanilla", padded=True)
    from _vision_engine import check_tree_text, run_tree_text

    check_tree_text(ve, ref, run_tree_text(testing, ve, path, data))


def _image_batch(seed: int):
    """:func:`_vision_engine.image_batch` with one 8×8 image (``pixel_values``; the SigLIP tower
    pools it into the 4 image tokens)."""
    from _vision_engine import image_batch

    return image_batch(
        seed, TEXT_VOCAB, lambda gen: {"pixel_values": torch.randn(1, 3, 8, 8, generator=gen)}
    )


def test_engine_vision_batch_falls_back(verl_engine, tmp_path):
    """A batch with ``multi_modal_inputs`` takes the stock path in harts_fsdp2
    (``harts/fallback`` = 1) and equals veRL's stock fsdp2 engine on it (log-probs ≤ 1e-6,
    grad norm ≤ 1e-6 relative), with the image in effect (dropping it changes the log-probs);
    text-only batches of the same engine run in tree mode and equal the stock engine."""
    from _vision_engine import check_vision_fallback, run_vision_engines

    testing, ve = verl_engine
    path = _save(testing, str(tmp_path / "m"), seed=5)
    check_vision_fallback(run_vision_engines(testing, ve, path, _image_batch(seed=6), TEXT_VOCAB))


def test_flop_model_counts_the_text_model():
    """The FLOP model of the wrapper is that of its text model (the vision tower is not on a
    tree-mode path)."""
    from harts_verl.runtime.flops import model_shape

    assert model_shape(tiny_hf_config(KIND)) == model_shape(tiny_hf_config("gemma3_text"))
