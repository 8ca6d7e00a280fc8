"""Run HF transformers hybrids in tree mode on their own weights.

Only the token mixers become tree-aware: the instance ``forward`` of each GatedDeltaNet and
attention module of Qwen3-Next / Qwen3.5 / Qwen3.5-MoE (gated attention), OLMo Hybrid (plain
GQA attention, RoPE or NoPE) is wrapped so that, in a tree-mode forward, it runs the tree ops
(short conv over each row's path, chunkwise gated delta rule over the planned rounds, tree
attention); outside one the original forward runs untouched. The attention modules of the
full-attention models (Qwen2 / Qwen3 / Llama / Mistral, Qwen2-MoE / Qwen3-MoE / Mixtral,
DeepSeek-V3's MLA, GLM-4-MoE, OLMo 2 / OLMo 3, Phi-3, Seed-OSS, GLM-4, Gemma 2 / Gemma 3,
Granite / Granite-MoE, Cohere / Cohere 2, SmolLM3, Ministral, EXAONE 4, ERNIE 4.5, Hunyuan
dense / MoE, ERNIE 4.5 MoE, Cohere 2 MoE, LongCat-Flash, Apertus, Arcee, MiniMax-M2, gpt-oss with
its attention sinks, ...) run their own forward in
tree mode, with transformers' attention interface pointed at tree attention
(:func:`tree_attention_interface`, which takes sliding windows, sinks and Gemma 2's logit
soft-capping). Embeddings, norms, MLP /
MoE, rotary tables and the LM head are HF's own code on the ``[1, C, D]`` compact batch.
Parameter names and the state dict are unchanged. What a causal LM's own forward does to the LM
head's logits (Gemma's soft-capping, Granite's and Cohere's scaling) is read from its config
(:func:`logit_transform_of`) and applied by the compact log-prob head.

A mixer takes its :class:`TreeLayout` from the ``harts_layout`` keyword or, when a decoder layer
does not forward extra keywords (OLMo Hybrid's linear-attention layer; Qwen3.5's decoder layers
once veRL's monkey patch has replaced their class ``forward``), from the enclosing
:func:`tree_call`. Such layers are wrapped too, so that a layer re-run by activation
checkpointing during backward (outside the original tree call) still finds its layout.

Every wrapper calls the module's *current* original forward: an instance-level forward that was
there before the wrapper, else the class ``forward`` looked up at call time, so a class-level
patch applied after ours (veRL's ``apply_monkey_patch``) is honoured, not bypassed by a method
bound before it.

The hybrid text models' own ``forward`` (``Qwen3NextModel``, ``Qwen3_5TextModel``,
``Qwen3_5MoeTextModel``, ``OlmoHybridModel``) is wrapped too, only so that a tree call never
builds HF's ``[C, C]`` causal mask: tree attention takes its ancestor structure from the layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts_verl.ops.layout import TreeLayout
from harts_verl.ops.logprobs import LogitTransform
from harts_verl.tree._checks import check_positive

_PATCHED = "_harts_original_forward"

# Inside a tree call whose layout travels only as the ``harts_layout`` keyword.
_KEYWORD_ONLY = object()

# The tree call in progress: None outside one; its TreeLayout, or ``_KEYWORD_ONLY``. A patched
# mixer reached without ``harts_layout`` inside a keyword-only tree call means some wrapper on
# the way dropped the keyword (it would silently run the trajectory-wise code on compact rows),
# so it raises instead.
_TREE_CALL: contextvars.ContextVar[TreeLayout | object | None] = contextvars.ContextVar(
    "harts_tree_call", default=None
)


@contextlib.contextmanager
def tree_call(layout: TreeLayout | None = None) -> Iterator[None]:
    """Mark a tree-mode forward (see :func:`patch_tree_mixers`).

    With ``layout``, patched mixers reached without a ``harts_layout`` keyword run on it. Without
    one, the layout of an enclosing tree call stays in force; if there is none, such a mixer
    raises ``RuntimeError`` (the layout must then arrive by keyword)."""
    if layout is not None and not isinstance(layout, TreeLayout):
        raise TypeError(f"layout: expected a TreeLayout or None, got {type(layout).__name__}")
    current = _TREE_CALL.get()
    if layout is None:
        layout = current if current is not None else _KEYWORD_ONLY
    token = _TREE_CALL.set(layout)
    try:
        yield
    finally:
        _TREE_CALL.reset(token)


def current_tree_layout() -> TreeLayout | None:
    """The layout of the enclosing :func:`tree_call` (None outside one, or when it carries none)."""
    current = _TREE_CALL.get()
    return current if isinstance(current, TreeLayout) else None


def _tree_layout(module: nn.Module, harts_layout: TreeLayout | None) -> TreeLayout | None:
    """The layout a patched mixer runs on: the keyword, else the enclosing tree call's; None
    outside a tree call (the original forward runs). Raises ``RuntimeError`` inside a tree call
    that carries no layout, and ``TypeError`` for a keyword that is not a :class:`TreeLayout`."""
    if harts_layout is not None:
        if not isinstance(harts_layout, TreeLayout):
            raise TypeError(
                f"harts_layout: expected a TreeLayout, got {type(harts_layout).__name__}"
            )
        return harts_layout
    current = _TREE_CALL.get()
    if current is _KEYWORD_ONLY:
        raise RuntimeError(
            f"{type(module).__name__}: called without harts_layout inside a tree-mode forward "
            "(a wrapper between the model and this module dropped the keyword)"
        )
    return current


def _original(module: nn.Module):
    return getattr(module, _PATCHED)


def _class_forward(self, *args: Any, **kwargs: Any) -> Any:
    """The ``forward`` of the module's class as it is at call time (what ``module.forward``
    would resolve to without an instance-level wrapper)."""
    return type(self).forward(self, *args, **kwargs)


# HF hybrids (GatedDeltaNet + gated full attention): Qwen3-Next and Qwen3.5 (dense / MoE; the
# text-only CausalLM and the multi-modal wrappers, whose text model runs in tree mode).
GATED_HYBRID_MODEL_TYPES = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)
_GDN_CLASSES = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
_GATED_ATTENTION_CLASSES = ("Qwen3NextAttention", "Qwen3_5Attention", "Qwen3_5MoeAttention")
_ROUTER_CLASSES = ("Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter")

# OLMo Hybrid: GatedDeltaNet with separate q/k/v/a/b projections and q/k/v convolutions, plain
# GQA attention (q/k RMSNorm over all heads, RoPE or NoPE), post-norm decoder layers.
OLMO_HYBRID_MODEL_TYPES = ("olmo_hybrid",)
_OLMO_GDN_CLASSES = ("OlmoHybridGatedDeltaNet",)
_OLMO_ATTENTION_CLASSES = ("OlmoHybridAttention",)
# Decoder layers that call their token mixer without forwarding extra keywords: OLMo Hybrid's
# linear-attention layer, Nemotron-H's blocks and Falcon-H1's layers (the Mamba-2 mixer), LFM2's
# layers (the short conv), and Qwen3.5's (dense, MoE) once veRL's monkey patch
# (``verl.models.transformers.qwen3_5.qwen3_5_decoder_layer_forward``, applied to the classes
# for the multi-modal ``qwen3_5`` / ``qwen3_5_moe`` models) has replaced HF's, which does forward
# them. Wrapped whichever forward the class has, before or after the patch.
_KEYWORD_DROPPING_LAYER_CLASSES = (
    "OlmoHybridLinearAttentionDecoderLayer",
    "NemotronHBlock",
    "Lfm2DecoderLayer",
    "Lfm2MoeDecoderLayer",
    "FalconH1DecoderLayer",
    "JambaMambaDecoderLayer",
    "MambaBlock",
    "FalconMambaBlock",
    "Mamba2Block",
    "Qwen3_5DecoderLayer",
    "Qwen3_5MoeDecoderLayer",
)

# Mamba-2 hybrids: Mamba-2 mixers (state-space duality: gated linear attention with a scalar
# decay per head, no delta rule) interleaved with softmax attention — IBM Granite 4.0-H
# (``granitemoehybrid``: NoPE or RoPE attention, dense or MoE + shared MLP), Bamba, NVIDIA
# Nemotron-H (separate Mamba / attention / MLP / MoE blocks, NoPE). Their HF text models build
# no RoPE-from-mask state, so they run like the full-attention models (embeddings → layers →
# final norm, attention through transformers' interface).
# Falcon-H1 runs a Mamba-2 mixer and attention in parallel in every layer, with µP multipliers
# (``ssm_in_multiplier``, the ``mup_vector`` of the in-projection, which its mixer applies; the
# layer's and MLP's multipliers are HF's code; ``lm_head_multiplier`` a logit transform).
# Zyphra's Zamba2: Mamba-2 layers, some preceded by a shared transformer block (attention over
# the concatenated hidden state and embeddings, per-use LoRA adapters, an MLP, a linear back into
# the residual stream; see :func:`_tree_decoder_forward`).
MAMBA2_HYBRID_MODEL_TYPES = ("granitemoehybrid", "bamba", "nemotron_h", "falcon_h1", "zamba2")
_MAMBA2_CLASSES = (
    "Mamba2Mixer",
    "Zamba2MambaMixer",
    "GraniteMoeHybridMambaLayer",
    "BambaMixer",
    "NemotronHMamba2Mixer",
    "FalconH1Mixer",
)

# Short-convolution hybrids: Liquid AI's LFM2 / LFM2-MoE (gated depthwise short convolutions —
# ``in_proj`` → B, C, x; ``C · conv(B · x)`` → ``out_proj`` — interleaved with GQA attention
# with q/k norms; LFM2-MoE: sigmoid-routed experts after its first dense layers). Run like the
# Mamba-2 hybrids (HF's text model, the 1-element mask).
CONV_HYBRID_MODEL_TYPES = ("lfm2", "lfm2_moe")
_SHORT_CONV_CLASSES = ("Lfm2ShortConv", "Lfm2MoeShortConv")

# Mamba-1 hybrids: AI21 Jamba (Jamba 1.5 / 1.7, Jamba Reasoning): Mamba-1 mixers (selective
# scan: a diagonal decay per channel and state entry, RMSNorms on dt, B and C) interleaved with
# NoPE GQA attention, a softmax top-k MoE (no renormalisation) in every ``expert_layer_period``-th
# layer. The selective scan runs as gated linear attention without the delta rule, one value
# head per channel (its state ``[N, 1]``), a per-channel decay ``dt · A`` over the N state
# entries, q/k = C/B shared by all channels.
MAMBA1_HYBRID_MODEL_TYPES = ("jamba",)
_MAMBA1_CLASSES = ("JambaMambaMixer", "MambaMixer", "FalconMambaMixer")
# Pure state-space models: Mamba (Mamba-1), TII Falcon-Mamba (Mamba-1 with weightless RMSNorms on
# dt, B and C) and Mamba-2 (``backbone`` in place of ``model``: embeddings, residual blocks of
# norm → mixer, ``norm_f``). Their mixers are the hybrids' (above); every layer is linear.
SSM_MODEL_TYPES = ("mamba", "falcon_mamba", "mamba2")
# MoE blocks whose router is a plain ``nn.Linear`` named ``router`` (its output: the logits).
_LINEAR_ROUTER_PARENTS = ("JambaSparseMoeBlock",)

# Griffin hybrids: Google RecurrentGemma (``recurrent_gemma``): recurrent blocks (two branches:
# ``act(linear_y(x))`` and ``linear_x(x)`` → a depthwise conv with bias → the RG-LRU, a diagonal
# linear recurrence ``h_t = a_t · h_{t-1} + sqrt(1 - a_t²) · (i_t · x_t)`` with input and
# recurrence gates from block-diagonal projections; their product → ``linear_out``) interleaved
# with local (sliding-window) MQA attention with half-dimension RoPE; embeddings times
# ``sqrt(hidden)`` (its text model's bf16 ``normalizer``), logits soft-capped by
# ``logits_soft_cap``. The RG-LRU runs as gated linear attention without the delta rule, one
# head per channel with a one-entry state (q = k = 1, v = the normalized input, write scale 1,
# log decay ``log a_t``).
RECURRENT_GEMMA_MODEL_TYPES = ("recurrent_gemma",)
_RG_RECURRENT_CLASSES = ("RecurrentGemmaRecurrentBlock",)
_RG_ATTENTION_CLASSES = ("RecurrentGemmaSdpaAttention",)
# Text models that scale their embeddings by a ``normalizer`` buffer and call their layers with
# positional ``(hidden, position_ids, attention_mask, use_cache, cache)`` (RecurrentGemma):
# :func:`_tree_decoder_forward` does the same. (HF's own forward, which the veRL engine runs,
# takes the 1-element tree mask as is and passes ``harts_layout`` on to the blocks.)
_POSITIONAL_LAYER_TEXT_MODEL_CLASSES = ("RecurrentGemmaModel",)

# Lightning-attention hybrids: MiniMax-Text-01 / MiniMax-M1 (``minimax``): lightning attention
# (linear attention with a fixed decay per head and layer, SiLU on q/k/v, RMSNorm and a sigmoid
# output gate) interleaved with GQA softmax attention, a softmax top-k MoE in every layer,
# DeepNorm-style residual factors (HF's decoder layer). Run like the Mamba-2 hybrids (HF's
# decoder layers, the 1-element mask); the lightning mixer runs as gated linear attention
# without the delta rule over the planned rounds.
LIGHTNING_HYBRID_MODEL_TYPES = ("minimax",)
_LIGHTNING_CLASSES = ("MiniMaxLightningAttention",)

# Text models whose layers take the embeddings and their own index positionally (Zamba2: its
# shared attention blocks read the concatenation of the hidden state and the embeddings).
_EMBEDDINGS_TO_EVERY_LAYER_TEXT_MODEL_CLASSES = ("Zamba2Model",)

# Text models whose forward calls its layers without forwarding extra keywords (Falcon-H1): in
# tree mode our own layer loop (:func:`_tree_decoder_forward`) replaces HF's, so every layer gets
# ``harts_layout`` (also when activation checkpointing re-runs it in backward, after the tree
# call ended).
_KEYWORD_DROPPING_TEXT_MODEL_CLASSES = ("FalconH1Model",)

# Linear-attention hybrids, run through :class:`HybridTreeModel`.
HYBRID_MODEL_TYPES = GATED_HYBRID_MODEL_TYPES + OLMO_HYBRID_MODEL_TYPES
_HYBRID_TEXT_MODEL_CLASSES = (
    "Qwen3NextModel",
    "Qwen3_5TextModel",
    "Qwen3_5MoeTextModel",
    "OlmoHybridModel",
)

# Full-attention HF causal LMs (dense or MoE; GQA, or MLA for DeepSeek-V3) whose attention modules
# compute q/k/v with their own code and call transformers' attention interface, which
# :func:`_interface_attn_tree_forward` points at tree attention. A model type is listed only once
# its tree forward is tested against HF's own per-trajectory forward in float64
# (``tests/test_full_attention_models.py``): the tree path runs embeddings → decoder layers →
# final norm → LM head, so a family that scales embeddings or logits outside these modules needs
# its own handling. Gemma 2 / Gemma 3 scale their embeddings inside the embedding module (HF's
# code runs), Granite multiplies them by ``embedding_multiplier`` in its text model's forward
# (:func:`_tree_decoder_forward` applies it); a CausalLM forward that transforms the logits
# (Gemma 2 / Gemma 3's ``final_logit_softcapping``, Granite's ``logits_scaling``, Cohere's
# ``logit_scale``) has the transform applied by the compact head (:func:`logit_transform_of`);
# Gemma 2 soft-caps its attention logits (``softcap``, which tree attention takes).
# OLMo 3, Gemma 2 / Gemma 3, Cohere 2 and gpt-oss mix sliding-window and full layers
# (``config.layer_types``); Gemma 3 keeps a rotary table per layer type (see
# :func:`_tree_decoder_forward`); gpt-oss passes its learned attention sinks to the interface
# (``s_aux``), which tree attention takes. ``gemma3`` is
# Gemma 3's multi-modal wrapper (``Gemma3ForConditionalGeneration``, every released Gemma 3 from
# 4B up): its text model (``model.language_model``, a ``gemma3_text`` model) runs text-only
# batches in tree mode; batches with vision inputs take the veRL engine's stock path.
FULL_ATTENTION_MODEL_TYPES = (
    "qwen2",
    "qwen3",
    "llama",
    "mistral",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "glm4_moe",
    "olmo2",
    "olmo3",
    "phi3",
    "seed_oss",
    "glm4",
    "gemma3_text",
    "gemma3",
    "gpt_oss",
    "gemma2",
    "granite",
    "cohere",
    "cohere2",
    "granitemoe",
    "granitemoeshared",
    "smollm3",
    "ministral",
    "exaone4",
    "ernie4_5",
    "hunyuan_v1_dense",
    "apertus",
    "arcee",
    "minimax_m2",
    "olmoe",
    "flex_olmo",
    "dots1",
    "solar_open",
    "glm4_moe_lite",
    "exaone_moe",
    "ministral3",
    "mistral4",
    "hunyuan_v1_moe",
    "ernie4_5_moe",
    "cohere2_moe",
    "longcat_flash",
)
_FULL_ATTENTION_CLASSES = (
    "Qwen2Attention",
    "Qwen3Attention",
    "LlamaAttention",
    "MistralAttention",
    "Qwen2MoeAttention",
    "Qwen3MoeAttention",
    "MixtralAttention",
    "DeepseekV3Attention",
    "Glm4MoeAttention",
    "Olmo2Attention",
    "Olmo3Attention",
    "Phi3Attention",
    "SeedOssAttention",
    "Glm4Attention",
    "Gemma3Attention",
    "GptOssAttention",
    "Gemma2Attention",
    "GraniteAttention",
    "CohereAttention",
    "Cohere2Attention",
    "GraniteMoeAttention",
    "GraniteMoeSharedAttention",
    "SmolLM3Attention",
    "MinistralAttention",
    "Exaone4Attention",
    "Ernie4_5Attention",
    "HunYuanDenseV1Attention",
    "ApertusAttention",
    "ArceeAttention",
    "MiniMaxM2Attention",
    "OlmoeAttention",
    "FlexOlmoAttention",
    "Dots1Attention",
    "SolarOpenAttention",
    "Glm4MoeLiteAttention",
    "ExaoneMoeAttention",
    "Ministral3Attention",
    "Mistral4Attention",
    "HunYuanMoEV1Attention",
    "Ernie4_5_MoeAttention",
    "Cohere2MoeAttention",
    "LongcatFlashMLA",
    "GraniteMoeHybridAttention",
    "BambaAttention",
    "NemotronHAttention",
    "Lfm2Attention",
    "Lfm2MoeAttention",
    "FalconH1Attention",
    "MiniMaxAttention",
    "JambaAttention",
    "Zamba2Attention",
)
# Softmax top-k routers whose load-balancing loss HF computes from the router logits
# (``output_router_logits``; gpt-oss: Switch-style over the softmax of its biased logits, like
# Mixtral's; ERNIE 4.5 MoE: over the plain softmax, without its ``moe_statics`` bias);
# DeepSeek-V3 / GLM-4-MoE route by sigmoid scores without one, and Hunyuan-MoE, Cohere 2 MoE
# and LongCat-Flash compute none.
_FULL_ATTENTION_ROUTER_CLASSES = (
    "Qwen2MoeTopKRouter",
    "Qwen3MoeTopKRouter",
    "MixtralTopKRouter",
    "GptOssTopKRouter",
    "MiniMaxM2TopKRouter",
    "OlmoeTopKRouter",
    "FlexOlmoTopKRouter",
    "MiniMaxTopKRouter",
    "Ernie4_5_MoeTopKRouter",
)

# Model types whose HF text model runs in tree mode with the 1-element mask of
# :func:`tree_mode_attention_mask` (HF's own forward, no patched text model, except Falcon-H1's),
# through :class:`HFCausalTreeModel`.
MASKED_TREE_MODEL_TYPES = (
    FULL_ATTENTION_MODEL_TYPES
    + MAMBA2_HYBRID_MODEL_TYPES
    + CONV_HYBRID_MODEL_TYPES
    + LIGHTNING_HYBRID_MODEL_TYPES
    + MAMBA1_HYBRID_MODEL_TYPES
    + SSM_MODEL_TYPES
    + RECURRENT_GEMMA_MODEL_TYPES
)
# Model types that run in tree mode (``harts_hybrid``: the native model through its HF wrapper).
TREE_MODEL_TYPES = HYBRID_MODEL_TYPES + MASKED_TREE_MODEL_TYPES + ("harts_hybrid",)


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _is_hf_class(mod: nn.Module, names: tuple[str, ...]) -> bool:
    cls = type(mod)
    return cls.__name__ in names and cls.__module__.startswith("transformers.")


def _is_hybrid(model: nn.Module) -> bool:
    return _model_type(model) in HYBRID_MODEL_TYPES


def as_tree_model(model: nn.Module) -> nn.Module:
    """Return a module with the tree interface ``forward(input_ids [C], layout) -> (hidden [C, D],
    aux_loss)`` and an ``lm_head``: the native model as is, HF Qwen3-Next / Qwen3.5 /
    Qwen3.5-MoE / OLMo Hybrid through :class:`HybridTreeModel`, the full-attention, Mamba-2 and
    short-conv models of :data:`MASKED_TREE_MODEL_TYPES` through :class:`HFCausalTreeModel`; a
    peft ``PeftModel`` as its base model (adapters injected: the same parameters). Raises
    ``TypeError`` for any other model."""
    from harts_verl.models.hybrid import HybridForCausalLM

    if isinstance(model, HybridForCausalLM | HybridTreeModel | HFCausalTreeModel):
        return model
    if type(model).__module__.startswith("peft.") and callable(
        getattr(model, "get_base_model", None)
    ):
        return as_tree_model(model.get_base_model())
    native = getattr(model, "harts_native_model", None)  # HartsHybridForCausalLM (HF wrapper)
    if isinstance(native, HybridForCausalLM):
        return native
    if _is_hybrid(model):
        return HybridTreeModel(model)
    if _model_type(model) in MASKED_TREE_MODEL_TYPES:
        return HFCausalTreeModel(model)
    raise TypeError(
        f"model: {type(model).__name__} is not supported in tree mode (supported: "
        "HybridForCausalLM, transformers Qwen3-Next / Qwen3.5 / Qwen3.5-MoE / OLMo Hybrid, the "
        f"Mamba-2 hybrids {', '.join(MAMBA2_HYBRID_MODEL_TYPES)}, the short-conv hybrids "
        f"{', '.join(CONV_HYBRID_MODEL_TYPES)}, the lightning-attention hybrids "
        f"{', '.join(LIGHTNING_HYBRID_MODEL_TYPES)}, the Mamba-1 hybrids "
        f"{', '.join(MAMBA1_HYBRID_MODEL_TYPES)}, the Griffin hybrids "
        f"{', '.join(RECURRENT_GEMMA_MODEL_TYPES)}, the state-space models "
        f"{', '.join(SSM_MODEL_TYPES)}, and the causal LMs of "
        f"{', '.join(FULL_ATTENTION_MODEL_TYPES)})"
    )


def logit_transform_of(model: nn.Module) -> LogitTransform:
    """What the causal-LM forward of ``model`` does to its LM head's logits, which the compact
    log-prob head (log-probs from the LM head's weight, ``compact_log_probs``) must apply too:
    :func:`config_logit_transform` of its config; the identity for a model without an
    ``lm_head`` (token classifiers) or of a type without a tree mode (whose forward is not known
    to apply these fields). Raises ``ValueError`` naming a field with an unusable value."""
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        return LogitTransform()
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in TREE_MODEL_TYPES:
        return LogitTransform()
    return config_logit_transform(config)


# The logit fields each causal-LM forward applies (transformers 5.10); other types apply none.
_LOGIT_TRANSFORM_FIELDS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gemma2", "gemma3_text"), ("final_logit_softcapping",)),
    **dict.fromkeys(
        ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid"), ("logits_scaling",)
    ),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), ("logit_scale",)),
    "falcon_h1": ("lm_head_multiplier",),
    "recurrent_gemma": ("logits_soft_cap",),
}


def config_logit_transform(config: Any) -> LogitTransform:
    """The logit transform of the tree-mode causal LM whose own config is ``config``: Gemma 2 /
    Gemma 3's ``final_logit_softcapping`` (``cap · tanh(x / cap)``; RecurrentGemma's
    ``logits_soft_cap``), Granite's ``logits_scaling``
    (``x / logits_scaling``), Cohere's ``logit_scale`` (``x · logit_scale``), Falcon-H1's
    ``lm_head_multiplier`` (``x · lm_head_multiplier``), as their forwards
    compute them from ``self.config``. A multi-modal wrapper's ``text_config`` is not read (HF's
    ``Gemma3ForConditionalGeneration`` does not soft-cap). Raises ``ValueError`` naming the field
    when its value is not a finite positive number."""

    model_type = getattr(config, "model_type", None)
    applied = _LOGIT_TRANSFORM_FIELDS.get(model_type, ())

    def field(key: str) -> float | None:
        if key not in applied:  # a stray config.json key this type's forward does not read
            return None
        return check_positive(f"config.{key}", getattr(config, key, None), none_ok=True)

    cap, divisor, factor, multiplier = (
        field(k)
        for k in ("final_logit_softcapping", "logits_scaling", "logit_scale", "lm_head_multiplier")
    )
    if model_type in RECURRENT_GEMMA_MODEL_TYPES:
        cap = field("logits_soft_cap")  # its forward always soft-caps
    if factor is not None:  # Cohere
        return LogitTransform(factor, cap)
    if multiplier is not None:  # Falcon-H1
        return LogitTransform(multiplier, cap)
    return LogitTransform(1.0 if divisor is None else 1.0 / divisor, cap)  # Granite


def _gdn_log_decay(module: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """An HF GatedDeltaNet's log decay ``g = -exp(A_log) · softplus(a + dt_bias)`` for ``a``
    ``[1, C, HV]`` → ``[C, HV]``, computed in at least float32 (float64 stays float64)."""
    ct = torch.promote_types(a.dtype, torch.float32)
    return (-module.A_log.to(ct).exp() * F.softplus(a.to(ct) + module.dt_bias.to(ct)))[0]


def _gdn_tree_forward(
    self,
    hidden_states: torch.Tensor,
    *args: Any,
    harts_layout: TreeLayout | None = None,
    **kwargs: Any,
):
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(hidden_states, *args, **kwargs)
    c = hidden_states.shape[1]
    if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: head-interleaved fused projections
        qkvz = self.in_proj_qkvz(hidden_states)
        ba = self.in_proj_ba(hidden_states)
        query, key, value, z, b, a = self.fix_query_key_value_ordering(qkvz, ba)
        mixed = torch.cat([x.reshape(c, -1) for x in (query, key, value)], dim=-1)
    else:  # Qwen3.5 (dense and MoE): separate q|k|v, z, b, a projections
        mixed = self.in_proj_qkv(hidden_states)[0]
        z = self.in_proj_z(hidden_states)
        b = self.in_proj_b(hidden_states)
        a = self.in_proj_a(hidden_states)
    mixed = layout.short_conv(mixed, *_conv_params(self, "conv1d"), activation="silu")
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(c, self.num_k_heads, self.head_k_dim)
    k = k.reshape(c, self.num_k_heads, self.head_k_dim)
    v = v.reshape(c, self.num_v_heads, self.head_v_dim)
    beta = b.sigmoid()[0]
    g = _gdn_log_decay(self, a)
    o = layout.linear_attention(q, k, v, g, beta, use_qk_l2norm=True)
    o = o.to(hidden_states.dtype)
    o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(o.reshape(1, c, -1))


def _attn_tree_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    *args: Any,
    harts_layout: TreeLayout | None = None,
    **kwargs: Any,
):
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    _refuse_attention_dropout(self)
    apply_rotary_pos_emb = sys.modules[type(self).__module__].apply_rotary_pos_emb
    c = hidden_states.shape[1]
    q, gate = torch.chunk(self.q_proj(hidden_states).view(1, c, -1, self.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(1, c, -1)
    q = self.q_norm(q).transpose(1, 2)
    k = self.k_norm(self.k_proj(hidden_states).view(1, c, -1, self.head_dim)).transpose(1, 2)
    v = self.v_proj(hidden_states).view(1, c, -1, self.head_dim)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = layout.attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0], scale=self.scaling)
    o = o.reshape(1, c, -1) * torch.sigmoid(gate)
    return self.o_proj(o), None


# Name under which :func:`tree_attention_interface` is registered in transformers'
# ``AttentionInterface``; a wrapped attention module's config names it only while the module runs
# in tree mode (see :func:`_interface_attn_tree_forward`).
TREE_ATTENTION = "harts_tree"

# The keywords under which transformers' attention interface passes attention sinks (gpt-oss:
# ``s_aux=self.sinks``; ``sinks`` elsewhere): see :func:`tree_attention_interface`.
_SINK_ATTENTION_KWARGS = ("s_aux", "sinks")


def _sliding_window(module: nn.Module, keyword: int | None) -> int | None:
    """The sliding window HF applies in ``module``'s layer. Where ``config.layer_types`` names
    the layer's type, that decides (HF picks the layer's mask by it): a ``full_attention``
    layer has the interface keyword only, which HF passes with a window its mask applies too
    (MiniMax: ``config.sliding_window`` on its full layers), not a ``sliding_window`` attribute
    its module keeps without passing it (EXAONE 4, Qwen2-MoE); a ``sliding_attention`` layer
    has the interface keyword, else the module's or the config's ``sliding_window``. Without
    layer types: the keyword, else the module's ``sliding_window`` (Qwen2-MoE sets it on its
    sliding layers without passing it on; HF applies it through the layer's sliding mask).
    None (or 0): no window."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    window = keyword or getattr(module, "sliding_window", None)
    if types is not None and idx is not None and 0 <= idx < len(types):
        if types[idx] == "full_attention":
            window = keyword
        elif types[idx] == "sliding_attention" and not window:
            window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def _effective_window(layout: TreeLayout, window: int | None) -> int | None:
    """``window`` as an int, or None when there is none (None or 0) or it changes nothing: no
    path of the layout is longer than it."""
    if not window:
        return None
    longest = int(layout.forest.depth.max()) + 1 if layout.forest.num_compact_tokens else 0
    return int(window) if longest > window else None


def tree_attention_interface(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any = None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    harts_layout: TreeLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function for tree mode: softmax attention of each compact
    row over its ancestors and itself (the layout's ancestor structure replaces the causal mask,
    which is ignored). query ``[1, Hq, C, Dk]``, key ``[1, Hkv, C, Dk]``, value
    ``[1, Hkv, C, Dv]`` (Hq a multiple of Hkv, query head h reads key/value head
    ``h // (Hq / Hkv)``) → (``[1, C, Hq, Dv]`` in the query dtype, None). The layout is
    ``harts_layout``, else that of the enclosing :func:`tree_call`.

    ``sliding_window`` (transformers' convention: a row sees the keys less than that many tokens
    above it) runs as a window over each row's ancestor path. Attention sinks ``s_aux`` (gpt-oss)
    or ``sinks``, ``[Hq]``: each head's sink logit joins every row's softmax and carries no value,
    as in HF's gpt-oss eager attention (gradient to the sinks included). ``softcap`` (Gemma 2's
    ``attn_logit_softcapping``): scores ``softcap · tanh(s / softcap)`` before the mask, as HF's
    eager attention. Raises ``NotImplementedError`` for attention dropout or a non-causal module,
    and ``ValueError`` for two different sink tensors."""
    layout = harts_layout if harts_layout is not None else current_tree_layout()
    name = type(module).__name__
    if layout is None:
        raise RuntimeError(f"{name}: the {TREE_ATTENTION!r} attention runs only in a tree call")
    if dropout:
        raise NotImplementedError(f"{name}: attention dropout ({dropout}) in tree mode")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(f"{name}: non-causal attention has no tree form")
    given = [kwargs[kw] for kw in _SINK_ATTENTION_KWARGS if kwargs.get(kw) is not None]
    if len(given) > 1 and given[0] is not given[1]:
        raise ValueError(f"{name}: two different attention-sink tensors (s_aux and sinks)")
    sinks = given[0] if given else None
    window = _effective_window(layout, _sliding_window(module, sliding_window))
    for t, what in ((query, "query"), (key, "key"), (value, "value")):
        if t.dim() != 4 or t.shape[0] != 1:
            raise ValueError(
                f"{what}: {name} in tree mode expects [1, H, C, D], got {tuple(t.shape)}"
            )
    o = layout.attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        scale=scaling,
        window=window,
        sinks=sinks,
        softcap=kwargs.get("softcap"),
    )
    return o[None], None


def _register_tree_attention() -> None:
    """Register :func:`tree_attention_interface` as ``harts_tree`` in transformers (once)."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(TREE_ATTENTION) is not tree_attention_interface:
        AttentionInterface.register(TREE_ATTENTION, tree_attention_interface)


def _interface_attn_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> Any:
    """Tree mode of an HF attention module that computes its q/k/v with its own code (projections,
    q/k norms, RoPE, MLA's low-rank paths) and then calls transformers' attention interface: the
    module's own forward runs with its config naming :data:`TREE_ATTENTION` for the duration of
    the call (restored after), and ``harts_layout`` travels with the interface keywords.
    hidden_states ``[1, C, D]``; tree mode keeps no cache. Raises ``NotImplementedError`` in
    training with Seed-OSS's functional residual dropout (``residual_dropout`` > 0, drawn per
    token: a shared row would share its mask across trajectories)."""
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(*args, **kwargs)
    names = ("hidden_states", "position_embeddings", "attention_mask", "past_key_values")
    hidden_states, _, _, past_key_values = _bind(args, kwargs, names)
    _compact_batch(self, hidden_states)
    if past_key_values is not None:
        raise ValueError("past_key_values: tree mode keeps no cache (call with use_cache=False)")
    residual_dropout = getattr(self, "residual_dropout", 0.0)
    if self.training and residual_dropout:
        raise NotImplementedError(
            f"{type(self).__name__}: residual dropout ({residual_dropout}) in training is drawn "
            "per token, so rows shared by several trajectories would share it (call "
            "model.eval(), or set residual_dropout = 0)"
        )
    config = self.config
    saved = config._attn_implementation_internal
    config._attn_implementation_internal = TREE_ATTENTION
    try:
        return _original(self)(*args, harts_layout=layout, **kwargs)
    finally:
        config._attn_implementation_internal = saved


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]) -> list[Any]:
    """The values of the leading parameters ``names`` of a call (positional or keyword; None
    where absent)."""
    return [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]


def _compact_batch(module: nn.Module, hidden_states: Any) -> int:
    """The row count ``C`` of a tree-mode mixer input, which must be ``[1, C, D]``."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        raise ValueError(
            f"hidden_states: {type(module).__name__} in tree mode expects [1, C, D], got "
            f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}"
        )
    if hidden_states.shape[0] != 1:
        raise ValueError(
            f"hidden_states: tree mode runs one compact batch [1, C, D], got batch "
            f"{hidden_states.shape[0]}"
        )
    return int(hidden_states.shape[1])


def _uncached_input(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *params: str
) -> tuple[torch.Tensor, int]:
    """``(hidden_states, C)`` of a tree-mode mixer call whose leading parameters are
    ``hidden_states`` (``[1, C, D]``) and then ``params``, the last of them its cache; raises
    ``ValueError`` when the call carries a cache: tree mode keeps none."""
    hidden_states, *rest = _bind(args, kwargs, ("hidden_states", *params))
    c = _compact_batch(module, hidden_states)
    if rest[-1] is not None:
        raise ValueError(f"{params[-1]}: tree mode keeps no cache (call with use_cache=False)")
    return hidden_states, c


def _olmo_gdn_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> torch.Tensor:
    """Tree mode of an OLMo Hybrid GatedDeltaNet: HF's separate q/k/v projections and depthwise
    convolutions (SiLU) over each row's path, q/k heads repeated to the value heads inside the
    kernel (HF: ``repeat_interleave``), ``beta = sigmoid(b)`` (× 2 with
    ``linear_allow_neg_eigval``), ``g = -exp(A_log) · softplus(a + dt_bias)`` in at least float32,
    the chunkwise gated delta rule with q/k L2 norm over the planned rounds, the gated output
    norm (gate ``g_proj``) and ``o_proj``. hidden_states ``[1, C, D]`` → ``[1, C, D]`` in the
    input dtype. Tree mode keeps no cache (``cache_params`` must be None) and ignores the
    attention mask (the layout gives each row its path)."""
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(*args, **kwargs)
    hidden_states, c = _uncached_input(self, args, kwargs, "cache_params")
    convs = [_checked_conv(self, name) for name in ("q_conv1d", "k_conv1d", "v_conv1d")]
    x = torch.cat([p(hidden_states)[0] for p in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
    weight = torch.cat([conv.weight.reshape(conv.weight.shape[0], -1) for conv in convs])
    bias = None
    if any(conv.bias is not None for conv in convs):
        bias = torch.cat(
            [
                conv.bias if conv.bias is not None else conv.weight.new_zeros(conv.weight.shape[0])
                for conv in convs
            ]
        )
    x = layout.short_conv(x, weight, bias, activation="silu")
    q, k, v = torch.split(x, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(c, -1, self.head_k_dim)
    k = k.reshape(c, -1, self.head_k_dim)
    v = v.reshape(c, -1, self.head_v_dim)
    beta = self.b_proj(hidden_states).sigmoid()[0]
    if self.allow_neg_eigval:
        beta = beta * 2.0
    g = _gdn_log_decay(self, self.a_proj(hidden_states))
    o = layout.linear_attention(q, k, v, g, beta, use_qk_l2norm=True).to(hidden_states.dtype)
    gate = self.g_proj(hidden_states)
    o = self.o_norm(o.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim))
    return self.o_proj(o.reshape(1, c, -1))


def _mamba2_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> torch.Tensor:
    """Tree mode of an HF Mamba-2 mixer (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1 with its
    ``ssm_in_multiplier`` and ``mup_vector``): ``in_proj`` →
    (gate ``z``, ``xBC``, ``dt``; Nemotron-H's leading MLP parts, unused by HF, skipped) →
    depthwise causal conv of ``xBC`` over each row's path and the mixer's activation → SSD over
    the planned rounds as gated linear attention without the delta rule (``q = C``, ``k = B``
    per group, ``v = x`` per head, write scale ``dt = softplus(dt + dt_bias)`` clamped to
    ``time_step_limit`` as the CUDA kernels clamp it (``dt_limit``; Nemotron-H's torch path
    floors it at ``time_step_min`` instead, transformers issue #47246 / PR #47513), log decay
    ``dt · A`` with ``A = -exp(A_log)``, query scale 1), in at least
    float32 → ``+ D · x`` → HF's gated RMSNorm (``norm(y, z)``; ``y · silu(z)`` for a Falcon-H1
    without ``mamba_rms_norm``) → ``out_proj`` in the input
    dtype. hidden_states ``[1, C, D]`` → ``[1, C, D]``. Tree mode keeps no cache and ignores the
    attention mask (the layout gives each row its path)."""
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(*args, **kwargs)
    hidden_states, c = _uncached_input(self, args, kwargs, "cache_params")
    dtype = hidden_states.dtype
    n_heads, head_dim, n_groups, d_state = (
        self.num_heads,
        self.head_dim,
        self.n_groups,
        self.ssm_state_size,
    )
    inner = self.intermediate_size
    multiplier = getattr(self, "ssm_in_multiplier", None)  # Falcon-H1's µP multipliers
    proj = self.in_proj(hidden_states if multiplier is None else hidden_states * multiplier)[0]
    mup = getattr(self, "mup_vector", None)
    if mup is not None:
        proj = proj * mup[0]
    width = inner + self.conv_dim + n_heads
    gate, xbc, dt = proj[:, proj.shape[-1] - width :].split([inner, self.conv_dim, n_heads], -1)
    xbc = self.act(layout.short_conv(xbc, *_conv_params(self, "conv1d"), None))
    x, b, cm = torch.split(xbc, [inner, n_groups * d_state, n_groups * d_state], dim=-1)
    dt = F.softplus(dt + self.dt_bias)
    if self.time_step_limit is not None:  # the CUDA kernels' ``dt_limit``
        dt = torch.clamp(dt, self.time_step_limit[0], self.time_step_limit[1])
    ct = torch.promote_types(dtype, torch.float32)
    x = x.to(ct).reshape(c, n_heads, head_dim)
    log_decay = -torch.exp(self.A_log.to(ct)) * dt.to(ct)  # [C, heads]
    o = layout.linear_attention(
        cm.to(ct).reshape(c, n_groups, d_state),
        b.to(ct).reshape(c, n_groups, d_state),
        x,
        log_decay,
        dt.to(ct),
        scale=1.0,
        delta_rule=False,
    )
    y = (o + self.D.to(ct)[:, None] * x).reshape(1, c, inner)
    if getattr(self, "mamba_rms_norm", True):
        out = self.norm(y, gate[None])
    else:  # Falcon-H1 without the gated norm
        out = y * F.silu(gate[None])
    return self.out_proj(out.to(dtype))


def _mamba1_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> torch.Tensor:
    """Tree mode of an HF Mamba-1 mixer (Jamba, Mamba, Falcon-Mamba): ``in_proj`` → (x, gate)
    → depthwise causal conv of x over each row's path and the mixer's activation → ``x_proj`` →
    (dt, B, C), each through its RMSNorm (Jamba: weighted; Falcon-Mamba: weightless; Mamba:
    none) → ``dt = softplus(dt_proj(dt))`` → the selective scan over the planned
    rounds as gated linear attention without the delta rule (one value head per channel with
    ``v = x``, q/k = C/B shared by all channels, write scale ``dt``, per-channel log decay
    ``dt · A`` over the state entries with ``A = -exp(A_log)``, query scale 1), in at least
    float32 → ``+ D · x`` → times ``act(gate)`` → ``out_proj`` in the input dtype.
    hidden_states ``[1, C, D]`` → ``[1, C, D]``. Tree mode keeps no cache and ignores the
    attention mask (the layout gives each row its path)."""
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(*args, **kwargs)
    hidden_states, _ = _uncached_input(self, args, kwargs, "cache_params")
    dtype = hidden_states.dtype
    n, rank = self.ssm_state_size, self.time_step_rank
    x, gate = self.in_proj(hidden_states)[0].chunk(2, dim=-1)
    x = self.act(layout.short_conv(x, *_conv_params(self, "conv1d"), None))
    dt, b, cm = self.x_proj(x).split([rank, n, n], dim=-1)
    if hasattr(self, "dt_layernorm"):  # Jamba
        dt, b, cm = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(cm)
    elif hasattr(self, "rms_eps"):  # Falcon-Mamba: weightless RMSNorms
        rms = sys.modules[type(self).__module__].rms_forward
        dt, b, cm = (rms(t, variance_epsilon=self.rms_eps) for t in (dt, b, cm))
    dt = F.softplus(self.dt_proj(dt))
    ct = torch.promote_types(dtype, torch.float32)
    x, dt = x.to(ct), dt.to(ct)
    log_decay = -torch.exp(self.A_log.to(ct))[None] * dt[..., None]  # [C, channels, N]
    o = layout.linear_attention(
        cm.to(ct)[:, None],
        b.to(ct)[:, None],
        x[..., None],
        log_decay,
        dt,
        scale=1.0,
        delta_rule=False,
    )
    y = (o[..., 0] + self.D.to(ct) * x) * self.act(gate.to(ct))
    return self.out_proj(y.to(dtype)[None])


def _short_conv_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> torch.Tensor:
    """Tree mode of an HF LFM2 gated short convolution: ``in_proj`` → B, C, x (thirds of the
    channels), the depthwise causal conv of ``B · x`` over each row's path (no activation),
    ``C ·`` that, ``out_proj``. hidden_states ``[1, C, D]`` → ``[1, C, D]``. Tree mode keeps no
    cache and ignores the attention mask."""
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(*args, **kwargs)
    hidden_states, _ = _uncached_input(self, args, kwargs, "past_key_values")
    b, cm, x = self.in_proj(hidden_states)[0].chunk(3, dim=-1)
    conv = layout.short_conv(b * x, *_conv_params(self, "conv"), None)
    return self.out_proj((cm * conv)[None])


def _lightning_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Tree mode of an HF MiniMax lightning-attention mixer: ``act(qkv_proj)`` → q, k, v per
    head; linear attention over the planned rounds without the delta rule, decay
    ``exp(-slope_rate)`` per head and token (the layer's ``slope_rate`` buffer), write scale 1,
    query scale 1, each row's own token included, in at least float32; RMSNorm over all heads,
    times ``sigmoid(output_gate(x))``, ``out_proj`` in the input dtype. hidden_states
    ``[1, C, D]`` → (``[1, C, D]``, None). Tree mode keeps no cache and ignores the attention
    mask (the layout gives each row its path)."""
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(*args, **kwargs)
    names = ("position_embeddings", "attention_mask", "past_key_values")
    hidden_states, c = _uncached_input(self, args, kwargs, *names)
    dtype = hidden_states.dtype
    heads, head_dim = self.num_attention_heads, self.head_dim
    ct = torch.promote_types(dtype, torch.float32)
    qkv = self.act_fn(self.qkv_proj(hidden_states))[0].reshape(c, heads, 3 * head_dim)
    q, k, v = qkv.to(ct).split(head_dim, dim=-1)
    log_decay = -self.slope_rate.to(ct).reshape(1, heads).expand(c, heads)
    write = torch.ones(c, heads, dtype=ct, device=qkv.device)
    o = layout.linear_attention(q, k, v, log_decay, write, scale=1.0, delta_rule=False)
    o = self.norm(o.to(dtype).reshape(1, c, heads * head_dim))
    o = torch.sigmoid(self.output_gate(hidden_states)) * o
    return self.out_proj(o), None


def _attention_input(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], second: str
) -> tuple[torch.Tensor, Any, int]:
    """``(hidden_states, the value of parameter second, C)`` of a tree-mode attention call
    whose leading parameters are ``hidden_states`` (``[1, C, D]``), ``second``,
    ``attention_mask`` and ``past_key_values``. Raises ``ValueError`` for a cache (tree mode
    keeps none) and ``NotImplementedError`` for attention dropout in training."""
    names = ("hidden_states", second, "attention_mask", "past_key_values")
    hidden_states, value, _, past_key_values = _bind(args, kwargs, names)
    c = _compact_batch(module, hidden_states)
    if past_key_values is not None:
        raise ValueError("past_key_values: tree mode keeps no cache (call with use_cache=False)")
    _refuse_attention_dropout(module)
    return hidden_states, value, c


def _checked_conv(module: nn.Module, name: str) -> nn.Conv1d:
    """``module``'s depthwise conv ``name``; TypeError naming it when it is not a plain
    ``nn.Conv1d`` (e.g. a peft LoRA adapter, whose ``weight`` alone is not what it computes:
    the tree conv reads the weight)."""
    conv = getattr(module, name)
    if not isinstance(conv, nn.Conv1d):
        raise TypeError(
            f"{type(module).__name__}.{name}: expected a plain torch.nn.Conv1d, got "
            f"{type(conv).__module__}.{type(conv).__name__} (a LoRA adapter or wrapper on the "
            "short convolution): tree mode convolves with its weight; merge the adapter or "
            "leave the conv out of its target modules"
        )
    return conv


def _conv_params(module: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight ``[channels, K]`` and bias of ``module``'s depthwise conv ``name``
    (:func:`_checked_conv`)."""
    conv = _checked_conv(module, name)
    return conv.weight.squeeze(1), conv.bias


def _refuse_attention_dropout(module: nn.Module) -> None:
    """``NotImplementedError`` for a module in training with a non-zero ``attention_dropout``
    (HF drops attention weights functionally, per call; a shared row would share its mask)."""
    p = getattr(module, "attention_dropout", 0.0)
    if module.training and p:
        raise NotImplementedError(
            f"{type(module).__name__}: attention dropout ({p}) is not supported in tree mode"
        )


def _rg_lru_tree(module: nn.Module, x: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """RecurrentGemma's RG-LRU over the planned rounds, x ``[C, W]`` (the conv output) →
    ``[C, W]`` in x's dtype: HF's input and recurrence gates (block-diagonal, ``baddbmm``), log
    decay ``log a = -8 · r · softplus(Λ)``, the input times ``sqrt(1 - a²)`` (HF's
    ``SqrtBoundDerivative``: the gradient of the root clipped) except at depth 0 (a trajectory's
    first token: the reset, multiplier 1), then the diagonal scan ``h_t = a_t · h_{t-1} + x̂_t``
    (zero state at depth 0) as gated linear attention without the delta rule — one head per
    channel, q = k = 1, write scale 1 — accumulated in at least float32 (HF: float32)."""
    c, width = x.shape
    heads, block = module.num_attention_heads, module.block_width
    xs = x.reshape(c, heads, block).permute(1, 0, 2)
    gate_x = torch.baddbmm(module.input_gate_bias[:, None, :], xs, module.input_gate_weight)
    gate_a = torch.baddbmm(module.recurrent_gate_bias[:, None, :], xs, module.recurrent_gate_weight)
    gate_x = torch.sigmoid(gate_x.transpose(0, 1).reshape(c, width))
    gate_a = torch.sigmoid(gate_a.transpose(0, 1).reshape(c, width))
    log_a = -8.0 * gate_a * F.softplus(module.recurrent_param)
    sqrt_bound = sys.modules[type(module).__module__].SqrtBoundDerivative
    multiplier = sqrt_bound.apply(1 - torch.exp(2 * log_a))
    reset = (layout.position_ids == 0)[:, None]
    multiplier = reset + ~reset * multiplier
    normalized = x * gate_x * multiplier.type(x.dtype)
    ct = torch.promote_types(x.dtype, torch.float32)
    ones = torch.ones(c, width, 1, dtype=ct, device=x.device)
    h = layout.linear_attention(
        ones,
        ones,
        normalized.to(ct)[..., None],
        log_a.to(ct),
        ones[..., 0],
        scale=1.0,
        delta_rule=False,
    )
    return h[..., 0].to(x.dtype)


def _rg_recurrent_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> torch.Tensor:
    """Tree mode of a RecurrentGemma recurrent block: ``act(linear_y(x))`` times the RG-LRU
    (:func:`_rg_lru_tree`) of the depthwise causal conv (with bias, no activation) of
    ``linear_x(x)`` over each row's path, then ``linear_out``. input_states ``[1, C, D]`` →
    ``[1, C, D]``. Tree mode keeps no cache (``use_cache`` must be false; the mask is
    ignored: the layout gives each row its path)."""
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(*args, **kwargs)
    names = ("input_states", "position_ids", "attention_mask", "use_cache")
    hidden_states, _, _, use_cache = _bind(args, kwargs, names)
    _compact_batch(self, hidden_states)
    if use_cache:
        raise ValueError("use_cache: tree mode keeps no cache (call with use_cache=False)")
    y = self.act_fn(self.linear_y(hidden_states))
    x = self.linear_x(hidden_states)[0]
    x = layout.short_conv(x, *_conv_params(self, "conv_1d"), None)
    return self.linear_out(_rg_lru_tree(self.rg_lru, x, layout)[None] * y)


def _rg_attn_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> torch.Tensor:
    """Tree mode of a RecurrentGemma local attention block: q/k/v projections, RoPE on the first
    ``partial_rotary_factor`` of each head (the module's own rotary table at the row depths),
    softmax attention (MQA / GQA, scale ``head_dim ** -0.5``) of each row over the
    ``config.attention_window_size`` latest tokens of its path (itself included), ``o_proj``.
    hidden_states ``[1, C, D]`` → ``[1, C, D]``. Tree mode keeps no cache and takes no attention
    dropout in training."""
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(*args, **kwargs)
    hidden_states, _, c = _attention_input(self, args, kwargs, "position_ids")
    d = self.head_dim
    q = self.q_proj(hidden_states).view(1, c, -1, d).transpose(1, 2)
    k = self.k_proj(hidden_states).view(1, c, -1, d).transpose(1, 2)
    v = self.v_proj(hidden_states).view(1, c, -1, d).transpose(1, 2)
    cos, sin = self.rotary_emb(v, layout.position_ids[None])
    parts = int(1 / self.partial_rotary_factor)
    q_rot, *q_pass = torch.chunk(q, parts, dim=-1)
    k_rot, *k_pass = torch.chunk(k, parts, dim=-1)
    rope = sys.modules[type(self).__module__].apply_rotary_pos_emb
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
    q, k = torch.cat((q_rot, *q_pass), dim=-1), torch.cat((k_rot, *k_pass), dim=-1)
    window = _effective_window(layout, getattr(self.config, "attention_window_size", None))
    o = layout.attention(
        q[0].transpose(0, 1),
        k[0].transpose(0, 1),
        v[0].transpose(0, 1),
        scale=d**-0.5,
        window=window,
    )
    return self.o_proj(o.reshape(1, c, -1))


def _olmo_attn_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Tree mode of an OLMo Hybrid attention module: q/k/v projections, RMSNorm over the whole
    projected q and k (before the head view), RoPE when ``position_embeddings`` is given (NoPE
    when None), softmax attention (GQA, ``self.scaling``) of each row over its ancestors, then
    ``o_proj``. hidden_states ``[1, C, D]`` → (``[1, C, D]``, None). Tree mode keeps no cache
    and takes no attention dropout."""
    layout = _tree_layout(self, harts_layout)
    if layout is None:
        return _original(self)(*args, **kwargs)
    hidden_states, position_embeddings, c = _attention_input(
        self, args, kwargs, "position_embeddings"
    )
    q = self.q_norm(self.q_proj(hidden_states)).view(1, c, -1, self.head_dim).transpose(1, 2)
    k = self.k_norm(self.k_proj(hidden_states)).view(1, c, -1, self.head_dim).transpose(1, 2)
    v = self.v_proj(hidden_states).view(1, c, -1, self.head_dim)
    if position_embeddings is not None:  # RoPE; None: NoPE
        cos, sin = position_embeddings
        rope = sys.modules[type(self).__module__].apply_rotary_pos_emb
        q, k = rope(q, k, cos, sin)
    o = layout.attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0], scale=self.scaling)
    return self.o_proj(o.reshape(1, c, -1)), None


def _layout_scope_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> Any:
    """Forward of a decoder layer that calls its token mixer without forwarding extra keywords:
    with ``harts_layout`` (or inside a tree call that carries a layout) HF's own forward runs in
    ``tree_call(layout)``, so the mixer finds the layout, also when activation checkpointing
    re-runs the layer during backward, outside the tree call that ran its forward."""
    layout = harts_layout if harts_layout is not None else current_tree_layout()
    if layout is None:
        return _original(self)(*args, **kwargs)
    with tree_call(layout):
        return _original(self)(*args, **kwargs)


def tree_mode_attention_mask(device: torch.device | str | None = None) -> torch.Tensor:
    """The ``attention_mask`` an HF model's own forward takes in tree mode: a 1-element 4D
    boolean tensor. transformers' mask builders (``create_causal_mask``, the sliding-window one)
    return a 4D mask as is, and ``_update_linear_attn_mask`` maps an all-ones mask to None, so
    no ``[C, C]`` mask is built from the (non-monotone) row depths; tree-mode mixers ignore
    masks (the layout gives each row its ancestors)."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def _hybrid_text_model_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs
):
    """Tree mode of a hybrid text model's ``forward``: HF's own code inside
    ``tree_call(layout)`` with ``harts_layout`` forwarded to the layers and a 1-element mask in
    place of the ``[C, C]`` causal mask that HF would otherwise build from the (non-monotone) row
    depths. The layout is the keyword, else that of the enclosing tree call."""
    layout = harts_layout if harts_layout is not None else current_tree_layout()
    if layout is None:
        return getattr(self, _PATCHED)(*args, **kwargs)
    if len(args) > 1 or kwargs.get("attention_mask") is not None:
        raise ValueError("harts_layout: tree mode takes no attention_mask")
    kwargs["attention_mask"] = tree_mode_attention_mask(layout.token_ids.device)
    with tree_call(layout):
        return getattr(self, _PATCHED)(*args, harts_layout=layout, **kwargs)


def _own_loop_text_model_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> Any:
    """Tree mode of an HF text model of :data:`_KEYWORD_DROPPING_TEXT_MODEL_CLASSES`: its
    embeddings, layers and final norm through :func:`_tree_decoder_forward` (positions = row
    depths; masks, caches and ``position_ids`` keywords are not read), returned as
    ``BaseModelOutputWithPast(last_hidden_state [1, C, D])``. ``input_ids`` must be the layout's
    ``[1, C]`` row tokens. The layout is the keyword, else that of the enclosing tree call."""
    layout = harts_layout if harts_layout is not None else current_tree_layout()
    if layout is None:
        return _original(self)(*args, **kwargs)
    (input_ids,) = _bind(args, kwargs, ("input_ids",))
    name = type(self).__name__
    if not isinstance(input_ids, torch.Tensor) or kwargs.get("inputs_embeds") is not None:
        raise ValueError(f"input_ids: {name} in tree mode runs from token ids, not embeddings")
    if tuple(input_ids.shape) != (1, layout.num_rows):
        raise ValueError(
            f"input_ids: {name} in tree mode expects the layout's [1, {layout.num_rows}] rows, "
            f"got {tuple(input_ids.shape)}"
        )
    from transformers.modeling_outputs import BaseModelOutputWithPast

    loop = types.SimpleNamespace(config=self.config, gradient_checkpointing=False)
    hidden = _tree_decoder_forward(loop, self, input_ids[0], layout)
    return BaseModelOutputWithPast(last_hidden_state=hidden[None])


def patch_tree_mixers(model: nn.Module) -> int:
    """Make every supported token mixer of an HF model tree-aware (idempotent): the instance
    ``forward`` runs the tree ops when called with ``harts_layout=...`` or inside a
    :func:`tree_call` that carries a layout, and the original code otherwise. Hybrid text models
    and keyword-dropping decoder layers are wrapped too (not counted). Returns the number of
    tree-capable modules (0: nothing in ``model`` is supported; the native model's HF wrapper
    counts as one)."""
    if getattr(model, "supports_harts_layout", False):
        return 1
    n = 0
    for mod in model.modules():
        if _is_hf_class(mod, _GDN_CLASSES):
            _patch(mod, _gdn_tree_forward)
        elif _is_hf_class(mod, _GATED_ATTENTION_CLASSES):
            _patch(mod, _attn_tree_forward)
        elif _is_hf_class(mod, _FULL_ATTENTION_CLASSES):
            _register_tree_attention()
            _patch(mod, _interface_attn_tree_forward)
        elif _is_hf_class(mod, _OLMO_GDN_CLASSES):
            _patch(mod, _olmo_gdn_tree_forward)
        elif _is_hf_class(mod, _OLMO_ATTENTION_CLASSES):
            _patch(mod, _olmo_attn_tree_forward)
        elif _is_hf_class(mod, _MAMBA2_CLASSES):
            _patch(mod, _mamba2_tree_forward)
        elif _is_hf_class(mod, _SHORT_CONV_CLASSES):
            _patch(mod, _short_conv_tree_forward)
        elif _is_hf_class(mod, _LIGHTNING_CLASSES):
            _patch(mod, _lightning_tree_forward)
        elif _is_hf_class(mod, _MAMBA1_CLASSES):
            _patch(mod, _mamba1_tree_forward)
        elif _is_hf_class(mod, _RG_RECURRENT_CLASSES):
            _patch(mod, _rg_recurrent_tree_forward)
        elif _is_hf_class(mod, _RG_ATTENTION_CLASSES):
            _patch(mod, _rg_attn_tree_forward)
        elif _is_hf_class(mod, _HYBRID_TEXT_MODEL_CLASSES):
            _patch(mod, _hybrid_text_model_tree_forward)
            continue
        elif _is_hf_class(mod, _KEYWORD_DROPPING_TEXT_MODEL_CLASSES):
            _patch(mod, _own_loop_text_model_tree_forward)
            continue
        elif _is_hf_class(mod, _KEYWORD_DROPPING_LAYER_CLASSES):
            _patch(mod, _layout_scope_forward)
            continue
        else:
            continue
        n += 1
    return n


def _patch(module: nn.Module, fn) -> None:
    """Install ``fn`` as the instance ``forward`` of ``module`` (once). The original it falls
    back to (``getattr(module, _PATCHED)``) is an instance-level forward already there, else
    the class ``forward`` resolved at each call (see :func:`_class_forward`)."""
    if hasattr(module, _PATCHED):
        return
    own = module.__dict__.get("forward")
    setattr(module, _PATCHED, own if own is not None else types.MethodType(_class_forward, module))
    module.forward = types.MethodType(fn, module)


def _text_model(hf_model: nn.Module) -> nn.Module:
    """The decoder stack of an HF causal LM (``model``; ``model.language_model`` for the
    multi-modal Qwen3.5 and Gemma 3 wrappers; the state-space models' ``backbone``)."""
    base = hf_model.model if hasattr(hf_model, "model") else hf_model.backbone
    return getattr(base, "language_model", base)


def _rope_types(rotary: nn.Module) -> list[tuple[str | None, str]]:
    """``(layer_type, rope_type)`` of each table of an HF rotary embedding (layer_type None for
    a single table; one per layer type where ``rope_type`` is a dict: Gemma 3)."""
    rope_type = getattr(rotary, "rope_type", None)
    if isinstance(rope_type, dict):  # per layer type
        return [(str(k), str(t)) for k, t in rope_type.items()]
    return [(None, str(rope_type))] if rope_type is not None else []


def length_dependent_rope(model: nn.Module) -> tuple[str, int] | None:
    """``(rope_type, longest)`` when a rotary embedding of ``model`` picks its frequencies from
    the longest position of the batch (transformers' ``dynamic`` NTK scaling and ``longrope``):
    a tree batch would give every row the frequencies of its microbatch's longest trajectory
    while trajectory-wise each trajectory gets its own, so tree mode is exact only for
    trajectories of at most ``longest`` tokens (below the original context, where these
    scalings leave the frequencies unchanged). A rotary with a table per layer type (Gemma 3)
    reads each type's own ``rope_parameters``; the smallest limit of all tables wins. None when
    no such rotary exists."""
    found: list[tuple[str, int]] = []
    for mod in model.modules():
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            continue
        original = getattr(mod, "original_max_seq_len", None)
        if original is None:
            continue
        params = getattr(getattr(mod, "config", None), "rope_parameters", None) or {}
        for layer_type, rope_type in _rope_types(mod):
            if "dynamic" in rope_type:
                found.append((rope_type, int(original) - 1))
            elif rope_type == "longrope":
                own = params.get(layer_type) if layer_type is not None else params
                limit = (own or {}).get("original_max_position_embeddings") or original
                found.append(("longrope", int(limit)))
    return min(found, key=lambda f: f[1]) if found else None


def check_rope_lengths(model: nn.Module, longest: int) -> None:
    """Raise ``NotImplementedError`` when :func:`length_dependent_rope` limits ``model`` to
    shorter trajectories than ``longest`` tokens (naming the rope type and both lengths)."""
    found = length_dependent_rope(model)
    if found is not None and longest > found[1]:
        raise NotImplementedError(
            f"rope_type {found[0]!r}: the rotary frequencies depend on the sequence length, "
            f"so tree mode is exact only up to {found[1]} tokens per trajectory; this batch has "
            f"a trajectory of {longest} tokens"
        )


def _tree_decoder_forward(
    tree_model: nn.Module, base: nn.Module, input_ids: torch.Tensor, layout: TreeLayout
) -> torch.Tensor:
    """The decoder stack ``base`` (HF text model) in tree mode: embeddings (times the text
    model's ``embedding_multiplier`` where it has one: Granite) → the first
    ``config.num_hidden_layers`` layers with ``position_ids`` = row depth, each inside
    ``tree_call(layout)`` (activation checkpointing when ``tree_model.gradient_checkpointing``
    and grad is on; the recomputation runs inside it too) → final norm. RoPE tables come from
    ``base.rotary_emb``; a model without one (OLMo Hybrid NoPE) gets ``position_embeddings=None``.
    A rotary embedding whose ``forward`` takes a ``layer_type`` (Gemma 3: its own frequencies
    and scaling for sliding and full layers) gives each layer the table of its
    ``config.layer_types`` entry, as HF's text model does. RecurrentGemma's text model
    (:data:`_POSITIONAL_LAYER_TEXT_MODEL_CLASSES`) scales the embeddings by its ``normalizer``
    and calls its layers with positional ``(hidden, position_ids, mask, use_cache, cache)``;
    so does this loop. No attention mask is built. input_ids ``[C]`` → hidden ``[C, D]``."""
    pos = layout.position_ids[None]
    h = base.get_input_embeddings()(input_ids[None])
    multiplier = getattr(base, "embedding_multiplier", None)  # Granite's text model forward
    if multiplier is not None:
        h = h * multiplier
    # RecurrentGemma's text model: embeddings times its (bf16) normalizer, layers called with
    # positional (hidden, position_ids, attention_mask, use_cache, cache).
    positional = _is_hf_class(base, _POSITIONAL_LAYER_TEXT_MODEL_CLASSES)
    if positional:
        h = h * base.normalizer.type(h.dtype)
    n_layers = tree_model.config.num_hidden_layers
    rotary = getattr(base, "rotary_emb", None) or getattr(base, "pos_emb", None)  # LFM2-MoE
    if rotary is not None and layout.forest.num_compact_tokens:
        check_rope_lengths(rotary, int(layout.forest.depth.max()) + 1)
    if rotary is None:
        pes: list[Any] = [None] * n_layers
    elif _rotary_per_layer_type(rotary):
        layer_types = list(tree_model.config.layer_types[:n_layers])
        tables = {t: rotary(h, pos, layer_type=t) for t in dict.fromkeys(layer_types)}
        pes = [tables[t] for t in layer_types]
    else:
        pes = [rotary(h, pos)] * n_layers

    # Zamba2's layers take the embeddings (the shared blocks' second input) and their index
    # positionally, then the padding and causal masks (None here), as its text model passes them.
    with_embeddings = _is_hf_class(base, _EMBEDDINGS_TO_EVERY_LAYER_TEXT_MODEL_CLASSES)
    embeddings = h

    def run(x: torch.Tensor, layer: nn.Module, pe: Any, idx: int, e: torch.Tensor) -> torch.Tensor:
        kw = dict(position_embeddings=pe, position_ids=pos, harts_layout=layout)
        with tree_call(layout):
            if positional:
                out = layer(x, pos, None, False, None, harts_layout=layout)
            elif with_embeddings:
                out = layer(x, e, idx, None, None, **kw)
            else:
                out = layer(x, **kw)
        return out[0] if isinstance(out, tuple) else out  # Bamba's layers return a tuple

    for idx, (layer, pe) in enumerate(zip(base.layers[:n_layers], pes)):
        if tree_model.gradient_checkpointing and torch.is_grad_enabled():
            h = checkpoint(run, h, layer, pe, idx, embeddings, use_reentrant=False)
        else:
            h = run(h, layer, pe, idx, embeddings)
    return _final_norm(base)(h)[0]


# Names of the final norm of HF text models: ``norm``, Nemotron-H's ``norm_f``, Bamba's
# ``final_layernorm``, LFM2's ``embedding_norm`` (applied after the last layer), RecurrentGemma's
# ``final_norm``.
_FINAL_NORM_NAMES = ("norm", "norm_f", "final_layernorm", "embedding_norm", "final_norm")


def _final_norm(base: nn.Module) -> nn.Module:
    """The final norm module of the HF text model ``base`` (see :data:`_FINAL_NORM_NAMES`)."""
    for name in _FINAL_NORM_NAMES:
        mod = getattr(base, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise TypeError(f"model: {type(base).__name__} has no final norm ({_FINAL_NORM_NAMES})")


def _rotary_per_layer_type(rotary: nn.Module) -> bool:
    """Whether an HF rotary embedding keeps a table per layer type (its ``forward`` takes
    ``layer_type``, and the config lists ``layer_types``)."""
    params = inspect.signature(rotary.forward).parameters
    config = getattr(rotary, "config", None)
    return "layer_type" in params and bool(getattr(config, "layer_types", None))


class _HFTreeModel(nn.Module):
    """Tree-mode view of an HF causal LM (weights shared, not copied): embeddings → decoder
    layers with ``position_ids`` = row depth and tree-aware token mixers → final norm. Router
    load-balancing loss (``config.output_router_logits``) from the router classes ``routers``,
    each row weighted by its multiplicity, so it equals the trajectory-wise value."""

    routers: tuple[str, ...] = ()

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.base = _text_model(hf_model)
        self.config = self.base.config
        self.gradient_checkpointing = False
        if patch_tree_mixers(hf_model) == 0:
            raise TypeError(f"model: {type(hf_model).__name__} has no supported token mixer")
        self._routers = [m for m in hf_model.modules() if _is_hf_class(m, self.routers)]
        self._routers += [
            m.router for m in hf_model.modules() if _is_hf_class(m, _LINEAR_ROUTER_PARENTS)
        ]

    @property
    def lm_head(self) -> nn.Linear:
        return self.hf.lm_head

    @property
    def logit_transform(self) -> LogitTransform:
        """What the HF causal LM's forward does to the LM head's logits
        (:func:`logit_transform_of`), for the compact log-prob head."""
        return logit_transform_of(self.hf)

    def _aux_loss(self, logits: list[torch.Tensor], layout: TreeLayout) -> torch.Tensor:
        from harts_verl.ops.moe import load_balancing_loss, softmax_topk_route

        cfg = self.config
        cat = torch.cat(logits, dim=0)
        norm = getattr(cfg, "norm_topk_prob", True)  # Qwen3.5-MoE / Mixtral always normalize
        n_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        route = softmax_topk_route(cat, cfg.num_experts_per_tok, norm_topk_prob=norm)
        w = layout.row_weights(route.probs.dtype).repeat(len(logits))
        loss = load_balancing_loss(
            route.probs, route.experts, n_experts, cfg.num_experts_per_tok, weights=w
        )
        return loss * cfg.router_aux_loss_coef

    def forward(
        self, input_ids: torch.Tensor, layout: TreeLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids ``[C]`` → (final hidden ``[C, D]``, router aux loss weighted by
        multiplicity when ``config.output_router_logits`` else 0)."""
        jitter = getattr(self.config, "router_jitter_noise", 0.0)
        if jitter and self.hf.training:
            raise NotImplementedError(
                f"router_jitter_noise = {jitter}: training-mode router noise is drawn per token, "
                "so rows shared by several trajectories would share it (call model.eval(), or "
                "set router_jitter_noise = 0)"
            )
        if self.hf.training:
            dropped = sorted(
                {
                    f"{name} (p = {float(m.p)})"
                    for name, m in self.hf.named_modules()
                    if isinstance(m, nn.Dropout) and m.p
                }
            )
            if dropped:
                shown = ", ".join(dropped[:3]) + (
                    f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
                )
                raise NotImplementedError(
                    f"{type(self.hf).__name__}: dropout in training ({shown}) draws one mask per "
                    "row, so rows shared by several trajectories would share it (call "
                    "model.eval(), or set the dropout probabilities to 0)"
                )
        captured: list[torch.Tensor] = []
        want_aux = bool(getattr(self.config, "output_router_logits", False)) and self._routers
        hooks = (
            [
                r.register_forward_hook(
                    lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out)
                )
                for r in self._routers
            ]
            if want_aux
            else []
        )
        try:
            h = _tree_decoder_forward(self, self.base, input_ids, layout)
        finally:
            for hk in hooks:
                hk.remove()
        aux = self._aux_loss(captured, layout) if captured else h.new_zeros(())
        return h, aux


class HybridTreeModel(_HFTreeModel):
    """Tree-mode view of a transformers Qwen3-Next / Qwen3.5 / Qwen3.5-MoE / OLMo Hybrid causal
    LM (weights shared, not copied)."""

    routers = _ROUTER_CLASSES


class HFCausalTreeModel(_HFTreeModel):
    """Tree-mode view of a full-attention HF causal LM of :data:`FULL_ATTENTION_MODEL_TYPES`
    (Qwen2 / Qwen3 / Llama / Mistral, the MoE Qwen2-MoE / Qwen3-MoE / Mixtral, DeepSeek-V3 with
    MLA, GLM-4-MoE, OLMo 2 / OLMo 3, Phi-3, Seed-OSS, GLM-4, Gemma 2 / Gemma 3, Granite /
    Granite-MoE (with or without a shared expert), Cohere / Cohere 2, SmolLM3, Ministral,
    EXAONE 4, ERNIE 4.5, Hunyuan dense, Apertus, Arcee, MiniMax-M2, OLMoE, FlexOlmo, dots.llm1,
    Solar-Open, GLM-4-MoE-Lite, EXAONE-MoE, Ministral 3, Mistral 4, Hunyuan-MoE, ERNIE 4.5 MoE,
    Cohere 2 MoE, LongCat-Flash (two MLA attentions a layer, zero-computation experts),
    gpt-oss), or of a Mamba-2
    hybrid (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1), Mamba-1 hybrid (Jamba), state-space
    model (Mamba, Falcon-Mamba, Mamba-2), short-conv hybrid (LFM2, LFM2-MoE),
    lightning-attention hybrid (MiniMax-Text-01 / MiniMax-M1) or Griffin hybrid
    (RecurrentGemma): :data:`MASKED_TREE_MODEL_TYPES`."""

    routers = _FULL_ATTENTION_ROUTER_CLASSES
