"""HybridConfig: an HF-style configuration for the native hybrid-attention model."""

from __future__ import annotations

import contextlib
import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any

MIXERS = ("kda", "gdn", "mla", "gqa")
ROUTERS = ("softmax", "sigmoid_grouped")


_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "linear_num_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "conv_size",
    "chunk_size",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "n_group",
    "topk_group",
)
_REAL_FIELDS = (
    "rms_norm_eps",
    "rope_theta",
    "initializer_range",
    "partial_rotary_factor",
    "routed_scaling_factor",
    "router_aux_loss_coef",
)
_BOOL_FIELDS = (
    "tie_word_embeddings",
    "attn_output_gate",
    "norm_topk_prob",
    "kda_gate_bias",
    "kda_low_rank_gates",
    "mla_use_nope",
    "mla_output_gate",
    "shared_expert_gate",
)


# The largest size field (a tensor dimension) and the most elements one weight may hold (a
# torch tensor's element count is an int64).
MAX_SIZE = 2**31 - 1
_MAX_ELEMENTS = 2**63 - 1


def _as_int(name: str, value: Any, expected: str = "an int") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    return int(value)


def _as_size(name: str, value: Any, expected: str = "an int") -> int:
    """``value`` as an int that can be a tensor dimension (at most :data:`MAX_SIZE`)."""
    v = _as_int(name, value, expected)
    if v > MAX_SIZE:
        raise ValueError(f"{name}: expected an int <= 2**31-1 (a tensor dimension), got {v}")
    return v


def _as_real(name: str, value: Any, suffix: str = "") -> float:
    f = None
    if not isinstance(value, bool) and isinstance(value, numbers.Real):
        with contextlib.suppress(OverflowError):  # an int past float's range
            f = float(value)
    if f is None or not math.isfinite(f):
        raise ValueError(
            f"{name}: expected a finite float{suffix}, got {type(value).__name__} {value!r}"
        )
    return f


def _positive(name: str, value: float, why: str = "") -> None:
    if value <= 0:
        what = "float" if isinstance(value, float) else "int"
        raise ValueError(
            f"{name}: expected a positive {what}{' ' + why if why else ''}, got {value}"
        )


@dataclass
class HybridConfig:
    """Configuration of :class:`~harts_verl.models.hybrid.HybridForCausalLM`.

    ``layer_types[i]`` is the token mixer of layer i (``kda``, ``gdn``, ``mla``, ``gqa``);
    ``moe_layers`` lists the layers whose FFN is a mixture of experts (others are dense SwiGLU).
    """

    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    layer_types: list[str] = field(default_factory=lambda: ["kda", "mla", "gdn", "gqa"])
    moe_layers: list[int] = field(default_factory=lambda: [1, 3])
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # linear attention (KDA / GatedDeltaNet)
    linear_num_heads: int = 2
    linear_num_value_heads: int = 2
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    conv_size: int = 4
    chunk_size: int = 64
    kda_lower_bound: float | None = None
    kda_gate_bias: bool = True  # bias of the output gate's up-projection (False: Kimi-Linear)
    # decay and output gates through a rank-K / rank-V bottleneck (False: full rank, Ling 3)
    kda_low_rank_gates: bool = True
    # full attention, shared
    num_attention_heads: int = 4
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8  # 0: no decoupled key part
    # True: the qk_rope_head_dim part is not rotated (NoPE MLA; Kimi-Linear keeps the shared part)
    mla_use_nope: bool = False
    mla_output_gate: bool = False  # a sigmoid gate per head on the attention output (Ling 3)
    mla_norm_eps: float | None = None  # eps of the latent q / kv RMSNorms (None: rms_norm_eps)
    v_head_dim: int = 16
    # GQA (Qwen3-Next style)
    num_key_value_heads: int = 2
    head_dim: int = 16
    partial_rotary_factor: float = 0.5
    attn_output_gate: bool = True
    # MoE
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 32
    shared_expert_gate: bool = True  # sigmoid gate on the shared expert (False: plain sum)
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        """Validate every field: types first (sizes are ints, not bools; rates are finite
        reals), then ranges of the fields the configured layers use (MoE fields only when a layer
        is MoE, MLA fields only with MLA layers, ...), then the relations between them. Ints are
        normalized to ``int``, reals to ``float``, ``layer_types`` / ``moe_layers`` to lists."""
        self._check_types()
        self._check_ranges()

    def _check_types(self) -> None:
        lt = self.layer_types
        if isinstance(lt, str) or not isinstance(lt, list | tuple):
            raise ValueError(
                f"layer_types: expected a list of mixer names from {MIXERS}, got "
                f"{type(lt).__name__} {lt!r}"
            )
        for i, t in enumerate(lt):
            if not isinstance(t, str) or t not in MIXERS:
                raise ValueError(f"layer_types[{i}]: unknown mixer {t!r}, expected one of {MIXERS}")
        self.layer_types = list(lt)
        ml = self.moe_layers
        if isinstance(ml, str) or not isinstance(ml, list | tuple):
            raise ValueError(
                f"moe_layers: expected a list of layer indices, got {type(ml).__name__} {ml!r}"
            )
        self.moe_layers = [_as_int(f"moe_layers[{i}]", v) for i, v in enumerate(ml)]
        for name in _INT_FIELDS:
            setattr(self, name, _as_size(name, getattr(self, name)))
        if self.q_lora_rank is not None:
            self.q_lora_rank = _as_size("q_lora_rank", self.q_lora_rank, "an int or None")
        for name in _REAL_FIELDS:
            setattr(self, name, _as_real(name, getattr(self, name)))
        if self.kda_lower_bound is not None:
            self.kda_lower_bound = _as_real("kda_lower_bound", self.kda_lower_bound, " or None")
        if self.mla_norm_eps is not None:
            self.mla_norm_eps = _as_real("mla_norm_eps", self.mla_norm_eps, " or None")
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name}: expected a bool, got {type(v).__name__} {v!r}")
        if not isinstance(self.router, str) or self.router not in ROUTERS:
            raise ValueError(f"router: expected one of {ROUTERS}, got {self.router!r}")

    def _check_ranges(self) -> None:
        n = len(self.layer_types)
        if n == 0:
            raise ValueError("layer_types: expected at least one layer, got []")
        for name in ("vocab_size", "hidden_size", "chunk_size"):
            _positive(name, getattr(self, name))
        _positive("rms_norm_eps", self.rms_norm_eps)
        if self.initializer_range < 0:
            raise ValueError(f"initializer_range: expected >= 0, got {self.initializer_range}")
        if self.router_aux_loss_coef < 0:
            raise ValueError(
                f"router_aux_loss_coef: expected >= 0, got {self.router_aux_loss_coef}"
            )
        seen: set[int] = set()
        for i, layer in enumerate(self.moe_layers):
            if not 0 <= layer < n:
                raise ValueError(f"moe_layers: layer {layer} out of range for {n} layers")
            if layer in seen:
                raise ValueError(f"moe_layers[{i}]: layer {layer} listed twice")
            seen.add(layer)
        types = set(self.layer_types)
        moe = bool(self.moe_layers) and self.num_experts > 0
        if self.num_experts < 0:
            raise ValueError(
                f"num_experts: expected an int >= 0 (0: no MoE), got {self.num_experts}"
            )
        if len(seen) < n or not moe:  # some layer has a dense SwiGLU FFN
            _positive("intermediate_size", self.intermediate_size, "(dense FFN layers)")
        if types & {"kda", "gdn"}:
            self._check_linear("kda" in types)
        if types & {"mla", "gqa"}:
            _positive("num_attention_heads", self.num_attention_heads, "(mla/gqa layers)")
        if "mla" in types:
            self._check_mla()
        if "gqa" in types:
            self._check_gqa()
        if moe:
            self._check_moe()
        self._check_weight_sizes(types, moe, dense=len(seen) < n or not moe)

    def _check_weight_sizes(self, types: set[str], moe: bool, *, dense: bool) -> None:
        """Every weight of the configured layers holds at most 2**63-1 elements (torch's
        limit); ValueError naming the product of fields that does not."""
        d, h = self.hidden_size, self.num_attention_heads
        weights = [("vocab_size × hidden_size", self.vocab_size * d)]
        if dense:
            weights.append(("hidden_size × intermediate_size", d * self.intermediate_size))
        if moe:
            f = max(self.moe_intermediate_size, self.shared_expert_intermediate_size)
            weights.append(
                ("num_experts × hidden_size × moe_intermediate_size", self.num_experts * d * f)
            )
        if types & {"kda", "gdn"}:
            hk = self.linear_num_heads * self.linear_key_head_dim
            hv = self.linear_num_value_heads
            kd, vd = self.linear_key_head_dim, self.linear_value_head_dim
            weights += [
                ("hidden_size × linear heads × head dims", d * (2 * hk + hv * (kd + vd))),
                (
                    "linear_key_head_dim × linear_num_value_heads × linear_key_head_dim",
                    kd * hv * kd,
                ),
                (
                    "linear_value_head_dim × linear_num_value_heads × linear_value_head_dim",
                    vd * hv * vd,
                ),
            ]
        if "mla" in types:
            qd = self.qk_nope_head_dim + self.qk_rope_head_dim
            q_in = self.q_lora_rank or d
            weights += [
                ("hidden_size or q_lora_rank × num_attention_heads × qk head dims", q_in * h * qd),
                (
                    "kv_lora_rank × num_attention_heads × (qk_nope_head_dim + v_head_dim)",
                    self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim),
                ),
                ("num_attention_heads × v_head_dim × hidden_size", h * self.v_head_dim * d),
            ]
        if "gqa" in types:
            heads = 2 * h + 2 * self.num_key_value_heads  # q (+ output gate), k, v
            weights.append(("hidden_size × attention heads × head_dim", d * heads * self.head_dim))
        for what, elements in weights:
            if elements > _MAX_ELEMENTS:
                raise ValueError(
                    f"{what}: a weight of {elements} elements, more than a torch tensor holds "
                    "(2**63-1)"
                )

    def _check_linear(self, kda: bool) -> None:
        why = "(kda/gdn layers)"
        for name in (
            "linear_num_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "conv_size",
        ):
            _positive(name, getattr(self, name), why)
        if self.linear_num_value_heads % self.linear_num_heads:
            raise ValueError(
                f"linear_num_value_heads: expected a multiple of linear_num_heads="
                f"{self.linear_num_heads}, got {self.linear_num_value_heads}"
            )
        if kda and self.kda_lower_bound is not None and self.kda_lower_bound >= 0:
            raise ValueError(
                f"kda_lower_bound: expected a negative float or None, got {self.kda_lower_bound}"
            )

    def _check_mla(self) -> None:
        why = "(mla layers)"
        if self.q_lora_rank is not None and self.q_lora_rank < 0:
            raise ValueError(
                f"q_lora_rank: expected None, 0 (no q bottleneck) or a positive int, "
                f"got {self.q_lora_rank}"
            )
        _positive("kv_lora_rank", self.kv_lora_rank, why)
        if self.mla_norm_eps is not None:
            _positive("mla_norm_eps", self.mla_norm_eps, why)
        _positive("v_head_dim", self.v_head_dim, why)
        if self.qk_nope_head_dim < 0:
            raise ValueError(f"qk_nope_head_dim: expected an int >= 0, got {self.qk_nope_head_dim}")
        r = self.qk_rope_head_dim
        if r < 0 or r % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even int >= 0 (0: NoPE), got {r}")
        if self.qk_nope_head_dim + r == 0:
            raise ValueError(
                "qk_nope_head_dim: expected > 0 when qk_rope_head_dim = 0 (query/key dim 0)"
            )
        if r and not self.mla_use_nope:
            _positive("rope_theta", self.rope_theta, "(mla rope)")

    def _check_gqa(self) -> None:
        why = "(gqa layers)"
        _positive("num_key_value_heads", self.num_key_value_heads, why)
        _positive("head_dim", self.head_dim, why)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads: expected a multiple of num_key_value_heads="
                f"{self.num_key_value_heads}, got {self.num_attention_heads}"
            )
        f = self.partial_rotary_factor
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"partial_rotary_factor: expected a float in [0, 1], got {f}")
        if int(self.head_dim * f) >= 2:
            _positive("rope_theta", self.rope_theta, "(gqa rope)")

    def _check_moe(self) -> None:
        e, k = self.num_experts, self.num_experts_per_tok
        if not 1 <= k <= e:
            raise ValueError(
                f"num_experts_per_tok: expected an int in [1, {e}] (num_experts), got {k}"
            )
        _positive("moe_intermediate_size", self.moe_intermediate_size, "(MoE layers)")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"shared_expert_intermediate_size: expected an int >= 0 (0: no shared expert), "
                f"got {self.shared_expert_intermediate_size}"
            )
        g, tg = self.n_group, self.topk_group
        _positive("n_group", g, "(MoE layers)")
        _positive("topk_group", tg, "(MoE layers)")
        if e % g:
            raise ValueError(f"n_group: expected a divisor of num_experts={e}, got {g}")
        if self.router != "sigmoid_grouped":
            return
        if tg > g:
            raise ValueError(f"topk_group: expected an int in [1, {g}] (n_group), got {tg}")
        if k > tg * (e // g):
            raise ValueError(
                f"num_experts_per_tok: expected at most {tg * (e // g)} (the experts of "
                f"topk_group={tg} groups of {e // g}), got {k}"
            )
        if self.routed_scaling_factor <= 0:
            raise ValueError(
                f"routed_scaling_factor: expected a positive float, got {self.routed_scaling_factor}"
            )

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridConfig:
        if not isinstance(d, dict):
            raise TypeError(f"HybridConfig.from_dict: expected a dict, got {type(d).__name__}")
        if d.get("model_type", "harts_hybrid") != "harts_hybrid":
            raise ValueError(f"model_type: expected 'harts_hybrid', got {d['model_type']!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - {"model_type"}
        if unknown:
            raise ValueError(f"HybridConfig: unknown keys {sorted(unknown)}")
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_json(self) -> str:
        return json.dumps({"model_type": "harts_hybrid", **self.to_dict()}, indent=2)


PRESETS: dict[str, dict[str, Any]] = {
    # Tests: every mixer and both FFN kinds, tiny.
    "tiny": {},
    # Benchmark default: >= 4 layers incl. MLA, KDA and MoE, hidden >= 256.
    "bench": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        layer_types=["kda", "kda", "mla", "gdn", "kda", "mla"],
        moe_layers=[1, 3, 5],
        linear_num_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_attention_heads=4,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    ),
    # Kimi-Linear's architecture: KDA without an output-gate bias, NoPE MLA whose shared key part
    # is not rotated, sigmoid grouped routing with an ungated shared expert, no aux loss.
    "kimi_tiny": dict(
        layer_types=["kda", "kda", "mla", "kda"],
        moe_layers=[1, 2, 3],
        kda_gate_bias=False,
        mla_use_nope=True,
        router="sigmoid_grouped",
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        shared_expert_gate=False,
        router_aux_loss_coef=0.0,
    ),
    # Ling 3's architecture (bailing_hybrid): KDA with full-rank gates and the safe (bounded)
    # decay, MLA with RoPE and a sigmoid gate per head, sigmoid grouped routing.
    "ling_tiny": dict(
        layer_types=["kda", "mla", "kda", "mla"],
        moe_layers=[1, 2, 3],
        kda_gate_bias=False,
        kda_low_rank_gates=False,
        kda_lower_bound=-5.0,
        mla_output_gate=True,
        mla_norm_eps=1e-6,
        router="sigmoid_grouped",
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        shared_expert_gate=False,
        router_aux_loss_coef=0.0,
    ),
}


def preset(name: str, **overrides: Any) -> HybridConfig:
    """A named configuration (``tiny``, ``bench``, ``kimi_tiny``, ``ling_tiny``) with optional
    overrides (any :class:`HybridConfig` field; validated like the constructor)."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}, expected one of {sorted(PRESETS)}")
    unknown = set(overrides) - {f.name for f in fields(HybridConfig)}
    if unknown:
        raise ValueError(f"preset: unknown HybridConfig fields {sorted(unknown)}")
    return HybridConfig(**{**PRESETS[name], **overrides})
