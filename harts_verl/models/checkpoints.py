"""Checkpoints of KDA + MLA hybrids from other code bases as the native hybrid model, and back.

The native model (:class:`~harts_verl.models.hybrid.HybridForCausalLM`) expresses Kimi-Linear
(``kimi_linear``, :mod:`harts_verl.models.kimi_linear`) and Ling 3 (``bailing_hybrid``,
:mod:`harts_verl.models.ling`). transformers 5.10 (veRL 0.9.1's pin) has neither, so such a
checkpoint is trained as ``harts_hybrid``: converted once (:func:`convert_checkpoint`), or while
loading (``HartsHybridForCausalLM.from_pretrained`` of the source directory, with
``hf_config_path`` naming a ``convert --config-only`` directory), and exported back in the
source's tensor names for the rollout server (:func:`source_tensors_from_hybrid`) or as a
checkpoint (``convert --to <source model type>``).

Every format is a :class:`SourceFormat`: how its ``config.json`` maps to a
:class:`HybridConfig` and back, and a :class:`SourceNames` table of its tensor names (the first
name of each entry is written, all are read: the source code base's checkpoint names and
transformers' in-memory ones). Conversions are exact (renames, reshapes, splits, stacks and row
permutations, never casts); every source tensor must find its place (multi-token-prediction
layers beyond ``num_hidden_layers`` are dropped and logged); a missing or misshapen tensor is a
``ValueError`` naming it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from harts_verl.models.config import HybridConfig

__all__ = [
    "HARTS_MODEL_TYPE",
    "CheckpointTensors",
    "SourceFormat",
    "SourceNames",
    "check_hybrid_architecture",
    "common_hybrid_kwargs",
    "common_source_config",
    "config_flag",
    "config_list",
    "config_mapping",
    "config_number",
    "config_value",
    "convert_checkpoint",
    "expected_hybrid_shapes",
    "format_of_config",
    "harts_config_from_source",
    "hybrid_state_dict_from_source",
    "load_from_source",
    "mixers_of_layer_types",
    "moe_layers_of",
    "mtp_layers_of",
    "read_config",
    "source_architecture",
    "source_config_of",
    "source_format_of_dir",
    "source_state_dict_from_hybrid",
    "source_tensors_from_hybrid",
]

logger = logging.getLogger(__name__)

HARTS_MODEL_TYPE = "harts_hybrid"
SOURCE_CONFIG_KEY = "harts_source_config"  # the source config a harts_hybrid came from
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_ARCH_EXEMPT = {"chunk_size", "initializer_range"}  # runtime / init choices, not weights


# --- formats ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceNames:
    """Tensor names of a source format under ``model.layers.{i}.``; in every tuple the first
    name is the one written, all are read."""

    attn: tuple[str, ...]  # token-mixer root, e.g. ("self_attn.",)
    o_proj: tuple[str, ...]  # output projection of both mixers, e.g. ("o_proj",)
    embed: tuple[str, ...]  # full names of the embedding
    dense: tuple[str, ...]  # dense FFN roots
    moe: tuple[str, ...]  # MoE FFN roots
    experts: tuple[str, str, str]  # per-expert (gate, up, down) names
    correction_bias: tuple[str, ...]  # under the MoE root
    a_log_shape: tuple[int, ...]  # KDA ``A_log`` as stored (-1 = heads)
    rope_interleaved: bool = False  # MLA rope channels in interleaved pairs (DeepSeek layout)
    kda_o_proj: tuple[str, ...] = ()  # output projection of KDA layers when not ``o_proj``'s


@dataclass(frozen=True)
class SourceFormat:
    """One source code base: its ``model_type``, the architecture of a config dict
    (``hybrid_config``), the config dict of an architecture (``source_config``, from the
    original config when there is one), the check that an architecture is expressible
    (``check_architecture``: ``ValueError`` naming the field) and its tensor names."""

    model_type: str
    display: str
    hybrid_config: Callable[[Mapping[str, Any]], HybridConfig]
    source_config: Callable[[HybridConfig, Mapping[str, Any] | None], dict[str, Any]]
    check_architecture: Callable[[HybridConfig], None]
    names: SourceNames
    # multi-token-prediction layers after the decoder layers when the config does not say
    # (``num_nextn_predict_layers`` / ``num_mtp_layers``): the format's transformers default
    mtp_default: int = 0


def config_value(d: Mapping[str, Any], *names: str, default: Any = ..., what: str) -> Any:
    """The value of the first of ``names`` set in the config dict ``d`` (the source code base's
    name first, then transformers'); ``ValueError`` naming ``what`` and the keys when none is set
    and there is no ``default``."""
    for n in names:
        if d.get(n) is not None:
            return d[n]
    if default is ...:
        raise ValueError(f"{what}: missing {' / '.join(names)}")
    return default


def config_number(value: Any, field: str, what: str, kind: type = int) -> Any:
    """``value`` of the config field ``field`` as ``kind`` (``int``: an int or an integral
    float; ``float``: a finite int or float; never a bool or a string); ``ValueError`` naming
    ``what`` and ``field`` otherwise (no silent truncation of 6.5 to 6)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if kind is int:
            return int(value)
        if abs(value) <= 2**1023:  # a float holds it
            return float(value)
    elif isinstance(value, float) and math.isfinite(value):
        if kind is float:
            return value
        if value.is_integer():
            return int(value)
    name = "an integer" if kind is int else "a finite number"
    raise ValueError(f"{what}: {field}: expected {name}, got {value!r}")


def mtp_layers_of(d: Mapping[str, Any], fmt: SourceFormat) -> int:
    """How many multi-token-prediction layers the source config ``d`` declares after its
    ``num_hidden_layers`` decoder layers (``num_nextn_predict_layers`` / ``num_mtp_layers``,
    else ``fmt.mtp_default``); ``ValueError`` naming the field unless an int >= 0."""
    what = f"{fmt.model_type} config"
    keys = ("num_nextn_predict_layers", "num_mtp_layers")
    value = config_value(d, *keys, default=fmt.mtp_default, what=what)
    field = next((k for k in keys if d.get(k) is not None), keys[0])
    mtp = config_number(value, field, what)
    if mtp < 0:
        raise ValueError(f"{what}: {field}: expected an int >= 0, got {mtp}")
    return mtp


def config_flag(value: Any, field: str, what: str) -> bool:
    """``value`` of the boolean config field ``field`` (a JSON ``true`` / ``false``);
    ``ValueError`` naming ``what`` and ``field`` for anything else (the string ``"false"`` is
    not read as true)."""
    if isinstance(value, bool):
        return value
    raise ValueError(f"{what}: {field}: expected true or false, got {value!r}")


def config_list(value: Any, field: str, what: str) -> list[Any]:
    """``value`` of the list config field ``field``; ``ValueError`` naming ``what`` and
    ``field`` for anything else (a string is not read character by character)."""
    if isinstance(value, list | tuple):
        return list(value)
    raise ValueError(f"{what}: {field}: expected a list, got {type(value).__name__} {value!r}")


def config_mapping(d: Mapping[str, Any], field: str, what: str) -> Mapping[str, Any]:
    """The sub-dict ``d[field]`` ({} when unset); ``ValueError`` naming ``what`` and ``field``
    when it is set to something else than a JSON object."""
    v = d.get(field)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"{what}: {field}: expected an object, got {type(v).__name__}")
    return v


def mixers_of_layer_types(layer_types: Any, n: int, what: str) -> list[str]:
    """Native mixers (``kda`` / ``mla``) of transformers' ``layer_types``
    (``linear_attention`` / ``full_attention``) for ``n`` layers."""
    names = {"linear_attention": "kda", "full_attention": "mla"}
    lt = config_list(layer_types, "layer_types", what)
    if len(lt) != n:
        raise ValueError(f"{what}: layer_types has {len(lt)} entries, num_hidden_layers is {n}")
    for i, t in enumerate(lt):
        if t not in names:
            raise ValueError(f"{what}: layer_types[{i}] = {t!r}, expected one of {list(names)}")
    return [names[t] for t in lt]


def moe_layers_of(d: Mapping[str, Any], n: int, what: str, first_k_dense: int = 1) -> list[int]:
    """MoE layer indices of a DeepSeek-style config: none without experts; ``mlp_layer_types``
    (``sparse``) when given; else the layers ``>= first_k_dense_replace`` (default
    ``first_k_dense``, the model's transformers default) that are multiples of
    ``moe_layer_freq`` (default 1)."""
    if not config_value(
        d, "num_experts", "num_local_experts", "n_routed_experts", default=0, what=what
    ):
        return []
    if d.get("mlp_layer_types") is not None:
        mt = config_list(d["mlp_layer_types"], "mlp_layer_types", what)
        if len(mt) != n or any(t not in ("dense", "sparse") for t in mt):
            raise ValueError(
                f"{what}: mlp_layer_types must list 'dense' / 'sparse' for each of the {n} "
                f"layers, got {mt!r}"
            )
        return [i for i, t in enumerate(mt) if t == "sparse"]
    k = config_number(
        config_value(d, "first_k_dense_replace", default=first_k_dense, what=what),
        "first_k_dense_replace",
        what,
    )
    freq = config_number(
        config_value(d, "moe_layer_freq", default=1, what=what), "moe_layer_freq", what
    )
    if freq < 1:
        raise ValueError(f"{what}: moe_layer_freq must be >= 1, got {freq}")
    return [i for i in range(n) if i >= k and i % freq == 0]


# --- the DeepSeek-style KDA + MLA configs (Kimi-Linear, Ling 3) -------------------------------


def common_hybrid_kwargs(
    d: Mapping[str, Any],
    what: str,
    *,
    rms_norm_eps: float,
    moe_intermediate_size: int,
    first_k_dense: int,
    routed_scaling_factor: float,
    num_shared_experts: int,
    n_group: int,
    topk_group: int,
) -> dict[str, Any]:
    """:class:`HybridConfig` keyword arguments that Kimi-Linear and Ling 3 configs share: sizes,
    norms, MLA dimensions, DeepSeek-style MoE (sigmoid grouped routing with the correction
    bias, ungated shared experts, no aux loss: balancing is the bias's), KDA without an output
    gate bias. The keyword arguments are the format's transformers defaults, used for the keys
    a config leaves out. ``ValueError`` naming ``what`` for an activation other than silu,
    attention biases or a ``quantization_config`` (the native model trains plain weights)."""

    def get(*names: str, default: Any = ...) -> Any:
        return config_value(d, *names, default=default, what=what)

    def num(kind: type, *names: str, default: Any = ...) -> Any:
        return config_number(get(*names, default=default), names[0], what, kind)

    def flag(*names: str, default: bool) -> bool:
        return config_flag(get(*names, default=default), names[0], what)

    if get("hidden_act", default="silu") != "silu":
        raise ValueError(f"{what}: hidden_act {d['hidden_act']!r}, expected 'silu'")
    if flag("attention_bias", default=False):
        raise ValueError(f"{what}: attention_bias=true is not supported")
    quant = d.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
        raise ValueError(
            f"{what}: quantization_config ({method!r}): quantized checkpoints are not supported; "
            "convert a dequantized (bf16 / fp32) checkpoint"
        )
    n = num(int, "num_hidden_layers")
    experts = num(int, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    kw: dict[str, Any] = dict(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        moe_layers=moe_layers_of(d, n, what, first_k_dense),
        rms_norm_eps=num(float, "rms_norm_eps", default=rms_norm_eps),
        tie_word_embeddings=flag("tie_word_embeddings", default=False),
        initializer_range=num(float, "initializer_range", default=0.02),
        kda_gate_bias=False,
        num_attention_heads=get("num_attention_heads"),
        q_lora_rank=get("q_lora_rank", default=None) or None,
        kv_lora_rank=get("kv_lora_rank", default=512),
        qk_nope_head_dim=get("qk_nope_head_dim", default=128),
        qk_rope_head_dim=num(int, "qk_rope_head_dim", default=64),
        v_head_dim=get("v_head_dim", default=128),
        num_experts=experts,
        router="sigmoid_grouped",
        router_aux_loss_coef=0.0,
        shared_expert_gate=False,
    )
    if experts:
        moe_f = num(int, "moe_intermediate_size", default=moe_intermediate_size)
        grouped = flag("use_grouped_topk", default=True)
        kw.update(
            num_experts_per_tok=get("num_experts_per_token", "num_experts_per_tok"),
            moe_intermediate_size=moe_f,
            shared_expert_intermediate_size=num(
                int, "num_shared_experts", "n_shared_experts", default=num_shared_experts
            )
            * moe_f,
            n_group=num(int, "num_expert_group", "n_group", default=n_group) if grouped else 1,
            topk_group=num(int, "topk_group", default=topk_group) if grouped else 1,
            routed_scaling_factor=num(
                float, "routed_scaling_factor", default=routed_scaling_factor
            ),
            norm_topk_prob=flag("moe_renormalize", "norm_topk_prob", default=True),
        )
    return kw


def check_hybrid_architecture(
    cfg: HybridConfig, display: str, checks: list[tuple[str, Any, Any]]
) -> None:
    """Raise ``ValueError`` naming the first field of ``cfg`` that the format ``display`` cannot
    express: layers other than kda / mla, what :func:`common_hybrid_kwargs` fixes, then the
    format's own ``checks`` (name, value, required value)."""
    bad = [(i, t) for i, t in enumerate(cfg.layer_types) if t not in ("kda", "mla")]
    if bad:
        raise ValueError(f"layer_types: {display} has kda and mla layers only, got {bad}")
    common = [
        ("kda_gate_bias", cfg.kda_gate_bias, False),
        ("linear_num_value_heads", cfg.linear_num_value_heads, cfg.linear_num_heads),
        ("linear_value_head_dim", cfg.linear_value_head_dim, cfg.linear_key_head_dim),
    ]
    if bool(cfg.moe_layers) and cfg.num_experts > 0:
        common += [
            ("router", cfg.router, "sigmoid_grouped"),
            ("shared_expert_gate", cfg.shared_expert_gate, False),
            (
                "shared_expert_intermediate_size % moe_intermediate_size",
                cfg.shared_expert_intermediate_size % cfg.moe_intermediate_size,
                0,
            ),
            ("router_aux_loss_coef", cfg.router_aux_loss_coef, 0.0),
        ]
    for name, got, want in common + checks:
        if got != want:
            raise ValueError(f"{name}: {display} needs {want!r}, got {got!r}")


def common_source_config(
    cfg: HybridConfig, base: Mapping[str, Any] | None, model_type: str, architecture: str
) -> dict[str, Any]:
    """The ``config.json`` keys that Kimi-Linear and Ling 3 share, for ``cfg``, over ``base``
    (the original config of a converted model: tokenizer ids, ``auto_map``, ...): sizes, norms,
    transformers' ``layer_types`` / ``mlp_layer_types``, MLA dimensions and the MoE."""
    n = cfg.num_hidden_layers
    out = dict(base or {})
    moe = sorted(cfg.moe_layers) if cfg.num_experts else []
    out.update(
        model_type=model_type,
        architectures=out.get("architectures") or [architecture],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        layer_types=[
            "linear_attention" if t == "kda" else "full_attention" for t in cfg.layer_types
        ],
        mlp_layer_types=["sparse" if i in moe else "dense" for i in range(n)],
        first_k_dense_replace=n,
        moe_layer_freq=1,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
    )
    # Multi-token-prediction layers are dropped on import (no place in the native model).
    for key in ("num_nextn_predict_layers", "num_mtp_layers"):
        if out.get(key):
            out[key] = 0
    out.pop("quantization_config", None)  # the weights written are plain
    if moe:
        out.update(_moe_layer_spelling(moe, n, base))
    if not moe:
        out["num_experts"] = None
        return out
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
    if base and base.get("use_grouped_topk") is False and cfg.n_group == cfg.topk_group == 1:
        # ungrouped as the source said it, with 1 / 1 groups: transformers reads only the group
        # sizes, Moonshot's code and vLLM the flag; both route ungrouped
        out["use_grouped_topk"] = False
    # the same values under the aliases the source may also spell (transformers' names)
    for key, aliases in _MOE_ALIASES.items():
        for alias in aliases:
            if alias in out:
                out[alias] = out[key]
    return out


_MOE_ALIASES = {
    "num_experts": ("num_local_experts", "n_routed_experts"),
    "num_experts_per_token": ("num_experts_per_tok",),
    "num_shared_experts": ("n_shared_experts",),
    "moe_renormalize": ("norm_topk_prob",),
    "num_expert_group": ("n_group",),
}


def _moe_layer_spelling(moe: list[int], n: int, base: Mapping[str, Any] | None) -> dict[str, int]:
    """``first_k_dense_replace`` / ``moe_layer_freq`` naming exactly the MoE layers ``moe``
    (sorted, non-empty) of ``n`` layers, for readers of those fields (Moonshot's code, vLLM)
    rather than of ``mlp_layer_types``: the source's own values when they still name them,
    else the first layer and the smallest frequency that do; when no pair does, the first MoE
    layer with frequency 1 and a WARNING (only ``mlp_layer_types`` names the layout then)."""

    def names(k: Any, freq: Any) -> bool:
        try:
            return (
                moe_layers_of(
                    {"num_experts": 1, "first_k_dense_replace": k, "moe_layer_freq": freq},
                    n,
                    "base",
                )
                == moe
            )
        except ValueError:
            return False

    k0 = (base or {}).get("first_k_dense_replace")
    freq0 = (base or {}).get("moe_layer_freq")
    k0 = moe[0] if k0 is None else k0
    freq0 = 1 if freq0 is None else freq0
    if base and names(k0, freq0):
        return {"first_k_dense_replace": k0, "moe_layer_freq": freq0}
    for freq in range(1, n + 1):
        if names(moe[0], freq):
            return {"first_k_dense_replace": moe[0], "moe_layer_freq": freq}
    logger.warning(
        "MoE layers %s are no first_k_dense_replace / moe_layer_freq pattern: the exported "
        "config names them in mlp_layer_types only (first_k_dense_replace=%d, moe_layer_freq=1 "
        "reads as layers %d..%d)",
        moe,
        moe[0],
        moe[0],
        n - 1,
    )
    return {"first_k_dense_replace": moe[0], "moe_layer_freq": 1}


def _formats() -> dict[str, SourceFormat]:
    from harts_verl.models import kimi_linear, ling

    return {f.model_type: f for f in (kimi_linear.FORMAT, ling.FORMAT)}


def format_of_config(d: Any) -> SourceFormat | None:
    """The source format of the ``config.json`` dict ``d``, or None."""
    if not isinstance(d, Mapping):
        return None
    return _formats().get(d.get("model_type"))


def _format(model_type: str) -> SourceFormat:
    fmts = _formats()
    if model_type not in fmts:
        raise ValueError(f"to: expected one of {[HARTS_MODEL_TYPE, *fmts]}, got {model_type!r}")
    return fmts[model_type]


def read_config(path: str) -> dict[str, Any]:
    """The ``config.json`` dict of a model directory (or of a config file path)."""
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"model: {path!r} does not exist")
    if not path.endswith(".json") and not os.path.isdir(path):
        raise ValueError(f"model: {path!r} is a file, expected a model directory or a config.json")
    if not os.path.isfile(file):
        raise ValueError(f"model: no config.json at {path!r}")
    with open(file) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: expected a JSON object, got a {type(d).__name__}")
    return d


def source_config_of(spec: str) -> dict[str, Any] | None:
    """The ``config.json`` dict of ``spec`` (a model directory or a config file) when it is a
    source format (Kimi-Linear, Ling 3), else None: also for a missing or unreadable config,
    which the caller's own reader (transformers') then reports."""
    try:
        d = read_config(spec)
    except ValueError:  # no config.json, or invalid JSON
        return None
    return d if format_of_config(d) is not None else None


def source_format_of_dir(path: str) -> SourceFormat | None:
    """The source format of the model directory ``path`` (None: not a source checkpoint)."""
    return format_of_config(source_config_of(path))


def harts_config_from_source(source: Mapping[str, Any]) -> Any:
    """The ``HartsHybridConfig`` of a source config dict: its architecture, its tokenizer ids,
    and ``source`` itself under ``harts_source_config`` (the veRL engine exports weights in the
    source's names for such a model; ``convert --to`` restores the config)."""
    from harts_verl.models.hf import HartsHybridConfig

    fmt = format_of_config(source)
    if fmt is None:
        raise ValueError(f"model_type: no converter for {source.get('model_type')!r}")
    extra = {k: source[k] for k in TOKEN_KEYS if source.get(k) is not None}
    return HartsHybridConfig.from_hybrid_config(
        fmt.hybrid_config(source), **extra, **{SOURCE_CONFIG_KEY: dict(source)}
    )


def source_architecture(config: Any) -> tuple[SourceFormat, HybridConfig] | None:
    """(format, architecture) of a ``HartsHybridConfig`` converted from a source format (its
    ``harts_source_config``), else None."""
    if getattr(config, "model_type", None) != HARTS_MODEL_TYPE:
        return None
    fmt = format_of_config(getattr(config, SOURCE_CONFIG_KEY, None))
    return None if fmt is None else (fmt, config.to_hybrid_config())


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

    def first(self, *names: str) -> str | None:
        """The first of ``names`` present, or None."""
        return next((n for n in names if self.has(n)), None)

    def numel(self, name: str) -> int:
        """The number of elements of tensor ``name`` (read from the header, not loaded)."""
        if self._mem is not None:
            return int(self._mem[name].numel())
        return math.prod(self._handle(self._where[name]).get_slice(name).get_shape())

    def take(self, *names: str) -> torch.Tensor:
        """The tensor of the first of ``names`` present; ``ValueError`` naming them all."""
        name = self.first(*names)
        if name is None:
            raise ValueError(f"checkpoint: missing tensor {' / '.join(names)}")
        self.taken.add(name)
        if self._mem is not None:
            return self._mem[name]
        from safetensors import SafetensorError

        file = self._where[name]
        try:
            return self._handle(file).get_tensor(name)
        except SafetensorError as exc:
            raise ValueError(f"checkpoint {file!r}: cannot read tensor {name} ({exc})") from None

    def _handle(self, file: str) -> Any:
        from safetensors import SafetensorError, safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(file, framework="pt")
            except (SafetensorError, OSError) as exc:
                raise ValueError(f"checkpoint {file!r}: unreadable ({exc})") from None
        return self._handles[file]


def _weight_map(path: str) -> dict[str, str]:
    """tensor name -> safetensors file of the checkpoint directory ``path``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{index}: not valid JSON ({exc})") from None
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ValueError(f"{index}: expected a 'weight_map' of tensor name -> shard file")
        missing = sorted({v for v in wm.values() if not os.path.isfile(os.path.join(path, v))})
        if missing:
            raise ValueError(f"{index}: names shard files that do not exist: {missing[:3]}")
        return {k: os.path.join(path, v) for k, v in wm.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(
            f"checkpoint {path!r}: no model.safetensors or model.safetensors.index.json"
        )
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    except SafetensorError as exc:
        raise ValueError(f"checkpoint {single!r}: unreadable ({exc})") from None


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


# --- the name table of a layer ---------------------------------------------------------------

_SWIGLU = ("gate_proj", "up_proj", "down_proj")
_EXPERTS = ("ffn.w_gate", "ffn.w_up", "ffn.w_down")


def _rope_perm(r: int) -> torch.Tensor:
    """Interleaved rope pairs (x0, x1), (x2, x3), ... -> rotate-half halves (evens, odds)."""
    return torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])


def _permute_rope_rows(w: torch.Tensor, cfg: HybridConfig, key: str, inverse: bool) -> torch.Tensor:
    """Reorder the rope rows of an MLA projection between the interleaved layout and ours: the
    query projection's per-head ``[nope | rope]`` rows, or the latent projection's trailing
    rope rows. Rotating the reordered channels rotate-half style gives the interleaved result."""
    r = cfg.qk_rope_head_dim
    perm = _rope_perm(r)
    if inverse:
        perm = torch.argsort(perm)
    if key.endswith(("q_proj.weight", "q_b.weight")):
        per_head = w.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + r, -1)
        rope = per_head[:, cfg.qk_nope_head_dim :][:, perm]
        return torch.cat([per_head[:, : cfg.qk_nope_head_dim], rope], dim=1).reshape(w.shape)
    return torch.cat([w[: cfg.kv_lora_rank], w[cfg.kv_lora_rank :][perm]], dim=0)


def _layer_table(
    names: SourceNames, cfg: HybridConfig, i: int
) -> dict[str, tuple[tuple[str, ...], str]]:
    """Native key (under ``layers.{i}.``) -> (source names under ``model.layers.{i}.``, kind);
    kinds: ``plain``, ``a_log``, ``rope`` (MLA rows to reorder). Convolutions and experts are
    handled apart (one source tensor for several native ones, or the other way round)."""
    t: dict[str, tuple[tuple[str, ...], str]] = {
        "input_norm.weight": (("input_layernorm.weight",), "plain"),
        "post_norm.weight": (("post_attention_layernorm.weight",), "plain"),
    }
    a = names.attn

    def attn(*leaf: str) -> tuple[str, ...]:
        return tuple(r + n for r in a for n in leaf)

    o_proj = names.kda_o_proj if cfg.layer_types[i] == "kda" and names.kda_o_proj else names.o_proj
    t["mixer.o_proj.weight"] = (attn(*(o + ".weight" for o in o_proj)), "plain")
    if cfg.layer_types[i] == "kda":
        for n in ("q_proj", "k_proj", "v_proj", "b_proj", "o_norm"):
            t[f"mixer.{n}.weight"] = (attn(f"{n}.weight"), "plain")
        gates = (
            {"f_a": "f_a_proj", "f_b": "f_b_proj", "g_a": "g_a_proj", "g_b": "g_b_proj"}
            if cfg.kda_low_rank_gates
            else {"f_proj": "f_proj", "g_proj": "g_proj"}
        )
        for ours, theirs in gates.items():
            forget = (f"forget_gate.{theirs}.weight",) if theirs.startswith("f") else ()
            t[f"mixer.{ours}.weight"] = (attn(f"{theirs}.weight", *forget), "plain")
        t["mixer.dt_bias"] = (attn("dt_bias", "forget_gate.dt_bias"), "plain")
        t["mixer.A_log"] = (attn("A_log", "forget_gate.A_log"), "a_log")
    else:
        rope = "rope" if names.rope_interleaved and cfg.qk_rope_head_dim else "plain"
        mla = {
            "q_proj": ("q_proj", rope),
            "q_a": ("q_a_proj", "plain"),
            "q_norm": ("q_a_layernorm", "plain"),
            "q_b": ("q_b_proj", rope),
            "kv_a": ("kv_a_proj_with_mqa", rope),
            "kv_norm": ("kv_a_layernorm", "plain"),
            "kv_b": ("kv_b_proj", "plain"),
            "g_proj": ("g_proj", "plain"),
        }
        for ours, (theirs, kind) in mla.items():
            t[f"mixer.{ours}.weight"] = (attn(f"{theirs}.weight"), kind)
    moe = i in cfg.moe_layers and cfg.num_experts > 0
    if not moe:
        for n in _SWIGLU:
            t[f"ffn.{n}.weight"] = (tuple(r + f"{n}.weight" for r in names.dense), "plain")
        return t
    m = names.moe
    t["ffn.router.weight"] = (tuple(r + "gate.weight" for r in m), "plain")
    t["ffn.correction_bias"] = (tuple(r + b for r in m for b in names.correction_bias), "plain")
    for n in _SWIGLU:
        t[f"ffn.shared.{n}.weight"] = (tuple(r + f"shared_experts.{n}.weight" for r in m), "plain")
    return t


def _to_hybrid(kind: str, w: torch.Tensor, cfg: HybridConfig, key: str) -> torch.Tensor:
    if kind == "a_log":
        return w.reshape(-1)
    if kind == "rope":
        return _permute_rope_rows(w, cfg, key, inverse=False)
    return w


def _layer_to_hybrid(
    src: CheckpointTensors,
    fmt: SourceFormat,
    cfg: HybridConfig,
    i: int,
    expected: Mapping[str, torch.Size],
) -> dict[str, torch.Tensor]:
    names, p, q = fmt.names, f"model.layers.{i}.", f"layers.{i}."
    out = {}
    for ours, (theirs, kind) in _layer_table(names, cfg, i).items():
        if q + ours in expected:
            out[q + ours] = _to_hybrid(kind, src.take(*(p + n for n in theirs)), cfg, ours)
    if cfg.layer_types[i] == "kda":
        fused = src.first(*(p + r + "conv1d.weight" for r in names.attn))
        if fused is not None:  # transformers' one conv over q|k|v
            sizes = [expected[q + f"mixer.{c}_conv.weight"][0] for c in "qkv"]
            w = src.take(fused)
            width = expected[q + "mixer.q_conv.weight"][1]
            if tuple(w.shape) != (sum(sizes), width):  # stored [C, W] or, as a conv, [C, 1, W]
                w = _shaped(fused, w, (sum(sizes), 1, width)).squeeze(1)
            parts = torch.split(w, sizes, dim=0)
            out.update({q + f"mixer.{c}_conv.weight": w for c, w in zip("qkv", parts, strict=True)})
        else:
            for c in "qkv":
                w = src.take(*(p + r + f"{c}_conv1d.weight" for r in names.attn))
                out[q + f"mixer.{c}_conv.weight"] = w.squeeze(1)
    if q + "ffn.w_gate" in expected:
        out.update(_experts_to_hybrid(src, names, p, q, expected[q + "ffn.w_gate"]))
    return out


def _experts_to_hybrid(
    src: CheckpointTensors,
    names: SourceNames,
    p: str,
    q: str,
    gate_shape: torch.Size,
) -> dict[str, torch.Tensor]:
    """Stacked ``[E, D, F]`` / ``[E, F, D]`` experts (``gate_shape``: the stacked gate's) from
    per-expert ``[F, D]`` / ``[D, F]`` tensors, or from transformers' fused
    ``gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]``; ``ValueError`` naming a source tensor
    of another shape."""
    e, d, f = gate_shape
    roots = [p + r for r in names.moe]
    fused = src.first(*(r + "experts.gate_up_proj" for r in roots))
    if fused is not None:
        gate_up = _shaped(fused, src.take(fused), (e, 2 * f, d))
        down_name = fused[: -len("gate_up_proj")] + "down_proj"
        down = _shaped(down_name, src.take(down_name), (e, d, f))
        return {
            q + "ffn.w_gate": gate_up[:, :f].transpose(1, 2),
            q + "ffn.w_up": gate_up[:, f:].transpose(1, 2),
            q + "ffn.w_down": down.transpose(1, 2),
        }
    out = {}
    for ours, w in zip(_EXPERTS, names.experts, strict=True):
        shape = (f, d) if ours != "ffn.w_down" else (d, f)
        per_expert = []
        for j in range(e):
            candidates = [r + f"experts.{j}.{w}.weight" for r in roots]
            t = src.take(*candidates)  # ValueError naming them when none is present
            per_expert.append(_shaped(str(src.first(*candidates)), t, shape).T)
        out[q + ours] = torch.stack(per_expert)
    return out


def source_tensors_from_hybrid(
    fmt: SourceFormat, name: str, tensor: torch.Tensor, cfg: HybridConfig
) -> list[tuple[str, torch.Tensor]]:
    """The source-format tensors of one native state-dict entry ``name`` (with or without
    ``model.``): a rename, a reshape (``A_log``, convolutions), a row reordering (interleaved
    rope) or, for stacked experts, one transposed tensor per expert. Raises ``ValueError`` for a
    name the architecture does not have. Used per tensor by the veRL engine's weight export to
    the rollout server."""
    names = fmt.names
    key = name.removeprefix("model.")
    top = {
        "embed_tokens.weight": names.embed[0],
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if key in top:
        return [(top[key], tensor)]
    parts = key.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"{fmt.model_type} export: unexpected tensor {name!r}")
    i, rest = int(parts[1]), parts[2]
    if i >= cfg.num_hidden_layers:
        raise ValueError(
            f"{fmt.model_type} export: {name!r} is beyond {cfg.num_hidden_layers} layers"
        )
    p, a = f"model.layers.{i}.", names.attn[0]
    table = _layer_table(names, cfg, i)
    if rest in table:
        theirs, kind = table[rest]
        if kind == "a_log":
            tensor = tensor.reshape(names.a_log_shape)
        elif kind == "rope":
            tensor = _permute_rope_rows(tensor, cfg, rest, inverse=True)
        return [(p + theirs[0], tensor)]
    if rest.startswith("mixer.") and rest.endswith("_conv.weight"):
        return [(p + a + f"{rest[len('mixer.')]}_conv1d.weight", tensor.unsqueeze(1))]
    if rest in _EXPERTS:
        w = names.experts[_EXPERTS.index(rest)]
        root = p + names.moe[0]
        return [(f"{root}experts.{j}.{w}.weight", t.T) for j, t in enumerate(tensor.unbind(0))]
    raise ValueError(f"{fmt.model_type} export: unexpected tensor {name!r}")


def _shaped(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` when its shape is ``shape``; else ``ValueError`` naming the tensor ``name``."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"checkpoint: {name!r} has shape {tuple(t.shape)}, the config needs {tuple(shape)}"
        )
    return t


def _check_shapes(
    got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size], keys: Any
) -> None:
    for k in keys:
        if k not in got:
            raise ValueError(f"checkpoint: no tensor for {k!r}")
        _shaped(k, got[k], expected[k])


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _iter_to_hybrid(
    src: CheckpointTensors,
    fmt: SourceFormat,
    cfg: HybridConfig,
    progress: Callable[[str], None] | None = None,
    *,
    mtp_layers: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """The native state dict of ``src`` in pieces (embeddings, each layer, head), shape-checked.
    The ``mtp_layers`` multi-token-prediction layers after the decoder layers (indices
    ``[n, n + mtp_layers)``) are dropped with a WARNING; empty (zero-element) tensors without
    a place (transformers saves ``[0, D]`` shared experts for ``num_shared_experts: 0``) hold
    nothing and are skipped; after the last piece, ``ValueError`` names any other unused source tensor (a layer
    beyond those is one: never truncated silently)."""
    expected = expected_hybrid_shapes(cfg)
    n = cfg.num_hidden_layers
    first = {"embed_tokens.weight": src.take(*fmt.names.embed)}
    _check_shapes(first, expected, first)
    yield first
    for i in range(n):
        piece = _layer_to_hybrid(src, fmt, cfg, i, expected)
        _check_shapes(piece, expected, [k for k in expected if k.startswith(f"layers.{i}.")])
        if progress is not None:
            progress(f"layer {i + 1}/{n} ({cfg.layer_types[i]})")
        yield piece
    last = {"norm.weight": src.take("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        last["lm_head.weight"] = src.take("lm_head.weight")
    elif "lm_head.weight" in src.names:  # a tied checkpoint may store the head as well
        head = src.take("lm_head.weight")
        if not torch.equal(head, first["embed_tokens.weight"]):
            raise ValueError(
                "checkpoint: lm_head.weight differs from the input embedding, but the config "
                "ties them (tie_word_embeddings: true); transformers' Kimi-Linear and Ling 3 "
                "never tie, so a checkpoint they saved keeps its own head: set "
                "tie_word_embeddings to false in its config.json"
            )
    _check_shapes(last, expected, last)
    yield last
    unused = src.names - src.taken
    index = {k: _layer_index(k) for k in unused}
    mtp = {k for k, i in index.items() if i is not None and n <= i < n + mtp_layers}
    if mtp:
        logger.warning(
            "%s: dropped %d tensors of multi-token-prediction layers (index %d..%d)",
            fmt.model_type,
            len(mtp),
            n,
            n + mtp_layers - 1,
        )
    rest = sorted(k for k in unused - mtp if "rotary_emb" not in k and src.numel(k))
    beyond = [k for k in rest if index[k] is not None and index[k] >= n]
    if beyond:
        raise ValueError(
            f"checkpoint: tensors of layers {sorted({index[k] for k in beyond})} beyond "
            f"num_hidden_layers = {n} and the {mtp_layers} multi-token-prediction layer(s) the "
            f"config declares (num_nextn_predict_layers / num_mtp_layers), e.g. {beyond[:3]}"
        )
    if rest:
        raise ValueError(
            f"checkpoint: {len(rest)} tensors have no place in the native model, e.g. {rest[:5]}"
        )


def hybrid_state_dict_from_source(
    fmt: SourceFormat,
    tensors: Mapping[str, torch.Tensor] | CheckpointTensors,
    cfg: HybridConfig,
    *,
    mtp_layers: int = 0,
) -> dict[str, torch.Tensor]:
    """The :class:`HybridForCausalLM` state dict (keys without ``model.``) of a source state
    dict in format ``fmt`` (any accepted names); ``mtp_layers``: the multi-token-prediction
    layers it holds after the decoder layers (:func:`mtp_layers_of`), dropped."""
    src = tensors if isinstance(tensors, CheckpointTensors) else CheckpointTensors(tensors)
    out: dict[str, torch.Tensor] = {}
    for piece in _iter_to_hybrid(src, fmt, cfg, mtp_layers=mtp_layers):
        out.update(piece)
    return out


def _iter_from_hybrid(
    src: CheckpointTensors,
    fmt: SourceFormat,
    cfg: HybridConfig,
    progress: Callable[[str], None] | None = None,
    *,
    tied_head: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """The source-format state dict of the native state dict in ``src`` (keys with or without
    ``model.``), one native tensor's worth at a time, shape-checked; raises ``ValueError`` for
    an architecture ``fmt`` cannot express, a missing tensor, or (after the last piece) a native
    tensor the architecture does not have. ``tied_head``: a tied model also gets
    ``lm_head.weight``, a copy of the embedding, last (transformers' Kimi-Linear and Ling 3
    never tie: without it they would load a random head)."""
    fmt.check_architecture(cfg)
    expected = expected_hybrid_shapes(cfg)
    layer = -1
    for k in expected:
        t = src.take("model." + k, k)
        _check_shapes({k: t}, expected, [k])
        i = _layer_index("model." + k)
        if progress is not None and i is not None and i != layer:
            layer = i
            progress(f"layer {i + 1}/{cfg.num_hidden_layers} ({cfg.layer_types[i]})")
        yield dict(source_tensors_from_hybrid(fmt, k, t, cfg))
        if tied_head and cfg.tie_word_embeddings and k == "embed_tokens.weight":
            head = t.clone()  # its own storage: safetensors refuses shared tensors
    if tied_head and cfg.tie_word_embeddings:
        yield {"lm_head.weight": head}
    tied = {"lm_head.weight", "model.lm_head.weight"} if cfg.tie_word_embeddings else set()
    extra = sorted(src.names - src.taken - tied)
    if extra:
        raise ValueError(f"state dict: unexpected tensors {extra[:5]}")


def source_state_dict_from_hybrid(
    fmt: SourceFormat, sd: Mapping[str, torch.Tensor], cfg: HybridConfig
) -> dict[str, torch.Tensor]:
    """The source-format state dict of a :class:`HybridForCausalLM` state dict (keys with or
    without ``model.``); the inverse of :func:`hybrid_state_dict_from_source`. Raises
    ``ValueError`` when ``cfg`` is not expressible in ``fmt`` or a tensor is missing or
    unexpected."""
    out: dict[str, torch.Tensor] = {}
    for piece in _iter_from_hybrid(CheckpointTensors(sd), fmt, cfg):
        out.update(piece)
    return out


# --- checkpoints -----------------------------------------------------------------------------


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

    def abort(self) -> None:
        """Remove the shards written so far (a conversion that failed leaves nothing behind)."""
        for k in range(len(self._files)):
            tmp = os.path.join(self.path, f".shard-{k:05d}.safetensors")
            if os.path.exists(tmp):
                os.remove(tmp)
        self._files, self._pending, self._size = [], {}, 0

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
            return [*names, "model.safetensors.index.json"]
        return names


def _copy_side_files(src: str, dst: str) -> list[str]:
    """Tokenizer, generation config and other files of ``src`` (not weights, not config.json)
    copied to ``dst``; returns their names, sorted."""
    copied = []
    for name in sorted(os.listdir(src)):
        full = os.path.join(src, name)
        if (
            not os.path.isfile(full)
            or name == "config.json"
            or name in _WEIGHT_FILES
            or name.endswith((".safetensors", ".bin", ".pt", ".h5", ".msgpack", ".index.json"))
        ):
            continue
        shutil.copy2(full, os.path.join(dst, name))
        copied.append(name)
    return copied


def _harts_config_dict(source: Mapping[str, Any]) -> dict[str, Any]:
    out = harts_config_from_source(source).to_dict()
    out["architectures"] = ["HartsHybridForCausalLM"]
    return out


def _hybrid_config_of_harts(d: Mapping[str, Any]) -> HybridConfig:
    from harts_verl.models.hf import HartsHybridConfig

    keep = {k: v for k, v in d.items() if k not in ("architectures", "transformers_version")}
    return HartsHybridConfig(**keep).to_hybrid_config()


_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt")


def _weight_files(path: str) -> list[str]:
    """Sorted names of the weight files (safetensors / PyTorch shards and their indexes) in the
    directory ``path``; [] when it is not a directory."""
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if n.endswith(_WEIGHT_SUFFIXES))


@contextlib.contextmanager
def _naming_source(src: str) -> Iterator[None]:
    """Re-raise a ValueError raised inside (about the source model) with ``src`` in front,
    unless its message already names it."""
    try:
        yield
    except ValueError as exc:
        msg = str(exc)
        if msg.startswith("model: "):  # read_config's field: here the source is ``src``
            raise ValueError("src: " + msg[len("model: ") :]) from exc
        if src in msg:
            raise
        raise ValueError(f"{src}: {exc}") from exc


def convert_checkpoint(
    src: str,
    dst: str,
    *,
    to: str = HARTS_MODEL_TYPE,
    max_shard_bytes: int = 5 * 2**30,
    config_only: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Convert the model directory ``src`` into ``dst`` (created; must hold neither a model nor
    weight files yet, ValueError naming ``dst``; an error about the source names ``src``): a
    source checkpoint (Kimi-Linear, Ling 3) to ``harts_hybrid`` (``to="harts_hybrid"``), or a
    ``harts_hybrid`` to a source format (``to="kimi_linear"`` / ``"bailing_hybrid"``). Streams
    layer by layer (peak memory about one layer plus one shard), copies the tokenizer and other
    side files, and returns a summary (model types, layers, tensors, bytes, and ``files``: every
    file written to ``dst``, config.json first). A
    ``harts_hybrid`` written here keeps the source config under ``harts_source_config``, so the
    way back restores its tokenizer ids and ``auto_map``. ``config_only`` (to ``harts_hybrid``):
    write the config alone, for veRL's ``model.hf_config_path`` beside the source ``model.path``
    (the weights are converted while loading)."""
    if (
        isinstance(max_shard_bytes, bool)
        or not isinstance(max_shard_bytes, int)
        or max_shard_bytes < 1
    ):
        raise ValueError(f"max_shard_bytes: expected an int >= 1, got {max_shard_bytes!r}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"dst: must differ from src ({src!r})")
    if os.path.exists(os.path.join(dst, "config.json")):
        raise ValueError(f"dst: {dst!r} already holds a model (config.json)")
    stale = _weight_files(dst)
    if stale:  # readers would mix them with (or prefer them to) the new shards
        raise ValueError(
            f"dst: {dst!r} already holds weight files ({', '.join(stale[:3])}"
            f"{', ...' if len(stale) > 3 else ''}); convert into a new or empty directory"
        )
    if config_only and to != HARTS_MODEL_TYPE:
        raise ValueError(f"config_only (--config-only): only with to={HARTS_MODEL_TYPE!r}")
    target = None if to == HARTS_MODEL_TYPE else _format(to)
    say = progress or (lambda msg: logger.info("convert: %s", msg))
    with _naming_source(src):
        d = read_config(src)
        summary: dict[str, Any] = {"src": src, "dst": dst, "from": d.get("model_type"), "to": to}
        if target is None:
            fmt = format_of_config(d)
            if fmt is None:
                raise ValueError(
                    f"model_type: converting to {HARTS_MODEL_TYPE} needs one of "
                    f"{list(_formats())}, got {d.get('model_type')!r}"
                )
            cfg = fmt.hybrid_config(d)
            mtp_layers = mtp_layers_of(d, fmt)
            out_cfg = _harts_config_dict(d)
        else:
            fmt = target
            if d.get("model_type") != HARTS_MODEL_TYPE:
                raise ValueError(
                    f"model_type: converting to {to} needs a {HARTS_MODEL_TYPE!r} model, got "
                    f"{d.get('model_type')!r}"
                )
            cfg = _hybrid_config_of_harts(d)
            base = d.get(SOURCE_CONFIG_KEY)
            out_cfg = fmt.source_config(cfg, base if format_of_config(base) is fmt else None)
            # every token id written, null when unset: a reader would fill in its own defaults
            # (transformers' Kimi-Linear: pad 163839, beyond a small vocabulary)
            for k in TOKEN_KEYS:
                out_cfg[k] = d[k] if d.get(k) is not None else out_cfg.get(k)
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ValueError(f"dst: {dst!r} exists and is not a directory")
    created = not os.path.exists(dst)
    os.makedirs(dst, exist_ok=True)
    if config_only:
        files, tensors, nbytes = ["config.json"], 0, 0
    else:
        writer = _ShardWriter(dst, max_shard_bytes)
        tensors = 0
        try:
            with _naming_source(src):
                src_t = CheckpointTensors(path=src)
                if target is None:
                    for piece in _iter_to_hybrid(src_t, fmt, cfg, say, mtp_layers=mtp_layers):
                        writer.add({"model." + k: v for k, v in piece.items()})
                        tensors += len(piece)
                else:
                    for piece in _iter_from_hybrid(src_t, fmt, cfg, say, tied_head=True):
                        writer.add(piece)
                        tensors += len(piece)
            files, nbytes = writer.close(), writer.total
        except BaseException:
            writer.abort()  # no hidden partial shards in dst
            if created and not os.listdir(dst):
                os.rmdir(dst)
            raise
        files = ["config.json", *files, *_copy_side_files(src, dst)]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(out_cfg, f, indent=2)
    say(f"wrote {tensors} tensors ({nbytes / 2**20:.1f} MiB) and config.json to {dst}")
    summary.update(layers=cfg.num_hidden_layers, tensors=tensors, bytes=nbytes, files=files)
    return summary


def load_from_source(cls: Any, path: str, *, config: Any = None, **kwargs: Any) -> Any:
    """``cls.from_pretrained`` (``HartsHybridForCausalLM``, or ``HartsHybridForTokenClassification``
    whose ``score`` keeps its init) of the source checkpoint ``path``:
    the weights converted while loading, cast to ``dtype`` / ``torch_dtype`` (default float32;
    ``"auto"``: the checkpoint config's ``dtype`` / ``torch_dtype``).
    ``config``: a ``HartsHybridConfig`` of the same architecture (e.g. from ``convert
    --config-only``; its ``chunk_size`` is honoured), else the converted one, whose attributes
    keyword arguments set as transformers' ``from_pretrained`` does without a config (a token
    classifier's ``num_labels``, ``chunk_size``, ...; ``attn_implementation`` is not applied).
    Either must describe the checkpoint's architecture (ValueError naming the differences).
    Under an empty-weight (meta) context, as veRL uses on FSDP ranks other than 0, the model is
    built and not loaded. Other keyword arguments of ``from_pretrained``
    (``trust_remote_code``, ...) are accepted and not used."""
    raw = read_config(path)
    fmt = format_of_config(raw)
    if fmt is None:
        raise ValueError(f"model_type: no converter for {raw.get('model_type')!r} at {path!r}")
    arch = fmt.hybrid_config(raw)
    if config is None:
        config = harts_config_from_source(raw)
        # as transformers' from_pretrained without a config: keyword arguments that name config
        # attributes (a token classifier's num_labels, chunk_size, ...) set them
        skip = ("dtype", "torch_dtype", "attn_implementation")
        overrides = {k: v for k, v in kwargs.items() if k not in skip and hasattr(config, k)}
        if overrides:
            d = config.to_dict()
            if "num_labels" in overrides:  # the label maps follow the new count
                d.pop("id2label", None)
                d.pop("label2id", None)
            config = type(config)(**{**d, **overrides})
    mine, theirs = config.to_hybrid_config().to_dict(), arch.to_dict()
    diff = sorted(k for k in mine if k not in _ARCH_EXEMPT and mine[k] != theirs[k])
    if diff:
        detail = ", ".join(f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in diff[:4])
        raise ValueError(
            f"config: does not describe the {fmt.display} checkpoint {path!r} ({detail})"
        )
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype")) or torch.float32
    if dtype == "auto":  # as transformers: the checkpoint config's dtype (float32 without one)
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype) or not named.is_floating_point:
            raise ValueError(f"dtype: expected a torch floating dtype or 'auto', got {dtype!r}")
        dtype = named
    model = cls(config).to(dtype)
    if any(p.is_meta for p in model.parameters()):
        return model
    src = CheckpointTensors(path=path)
    sd = hybrid_state_dict_from_source(
        fmt, src, config.to_hybrid_config(), mtp_layers=mtp_layers_of(raw, fmt)
    )
    if not hasattr(model.model, "lm_head"):  # a token classifier (critic): no LM head
        sd.pop("lm_head.weight", None)
    model.model.load_state_dict(sd, strict=not arch.tie_word_embeddings)
    return model.eval()
