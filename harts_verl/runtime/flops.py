"""Analytic FLOP model: expanded ÷ tree work of one forward/backward for a model and a forest.

Counts matmul FLOPs (2·m·n·k) of the forward; backward is ~2× forward for the matmul terms, so
the ratio of forward counts stands for the ratio of forward+backward (softmax attention's
backward is ~2.5× its forward and recomputation re-runs the layers but not the LM head: see
docs/runtime.md for what that leaves out). Terms:

* per-token (row-wise) work: projections, FFN / active MoE experts, router, LM head — ∝ tokens
  (expanded: S; tree: C);
* softmax attention: per (query, key) pair 2·H·(Dqk + Dv) — pairs are Σ_i L_i(L_i+1)/2 expanded
  and Σ_rows (depth + 1) in the tree; a layer with a sliding window w (given per layer to
  :func:`ideal_flop_ratio`) counts min(position + 1, w) keys per query instead;
* chunkwise linear attention: per processed token HV·(2B(3K+2V) + 6KV) with the delta rule,
  HV·(2B(K+V) + 4KV) without (intra-chunk matrices and state reads/updates at the run's chunk
  size B) — processed tokens are S expanded and C + replay in the tree;
* short convolutions: 2·W·channels per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts_verl.models.adapter import (
    CONV_HYBRID_MODEL_TYPES,
    FULL_ATTENTION_MODEL_TYPES,
    LIGHTNING_HYBRID_MODEL_TYPES,
    MAMBA1_HYBRID_MODEL_TYPES,
    MAMBA2_HYBRID_MODEL_TYPES,
    RECURRENT_GEMMA_MODEL_TYPES,
    SSM_MODEL_TYPES,
)
from harts_verl.tree import RolloutForest

__all__ = [
    "ModelShape",
    "causal_pairs",
    "conv_hybrid_shape",
    "forward_flops",
    "full_attention_shape",
    "gated_hybrid_shape",
    "ideal_flop_ratio",
    "lightning_hybrid_shape",
    "longcat_flash_shape",
    "mamba1_hybrid_shape",
    "mamba2_hybrid_shape",
    "model_shape",
    "native_model_shape",
    "olmo_hybrid_shape",
    "qwen3_next_shape",
    "recurrent_gemma_shape",
    "ssm_shape",
    "tree_pairs",
]


@dataclass(frozen=True)
class ModelShape:
    """Per-token and per-pair FLOP coefficients of a model (forward). A token that a
    chunkwise linear-attention kernel processes at chunk size B costs
    ``linear_per_token + B * linear_per_chunk_token`` (:meth:`linear_cost`)."""

    dense_per_token: float  # row-wise matmuls incl. LM head
    attention_per_pair: float  # summed over softmax-attention layers
    linear_per_token: float  # summed over linear-attention layers: state reads and updates
    linear_per_chunk_token: float = 0.0  # the same layers' intra-chunk matrices, per unit of B
    # the LM head's part of dense_per_token (2·hidden·vocab): it runs on rows with a next token
    head_per_token: float = 0.0

    def linear_cost(self, chunk_size: int) -> float:
        """Linear-attention FLOPs per processed token at ``chunk_size`` (summed over layers)."""
        return self.linear_per_token + chunk_size * self.linear_per_chunk_token


def _chunk_terms(heads: int, k: int, v: int, *, delta_rule: bool) -> np.ndarray:
    """``[fixed, per unit of B]`` FLOPs per processed token of one chunkwise linear-attention
    layer with ``heads`` value heads. Without the delta rule: inside the chunk q·k and p·v
    (2·B·(K+V)), state read and update (4·K·V). With it (fla's ``chunk_gated_delta_rule`` /
    ``chunk_kda``, HF's torch chunk kernel): also k·kᵀ and the WY products T·k and T·v inside the
    chunk (2·B·(3K+2V) in all; the triangular solve, ~B² per token, is not a matmul of these and
    is left out), and the state's reads by q and w and its update (6·K·V)."""
    if delta_rule:
        return np.array([heads * 6.0 * k * v, heads * 2.0 * (3 * k + 2 * v)])
    return np.array([heads * 4.0 * k * v, heads * 2.0 * (k + v)])


def _shape(dense: float, attn: float, lin: Any) -> ModelShape:
    """A :class:`ModelShape` from ``lin``: 0 or the summed :func:`_chunk_terms`."""
    fixed, per_chunk = (float(x) for x in np.broadcast_to(np.asarray(lin, dtype=float), (2,)))
    return ModelShape(float(dense), float(attn), fixed, per_chunk)


def native_model_shape(cfg: Any) -> ModelShape:
    """Coefficients of a :class:`~harts_verl.models.HybridConfig`."""
    d = cfg.hidden_size
    dense = 2.0 * d * cfg.vocab_size  # LM head
    attn = 0.0
    lin = 0.0
    for i, t in enumerate(cfg.layer_types):
        if t in ("kda", "gdn"):
            h, hv = cfg.linear_num_heads, cfg.linear_num_value_heads
            k, v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            proj = d * (2 * h * k + hv * v) + hv * v * d  # q, k, v, out
            if t == "kda":  # decay and output gates (low-rank or full), beta
                if cfg.kda_low_rank_gates:
                    proj += d * k + k * hv * k + d * v + v * hv * v
                else:
                    proj += d * hv * k + d * hv * v
                proj += d * hv
            else:  # z (output gate), a, b
                proj += d * hv * v + 2 * d * hv
            dense += 2.0 * proj + 2.0 * cfg.conv_size * (2 * h * k + hv * v)
            lin = lin + _chunk_terms(hv, k, v, delta_rule=True)
        elif t == "mla":
            dense_i, attn_i = _mla_attention_layer(cfg)
            gate = 2.0 * d * cfg.num_attention_heads if cfg.mla_output_gate else 0.0
            dense, attn = dense + dense_i + gate, attn + attn_i
        else:  # gqa
            hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            dense += 2.0 * (
                d * hq * hd * (2 if cfg.attn_output_gate else 1) + 2 * d * hkv * hd + hq * hd * d
            )
            attn += 2.0 * hq * 2 * hd
        if i in cfg.moe_layers and cfg.num_experts:
            dense += 2.0 * d * cfg.num_experts
            dense += 2.0 * 3 * d * cfg.moe_intermediate_size * cfg.num_experts_per_tok
            if cfg.shared_expert_intermediate_size:
                gate = d if cfg.shared_expert_gate else 0
                dense += 2.0 * (3 * d * cfg.shared_expert_intermediate_size + gate)
        else:
            dense += 2.0 * 3 * d * cfg.intermediate_size
    head = 2.0 * d * cfg.vocab_size
    return dataclasses.replace(_shape(dense, attn, lin), head_per_token=head)


def _hf_gdn_layer(cfg: Any) -> tuple[float, np.ndarray]:
    """(row-wise FLOPs per token, chunkwise-kernel :func:`_chunk_terms` per processed token)
    of one HF GatedDeltaNet layer: q/k/v, z (output gate), a, b and output projections,
    depthwise q/k/v convolutions, the chunkwise delta rule."""
    d = cfg.hidden_size
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    k, v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    proj = d * (2 * hk * k + 2 * hv * v) + d * 2 * hv + hv * v * d
    dense = 2.0 * proj + 2.0 * cfg.linear_conv_kernel_dim * (2 * hk * k + hv * v)
    return dense, _chunk_terms(hv, k, v, delta_rule=True)


def _hf_attention_layer(cfg: Any, *, output_gate: bool) -> tuple[float, float]:
    """(projection FLOPs per token, softmax-attention FLOPs per (query, key) pair) of one HF
    GQA attention layer; ``output_gate``: q_proj also yields a per-head gate (Qwen3-Next /
    Qwen3.5)."""
    d = cfg.hidden_size
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    hd = getattr(cfg, "head_dim", None) or d // hq
    q_out = hq * hd * (2 if output_gate else 1)
    return 2.0 * (d * q_out + 2 * d * hkv * hd + hq * hd * d), 2.0 * hq * 2 * hd


def _gla_chunk_flops(heads: int, k: int, v: int) -> np.ndarray:
    """Chunkwise gated linear attention without the delta rule, per processed token
    (:func:`_chunk_terms`): per value head q·k and p·v inside the chunk (2·B·(K+V)), state read
    and update (4·K·V)."""
    return _chunk_terms(heads, k, v, delta_rule=False)


def _mla_attention_layer(cfg: Any) -> tuple[float, float]:
    """(projection FLOPs per token, softmax-attention FLOPs per (query, key) pair) of one
    multi-head latent attention layer (DeepSeek-V3, native ``mla``): q through the
    ``q_lora_rank`` bottleneck (``q_a_proj``, ``q_b_proj``; one ``q_proj`` without it), the
    joint kv latent plus the shared rope key (``kv_a_proj_with_mqa``), per-head no-rope keys
    and values from the latent (``kv_b_proj``), ``o_proj``; per pair, q·k over
    ``qk_nope_head_dim + qk_rope_head_dim`` and p·v over ``v_head_dim``."""
    d, h, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk if cfg.q_lora_rank else d * h * qk
    kv = d * (r + cfg.qk_rope_head_dim) + r * h * (cfg.qk_nope_head_dim + v)
    return 2.0 * (q + kv + h * v * d), 2.0 * h * (qk + v)


_UNGATED_MLP_TYPES = ("apertus", "arcee")  # up → activation (xIELU, ReLU²) → down


# MoE families whose experts are ``intermediate_size`` wide (the others: ``moe_intermediate_size``).
_EXPERT_WIDTH_IS_INTERMEDIATE = (
    *("mixtral", "gpt_oss", "granitemoe", "granitemoeshared", "minimax_m2", "olmoe", "flex_olmo"),
    *("hunyuan_v1_moe", "cohere2_moe"),
)


def _per_layer(value: Any, i: int) -> Any:
    """A config field that is one value or a list with one per layer (Hunyuan's ``moe_topk``)."""
    return value[i] if isinstance(value, list | tuple) else value


def _is_sparse_layer(cfg: Any, i: int) -> bool:
    """Whether layer ``i`` of an HF MoE config routes to experts: ``mlp_layer_types`` where the
    config has them (``sparse``); ERNIE 4.5 MoE's ``moe_layer_interval`` between
    ``moe_layer_start_index`` and ``moe_layer_end_index`` (-1: the last layer); from
    ``first_k_dense_replace`` on (DeepSeek-V3, GLM-4-MoE); else every
    ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` (every layer where the config has
    none of these, e.g. Mixtral)."""
    mlp_types = getattr(cfg, "mlp_layer_types", None)
    if mlp_types is not None:  # GLM-4-MoE-Lite, EXAONE-MoE, Cohere 2 MoE
        return mlp_types[i] == "sparse"
    interval = getattr(cfg, "moe_layer_interval", None)
    if interval is not None:  # ERNIE 4.5 MoE
        end = cfg.moe_layer_end_index
        end = cfg.num_hidden_layers - 1 if end == -1 else end
        return (i + 1) % interval == 0 and cfg.moe_layer_start_index <= i <= end
    first_dense = getattr(cfg, "first_k_dense_replace", None)
    if first_dense is not None:
        return i >= first_dense
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    return (i + 1) % step == 0 and i not in (getattr(cfg, "mlp_only_layers", None) or ())


def _ffn_layer(cfg: Any, i: int) -> float:
    """Row-wise FLOPs per token of layer ``i``'s feed-forward block in an HF model: a gated MLP
    of ``intermediate_size`` (Apertus' and Arcee's: ungated, two matrices; Cohere 2 MoE's dense
    prefix: ``prefix_dense_intermediate_size``), or, in a sparse layer
    (:func:`_is_sparse_layer`), a sparse MoE block: the router (one weight row per routed
    expert), ``num_experts_per_tok`` (Hunyuan: ``moe_topk``, one or one per layer) gated experts
    (``moe_intermediate_size`` wide; ``intermediate_size`` for
    :data:`_EXPERT_WIDTH_IS_INTERMEDIATE`; biases ignored), and in full any shared expert:
    Granite-MoE-Shared's ``shared_intermediate_size`` wide one, Qwen2-MoE / Qwen3-Next /
    Qwen3.5-MoE's ``shared_expert_intermediate_size`` wide one and its sigmoid gate,
    Hunyuan-MoE's MLP as wide as its experts, DeepSeek-V3 / GLM-4-MoE's ``n_shared_experts``
    (EXAONE-MoE, Cohere 2 MoE: ``num_shared_experts``; ERNIE 4.5 MoE:
    ``moe_num_shared_experts``) fused into one MLP that many experts wide."""
    d = cfg.hidden_size
    num_experts = 0
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        num_experts = num_experts or int(_per_layer(getattr(cfg, key, 0), i) or 0)
    if not (num_experts and _is_sparse_layer(cfg, i)):
        # a gated MLP (gate, up, down), or Apertus' / Arcee's ungated one (up, down)
        mats = 2 if cfg.model_type in _UNGATED_MLP_TYPES else 3
        width = getattr(cfg, "prefix_dense_intermediate_size", None) or cfg.intermediate_size
        return 2.0 * mats * d * width
    if cfg.model_type in _EXPERT_WIDTH_IS_INTERMEDIATE:
        width = cfg.intermediate_size
    else:
        width = cfg.moe_intermediate_size
    top_k = _per_layer(getattr(cfg, "num_experts_per_tok", None) or cfg.moe_topk, i)
    flops = d * num_experts + 3 * d * width * top_k
    shared = getattr(cfg, "shared_expert_intermediate_size", None)
    if shared is not None:
        flops += 3 * d * shared + d
    if getattr(cfg, "shared_intermediate_size", 0):  # Granite-MoE-Shared: no gate
        flops += 3 * d * cfg.shared_intermediate_size
    if cfg.model_type == "hunyuan_v1_moe":  # its shared MLP, as wide as the experts
        flops += 3 * d * width
    n_shared = (
        getattr(cfg, "n_shared_experts", None)
        or getattr(cfg, "num_shared_experts", None)
        or getattr(cfg, "moe_num_shared_experts", 0)
    )
    if n_shared:  # configs without shared experts may have no moe_intermediate_size
        flops += 3 * d * width * n_shared
    return 2.0 * flops


def longcat_flash_shape(cfg: Any) -> ModelShape:
    """Coefficients of an HF LongCat-Flash (``longcat_flash``): per layer (``num_layers``) two
    multi-head latent attentions (:func:`_mla_attention_layer`), two gated MLPs
    ``ffn_hidden_size`` wide and a shortcut MoE: the router over the routed and
    zero-computation experts and ``moe_topk`` gated experts ``expert_ffn_hidden_size`` wide (an
    upper bound: a token routed to a zero-computation expert does no work there); the LM head."""
    d = cfg.hidden_size
    dense_a, attn_a = _mla_attention_layer(cfg)
    mlps = 2 * 3 * d * cfg.ffn_hidden_size
    router = d * (cfg.n_routed_experts + cfg.zero_expert_num)
    experts = 3 * d * cfg.expert_ffn_hidden_size * cfg.moe_topk
    per_layer = 2 * dense_a + 2.0 * (mlps + router + experts)
    return ModelShape(
        2.0 * d * cfg.vocab_size + cfg.num_layers * per_layer, cfg.num_layers * 2 * attn_a, 0.0
    )


def gated_hybrid_shape(cfg: Any) -> ModelShape:
    """Coefficients of a transformers Qwen3-Next (``Qwen3NextConfig``) or Qwen3.5 text model
    (``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig``): GatedDeltaNet layers (Qwen3-Next fuses
    the q|k|v|z and b|a projections, Qwen3.5 keeps them separate: same FLOPs), gated softmax
    attention, and per layer a dense MLP or a sparse MoE block (router, ``num_experts_per_tok``
    experts, shared expert and its gate). Qwen3-Next's MoE layers follow
    ``decoder_sparse_step`` / ``mlp_only_layers``; Qwen3.5-MoE has MoE in every layer and the
    dense Qwen3.5 none."""
    dense = 2.0 * cfg.hidden_size * cfg.vocab_size
    attn = lin = 0.0
    for i, t in enumerate(cfg.layer_types):
        if t == "linear_attention":
            dense_i, lin_i = _hf_gdn_layer(cfg)
            dense, lin = dense + dense_i, lin + lin_i
        else:
            dense_i, attn_i = _hf_attention_layer(cfg, output_gate=True)
            dense, attn = dense + dense_i, attn + attn_i
        dense += _ffn_layer(cfg, i)
    return _shape(dense, attn, lin)


qwen3_next_shape = gated_hybrid_shape  # the name this module used first


def olmo_hybrid_shape(cfg: Any) -> ModelShape:
    """Coefficients of a transformers OLMo Hybrid (``OlmoHybridConfig``): GatedDeltaNet layers
    (separate q, k, v, a, b, output-gate ``g_proj`` and ``o_proj`` projections, depthwise q/k/v
    convolutions), softmax attention without an output gate (q/k/v/o projections; RoPE or NoPE
    costs no matmul), a gated MLP in every layer, the LM head."""
    d = cfg.hidden_size
    dense = 2.0 * d * cfg.vocab_size
    attn = lin = 0.0
    for t in cfg.layer_types:
        if t == "linear_attention":
            dense_i, lin_i = _hf_gdn_layer(cfg)
            dense, lin = dense + dense_i, lin + lin_i
        else:
            dense_i, attn_i = _hf_attention_layer(cfg, output_gate=False)
            dense, attn = dense + dense_i, attn + attn_i
        dense += 2.0 * 3 * d * cfg.intermediate_size
    return _shape(dense, attn, lin)


def full_attention_shape(cfg: Any) -> ModelShape:
    """Coefficients of a full-attention HF causal LM (every type of
    ``FULL_ATTENTION_MODEL_TYPES``): per layer GQA q/k/v/o projections (Phi-3's fused qkv: the
    same FLOPs; biases, norms, soft-caps and gpt-oss's attention sinks ignored; sliding windows
    enter through :func:`ideal_flop_ratio`'s ``windows``)
    or DeepSeek-V3's multi-head latent attention (configs with ``kv_lora_rank``), an MLP or a
    sparse MoE block (see :func:`_ffn_layer`); the LM head."""
    dense, attn = 2.0 * cfg.hidden_size * cfg.vocab_size, 0.0
    mla = getattr(cfg, "kv_lora_rank", None) is not None
    for i in range(cfg.num_hidden_layers):
        if mla:
            dense_i, attn_i = _mla_attention_layer(cfg)
        else:
            dense_i, attn_i = _hf_attention_layer(cfg, output_gate=False)
        dense, attn = dense + dense_i + _ffn_layer(cfg, i), attn + attn_i
    return ModelShape(dense, attn, 0.0)


def _mamba2_mixer(cfg: Any) -> tuple[float, np.ndarray]:
    """(row-wise FLOPs per token, SSD-kernel FLOPs per processed token as :func:`_chunk_terms`)
    of one HF Mamba-2 mixer (Granite 4.0-H / Bamba ``mamba_*`` fields, Nemotron-H's
    ``mamba_num_heads`` …):
    ``in_proj`` (gate, x, B, C, dt), the depthwise conv over x|B|C, ``out_proj``; the chunkwise
    gated linear attention (per head: q·k and p·x inside the chunk, state read and update)."""
    d = cfg.hidden_size
    if cfg.model_type == "nemotron_h":
        nh, p, ng = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups
        n, w = cfg.ssm_state_size, cfg.conv_kernel
    elif cfg.model_type == "mamba2":
        nh, p, ng = cfg.num_heads, cfg.head_dim, cfg.n_groups
        n, w = cfg.state_size, cfg.conv_kernel
    elif cfg.model_type == "zamba2":
        nh, p, ng = cfg.n_mamba_heads, cfg.mamba_headdim, cfg.mamba_ngroups
        n, w = cfg.mamba_d_state, cfg.mamba_d_conv
    else:
        nh, p, ng = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups
        n, w = cfg.mamba_d_state, cfg.mamba_d_conv
    inner = nh * p
    conv = inner + 2 * ng * n
    dense = 2.0 * d * (inner + conv + nh) + 2.0 * inner * d + 2.0 * w * conv
    return dense, _gla_chunk_flops(nh, n, p)


def _zamba2_shared_block(cfg: Any) -> tuple[float, float]:
    """(row-wise FLOPs per token, softmax-attention FLOPs per pair) of one use of a Zamba2
    shared transformer block: q/k/v over the concatenated hidden state and embeddings
    (``attention_hidden_size`` = 2 × hidden) plus their LoRA adapters, ``o_proj``, the gated MLP
    and its adapter, and the linear back into the residual stream."""
    d, d2, r = cfg.hidden_size, cfg.attention_hidden_size, cfg.adapter_rank
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim
    attn = d2 * hq * hd + 2 * d2 * hkv * hd + hq * hd * d
    if cfg.use_shared_attention_adapter:
        attn += 3 * 2 * d2 * r
    inter = cfg.intermediate_size
    mlp = d * 2 * inter + d * r + r * 2 * inter + inter * d
    return 2.0 * (attn + mlp + d * d), 2.0 * hq * 2 * hd


def mamba2_hybrid_shape(cfg: Any) -> ModelShape:
    """Coefficients of a transformers Mamba-2 hybrid (``granitemoehybrid``: Granite 4.0-H,
    ``bamba``, ``nemotron_h``, ``zamba2`` (a shared block before the mixer in its ``hybrid``
    layers, :func:`_zamba2_shared_block`) from ``config.layers_block_type``; ``falcon_h1``: a mixer,
    attention and a gated MLP in every layer): Mamba-2 mixers
    (:func:`_mamba2_mixer`) and GQA attention; Granite 4.0-H adds to every layer a MoE block
    (router, top-k gated experts ``intermediate_size`` wide) and a gated shared MLP
    (``shared_intermediate_size``), Bamba a gated MLP; Nemotron-H's ``mlp`` blocks are ungated
    (up, down), its ``moe`` blocks route to ungated experts (in ``moe_latent_size`` between
    two latent projections when set) plus one ungated shared expert. The LM head."""
    d = cfg.hidden_size
    dense, attn, lin = 2.0 * d * cfg.vocab_size, 0.0, 0.0
    if cfg.model_type == "falcon_h1":  # a Mamba-2 mixer, attention and a gated MLP per layer
        dense_m, lin_m = _mamba2_mixer(cfg)
        dense_a, attn_a = _hf_attention_layer(cfg, output_gate=False)
        n = cfg.num_hidden_layers
        mlp = 2.0 * 3 * d * cfg.intermediate_size
        return _shape(dense + n * (dense_m + dense_a + mlp), n * attn_a, n * lin_m)
    for t in cfg.layers_block_type:
        if t in ("mamba", "hybrid"):
            dense_i, lin_i = _mamba2_mixer(cfg)
            dense, lin = dense + dense_i, lin + lin_i
            if t == "hybrid":  # Zamba2: the shared block before the mixer
                dense_i, attn_i = _zamba2_shared_block(cfg)
                dense, attn = dense + dense_i, attn + attn_i
        elif t == "attention":
            dense_i, attn_i = _hf_attention_layer(cfg, output_gate=False)
            dense, attn = dense + dense_i, attn + attn_i
        elif t == "mlp":  # Nemotron-H
            dense += 2.0 * 2 * d * cfg.intermediate_size
        elif t == "moe":  # Nemotron-H: one shared expert, routed ones in the latent width
            latent = getattr(cfg, "moe_latent_size", None)
            e_in = latent or d
            routed = 2 * e_in * cfg.moe_intermediate_size * cfg.num_experts_per_tok
            shared = 2 * d * cfg.moe_shared_expert_intermediate_size
            proj = 2 * d * latent if latent else 0  # fc1 / fc2 latent projections
            dense += 2.0 * (d * cfg.n_routed_experts + routed + shared + proj)
        else:
            raise ValueError(f"model_shape: unknown {cfg.model_type} layer type {t!r}")
        if cfg.model_type == "granitemoehybrid":
            dense += 2.0 * 3 * d * cfg.shared_intermediate_size
            if cfg.num_local_experts:
                experts = 3 * d * cfg.intermediate_size * cfg.num_experts_per_tok
                dense += 2.0 * (d * cfg.num_local_experts + experts)
        elif cfg.model_type == "bamba":
            dense += 2.0 * 3 * d * cfg.intermediate_size
    return _shape(dense, attn, lin)


def _lfm2_mlp_width(cfg: Any) -> int:
    """The width of an LFM2 gated MLP: ``intermediate_size``, auto-adjusted as HF's ``Lfm2MLP``
    does (2/3 of it, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``)."""
    width = cfg.intermediate_size
    if getattr(cfg, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        if cfg.block_ffn_dim_multiplier is not None:
            width = int(cfg.block_ffn_dim_multiplier * width)
            width = cfg.block_multiple_of * (
                (width + cfg.block_multiple_of - 1) // cfg.block_multiple_of
            )
    return width


def conv_hybrid_shape(cfg: Any) -> ModelShape:
    """Coefficients of a transformers short-conv hybrid (``lfm2``, ``lfm2_moe``) from
    ``config.layer_types``: gated short convolutions (``in_proj`` to B, C, x; the depthwise
    ``conv_L_cache``-token conv; ``out_proj``) and GQA attention; per layer a gated MLP (LFM2's
    auto-adjusted width; LFM2-MoE's first ``num_dense_layers``) or LFM2-MoE's router and top-k
    gated experts; the LM head."""
    d = cfg.hidden_size
    dense, attn = 2.0 * d * cfg.vocab_size, 0.0
    for i, t in enumerate(cfg.layer_types):
        if t == "full_attention":
            dense_i, attn_i = _hf_attention_layer(cfg, output_gate=False)
            dense, attn = dense + dense_i, attn + attn_i
        else:
            dense += 2.0 * 4 * d * d + 2.0 * cfg.conv_L_cache * d
        if cfg.model_type == "lfm2":
            dense += 2.0 * 3 * d * _lfm2_mlp_width(cfg)
        elif i < cfg.num_dense_layers:
            dense += 2.0 * 3 * d * cfg.intermediate_size
        else:
            experts = 3 * d * cfg.moe_intermediate_size * cfg.num_experts_per_tok
            dense += 2.0 * (d * cfg.num_experts + experts)
    return ModelShape(dense, attn, 0.0)


def lightning_hybrid_shape(cfg: Any) -> ModelShape:
    """Coefficients of a transformers lightning-attention hybrid (``minimax``: MiniMax-Text-01 /
    MiniMax-M1) from ``config.layer_types``: lightning layers (q|k|v, output-gate and output
    projections; the chunkwise linear attention without the delta rule: per head q·k and p·v
    inside the chunk, state read and update) and GQA attention; a router and top-k gated experts
    ``intermediate_size`` wide in every layer; the LM head."""
    d = cfg.hidden_size
    dense, attn, lin = 2.0 * d * cfg.vocab_size, 0.0, 0.0
    h = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or d // h
    for t in cfg.layer_types:
        if t == "linear_attention":
            dense += 2.0 * (d * 3 * h * hd + d * h * hd + h * hd * d)
            lin = lin + _gla_chunk_flops(h, hd, hd)
        elif t == "full_attention":
            dense_i, attn_i = _hf_attention_layer(cfg, output_gate=False)
            dense, attn = dense + dense_i, attn + attn_i
        else:
            raise ValueError(f"model_shape: unknown {cfg.model_type} layer type {t!r}")
        experts = 3 * d * cfg.intermediate_size * cfg.num_experts_per_tok
        dense += 2.0 * (d * cfg.num_local_experts + experts)
    return _shape(dense, attn, lin)


def _mamba1_mixer(cfg: Any) -> tuple[float, np.ndarray]:
    """(row-wise FLOPs per token, selective-scan FLOPs per processed token as
    :func:`_chunk_terms`) of one HF Mamba-1 mixer (Jamba's ``mamba_*`` fields; Mamba /
    Falcon-Mamba's ``expand``, ``state_size`` …):
    ``in_proj`` (x, gate), the depthwise conv of x, ``x_proj`` (dt, B, C), ``dt_proj``,
    ``out_proj``; the scan as chunkwise linear attention with one value head per channel and the
    state entries as keys (per channel q·k and p·x inside the chunk, state read and update)."""
    d = cfg.hidden_size
    if cfg.model_type == "jamba":
        inner, n, rank = cfg.mamba_expand * d, cfg.mamba_d_state, cfg.mamba_dt_rank
        width = cfg.mamba_d_conv
    else:
        inner, n, rank = int(cfg.expand * d), cfg.state_size, int(cfg.time_step_rank)
        width = cfg.conv_kernel
    proj = d * 2 * inner + inner * (rank + 2 * n) + rank * inner + inner * d
    return 2.0 * proj + 2.0 * width * inner, _gla_chunk_flops(inner, n, 1)


def ssm_shape(cfg: Any) -> ModelShape:
    """Coefficients of a transformers state-space model (``mamba``, ``falcon_mamba``: Mamba-1
    mixers, :func:`_mamba1_mixer`; ``mamba2``: Mamba-2 mixers, :func:`_mamba2_mixer`) in every
    layer; the LM head."""
    mixer = _mamba2_mixer if cfg.model_type == "mamba2" else _mamba1_mixer
    dense, lin = mixer(cfg)
    n = cfg.num_hidden_layers
    return _shape(2.0 * cfg.hidden_size * cfg.vocab_size + n * dense, 0.0, n * lin)


def mamba1_hybrid_shape(cfg: Any) -> ModelShape:
    """Coefficients of a transformers Mamba-1 hybrid (``jamba``) from
    ``config.layers_block_type``: Mamba-1 mixers (``in_proj`` to x and gate, the depthwise conv
    of x, ``x_proj`` to dt / B / C, ``dt_proj``, ``out_proj``; the selective scan as chunkwise
    linear attention, one value head per channel with the state entries as keys: per channel
    q·k and p·x inside the chunk, state read and update) and GQA attention; in the layers of
    ``config.layers_num_experts`` > 1 a router and top-k gated experts ``intermediate_size``
    wide, elsewhere a gated MLP; the LM head."""
    d = cfg.hidden_size
    dense, attn, lin = 2.0 * d * cfg.vocab_size, 0.0, 0.0
    for t, experts in zip(cfg.layers_block_type, cfg.layers_num_experts):
        if t == "mamba":
            dense_i, lin_i = _mamba1_mixer(cfg)
            dense, lin = dense + dense_i, lin + lin_i
        elif t == "attention":
            dense_i, attn_i = _hf_attention_layer(cfg, output_gate=False)
            dense, attn = dense + dense_i, attn + attn_i
        else:
            raise ValueError(f"model_shape: unknown {cfg.model_type} layer type {t!r}")
        if experts > 1:
            routed = 3 * d * cfg.intermediate_size * cfg.num_experts_per_tok
            dense += 2.0 * (d * experts + routed)
        else:
            dense += 2.0 * 3 * d * cfg.intermediate_size
    return _shape(dense, attn, lin)


def recurrent_gemma_shape(cfg: Any) -> ModelShape:
    """Coefficients of a transformers RecurrentGemma (``recurrent_gemma``) from
    ``config.layers_block_type``: recurrent blocks (``linear_y``, ``linear_x``, the depthwise
    ``conv1d_width``-token conv, the RG-LRU's block-diagonal input and recurrence gates,
    ``linear_out``; the scan as chunkwise linear attention with one one-entry head per channel)
    and local MQA / GQA attention (its window enters through :func:`ideal_flop_ratio`'s
    ``windows``, as for other sliding-window layers); per layer a gated MLP
    ``intermediate_size // 2`` wide; the LM head."""
    d, w = cfg.hidden_size, cfg.lru_width
    dense, attn, lin = 2.0 * d * cfg.vocab_size, 0.0, 0.0
    block = w // cfg.num_attention_heads
    for t in cfg.layers_block_type:
        if t == "recurrent":
            dense += 2.0 * (3 * d * w + 2 * w * block) + 2.0 * cfg.conv1d_width * w
            lin = lin + _gla_chunk_flops(w, 1, 1)
        elif t == "attention":
            dense_i, attn_i = _hf_attention_layer(cfg, output_gate=False)
            dense, attn = dense + dense_i, attn + attn_i
        else:
            raise ValueError(f"model_shape: unknown {cfg.model_type} layer type {t!r}")
        dense += 2.0 * 3 * d * (cfg.intermediate_size // 2)
    return _shape(dense, attn, lin)


_GATED_HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_FULL_ATTENTION_TYPES = FULL_ATTENTION_MODEL_TYPES


def model_shape(cfg: Any) -> ModelShape:
    """:func:`_model_shape` of ``cfg`` with its LM head's part of ``dense_per_token``
    (``head_per_token``: 2 · hidden_size · vocab_size of the text config)."""
    shape = _model_shape(cfg)
    if shape.head_per_token:
        return shape
    text = getattr(cfg, "text_config", None) or cfg
    d, v = getattr(text, "hidden_size", None), getattr(text, "vocab_size", None)
    if not (isinstance(d, int) and isinstance(v, int)):
        return shape
    return dataclasses.replace(shape, head_per_token=2.0 * d * v)


def _model_shape(cfg: Any) -> ModelShape:
    """Coefficients of any model that runs in tree mode, from its config: a native
    :class:`~harts_verl.models.HybridConfig` or ``HartsHybridConfig`` (``harts_hybrid``), the
    HF hybrids ``qwen3_next`` / ``qwen3_5_text`` / ``qwen3_5_moe_text`` (and the multi-modal
    ``qwen3_5`` / ``qwen3_5_moe`` wrappers and Gemma 3's ``gemma3``, through their
    ``text_config``: the vision tower is not counted) and ``olmo_hybrid``, and the
    full-attention ``qwen2`` / ``qwen3`` / ``llama`` / ``mistral`` / ``qwen2_moe`` /
    ``qwen3_moe`` / ``mixtral`` / ``deepseek_v3`` / ``glm4_moe`` / ``olmo2`` / ``olmo3`` /
    ``phi3`` / ``seed_oss`` / ``glm4`` / ``gemma3_text`` / ``gpt_oss`` / ``gemma2`` /
    ``granite`` / ``granitemoe`` / ``granitemoeshared`` / ``cohere`` / ``cohere2`` /
    ``smollm3`` / ``ministral`` / ``exaone4`` / ``ernie4_5`` / ``hunyuan_v1_dense`` /
    ``apertus`` / ``arcee``, the Mamba-2 hybrids ``granitemoehybrid`` / ``bamba`` /
    ``nemotron_h`` / ``falcon_h1``, the Mamba-1 hybrid ``jamba``, the Griffin hybrid
    ``recurrent_gemma``, the state-space models
    ``mamba`` / ``falcon_mamba`` / ``mamba2``, the short-conv hybrids
    ``lfm2`` / ``lfm2_moe`` and the lightning-attention hybrid ``minimax``. Raises ``ValueError`` for any other
    ``model_type``."""
    from harts_verl.models.config import HybridConfig

    if isinstance(cfg, HybridConfig):
        return native_model_shape(cfg)
    model_type = getattr(cfg, "model_type", None)
    if model_type == "harts_hybrid":
        return native_model_shape(cfg.to_hybrid_config())
    if model_type in ("qwen3_5", "qwen3_5_moe", "gemma3"):
        return model_shape(cfg.text_config)
    if model_type in _GATED_HYBRID_TYPES:
        return gated_hybrid_shape(cfg)
    if model_type == "olmo_hybrid":
        return olmo_hybrid_shape(cfg)
    if model_type in MAMBA2_HYBRID_MODEL_TYPES:
        return mamba2_hybrid_shape(cfg)
    if model_type in CONV_HYBRID_MODEL_TYPES:
        return conv_hybrid_shape(cfg)
    if model_type in LIGHTNING_HYBRID_MODEL_TYPES:
        return lightning_hybrid_shape(cfg)
    if model_type in MAMBA1_HYBRID_MODEL_TYPES:
        return mamba1_hybrid_shape(cfg)
    if model_type in SSM_MODEL_TYPES:
        return ssm_shape(cfg)
    if model_type in RECURRENT_GEMMA_MODEL_TYPES:
        return recurrent_gemma_shape(cfg)
    if model_type == "longcat_flash":
        return longcat_flash_shape(cfg)
    if model_type in _FULL_ATTENTION_TYPES:
        return full_attention_shape(cfg)
    raise ValueError(
        f"model_shape: no FLOP model for model_type {model_type!r} (known: harts_hybrid, "
        f"{', '.join(_GATED_HYBRID_TYPES + _FULL_ATTENTION_TYPES + MAMBA2_HYBRID_MODEL_TYPES)}, "
        f"{', '.join(CONV_HYBRID_MODEL_TYPES + LIGHTNING_HYBRID_MODEL_TYPES)}, "
        f"{', '.join(MAMBA1_HYBRID_MODEL_TYPES + SSM_MODEL_TYPES + RECURRENT_GEMMA_MODEL_TYPES)}, "
        "qwen3_5, qwen3_5_moe, "
        "olmo_hybrid)"
    )


def forward_flops(
    shape: ModelShape,
    tokens: float,
    attention_pairs: float,
    linear_tokens: float,
    chunk_size: int = 64,
    head_tokens: float | None = None,
) -> float:
    """Forward FLOPs of ``tokens`` row-wise tokens, ``attention_pairs`` (query, key) pairs
    and ``linear_tokens`` tokens through the chunkwise linear attention at ``chunk_size``;
    ``head_tokens``: the rows the LM head runs on (default: ``tokens``)."""
    head = 0.0 if head_tokens is None else shape.head_per_token * (head_tokens - tokens)
    return (
        shape.dense_per_token * tokens
        + head
        + shape.attention_per_pair * attention_pairs
        + shape.linear_cost(chunk_size) * linear_tokens
    )


def causal_pairs(lengths: np.ndarray, window: int | None = None) -> float:
    """(query, key) pairs of causal attention over sequences of ``lengths`` tokens: a query at
    position p sees ``min(p + 1, window)`` keys (``window`` None: all p + 1)."""
    n = np.asarray(lengths, dtype=np.float64)
    if window is None:
        return float((n * (n + 1) / 2).sum())
    w = float(min(_checked_window(window), 2**53))  # longer than any sequence: exact as float
    head = np.minimum(n, w)  # the first min(L, w) queries see p + 1 keys, the rest w each
    return float((head * (head + 1) / 2 + (n - head) * w).sum())


def tree_pairs(depth: np.ndarray, window: int | None = None) -> float:
    """(query, key) pairs of tree attention over rows at ``depth``: a row sees its ancestors
    and itself, ``min(depth + 1, window)`` of them with a ``window``."""
    d = np.asarray(depth, dtype=np.float64) + 1
    if window is None:
        return float(d.sum())
    return float(np.minimum(d, float(min(_checked_window(window), 2**53))).sum())


def _checked_window(window: Any) -> int:
    if isinstance(window, bool) or not isinstance(window, int | np.integer) or window < 1:
        raise ValueError(f"windows: expected positive ints or None, got {window!r}")
    return int(window)


def ideal_flop_ratio(
    shape: ModelShape,
    forest: RolloutForest,
    replay_tokens: int,
    chunk_size: int = 64,
    windows: Sequence[int | None] | None = None,
) -> dict[str, float]:
    """Expanded and tree forward FLOPs of ``forest`` and their ratio (``ideal_flop_ratio``),
    the linear attention of both at the run's ``chunk_size`` (``TreeRunner``'s default 64);
    the LM head on the rows with a next token, as the log-prob code runs it (S − N expanded,
    the rows with a child in the tree). ``windows``: the sliding window of each softmax-attention
    layer (None for a full-attention layer; e.g. from :func:`~harts_verl.ops.layout.layer_windows`),
    each layer taking an equal share of ``shape.attention_per_pair`` (the windowed families'
    attention layers are alike); None or empty: every pair of a causal mask counts."""
    lengths = forest.lengths.astype(np.float64)
    s = float(lengths.sum())
    c = float(forest.num_compact_tokens)
    # any sequence of windows (a numpy array too); None or empty: full causal attention
    per_layer = (list(windows) if windows is not None else []) or [None]
    pairs_exp = sum(causal_pairs(lengths, w) for w in per_layer) / len(per_layer)
    pairs_tree = sum(tree_pairs(forest.depth, w) for w in per_layer) / len(per_layer)
    head_exp = s - float(forest.num_trajectories)
    head_tree = float(np.count_nonzero(np.asarray(forest.num_children) > 0))
    f_exp = forward_flops(shape, s, pairs_exp, s, chunk_size, head_exp)
    f_tree = forward_flops(shape, c, pairs_tree, c + replay_tokens, chunk_size, head_tree)
    return {
        "expanded_flops": f_exp,
        "tree_flops": f_tree,
        "ideal_flop_ratio": f_exp / f_tree if f_tree else 1.0,
        "attention_pair_ratio": pairs_exp / pairs_tree if pairs_tree else 1.0,
    }
