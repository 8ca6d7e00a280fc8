"""HybridConfig: an HF-style configuration for the native hybrid-attention model."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

MIXERS = ("kda", "gdn", "mla", "gqa")
ROUTERS = ("softmax", "sigmoid_grouped")


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
    # full attention, shared
    num_attention_heads: int = 4
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8  # 0 = NoPE MLA (Kimi-Linear)
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
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        for i, t in enumerate(self.layer_types):
            if t not in MIXERS:
                raise ValueError(f"layer_types[{i}]: unknown mixer {t!r}, expected one of {MIXERS}")
        n = len(self.layer_types)
        for i in self.moe_layers:
            if not 0 <= i < n:
                raise ValueError(f"moe_layers: layer {i} out of range for {n} layers")
        if self.router not in ROUTERS:
            raise ValueError(f"router: expected one of {ROUTERS}, got {self.router!r}")
        if self.linear_num_value_heads % self.linear_num_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts and self.num_experts % self.n_group:
            raise ValueError("num_experts must be a multiple of n_group")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size: expected a positive int, got {self.chunk_size}")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridConfig:
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
    # Kimi-Linear-like: KDA + NoPE MLA + sigmoid grouped routing.
    "kimi_tiny": dict(
        layer_types=["kda", "kda", "mla", "kda"],
        moe_layers=[1, 2, 3],
        qk_rope_head_dim=0,
        router="sigmoid_grouped",
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    ),
}


def preset(name: str, **overrides: Any) -> HybridConfig:
    """A named configuration (``tiny``, ``bench``, ``kimi_tiny``) with optional overrides."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}, expected one of {sorted(PRESETS)}")
    return HybridConfig(**{**PRESETS[name], **overrides})
