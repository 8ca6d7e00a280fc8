"""Ling 3 (``model_type = "bailing_hybrid"``, inclusionAI) as the native hybrid model.

Ling 3 interleaves KDA with full-rank decay and output gates and the safe (bounded) decay
(``kda_low_rank_gates=False``, ``kda_lower_bound``) with MLA using interleaved RoPE and a sigmoid
gate per head (``mla_output_gate=True``), and a DeepSeek-style MoE (sigmoid grouped routing,
correction bias, ungated shared experts). This module maps its ``config.json`` to a
:class:`HybridConfig` and back and names its tensors (:data:`FORMAT`); conversion, loading and
export are :mod:`harts_verl.models.checkpoints`'.

Tensor names read: Ling's (``model.word_embeddings``, ``attention.*`` with ``attention.dense``
as the output projection, ``mlp.experts.{j}.gate_proj/up_proj/down_proj``,
``mlp.gate.expert_bias``, ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``), which transformers >= 5.23
also writes, and transformers' in-memory names (``self_attn.*``, ``forget_gate.*``, one fused
``conv1d``, fused experts, ``e_score_correction_bias``); written: Ling's. The interleaved rope
channels of the MLA projections are reordered into our rotate-half layout (and back on export),
which gives the same rotated queries and keys. As in transformers, the latent q / kv RMSNorms
use eps 1e-6.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harts_verl.models.checkpoints import (
    SourceFormat,
    SourceNames,
    config_value,
    mixers_of_layer_types,
    moe_layers_of,
)
from harts_verl.models.config import HybridConfig

__all__ = [
    "FORMAT",
    "LING_MODEL_TYPE",
    "check_ling_architecture",
    "hybrid_config_from_ling",
    "ling_config_from_hybrid",
]

LING_MODEL_TYPE = "bailing_hybrid"
_LATENT_NORM_EPS = 1e-6  # transformers' DeepSeek-style MLA latent norms


def _get(d: Mapping[str, Any], *names: str, default: Any = ...) -> Any:
    return config_value(d, *names, default=default, what="bailing_hybrid config")


def _rope_theta(d: Mapping[str, Any]) -> float:
    """The MLA rope base; ``ValueError`` for rope scaling (only the default rope is expressed)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(
            f"bailing_hybrid config: rope type {kind!r} is not supported (default rope only)"
        )
    return float(params.get("rope_theta", _get(d, "rope_theta", default=6_000_000.0)))


def hybrid_config_from_ling(d: Mapping[str, Any], *, chunk_size: int = 64) -> HybridConfig:
    """The :class:`HybridConfig` of a Ling 3 ``config.json`` dict. Raises ``ValueError`` naming
    the key for what the native model does not express (rope scaling, activations other than
    silu, attention biases)."""
    if d.get("model_type") != LING_MODEL_TYPE:
        raise ValueError(f"model_type: expected {LING_MODEL_TYPE!r}, got {d.get('model_type')!r}")
    n = int(_get(d, "num_hidden_layers"))
    if _get(d, "hidden_act", default="silu") != "silu":
        raise ValueError(f"bailing_hybrid config: hidden_act {d['hidden_act']!r}, expected 'silu'")
    if _get(d, "attention_bias", default=False):
        raise ValueError("bailing_hybrid config: attention_bias=true is not supported")
    if d.get("layer_types") is not None:
        layer_types = mixers_of_layer_types(d["layer_types"], n, "bailing_hybrid config")
    else:
        group = int(_get(d, "layer_group_size", default=6))
        layer_types = ["mla" if (i + 1) % group == 0 else "kda" for i in range(n)]
    heads = int(_get(d, "num_attention_heads"))
    lin_heads = int(_get(d, "linear_num_heads", default=heads))
    # transformers' saved config holds the rope dim in head_dim and the KDA head in linear_head_dim
    lin_dim = int(_get(d, "linear_head_dim", "head_dim", default=128))
    experts = int(_get(d, "num_experts", "num_local_experts", default=0))
    moe_f = int(_get(d, "moe_intermediate_size", default=768))
    safe = bool(_get(d, "kda_safe_gate", default=True))
    kw: dict[str, Any] = dict(
        vocab_size=_get(d, "vocab_size"),
        hidden_size=_get(d, "hidden_size"),
        intermediate_size=_get(d, "intermediate_size"),
        layer_types=layer_types,
        moe_layers=moe_layers_of(d, n, "bailing_hybrid config", first_k_dense=2),
        rms_norm_eps=float(_get(d, "rms_norm_eps", default=1e-6)),
        rope_theta=_rope_theta(d),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", default=False)),
        initializer_range=float(_get(d, "initializer_range", default=0.02)),
        linear_num_heads=lin_heads,
        linear_num_value_heads=lin_heads,
        linear_key_head_dim=lin_dim,
        linear_value_head_dim=lin_dim,
        conv_size=int(_get(d, "linear_conv_kernel_dim", "short_conv_kernel_size", default=4)),
        chunk_size=chunk_size,
        kda_lower_bound=float(_get(d, "kda_lower_bound", default=-5.0)) if safe else None,
        kda_gate_bias=False,
        kda_low_rank_gates=False,
        num_attention_heads=heads,
        q_lora_rank=_get(d, "q_lora_rank", default=None) or None,
        kv_lora_rank=_get(d, "kv_lora_rank", default=512),
        qk_nope_head_dim=_get(d, "qk_nope_head_dim", default=128),
        qk_rope_head_dim=_get(d, "qk_rope_head_dim", default=64),
        v_head_dim=_get(d, "v_head_dim", default=128),
        mla_output_gate=True,
        mla_norm_eps=_LATENT_NORM_EPS,
        num_experts=experts,
        router="sigmoid_grouped",
        router_aux_loss_coef=0.0,
        shared_expert_gate=False,
    )
    if experts:
        n_shared = int(_get(d, "num_shared_experts", "n_shared_experts", default=0))
        kw.update(
            num_experts_per_tok=_get(d, "num_experts_per_token", "num_experts_per_tok"),
            moe_intermediate_size=moe_f,
            shared_expert_intermediate_size=n_shared * moe_f,
            n_group=int(_get(d, "num_expert_group", "n_group", default=1)),
            topk_group=int(_get(d, "topk_group", default=1)),
            routed_scaling_factor=float(_get(d, "routed_scaling_factor", default=1.0)),
            norm_topk_prob=bool(_get(d, "moe_renormalize", "norm_topk_prob", default=True)),
        )
    return HybridConfig(**kw)


def check_ling_architecture(cfg: HybridConfig) -> None:
    """Raise ``ValueError`` naming the first field of ``cfg`` that Ling 3 cannot express."""
    bad = [(i, t) for i, t in enumerate(cfg.layer_types) if t not in ("kda", "mla")]
    if bad:
        raise ValueError(f"layer_types: Ling 3 has kda and mla layers only, got {bad}")
    checks = [
        ("kda_gate_bias", cfg.kda_gate_bias, False),
        ("kda_low_rank_gates", cfg.kda_low_rank_gates, False),
        ("linear_num_value_heads", cfg.linear_num_value_heads, cfg.linear_num_heads),
        ("linear_value_head_dim", cfg.linear_value_head_dim, cfg.linear_key_head_dim),
        ("mla_use_nope", cfg.mla_use_nope, False),
        ("mla_output_gate", cfg.mla_output_gate, True),
        ("mla_norm_eps", cfg.mla_norm_eps, _LATENT_NORM_EPS),
    ]
    if bool(cfg.moe_layers) and cfg.num_experts > 0:
        checks += [
            ("router", cfg.router, "sigmoid_grouped"),
            ("shared_expert_gate", cfg.shared_expert_gate, False),
            (
                "shared_expert_intermediate_size % moe_intermediate_size",
                cfg.shared_expert_intermediate_size % cfg.moe_intermediate_size,
                0,
            ),
            ("router_aux_loss_coef", cfg.router_aux_loss_coef, 0.0),
        ]
    for name, got, want in checks:
        if got != want:
            raise ValueError(f"{name}: Ling 3 needs {want!r}, got {got!r}")


def ling_config_from_hybrid(
    cfg: HybridConfig, base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A Ling 3 ``config.json`` dict for ``cfg`` (explicit ``layer_types`` / ``mlp_layer_types``
    as transformers reads them), starting from ``base`` (the source config of a converted
    model). Raises ``ValueError`` naming the field when ``cfg`` is not a Ling 3 architecture."""
    check_ling_architecture(cfg)
    n = cfg.num_hidden_layers
    out = dict(base or {})
    moe = sorted(cfg.moe_layers) if cfg.num_experts else []
    out.update(
        model_type=LING_MODEL_TYPE,
        architectures=out.get("architectures") or ["BailingHybridForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        layer_types=[
            "linear_attention" if t == "kda" else "full_attention" for t in cfg.layer_types
        ],
        mlp_layer_types=["sparse" if i in moe else "dense" for i in range(n)],
        first_k_dense_replace=moe[0] if moe else n,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        linear_num_heads=cfg.linear_num_heads,
        linear_head_dim=cfg.linear_key_head_dim,
        linear_conv_kernel_dim=cfg.conv_size,
        short_conv_kernel_size=cfg.conv_size,
        kda_safe_gate=cfg.kda_lower_bound is not None,
        kda_lower_bound=cfg.kda_lower_bound if cfg.kda_lower_bound is not None else -5.0,
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
    )
    if moe:
        out.update(
            num_experts=cfg.num_experts,
            num_experts_per_token=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            num_shared_experts=cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
            moe_renormalize=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            num_expert_group=cfg.n_group,
            topk_group=cfg.topk_group,
        )
    else:
        out["num_experts"] = None
    return out


FORMAT = SourceFormat(
    model_type=LING_MODEL_TYPE,
    display="Ling 3",
    hybrid_config=hybrid_config_from_ling,
    source_config=ling_config_from_hybrid,
    check_architecture=check_ling_architecture,
    names=SourceNames(
        attn=("attention.", "self_attn."),
        o_proj=("dense", "o_proj"),
        embed=("model.word_embeddings.weight", "model.embed_tokens.weight"),
        dense=("mlp.",),
        moe=("mlp.",),
        experts=("gate_proj", "up_proj", "down_proj"),
        correction_bias=("gate.expert_bias", "gate.e_score_correction_bias"),
        a_log_shape=(-1,),
        rope_interleaved=True,
    ),
)
