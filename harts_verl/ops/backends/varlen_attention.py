"""Tree attention through a varlen flash-attention kernel (``flash_attn_varlen_func`` contract).

Packing. Every segment of the forest is one varlen sequence: its queries are the segment's rows
(``Lq``), its keys the ancestor path followed by its own rows (``Lk = fork_position + Lq``), and
the causal mask is aligned **bottom-right** (query ``t`` sees keys ``0 .. fork_position + t``),
which is flash-attn's convention for ``causal=True`` with ``Lq != Lk`` (flash-attn >= 2.1, and
torch's built-in flash kernel behind ``torch.nn.attention.varlen.varlen_attn``). Segments are
contiguous preorder row ranges, so in preorder the packed queries are the compact rows themselves
(no gather, no scatter); keys/values are gathered once per call (``Σ Lk`` rows). Work is
``Σ_rows (depth + 1)``, never ``C × C`` and no bucket padding.

Kernel contract (:data:`VarlenFn`)::

    fn(q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, D], cu_seqlens_q int32 [N+1],
       cu_seqlens_k int32 [N+1], max_seqlen_q, max_seqlen_k, softmax_scale=..., causal=True
       [, window_size=(left, 0)]) -> o [Tq, Hq, D]

``window_size`` (flash-attn's convention, passed only for sliding-window layers, and only to a
kernel whose ``supports_window`` attribute is true): query ``t`` sees the keys
``fork_position + t - left .. fork_position + t``; a window of ``w`` tokens is ``left = w - 1``.
``softcap`` (flash-attn >= 2.6: scores ``softcap · tanh(s / softcap)``, Gemma 2) is passed only
when set, and only to a kernel whose ``supports_softcap`` attribute is true.

GQA is passed through (``Hq`` a multiple of ``Hkv``). Head dims: flash kernels need equal q/k and
v head dims, a multiple of 8, ``<= 256``: the narrower side is zero-padded (exact: zeros add
nothing to a dot product, padded output columns are dropped) and the scale is computed from the
true ``Dqk``. Flash kernels take fp16/bf16 only; other dtypes are refused here (the ``auto``
backend routes them to the SDPA reference instead).

:func:`sdpa_varlen_reference` implements the same contract with SDPA per sequence on any device:
it is the CPU test double that checks the packing without CUDA.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from harts_verl.ops._index import concat_ranges, segment_ancestors, to_index
from harts_verl.ops._version import release_tuple
from harts_verl.ops.tree_attention import (
    _check_qkv,
    _check_softcap,
    _check_window,
    _finish_heads,
    _pad_head_dim,
    _softcapped_attention,
    check_key_rows,
    same_device,
)

__all__ = [
    "VarlenAttentionPlan",
    "VarlenFn",
    "build_varlen_attention_plan",
    "load_flash_attn_varlen",
    "load_torch_varlen",
    "sdpa_varlen_reference",
    "tree_attention_varlen",
]

FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


class VarlenFn(Protocol):
    """``flash_attn_varlen_func``-style kernel (see the module docstring)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class VarlenAttentionPlan:
    """Packing of a forest's segments into varlen sequences (one per segment).

    Attributes:
      num_rows: C.
      q_index: int64 ``[C]`` rows gathered as packed queries, or None when the packed order is
        the compact order itself (segments in preorder: the usual case).
      out_index: int64 ``[C]`` position of each row in the packed output, or None (identity).
      key_index: int64 ``[Σ Lk]`` rows gathered as packed keys/values: per segment its
        ancestor path (root first) then its own rows.
      cu_seqlens_q, cu_seqlens_k: int32 ``[N + 1]``.
      max_seqlen_q, max_seqlen_k: host ints.
      num_segments: N.
      work: ``Σ_rows (depth + 1)`` attended pairs.
      device: where the index tensors live.
      forest: the forest (kept so a fallback can build the SDPA plan lazily).
      cache: per-plan scratch (e.g. the lazily built SDPA plan of a dtype fallback, the key
        groups of a ``max_key_rows`` bound).
      cu_seqlens_host: int64 numpy copies of ``cu_seqlens_q`` / ``cu_seqlens_k`` (no device
        sync to group the sequences), or None.
    """

    num_rows: int
    q_index: torch.Tensor | None
    out_index: torch.Tensor | None
    key_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    num_segments: int
    work: int
    device: torch.device
    forest: Any = None
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    cu_seqlens_host: tuple[np.ndarray, np.ndarray] | None = field(
        default=None, compare=False, repr=False
    )

    @property
    def num_key_rows(self) -> int:
        """Σ Lk: rows gathered as keys (and as values) by one call without a key bound."""
        return int(self.key_index.shape[0])

    def key_groups(self, max_key_rows: int) -> list[_KeyGroup]:
        """Consecutive packed sequences in groups of at most ``max_key_rows`` key rows each (a
        sequence whose own keys exceed it is a group alone); cached per bound."""
        key = ("key_groups", int(max_key_rows))
        groups = self.cache.get(key)
        if groups is None:
            groups = self.cache[key] = _key_groups(self, int(max_key_rows))
        return groups

    def summary(self) -> dict[str, Any]:
        """Sizes as a JSON-ready dict."""
        return {
            "rows": self.num_rows,
            "segments": self.num_segments,
            "packed_keys": int(self.key_index.shape[0]),
            "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_k": self.max_seqlen_k,
            "work": self.work,
        }


def build_varlen_attention_plan(
    forest: Any, *, device: torch.device | str | None = None
) -> VarlenAttentionPlan:
    """Pack ``forest`` (tree or expanded layout) for :func:`tree_attention_varlen`.

    Deterministic; numpy loops only over segment-tree levels.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    seg = forest.segments
    c = int(forest.num_compact_tokens)
    first = np.asarray(seg.first_row, dtype=np.int64)
    lq = np.asarray(seg.length, dtype=np.int64)
    fork = np.asarray(seg.fork_position, dtype=np.int64)
    lk = fork + lq
    n = first.shape[0]
    anc_off, anc = segment_ancestors(np.asarray(seg.parent_segment, dtype=np.int64))
    if n and not np.array_equal(np.add.reduceat(lq[anc], anc_off[:-1]), lk):
        raise ValueError("forest: ancestor segments do not cover each segment's fork prefix")
    order = np.argsort(first, kind="stable")
    # Keys of segment s, in packed (segment-order) order.
    anc_counts = np.diff(anc_off)
    anc_sorted = anc[concat_ranges(anc_off[:-1][order], anc_counts[order])]
    key_flat = concat_ranges(first[anc_sorted], lq[anc_sorted])
    q_rows = concat_ranges(first[order], lq[order])
    identity = q_rows.shape[0] == c and np.array_equal(q_rows, np.arange(c))
    if q_rows.shape[0] != c:
        raise ValueError(f"forest: segments cover {q_rows.shape[0]} rows, expected {c}")
    out_index = None
    q_index = None
    if not identity:
        inv = np.empty(c, dtype=np.int64)
        inv[q_rows] = np.arange(c, dtype=np.int64)
        q_index = to_index(q_rows, dev)
        out_index = to_index(inv, dev)
    cu_q = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lq[order], out=cu_q[1:])
    cu_k = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lk[order], out=cu_k[1:])
    if cu_k[-1] >= 2**31:
        raise ValueError(f"forest: {int(cu_k[-1])} packed keys exceed int32 cu_seqlens")
    return VarlenAttentionPlan(
        num_rows=c,
        q_index=q_index,
        out_index=out_index,
        key_index=to_index(key_flat, dev),
        cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)).to(dev),
        cu_seqlens_k=torch.from_numpy(cu_k.astype(np.int32)).to(dev),
        max_seqlen_q=int(lq.max(initial=0)),
        max_seqlen_k=int(lk.max(initial=0)),
        num_segments=n,
        work=int((lq * fork + lq * (lq + 1) // 2).sum()),
        device=dev,
        forest=forest,
        cu_seqlens_host=(cu_q, cu_k),
    )


@dataclass(frozen=True)
class _KeyGroup:
    """Packed sequences ``[s0, s1)`` of a :class:`VarlenAttentionPlan`: their queries are
    packed rows ``q0 .. q1 - 1``, their keys ``key_index`` (a slice of the plan's)."""

    q0: int
    q1: int
    key_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    def run(
        self, fn: VarlenFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict
    ) -> torch.Tensor:
        """``fn`` on the group's packed queries ``q`` and gathered keys / values ``k``, ``v``."""
        return fn(
            q,
            k,
            v,
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            self.max_seqlen_q,
            self.max_seqlen_k,
            **kwargs,
        )


def _key_groups(plan: VarlenAttentionPlan, max_key_rows: int) -> list[_KeyGroup]:
    """:meth:`VarlenAttentionPlan.key_groups` (greedy, in packed order; loops over groups)."""
    check_key_rows(max_key_rows)
    if plan.cu_seqlens_host is None:
        cu_q = plan.cu_seqlens_q.cpu().numpy().astype(np.int64)
        cu_k = plan.cu_seqlens_k.cpu().numpy().astype(np.int64)
    else:
        cu_q, cu_k = plan.cu_seqlens_host
    n = cu_q.shape[0] - 1
    groups: list[_KeyGroup] = []
    dev = plan.device
    s0 = 0
    while s0 < n:
        s1 = int(np.searchsorted(cu_k, cu_k[s0] + max_key_rows, side="right")) - 1
        s1 = min(max(s1, s0 + 1), n)
        lq = np.diff(cu_q[s0 : s1 + 1])
        lk = np.diff(cu_k[s0 : s1 + 1])
        groups.append(
            _KeyGroup(
                q0=int(cu_q[s0]),
                q1=int(cu_q[s1]),
                key_index=plan.key_index[int(cu_k[s0]) : int(cu_k[s1])],
                cu_seqlens_q=torch.from_numpy((cu_q[s0 : s1 + 1] - cu_q[s0]).astype(np.int32)).to(
                    dev
                ),
                cu_seqlens_k=torch.from_numpy((cu_k[s0 : s1 + 1] - cu_k[s0]).astype(np.int32)).to(
                    dev
                ),
                max_seqlen_q=int(lq.max()),
                max_seqlen_k=int(lk.max()),
            )
        )
        s0 = s1
    return groups


class _GroupedVarlen(torch.autograd.Function):
    """The varlen kernel over key groups; keeps only the packed queries and the compact keys /
    values for backward, where each group's keys are gathered again and its forward rerun
    (one more kernel forward) to take its gradients. Outputs equal the ungrouped call's (each
    sequence is computed alone either way); key / value gradients are summed over the groups
    in float32 (at least). The rerun replays the forward's autocast state (as
    ``torch.utils.checkpoint`` does), and each group's gathered keys, values and graph are
    released before the next group's are gathered (one group alive at a time)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        qq: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        groups: list[_KeyGroup],
        varlen_fn: VarlenFn,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        outs = [
            g.run(
                varlen_fn,
                qq[g.q0 : g.q1],
                k.index_select(0, g.key_index),
                v.index_select(0, g.key_index),
                kwargs,
            )
            for g in groups
        ]
        ctx.save_for_backward(qq, k, v)
        ctx.groups, ctx.varlen_fn, ctx.kwargs = groups, varlen_fn, kwargs
        ctx.autocast = _autocast_state(qq.device.type)
        return torch.cat(outs, dim=0) if outs else qq.new_zeros((0, qq.shape[1], v.shape[2]))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qq, k, v = ctx.saved_tensors
        dq = torch.zeros_like(qq) if ctx.needs_input_grad[0] else None
        # key / value gradients are sums over groups: accumulated in float32 at least
        acc = torch.promote_types(k.dtype, torch.float32)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device) if ctx.needs_input_grad[1] else None
        dv = torch.zeros(v.shape, dtype=acc, device=v.device) if ctx.needs_input_grad[2] else None
        for g in ctx.groups:
            # one group at a time: its gathered keys / values and graph die with the call
            gq, gk, gv = _group_grads(
                ctx, g, qq, k, v, do, dq is not None, dk is not None, dv is not None
            )
            if gq is not None:
                dq[g.q0 : g.q1] = gq
            if gk is not None:
                dk.index_add_(0, g.key_index, gk.to(acc))
            if gv is not None:
                dv.index_add_(0, g.key_index, gv.to(acc))
            del gq, gk, gv
        dk = None if dk is None else dk.to(k.dtype)
        dv = None if dv is None else dv.to(v.dtype)
        return dq, dk, dv, None, None, None


def _autocast_state(device_type: str) -> dict[str, Any] | None:
    """``torch.autocast`` keywords replaying the current autocast state of ``device_type``
    (None where that device type has no autocast)."""
    try:
        return {
            "device_type": device_type,
            "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type),
            "cache_enabled": torch.is_autocast_cache_enabled(),
        }
    except (RuntimeError, TypeError, AttributeError):  # e.g. "meta"
        return None


def _group_grads(
    ctx: Any,
    g: _KeyGroup,
    qq: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    need_q: bool,
    need_k: bool,
    need_v: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of one key group of :class:`_GroupedVarlen` (its forward rerun under the
    forward's autocast state); None for what is not needed."""
    state = ctx.autocast
    with (
        torch.enable_grad(),
        contextlib.nullcontext() if state is None else torch.autocast(**state),
    ):
        qg = qq[g.q0 : g.q1].detach().requires_grad_(need_q)
        kg = k.detach().index_select(0, g.key_index).requires_grad_(need_k)
        vg = v.detach().index_select(0, g.key_index).requires_grad_(need_v)
        o = g.run(ctx.varlen_fn, qg, kg, vg, ctx.kwargs)
    wrt = [t for t in (qg, kg, vg) if t.requires_grad]
    it = iter(torch.autograd.grad(o, wrt, do[g.q0 : g.q1]) if wrt else ())
    return (
        next(it) if need_q else None,
        next(it) if need_k else None,
        next(it) if need_v else None,
    )


def tree_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: VarlenAttentionPlan,
    *,
    varlen_fn: VarlenFn,
    scale: float | None = None,
    gate: torch.Tensor | None = None,
    require_half: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    max_key_rows: int | None = None,
) -> torch.Tensor:
    """Tree attention with a varlen kernel; same contract as
    :func:`~harts_verl.ops.tree_attention.tree_attention` (q ``[C, Hq, Dqk]``, k ``[C, Hkv,
    Dqk]``, v ``[C, Hkv, Dv]`` → ``[C, Hq, Dv]``, optional sigmoid output ``gate``).

    Args:
      varlen_fn: the kernel (:data:`VarlenFn`): ``flash_attn_varlen_func``, the torch adapter
        from :func:`load_torch_varlen`, or :func:`sdpa_varlen_reference`.
      require_half: refuse dtypes other than fp16/bf16 (flash kernels); False for the SDPA
        test double.
      window: sliding window in tokens (a row sees the ancestors-or-self less than ``window``
        above it), passed as ``window_size=(window - 1, 0)``; None = unlimited.
      softcap: attention logit soft-cap (Gemma 2), passed as ``softcap=``; raises
        ``NotImplementedError`` for a kernel without ``supports_softcap``.
      max_key_rows: when the call would gather more key rows than this (``plan.num_key_rows``,
        Σ Lk), run the sequences in groups of at most this many key rows (a sequence whose
        own path is longer is a group alone) and keep no gathered keys / values for backward:
        each group gathers them again there and reruns its forward (one more kernel forward).
        Same outputs; key / value gradients summed per group. None = one call.
    """
    c = plan.num_rows
    hq, _hkv, dqk, dv = _check_qkv(q, k, v, gate, c)
    if not same_device(q.device, plan.device):
        raise ValueError(f"plan: built for {plan.device}, but q is on {q.device}")
    if require_half and q.dtype not in FLASH_DTYPES:
        raise TypeError(
            f"varlen flash attention supports float16/bfloat16 only, got {q.dtype}; use "
            f"attention_backend='sdpa' (or 'auto', which routes other dtypes to SDPA)"
        )
    window = _check_window(window)
    softcap = _check_softcap(softcap, None)
    if softcap is not None and not getattr(varlen_fn, "supports_softcap", False):
        raise NotImplementedError("varlen attention: this kernel takes no softcap")
    max_key_rows = None if max_key_rows is None else check_key_rows(max_key_rows)
    if scale is None:
        scale = 1.0 / math.sqrt(dqk)
    if c == 0:
        return q.new_zeros((0, hq, dv))
    d = max(dqk, dv)
    d = -(-d // 8) * 8
    if d > MAX_HEAD_DIM:
        raise ValueError(f"varlen flash attention: head dim {d} > {MAX_HEAD_DIM}")
    q, k, v = _pad_head_dim(q, k, v, d)
    qq = q.contiguous() if plan.q_index is None else q.index_select(0, plan.q_index)
    kwargs: dict[str, Any] = {
        "softmax_scale": scale,
        "causal": True,
        **({} if window is None else {"window_size": (int(window) - 1, 0)}),
        **({} if softcap is None else {"softcap": softcap}),
    }
    if max_key_rows is not None and plan.num_key_rows > max_key_rows:
        groups = plan.key_groups(max_key_rows)
        o = _GroupedVarlen.apply(qq, k, v, groups, varlen_fn, kwargs)
        return _finish_heads(o, plan.out_index, dv, gate)
    kk = k.index_select(0, plan.key_index)
    vv = v.index_select(0, plan.key_index)
    o = varlen_fn(
        qq,
        kk,
        vv,
        plan.cu_seqlens_q,
        plan.cu_seqlens_k,
        plan.max_seqlen_q,
        plan.max_seqlen_k,
        **kwargs,
    )
    return _finish_heads(o, plan.out_index, dv, gate)


def sdpa_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """The :data:`VarlenFn` contract implemented with SDPA, one sequence at a time (any device,
    any float dtype). Causal masks and windows are aligned bottom-right, like flash-attn
    (``window_size = (left, right)``, -1 = unlimited); ``softcap`` > 0 soft-caps the scores
    (explicit scores instead of SDPA). Test double only: a Python loop over sequences."""
    left, right = (int(x) for x in window_size)
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cq) != len(ck):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")
    hq, hkv = q.shape[1], k.shape[1]
    rep = hq // hkv
    outs = []
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq > max_seqlen_q or lk > max_seqlen_k:
            raise ValueError(f"sequence {i}: lengths ({lq}, {lk}) exceed the given maxima")
        qi = q[cq[i] : cq[i + 1]].transpose(0, 1)
        ki = k[ck[i] : ck[i + 1]].repeat_interleave(rep, dim=1).transpose(0, 1)
        vi = v[ck[i] : ck[i + 1]].repeat_interleave(rep, dim=1).transpose(0, 1)
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            right = 0
        if right >= 0:
            mask = mask.tril(lk - lq + right)
        if left >= 0:
            mask = mask.triu(lk - lq - left)
        if softcap:
            scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
            oi = _softcapped_attention(
                qi[None], ki[None], vi[None], mask, False, scale, float(softcap)
            )[0]
        else:
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale)
        outs.append(oi.transpose(0, 1))
    if not outs:
        return q.new_zeros((0, hq, v.shape[2]))
    return torch.cat(outs, dim=0)


sdpa_varlen_reference.supports_window = True  # type: ignore[attr-defined]
sdpa_varlen_reference.supports_softcap = True  # type: ignore[attr-defined]


_FLASH_ATTN_MIN = (2, 1)  # causal=True aligned bottom-right from 2.1 on


def load_flash_attn_varlen() -> Callable[..., torch.Tensor]:
    """``flash_attn.flash_attn_varlen_func`` (already the :data:`VarlenFn` contract).

    Raises:
      ImportError: flash-attn is not installed, fails to import, or is older than 2.1 (whose
        ``causal=True`` aligns the mask top-left, not bottom-right as tree segments need; its
        release number is read from ``flash_attn.__version__``); the message says which.
    """
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:
        raise ImportError(
            f"flash-attn unavailable: cannot import flash_attn.flash_attn_varlen_func "
            f"({type(exc).__name__}: {exc}); install flash-attn >= 2.1 built for this torch/CUDA"
        ) from exc
    version = str(getattr(flash_attn, "__version__", ""))
    if release_tuple(version)[:2] < _FLASH_ATTN_MIN:
        raise ImportError(
            f"flash-attn {version or '(no __version__)'} unavailable: before 2.1 its causal mask "
            "is aligned top-left, not bottom-right as segments with ancestor keys need; install "
            "flash-attn >= 2.1"
        )
    params = inspect.signature(flash_attn_varlen_func).parameters

    def fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        return flash_attn_varlen_func(*args, **kwargs)

    fn.supports_window = "window_size" in params  # type: ignore[attr-defined]  # flash-attn >= 2.3
    fn.supports_softcap = "softcap" in params  # type: ignore[attr-defined]  # flash-attn >= 2.6
    return fn


def load_torch_varlen() -> Callable[..., torch.Tensor]:
    """An adapter of ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9, CUDA; torch's
    built-in flash kernel, bottom-right causal) to the :data:`VarlenFn` contract.

    Causal is requested as ``window_size=(-1, 0)`` (newer torch; ``(left, 0)`` with a sliding
    window, ``supports_window`` set) or ``is_causal=True`` (older torch: no windows);
    GQA as ``enable_gqa=True`` where supported, else by repeating k/v heads; without a ``scale``
    keyword (torch 2.9) the scale is folded into q.

    Raises:
      ImportError: this torch has no ``varlen_attn``.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as exc:
        raise ImportError(
            f"torch varlen attention unavailable: cannot import "
            f"torch.nn.attention.varlen.varlen_attn from torch {torch.__version__} "
            f"({type(exc).__name__}: {exc}); needs torch >= 2.9"
        ) from exc
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params and "is_causal" not in params:
        raise ImportError(
            f"torch {torch.__version__}: varlen_attn takes neither window_size nor is_causal"
        )
    has_gqa = "enable_gqa" in params

    def fn(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
    ) -> torch.Tensor:
        kw: dict[str, Any] = {}
        if tuple(window_size) != (-1, -1) and "window_size" not in params:
            raise NotImplementedError(f"torch {torch.__version__}: varlen_attn has no window")
        if "scale" in params:
            kw["scale"] = softmax_scale
        elif softmax_scale is not None:  # oldest API (torch 2.9): fixed 1/sqrt(D); fold into q
            q = q * (softmax_scale * math.sqrt(q.shape[-1]))
        if "window_size" in params:
            left, right = (int(x) for x in window_size)
            kw["window_size"] = (left, 0 if causal else right)
        elif causal:
            kw["is_causal"] = True
        if k.shape[1] != q.shape[1]:
            if has_gqa:
                kw["enable_gqa"] = True
            else:
                rep = q.shape[1] // k.shape[1]
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
        return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw)

    fn.supports_window = "window_size" in params  # type: ignore[attr-defined]
    return fn
