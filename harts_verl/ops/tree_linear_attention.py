"""Chunkwise linear attention (KDA / GatedDeltaNet) over a forest's planned rounds.

The :class:`~harts_verl.tree.LinearCallPlan` splits the compact rows into members of packed varlen
calls. Rounds run in order; each is ONE packed kernel call over its members (replay rows first)
with per-member initial states taken from boundary states kept by earlier rounds. Every member
starts on an absolute chunk boundary, so each trajectory sees exactly the chunk partition of a
trajectory-wise run (invariant 5). State handoffs are ordinary tensors in the autograd graph, so
gradients flow from a branch back into its ancestors. Projections are never repeated: replay
gathers the already computed q/k/v/g/beta rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harts_verl.ops.linear_attention import chunk_delta_rule_varlen
from harts_verl.tree import RolloutForest
from harts_verl.tree.linear_plan import LinearCallPlan, plan_linear_calls


@dataclass(frozen=True)
class _RoundTensors:
    token_rows: torch.Tensor  # [T] rows gathered for the call (replay then own rows per member)
    out_pos: torch.Tensor  # [T_out] positions in the call whose output is kept
    cu_seqlens: torch.Tensor  # [N + 1]
    cu_seqlens_cpu: torch.Tensor  # [N + 1] the same on the host (kernels read it without a sync)
    initial_slot: torch.Tensor  # [N] state slot or -1 (zeros)
    has_initial: bool
    save_src: torch.Tensor  # [M] into cat(chunk_states, final_state)
    num_chunk_states: int  # chunk_offsets[-1] of the call
    needs_chunk_states: bool


@dataclass(frozen=True)
class LinearLayout:
    """Torch-side index tensors of a :class:`LinearCallPlan` (built once per microbatch)."""

    plan: LinearCallPlan
    chunk_size: int
    rounds: tuple[_RoundTensors, ...]
    inverse_rows: torch.Tensor  # [C]: position of each row in the concatenated round outputs

    @property
    def num_rounds(self) -> int:
        """The packed calls a layer runs: the plan's rounds, or more where a kernel that
        returns final states only runs the plan split at its saved boundaries."""
        return len(self.rounds)


def build_linear_layout(
    forest: RolloutForest,
    *,
    chunk_size: int = 64,
    device: torch.device | str | None = None,
    final_states_only: bool = False,
) -> LinearLayout:
    """Plan the rounds of ``forest`` and move their index arrays to ``device``.

    ``final_states_only``: cut members at kept boundaries so every kept state is a member's
    final state (for kernels without exact chunk-start states, e.g. fla; see
    :func:`harts_verl.ops.backends.plan_split.split_members_at_saved_boundaries`).
    """
    plan = plan_linear_calls(forest, chunk_size=chunk_size)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    rounds = []
    out_rows = []
    # --- backend threading (issue 9): optionally split members at kept boundaries ---
    arrays = plan.arrays
    if final_states_only:
        from harts_verl.ops.backends.plan_split import split_members_at_saved_boundaries

        arrays = split_members_at_saved_boundaries(arrays)
    # --- end backend threading ---
    for ra in arrays.rounds:
        out_pos = ra.output_mask.nonzero()[0]
        out_rows.append(ra.token_rows[out_pos])
        rounds.append(
            _RoundTensors(
                token_rows=torch.as_tensor(ra.token_rows, device=dev),
                out_pos=torch.as_tensor(out_pos, device=dev),
                cu_seqlens=torch.as_tensor(ra.cu_seqlens, device=dev),
                cu_seqlens_cpu=torch.as_tensor(ra.cu_seqlens),
                initial_slot=torch.as_tensor(ra.initial_slot, device=dev),
                has_initial=bool((ra.initial_slot >= 0).any()),
                save_src=torch.as_tensor(ra.save_src, device=dev),
                num_chunk_states=int(ra.chunk_offsets[-1]),
                needs_chunk_states=bool(ra.needs_chunk_states),
            )
        )
    c = forest.num_compact_tokens
    inverse = torch.empty(c, dtype=torch.int64)
    if out_rows:
        import numpy as np

        rows = np.concatenate(out_rows)
        if rows.shape[0] != c:
            raise AssertionError(f"linear plan outputs {rows.shape[0]} rows, forest has {c}")
        inverse[torch.as_tensor(rows)] = torch.arange(c, dtype=torch.int64)
    return LinearLayout(plan, chunk_size, tuple(rounds), inverse.to(dev))


def tree_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layout: LinearLayout,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    use_beta_sigmoid: bool = False,
    kernel: Callable[..., Any] | None = None,
    delta_rule: bool = True,
) -> torch.Tensor:
    """Gated delta rule over all compact rows: q, k ``[C, H, K]``, v ``[C, HV, V]``, g
    ``[C, HV, K]`` (KDA) or ``[C, HV]`` (GDN), beta ``[C, HV]`` → o ``[C, HV, V]``.

    Equal to running every trajectory alone through :func:`chunk_delta_rule_varlen` with the
    same ``chunk_size``, for every row, for finite inputs (a non-finite value spoils the
    kernel chunk it lies in, which can hold rows that other trajectories share); differentiable
    w.r.t. all inputs, including through the boundary-state handoffs.

    ``kernel``: a callable with the signature of :func:`chunk_delta_rule_varlen` (default: it),
    e.g. from :func:`harts_verl.ops.backends.linear_kernel`. A kernel without chunk-start states
    needs a layout built with ``final_states_only=True``; one whose ``takes_cu_seqlens_cpu``
    attribute is true also gets ``cu_seqlens_cpu``, the offsets on the host (no device sync to
    read them).

    ``delta_rule=False``: gated linear attention without the delta correction (Mamba-2 SSD for
    a scalar ``g``), passed to the kernel as ``delta_rule=False`` (the keyword is left out
    otherwise, so delta-rule-only kernels keep working).
    """
    run = chunk_delta_rule_varlen if kernel is None else kernel
    c = layout.inverse_rows.shape[0]
    dims = {"q": 3, "k": 3, "v": 3, "beta": 2}  # g: [C, H] (scalar gate) or [C, H, K]
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.shape[0] != c:
            raise ValueError(f"{name}: expected {c} rows in dim 0, got {x.shape[0]}")
        want = dims.get(name)
        if (want is not None and x.dim() != want) or (name == "g" and x.dim() not in (2, 3)):
            form = {"q": "[C, H, K]", "k": "[C, H, K]", "v": "[C, H, V]", "beta": "[C, H]"}
            raise ValueError(
                f"{name}: expected {form.get(name, '[C, H] or [C, H, K]')}, got shape "
                f"{tuple(x.shape)}"
            )
    extra: dict[str, Any] = {} if delta_rule else {"delta_rule": False}
    host_offsets = bool(getattr(run, "takes_cu_seqlens_cpu", False))
    saved: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    for rt in layout.rounds:
        idx = rt.token_rows
        init = None
        if rt.has_initial:
            pool = torch.cat(saved, dim=0)
            slot = rt.initial_slot
            init = pool.index_select(0, slot.clamp(min=0))
            init = torch.where((slot >= 0)[:, None, None, None], init, torch.zeros_like(init))
        res = run(
            q.index_select(0, idx),
            k.index_select(0, idx),
            v.index_select(0, idx),
            g.index_select(0, idx),
            beta.index_select(0, idx),
            cu_seqlens=rt.cu_seqlens,
            **({"cu_seqlens_cpu": rt.cu_seqlens_cpu} if host_offsets else {}),
            initial_state=init,
            scale=scale,
            chunk_size=layout.chunk_size,
            use_qk_l2norm=use_qk_l2norm,
            use_beta_sigmoid=use_beta_sigmoid,
            output_chunk_states=rt.needs_chunk_states,
            **extra,
        )
        outs.append(res.o.index_select(0, rt.out_pos))
        if rt.save_src.numel():
            if rt.needs_chunk_states:
                src = torch.cat([res.chunk_states.states, res.final_state], dim=0)
                saved.append(src.index_select(0, rt.save_src))
            else:
                saved.append(res.final_state.index_select(0, rt.save_src - rt.num_chunk_states))
    if not outs:
        return v.new_zeros((0, *v.shape[1:]))
    return torch.cat(outs, dim=0).index_select(0, layout.inverse_rows)
