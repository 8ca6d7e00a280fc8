"""Token mixers of the hybrid model. Each takes compact rows ``x [C, D]`` and a
:class:`~harts_verl.ops.layout.TreeLayout`; the same code runs the tree layout and the expanded
(trajectory-wise) layout, so the two paths differ only in the layout they are given."""

from __future__ import annotations

import torch
from torch import nn

from harts_verl.models.config import HybridConfig
from harts_verl.models.layers import GatedRMSNorm, RMSNorm, apply_rope, rope_cos_sin
from harts_verl.ops.layout import TreeLayout
from harts_verl.ops.linear_attention import gdn_gate, kda_gate


class ShortConv(nn.Module):
    """Depthwise causal conv (width W, silu) over each row's path: weight ``[D, W]``."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, width) / width**0.5)
        self.width = width

    def forward(self, x: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
        return layout.short_conv(x, self.weight, None)


class KDAMixer(nn.Module):
    """Kimi Delta Attention: per-channel decay, short convs on q/k/v, decay and output gates
    (low-rank, or full-rank with ``kda_low_rank_gates=False``), sigmoid-gated RMSNorm."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        d, h, hv = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_num_value_heads
        kd, vd = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.h, self.hv, self.kd, self.vd = h, hv, kd, vd
        self.lower_bound = cfg.kda_lower_bound
        self.q_proj = nn.Linear(d, h * kd, bias=False)
        self.k_proj = nn.Linear(d, h * kd, bias=False)
        self.v_proj = nn.Linear(d, hv * vd, bias=False)
        self.q_conv = ShortConv(h * kd, cfg.conv_size)
        self.k_conv = ShortConv(h * kd, cfg.conv_size)
        self.v_conv = ShortConv(hv * vd, cfg.conv_size)
        self.low_rank = cfg.kda_low_rank_gates
        if self.low_rank:
            self.f_a = nn.Linear(d, kd, bias=False)
            self.f_b = nn.Linear(kd, hv * kd, bias=False)
        else:
            self.f_proj = nn.Linear(d, hv * kd, bias=False)
        self.b_proj = nn.Linear(d, hv, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(hv).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(torch.empty(hv * kd).uniform_(-4.0, -2.0))
        if self.low_rank:
            self.g_a = nn.Linear(d, vd, bias=False)
            self.g_b = nn.Linear(vd, hv * vd, bias=cfg.kda_gate_bias)
        else:
            self.g_proj = nn.Linear(d, hv * vd, bias=cfg.kda_gate_bias)
        self.o_norm = GatedRMSNorm(vd, cfg.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(hv * vd, d, bias=False)

    def forward(self, x: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
        c = x.shape[0]
        q = self.q_conv(self.q_proj(x), layout).view(c, self.h, self.kd)
        k = self.k_conv(self.k_proj(x), layout).view(c, self.h, self.kd)
        v = self.v_conv(self.v_proj(x), layout).view(c, self.hv, self.vd)
        f = self.f_b(self.f_a(x)) if self.low_rank else self.f_proj(x)
        g = kda_gate(
            f.view(c, self.hv, self.kd),
            self.A_log,
            self.dt_bias,
            self.lower_bound,
        )
        beta = torch.sigmoid(self.b_proj(x).float() if x.dtype != torch.float64 else self.b_proj(x))
        o = layout.linear_attention(q, k, v, g, beta, use_qk_l2norm=True)
        gate = self.g_b(self.g_a(x)) if self.low_rank else self.g_proj(x)
        o = self.o_norm(o, gate.view(c, self.hv, self.vd))
        return self.o_proj(o.reshape(c, self.hv * self.vd))


class GDNMixer(nn.Module):
    """Gated DeltaNet: scalar decay per value head, one short conv over fused q/k/v channels,
    silu-gated RMSNorm."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        d, h, hv = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_num_value_heads
        kd, vd = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.h, self.hv, self.kd, self.vd = h, hv, kd, vd
        self.qkv_proj = nn.Linear(d, 2 * h * kd + hv * vd, bias=False)
        self.conv = ShortConv(2 * h * kd + hv * vd, cfg.conv_size)
        self.a_proj = nn.Linear(d, hv, bias=False)
        self.b_proj = nn.Linear(d, hv, bias=False)
        self.z_proj = nn.Linear(d, hv * vd, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(hv).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.o_norm = GatedRMSNorm(vd, cfg.rms_norm_eps, activation="silu")
        self.o_proj = nn.Linear(hv * vd, d, bias=False)

    def forward(self, x: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
        c = x.shape[0]
        qkv = self.conv(self.qkv_proj(x), layout)
        nk = self.h * self.kd
        q = qkv[:, :nk].reshape(c, self.h, self.kd)
        k = qkv[:, nk : 2 * nk].reshape(c, self.h, self.kd)
        v = qkv[:, 2 * nk :].reshape(c, self.hv, self.vd)
        g = gdn_gate(self.a_proj(x), self.A_log, self.dt_bias)
        b = self.b_proj(x)
        beta = torch.sigmoid(b if x.dtype == torch.float64 else b.float())
        o = layout.linear_attention(q, k, v, g, beta, use_qk_l2norm=True)
        o = self.o_norm(o, self.z_proj(x).view(c, self.hv, self.vd))
        return self.o_proj(o.reshape(c, self.hv * self.vd))


class MLAMixer(nn.Module):
    """Multi-head latent attention: latent KV (``kv_lora_rank``) with a decoupled RoPE key shared
    by all heads. NoPE variants: ``qk_rope_head_dim = 0`` (no decoupled part) or ``mla_use_nope``
    (the decoupled query / shared key part is kept but not rotated, as in Kimi-Linear).
    ``mla_output_gate``: a sigmoid gate per head on the attention output (Ling 3)."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.h = h
        self.nope, self.rope, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.theta = cfg.rope_theta
        self.use_nope = cfg.mla_use_nope
        qd = self.nope + self.rope
        eps = cfg.rms_norm_eps if cfg.mla_norm_eps is None else cfg.mla_norm_eps
        if cfg.q_lora_rank:
            self.q_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, eps)
            self.q_b = nn.Linear(cfg.q_lora_rank, h * qd, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * qd, bias=False)
        self.kv_a = nn.Linear(d, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, eps)
        self.kv_b = nn.Linear(self.kv_rank, h * (self.nope + self.vd), bias=False)
        self.g_proj = nn.Linear(d, h, bias=False) if cfg.mla_output_gate else None
        self.o_proj = nn.Linear(h * self.vd, d, bias=False)
        self.scale = qd**-0.5

    def forward(self, x: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
        c, h = x.shape[0], self.h
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b(self.q_norm(self.q_a(x)))
        q = q.view(c, h, self.nope + self.rope)
        kv_a = self.kv_a(x)
        c_kv, k_rope = kv_a[:, : self.kv_rank], kv_a[:, self.kv_rank :]
        kv = self.kv_b(self.kv_norm(c_kv)).view(c, h, self.nope + self.vd)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        if self.rope and not self.use_nope:
            cos, sin = rope_cos_sin(layout.position_ids, self.rope, self.theta, x.dtype)
            q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]
            q_rope = apply_rope(q_rope, cos, sin)
            k_rope = apply_rope(k_rope[:, None, :], cos, sin).expand(c, h, self.rope)
            q = torch.cat([q_nope, q_rope], dim=-1)
            k = torch.cat([k_nope, k_rope], dim=-1)
        elif self.rope:  # NoPE with the shared key part (Kimi-Linear)
            k = torch.cat([k_nope, k_rope[:, None, :].expand(c, h, self.rope)], dim=-1)
        else:
            k = k_nope
        o = layout.attention(q, k, v, scale=self.scale)
        if self.g_proj is not None:  # one sigmoid gate per head
            g = self.g_proj(x)
            o = (
                o
                * torch.sigmoid(g if x.dtype == torch.float64 else g.float()).to(o.dtype)[..., None]
            )
        return self.o_proj(o.reshape(c, h * self.vd))


class GQAMixer(nn.Module):
    """Grouped-query attention as in Qwen3-Next: q/k RMSNorm per head, partial RoPE, sigmoid
    output gate from the query projection."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.hq, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.gated = cfg.attn_output_gate
        self.q_proj = nn.Linear(d, self.hq * self.hd * (2 if self.gated else 1), bias=False)
        self.k_proj = nn.Linear(d, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.hkv * self.hd, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(self.hq * self.hd, d, bias=False)
        rot = int(self.hd * cfg.partial_rotary_factor)
        self.rot = rot - rot % 2
        self.theta = cfg.rope_theta

    def forward(self, x: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
        c = x.shape[0]
        qg = self.q_proj(x).view(c, self.hq, -1)
        q, gate = (qg[..., : self.hd], qg[..., self.hd :]) if self.gated else (qg, None)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(c, self.hkv, self.hd))
        v = self.v_proj(x).view(c, self.hkv, self.hd)
        cos, sin = rope_cos_sin(layout.position_ids, self.rot, self.theta, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = layout.attention(q, k, v, scale=self.hd**-0.5, gate=gate)
        return self.o_proj(o.reshape(c, self.hq * self.hd))


MIXER_CLASSES = {"kda": KDAMixer, "gdn": GDNMixer, "mla": MLAMixer, "gqa": GQAMixer}
__all__ = ["MIXER_CLASSES", "GDNMixer", "GQAMixer", "KDAMixer", "MLAMixer", "ShortConv"]
