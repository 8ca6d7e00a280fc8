"""Recurrent hybrids in tree mode: the Mamba-2 hybrids (``MAMBA2_HYBRID_MODEL_TYPES``) IBM
Granite 4.0-H (``granitemoehybrid``: Mamba-2 layers and a NoPE attention layer, each with 4
experts and a shared MLP, Granite's multipliers), Bamba (Mamba-2 and RoPE attention, dense MLPs)
and NVIDIA Nemotron-H (separate Mamba-2, attention, ReLU² MLP and sigmoid-routed MoE blocks), TII Falcon-H1
(a Mamba-2 mixer and attention in parallel in every layer, µP multipliers everywhere, logits
times ``lm_head_multiplier``),
the short-conv hybrids (``CONV_HYBRID_MODEL_TYPES``) Liquid AI LFM2 (gated 3-token convolutions
and RoPE attention with q/k norms, tied embeddings) and LFM2-MoE (sigmoid-routed experts with an
expert bias after a dense first layer), and the lightning-attention hybrid MiniMax-Text-01 /
MiniMax-M1 (``LIGHTNING_HYBRID_MODEL_TYPES``: linear attention with a fixed decay per head and
layer, GQA softmax attention, softmax top-k MoE, DeepNorm-style residual factors); also the
pure state-space models Mamba, Falcon-Mamba and Mamba-2 (``SSM_MODEL_TYPES``), whose every
layer is such a mixer.

A Mamba-2 mixer runs its in-projection, the depthwise conv over each row's path, SSD over the
planned rounds (gated linear attention without the delta rule, state handoffs at forks), the D
skip, HF's gated RMSNorm and out-projection; an LFM2 conv gates the tree conv of ``B · x`` by
``C``; a lightning mixer runs the same kernel with a constant decay and unit write scale. The oracle is HF's own per-trajectory forward (its pure-torch SSD and convolutions, sdpa
attention) in float64 with its float32 islands lifted
(``_hf_float64.lift_recurrent_hybrid_islands``; MiniMax's decay tables recomputed in float64,
``lift_lightning_decay_tables``): log-probs ≤ 1e-10, every parameter gradient
≤ 1e-9 relative; unmodified float32 models within float32 rounding. The trajectories (up to 52
tokens) span several of the linear plan's 16-token chunks and of HF's (Granite 4.0-H, Bamba,
MiniMax: 16 tokens).
"""

from __future__ import annotations

import pytest
import torch
from _forked import forked_sequences
from _hf_float64 import (
    assert_float32_log_probs_close_to_hf,
    assert_gradients_equal_hf,
    assert_log_probs_equal_hf,
    assert_router_aux_loss_equals_hf_padded,
    hf_log_probs,
    lift_lightning_decay_tables,
    spread_state_space_params,
    spread_weights,
)

from harts_verl.models.adapter import (
    CONV_HYBRID_MODEL_TYPES,
    LIGHTNING_HYBRID_MODEL_TYPES,
    MAMBA1_HYBRID_MODEL_TYPES,
    MAMBA2_HYBRID_MODEL_TYPES,
    RECURRENT_GEMMA_MODEL_TYPES,
    SSM_MODEL_TYPES,
    TREE_MODEL_TYPES,
    HFCausalTreeModel,
    as_tree_model,
)
from harts_verl.ops.layout import TreeLayout
from harts_verl.runtime import TreeRunner
from harts_verl.tree import RolloutForest
from harts_verl.workers.testing import TINY_KINDS, tiny_hf_config, tiny_hf_model

KINDS = [
    *MAMBA2_HYBRID_MODEL_TYPES,
    *MAMBA1_HYBRID_MODEL_TYPES,
    *CONV_HYBRID_MODEL_TYPES,
    *LIGHTNING_HYBRID_MODEL_TYPES,
    *RECURRENT_GEMMA_MODEL_TYPES,
    *SSM_MODEL_TYPES,
]


@pytest.fixture
def lifted(monkeypatch, no_fla):
    from _hf_float64 import lift_recurrent_hybrid_islands

    lift_recurrent_hybrid_islands(monkeypatch)


def _model(kind: str, seed: int = 3) -> torch.nn.Module:
    """A float64 tiny model of ``kind``, weights from N(0, 0.2²) (norm weights 1 ± 0.2), then
    the Mamba-2 parameters redrawn in their own ranges: ``A_log`` so that decays span
    ``exp(-dt · A)`` well below 1, ``dt_bias`` around softplus⁻¹(0.1..1), ``D`` around 1;
    MiniMax's lightning decay tables in float64."""
    model = spread_weights(tiny_hf_model(kind, seed=seed).double().eval(), seed)
    lift_lightning_decay_tables(model)
    return spread_state_space_params(model, seed)


def _sequences(seed: int) -> list[list[int]]:
    """A shared 24-token prompt, forks at 9 and 17 (inside chunks), a prefix of another
    trajectory, an identical pair, a second root, a one-token trajectory."""
    return forked_sequences(seed, 64, prompt=24, extension=14, forks=[(9, 11), (17, 6)], root=13)


def test_every_recurrent_hybrid_type_has_a_tiny_model():
    for kind in KINDS:
        assert kind in TINY_KINDS and tiny_hf_config(kind).model_type == kind
        assert kind in TREE_MODEL_TYPES
        assert isinstance(as_tree_model(tiny_hf_model(kind)), HFCausalTreeModel)


@pytest.mark.parametrize("kind", KINDS)
def test_log_probs_equal_hf_per_trajectory_float64(lifted, kind):
    """Tree log-probs and entropies, microbatched (48-token capacity: shared prefixes split
    across microbatches), vs HF's per-trajectory forward."""
    assert_log_probs_equal_hf(_model(kind), _sequences(1))


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_hf_per_trajectory_float64(lifted, kind):
    """The tree loss and every parameter gradient (A_log, dt_bias, D, conv, projections, norms,
    experts; MiniMax's lightning q/k/v projections and output gates; RecurrentGemma's RG-LRU
    gates and ``recurrent_param``) equal those of HF's per-trajectory forward/backward."""
    names = assert_gradients_equal_hf(_model(kind, seed=4), _sequences(2))
    own = ("A_log", "conv.weight", "qkv_proj.weight", "recurrent_param", "conv_1d.weight")
    assert any(n.endswith(own) for n in names)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_log_probs_close_to_hf(no_fla, kind):
    """The unmodified float32 models: tree log-probs vs HF's per-trajectory forward."""
    assert_float32_log_probs_close_to_hf(_model(kind, seed=6).float(), _sequences(6))


@pytest.mark.parametrize(
    ("kind", "mixer_class"),
    [("granitemoehybrid", "GraniteMoeHybridMambaLayer"), ("jamba", "JambaMambaMixer")],
)
def test_mixer_refuses_a_cache_and_runs_hf_code_outside_tree_calls(no_fla, kind, mixer_class):
    """A patched Mamba-2 / Mamba-1 mixer runs HF's own forward outside a tree call (same output
    as the unpatched class), and refuses a cache inside one."""
    model = _model(kind)
    tree = as_tree_model(model)
    mixer = next(m for m in model.modules() if type(m).__name__ == mixer_class)
    x = torch.randn(1, 7, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(mixer(x), type(mixer).forward(mixer, x))
    layout = TreeLayout(RolloutForest.from_sequences([[1, 2, 3]]))
    with pytest.raises(ValueError, match="cache_params"):
        mixer(x[:, :3], cache_params=object(), harts_layout=layout)
    assert tree.hf is model


def test_time_steps_clamped_like_the_cuda_kernels(lifted):
    """dt is clamped to ``time_step_limit`` (the CUDA kernels' ``dt_limit``), not floored at
    ``time_step_min`` as Nemotron-H's torch path does (transformers #47246 / #47513): with time
    steps far below ``time_step_min`` (dt_bias = -10: dt ≈ 5e-5 < 1e-3) tree mode equals HF's
    torch path run with ``time_step_min = 0``, the kernels' semantics."""
    model = _model("nemotron_h", seed=8)
    mixers = [m for m in model.modules() if type(m).__name__ == "NemotronHMamba2Mixer"]
    with torch.no_grad():
        for m in mixers:
            m.dt_bias.fill_(-10.0)
            assert m.time_step_min > 1e-4 and tuple(m.time_step_limit) == (0.0, float("inf"))
            m.time_step_min = 0.0
    seqs = _sequences(4)
    with torch.no_grad():
        lps = TreeRunner(model).log_probs(seqs)
        for lp, ref in zip(lps, hf_log_probs(model, seqs)):
            torch.testing.assert_close(lp, ref, rtol=0, atol=1e-10)


def test_falcon_h1_without_the_gated_norm(lifted):
    """Falcon-H1 with ``mamba_rms_norm = False`` (its config's default): ``y · silu(z)`` in place
    of the gated norm; log-probs equal HF's per-trajectory forward."""
    import transformers

    cfg = tiny_hf_config("falcon_h1")
    cfg.mamba_rms_norm = False
    torch.manual_seed(2)
    model = spread_weights(transformers.FalconH1ForCausalLM(cfg).double().eval(), 2)
    assert not any(type(m).__name__ == "FalconH1RMSNormGated" for m in model.modules())
    assert_log_probs_equal_hf(model, _sequences(5))


def test_minimax_sliding_window_on_its_softmax_layers(lifted):
    """MiniMax applies ``config.sliding_window`` to its ``full_attention`` layers (HF builds
    their mask with the window whenever one is set): tree mode windows them too, and its
    log-probs equal HF's per-trajectory forward; without the window they differ."""
    import transformers

    cfg = tiny_hf_config("minimax")
    cfg.sliding_window = 6
    torch.manual_seed(5)
    model = spread_weights(transformers.MiniMaxForCausalLM(cfg).double().eval(), 5)
    lift_lightning_decay_tables(model)
    assert_log_probs_equal_hf(model, _sequences(7))
    seqs = _sequences(7)
    with torch.no_grad():
        windowed = TreeRunner(model).log_probs(seqs)
        model.config.sliding_window = None
        full = TreeRunner(model).log_probs(seqs)
    assert max((a - b).abs().max().item() for a, b in zip(windowed, full) if a.numel()) > 1e-3


@pytest.mark.parametrize("kind", ["minimax", "jamba"])
def test_router_aux_loss_equals_hf_padded_batch(lifted, kind):
    """``output_router_logits``: the load-balancing loss in tree mode (rows weighted by their
    multiplicity) of MiniMax (softmax top-k router module) and Jamba (a linear router in its MoE
    layers only) equals HF's over the padded batch of all trajectories (padding masked; HF
    zeroes MiniMax's lightning values and Jamba's scan inputs at padding)."""
    cfg = tiny_hf_config(kind)
    cfg.output_router_logits, cfg.router_aux_loss_coef = True, 0.37
    torch.manual_seed(6)
    model = spread_weights(type(tiny_hf_model(kind))(cfg).double().eval(), 6)
    assert_router_aux_loss_equals_hf_padded(model, _sequences(3))


def test_lightning_mixer_runs_hf_code_outside_tree_calls(no_fla):
    """A patched MiniMax lightning mixer runs HF's own forward outside a tree call and refuses a
    cache inside one."""
    model = _model("minimax")
    as_tree_model(model)
    mixer = model.model.layers[0].self_attn
    assert type(mixer).__name__ == "MiniMaxLightningAttention"
    x = torch.randn(1, 7, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        out = mixer(x, None, None)[0]
        assert torch.equal(out, type(mixer).forward(mixer, x, None, None)[0])
    layout = TreeLayout(RolloutForest.from_sequences([[1, 2, 3]]))
    with pytest.raises(ValueError, match="past_key_values"):
        mixer(x[:, :3], None, None, past_key_values=object(), harts_layout=layout)
