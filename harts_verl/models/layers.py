"""Row-wise building blocks of the hybrid model: norms, RoPE, SwiGLU MLP, MoE FFN.

Everything here is position-wise except RoPE, which takes explicit position ids (the row depth,
invariant 2), so all of it runs unchanged on the compact ``[C, D]`` rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harts_verl.models.config import HybridConfig
from harts_verl.ops._dtypes import compute_dtype


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` computed in float32 (float64 for float64 input)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.to(h.dtype)).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the mixer output times ``act(gate)`` (sigmoid for KDA, silu for GDN)."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"activation: expected 'silu' or 'sigmoid', got {activation!r}")
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(h.dtype)
        g = gate.to(h.dtype)
        g = F.silu(g) if self.activation == "silu" else torch.sigmoid(g)
        return (h * g).to(x.dtype)


def rope_cos_sin(
    position_ids: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[C, dim]`` for the given positions (rotate-half layout)."""
    if dim % 2:
        raise ValueError(f"rope dim must be even, got {dim}")
    calc = compute_dtype(dtype)
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, dim, 2, dtype=calc, device=position_ids.device) / dim)
    )
    freqs = position_ids.to(calc)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x [C, H, D]``; the rest pass through."""
    r = cos.shape[-1]
    if r == 0:
        return x
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, x_pass], dim=-1)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEFFN(nn.Module):
    """Mixture of SwiGLU experts with deterministic top-k routing (no token drop), an optional
    shared expert (sigmoid-gated, or added as is with ``shared_expert_gate=False``), and a router
    auxiliary loss weighted by row multiplicity (invariant 7: each row is routed once,
    statistics equal the trajectory-wise ones)."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.router = nn.Linear(d, e, bias=False)
        if cfg.router == "sigmoid_grouped":
            self.register_buffer("correction_bias", torch.zeros(e))
        # Expert weights [E, D, F] / [E, F, D] (x @ w layout of ops.moe.moe_forward).
        self.w_gate = nn.Parameter(torch.randn(e, d, f) * cfg.initializer_range)
        self.w_up = nn.Parameter(torch.randn(e, d, f) * cfg.initializer_range)
        self.w_down = nn.Parameter(torch.randn(e, f, d) * cfg.initializer_range)
        if cfg.shared_expert_intermediate_size:
            self.shared = SwiGLU(d, cfg.shared_expert_intermediate_size)
            self.shared_gate = nn.Linear(d, 1, bias=False) if cfg.shared_expert_gate else None
        else:
            self.shared = None

    def route(self, x: torch.Tensor):
        from harts_verl.ops import moe

        logits = self.router(x)
        cfg = self.cfg
        if cfg.router == "softmax":
            return logits, moe.softmax_topk_route(
                logits, cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob
            )
        return logits, moe.sigmoid_grouped_topk_route(
            logits,
            top_k=cfg.num_experts_per_tok,
            correction_bias=self.correction_bias,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
            norm_topk_prob=cfg.norm_topk_prob,
        )

    def forward(
        self, x: torch.Tensor, row_weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[C, D]`` → (output ``[C, D]``, auxiliary load-balancing loss scalar)."""
        from harts_verl.ops import moe

        _, route = self.route(x)
        out = moe.moe_forward(x, route.weights, route.experts, self.w_gate, self.w_up, self.w_down)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        aux = moe.load_balancing_loss(
            route.probs,
            route.experts,
            self.cfg.num_experts,
            self.cfg.num_experts_per_tok,
            weights=row_weights,
        )
        return out, aux
