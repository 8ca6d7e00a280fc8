"""Small builders shared by the veRL tests and ``harts-verl check``: tiny HF models saved from
configs in code (no hub), engines built the way veRL's workers build them, and veRL-format
batches (nested prompt+response tensors) from token sequences.

Everything here runs on CPU with the platform shim (:mod:`harts_verl.workers.cpu_platform`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = [
    "TINY_IMAGE_TOKEN_ID",
    "TINY_KINDS",
    "TINY_MULTIMODAL_KINDS",
    "actor_config",
    "build_engine",
    "dp_worker",
    "init_process_group",
    "make_batch",
    "save_tiny_model",
    "tiny_hf_config",
    "tiny_hf_model",
]

TINY_KINDS = (
    "qwen2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "olmo_hybrid",
    "olmo_hybrid_nope",
    *("llama", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe"),
    *("olmo2", "olmo3", "phi3", "seed_oss", "glm4", "gemma3_text", "gpt_oss"),
    *("gemma2", "granite", "cohere", "cohere2", "granitemoe", "granitemoeshared"),
    *("smollm3", "ministral", "exaone4", "ernie4_5", "hunyuan_v1_dense", "apertus", "arcee"),
    "minimax_m2",
    *("olmoe", "flex_olmo", "dots1", "solar_open", "glm4_moe_lite", "exaone_moe"),
    *("ministral3", "mistral4"),
    *("hunyuan_v1_moe", "ernie4_5_moe", "cohere2_moe", "longcat_flash"),
    *("granitemoehybrid", "bamba", "nemotron_h", "falcon_h1", "lfm2", "lfm2_moe"),
    "zamba2",
    "minimax",
    "jamba",
    "recurrent_gemma",
    *("mamba", "falcon_mamba", "mamba2"),
)
# The multi-modal Qwen3.5 wrappers (``Qwen3_5ForConditionalGeneration`` /
# ``Qwen3_5MoeForConditionalGeneration``, model_type ``qwen3_5`` / ``qwen3_5_moe``): the text
# model of the ``qwen3_5`` / ``qwen3_5_moe`` kind and a one-block vision tower. Gemma 3's
# (``Gemma3ForConditionalGeneration``, model_type ``gemma3``): the text model of the
# ``gemma3_text`` kind and a one-layer SigLIP tower.
TINY_MULTIMODAL_KINDS = ("qwen3_5_mm", "qwen3_5_moe_mm", "gemma3_mm")
# Token ids of the tiny multi-modal configs (inside the default 64-token vocabulary).
TINY_IMAGE_TOKEN_ID = 60

# Shared by the hybrid kinds: 4 layers (linear, full, linear, full), GQA 4/2 heads of 8 (16
# for Qwen3.5, whose multi-axis RoPE needs >= 3 frequencies), GatedDeltaNet 2 key / 4 value heads.
_HYBRID = dict(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
# The full-attention kinds: 2 layers, GQA 4/2 heads of 8 on hidden 32 (the MoE kinds: 4 experts,
# top-2, 16 wide; DeepSeek-V3 / GLM-4-MoE: one dense layer first, a shared expert, sigmoid routing
# over 2 groups; DeepSeek-V3's MLA: q and kv low-rank paths, 8 + 8 q/k head dims, value heads of
# 4 so that the value width differs from the q/k width).
_DENSE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
_SOFTMAX_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
_SIGMOID_MOE = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.5,
)
# The same routing without a dense first layer (families that do not read first_k_dense_replace)
_SIGMOID_MOE_ALL_SPARSE = {k: v for k, v in _SIGMOID_MOE.items() if k != "first_k_dense_replace"}
# Multi-head latent attention (DeepSeek-V3, GLM-4-MoE-Lite, Mistral 4, LongCat-Flash): q and kv
# low-rank paths,
# 8 + 8 q/k head dims, value heads of 4 (a value width unlike the q/k width).
_MLA = dict(
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=4,
)
# OLMo 2 / OLMo 3, Phi-3, Seed-OSS, GLM-4 and Gemma 3: no pad/bos/eos ids (HF's defaults lie
# outside a tiny vocabulary); OLMo 3 and Gemma 3: a sliding-window layer, then a full one
# (window 4096 unless a test sets a shorter one); Phi-3: partial RoPE (6 of 8 dims, as in
# Phi-4-mini); Seed-OSS: no dropout (its defaults are 0.1); Gemma 3: q·k scale 16^-1/2, linear
# RoPE scaling on the full layer, tied embeddings. gpt-oss: hidden 64 (q width 4 × 8 = 32, not
# the hidden size, as in the real model), attention sinks, a 6-token sliding window on the first
# layer (shorter than the test trajectories), 4 biased experts 32 wide (top-2), YaRN RoPE;
# eager attention (HF runs sinks only there). Gemma 2: a 6-token sliding layer, then a full one,
# small attention and final logit soft-caps (3 and 5) and a 10x init range (0.2), so that tanh
# bends the tiny model's logits; tied embeddings, eager attention (HF's sdpa drops the attention
# soft-cap). Granite:
# embedding, residual, attention and logit multipliers away from 1 (Granite-MoE: the same, 4
# experts 64 wide, top-2; -Shared: plus a 16-wide shared expert). Cohere (Command R): parallel
# attention and MLP after one LayerNorm, per-head q/k LayerNorms, interleaved RoPE, logits
# times 0.25, tied embeddings; Cohere 2 (Command R7B / A): a 6-token sliding layer with RoPE,
# then a full layer without.
_NO_SPECIAL_IDS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
# YaRN (4x over 16 original positions) with Llama 4's position-dependent query scaling (Ministral
# 3, Mistral 4): the test trajectories span several of its 16-position steps.
_YARN_LLAMA4 = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=16,
    max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale_all_dim=1.0,
    mscale=1.0,
    llama_4_scaling_beta=0.1,
)
_GRANITE = dict(
    embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0
)
_SLIDING_FULL = ["sliding_attention", "full_attention"]
_FULL_ATTENTION = {
    "qwen2": ("Qwen2Config", {}),
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "mistral": ("MistralConfig", {"head_dim": 8}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {**_SOFTMAX_MOE, "num_experts": 4, "shared_expert_intermediate_size": 16},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", {**_SOFTMAX_MOE, "num_experts": 4, "head_dim": 8}),
    "mixtral": ("MixtralConfig", {**_SOFTMAX_MOE, "num_local_experts": 4, "head_dim": 8}),
    "deepseek_v3": ("DeepseekV3Config", {**_SIGMOID_MOE, **_MLA}),
    "glm4_moe": ("Glm4MoeConfig", {**_SIGMOID_MOE, "head_dim": 8, "use_qk_norm": True}),
    "olmo2": ("Olmo2Config", _NO_SPECIAL_IDS),
    "olmo3": ("Olmo3Config", {**_NO_SPECIAL_IDS, "layer_types": _SLIDING_FULL}),
    "phi3": (
        "Phi3Config",
        {
            **_NO_SPECIAL_IDS,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
            },
        },
    ),
    "seed_oss": (
        "SeedOssConfig",
        {**_NO_SPECIAL_IDS, "head_dim": 8, "attention_dropout": 0.0, "residual_dropout": 0.0},
    ),
    "glm4": ("Glm4Config", {**_NO_SPECIAL_IDS, "head_dim": 8}),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            **_NO_SPECIAL_IDS,
            "head_dim": 8,
            "query_pre_attn_scalar": 16,
            "layer_types": _SLIDING_FULL,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
            "tie_word_embeddings": True,
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 32,
            "head_dim": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 6,
            "layer_types": _SLIDING_FULL,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            },
        },
    ),
    "gemma2": (
        "Gemma2Config",
        {
            **_NO_SPECIAL_IDS,
            "head_dim": 8,
            "query_pre_attn_scalar": 16,
            "layer_types": _SLIDING_FULL,
            "sliding_window": 6,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": True,
            "initializer_range": 0.2,
        },
    ),
    "granite": ("GraniteConfig", {**_NO_SPECIAL_IDS, **_GRANITE}),
    "granitemoe": (
        "GraniteMoeConfig",
        {**_NO_SPECIAL_IDS, **_GRANITE, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        {
            **_NO_SPECIAL_IDS,
            **_GRANITE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 16,
        },
    ),
    "smollm3": ("SmolLM3Config", {**_NO_SPECIAL_IDS, "no_rope_layers": [1, 0]}),
    "ministral": (
        "MinistralConfig",
        {**_NO_SPECIAL_IDS, "head_dim": 8, "sliding_window": 6, "layer_types": _SLIDING_FULL},
    ),
    "exaone4": (
        "Exaone4Config",
        {**_NO_SPECIAL_IDS, "sliding_window": 6, "layer_types": _SLIDING_FULL},
    ),
    "ernie4_5": ("Ernie4_5Config", {**_NO_SPECIAL_IDS, "head_dim": 8}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {**_NO_SPECIAL_IDS, "head_dim": 8}),
    "apertus": ("ApertusConfig", _NO_SPECIAL_IDS),
    "arcee": ("ArceeConfig", {**_NO_SPECIAL_IDS, "head_dim": 8}),
    "minimax_m2": (
        "MiniMaxM2Config",
        {
            **_NO_SPECIAL_IDS,
            "head_dim": 8,
            "intermediate_size": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    # OLMoE / FlexOlmo: q/k norms over all heads, 4 experts 16 wide, top-2 softmax routing
    # (FlexOlmo: post-norm layers). dots.llm1 / Solar-Open: sigmoid routing with a correction
    # bias and a shared expert (dots1: one dense layer first); GLM-4-MoE-Lite (GLM-4.7-Flash):
    # multi-head latent attention as DeepSeek-V3's, a dense first layer (``mlp_layer_types``);
    # EXAONE-MoE: a sliding RoPE layer and a full NoPE one, a dense first layer, a shared expert.
    "olmoe": (
        "OlmoeConfig",
        {**_NO_SPECIAL_IDS, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
    ),
    "flex_olmo": (
        "FlexOlmoConfig",
        {**_NO_SPECIAL_IDS, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
    ),
    "dots1": (
        "Dots1Config",
        {**_NO_SPECIAL_IDS, **_SIGMOID_MOE, "head_dim": 8},
    ),
    "solar_open": (
        "SolarOpenConfig",
        {
            **_NO_SPECIAL_IDS,
            **_SIGMOID_MOE_ALL_SPARSE,
            "head_dim": 8,
        },
    ),
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        {
            **_NO_SPECIAL_IDS,
            **_SIGMOID_MOE_ALL_SPARSE,
            "mlp_layer_types": ["dense", "sparse"],
            **_MLA,
        },
    ),
    "exaone_moe": (
        "ExaoneMoeConfig",
        {
            **_NO_SPECIAL_IDS,
            "head_dim": 8,
            "sliding_window": 6,
            "layer_types": _SLIDING_FULL,
            "mlp_layer_types": ["dense", "sparse"],
            "first_k_dense_replace": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "num_shared_experts": 1,
            "routed_scaling_factor": 1.5,
        },
    ),
    # Ministral 3 / Mistral 4: YaRN RoPE with Llama 4's position-dependent query scaling
    # (``llama_4_scaling_beta``, from the row depths in tree mode); Mistral 4: MLA with
    # interleaved RoPE on half the rope dims, sigmoid-routed experts plus a shared one.
    "ministral3": (
        "Ministral3Config",
        {
            **_NO_SPECIAL_IDS,
            "head_dim": 8,
            "max_position_embeddings": 64,
            "rope_parameters": _YARN_LLAMA4,
        },
    ),
    "mistral4": (
        "Mistral4Config",
        {
            **_NO_SPECIAL_IDS,
            **_SIGMOID_MOE_ALL_SPARSE,
            **_MLA,
            "qk_head_dim": 16,
            "head_dim": 16,
            "max_position_embeddings": 64,
            "rope_parameters": {**_YARN_LLAMA4, "partial_rotary_factor": 0.5},
        },
    ),
    # Hunyuan-A13B-like: q/k norms after RoPE, softmax top-2 of 4 experts (renormalised) plus a
    # shared MLP in every layer, experts as wide as the MLP.
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        {
            **_NO_SPECIAL_IDS,
            "head_dim": 8,
            "intermediate_size": 16,
            "num_experts": 4,
            "moe_topk": 2,
        },
    ),
    # ERNIE 4.5 MoE: a dense first layer, then softmax top-2 of 4 experts chosen with the
    # ``moe_statics`` correction bias, a shared expert; interleaved RoPE.
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        {
            **_NO_SPECIAL_IDS,
            "num_hidden_layers": 3,
            "head_dim": 8,
            "moe_num_experts": 4,
            "moe_k": 2,
            "moe_intermediate_size": 16,
            "moe_num_shared_experts": 1,
        },
    ),
    # Cohere 2 MoE (Command A-like): a dense RoPE prefix layer, a sliding RoPE layer, a full NoPE
    # layer; parallel attention and MoE (softmax over the top-2 logits) averaged with a shared
    # expert; LayerNorms; logits times logit_scale.
    "cohere2_moe": (
        "Cohere2MoeConfig",
        {
            **_NO_SPECIAL_IDS,
            "num_hidden_layers": 3,
            "head_dim": 8,
            "intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_shared_experts": 1,
            "prefix_dense_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "sliding_window": 6,
            "logit_scale": 0.25,
        },
    ),
    # LongCat-Flash: two MLA attentions and two dense MLPs per layer, a shortcut MoE (softmax
    # over 4 experts and 2 zero-computation experts, top-2 by score + correction bias, scaled).
    "longcat_flash": (
        "LongcatFlashConfig",
        {
            **_NO_SPECIAL_IDS,
            **_MLA,
            "num_layers": 2,
            "ffn_hidden_size": 64,
            "head_dim": 8,
            "n_routed_experts": 4,
            "zero_expert_num": 2,
            "moe_topk": 2,
            "expert_ffn_hidden_size": 16,
            "routed_scaling_factor": 1.5,
        },
    ),
    "cohere": (
        "CohereConfig",
        {**_NO_SPECIAL_IDS, "logit_scale": 0.25, "use_qk_norm": True, "tie_word_embeddings": True},
    ),
    "cohere2": (
        "Cohere2Config",
        {
            **_NO_SPECIAL_IDS,
            "logit_scale": 0.25,
            "layer_types": _SLIDING_FULL,
            "sliding_window": 6,
            "tie_word_embeddings": True,
        },
    ),
}
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)
# OLMo Hybrid: 4 layers (linear, full, linear, full), GQA 4/2 heads of 8 (head_dim = hidden /
# heads), no pad/eos ids (HF's defaults lie outside a tiny vocabulary). ``olmo_hybrid``: RoPE,
# GatedDeltaNet 2 key / 4 value heads, beta in [0, 2] (``linear_allow_neg_eigval``);
# ``olmo_hybrid_nope``: NoPE (no ``rope_theta``: the model has no rotary table), 2 / 2 heads,
# beta in [0, 1]. A larger init range than HF's 0.02 makes the token mixers weigh in the output.
_OLMO_HYBRID = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    initializer_range=0.1,
    pad_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=False,
)
_QWEN3_5_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "mrope_section": [2, 1, 1],
}


# One vision block of width 16 (2 heads), 2×2 patches of 2 frames × 3 channels (24 values a
# patch), 2×2 patches merged into one token of the text width; a 4×4 table of position
# embeddings (veRL's dummy image for text-only batches is a 4×4 grid).
_TINY_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    in_channels=3,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,
    out_hidden_size=_HYBRID["hidden_size"],
)
# Gemma 3's SigLIP tower: one layer of width 16 (2 heads), 8×8 images in 2×2 patches (a 4×4
# grid), average-pooled 2×2 into 4 tokens an image (``mm_tokens_per_image``).
_TINY_SIGLIP = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_channels=3,
    image_size=8,
    patch_size=2,
)


def _multimodal_config(kind: str, vocab_size: int):
    """The config of a multi-modal kind (see :func:`tiny_hf_config`)."""
    import transformers

    text_kind = "gemma3_text" if kind == "gemma3_mm" else kind.removesuffix("_mm")
    text = tiny_hf_config(text_kind, vocab_size)
    if vocab_size < TINY_IMAGE_TOKEN_ID + 4:
        raise ValueError(
            f"vocab_size: the multi-modal kinds need ids {TINY_IMAGE_TOKEN_ID}.."
            f"{TINY_IMAGE_TOKEN_ID + 3} inside the vocabulary, got {vocab_size}"
        )
    if text_kind == "gemma3_text":
        cfg = transformers.Gemma3Config(
            text_config=text.to_dict(),
            vision_config=dict(_TINY_SIGLIP),
            mm_tokens_per_image=4,
            image_token_index=TINY_IMAGE_TOKEN_ID,
            boi_token_index=TINY_IMAGE_TOKEN_ID + 2,
            eoi_token_index=TINY_IMAGE_TOKEN_ID + 3,
            tie_word_embeddings=True,
        )
        for sub in (cfg, cfg.text_config, cfg.vision_config):
            sub._attn_implementation = "sdpa"
        return cfg
    cls = transformers.Qwen3_5Config if text_kind == "qwen3_5" else transformers.Qwen3_5MoeConfig
    cfg = cls(
        text_config=text.to_dict(),
        vision_config=dict(_TINY_VISION),
        image_token_id=TINY_IMAGE_TOKEN_ID,
        video_token_id=TINY_IMAGE_TOKEN_ID + 1,
        vision_start_token_id=TINY_IMAGE_TOKEN_ID + 2,
        vision_end_token_id=TINY_IMAGE_TOKEN_ID + 3,
        tie_word_embeddings=False,
    )
    for sub in (cfg, cfg.text_config, cfg.vision_config):
        sub._attn_implementation = "sdpa"
    if text_kind == "qwen3_5_moe":
        for sub in (cfg, cfg.text_config):
            sub._experts_implementation = "eager"
    return cfg


# The Mamba-2 hybrids: hidden 32, Mamba-2 mixers of 4 heads of 16 over 2 groups of state 8 (HF's
# torch path in chunks of 16, shorter than the test trajectories), GQA 4/2 attention. Granite
# 4.0-H: mamba, NoPE attention, mamba, each with 4 experts 16 wide (top-2) and a 16-wide shared
# MLP, Granite's multipliers; Bamba: mamba, RoPE attention (half the head dims rotated),
# mamba, dense MLPs; Nemotron-H: mamba, attention (NoPE), ReLU² MLP, mamba, MoE (4 routed experts
# top-2 by sigmoid scores, one shared expert), the pure-torch path (no mamba kernels), with
# HF's chunk of 256 tokens: transformers 5.10's Nemotron-H torch path sums its inter-chunk
# state recurrence over the wrong axis, so it is right only within one chunk (Granite 4.0-H and
# Bamba, whose torch paths are right, run in chunks of 16). Falcon-H1: two layers, each with a
# Mamba-2 mixer (its gated norm after the gate, per group) and attention in parallel, every µP
# multiplier away from 1.
_MAMBA2_MIXER = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8)
_MAMBA2_HYBRID = {
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {
            **_GRANITE,
            **_MAMBA2_MIXER,
            "num_hidden_layers": 3,
            "layer_types": ["mamba", "attention", "mamba"],
            "mamba_chunk_size": 16,
            "intermediate_size": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 16,
            "position_embedding_type": "nope",
        },
    ),
    "bamba": (
        "BambaConfig",
        {
            **_MAMBA2_MIXER,
            "num_hidden_layers": 3,
            "attn_layer_indices": [1],
            "mamba_chunk_size": 16,
        },
    ),
    "nemotron_h": (
        "NemotronHConfig",
        {
            "layers_block_type": ["mamba", "attention", "mlp", "mamba", "moe"],
            "head_dim": 8,
            "ssm_state_size": 8,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "chunk_size": 256,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "moe_intermediate_size": 16,
            "moe_shared_expert_intermediate_size": 16,
            "num_experts_per_tok": 2,
            "use_mamba_kernels": False,
        },
    ),
    "falcon_h1": (
        "FalconH1Config",
        {
            **_MAMBA2_MIXER,
            "num_hidden_layers": 2,
            "mamba_d_ssm": 64,
            "mamba_chunk_size": 16,
            "mamba_rms_norm": True,
            "mamba_norm_before_gate": False,
            "embedding_multiplier": 2.0,
            "lm_head_multiplier": 0.5,
            "mlp_multipliers": [0.8, 1.2],
            "key_multiplier": 0.7,
            "attention_in_multiplier": 1.3,
            "attention_out_multiplier": 0.9,
            "ssm_multipliers": [0.5, 1.5, 0.8, 1.2, 0.7],
            "ssm_in_multiplier": 1.1,
            "ssm_out_multiplier": 0.6,
        },
    ),
    # Zamba2 (1.2B-like): mamba, hybrid (shared block + mamba), mamba, hybrid; one shared block
    # used twice with LoRA adapters per use, RoPE in the shared attention (4 heads of 16 over the
    # 64-wide concatenation), Mamba-2 mixers of 4 heads × 16, 2 groups; HF's chunks of 256 tokens
    # (its torch path, like Nemotron-H's, is right only within one chunk: transformers #47246).
    "zamba2": (
        "Zamba2Config",
        {
            **_NO_SPECIAL_IDS,
            "num_hidden_layers": 4,
            "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
            "num_key_value_heads": 4,  # HF's adapters assume as many kv heads as heads
            "num_mem_blocks": 1,
            "use_shared_attention_adapter": True,
            "adapter_rank": 4,
            "use_mem_rope": True,
            "mamba_d_state": 8,
            "n_mamba_heads": 4,
            "mamba_ngroups": 2,
            "chunk_size": 256,
            "use_mamba_kernels": False,
        },
    ),
}

# The short-conv hybrids (Liquid AI LFM2 / LFM2-MoE): hidden 32, conv, attention (GQA 4/2, q/k
# norms, RoPE), conv; 3-token convolutions with a bias. LFM2: its auto-adjusted gated MLP
# (64 → 48 wide), tied embeddings (as released); LFM2-MoE: a dense first layer, then 4 experts
# 16 wide, top-2 by sigmoid scores plus an expert bias.
_CONV_LAYERS = ["conv", "full_attention", "conv"]
_CONV_HYBRID = {
    "lfm2": (
        "Lfm2Config",
        {
            "num_hidden_layers": 3,
            "layer_types": _CONV_LAYERS,
            "conv_bias": True,
            "block_multiple_of": 16,
            "tie_word_embeddings": True,
        },
    ),
    "lfm2_moe": (
        "Lfm2MoeConfig",
        {
            "num_hidden_layers": 3,
            "layer_types": _CONV_LAYERS,
            "conv_bias": True,
            "num_dense_layers": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
        },
    ),
}
# The lightning-attention hybrid MiniMax-Text-01 / MiniMax-M1 (``minimax``): lightning, softmax
# (GQA 4/2, RoPE), lightning, lightning (the released 7:1 pattern, shortened); 4 experts 16 wide,
# top-2 softmax routing in every layer; HF's lightning blocks of 16 tokens; residual factors
# other than 1 (the released checkpoints use DeepNorm-style alphas).
_LIGHTNING_HYBRID = {
    "minimax": (
        "MiniMaxConfig",
        {
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention"] + ["linear_attention"] * 2,
            "head_dim": 8,
            "block_size": 16,
            "intermediate_size": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "full_attn_alpha_factor": 1.2,
            "full_attn_beta_factor": 0.9,
            "linear_attn_alpha_factor": 1.3,
            "linear_attn_beta_factor": 0.8,
            "mlp_alpha_factor": 1.1,
            "mlp_beta_factor": 0.7,
        },
    ),
}
# The Mamba-1 hybrid AI21 Jamba: mamba, attention (NoPE, GQA 4/2), mamba, mamba; Mamba-1 mixers
# 64 channels wide (expand 2), state 8, rank-4 time steps, 4-token convolutions; 4 experts
# (top-2, no renormalisation) in layers 1 and 3, MLPs elsewhere; the pure-torch selective scan.
_MAMBA1_HYBRID = {
    "jamba": (
        "JambaConfig",
        {
            "num_hidden_layers": 4,
            "attn_layer_period": 4,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 16,
            "mamba_d_state": 8,
            "mamba_dt_rank": 4,
            "use_mamba_kernels": False,
            "pad_token_id": None,
        },
    ),
}
# The Griffin hybrid Google RecurrentGemma: recurrent, recurrent, attention, recurrent (the
# released 2:1 pattern); RG-LRU 32 channels wide in 4 gate blocks, 4-token convolutions; local MQA
# attention (4 heads of 8, one key/value head, RoPE on half of each head) over a 12-token window;
# tied embeddings (as released); logits soft-capped at 5 (30 released: a cap that tiny logits
# reach).
_RECURRENT_GEMMA = {
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        {
            **_NO_SPECIAL_IDS,
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "lru_width": 32,
            "attention_window_size": 12,
            "conv1d_width": 4,
            "logits_soft_cap": 5.0,
            "block_types": ["recurrent", "recurrent", "attention"],
            "tie_word_embeddings": True,
        },
    ),
}
_RECURRENT_HYBRID = {
    **_MAMBA2_HYBRID,
    **_CONV_HYBRID,
    **_LIGHTNING_HYBRID,
    **_MAMBA1_HYBRID,
    **_RECURRENT_GEMMA,
}
# The pure state-space models (Mamba, Falcon-Mamba, Mamba-2): hidden 32, 2 layers, mixers 64
# channels wide (Mamba-2: 4 heads of 16, 2 groups, 16-token chunks), state 8; the residual
# stream in the model dtype (their default keeps it in float32).
_SSM_MAMBA1 = dict(state_size=8, expand=2, time_step_rank=4, conv_kernel=4)
_SSM = {
    "mamba": ("MambaConfig", _SSM_MAMBA1),
    "falcon_mamba": ("FalconMambaConfig", _SSM_MAMBA1),
    "mamba2": (
        "Mamba2Config",
        dict(num_heads=4, head_dim=16, n_groups=2, state_size=8, chunk_size=16, expand=2),
    ),
}


def tiny_hf_config(kind: str, vocab_size: int = 64):
    """A tiny transformers config of ``kind`` (``qwen2``, ``qwen3_next``, ``qwen3_5`` = the
    text-only Qwen3.5 causal LM, ``qwen3_5_moe`` = the text-only Qwen3.5-MoE causal LM,
    ``olmo_hybrid`` = OLMo Hybrid with RoPE, ``olmo_hybrid_nope`` = OLMo Hybrid with NoPE,
    ``qwen3_5_mm`` / ``qwen3_5_moe_mm`` = the multi-modal wrappers, whose text config is that of
    ``qwen3_5`` / ``qwen3_5_moe`` and whose vision tower has one block; image token id
    ``TINY_IMAGE_TOKEN_ID``, then video, vision start and vision end; ``gemma3_mm`` = Gemma 3's
    multi-modal wrapper, text config of ``gemma3_text``, a one-layer SigLIP tower, 4 tokens an
    image, image / begin / end-of-image ids ``TINY_IMAGE_TOKEN_ID`` + 0 / 2 / 3; the
    full-attention causal LMs ``llama``, ``qwen3``, ``mistral``, ``qwen2_moe``, ``qwen3_moe``,
    ``mixtral``, ``deepseek_v3``, ``glm4_moe``, ``olmo2``, ``olmo3``, ``phi3``, ``seed_oss``,
    ``glm4``, ``gemma3_text``, ``gpt_oss``, ``gemma2``, ``granite``, ``granitemoe``,
    ``granitemoeshared``, ``cohere``, ``cohere2``, ...; the Mamba-2 hybrids
    ``granitemoehybrid``, ``bamba``, ``nemotron_h``, ``falcon_h1``; the short-conv hybrids ``lfm2``,
    ``lfm2_moe``; the lightning-attention hybrid ``minimax``; the Mamba-1 hybrid ``jamba``; the
    Griffin hybrid ``recurrent_gemma``; the state-space models ``mamba``, ``falcon_mamba``, ``mamba2``), sdpa attention (eager for
    gpt-oss, whose class has no sdpa, and Gemma 2, whose attention soft-cap HF's sdpa path
    drops), eager experts (float64-capable on CPU).
    Raises ``ValueError`` for another kind."""
    import transformers

    from harts_verl.models.hf import attn_implementation_for

    if kind in TINY_MULTIMODAL_KINDS:
        return _multimodal_config(kind, vocab_size)
    if kind in _SSM:
        cls_name, extra = _SSM[kind]
        cfg = getattr(transformers, cls_name)(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            residual_in_fp32=False,
            **_NO_SPECIAL_IDS,
            **extra,
        )
    elif kind in _FULL_ATTENTION or kind in _RECURRENT_HYBRID:
        cls_name, extra = _FULL_ATTENTION.get(kind) or _RECURRENT_HYBRID[kind]
        extra = copy.deepcopy(extra)  # each config its own layer_types / rope_parameters
        cfg = getattr(transformers, cls_name)(vocab_size=vocab_size, **{**_DENSE, **extra})
    elif kind == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(
            vocab_size=vocab_size,
            intermediate_size=64,
            decoder_sparse_step=1,
            **_HYBRID,
            **_MOE,
        )
    elif kind == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(
            vocab_size=vocab_size,
            intermediate_size=64,
            rope_parameters=dict(_QWEN3_5_ROPE),
            **{**_HYBRID, "head_dim": 16},
        )
    elif kind == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeTextConfig(
            vocab_size=vocab_size,
            rope_parameters=dict(_QWEN3_5_ROPE),
            **{**_HYBRID, "head_dim": 16},
            **_MOE,
        )
    elif kind == "olmo_hybrid":
        cfg = transformers.OlmoHybridConfig(
            vocab_size=vocab_size,
            linear_num_value_heads=4,
            linear_allow_neg_eigval=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **_OLMO_HYBRID,
        )
    elif kind == "olmo_hybrid_nope":
        cfg = transformers.OlmoHybridConfig(
            vocab_size=vocab_size,
            linear_num_value_heads=2,
            linear_allow_neg_eigval=False,
            rope_parameters={"rope_type": "default", "rope_theta": None},
            **_OLMO_HYBRID,
        )
    else:
        raise ValueError(
            f"kind: expected one of {TINY_KINDS + TINY_MULTIMODAL_KINDS}, got {kind!r}"
        )
    cfg._attn_implementation = attn_implementation_for(cfg)
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    return cfg


def tiny_hf_model(kind: str, *, seed: int = 0, vocab_size: int = 64) -> torch.nn.Module:
    """A randomly initialised (``torch.manual_seed(seed)``) fp32 tiny causal LM of ``kind`` (a
    ``…ForConditionalGeneration`` for the multi-modal kinds)."""
    import transformers

    cls = {
        "qwen3_5_mm": transformers.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe_mm": transformers.Qwen3_5MoeForConditionalGeneration,
        "gemma3_mm": transformers.Gemma3ForConditionalGeneration,
        "qwen2": transformers.Qwen2ForCausalLM,
        "llama": transformers.LlamaForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2_moe": transformers.Qwen2MoeForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
        "glm4_moe": transformers.Glm4MoeForCausalLM,
        "olmo2": transformers.Olmo2ForCausalLM,
        "olmo3": transformers.Olmo3ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "seed_oss": transformers.SeedOssForCausalLM,
        "glm4": transformers.Glm4ForCausalLM,
        "gemma3_text": transformers.Gemma3ForCausalLM,
        "gpt_oss": transformers.GptOssForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
        "granite": transformers.GraniteForCausalLM,
        "granitemoehybrid": transformers.GraniteMoeHybridForCausalLM,
        "bamba": transformers.BambaForCausalLM,
        "nemotron_h": transformers.NemotronHForCausalLM,
        "falcon_h1": transformers.FalconH1ForCausalLM,
        "zamba2": transformers.Zamba2ForCausalLM,
        "lfm2": transformers.Lfm2ForCausalLM,
        "lfm2_moe": transformers.Lfm2MoeForCausalLM,
        "minimax": transformers.MiniMaxForCausalLM,
        "jamba": transformers.JambaForCausalLM,
        "recurrent_gemma": transformers.RecurrentGemmaForCausalLM,
        "mamba": transformers.MambaForCausalLM,
        "falcon_mamba": transformers.FalconMambaForCausalLM,
        "mamba2": transformers.Mamba2ForCausalLM,
        "smollm3": transformers.SmolLM3ForCausalLM,
        "ministral": transformers.MinistralForCausalLM,
        "exaone4": transformers.Exaone4ForCausalLM,
        "ernie4_5": transformers.Ernie4_5ForCausalLM,
        "hunyuan_v1_dense": transformers.HunYuanDenseV1ForCausalLM,
        "apertus": transformers.ApertusForCausalLM,
        "arcee": transformers.ArceeForCausalLM,
        "minimax_m2": transformers.MiniMaxM2ForCausalLM,
        "olmoe": transformers.OlmoeForCausalLM,
        "flex_olmo": transformers.FlexOlmoForCausalLM,
        "dots1": transformers.Dots1ForCausalLM,
        "solar_open": transformers.SolarOpenForCausalLM,
        "glm4_moe_lite": transformers.Glm4MoeLiteForCausalLM,
        "exaone_moe": transformers.ExaoneMoeForCausalLM,
        "ministral3": transformers.Ministral3ForCausalLM,
        "mistral4": transformers.Mistral4ForCausalLM,
        "hunyuan_v1_moe": transformers.HunYuanMoEV1ForCausalLM,
        "ernie4_5_moe": transformers.Ernie4_5_MoeForCausalLM,
        "cohere2_moe": transformers.Cohere2MoeForCausalLM,
        "longcat_flash": transformers.LongcatFlashForCausalLM,
        "granitemoe": transformers.GraniteMoeForCausalLM,
        "granitemoeshared": transformers.GraniteMoeSharedForCausalLM,
        "cohere": transformers.CohereForCausalLM,
        "cohere2": transformers.Cohere2ForCausalLM,
        "qwen3_next": transformers.Qwen3NextForCausalLM,
        "qwen3_5": transformers.Qwen3_5ForCausalLM,
        "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM,
        "olmo_hybrid": transformers.OlmoHybridForCausalLM,
        "olmo_hybrid_nope": transformers.OlmoHybridForCausalLM,
    }
    cfg = tiny_hf_config(kind, vocab_size)
    torch.manual_seed(seed)
    return cls[kind](cfg).float()


def save_tiny_value_model(kind: str, path: str, *, seed: int = 0, vocab_size: int = 64) -> str:
    """A randomly initialised tiny critic of ``kind``: the token classifier with one label
    (``AutoModelForTokenClassification``, what veRL loads for a value model; weights of the
    value head included, so every load is identical), saved (fp32) to ``path``."""
    from transformers import AutoModelForTokenClassification

    cfg = tiny_hf_config(kind, vocab_size)
    cfg.num_labels = 1
    cfg.classifier_dropout = 0.0
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(cfg).float()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def save_tiny_model(kind: str, path: str, *, seed: int = 0, vocab_size: int = 64) -> str:
    """Build a randomly initialised tiny model of ``kind`` and save it (fp32) to ``path``."""
    model = tiny_hf_model(kind, seed=seed, vocab_size=vocab_size)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def init_process_group(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    """gloo process group on localhost (no-op when already initialised)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _fp32_engine_config(max_token_len: int):
    """veRL's FSDP2 engine config of the test engines: fp32 throughout, no compile, dynamic
    batching up to ``max_token_len`` tokens per micro-batch."""
    from verl.workers.config import FSDPEngineConfig

    return FSDPEngineConfig(
        strategy="fsdp2",
        model_dtype="fp32",
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_torch_compile=False,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=max_token_len,
        infer_max_token_len_per_gpu=max_token_len,
    )


def actor_config(
    *,
    loss_mode: str = "vanilla",
    loss_agg_mode: str = "token-mean",
    harts: dict[str, Any] | None = None,
    strategy: str = "harts_fsdp2",
    max_token_len: int = 4096,
    entropy_coeff: float = 0.0,
    optimizer: str = "SGD",
    lr: float = 0.1,
    weight_decay: float = 0.0,
    sp: int = 1,
    policy_loss: dict[str, Any] | None = None,
    kl_loss_type: str | None = None,
    kl_loss_coef: float = 0.5,
    **fields: Any,
):
    """An actor config as veRL's worker builds it (``HartsFSDPActorConfig`` for the harts
    strategy, veRL's ``FSDPActorConfig`` otherwise); ``fields``: other ``ActorConfig`` fields
    (``clip_ratio_c``, ``ppo_epochs``, ...); ``sp``: Ulysses sequence-parallel size;
    ``policy_loss``: ``PolicyLossConfig`` fields (its ``rollout_correction`` as a dict of
    ``RolloutCorrectionConfig`` fields), replacing ``loss_mode``; ``kl_loss_type``: veRL's KL
    loss against the batch's ``ref_log_prob`` (``use_kl_loss``), off when None."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import FSDPActorConfig, FSDPOptimizerConfig
    from verl.workers.config.actor import PolicyLossConfig

    pl = dict(policy_loss or {"loss_mode": loss_mode})
    if isinstance(pl.get("rollout_correction"), dict):
        pl["rollout_correction"] = RolloutCorrectionConfig(**pl["rollout_correction"])

    from harts_verl.workers.config import HartsFSDPActorConfig

    fsdp = _fp32_engine_config(max_token_len)
    common = dict(
        ppo_mini_batch_size=8,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=max_token_len,
        ppo_infer_max_token_len_per_gpu=max_token_len,
        policy_loss=PolicyLossConfig(**pl),
        loss_agg_mode=loss_agg_mode,
        entropy_coeff=entropy_coeff,
        use_torch_compile=False,
        rollout_n=1,
        fsdp_config=fsdp,
        optim=FSDPOptimizerConfig(
            optimizer=optimizer,
            lr=lr,
            total_training_steps=10,
            clip_grad=1e9,
            weight_decay=weight_decay,
        ),
        use_remove_padding=True,
        ulysses_sequence_parallel_size=sp,
        use_kl_loss=kl_loss_type is not None,
        kl_loss_type=kl_loss_type or "low_var_kl",
        kl_loss_coef=kl_loss_coef,
        **fields,
    )
    if strategy == "harts_fsdp2":
        return HartsFSDPActorConfig(strategy=strategy, harts=harts or {}, **common)
    return FSDPActorConfig(strategy=strategy, **common)


def critic_config(
    *,
    harts: dict[str, Any] | None = None,
    strategy: str = "harts_fsdp2",
    max_token_len: int = 4096,
    loss_agg_mode: str = "token-mean",
    lr: float = 0.1,
):
    """A critic config as veRL's trainer builds it (``HartsFSDPCriticConfig`` for the harts
    strategy, veRL's ``FSDPCriticConfig`` otherwise): fp32, dynamic batching, SGD."""
    from verl.workers.config import FSDPCriticConfig, FSDPOptimizerConfig

    from harts_verl.workers.config import HartsFSDPCriticConfig

    fsdp = _fp32_engine_config(max_token_len)
    common = dict(
        ppo_mini_batch_size=8,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=max_token_len,
        forward_max_token_len_per_gpu=max_token_len,
        loss_agg_mode=loss_agg_mode,
        rollout_n=1,
        fsdp=fsdp,
        optim=FSDPOptimizerConfig(
            optimizer="SGD", lr=lr, total_training_steps=10, clip_grad=1e9, weight_decay=0.0
        ),
    )
    if strategy == "harts_fsdp2":
        return HartsFSDPCriticConfig(strategy=strategy, harts=harts or {}, **common)
    return FSDPCriticConfig(strategy=strategy, **common)


def build_engine(
    model_path: str,
    actor_cfg: Any,
    *,
    use_remove_padding: bool = True,
    gradient_checkpointing: bool = False,
    model_type: str = "language_model",
    use_fused_kernels: bool = False,
    lora_rank: int = 0,
    attn_implementation: str | None = None,
    hf_config_path: str | None = None,
):
    """Build and initialise the engine of ``actor_cfg.strategy`` for the model at
    ``model_path`` through veRL's ``EngineRegistry`` (as ``TrainingWorker`` does);
    ``gradient_checkpointing``: veRL's ``enable_gradient_checkpointing`` (HF's, non-reentrant);
    ``model_type="value_model"`` with a :func:`critic_config` builds the critic's engine;
    ``use_fused_kernels``: veRL's fused LM-head forward (torch backend; it replaces the model
    class's ``forward`` for the rest of the process); ``lora_rank`` > 0: veRL's LoRA adapters
    (peft, every linear layer, ``lora_alpha`` = 2 × rank); ``attn_implementation``: HF's
    attention implementation (default: :func:`~harts_verl.models.hf.attn_implementation_for`);
    ``hf_config_path``: veRL's ``model.hf_config_path`` (the config, when not ``model_path``'s)."""
    from transformers import AutoConfig
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig
    from verl.workers.engine import EngineRegistry

    from harts_verl.models.hf import attn_implementation_for

    config_path = hf_config_path or model_path
    attn = attn_implementation or attn_implementation_for(AutoConfig.from_pretrained(config_path))
    model_cfg = HFModelConfig(
        path=model_path,
        hf_config_path=hf_config_path,
        load_tokenizer=False,
        override_config={"attn_implementation": attn},
        enable_gradient_checkpointing=gradient_checkpointing,
        use_remove_padding=use_remove_padding,
        use_fused_kernels=use_fused_kernels,
        fused_kernel_options={"impl_backend": "torch"} if use_fused_kernels else {},
        lora_rank=lora_rank,
        lora_alpha=2 * lora_rank,
    )
    model_cfg.model_type = model_type
    engine = EngineRegistry.new(
        model_type=model_type,
        backend=actor_cfg.engine.strategy,
        model_config=model_cfg,
        engine_config=actor_cfg.engine,
        optimizer_config=actor_cfg.optim,
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def make_batch(
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    *,
    seed: int = 0,
    temperature: float | Sequence[float] = 1.0,
    calculate_entropy: bool = False,
    max_token_len: int = 4096,
    tool_spans: Sequence[tuple[int, int, int]] = (),
    use_remove_padding: bool = True,
    global_batch_size: int | None = None,
    trajectory_ids: Sequence[int] | None = None,
    multi_modal_inputs: Sequence[dict[str, Any] | None] | None = None,
    use_fused_kernels: bool = False,
    ref_log_probs: bool = False,
    rollout_is_weights: bool = False,
) -> TensorDict:
    """A veRL engine batch (no-padding format) for trajectories ``sequences`` whose first
    ``prompt_lengths[i]`` tokens are prompt. ``tool_spans`` = (trajectory, start, end) ranges of
    the response that are tool tokens (loss mask 0), for multi-turn batches. Advantages and old
    log-probs are deterministic pseudo-random values of (seed, trajectory id); ``trajectory_ids``
    (default 0..N−1) name the trajectories, so a rank's slice of a batch gets the same values. ``use_remove_padding=False`` makes
    the stock engine run padded rows instead of one packed row (needed for linear-attention
    models without fla: HF's torch fallback would carry state across packed sequences).
    ``multi_modal_inputs``: per trajectory, the model's vision keywords (e.g. ``pixel_values``,
    ``image_grid_thw``) or an empty dict / None for a text-only one, stored as veRL stores them
    (a ``NonTensorStack`` under ``multi_modal_inputs``); position ids stay the text positions.
    ``temperature``: one for the batch (a non-tensor field), or one per trajectory (a float32
    ``[N]`` tensor field, veRL's per-sample temperatures). ``ref_log_probs`` /
    ``rollout_is_weights`` add veRL's ``ref_log_prob`` (the KL loss's reference) and
    ``rollout_is_weights`` (rollout-correction importance weights) per response token, also
    deterministic in (seed, trajectory id)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    n = len(sequences)
    tids = list(trajectory_ids) if trajectory_ids is not None else list(range(n))
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    ids = [torch.as_tensor(np.asarray(s), dtype=torch.long) for s in sequences]
    prompts = [t[:p] for t, p in zip(ids, prompt_lengths)]
    responses = [t[p:] for t, p in zip(ids, prompt_lengths)]
    if any(r.shape[0] == 0 for r in responses) or any(p < 1 for p in prompt_lengths):
        raise ValueError("make_batch: every trajectory needs >= 1 prompt and >= 1 response token")
    resp_mask = [torch.ones(r.shape[0], dtype=torch.long) for r in responses]
    for i, a, b in tool_spans:
        resp_mask[i][a:b] = 0
    loss_mask = [
        torch.cat([torch.zeros(p, dtype=torch.long), m]) for p, m in zip(prompt_lengths, resp_mask)
    ]
    rngs = [np.random.default_rng([seed, t]) for t in tids]
    adv = [torch.full((r.shape[0],), float(g.normal())) for r, g in zip(responses, rngs)]
    old = [
        torch.as_tensor(-g.uniform(0.5, 5.0, r.shape[0]), dtype=torch.float32)
        for r, g in zip(responses, rngs)
    ]
    # the critic's targets: old values and returns per response token
    values = [
        torch.as_tensor(g.normal(0, 0.5, r.shape[0]), dtype=torch.float32)
        for r, g in zip(responses, rngs)
    ]
    returns = [
        torch.as_tensor(g.normal(0, 1.0, r.shape[0]), dtype=torch.float32)
        for r, g in zip(responses, rngs)
    ]
    extra = {}
    if ref_log_probs:
        extra["ref_log_prob"] = nested(
            [
                o + torch.as_tensor(g.normal(0, 0.3, o.shape[0]), dtype=o.dtype)
                for o, g in zip(old, rngs)
            ]
        )
    if rollout_is_weights:
        extra["rollout_is_weights"] = nested(
            [
                torch.as_tensor(g.uniform(0.5, 1.5, r.shape[0]), dtype=torch.float32)
                for r, g in zip(responses, rngs)
            ]
        )
    td = TensorDict(
        {
            "input_ids": nested(ids),
            "position_ids": nested([torch.arange(t.shape[0]) for t in ids]),
            "prompts": nested(prompts),
            "responses": nested(responses),
            "response_mask": nested(resp_mask),
            "loss_mask": nested(loss_mask),
            "attention_mask": nested([torch.ones(t.shape[0], dtype=torch.long) for t in ids]),
            "advantages": nested(adv),
            "old_log_probs": nested(old),
            "values": nested(values),
            "returns": nested(returns),
            **extra,
        },
        batch_size=n,
    )
    if multi_modal_inputs is not None:
        from tensordict import NonTensorData, NonTensorStack

        if len(multi_modal_inputs) != n:
            raise ValueError(
                f"multi_modal_inputs: expected one entry per trajectory ({n}), got "
                f"{len(multi_modal_inputs)}"
            )
        td["multi_modal_inputs"] = NonTensorStack.from_list(
            [NonTensorData(item) for item in multi_modal_inputs]
        )
    per_sample = not isinstance(temperature, int | float)
    if per_sample:
        if len(temperature) != n:
            raise ValueError(
                f"temperature: expected one per trajectory ({n}), got {len(temperature)}"
            )
        td["temperature"] = torch.tensor([float(t) for t in temperature], dtype=torch.float32)
    tu.assign_non_tensor(
        td,
        **({} if per_sample else {"temperature": temperature}),
        calculate_entropy=calculate_entropy,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=max_token_len,
        micro_batch_size_per_gpu=1,
        use_remove_padding=use_remove_padding,
        use_fused_kernels=use_fused_kernels,
        global_batch_size=global_batch_size or n,
    )
    return td


def make_trainer_batch(
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    *,
    pad_token_id: int = 0,
    **kwargs: Any,
) -> TensorDict:
    """:func:`make_batch`'s batch (same tokens, masks and per-token values; ``kwargs`` are its
    keywords) in the form veRL's trainer hands it to the engine:
    prompts left-padded and responses right-padded to the batch's widths (dense ``input_ids``,
    ``attention_mask``, ``position_ids`` ``[B, P + R]``; ``prompts`` ``[B, P]``; ``responses``,
    ``response_mask`` and every per-response-token field ``[B, R]``, zero past a response),
    then veRL's ``left_right_2_no_padding`` (as ``RayPPOTrainer`` does before an engine call):
    ``input_ids`` / ``position_ids`` nested again, the per-token fields left dense. Per-trajectory
    fields (per-sample ``temperature`` ``[B]``, ``multi_modal_inputs``) are kept as they are."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = make_batch(sequences, prompt_lengths, **kwargs)
    n = len(sequences)
    prompts = list(td["prompts"].unbind())
    responses = list(td["responses"].unbind())
    wp = max(t.shape[0] for t in prompts)
    wr = max(t.shape[0] for t in responses)

    def right(ts: list[torch.Tensor], width: int, value: float = 0) -> torch.Tensor:
        out = torch.full((n, width), value, dtype=ts[0].dtype)
        for i, t in enumerate(ts):
            out[i, : t.shape[0]] = t
        return out

    def left(ts: list[torch.Tensor], width: int, value: float = 0) -> torch.Tensor:
        out = torch.full((n, width), value, dtype=ts[0].dtype)
        for i, t in enumerate(ts):
            out[i, width - t.shape[0] :] = t
        return out

    ones = [torch.ones(t.shape[0], dtype=torch.long) for t in prompts]
    mask = torch.cat([left(ones, wp), right([torch.ones_like(r) for r in responses], wr)], dim=1)
    dense = {
        "input_ids": torch.cat(
            [left(prompts, wp, pad_token_id), right(responses, wr, pad_token_id)], dim=1
        ),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp_min(0),
        "prompts": left(prompts, wp, pad_token_id),
        "responses": right(responses, wr, pad_token_id),
    }
    skip = {*dense, "loss_mask"}  # left_right_2_no_padding makes loss_mask of response_mask
    for key in td.keys():
        value = td.get(key)
        if key in skip or not isinstance(value, torch.Tensor):
            continue
        # per response token: padded to the batch's width; per trajectory (e.g. per-sample
        # temperatures): as veRL's DataProto keeps them
        dense[key] = right(list(value.unbind()), wr) if value.is_nested else value
    out = TensorDict(dense, batch_size=n)
    tu.assign_non_tensor(
        out,
        **{
            key: tu.get_non_tensor_data(td, key, None)
            for key in td.keys()
            if not isinstance(td.get(key), torch.Tensor)
        },
    )
    return left_right_2_no_padding(out)


def dp_worker(
    rank: int,
    world_size: int,
    port: int,
    model_path: str,
    out_path: str,
    sequences: list[list[int]],
    prompt_lengths: list[int],
    parts: list[list[int]],
    strategy: str = "harts_fsdp2",
    sp: int = 1,
    capacity_tokens: int = 40,
    loss_mode: str = "vanilla",
    max_token_len: int = 4096,
    policy_loss: dict | None = None,
    harts: dict | None = None,
) -> None:
    """One rank of a gloo data-parallel run of the ``harts_fsdp2`` engine (CPU shim): infer
    log-probs and one train step on the trajectories ``parts[rank // sp]`` of this rank's DP
    group (``sp``: Ulysses sequence-parallel size; ranks ``d·sp … d·sp + sp − 1`` share DP rank
    ``d``); saves ``{"indices", "log_probs", "entropy", "grads", "grad_norm", "metrics"}`` to
    ``out_path`` (``loss_mode``: the policy loss; ``max_token_len``: the token budget of a
    micro-batch; full gradients, gathered from the FSDP shards; ``metrics``: the train step's
    ``harts/*`` metrics and its per-micro-batch losses; ``metric_values``: the loss function's
    veRL ``Metric`` entries as ``{key: (aggregation, values)}``; ``policy_loss``, ``harts``:
    as :func:`actor_config`'s, ``harts`` added to the chunk size and capacity)."""
    import sys
    from functools import partial

    sys.modules["fla"] = None
    os.environ["VERL_PLATFORM"] = "harts_cpu"
    from harts_verl.workers.cpu_platform import install_cpu_platform

    install_cpu_platform()
    init_process_group(rank, world_size, port)
    from verl.workers.utils.losses import ppo_loss

    mine = parts[rank // sp]
    seqs = [sequences[i] for i in mine]
    pls = [prompt_lengths[i] for i in mine]
    cfg = actor_config(
        strategy=strategy,
        harts={"chunk_size": 8, "capacity_tokens": capacity_tokens, **(harts or {})},
        sp=sp,
        loss_mode=loss_mode,
        max_token_len=max_token_len,
        policy_loss=policy_loss,
    )
    engine = build_engine(model_path, cfg)
    mk = partial(
        make_batch,
        seqs,
        pls,
        global_batch_size=len(sequences),
        trajectory_ids=mine,
        max_token_len=max_token_len,
    )
    with engine.eval_mode():
        inf = engine.infer_batch(mk(calculate_entropy=True))
    with engine.train_mode():
        out = engine.train_batch(mk(), loss_function=partial(ppo_loss, config=cfg))
        grads = {}
        for name, p in engine.module.named_parameters():
            g = p.grad
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    torch.save(
        {
            "indices": mine,
            "log_probs": [t.clone() for t in inf["model_output"]["log_probs"].unbind()],
            "entropy": [t.clone() for t in inf["model_output"]["entropy"].unbind()],
            "grads": grads,
            # veRL reports grad_norm on the output-collecting rank (SP rank 0) only
            "grad_norm": float(out["metrics"].get("grad_norm", float("nan"))),
            "metrics": {
                "loss": [float(x) for x in out.get("loss", [])],
                **{k: v for k, v in out["metrics"].items() if k.startswith("harts/")},
            },
            # veRL Metric entries of the train step: {key: (aggregation, values)}
            "metric_values": {
                k: (v.aggregation.value, [float(x) for x in v.values])
                for k, v in out["metrics"].items()
                if hasattr(v, "aggregation")
            },
        },
        out_path,
    )
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
