"""Full-attention HF causal LMs in tree mode (``FULL_ATTENTION_MODEL_TYPES``): Llama, Qwen2,
Qwen3, Mistral, the MoE Qwen2-MoE / Qwen3-MoE / Mixtral, DeepSeek-V3 (MLA: low-rank q and kv
paths, decoupled RoPE, a value width different from the q/k width; sigmoid group routing),
GLM-4-MoE (partial RoPE, q/k norm, sigmoid routing), OLMo 2 / OLMo 3 (q/k norms over all heads,
post-norm layers; OLMo 3 with a sliding and a full layer), Phi-3 (fused qkv, partial RoPE),
Seed-OSS, GLM-4 (extra post norms), Gemma 3 (scaled embeddings, ``(1 + w)`` RMSNorms, a
rotary table per layer type, tied LM head), gpt-oss (learned attention sinks, a sliding and a
full layer, YaRN RoPE, biased top-k router and experts; HF's eager attention is its oracle),
Gemma 2 (attention and final logit soft-capping, a sliding and a full layer; eager oracle),
Granite (embedding, residual, attention and logit multipliers), Cohere (parallel attention and
MLP, q/k LayerNorms, interleaved RoPE, logit scale), Cohere 2 (a sliding RoPE layer, a full
NoPE layer), SmolLM3 (a NoPE layer), Ministral, EXAONE 4 (a sliding RoPE layer and a full NoPE
layer whose module keeps a sliding window), ERNIE 4.5, Hunyuan dense, Apertus, Arcee and the MoE
MiniMax-M2 (sigmoid router with a correction bias), OLMoE / FlexOlmo (softmax routing, q/k norms
over all heads), dots.llm1 / Solar-Open (sigmoid routing, shared expert), GLM-4-MoE-Lite (MLA,
a dense first layer), EXAONE-MoE (sliding RoPE + full NoPE layers), Ministral 3 and Mistral 4
(YaRN with Llama 4's position-dependent query scaling; Mistral 4: MLA, MoE), Hunyuan-MoE (q/k
norms after RoPE, shared MLP), ERNIE 4.5 MoE (``moe_statics`` correction bias, shared expert,
a dense first layer), Cohere 2 MoE (dense prefix, sliding RoPE + full NoPE layers, averaged
shared expert) and LongCat-Flash (two MLA attentions and two MLPs a layer, a shortcut MoE with
zero-computation experts). The logit
transforms of the
causal-LM forwards (soft-caps, scalings) are applied by the compact head.

Each attention module runs its own forward with transformers' attention interface pointed at tree
attention. The oracle is HF's own forward of each trajectory on its own (sdpa, or eager for
gpt-oss and Gemma 2; float64): log-probs of the unmodified models, and — with HF's float32 islands (RMSNorms,
routers) computing in float64 — gradients too. Weights are re-drawn with a larger spread than
HF's 0.02 init, so attention weighs in the output and a wrong ancestor set would show.
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
    spread_weights,
    trajectory_loss,
)

from harts_verl.models.adapter import (
    FULL_ATTENTION_MODEL_TYPES,
    TREE_MODEL_TYPES,
    HFCausalTreeModel,
    as_tree_model,
    tree_attention_interface,
    tree_call,
)
from harts_verl.ops.layout import TreeLayout
from harts_verl.runtime import TreeRunner
from harts_verl.tree import RolloutForest
from harts_verl.workers.testing import (
    TINY_KINDS,
    TINY_MULTIMODAL_KINDS,
    tiny_hf_config,
    tiny_hf_model,
)

# The causal LMs; Gemma 3's multi-modal wrapper (``gemma3``, tiny kind ``gemma3_mm``) is tested in
# ``test_gemma3_multimodal.py``.
MULTIMODAL = {"gemma3": "gemma3_mm"}
KINDS = [k for k in FULL_ATTENTION_MODEL_TYPES if k not in MULTIMODAL]
MOE_SOFTMAX = ["qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "minimax_m2", "olmoe", "flex_olmo"]
MOE_SOFTMAX += ["ernie4_5_moe"]


def _model(kind: str, seed: int = 3, **cfg_overrides) -> torch.nn.Module:
    """A float64 tiny model of ``kind`` with weights drawn from N(0, 0.2²) (norm weights 1 ± 0.2,
    routers' correction biases as drawn), in eval mode."""
    import transformers

    cfg = tiny_hf_config(kind)
    for k, v in cfg_overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    cls = getattr(transformers, type(tiny_hf_model(kind)).__name__)
    model = cls(cfg).double().eval()
    return spread_weights(model, seed)


def _sequences(seed: int = 0, vocab: int = 64) -> list[list[int]]:
    """A shared prompt, forks (9, 17), a prefix of another trajectory, an identical pair, a
    second root, a one-token trajectory."""
    return forked_sequences(seed, vocab, prompt=24, extension=14, forks=[(9, 11), (17, 6)], root=13)


def _hf_log_probs(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    ids = torch.tensor([seq])
    logits = model(ids, use_cache=False).logits[0]
    return torch.log_softmax(logits.double(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def lifted(monkeypatch, no_fla):
    from _hf_float64 import lift_full_attention_islands

    lift_full_attention_islands(monkeypatch)


@pytest.mark.parametrize("kind", KINDS)
def test_log_probs_equal_hf_per_trajectory_float64(lifted, kind):
    """Tree log-probs and entropies (microbatched, rows shared inside each microbatch) vs HF's
    own per-trajectory forward. (Unlifted, DeepSeek-V3's and GLM-4-MoE's float32 router matmuls
    round differently for different row counts: 3e-8 / 8e-8 apart; see the float32 test.)"""
    assert_log_probs_equal_hf(_model(kind), _sequences(1))


@pytest.mark.parametrize("kind", KINDS)
def test_float32_log_probs_close_to_hf(no_fla, kind):
    """The unmodified models in float32 (a production dtype): tree log-probs vs HF's own
    per-trajectory forward, within float32 rounding."""
    assert_float32_log_probs_close_to_hf(_model(kind, seed=6).float(), _sequences(6))


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_hf_per_trajectory_float64(lifted, kind):
    """With HF's float32 islands in float64: the tree loss and every parameter gradient equal
    those of HF's per-trajectory forward/backward (≤ 1e-9 relative to each tensor's scale)."""
    assert_gradients_equal_hf(_model(kind, seed=4), _sequences(2))


@pytest.mark.parametrize("kind", MOE_SOFTMAX)
def test_router_aux_loss_equals_hf_padded_batch(lifted, kind):
    """``output_router_logits``: the tree model's load-balancing loss (rows weighted by their
    multiplicity) equals HF's over the padded batch of all trajectories (padding masked)."""
    model = _model(kind, seed=5, output_router_logits=True, router_aux_loss_coef=0.37)
    assert_router_aux_loss_equals_hf_padded(model, _sequences(3))


def test_every_full_attention_type_has_a_tiny_model():
    """Each listed model type is exercised by the tests above (a tiny config of that type)."""
    for kind in KINDS:
        assert kind in TINY_KINDS and tiny_hf_config(kind).model_type == kind
        assert kind in TREE_MODEL_TYPES
    for model_type, kind in MULTIMODAL.items():
        assert kind in TINY_MULTIMODAL_KINDS and tiny_hf_config(kind).model_type == model_type
        assert model_type in TREE_MODEL_TYPES
    assert set(KINDS) | set(MULTIMODAL) == set(FULL_ATTENTION_MODEL_TYPES)
    assert isinstance(as_tree_model(tiny_hf_model("llama")), HFCausalTreeModel)


@pytest.mark.parametrize("kind,impl", [("deepseek_v3", "sdpa"), ("gpt_oss", "eager")])
def test_attention_config_restored_and_original_forward_outside_tree_calls(no_fla, kind, impl):
    """The attention implementation is switched only while a module runs in tree mode; outside
    a tree call the patched model is HF's own (sdpa; gpt-oss: eager) code."""
    model = _model(kind)
    assert model.config._attn_implementation == impl
    seqs = _sequences(4)
    with torch.no_grad():
        before = [_hf_log_probs(model, s) for s in seqs]
        TreeRunner(model).log_probs(seqs)
        assert model.config._attn_implementation == impl
        after = [_hf_log_probs(model, s) for s in seqs]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# Families with per-layer windows from ``use_sliding_window`` / ``max_window_layers`` (Qwen2,
# Qwen3: layers from ``max_window_layers`` on; Qwen2-MoE: even layers below it), families whose
# tiny config lists a sliding layer and a full one (OLMo 3, Gemma 3, gpt-oss: the window applies
# to the first layer) and families whose ``sliding_window`` applies to every layer (Phi-3 passes
# it to the attention interface of each layer).
_LAYER_TYPED = ("qwen2", "qwen3", "qwen2_moe")
_TYPED_IN_TINY_CONFIG = ("olmo3", "gemma3_text", "gpt_oss")
WINDOWED = ["mistral", "mixtral", "qwen3_moe", "phi3", *_LAYER_TYPED, *_TYPED_IN_TINY_CONFIG]


def _windowed(kind: str, window: int, seed: int) -> torch.nn.Module:
    """The float64 model of :func:`_model` (same weights) with a ``window``-token sliding
    window: on every layer, or for the layer-typed families on one of the two layers."""

    base = _model(kind, seed=seed)
    d = tiny_hf_config(kind).to_dict()
    if kind in _LAYER_TYPED:
        d.pop("layer_types", None)  # recomputed from the window settings
        d.update(use_sliding_window=True, sliding_window=window, max_window_layers=1)
    else:
        d.update(sliding_window=window, use_sliding_window=True)  # Qwen3-MoE reads the flag
    cfg = type(base.config)(**d)
    assert cfg.sliding_window == window
    cfg._attn_implementation = base.config._attn_implementation  # sdpa; gpt-oss: eager
    cfg._experts_implementation = getattr(base.config, "_experts_implementation", None)
    if kind in _LAYER_TYPED + _TYPED_IN_TINY_CONFIG:
        assert sorted(cfg.layer_types) == ["full_attention", "sliding_attention"]
    windowed = type(base)(cfg).double().eval()
    windowed.load_state_dict(base.state_dict())
    return windowed


@pytest.mark.parametrize("kind", WINDOWED)
def test_sliding_window_equals_hf_per_trajectory_float64(lifted, kind):
    """A sliding window shorter than the trajectories runs as a window over each row's ancestor
    path: log-probs and every gradient equal HF's per-trajectory forward (whose sliding-window
    mask applies it); a window as long as every trajectory gives the unwindowed result."""
    seqs = _sequences(5)
    model = _windowed(kind, 5, seed=7)
    model.zero_grad(set_to_none=True)
    out = TreeRunner(model, capacity_tokens=48).forward_backward(seqs, trajectory_loss)
    tree = _grads(model)
    model.zero_grad(set_to_none=True)
    ref_lps = [_hf_log_probs(model, s) for s in seqs]
    ref_loss = trajectory_loss(ref_lps)
    ref_loss.backward()
    assert abs(out["loss"] - ref_loss.item()) <= 1e-10 * max(1.0, abs(ref_loss.item()))
    for name, g in _grads(model).items():
        err = (tree[name] - g).abs().max().item()
        assert err <= 1e-9 * max(g.abs().max().item(), 1e-30), name
    with torch.no_grad():
        lps = TreeRunner(model).log_probs(seqs)
        for lp, ref in zip(lps, ref_lps):
            torch.testing.assert_close(lp, ref.detach(), rtol=0, atol=1e-10)
        longest = max(len(s) for s in seqs)
        full = _windowed(kind, longest, seed=7)
        unwindowed = _windowed(kind, 10_000, seed=7)
        for a, b in zip(TreeRunner(full).log_probs(seqs), TreeRunner(unwindowed).log_probs(seqs)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # the window matters here: window 5 differs from no window
        windowed_vs_full = [
            float((a - b).abs().max())
            for a, b in zip(lps, TreeRunner(full).log_probs(seqs))
            if a.numel()
        ]
        assert max(windowed_vs_full) > 1e-3


def test_interface_errors(no_fla):
    model = _model("llama")
    as_tree_model(model)  # wraps the attention modules
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 8, dtype=torch.float64)
    k = torch.zeros(1, 2, 3, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="tree call"):
        tree_attention_interface(attn, q, k, k, None)
    layout = TreeLayout(RolloutForest.from_sequences([[1, 2, 3]]))
    with tree_call(layout):
        with pytest.raises(NotImplementedError, match="dropout"):
            tree_attention_interface(attn, q, k, k, None, dropout=0.1)
        with pytest.raises(ValueError, match="softcap"):
            tree_attention_interface(attn, q, k, k, None, softcap=-1.0)
        s1, s2 = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
        with pytest.raises(ValueError, match="two different attention-sink"):
            tree_attention_interface(attn, q, k, k, None, s_aux=s1, sinks=s2)
        out, weights = tree_attention_interface(attn, q, k, k, None, scaling=0.5)
    assert out.shape == (1, 3, 4, 8) and weights is None
    hidden = torch.zeros(2, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="one compact batch"):
        attn(hidden, (hidden, hidden), None, harts_layout=layout)


_DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.2, 1.3],
    "long_factor": [2.0, 2.5, 3.0, 3.5],
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    "rope,max_pos,limit", [(_DYNAMIC, 16, 15), (_LONGROPE, 64, 16)], ids=["dynamic", "longrope"]
)
def test_length_dependent_rope(lifted, rope, max_pos, limit):
    """Dynamic-NTK and LongRoPE scaling pick frequencies from the batch's longest position: tree
    mode runs batches whose trajectories stay within the original context (exact vs HF) and
    refuses longer ones, naming the rope type and both lengths."""
    model = _model("llama", rope_parameters=dict(rope), max_position_embeddings=max_pos)
    short = [s[:limit] for s in _sequences(8)]
    with torch.no_grad():
        for lp, s in zip(TreeRunner(model).log_probs(short), short):
            torch.testing.assert_close(lp, _hf_log_probs(model, s), rtol=0, atol=1e-10)
        longer = [*short, _sequences(9)[0][: limit + 1]]
        with pytest.raises(
            NotImplementedError, match=f"{rope['rope_type']}.*{limit} tokens.*{limit + 1}"
        ):
            TreeRunner(model).log_probs(longer)


@pytest.mark.parametrize(
    ("kind", "override", "match"),
    [
        # Mixtral's training-mode router noise is drawn per token
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        # Seed-OSS draws its residual dropout per token (inside the attention and MLP modules)
        ("seed_oss", {"residual_dropout": 0.1}, "residual dropout"),
        # Phi-3's residual dropout modules (nn.Dropout(resid_pdrop) after attention and MLP)
        ("phi3", {"resid_pdrop": 0.1}, r"resid_attn_dropout \(p = 0.1\)"),
    ],
)
def test_per_token_noise_refused_in_training(no_fla, kind, override, match):
    """Noise drawn per token in training (shared rows would share it across trajectories) is
    refused by name; the noise-free eval mode runs exactly."""
    model = _model(kind, **override)
    seqs = _sequences(10 + len(kind) % 2)
    with torch.no_grad():
        for lp, s in zip(TreeRunner(model).log_probs(seqs), seqs):
            torch.testing.assert_close(lp, _hf_log_probs(model, s), rtol=0, atol=1e-10)
    model.train()
    with pytest.raises(NotImplementedError, match=match):
        TreeRunner(model).forward_backward(seqs, trajectory_loss)


def test_logit_transforms_applied(no_fla):
    """What the causal-LM forward does to the LM head's logits is read from the config and
    applied by the compact head: Gemma 2's soft-cap (the tiny ``gemma2`` kind, with its attention
    soft-cap), Granite's ``1 / logits_scaling``, a soft-capped Gemma 3; the identity elsewhere,
    for the multi-modal Gemma 3 wrapper (HF's does not soft-cap) and for a type without a tree
    mode. Log-probs equal HF's own forward, which differs from the untransformed head."""
    import transformers

    from harts_verl.models.adapter import logit_transform_of
    from harts_verl.ops.logprobs import LogitTransform

    assert logit_transform_of(_model("gemma2")) == LogitTransform(1.0, 5.0)
    assert logit_transform_of(_model("granite")) == LogitTransform(0.25, None)
    assert logit_transform_of(_model("llama")).is_identity
    assert logit_transform_of(tiny_hf_model("gemma3_mm")).is_identity
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2))
    gpt2.config.logit_scale = 3.0  # not a field this type's forward applies
    assert logit_transform_of(gpt2).is_identity
    # a stray config.json key that this type's forward does not read (HF's Llama ignores it)
    stray = _model("llama", logit_scale=0.5, final_logit_softcapping=2.0, logits_scaling=4.0)
    assert logit_transform_of(stray).is_identity
    capped = _model("gemma3_text", final_logit_softcapping=2.0)
    assert logit_transform_of(capped) == LogitTransform(1.0, 2.0)
    seqs = _sequences(14)
    with torch.no_grad():
        lps = TreeRunner(capped).log_probs(seqs)
        for s, lp in zip(seqs, lps):
            torch.testing.assert_close(lp, _hf_log_probs(capped, s), rtol=0, atol=1e-10)
        capped.config.final_logit_softcapping = None  # HF's forward and tree mode both follow
        plain = TreeRunner(capped).log_probs(seqs)
    assert max(float((a - b).abs().max()) for a, b in zip(lps, plain) if a.numel()) > 1e-3
    bad = _model("granite", logits_scaling=0.0)
    with pytest.raises(ValueError, match=r"config\.logits_scaling: .*0\.0"):
        logit_transform_of(bad)


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_interface_sinks_equal_hf_eager_attention(no_fla, layer):
    """gpt-oss's attention call (``s_aux=self.sinks``, its layer's ``sliding_window``) through
    the tree interface on a forest equals HF's gpt-oss ``eager_attention_forward`` on each
    trajectory (causal, windowed mask), outputs and gradients (sinks included); ``sinks=`` is
    the same keyword."""
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    model = _model("gpt_oss")
    as_tree_model(model)
    attn = model.model.layers[layer].self_attn
    seqs = _sequences(12)
    forest = RolloutForest.from_sequences(seqs)
    layout = TreeLayout(forest)
    c, hq, hkv, d = forest.num_compact_tokens, 4, 2, attn.head_dim
    gen = torch.Generator().manual_seed(12)
    q, k, v = (
        torch.randn(1, h, c, d, generator=gen, dtype=torch.float64).requires_grad_()
        for h in (hq, hkv, hkv)
    )
    kw = dict(scaling=attn.scaling, sliding_window=attn.sliding_window)  # as HF's forward
    with tree_call(layout):
        out, _ = tree_attention_interface(attn, q, k, v, None, s_aux=attn.sinks, **kw)
        again, _ = tree_attention_interface(attn, q, k, v, None, sinks=attn.sinks, **kw)
    assert torch.equal(out, again)
    window = attn.sliding_window or 10**6
    assert (layer == 0) == (window < max(len(s) for s in seqs))
    refs = []
    for i in range(forest.num_trajectories):
        rows = torch.from_numpy(forest.rows_of(i))
        n = len(rows)
        t = torch.arange(n)
        allowed = (t[:, None] >= t[None, :]) & (t[:, None] - t[None, :] < window)
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
        o, _ = hf.eager_attention_forward(
            attn, q[:, :, rows], k[:, :, rows], v[:, :, rows], mask[None, None], attn.scaling
        )
        refs.append(o[0])
    ref = torch.cat(refs)
    tree = out[0][torch.from_numpy(forest.semantic_rows)]
    assert float((tree - ref).detach().abs().max()) <= 1e-12
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    leaves = (q, k, v, attn.sinks)
    g_tree = torch.autograd.grad((tree * w).sum(), leaves)
    for a, b in zip(g_tree, torch.autograd.grad((ref * w).sum(), leaves)):
        assert float((a - b).abs().max()) <= 1e-12 * max(float(b.abs().max()), 1.0)
    assert float(g_tree[-1].abs().min()) > 0  # every head's sink receives gradient


def test_length_dependent_rope_per_layer_type(lifted):
    """Gemma 3 with LongRoPE on its full layers only (``rope_parameters`` per layer type): the
    limit is that layer type's own ``original_max_position_embeddings`` (16), not the model's
    ``max_position_embeddings`` (64); within it tree mode equals HF, beyond it it refuses."""
    from harts_verl.models.adapter import length_dependent_rope

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {**_LONGROPE, "factor": 4.0},
    }
    model = _model("gemma3_text", rope_parameters=rope, max_position_embeddings=64)
    assert length_dependent_rope(model) == ("longrope", 16)
    short = [s[:16] for s in _sequences(8)]
    with torch.no_grad():
        for lp, s in zip(TreeRunner(model).log_probs(short), short):
            torch.testing.assert_close(lp, _hf_log_probs(model, s), rtol=0, atol=1e-10)
        with pytest.raises(NotImplementedError, match=r"longrope.*16 tokens.*17"):
            TreeRunner(model).log_probs([*short, _sequences(9)[0][:17]])


def test_logit_transform_fields_match_each_causal_lm_forward():
    """The logit fields read for each tree-mode type are those its causal-LM class's own
    ``forward`` (transformers' source) mentions, no more and no fewer."""
    import inspect
    import re

    import transformers
    from transformers.models.auto import modeling_auto

    from harts_verl.models import adapter

    fields = (
        "final_logit_softcapping",
        "logits_scaling",
        "logit_scale",
        "lm_head_multiplier",
        "logits_soft_cap",
    )
    names = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    checked = 0
    for model_type in adapter.TREE_MODEL_TYPES:
        if model_type not in names:
            continue
        cls = getattr(transformers, names[model_type], None)
        if cls is None:
            continue
        source = inspect.getsource(cls.forward)
        used = {f for f in fields if re.search(rf"\b{f}\b", source)}
        assert used == set(adapter._LOGIT_TRANSFORM_FIELDS.get(model_type, ())), model_type
        checked += 1
    assert checked >= 30
