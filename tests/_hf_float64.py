"""Lift the float32 islands of HF's Qwen3-Next / Qwen3.5 / Qwen3.5-MoE to float64.

HF computes these models' RMSNorms, gated norm and router softmax in float32 even in a float64
model, so their gradients carry float32 rounding whatever the batching. To test the tree
machinery at float64 precision these islands compute in the input dtype (same formulas); the
unmodified models are tested against HF's own forward separately.
"""

from __future__ import annotations

import importlib

import torch

_MODULES = {
    "transformers.models.qwen3_next.modeling_qwen3_next": "Qwen3Next",
    "transformers.models.qwen3_5.modeling_qwen3_5": "Qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": "Qwen3_5Moe",
}


def _rms(self, x):
    h = x if x.dtype == torch.float64 else x.float()
    return (self._norm(h) * (1.0 + self.weight.to(h.dtype))).type_as(x)


def _rms_gated(self, hidden_states, gate=None):
    dt = hidden_states.dtype
    h = hidden_states if dt == torch.float64 else hidden_states.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    h = (self.weight * h.to(dt)) * torch.nn.functional.silu(gate.to(h.dtype))
    return h.to(dt)


def _router(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(x, self.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Qwen3.5-MoE always normalizes
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), idx


def lift_float32_islands(monkeypatch) -> None:
    """Patch (through pytest's ``monkeypatch``) every hybrid family's norms and router."""
    for name, prefix in _MODULES.items():
        m = importlib.import_module(name)
        monkeypatch.setattr(getattr(m, f"{prefix}RMSNorm"), "forward", _rms)
        monkeypatch.setattr(getattr(m, f"{prefix}RMSNormGated"), "forward", _rms_gated)
        router = getattr(m, f"{prefix}TopKRouter", None)
        if router is not None:
            monkeypatch.setattr(router, "forward", _router)
