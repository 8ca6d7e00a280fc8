"""Kimi-Linear (``model_type = "kimi_linear"``, Moonshot AI) as the native hybrid model.

Kimi-Linear (KDA + NoPE MLA + sigmoid-routed MoE) is the native model's architecture with
``kda_gate_bias=False``, ``mla_use_nope=True`` and ``shared_expert_gate=False``. This module maps
its ``config.json`` (Moonshot's keys, or transformers' ``KimiLinearConfig`` keys) to a
:class:`HybridConfig` and back, and names its tensors (:data:`FORMAT`); conversion, loading and
export are :mod:`harts_verl.models.checkpoints`'.

Tensor names read: Moonshot's (``block_sparse_moe.experts.{j}.w1/w2/w3``, ``q_conv1d`` /
``k_conv1d`` / ``v_conv1d``, ``A_log [1, 1, H, 1]``), which transformers >= 5.23 also writes
(it puts the dense first layer under ``block_sparse_moe``), and transformers' in-memory names
(``forget_gate.*``, one fused ``conv1d``, ``mlp.experts.gate_up_proj`` / ``down_proj``);
written: Moonshot's. Numerics follow Moonshot's model as served by vLLM: the latent-KV RMSNorm
uses ``rms_norm_eps`` (transformers >= 5.23 hard-codes 1e-6 there).
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
    config_mapping,
    config_number,
    config_value,
    mixers_of_layer_types,
)
from harts_verl.models.config import HybridConfig

__all__ = [
    "FORMAT",
    "KIMI_LINEAR_MODEL_TYPE",
    "check_kimi_architecture",
    "hybrid_config_from_kimi_linear",
    "kimi_linear_config_from_hybrid",
]

KIMI_LINEAR_MODEL_TYPE = "kimi_linear"


def _get(d: Mapping[str, Any], *names: str, default: Any = ...) -> Any:
    return config_value(d, *names, default=default, what="kimi_linear config")


def _int(value: Any, field: str) -> int:
    return config_number(value, field, "kimi_linear config")


def _lac(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return config_mapping(d, "linear_attn_config", "kimi_linear config")


def _kimi_layer_types(d: Mapping[str, Any], n: int) -> list[str]:
    """``kda`` / ``mla`` per layer: ``layer_types`` (transformers' names), else
    ``linear_attn_config``'s 1-indexed ``kda_layers`` / ``full_attn_layers``, else
    transformers' default (every 4th layer from index 4 is full attention)."""
    if d.get("layer_types") is not None:
        return mixers_of_layer_types(d["layer_types"], n, "kimi_linear config")
    lac = _lac(d)
    if lac.get("kda_layers") is not None and lac.get("full_attn_layers") is not None:
        types: list[str | None] = [None] * n
        for key, mixer in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            if not isinstance(lac[key], list | tuple):
                raise ValueError(
                    f"kimi_linear config: linear_attn_config.{key}: expected a list of "
                    f"1-indexed layers, got {lac[key]!r}"
                )
            for one_based in lac[key]:
                if (
                    not isinstance(one_based, int)
                    or isinstance(one_based, bool)  # JSON true is no layer number
                    or not 1 <= one_based <= n
                ):
                    raise ValueError(
                        f"kimi_linear config: linear_attn_config.{key} has {one_based!r}, "
                        f"expected 1-indexed layers in [1, {n}]"
                    )
                if types[one_based - 1] is not None:
                    raise ValueError(
                        f"kimi_linear config: layer {one_based} (1-indexed) is listed in both "
                        "kda_layers and full_attn_layers"
                    )
                types[one_based - 1] = mixer
        missing = [i + 1 for i, t in enumerate(types) if t is None]
        if missing:
            raise ValueError(
                f"kimi_linear config: layers {missing} (1-indexed) are in neither "
                "linear_attn_config.kda_layers nor full_attn_layers"
            )
        return [str(t) for t in types]
    return ["mla" if i and i % 4 == 0 else "kda" for i in range(n)]


# transformers' KimiLinearConfig defaults of the keys common_hybrid_kwargs reads.
_TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "moe_intermediate_size": 1024,
    "first_k_dense": 1,
    "routed_scaling_factor": 2.446,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
}
# Keys whose default transformers' KimiLinearConfig and Moonshot's configuration_kimi.py (which
# vLLM and SGLang copy) disagree on: (key and aliases, its _TRANSFORMERS_DEFAULTS name,
# Moonshot's default, MoE-only).
_DISPUTED = (
    (("rms_norm_eps",), "rms_norm_eps", 1e-6, False),
    (("routed_scaling_factor",), "routed_scaling_factor", 1.0, True),
    (("num_shared_experts", "n_shared_experts"), "num_shared_experts", 0, True),
    (("first_k_dense_replace",), "first_k_dense", 0, True),
)


def _check_disputed_defaults(d: Mapping[str, Any], what: str) -> None:
    """ValueError naming the first key a config leaves out whose default transformers and
    Moonshot's code (the rollout servers' reading) disagree on: the trainer would silently
    compute another model than the server (``first_k_dense_replace`` is not needed with
    ``mlp_layer_types``; the MoE keys not without experts)."""
    experts = any(d.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    for keys, default, moonshot, moe_only in _DISPUTED:
        if moe_only and not experts:
            continue
        if keys[0] == "first_k_dense_replace" and d.get("mlp_layer_types") is not None:
            continue
        if all(d.get(k) is None for k in keys):
            raise ValueError(
                f"{what}: {keys[0]} is missing, and its default differs between transformers "
                f"({_TRANSFORMERS_DEFAULTS[default]}) and Moonshot's configuration_kimi.py / vLLM "
                f"({moonshot}); set it"
            )


def hybrid_config_from_kimi_linear(d: Mapping[str, Any], *, chunk_size: int = 64) -> HybridConfig:
    """The :class:`HybridConfig` of a Kimi-Linear ``config.json`` dict (Moonshot's keys or
    transformers' ``KimiLinearConfig`` keys). Raises ``ValueError`` naming the key for a
    configuration the native model does not express (RoPE MLA, softmax routing, activations other
    than silu, attention biases)."""
    if d.get("model_type") != KIMI_LINEAR_MODEL_TYPE:
        raise ValueError(
            f"model_type: expected {KIMI_LINEAR_MODEL_TYPE!r}, got {d.get('model_type')!r}"
        )
    what = "kimi_linear config"
    _check_disputed_defaults(d, what)
    kw = common_hybrid_kwargs(d, what, **_TRANSFORMERS_DEFAULTS)
    if d.get("mla_use_nope") is False and kw["qk_rope_head_dim"]:
        raise ValueError(
            f"{what}: mla_use_nope=false (RoPE MLA) is not supported; released Kimi-Linear "
            "checkpoints and transformers' KimiLinear use NoPE MLA"
        )
    act = _get(d, "moe_router_activation_func", default="sigmoid")
    if act != "sigmoid":
        raise ValueError(f"{what}: moe_router_activation_func {act!r}, expected 'sigmoid'")
    lac = _lac(d)
    heads = _int(lac.get("num_heads", _get(d, "linear_num_heads", default=32)), "num_heads")
    head_dim = _int(lac.get("head_dim", _get(d, "linear_head_dim", default=128)), "head_dim")
    kw.update(
        layer_types=_kimi_layer_types(d, _int(_get(d, "num_hidden_layers"), "num_hidden_layers")),
        linear_num_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        conv_size=_int(
            lac.get("short_conv_kernel_size", _get(d, "linear_conv_kernel_dim", default=4)),
            "short_conv_kernel_size",
        ),
        chunk_size=chunk_size,
        mla_use_nope=True,
    )
    return HybridConfig(**kw)


def kimi_linear_config_from_hybrid(
    cfg: HybridConfig, base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A Kimi-Linear ``config.json`` dict (Moonshot's keys, plus transformers' ``layer_types`` /
    ``mlp_layer_types``) for ``cfg``, starting from ``base`` (the source config of a converted
    model: tokenizer ids, ``auto_map``, ...). Raises ``ValueError`` naming the field when ``cfg``
    is not a Kimi-Linear architecture."""
    check_kimi_architecture(cfg)
    out = common_source_config(cfg, base, KIMI_LINEAR_MODEL_TYPE, "KimiLinearForCausalLM")
    lac = dict(out.get("linear_attn_config") or {})
    lac.update(
        head_dim=cfg.linear_key_head_dim,
        num_heads=cfg.linear_num_heads,
        short_conv_kernel_size=cfg.conv_size,
        kda_layers=[i + 1 for i, t in enumerate(cfg.layer_types) if t == "kda"],
        full_attn_layers=[i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"],
    )
    out.update(linear_attn_config=lac, mla_use_nope=True)
    return out


def check_kimi_architecture(cfg: HybridConfig) -> None:
    """Raise ``ValueError`` naming the first field of ``cfg`` that Kimi-Linear cannot express."""
    check_hybrid_architecture(
        cfg,
        "Kimi-Linear",
        [
            ("kda_lower_bound", cfg.kda_lower_bound, None),
            ("kda_low_rank_gates", cfg.kda_low_rank_gates, True),
            ("mla_use_nope", cfg.mla_use_nope or cfg.qk_rope_head_dim == 0, True),
            ("mla_output_gate", cfg.mla_output_gate, False),
            ("mla_norm_eps", cfg.mla_norm_eps in (None, cfg.rms_norm_eps), True),
        ],
    )


FORMAT = SourceFormat(
    model_type=KIMI_LINEAR_MODEL_TYPE,
    display="Kimi-Linear",
    hybrid_config=hybrid_config_from_kimi_linear,
    source_config=kimi_linear_config_from_hybrid,
    check_architecture=check_kimi_architecture,
    names=SourceNames(
        attn=("self_attn.",),
        o_proj=("o_proj",),
        embed=("model.embed_tokens.weight",),
        dense=("mlp.", "block_sparse_moe."),
        moe=("block_sparse_moe.", "mlp."),
        experts=("w1", "w3", "w2"),
        correction_bias=("gate.e_score_correction_bias",),
        a_log_shape=(1, 1, -1, 1),
    ),
)
