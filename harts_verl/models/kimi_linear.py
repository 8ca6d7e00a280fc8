"""Kimi-Linear checkpoints (``model_type = "kimi_linear"``, Moonshot AI) as the native hybrid
model, and back.

Kimi-Linear (KDA + NoPE MLA + sigmoid-routed MoE) is the native model's architecture with
``kda_gate_bias=False``, ``mla_use_nope=True`` and ``shared_expert_gate=False``. transformers
5.10 (veRL 0.9.1's pin) has no ``kimi_linear`` and Moonshot's remote code imports fla, so a
Kimi-Linear checkpoint is trained by converting it to ``harts_hybrid``
(:func:`convert_checkpoint`), training that, and converting the result back for serving (vLLM and
SGLang load the Kimi-Linear format).

Accepted sources: Moonshot's format (``config.json`` with ``linear_attn_config``; per-expert
``block_sparse_moe.experts.{j}.w1/w2/w3``; ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``), which is
also what transformers >= 5.23 writes, and transformers' in-memory names (``forget_gate.*``, one
fused ``conv1d``, ``mlp.experts.gate_up_proj`` / ``down_proj``). The Kimi-Linear format written
back is Moonshot's. Every source tensor must be used (multi-token-prediction layers beyond
``num_hidden_layers`` are dropped and reported); a missing or misshapen tensor raises a
``ValueError`` naming it.

Numerics follow Moonshot's model as served by vLLM: the latent-KV RMSNorm uses ``rms_norm_eps``
(transformers >= 5.23 hard-codes 1e-6 there).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from harts_verl.models.config import HybridConfig

__all__ = [
    "KIMI_LINEAR_MODEL_TYPE",
    "CheckpointTensors",
    "convert_checkpoint",
    "harts_config_from_kimi_linear",
    "hybrid_config_from_kimi_linear",
    "hybrid_state_dict_from_kimi_linear",
    "is_kimi_linear_config",
    "is_kimi_linear_dir",
    "kimi_linear_config_from_hybrid",
    "kimi_linear_source",
    "kimi_linear_state_dict_from_hybrid",
    "kimi_linear_tensors_from_hybrid",
    "load_from_kimi_linear",
    "read_config",
]

logger = logging.getLogger(__name__)

KIMI_LINEAR_MODEL_TYPE = "kimi_linear"
HARTS_MODEL_TYPE = "harts_hybrid"
SOURCE_CONFIG_KEY = "harts_source_config"  # the Kimi-Linear config a harts_hybrid came from
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def is_kimi_linear_config(d: Mapping[str, Any]) -> bool:
    """Whether the ``config.json`` dict ``d`` describes a Kimi-Linear model."""
    return isinstance(d, Mapping) and d.get("model_type") == KIMI_LINEAR_MODEL_TYPE


def _get(d: Mapping[str, Any], *names: str, default: Any = ...) -> Any:
    """The first of ``names`` present in ``d`` (Moonshot's name first, then transformers')."""
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    if default is ...:
        raise ValueError(f"kimi_linear config: missing {' / '.join(names)}")
    return default


def _kimi_layer_types(d: Mapping[str, Any], n: int) -> list[str]:
    """``kda`` / ``mla`` per layer: ``layer_types`` (transformers' names), else
    ``linear_attn_config``'s 1-indexed ``kda_layers`` / ``full_attn_layers``, else
    transformers' default (every 4th layer from index 4 is full attention)."""
    if d.get("layer_types") is not None:
        names = {"linear_attention": "kda", "full_attention": "mla"}
        lt = list(d["layer_types"])
        if len(lt) != n:
            raise ValueError(
                f"kimi_linear config: layer_types has {len(lt)} entries, num_hidden_layers is {n}"
            )
        for i, t in enumerate(lt):
            if t not in names:
                raise ValueError(
                    f"kimi_linear config: layer_types[{i}] = {t!r}, expected one of {list(names)}"
                )
        return [names[t] for t in lt]
    lac = d.get("linear_attn_config") or {}
    if lac.get("kda_layers") is not None and lac.get("full_attn_layers") is not None:
        types: list[str | None] = [None] * n
        for key, mixer in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            for one_based in lac[key]:
                if not isinstance(one_based, int) or not 1 <= one_based <= n:
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


def _kimi_moe_layers(d: Mapping[str, Any], n: int) -> list[int]:
    """MoE layer indices: ``mlp_layer_types`` (``sparse``), else ``first_k_dense_replace``
    (transformers' default 1) and ``moe_layer_freq`` (default 1)."""
    if not _get(d, "num_experts", "num_local_experts", default=0):
        return []
    if d.get("mlp_layer_types") is not None:
        mt = list(d["mlp_layer_types"])
        if len(mt) != n or any(t not in ("dense", "sparse") for t in mt):
            raise ValueError(
                f"kimi_linear config: mlp_layer_types must list 'dense' / 'sparse' for each of "
                f"the {n} layers, got {mt!r}"
            )
        return [i for i, t in enumerate(mt) if t == "sparse"]
    k = int(d.get("first_k_dense_replace", 1))
    freq = int(d.get("moe_layer_freq", 1))
    if freq < 1:
        raise ValueError(f"kimi_linear config: moe_layer_freq must be >= 1, got {freq}")
    return [i for i in range(n) if i >= k and i % freq == 0]


def hybrid_config_from_kimi_linear(d: Mapping[str, Any], *, chunk_size: int = 64) -> HybridConfig:
    """The :class:`HybridConfig` of a Kimi-Linear ``config.json`` dict (Moonshot's keys or
    transformers' ``KimiLinearConfig`` keys). Raises ``ValueError`` naming the key for a
    configuration the native model does not express (RoPE MLA, softmax routing, activations other
    than silu, attention biases)."""
    if not is_kimi_linear_config(d):
        raise ValueError(
            f"model_type: expected {KIMI_LINEAR_MODEL_TYPE!r}, got {d.get('model_type')!r}"
        )
    n = int(_get(d, "num_hidden_layers"))
    if _get(d, "hidden_act", default="silu") != "silu":
        raise ValueError(f"kimi_linear config: hidden_act {d['hidden_act']!r}, expected 'silu'")
    if _get(d, "attention_bias", default=False):
        raise ValueError("kimi_linear config: attention_bias=true is not supported")
    rope = int(_get(d, "qk_rope_head_dim", default=64))
    if d.get("mla_use_nope") is False and rope:
        raise ValueError(
            "kimi_linear config: mla_use_nope=false (RoPE MLA) is not supported; released "
            "Kimi-Linear checkpoints and transformers' KimiLinear use NoPE MLA"
        )
    act = _get(d, "moe_router_activation_func", default="sigmoid")
    if act != "sigmoid":
        raise ValueError(
            f"kimi_linear config: moe_router_activation_func {act!r}, expected 'sigmoid'"
        )
    lac = d.get("linear_attn_config") or {}
    head_dim = int(lac.get("head_dim", _get(d, "linear_head_dim", default=128)))
    heads = int(lac.get("num_heads", _get(d, "linear_num_heads", default=32)))
    conv = int(lac.get("short_conv_kernel_size", _get(d, "linear_conv_kernel_dim", default=4)))
    experts = int(_get(d, "num_experts", "num_local_experts", default=0))
    moe_f = int(_get(d, "moe_intermediate_size", default=1024))
    n_shared = int(_get(d, "num_shared_experts", "n_shared_experts", default=0))
    grouped = bool(_get(d, "use_grouped_topk", default=True))
    kw: dict[str, Any] = dict(
        vocab_size=_get(d, "vocab_size"),
        hidden_size=_get(d, "hidden_size"),
        intermediate_size=_get(d, "intermediate_size"),
        layer_types=_kimi_layer_types(d, n),
        moe_layers=_kimi_moe_layers(d, n),
        rms_norm_eps=float(_get(d, "rms_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", default=False)),
        initializer_range=float(_get(d, "initializer_range", default=0.02)),
        linear_num_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        conv_size=conv,
        chunk_size=chunk_size,
        kda_gate_bias=False,
        num_attention_heads=_get(d, "num_attention_heads"),
        q_lora_rank=_get(d, "q_lora_rank", default=None) or None,
        kv_lora_rank=_get(d, "kv_lora_rank", default=512),
        qk_nope_head_dim=_get(d, "qk_nope_head_dim", default=128),
        qk_rope_head_dim=rope,
        mla_use_nope=True,
        v_head_dim=_get(d, "v_head_dim", default=128),
        num_experts=experts,
        router="sigmoid_grouped",
        router_aux_loss_coef=0.0,  # Kimi-Linear balances experts with the correction bias
        shared_expert_gate=False,
    )
    if experts:
        kw.update(
            num_experts_per_tok=_get(d, "num_experts_per_token", "num_experts_per_tok"),
            moe_intermediate_size=moe_f,
            shared_expert_intermediate_size=n_shared * moe_f,
            n_group=int(_get(d, "num_expert_group", "n_group", default=1)) if grouped else 1,
            topk_group=int(_get(d, "topk_group", default=1)) if grouped else 1,
            routed_scaling_factor=float(_get(d, "routed_scaling_factor", default=1.0)),
            norm_topk_prob=bool(_get(d, "moe_renormalize", "norm_topk_prob", default=True)),
        )
    return HybridConfig(**kw)


def kimi_linear_config_from_hybrid(
    cfg: HybridConfig, base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A Kimi-Linear ``config.json`` dict (Moonshot's keys, plus transformers' ``layer_types`` /
    ``mlp_layer_types``) for ``cfg``, starting from ``base`` (the source config of a converted
    model: tokenizer ids, ``auto_map``, ...). Raises ``ValueError`` naming the field when ``cfg``
    is not a Kimi-Linear architecture."""
    _check_kimi_architecture(cfg)
    n = cfg.num_hidden_layers
    out = dict(base or {})
    out.pop(SOURCE_CONFIG_KEY, None)
    moe = sorted(cfg.moe_layers) if cfg.num_experts else []
    first_dense = moe[0] if moe else n
    lac = dict(out.get("linear_attn_config") or {})
    lac.update(
        head_dim=cfg.linear_key_head_dim,
        num_heads=cfg.linear_num_heads,
        short_conv_kernel_size=cfg.conv_size,
        kda_layers=[i + 1 for i, t in enumerate(cfg.layer_types) if t == "kda"],
        full_attn_layers=[i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"],
    )
    out.update(
        model_type=KIMI_LINEAR_MODEL_TYPE,
        architectures=out.get("architectures") or ["KimiLinearForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        linear_attn_config=lac,
        layer_types=[
            "linear_attention" if t == "kda" else "full_attention" for t in cfg.layer_types
        ],
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        mla_use_nope=True,
        mlp_layer_types=["sparse" if i in moe else "dense" for i in range(n)],
        first_k_dense_replace=first_dense,
        moe_layer_freq=1,
    )
    if moe:
        out.update(
            num_experts=cfg.num_experts,
            num_experts_per_token=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            num_shared_experts=cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
            moe_renormalize=cfg.norm_topk_prob,
            moe_router_activation_func="sigmoid",
            routed_scaling_factor=cfg.routed_scaling_factor,
            use_grouped_topk=True,
            num_expert_group=cfg.n_group,
            topk_group=cfg.topk_group,
        )
    else:
        out["num_experts"] = None
    return out


def _check_kimi_architecture(cfg: HybridConfig) -> None:
    """Raise ``ValueError`` naming the first field of ``cfg`` that Kimi-Linear cannot express."""
    bad = [(i, t) for i, t in enumerate(cfg.layer_types) if t not in ("kda", "mla")]
    if bad:
        raise ValueError(f"layer_types: Kimi-Linear has kda and mla layers only, got {bad}")
    checks = [
        ("kda_gate_bias", cfg.kda_gate_bias, False),
        ("kda_lower_bound", cfg.kda_lower_bound, None),
        ("linear_num_value_heads", cfg.linear_num_value_heads, cfg.linear_num_heads),
        ("linear_value_head_dim", cfg.linear_value_head_dim, cfg.linear_key_head_dim),
        ("mla_use_nope", cfg.mla_use_nope or cfg.qk_rope_head_dim == 0, True),
    ]
    moe = bool(cfg.moe_layers) and cfg.num_experts > 0
    if moe:
        checks += [
            ("router", cfg.router, "sigmoid_grouped"),
            (
                "shared_expert_gate",
                cfg.shared_expert_gate or not cfg.shared_expert_intermediate_size,
                False,
            ),
            (
                "shared_expert_intermediate_size % moe_intermediate_size",
                cfg.shared_expert_intermediate_size % cfg.moe_intermediate_size,
                0,
            ),
            ("router_aux_loss_coef", cfg.router_aux_loss_coef, 0.0),
        ]
    for name, got, want in checks:
        if got != want:
            raise ValueError(f"{name}: Kimi-Linear needs {want!r}, got {got!r}")


# --- tensors ---------------------------------------------------------------------------------


class CheckpointTensors:
    """Lazy, read-once view of a checkpoint's tensors: a directory of safetensors shards (with
    or without ``model.safetensors.index.json``) or an in-memory mapping. Records which names were
    taken, so a conversion can refuse to drop any."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None, path: str | None = None):
        self._mem = dict(tensors) if tensors is not None else None
        self._where: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        self.taken: set[str] = set()
        if self._mem is None:
            if path is None:
                raise TypeError("CheckpointTensors: give tensors or path")
            self._where = _weight_map(path)

    @property
    def names(self) -> set[str]:
        return set(self._mem) if self._mem is not None else set(self._where)

    def has(self, name: str) -> bool:
        return name in (self._mem if self._mem is not None else self._where)

    def take(self, *names: str) -> torch.Tensor:
        """The tensor of the first of ``names`` present; ``ValueError`` naming them all."""
        for name in names:
            if self.has(name):
                self.taken.add(name)
                if self._mem is not None:
                    return self._mem[name]
                return self._handle(self._where[name]).get_tensor(name)
        raise ValueError(f"checkpoint: missing tensor {' / '.join(names)}")

    def _handle(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]


def _weight_map(path: str) -> dict[str, str]:
    """tensor name -> safetensors file of the checkpoint directory ``path``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            wm = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in wm.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(
            f"checkpoint {path!r}: no model.safetensors or model.safetensors.index.json"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


# Per-layer name tables: (ours under layers.{i}., Kimi-Linear under model.layers.{i}.).
_NORMS = (
    ("input_norm.weight", "input_layernorm.weight"),
    ("post_norm.weight", "post_attention_layernorm.weight"),
)
_KDA_PLAIN = (
    *(
        (f"mixer.{n}.weight", f"self_attn.{n}.weight")
        for n in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "o_norm")
    ),
    ("mixer.g_a.weight", "self_attn.g_a_proj.weight"),
    ("mixer.g_b.weight", "self_attn.g_b_proj.weight"),
)
_KDA_GATE = (
    ("mixer.f_a.weight", "f_a_proj.weight"),
    ("mixer.f_b.weight", "f_b_proj.weight"),
    ("mixer.dt_bias", "dt_bias"),
)
_MLA = (
    ("mixer.q_proj.weight", "self_attn.q_proj.weight"),
    ("mixer.q_a.weight", "self_attn.q_a_proj.weight"),
    ("mixer.q_norm.weight", "self_attn.q_a_layernorm.weight"),
    ("mixer.q_b.weight", "self_attn.q_b_proj.weight"),
    ("mixer.kv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("mixer.kv_norm.weight", "self_attn.kv_a_layernorm.weight"),
    ("mixer.kv_b.weight", "self_attn.kv_b_proj.weight"),
    ("mixer.o_proj.weight", "self_attn.o_proj.weight"),
)
_SWIGLU = ("gate_proj", "up_proj", "down_proj")
_MOE_ROOTS = ("block_sparse_moe.", "mlp.")  # Moonshot's, transformers' in-memory
_DENSE_ROOTS = ("mlp.", "block_sparse_moe.")  # transformers >= 5.23 saves dense layers here


def _kimi_layer_to_hybrid(
    src: CheckpointTensors, cfg: HybridConfig, i: int, expected: Mapping[str, torch.Size]
) -> dict[str, torch.Tensor]:
    p, q = f"model.layers.{i}.", f"layers.{i}."
    out = {q + ours: src.take(p + theirs) for ours, theirs in _NORMS}
    if cfg.layer_types[i] == "kda":
        out.update({q + ours: src.take(p + theirs) for ours, theirs in _KDA_PLAIN})
        for ours, theirs in _KDA_GATE:
            out[q + ours] = src.take(
                p + "self_attn." + theirs, p + "self_attn.forget_gate." + theirs
            )
        out[q + "mixer.A_log"] = src.take(
            p + "self_attn.A_log", p + "self_attn.forget_gate.A_log"
        ).reshape(-1)
        if src.has(p + "self_attn.conv1d.weight"):  # transformers' fused q/k/v conv
            fused = src.take(p + "self_attn.conv1d.weight").squeeze(1)
            sizes = [expected[q + f"mixer.{c}_conv.weight"][0] for c in "qkv"]
            for c, w in zip("qkv", torch.split(fused, sizes, dim=0), strict=True):
                out[q + f"mixer.{c}_conv.weight"] = w
        else:
            for c in "qkv":
                out[q + f"mixer.{c}_conv.weight"] = src.take(
                    p + f"self_attn.{c}_conv1d.weight"
                ).squeeze(1)
    else:
        for ours, theirs in _MLA:
            if q + ours in expected:
                out[q + ours] = src.take(p + theirs)
    if q + "ffn.router.weight" not in expected:  # dense SwiGLU
        for n in _SWIGLU:
            out[q + f"ffn.{n}.weight"] = src.take(*(p + r + f"{n}.weight" for r in _DENSE_ROOTS))
        return out
    roots = [p + r for r in _MOE_ROOTS]
    out[q + "ffn.router.weight"] = src.take(*(r + "gate.weight" for r in roots))
    out[q + "ffn.correction_bias"] = src.take(*(r + "gate.e_score_correction_bias" for r in roots))
    e = expected[q + "ffn.w_gate"][0]
    fused = [r + "experts.gate_up_proj" for r in roots if src.has(r + "experts.gate_up_proj")]
    if fused:  # transformers' in-memory layout: [E, 2F, D] and [E, D, F]
        gate_up = src.take(fused[0])
        f = gate_up.shape[1] // 2
        out[q + "ffn.w_gate"] = gate_up[:, :f].transpose(1, 2)
        out[q + "ffn.w_up"] = gate_up[:, f:].transpose(1, 2)
        root = fused[0][: -len("experts.gate_up_proj")]
        out[q + "ffn.w_down"] = src.take(root + "experts.down_proj").transpose(1, 2)
    else:
        for ours, w in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
            out[q + f"ffn.{ours}"] = torch.stack(
                [src.take(*(r + f"experts.{j}.{w}.weight" for r in roots)).T for j in range(e)]
            )
    if q + "ffn.shared.gate_proj.weight" in expected:
        for n in _SWIGLU:
            out[q + f"ffn.shared.{n}.weight"] = src.take(
                *(r + f"shared_experts.{n}.weight" for r in roots)
            )
    return out


def kimi_linear_tensors_from_hybrid(
    name: str, tensor: torch.Tensor, cfg: HybridConfig
) -> list[tuple[str, torch.Tensor]]:
    """The Kimi-Linear (Moonshot) tensors of one native state-dict entry ``name`` (with or
    without ``model.``): a rename, a reshape (``A_log``, convolutions) or, for stacked experts,
    one transposed tensor per expert. Views, no copies. Raises ``ValueError`` for a name the
    native Kimi-Linear architecture does not have. Used per tensor by the veRL engine's weight
    export to the rollout server (vLLM / SGLang load Moonshot's names)."""
    key = name.removeprefix("model.")
    top = {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if key in top:
        return [(top[key], tensor)]
    parts = key.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"kimi_linear export: unexpected tensor {name!r}")
    i, rest = int(parts[1]), parts[2]
    if i >= cfg.num_hidden_layers:
        raise ValueError(f"kimi_linear export: {name!r} is beyond {cfg.num_hidden_layers} layers")
    p = f"model.layers.{i}."
    table = dict(_NORMS)
    table.update(_KDA_PLAIN if cfg.layer_types[i] == "kda" else _MLA)
    if cfg.layer_types[i] == "kda":
        table.update({ours: "self_attn." + theirs for ours, theirs in _KDA_GATE})
    moe = i in cfg.moe_layers and cfg.num_experts > 0
    root = "block_sparse_moe." if moe else "mlp."
    table.update({f"ffn.{n}.weight": f"{root}{n}.weight" for n in _SWIGLU})
    table.update({f"ffn.shared.{n}.weight": f"{root}shared_experts.{n}.weight" for n in _SWIGLU})
    table.update(
        {
            "ffn.router.weight": root + "gate.weight",
            "ffn.correction_bias": root + "gate.e_score_correction_bias",
        }
    )
    if rest in table:
        return [(p + table[rest], tensor)]
    if rest == "mixer.A_log":
        return [(p + "self_attn.A_log", tensor.reshape(1, 1, -1, 1))]
    if rest.endswith("_conv.weight") and rest[len("mixer.")] in "qkv":
        return [(p + f"self_attn.{rest[len('mixer.')]}_conv1d.weight", tensor.unsqueeze(1))]
    experts = {"ffn.w_gate": "w1", "ffn.w_up": "w3", "ffn.w_down": "w2"}
    if rest in experts:
        w = experts[rest]
        return [(f"{p}{root}experts.{j}.{w}.weight", t.T) for j, t in enumerate(tensor.unbind(0))]
    raise ValueError(f"kimi_linear export: unexpected tensor {name!r}")


def expected_hybrid_shapes(cfg: HybridConfig) -> dict[str, torch.Size]:
    """Every state-dict entry of :class:`HybridForCausalLM` for ``cfg`` and its shape (built on
    the meta device: no memory)."""
    from harts_verl.models.hybrid import HybridForCausalLM

    with torch.device("meta"):
        model = HybridForCausalLM(cfg)
    sd = model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return {k: v.shape for k, v in sd.items()}


def _check_shapes(
    got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size], keys: Iterable[str]
) -> None:
    for k in keys:
        if k not in got:
            raise ValueError(f"checkpoint: no tensor for {k!r}")
        if got[k].shape != expected[k]:
            raise ValueError(
                f"checkpoint: {k!r} has shape {tuple(got[k].shape)}, the config needs "
                f"{tuple(expected[k])}"
            )


def _iter_kimi_to_hybrid(
    src: CheckpointTensors, cfg: HybridConfig, progress: Callable[[str], None] | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """The native state dict of ``src`` in pieces (embeddings, each layer, head), shape-checked;
    raises ``ValueError`` for unused source tensors after the last piece."""
    expected = expected_hybrid_shapes(cfg)
    n = cfg.num_hidden_layers
    first = {"embed_tokens.weight": src.take("model.embed_tokens.weight")}
    _check_shapes(first, expected, first)
    yield first
    for i in range(n):
        piece = _kimi_layer_to_hybrid(src, cfg, i, expected)
        _check_shapes(piece, expected, [k for k in expected if k.startswith(f"layers.{i}.")])
        if progress is not None:
            progress(f"layer {i + 1}/{n} ({cfg.layer_types[i]})")
        yield piece
    last = {"norm.weight": src.take("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        last["lm_head.weight"] = src.take("lm_head.weight")
    _check_shapes(last, expected, last)
    yield last
    unused = src.names - src.taken
    mtp = {k for k in unused if _layer_index(k) is not None and _layer_index(k) >= n}
    if mtp:
        logger.warning(
            "kimi_linear: dropped %d tensors of multi-token-prediction layers (index >= %d)",
            len(mtp),
            n,
        )
    rest = sorted(k for k in unused - mtp if "rotary_emb" not in k)
    if rest:
        raise ValueError(
            f"checkpoint: {len(rest)} tensors have no place in the native model, e.g. {rest[:5]}"
        )


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def hybrid_state_dict_from_kimi_linear(
    tensors: Mapping[str, torch.Tensor] | CheckpointTensors, cfg: HybridConfig
) -> dict[str, torch.Tensor]:
    """The :class:`HybridForCausalLM` state dict (keys without ``model.``) of a Kimi-Linear
    state dict (any accepted layout, see the module docstring). Exact: tensors are renamed,
    reshaped, split or stacked, never cast."""
    src = tensors if isinstance(tensors, CheckpointTensors) else CheckpointTensors(tensors)
    out: dict[str, torch.Tensor] = {}
    for piece in _iter_kimi_to_hybrid(src, cfg):
        out.update(piece)
    return out


def kimi_linear_state_dict_from_hybrid(
    sd: Mapping[str, torch.Tensor], cfg: HybridConfig
) -> dict[str, torch.Tensor]:
    """Moonshot's Kimi-Linear state dict of a :class:`HybridForCausalLM` state dict (keys with or
    without ``model.``); the inverse of :func:`hybrid_state_dict_from_kimi_linear`. Raises
    ``ValueError`` when ``cfg`` is not a Kimi-Linear architecture or a tensor is missing."""
    _check_kimi_architecture(cfg)
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    expected = expected_hybrid_shapes(cfg)
    _check_shapes(sd, expected, expected)
    extra = sorted(set(sd) - set(expected) - {"lm_head.weight"})
    if extra:
        raise ValueError(f"state dict: unexpected tensors {extra[:5]}")
    out: dict[str, torch.Tensor] = {}
    for k in expected:
        out.update(kimi_linear_tensors_from_hybrid(k, sd[k], cfg))
    return out


# --- checkpoints -----------------------------------------------------------------------------


def read_config(path: str) -> dict[str, Any]:
    """The ``config.json`` dict of a model directory (or of a config file path)."""
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"model: no config.json at {path!r}")
    with open(file) as f:
        return json.load(f)


@dataclass
class _ShardWriter:
    """Writes tensors to ``model-0000k-of-0000N.safetensors`` shards of at most ``max_bytes``
    (one shard: ``model.safetensors``) plus the index."""

    path: str
    max_bytes: int
    _pending: dict[str, torch.Tensor] = field(default_factory=dict)
    _files: list[list[str]] = field(default_factory=list)
    _size: int = 0
    total: int = 0

    def add(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for k, v in tensors.items():
            nbytes = v.numel() * v.element_size()
            if self._pending and self._size + nbytes > self.max_bytes:
                self._flush()
            self._pending[k] = v.contiguous()
            self._size += nbytes
            self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = os.path.join(self.path, f".shard-{len(self._files):05d}.safetensors")
        save_file(self._pending, tmp, metadata={"format": "pt"})
        self._files.append(sorted(self._pending))
        self._pending, self._size = {}, 0

    def close(self) -> list[str]:
        if self._pending or not self._files:
            self._flush()
        n = len(self._files)
        names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        )
        for k, name in enumerate(names):
            os.replace(
                os.path.join(self.path, f".shard-{k:05d}.safetensors"),
                os.path.join(self.path, name),
            )
        if n > 1:
            wm = {key: names[k] for k, keys in enumerate(self._files) for key in keys}
            with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": wm}, f, indent=2)
        return names


def _copy_side_files(src: str, dst: str) -> None:
    """Tokenizer, generation config and other files of ``src`` (not weights, not config.json)."""
    for name in os.listdir(src):
        full = os.path.join(src, name)
        if (
            not os.path.isfile(full)
            or name == "config.json"
            or name in _WEIGHT_FILES
            or name.endswith((".safetensors", ".bin", ".pt"))
        ):
            continue
        shutil.copy2(full, os.path.join(dst, name))


def convert_checkpoint(
    src: str,
    dst: str,
    *,
    to: str = HARTS_MODEL_TYPE,
    max_shard_bytes: int = 5 * 2**30,
    config_only: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Convert the model directory ``src`` into ``dst`` (created; must not hold a model yet):
    Kimi-Linear to ``harts_hybrid`` (``to="harts_hybrid"``) or back (``to="kimi_linear"``).
    Streams layer by layer (peak memory about one layer plus one shard), copies the tokenizer
    and other side files, and returns a summary (model types, layers, tensors, bytes, files).
    A ``harts_hybrid`` written here keeps the source config under ``harts_source_config``, so the
    way back restores its tokenizer ids and ``auto_map``. ``config_only`` (to ``harts_hybrid``):
    write the config alone, for veRL's ``model.hf_config_path`` beside a Kimi-Linear
    ``model.path`` (the weights are converted while loading)."""
    if to not in (HARTS_MODEL_TYPE, KIMI_LINEAR_MODEL_TYPE):
        raise ValueError(
            f"to: expected {HARTS_MODEL_TYPE!r} or {KIMI_LINEAR_MODEL_TYPE!r}, got {to!r}"
        )
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"dst: must differ from src ({src!r})")
    if os.path.exists(os.path.join(dst, "config.json")):
        raise ValueError(f"dst: {dst!r} already holds a model (config.json)")
    d = read_config(src)
    say = progress or (lambda msg: logger.info("convert: %s", msg))
    if config_only:
        if to != HARTS_MODEL_TYPE:
            raise ValueError("config_only: only with to='harts_hybrid'")
        cfg = hybrid_config_from_kimi_linear(d)
        os.makedirs(dst, exist_ok=True)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(_harts_config_dict(cfg, d), f, indent=2)
        say(f"wrote the harts_hybrid config of {cfg.num_hidden_layers} layers to {dst}")
        return {
            "src": src,
            "dst": dst,
            "from": d.get("model_type"),
            "to": to,
            "layers": cfg.num_hidden_layers,
            "tensors": 0,
            "bytes": 0,
            "files": ["config.json"],
        }
    os.makedirs(dst, exist_ok=True)
    writer = _ShardWriter(dst, max_shard_bytes)
    tensors = 0
    if to == HARTS_MODEL_TYPE:
        cfg = hybrid_config_from_kimi_linear(d)
        src_t = CheckpointTensors(path=src)
        for piece in _iter_kimi_to_hybrid(src_t, cfg, say):
            writer.add({"model." + k: v for k, v in piece.items()})
            tensors += len(piece)
        out_cfg = _harts_config_dict(cfg, d)
    else:
        if d.get("model_type") != HARTS_MODEL_TYPE:
            raise ValueError(
                f"model_type: converting to kimi_linear needs a {HARTS_MODEL_TYPE!r} model, got "
                f"{d.get('model_type')!r}"
            )
        cfg = _hybrid_config_of_harts(d)
        src_t = CheckpointTensors(path=src)
        sd = {k: src_t.take(k) for k in sorted(src_t.names)}
        out_sd = kimi_linear_state_dict_from_hybrid(sd, cfg)
        writer.add(out_sd)
        tensors = len(out_sd)
        say(f"{cfg.num_hidden_layers} layers")
        out_cfg = kimi_linear_config_from_hybrid(cfg, d.get(SOURCE_CONFIG_KEY))
        for k in _TOKEN_KEYS:
            if d.get(k) is not None:
                out_cfg[k] = d[k]
    files = writer.close()
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(out_cfg, f, indent=2)
    _copy_side_files(src, dst)
    summary = {
        "src": src,
        "dst": dst,
        "from": d.get("model_type"),
        "to": to,
        "layers": cfg.num_hidden_layers,
        "tensors": tensors,
        "bytes": writer.total,
        "files": files,
    }
    say(f"wrote {tensors} tensors ({writer.total / 2**20:.1f} MiB) to {dst}")
    return summary


def harts_config_from_kimi_linear(source: Mapping[str, Any]) -> Any:
    """The ``HartsHybridConfig`` of the Kimi-Linear config dict ``source``: its architecture
    (:func:`hybrid_config_from_kimi_linear`), its tokenizer ids, and ``source`` itself under
    ``harts_source_config`` (the veRL engine exports weights in Kimi-Linear's names for such a
    model, and ``convert --to kimi_linear`` restores the config)."""
    from harts_verl.models.hf import HartsHybridConfig

    extra = {k: source[k] for k in _TOKEN_KEYS if source.get(k) is not None}
    return HartsHybridConfig.from_hybrid_config(
        hybrid_config_from_kimi_linear(source), **extra, **{SOURCE_CONFIG_KEY: dict(source)}
    )


def kimi_linear_source(config: Any) -> HybridConfig | None:
    """The native architecture of ``config`` (a ``HartsHybridConfig``) when it was converted from
    Kimi-Linear (its ``harts_source_config`` is a ``kimi_linear`` config), else None."""
    source = getattr(config, SOURCE_CONFIG_KEY, None)
    if getattr(config, "model_type", None) != HARTS_MODEL_TYPE or not is_kimi_linear_config(
        source or {}
    ):
        return None
    return config.to_hybrid_config()


def is_kimi_linear_dir(path: str) -> bool:
    """Whether ``path`` is a model directory whose ``config.json`` is a Kimi-Linear config."""
    file = os.path.join(path, "config.json")
    return os.path.isfile(file) and is_kimi_linear_config(read_config(path))


_ARCH_EXEMPT = {"chunk_size", "initializer_range"}  # runtime / init choices, not weights


def load_from_kimi_linear(cls: Any, path: str, *, config: Any = None, **kwargs: Any) -> Any:
    """``cls.from_pretrained`` (``HartsHybridForCausalLM``) of the Kimi-Linear directory
    ``path``: the weights converted while loading, cast to ``dtype`` / ``torch_dtype`` (default
    float32). ``config``: a ``HartsHybridConfig`` of the same architecture (e.g. from ``convert
    --config-only``; its ``chunk_size`` is honoured), else the converted one. Under an empty-weight
    (meta) context, as veRL uses on FSDP ranks other than 0, the model is built and not loaded.
    Other keyword arguments of ``from_pretrained`` (``trust_remote_code``, ...) are accepted and
    not used."""
    raw = read_config(path)
    arch = hybrid_config_from_kimi_linear(raw)
    if config is None:
        config = harts_config_from_kimi_linear(raw)
    else:
        mine = config.to_hybrid_config().to_dict()
        theirs = arch.to_dict()
        diff = sorted(k for k in mine if k not in _ARCH_EXEMPT and mine[k] != theirs[k])
        if diff:
            detail = ", ".join(f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in diff[:4])
            raise ValueError(
                f"config: does not describe the Kimi-Linear checkpoint {path!r} ({detail})"
            )
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype")) or torch.float32
    if isinstance(dtype, str):
        dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    model = cls(config).to(dtype)
    if any(p.is_meta for p in model.parameters()):
        return model
    sd = hybrid_state_dict_from_kimi_linear(CheckpointTensors(path=path), config.to_hybrid_config())
    model.model.load_state_dict(sd, strict=not arch.tie_word_embeddings)
    return model.eval()


def _harts_config_dict(cfg: HybridConfig, source: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json`` of the ``harts_hybrid`` conversion of the Kimi-Linear config ``source``."""
    out = harts_config_from_kimi_linear(source).to_dict()
    out["architectures"] = ["HartsHybridForCausalLM"]
    return out


def _hybrid_config_of_harts(d: Mapping[str, Any]) -> HybridConfig:
    from harts_verl.models.hf import HartsHybridConfig

    keep = {k: v for k, v in d.items() if k not in ("architectures", "transformers_version")}
    return HartsHybridConfig(**keep).to_hybrid_config()
