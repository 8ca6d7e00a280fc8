"""Shared by the fast-kernel tests (``tests/gpu``, ``tests/fla_cpu``): fla's error ratio,
model-like delta-rule inputs, per-trajectory row gathering."""

from __future__ import annotations

import numpy as np
import torch

from harts_verl.ops.linear_attention import gdn_gate, kda_gate
from harts_verl.tree import RolloutForest


def err_ratio(x: torch.Tensor, ref: torch.Tensor) -> float:
    """fla's ``get_err_ratio``: rmse of the difference over rmse of the reference."""
    x, ref = x.detach().double().flatten(), ref.detach().double().flatten()
    return float((x - ref).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-12))


def delta_rule_inputs(
    t: int, kda: bool, *, h: int, hv: int, d: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Model-like float32 CPU inputs ``(q, k [t, h, d], v [t, hv, d], g, beta_logits [t, hv])``:
    raw q/k, gates from the model's gate functions (KDA ``[t, hv, d]``, GDN ``[t, hv]``),
    beta before its sigmoid. Deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, h, d, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, d, generator=gen)
    a_log = torch.log(torch.empty(hv).uniform_(1, 16, generator=gen))
    if kda:
        dt = torch.empty(hv * d).uniform_(-4, -2, generator=gen)
        g = kda_gate(torch.randn(t, hv, d, generator=gen), a_log, dt)
    else:
        g = gdn_gate(torch.randn(t, hv, generator=gen), a_log, torch.ones(hv))
    return q, k, v, g, torch.randn(t, hv, generator=gen)


def per_trajectory(forest: RolloutForest, x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (one per compact row of ``forest``) in semantic order: every trajectory's
    rows, trajectory after trajectory."""
    rows = np.concatenate([forest.rows_of(i) for i in range(forest.num_trajectories)])
    return x[torch.as_tensor(rows, device=x.device)]
