"""Ling 3 (``model_type = "bailing_hybrid"``, inclusionAI) as the native hybrid model.

Ling 3 interleaves KDA with full-rank decay and output gates and the safe (bounded) decay
(``kda_low_rank_gates=False``, ``kda_lower_bound``) with MLA using interleaved RoPE and a sigmoid
gate per head (``mla_output_gate=True``), and a DeepSeek-style MoE (sigmoid grouped routing,
correction bias, ungated shared experts). This module maps its ``config.json`` to a
:class:`HybridConfig` and back and names its tensors (:data:`FORMAT`); conversion, loading and
export are :mod:`harts_verl.models.checkpoints`'.

Tensor names read: Ling's (``model.word_embeddings``, ``attention.*`` with ``attention.dense``
as the MLA output projection and ``attention.o_proj`` as the KDA one,
``mlp.experts.{j}.gate_proj/up_proj/down_proj``, ``mlp.gate.expert_bias``, ``q_conv1d`` /
``k_conv1d`` / ``v_conv1d``), which transformers >= 5.23 also writes (except that it saves the
KDA output projection as ``attention.dense`` too, also read), and transformers' in-memory names
(``self_attn.*``, ``forget_gate.*``, one fused ``conv1d``, fused experts,
``e_score_correction_bias``); written: Ling's. The interleaved rope
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
    check_hybrid_architecture,
    common_hybrid_kwargs,
    common_source_config,
    config_flag,
    config_mapping,
    config_number,
    config_value,
    mixers_of_layer_types,
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


def _num(kind: type, d: Mapping[str, Any], *names: str, default: Any = ...) -> Any:
    return config_number(_get(d, *names, default=default), names[0], "bailing_hybrid config", kind)


def _rope_theta(d: Mapping[str, Any]) -> float:
    """The MLA rope base of the rope transformers applies: a non-empty ``rope_scaling`` in
    place of ``rope_parameters`` (transformers 5 lets it take precedence), its ``rope_theta``
    else the top-level one. ``ValueError`` naming that key for rope scaling (only the default
    rope is expressed)."""
    what = "bailing_hybrid config"
    params = config_mapping(d, "rope_parameters", what)
    key = "rope_parameters"
    if config_mapping(d, "rope_scaling", what):
        params, key = config_mapping(d, "rope_scaling", what), "rope_scaling"
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(
            f"bailing_hybrid config: {key}: rope type {kind!r} is not supported (default rope only)"
        )
    theta = params.get("rope_theta", _get(d, "rope_theta", default=6_000_000.0))
    return config_number(theta, "rope_theta", what, float)


# transformers' BailingHybridConfig defaults of the keys common_hybrid_kwargs reads.
_TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "moe_intermediate_size": 768,
    "first_k_dense": 2,
    "routed_scaling_factor": 2.5,
    "num_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
}


def hybrid_config_from_ling(d: Mapping[str, Any], *, chunk_size: int = 64) -> HybridConfig:
    """The :class:`HybridConfig` of a Ling 3 ``config.json`` dict. Raises ``ValueError`` naming
    the key for what the native model does not express (rope scaling, activations other than
    silu, attention biases)."""
    if d.get("model_type") != LING_MODEL_TYPE:
        raise ValueError(f"model_type: expected {LING_MODEL_TYPE!r}, got {d.get('model_type')!r}")
    what = "bailing_hybrid config"
    kw = common_hybrid_kwargs(d, what, **_TRANSFORMERS_DEFAULTS)
    n = _num(int, d, "num_hidden_layers")
    if d.get("layer_types") is not None:
        layer_types = mixers_of_layer_types(d["layer_types"], n, what)
    else:
        group = _get(d, "layer_group_size", default=6)
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"{what}: layer_group_size: expected an int >= 1, got {group!r}")
        if n % group:
            # inclusionAI's modeling_bailing_moe_v3.py (and vLLM / SGLang) make the layers after
            # the last whole group full attention; transformers' BailingHybridConfig does not
            raise ValueError(
                f"{what}: num_hidden_layers ({n}) is not a multiple of layer_group_size "
                f"({group}) and layer_types is missing: Ling's own code makes the last "
                f"{n % group} layer(s) full attention, transformers linear; set layer_types"
            )
        layer_types = ["mla" if (i + 1) % group == 0 else "kda" for i in range(n)]
    heads = _num(int, d, "linear_num_heads", "num_attention_heads")
    # transformers' saved config holds the rope dim in head_dim and the KDA head in linear_head_dim
    head_dim = _num(int, d, "linear_head_dim", "head_dim", default=128)
    safe = config_flag(_get(d, "kda_safe_gate", default=True), "kda_safe_gate", what)
    kw.update(
        layer_types=layer_types,
        rope_theta=_rope_theta(d),
        linear_num_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        conv_size=_num(int, d, "linear_conv_kernel_dim", "short_conv_kernel_size", default=4),
        chunk_size=chunk_size,
        kda_lower_bound=_num(float, d, "kda_lower_bound", default=-5.0) if safe else None,
        kda_low_rank_gates=False,
        mla_output_gate=True,
        mla_norm_eps=_LATENT_NORM_EPS,
    )
    return HybridConfig(**kw)


def check_ling_architecture(cfg: HybridConfig) -> None:
    """Raise ``ValueError`` naming the first field of ``cfg`` that Ling 3 cannot express."""
    check_hybrid_architecture(
        cfg,
        "Ling 3",
        [
            ("kda_low_rank_gates", cfg.kda_low_rank_gates, False),
            ("mla_use_nope", cfg.mla_use_nope, False),
            ("mla_output_gate", cfg.mla_output_gate, True),
            ("mla_norm_eps", cfg.mla_norm_eps, _LATENT_NORM_EPS),
        ],
    )


def ling_config_from_hybrid(
    cfg: HybridConfig, base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A Ling 3 ``config.json`` dict for ``cfg`` (explicit ``layer_types`` / ``mlp_layer_types``
    as transformers reads them), starting from ``base`` (the source config of a converted
    model). Raises ``ValueError`` naming the field when ``cfg`` is not a Ling 3 architecture."""
    check_ling_architecture(cfg)
    out = common_source_config(cfg, base, LING_MODEL_TYPE, "BailingHybridForCausalLM")
    out.update(
        rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        linear_num_heads=cfg.linear_num_heads,
        linear_head_dim=cfg.linear_key_head_dim,
        linear_conv_kernel_dim=cfg.conv_size,
        short_conv_kernel_size=cfg.conv_size,
        kda_safe_gate=cfg.kda_lower_bound is not None,
        # unused without the safe gate: the source's value, else transformers' default
        kda_lower_bound=cfg.kda_lower_bound
        if cfg.kda_lower_bound is not None
        else (base or {}).get("kda_lower_bound", -5.0),
    )
    if not any(k in out for k in ("num_nextn_predict_layers", "num_mtp_layers")):
        # transformers defaults to one multi-token-prediction layer; none is written
        out["num_nextn_predict_layers"] = 0
    return out


FORMAT = SourceFormat(
    model_type=LING_MODEL_TYPE,
    display="Ling 3",
    hybrid_config=hybrid_config_from_ling,
    source_config=ling_config_from_hybrid,
    check_architecture=check_ling_architecture,
    names=SourceNames(
        attn=("attention.", "self_attn."),
        o_proj=("dense", "o_proj"),  # MLA: Ling's ``dense``
        kda_o_proj=("o_proj", "dense"),  # KDA: Ling's ``o_proj`` (transformers saves ``dense``)
        embed=("model.word_embeddings.weight", "model.embed_tokens.weight"),
        dense=("mlp.",),
        moe=("mlp.",),
        experts=("gate_proj", "up_proj", "down_proj"),
        correction_bias=("gate.expert_bias", "gate.e_score_correction_bias"),
        a_log_shape=(-1,),
        rope_interleaved=True,
    ),
    mtp_default=1,  # transformers' num_mtp_layers
)
