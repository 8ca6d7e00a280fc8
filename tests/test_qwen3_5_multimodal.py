"""The multi-modal Qwen3.5 / Qwen3.5-MoE wrappers (transformers ``qwen3_5`` / ``qwen3_5_moe``,
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``) in tree mode.

Text-only batches run in tree mode through the wrapper, with and without veRL's monkey patch
(``apply_monkey_patch``, as veRL's FSDP engine applies it), whose decoder layer calls the
GatedDeltaNet without forwarding extra keywords: the adapter wraps the decoder layers, so the
GatedDeltaNet takes its layout from the enclosing tree call, also when HF's activation
checkpointing re-runs a layer during backward. Batches with vision inputs take the engine's
stock path.

veRL's patch replaces class attributes for the whole process; every test that applies it
restores them at teardown (``_apply_verl_patch``).

Measured (float64, HF's float32 islands lifted by ``_hf_float64``, chunk 16, the forests of
``_forest``, both kinds, with and without veRL's patch): tree vs HF's per-trajectory forward of
the same wrapper ≤ 8.9e-16 (log-probs), ≤ 1.8e-15 (loss), ≤ 3.8e-15 relative (text-model
gradients), asserted at 1e-12 / 1e-12 / 1e-11; with HF's gradient checkpointing (reentrant and
not) the tree gradients are bitwise those without it (asserted ≤ 1e-12 relative) and ≤ 7.8e-15
relative from HF's (asserted 1e-11). Float32 against the unmodified wrapper (HF's or veRL's
float32 gate and kernel): log-probs ≤ 4.8e-7, asserted 1e-5.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _forked import forked_sequences
from _hf_float64 import hf_log_probs
from test_runtime import _assert_grads_close, _grads, _loss_fn

pytest.importorskip("transformers")

from harts_verl.models import adapter
from harts_verl.models.adapter import patch_tree_mixers
from harts_verl.runtime import TreeRunner
from harts_verl.workers.testing import TINY_IMAGE_TOKEN_ID, tiny_hf_model

KINDS = ["qwen3_5_mm", "qwen3_5_moe_mm"]
TEXT_VOCAB = TINY_IMAGE_TOKEN_ID  # text tokens; the ids above are image / video / vision marks
_HF_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)


def _model(kind: str, seed: int, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The tiny wrapper of ``kind`` with slow GatedDeltaNet decays: HF draws A in [0, 16], so
    most heads forget within a few tokens; A in [0.02, 0.2] keeps the state alive over chunks,
    so member initial states, replay and state handoff weigh in the output and gradients."""
    model = tiny_hf_model(kind, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("GatedDeltaNet"):
                a = torch.empty(m.A_log.shape).uniform_(0.02, 0.2, generator=gen)
                m.A_log.copy_(a.log())
    return model.to(dtype).eval()


def _forest(seed: int) -> list[list[int]]:
    """Shared prompt over > 2 chunks of 16, forks inside a chunk (37), on a chunk boundary (48)
    and later (55); a prefix-of-another trajectory, an identical pair, a second root, a
    length-1 trajectory. Text tokens only."""
    forks = [(37, 25), (48, 12), (55, 9)]
    return forked_sequences(seed, TEXT_VOCAB, prompt=70, extension=30, forks=forks, root=21)


def _restore_after_verl_patch(monkeypatch) -> None:
    """Have ``monkeypatch`` restore at teardown every attribute that veRL's Qwen3.5 monkey patch
    replaces (the classes' ``forward`` and ``fast_pos_embed_interpolate`` of both HF modules,
    transformers' ``_flash_attention_forward``): it patches classes for the whole process."""
    from transformers.integrations import flash_attention

    for name in _HF_MODULES:
        mod = importlib.import_module(name)
        for obj in vars(mod).values():
            if isinstance(obj, type) and obj.__module__ == name:
                for attr in ("forward", "fast_pos_embed_interpolate"):
                    if attr in obj.__dict__:
                        monkeypatch.setattr(obj, attr, obj.__dict__[attr])
    fa = "_flash_attention_forward"
    monkeypatch.setattr(flash_attention, fa, getattr(flash_attention, fa))


def _apply_verl_patch(monkeypatch, model: torch.nn.Module) -> None:
    """veRL's ``apply_monkey_patch`` on ``model`` with the arguments veRL's FSDP engine passes
    (no sequence parallelism, remove-padding on, no fused kernels); undone at teardown."""
    pytest.importorskip("verl")
    from verl.models.transformers import qwen3_5 as verl_qwen3_5
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    _restore_after_verl_patch(monkeypatch)
    apply_monkey_patch(
        model,
        ulysses_sp_size=1,
        use_remove_padding=True,
        use_fused_kernels=False,
        fused_kernels_backend=None,
    )
    layer_cls = type(model.model.language_model.layers[0])
    assert layer_cls.forward is verl_qwen3_5.qwen3_5_decoder_layer_forward


def _text_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of the text model and the LM head (the vision tower is not on a text-only
    path; veRL's patch runs it on a dummy image × 0)."""
    return {n: g for n, g in _grads(model).items() if not n.startswith("model.visual.")}


def _hf_grads(model, seqs, loss_fn) -> tuple[list[torch.Tensor], float, dict]:
    """:func:`hf_log_probs` and the backward of ``loss_fn``."""
    model.zero_grad(set_to_none=True)
    lps = hf_log_probs(model, seqs)
    loss = loss_fn(lps)
    loss.backward()
    return [lp.detach() for lp in lps], float(loss.detach()), _text_grads(model)


def _tree_grads(model, seqs, loss_fn) -> tuple[float, dict]:
    """The tree path's loss and text-model gradients (``TreeRunner``, chunk 16)."""
    model.zero_grad(set_to_none=True)
    out = TreeRunner(model, chunk_size=16).forward_backward(seqs, loss_fn)
    return out["loss"], _text_grads(model)


def _max_rel(ga: dict, gb: dict) -> float:
    assert ga.keys() == gb.keys() and ga
    return max(
        (ga[n] - gb[n]).abs().max().item() / max(gb[n].abs().max().item(), 1e-30) for n in gb
    )


def _count_calls(monkeypatch, cls: type) -> list[int]:
    """Count the calls of ``cls.forward`` (whatever it is now: HF's, veRL's or a lifted one)."""
    calls = [0]
    current = cls.forward

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return current(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", counting)
    return calls


@pytest.mark.parametrize("verl_patch", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_tree_equals_hf_float64_lifted(no_fla, monkeypatch, kind, verl_patch):
    """Tree log-probs, loss and every text-model gradient vs HF's own per-trajectory forward /
    backward of the same float64 wrapper, HF's float32 islands lifted (after veRL's patch, which
    would otherwise put back a float32 gate): log-probs ≤ 1e-12, loss ≤ 1e-12, gradients ≤ 1e-11
    relative. Every GatedDeltaNet parameter has a gradient that matters."""
    from _hf_float64 import lift_float32_islands

    model = _model(kind, seed=41)
    if verl_patch:
        _apply_verl_patch(monkeypatch, model)
    lift_float32_islands(monkeypatch)
    seqs = _forest(42)
    loss_fn = _loss_fn(len(seqs))
    loss_t, g_t = _tree_grads(model, seqs, loss_fn)
    lp_h, loss_h, g_h = _hf_grads(model, seqs, loss_fn)
    with torch.no_grad():
        lp_t = TreeRunner(model, chunk_size=16).log_probs(seqs)
    for a, b in zip(lp_t, lp_h, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert abs(loss_t - loss_h) <= 1e-12 * max(1.0, abs(loss_h))
    _assert_grads_close(g_t, g_h, rel=1e-11)
    gdn = [n for n in g_h if ".linear_attn." in n]
    assert {n.rsplit(".", 1)[-1] for n in gdn} >= {"A_log", "dt_bias"}
    assert len(gdn) == 18 and all(g_h[n].abs().max() > 1e-4 for n in gdn)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("verl_patch", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_gradient_checkpointing_float64(no_fla, monkeypatch, kind, verl_patch, reentrant):
    """HF's activation checkpointing (``gradient_checkpointing_enable``) re-runs each decoder
    layer during backward, outside the tree call. The wrapped layer re-enters the layout, so the
    checkpointed tree gradients equal the non-checkpointed ones (≤ 1e-12) and HF's
    per-trajectory gradients (≤ 1e-11), and the GatedDeltaNet's own (trajectory-wise) forward is
    never called on compact rows, neither in the forward nor in the recomputation.

    Negative control, the layer wrappers removed: under veRL's patch (keywords dropped) the
    recomputation runs the trajectory-wise GatedDeltaNet on compact rows — non-reentrant
    checkpointing detects it (a different saved-tensor count), reentrant checkpointing returns
    wrong gradients; with HF's own layer forward (keywords forwarded) nothing changes."""
    from _hf_float64 import lift_float32_islands
    from torch.utils.checkpoint import CheckpointError

    model = _model(kind, seed=43)
    if verl_patch:
        _apply_verl_patch(monkeypatch, model)
    lift_float32_islands(monkeypatch)
    seqs = _forest(44)[:5]
    loss_fn = _loss_fn(len(seqs))
    model.train()
    _, ref_tree = _tree_grads(model, seqs, loss_fn)
    _, _, ref_hf = _hf_grads(model, seqs, loss_fn)
    gdn_cls = type(model.model.language_model.layers[0].linear_attn)
    gdn_calls = _count_calls(monkeypatch, gdn_cls)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert model.model.language_model.layers[0].gradient_checkpointing
    _, g_ckpt = _tree_grads(model, seqs, loss_fn)
    assert gdn_calls[0] == 0
    _assert_grads_close(g_ckpt, ref_tree, rel=1e-12)
    _assert_grads_close(g_ckpt, ref_hf, rel=1e-11)

    for m in model.modules():  # negative control: the decoder-layer wrappers removed
        if type(m).__name__ in ("Qwen3_5DecoderLayer", "Qwen3_5MoeDecoderLayer"):
            m.forward = getattr(m, adapter._PATCHED)
    if not verl_patch:
        _assert_grads_close(_tree_grads(model, seqs, loss_fn)[1], ref_tree, rel=1e-12)
        assert gdn_calls[0] == 0
    elif reentrant:
        assert _max_rel(_tree_grads(model, seqs, loss_fn)[1], ref_tree) > 1e-3
        assert gdn_calls[0] > 0  # it ran on compact rows
    else:
        with pytest.raises(CheckpointError):
            _tree_grads(model, seqs, loss_fn)


def test_wrappers_follow_a_later_class_patch(no_fla, monkeypatch):
    """veRL's class-level patch applied *after* ``patch_tree_mixers``: the instance wrappers
    call the class forward current at call time (veRL's), not a method bound before the patch.
    Outside a tree call every wrapped layer and GatedDeltaNet runs veRL's forward; in a tree
    call the layers run veRL's forward and the GatedDeltaNets the tree ops (their class forward
    is never called), with the same log-probs as the other order (veRL first, then ours)."""
    model = _model("qwen3_5_mm", seed=45)
    seqs = _forest(46)[:4]
    assert patch_tree_mixers(model) == 4
    _apply_verl_patch(monkeypatch, model)
    text = model.model.language_model
    layer_calls = _count_calls(monkeypatch, type(text.layers[0]))
    gdn_calls = _count_calls(monkeypatch, type(text.layers[0].linear_attn))
    with torch.no_grad():
        model(input_ids=torch.tensor([seqs[0]]), use_cache=False)
        assert (layer_calls[0], gdn_calls[0]) == (4, 2)
        lp = TreeRunner(model, chunk_size=16).log_probs(seqs)
    assert (layer_calls[0], gdn_calls[0]) == (8, 2)

    other = _model("qwen3_5_mm", seed=45)
    _apply_verl_patch(monkeypatch, other)
    with torch.no_grad():
        ref = TreeRunner(other, chunk_size=16).log_probs(seqs)
    for a, b in zip(lp, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("verl_patch", [False, True])
def test_float32_tree_equals_unmodified_hf(no_fla, monkeypatch, verl_patch):
    """In float32, against the unmodified wrapper's per-trajectory forward (HF's or veRL's
    float32 gate and kernel): log-probs agree to kernel rounding (≤ 1e-5)."""
    model = _model("qwen3_5_moe_mm", seed=47, dtype=torch.float32)
    if verl_patch:
        _apply_verl_patch(monkeypatch, model)
    seqs = _forest(48)
    with torch.no_grad():
        lp_t = TreeRunner(model, chunk_size=64).log_probs(seqs)
        lp_h = hf_log_probs(model, seqs)
    for a, b in zip(lp_t, lp_h, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_lifted_gdn_is_hf_formula(no_fla, monkeypatch):
    """The float64 lift of the Qwen3.5 GatedDeltaNet changes only the precision: in a float32
    model it reproduces HF's forward (and veRL's) bit for bit."""
    from _hf_float64 import lift_float32_islands

    model = _model("qwen3_5_mm", seed=49, dtype=torch.float32)
    gdn = model.model.language_model.layers[0].linear_attn
    x = torch.randn(1, 37, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = gdn(x)
        _apply_verl_patch(monkeypatch, model)
        verl = gdn(x)
        lift_float32_islands(monkeypatch)
        lifted = gdn(x)
    assert torch.equal(verl, hf) and torch.equal(lifted, hf)


# ---------------------------------------------------------------------------------- engine


@pytest.fixture
def verl_engine(monkeypatch):
    """CPU platform shim, a world-size-1 gloo group, veRL's class patches undone at teardown;
    returns (``harts_verl.workers.testing``, the ``test_verl_engine`` module)."""
    pytest.importorskip("verl")

    from _verl_cpu import verl_cpu_process

    testing = verl_cpu_process()
    import test_verl_engine as ve

    _restore_after_verl_patch(monkeypatch)  # both engines apply veRL's patch when built
    return testing, ve


@pytest.mark.parametrize("kind", KINDS)
def test_engine_text_batch_in_tree_mode(verl_engine, tmp_path, kind):
    """veRL's stock fsdp2 engine (padded rows: the wrapper's per-trajectory forward, veRL's
    monkey patch applied) vs harts_fsdp2 in tree mode (the engine's call through the wrapper's
    forward, veRL's patch applied, veRL's gradient checkpointing on — HF's, non-reentrant —
    so layers are re-run during backward; several micro-batches) on a multi-turn tree batch:
    log-probs, entropy, grad norm and parameters after one SGD step ≤ 1e-6 (the tree side's
    GatedDeltaNets never run their own forward)."""
    from _vision_engine import check_tree_text, run_tree_text
    from verl.models.transformers import qwen3_5 as verl_qwen3_5

    testing, ve = verl_engine
    path = testing.save_tiny_model(kind, str(tmp_path / kind), seed=3)
    data = ve.BATCHES["multiturn"](seed=len(kind))
    ref = ve._run(testing, path, "fsdp2", data, loss_mode="vanilla", padded=True)
    module = importlib.import_module(_HF_MODULES[kind != "qwen3_5_mm"])
    prefix = "Qwen3_5" if kind == "qwen3_5_mm" else "Qwen3_5Moe"
    layer_cls = getattr(module, f"{prefix}DecoderLayer")
    seen = {"gdn": 0, "checkpointed": 0}
    gdn_forward, layer_call = verl_qwen3_5.qwen3_5_gated_delta_net_forward, layer_cls.__call__

    def gdn_spy(self, *args, **kwargs):
        seen["gdn"] += 1
        return gdn_forward(self, *args, **kwargs)

    def layer_spy(self, *args, **kwargs):
        seen["checkpointed"] += bool(self.gradient_checkpointing and self.training)
        return layer_call(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:  # spies for the tree run only
        # veRL's patch, applied when the engine is built, installs the spy as the class forward.
        mp.setattr(verl_qwen3_5, "qwen3_5_gated_delta_net_forward", gdn_spy)
        mp.setattr(layer_cls, "__call__", layer_spy)
        tree = run_tree_text(testing, ve, path, data)
        assert getattr(module, f"{prefix}GatedDeltaNet").forward is gdn_spy
    check_tree_text(ve, ref, tree)
    assert seen["checkpointed"] > 0 and seen["gdn"] == 0


def _image_batch(seed: int):
    """:func:`_vision_engine.image_batch` with a 4×4 patch grid merged 2×2 into the 4 image
    tokens (``pixel_values`` / ``image_grid_thw``)."""
    from _vision_engine import image_batch

    def image(gen: torch.Generator) -> dict:
        return {
            "pixel_values": torch.randn(16, 3 * 2 * 2 * 2, generator=gen),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
        }

    return image_batch(seed, TEXT_VOCAB, image)


def test_engine_vision_batch_falls_back(verl_engine, tmp_path, caplog):
    """A batch with ``multi_modal_inputs`` takes the stock path in harts_fsdp2 (``harts/fallback``
    = 1; one WARNING naming multi-modal inputs, however many such batches follow) and equals
    veRL's stock fsdp2 engine on it (log-probs ≤ 1e-6, grad norm ≤ 1e-6 relative), with the
    image's vision embeddings in effect (dropping them changes the log-probs); a text-only
    batch of the same engine then runs in tree mode and equals the stock engine."""
    import logging

    from _vision_engine import check_vision_fallback, max_log_prob_diff, run_vision_engines

    testing, ve = verl_engine
    path = testing.save_tiny_model("qwen3_5_mm", str(tmp_path / "m"), seed=5)
    batch = _image_batch(seed=6)
    with caplog.at_level(logging.WARNING, logger="harts_verl.workers.engine"):
        out = run_vision_engines(testing, ve, path, batch, TEXT_VOCAB, image_calls=2)
    check_vision_fallback(out)
    img_t = out["harts_fsdp2"][0]
    assert max_log_prob_diff(img_t[1], img_t[0]) == 0.0
    msgs = [r.getMessage() for r in caplog.records if r.name == "harts_verl.workers.engine"]
    assert len([m for m in msgs if "multi-modal inputs" in m]) == 1, msgs
