"""Tree attention: causal softmax attention over a rollout forest, in torch (CPU and CUDA).

In tree mode every compact row (DFS preorder, see :class:`~harts_verl.tree.forest.RolloutForest`)
attends to its ancestors and itself — exactly the keys it sees in every trajectory through it, so
the output of a row equals the output of each of its semantic positions in trajectory-wise causal
attention (position id = depth, invariant 2).

Algorithm. A *segment* (maximal single-child chain, a contiguous preorder row range) is one
attention problem: queries = its ``Lq`` rows, keys = its root-to-parent ancestor path (depths
``0..fork_position-1``; since a fork row ends its segment, that path is the concatenation of the
full row ranges of the ancestor segments) followed by its own rows, ``Lk = fork_position + Lq``,
causal mask aligned bottom-right (query ``t`` sees keys ``0..fork_position + t``). Work is
``Σ_rows (depth + 1)`` up to the causal-rectangle factor, never ``C × C``.

Segments are batched into *buckets* of similar ``(Lq, Lk)``, padded to the bucket maxima, with
one ``scaled_dot_product_attention`` call per bucket (chunked by an element budget). The
bucketing rule: with ``r = sqrt(1 + max_pad_ratio)``, ``Lq`` and ``Lk`` are each binned
geometrically (bin ``ceil(log_r L)``), so within a bucket ``Lq_max < r·Lq`` and ``Lk_max < r·Lk``
for every member, hence ``padded area (nb·Lq_max·Lk_max) ≤ (1 + max_pad_ratio) · Σ Lq·Lk``.
Root segments (``Lq == Lk``) are only grouped with roots of the same length: such buckets are
unpadded and run with ``is_causal`` (kernels skip the upper triangle); a bucket of identical
non-root shapes uses one shared bottom-right causal ``[Lq, Lk]`` mask, other buckets a
``[nb, 1, Lq, Lk]`` boolean mask (SDPA turns it into an additive mask of q's dtype, which
autograd keeps until backward: one element per padded score of such buckets, no heads).
Index tensors are built once per microbatch with numpy (loops over segment-tree levels and
buckets only); masks are created per call from two small per-segment length vectors.

Padding is exact: padded key slots are masked out (probability exactly 0, zero gradient);
padded query slots see all valid keys (never a fully masked row, so no NaN) and their outputs are
dropped, so they receive zero gradient. When ``Dv != Dqk`` (MLA: 192 vs 128) the narrower side is
zero-padded once on the compact tensors (adds exact zeros to every dot product), because the
fused CPU/CUDA SDPA kernels need equal head dims.

Attention sinks (gpt-oss: a learned logit ``sinks[h]`` per query head that joins every row's
softmax and carries no value, ``softmax([scores..., sinks[h]])`` with the sink column dropped)
run through the same SDPA calls with the sink as one more key: its key is a unit vector on one
extra head-dim coordinate (zero on every real key), where each query carries ``sinks[h] / scale``,
and its value is zero. Every bucket member gets the sink key at key slot 0 (always allowed, so no
row is ever fully masked); an ``is_causal`` root bucket also gets a zero query at query slot 0,
so it stays square and causal. The sink's score is ``sinks[h]`` up to a rounding of
``(sinks[h] / scale) · scale`` (a few ulps), and its gradient flows to ``sinks`` through that
coordinate. The sink-free path is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from harts_verl.ops._dtypes import compute_dtype
from harts_verl.ops._index import concat_ranges, segment_ancestors, to_index
from harts_verl.ops._version import release_tuple
from harts_verl.tree._checks import check_positive, is_int
from harts_verl.tree.forest import attention_key_rows  # re-exported: the plans' key rows

__all__ = [
    "AttentionBucket",
    "TreeAttentionPlan",
    "attention_key_rows",
    "build_attention_plan",
    "tree_attention",
    "tree_attention_dense_ref",
]

_HAS_ENABLE_GQA = release_tuple(torch.__version__)[:2] >= (2, 5)
_DEFAULT_MAX_BUCKET_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class AttentionBucket:
    """One padded batch of segments run by a single SDPA call.

    Attributes:
      q_index: int64 ``[nb * lq]`` compact rows gathered as queries (padded slots repeat the
        segment's last row).
      k_index: int64 ``[nb * lk]`` compact rows gathered as keys (padded slots repeat the last
        key).
      q_len, k_len: int64 ``[nb]`` true ``Lq``/``Lk`` of each member segment.
      nb, lq, lk: number of segments and padded lengths.
      uniform: all members have exactly ``(lq, lk)`` (no padding; mask is the shared
        bottom-right causal ``[lq, lk]``, or ``is_causal`` when ``lq == lk``).
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    q_len: torch.Tensor
    k_len: torch.Tensor
    nb: int
    lq: int
    lk: int
    uniform: bool


@dataclass(frozen=True)
class TreeAttentionPlan:
    """Precomputed gather/scatter indices for :func:`tree_attention` on one forest.

    Attributes:
      num_rows: C, the number of compact rows the plan expects.
      buckets: the SDPA batches, in execution order.
      out_index: int64 ``[C]``; row ``r``'s output is row ``out_index[r]`` of the concatenated
        flattened bucket outputs (``Σ nb·lq`` slots).
      num_segments: number of segments.
      work: ``Σ_rows (depth + 1)`` — attended (query, key) pairs, the ideal cost.
      rect_work: ``Σ_segments Lq·Lk`` — the unpadded rectangles the kernels see.
      padded_work: ``Σ_buckets nb·lq·lk`` — what is actually computed.
      max_pad_ratio: the bucketing parameter the plan was built with.
      device: where the index tensors live.
    """

    num_rows: int
    buckets: tuple[AttentionBucket, ...]
    out_index: torch.Tensor
    num_segments: int
    work: int
    rect_work: int
    padded_work: int
    max_pad_ratio: float
    device: torch.device

    @property
    def num_key_rows(self) -> int:
        """``Σ_buckets nb·lk``: rows gathered as keys (and as values), padding included."""
        return sum(b.nb * b.lk for b in self.buckets)

    @property
    def padding_ratio(self) -> float:
        """``padded_work / rect_work - 1`` (≤ ``max_pad_ratio`` by construction)."""
        return self.padded_work / self.rect_work - 1.0 if self.rect_work else 0.0

    def summary(self) -> dict[str, Any]:
        """Sizes as a JSON-ready dict."""
        return {
            "rows": self.num_rows,
            "segments": self.num_segments,
            "buckets": len(self.buckets),
            "work": self.work,
            "rect_work": self.rect_work,
            "padded_work": self.padded_work,
            "padding_ratio": round(self.padding_ratio, 4),
        }


def _bins(lengths: np.ndarray, max_pad_ratio: float) -> np.ndarray:
    """Geometric bin of each length (ratio ``sqrt(1 + max_pad_ratio)``); see module doc."""
    if math.isinf(max_pad_ratio):
        return np.zeros_like(lengths)
    if max_pad_ratio == 0.0:
        return lengths.copy()
    log_r = 0.5 * math.log1p(max_pad_ratio)
    return np.ceil(np.log(lengths.astype(np.float64)) / log_r - 1e-9).astype(np.int64)


def build_attention_plan(
    forest: Any,
    *,
    device: torch.device | str | None = None,
    max_pad_ratio: float = 0.25,
    max_bucket_elements: int = _DEFAULT_MAX_BUCKET_ELEMENTS,
) -> TreeAttentionPlan:
    """Plan tree attention for ``forest`` (a :class:`RolloutForest`, tree or expanded layout).

    Args:
      forest: provides ``segments`` (``first_row``, ``length``, ``parent_segment``,
        ``fork_position``), ``depth`` and ``num_compact_tokens``.
      device: device of the index tensors (must match the q/k/v passed later).
      max_pad_ratio: bound on padding waste per bucket, ``padded ≤ (1 + max_pad_ratio) ·
        Σ Lq·Lk``; ``0`` groups only identical shapes, ``inf`` puts all non-root segments in
        one bucket (roots are always grouped by exact length).
      max_bucket_elements: a bucket whose ``nb·lq·lk`` exceeds this is split into chunks of
        consecutive members (a single segment is never split); bounds the per-call mask memory.

    Deterministic in its inputs (invariant 9).
    """
    if not (
        isinstance(max_pad_ratio, int | float)
        and not isinstance(max_pad_ratio, bool)
        and max_pad_ratio >= 0
    ):
        raise ValueError(f"max_pad_ratio: expected a number >= 0, got {max_pad_ratio!r}")
    try:
        pad_ratio = float(max_pad_ratio)
    except OverflowError:  # an int past float's range pads without bound, as inf does
        pad_ratio = float("inf")
    if not (isinstance(max_bucket_elements, int) and max_bucket_elements >= 1):
        raise ValueError(f"max_bucket_elements: expected an int >= 1, got {max_bucket_elements!r}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    seg = forest.segments
    c = int(forest.num_compact_tokens)
    first = np.asarray(seg.first_row, dtype=np.int64)
    lq = np.asarray(seg.length, dtype=np.int64)
    fork = np.asarray(seg.fork_position, dtype=np.int64)
    lk = fork + lq
    n = first.shape[0]

    # Keys of segment s: full row ranges of its ancestor segments (root first), then its own.
    anc_off, anc = segment_ancestors(np.asarray(seg.parent_segment, dtype=np.int64))
    key_flat = concat_ranges(first[anc], lq[anc])
    key_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lk, out=key_off[1:])
    if n and not np.array_equal(np.add.reduceat(lq[anc], anc_off[:-1]), lk):
        raise ValueError("forest: ancestor segments do not cover each segment's fork prefix")

    # Root segments (Lq == Lk) are grouped by exact length only: unpadded, they run with
    # is_causal, which lets the kernels skip the upper triangle (half the rectangle).
    root = fork == 0
    bq = np.where(root, lq, _bins(lq, pad_ratio))
    bk = np.where(root, lk, _bins(lk, pad_ratio))
    order = np.lexsort((np.arange(n), bk, bq, root))
    if n:
        key = np.stack([root[order], bq[order], bk[order]], axis=1)
        new = np.ones(n, dtype=bool)
        new[1:] = np.any(key[1:] != key[:-1], axis=1)
        starts = [*np.flatnonzero(new).tolist(), n]
    else:
        starts = [0]

    buckets: list[AttentionBucket] = []
    out_index = np.empty(c, dtype=np.int64)
    base = 0
    padded_work = 0
    for g0, g1 in pairwise(starts):
        group = order[g0:g1]
        per = max(1, max_bucket_elements // int(lq[group].max() * lk[group].max()))
        for c0 in range(0, group.shape[0], per):
            segs = group[c0 : c0 + per]
            nb = int(segs.shape[0])
            sq, sk = lq[segs], lk[segs]
            mq, mk = int(sq.max()), int(sk.max())
            q_idx = first[segs, None] + np.minimum(np.arange(mq)[None, :], sq[:, None] - 1)
            k_pos = key_off[segs, None] + np.minimum(np.arange(mk)[None, :], sk[:, None] - 1)
            rows = concat_ranges(first[segs], sq)
            out_index[rows] = base + concat_ranges(np.arange(nb, dtype=np.int64) * mq, sq)
            buckets.append(
                AttentionBucket(
                    q_index=to_index(q_idx.reshape(-1), dev),
                    k_index=to_index(key_flat[k_pos].reshape(-1), dev),
                    q_len=to_index(sq, dev),
                    k_len=to_index(sk, dev),
                    nb=nb,
                    lq=mq,
                    lk=mk,
                    uniform=bool((sq == mq).all() and (sk == mk).all()),
                )
            )
            base += nb * mq
            padded_work += nb * mq * mk
    work = int((lq * fork + lq * (lq + 1) // 2).sum())
    return TreeAttentionPlan(
        num_rows=c,
        buckets=tuple(buckets),
        out_index=to_index(out_index, dev),
        num_segments=n,
        work=work,
        rect_work=int((lq * lk).sum()),
        padded_work=padded_work,
        max_pad_ratio=pad_ratio,
        device=dev,
    )


def _check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, c: int
) -> tuple[int, int, int, int]:
    """Validate shapes; return ``(Hq, Hkv, Dqk, Dv)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a [C, H, D] tensor, got {shape}")
        if t.shape[0] != c:
            raise ValueError(f"{name}: expected {c} rows (the plan's C), got {t.shape[0]}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    hq, dqk = q.shape[1], q.shape[2]
    hkv, dv = v.shape[1], v.shape[2]
    if k.shape[1] != hkv:
        raise ValueError(f"k: expected {hkv} heads like v, got {k.shape[1]}")
    if k.shape[2] != dqk:
        raise ValueError(f"k: expected head dim {dqk} like q, got {k.shape[2]}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q: {hq} query heads is not a multiple of {hkv} key/value heads")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: dtypes {k.dtype}, {v.dtype} differ from q's {q.dtype}")
    if gate is not None and tuple(gate.shape) != (c, hq, dv):
        raise ValueError(f"gate: expected shape {(c, hq, dv)}, got {tuple(gate.shape)}")
    return hq, hkv, dqk, dv


# --- issue 9 (GPU backends): "cuda" and "cuda:0" name the same device ---
def _pad_head_dim(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v zero-padded on the head dim to ``d`` (>= both head dims; one kernel call for
    MLA's unequal q/k and v dims). Padding q/k adds 0 to every score."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk < d:
        q = F.pad(q, (0, d - dqk))
        k = F.pad(k, (0, d - dqk))
    if dv < d:
        v = F.pad(v, (0, d - dv))
    return q, k, v


def _finish_heads(
    o: torch.Tensor, out_index: torch.Tensor | None, dv: int, gate: torch.Tensor | None
) -> torch.Tensor:
    """Kernel output ``o`` back to compact rows (``out_index``, None = already in order), the
    value head dim ``dv`` (drops :func:`_pad_head_dim`'s padding) and the sigmoid output gate."""
    if out_index is not None:
        o = o.index_select(0, out_index)
    if o.shape[-1] > dv:
        o = o[..., :dv]
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return o


def check_key_rows(value: Any, name: str = "max_key_rows") -> int:
    """``value`` as a positive int (ValueError naming ``name`` otherwise; bools refused)."""
    if isinstance(value, bool) or not is_int(value) or int(value) < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Same device type and, where both name one, the same index (``cuda`` == ``cuda:0`` when
    the current device is 0; torch's ``==`` says they differ)."""
    if a.type != b.type:
        return False
    if a.index == b.index:
        return True
    cur = torch.cuda.current_device() if a.type == "cuda" else 0
    ia = cur if a.index is None else a.index
    ib = cur if b.index is None else b.index
    return ia == ib


# --- end issue 9 ---


def _bucket_mask(
    b: AttentionBucket, device: torch.device, window: int | None = None
) -> tuple[torch.Tensor | None, bool]:
    """``(attn_mask, is_causal)`` for one bucket: True = attend.

    Member ``s``, query slot ``i``, key slot ``j``: ``j < Lk_s and j <= i + Lk_s - Lq_s`` (key
    slot = depth: a member's keys are its whole root path), and with a sliding ``window`` also
    ``j > i + Lk_s - Lq_s - window`` for valid query slots. Padded query slots (``i >= Lq_s``)
    see every valid key (never fully masked, so no NaN; their outputs are dropped).
    """
    if window is None and b.uniform:
        if b.lq == b.lk:
            return None, True
        return torch.ones(b.lq, b.lk, dtype=torch.bool, device=device).tril(b.lk - b.lq), False
    qpos = torch.arange(b.lq, device=device).view(1, b.lq, 1)
    kpos = torch.arange(b.lk, device=device).view(1, 1, b.lk)
    if b.uniform:
        k_len, q_len = b.lk, b.lq
    else:
        k_len, q_len = b.k_len.view(-1, 1, 1), b.q_len.view(-1, 1, 1)
    shift = k_len - q_len
    mask = (kpos < k_len) & (kpos <= qpos + shift)
    if window is not None:
        mask = mask & ((kpos > qpos + shift - window) | (qpos >= q_len))
    return mask.unsqueeze(1), False


def _key_row_chunks(
    b: AttentionBucket, max_key_rows: int, extra_keys: int
) -> list[AttentionBucket]:
    """``b`` as consecutive member chunks that each gather at most ``max_key_rows`` key rows
    (``lk + extra_keys`` per member; a member whose own keys exceed the bound is a chunk
    alone). Their outputs, concatenated in order, are ``b``'s (members are independent)."""
    per = max(1, max_key_rows // (b.lk + extra_keys))
    if per >= b.nb:
        return [b]
    chunks = []
    for m0 in range(0, b.nb, per):
        m1 = min(b.nb, m0 + per)
        chunks.append(
            replace(
                b,
                q_index=b.q_index[m0 * b.lq : m1 * b.lq],
                k_index=b.k_index[m0 * b.lk : m1 * b.lk],
                q_len=b.q_len[m0:m1],
                k_len=b.k_len[m0:m1],
                nb=m1 - m0,
            )
        )
    return chunks


def _gqa(
    k: torch.Tensor, v: torch.Tensor, hq: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, bool]]:
    """k, v (``[C, Hkv, D]``) and the SDPA keywords for ``hq`` query heads: ``enable_gqa`` when
    ``Hkv < hq`` (torch >= 2.5), else k / v repeated per query head."""
    hkv = k.shape[1]
    if hkv == hq:
        return k, v, {}
    if not _HAS_ENABLE_GQA:  # pragma: no cover - torch < 2.5
        return k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1), {}
    return k, v, {"enable_gqa": True}


def _check_sinks(sinks: torch.Tensor | None, hq: int, device: torch.device) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (hq,):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks: expected a [{hq}] tensor (one per query head), got {shape}")
    if not sinks.is_floating_point():
        raise ValueError(f"sinks: expected a floating-point tensor, got {sinks.dtype}")
    if not same_device(sinks.device, device):
        raise ValueError(f"sinks: on {sinks.device}, but q is on {device}")


def _with_sink_key(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (``[C, H, D]``) on one head dim ``ds > max(Dqk, Dv)`` (a multiple of 8 on CUDA,
    for the fused kernels) with one more row ``C``: the sink key (a unit vector on coordinate
    ``d = max(Dqk, Dv)``), its zero value, and a zero query. Query rows carry
    ``sinks[h] / scale`` on coordinate ``d`` (real keys are zero there), so a query's score
    against the sink key is ``sinks[h]``."""
    c, hq, dqk = q.shape
    hkv, dv = v.shape[1], v.shape[2]
    d = max(dqk, dv)
    align = 8 if q.device.type == "cuda" else 1
    ds = -(-(d + 1) // align) * align
    ct = torch.promote_types(torch.promote_types(sinks.dtype, q.dtype), torch.float32)
    col = (sinks.to(ct) / scale).to(q.dtype).view(1, hq, 1).expand(c, hq, 1)
    qs = torch.cat([F.pad(q, (0, d - dqk)), col, q.new_zeros(c, hq, ds - d - 1)], dim=-1)
    qs = F.pad(qs, (0, 0, 0, 0, 0, 1))
    sink_key = k.new_zeros(1, hkv, ds)
    sink_key[..., d] = 1.0
    ks = torch.cat([F.pad(k, (0, ds - dqk)), sink_key], dim=0)
    vs = F.pad(v, (0, ds - dv, 0, 0, 0, 1))
    return qs, ks, vs


def _check_softcap(softcap: float | None, sinks: torch.Tensor | None) -> float | None:
    """``softcap`` as a float (None stays None): a finite positive number, not combined with
    attention sinks (no model has both; the sink's logit would be capped too)."""
    softcap = check_positive("softcap", softcap, none_ok=True)
    if softcap is not None and sinks is not None:
        raise NotImplementedError("softcap: attention logit soft-capping with attention sinks")
    return softcap


class _SoftcapAttention(torch.autograd.Function):
    """``softmax(mask(cap · tanh(q kᵀ · scale / cap))) v`` for q / k / v ``[nb, H, L, D]`` (same
    heads) and a boolean ``mask`` broadcastable to ``[nb, H, Lq, Lk]``. Scores and softmax in
    float32 (float64 for float64 inputs); saves only the probabilities and the tanh (two score-
    sized tensors, where autograd through the explicit ops keeps about five); the backward is
    the chain rule written out (``dz/ds = scale · (1 − tanh²)``)."""

    @staticmethod
    def forward(ctx: Any, q, k, v, mask, scale: float, cap: float):  # type: ignore[override]
        cdt = compute_dtype(q.dtype)
        t = torch.matmul(q, k.transpose(-1, -2)).to(cdt)
        t.mul_(scale / cap).tanh_()
        z = torch.mul(t, cap)
        z.masked_fill_(~mask, float("-inf"))
        p = torch.softmax(z, dim=-1)
        del z
        o = torch.matmul(p.to(q.dtype), v)
        ctx.save_for_backward(q, k, v, p, t)
        ctx.scale = scale
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do):  # type: ignore[override]
        q, k, v, p, t = ctx.saved_tensors
        dtype = q.dtype
        dv = torch.matmul(p.to(dtype).transpose(-1, -2), do)
        dp = torch.matmul(do, v.transpose(-1, -2)).to(p.dtype)
        # softmax: dz = p · (dp − Σ p·dp); masked keys have p = 0, so dz = 0 there
        dz = dp.sub_(torch.linalg.vecdot(p, dp)[..., None]).mul_(p)
        # t is saved: out of place, so a retained graph can run backward again
        ds = dz.mul_(t.square().neg_().add_(1.0)).mul_(ctx.scale).to(dtype)
        dq = torch.matmul(ds, k)
        dk = torch.matmul(ds.transpose(-1, -2), q)
        return dq, dk, dv, None, None, None


def _softcapped_attention(
    qb: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """One bucket of attention with soft-capped logits, ``softmax(cap · tanh(q kᵀ · scale / cap))
    v`` under ``mask`` (or bottom-right ``causal``), as HF's eager attention of Gemma 2 computes
    it (softmax in float32 for half/bfloat16; :class:`_SoftcapAttention`). q ``[nb, Hq, Lq, D]``,
    k / v ``[nb, Hkv, Lk, D]`` (Hkv dividing Hq) → ``[nb, Hq, Lq, D]``; no SDPA kernel takes a
    soft-cap."""
    rep = qb.shape[1] // kb.shape[1]
    if rep > 1:
        kb, vb = kb.repeat_interleave(rep, dim=1), vb.repeat_interleave(rep, dim=1)
    lq, lk = qb.shape[2], kb.shape[2]
    if causal or mask is None:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=qb.device)
        mask = mask.tril(lk - lq) if causal else mask
    return _SoftcapAttention.apply(qb, kb, vb, mask, float(scale), float(softcap))


def _check_window(window: int | None) -> int | None:
    if window is None:
        return None
    if not is_int(window) or window < 1:
        raise ValueError(f"window: expected a positive int or None, got {window!r}")
    return int(window)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: TreeAttentionPlan,
    *,
    scale: float | None = None,
    gate: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    max_key_rows: int | None = None,
) -> torch.Tensor:
    """Causal softmax attention where each compact row attends to its ancestors and itself.

    Args:
      q: ``[C, Hq, Dqk]`` queries in compact (preorder) row order.
      k: ``[C, Hkv, Dqk]`` keys; ``Hq`` must be a multiple of ``Hkv`` (GQA: query head ``h``
        uses key/value head ``h // (Hq // Hkv)``).
      v: ``[C, Hkv, Dv]`` values; ``Dv`` may differ from ``Dqk`` (MLA).
      plan: from :func:`build_attention_plan` on the same forest, on q's device.
      scale: softmax scale, default ``1 / sqrt(Dqk)``.
      gate: optional ``[C, Hq, Dv]`` pre-sigmoid output-gate logits: returns
        ``o * sigmoid(gate)`` (Qwen3-Next).
      window: sliding window (transformers' ``sliding_window``): a row attends only to the
        ancestors-or-self less than ``window`` tokens above it (``depth_q - depth_k < window``);
        None = unlimited.
      sinks: optional ``[Hq]`` attention-sink logits (gpt-oss, any float dtype): each row of
        head ``h`` takes ``softmax([scores of its keys..., sinks[h]])`` and drops the sink's
        column (it has no value), as HF's gpt-oss attention does.
      softcap: optional attention logit soft-cap (Gemma 2's ``attn_logit_softcapping``): the
        scores become ``softcap · tanh(q kᵀ · scale / softcap)`` before the mask and softmax
        (an explicit-score path per bucket: no SDPA kernel takes it). Not with ``sinks``.
      max_key_rows: when the plan gathers more key rows than this (``plan.num_key_rows``) and
        autograd records the call, each bucket runs in consecutive member chunks of at most
        this many key rows (a member whose own keys exceed it is a chunk alone), each under
        activation checkpointing: no gathered keys / values (or scores) are kept for
        backward, which gathers them again one chunk at a time and reruns that chunk's
        forward. Same values and gradients up to the order of the key / value gradient sums.
        None = keep them.

    Returns:
      ``[C, Hq, Dv]`` in q's dtype and compact row order. Row ``r`` equals the trajectory-wise
      causal attention output at every semantic position mapped to ``r``. Differentiable with
      respect to q, k, v, gate and sinks (gathers are ``index_select``; backward by autograd).
      Supports float64/float32/bfloat16/float16 on CPU and CUDA.
    """
    c = plan.num_rows
    hq, hkv, dqk, dv = _check_qkv(q, k, v, gate, c)
    window = _check_window(window)
    if not same_device(q.device, plan.device):
        raise ValueError(f"plan: built for {plan.device}, but q is on {q.device}")
    _check_sinks(sinks, hq, q.device)
    softcap = _check_softcap(softcap, sinks)
    max_key_rows = None if max_key_rows is None else check_key_rows(max_key_rows)
    if scale is None:
        scale = 1.0 / math.sqrt(dqk)
    if c == 0:
        return q.new_zeros((0, hq, dv))
    if sinks is None:
        q, k, v = _pad_head_dim(q, k, v, max(dqk, dv))
    else:  # the sink as one more key: row C (see the module doc)
        q, k, v = _with_sink_key(q, k, v, sinks, scale)
    k, v, extra = _gqa(k, v, hq)
    hkv, d = k.shape[1], k.shape[2]
    recompute = (
        max_key_rows is not None
        and plan.num_key_rows > max_key_rows
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in (q, k, v))
    )

    def run(b: AttentionBucket, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q_idx, k_idx, lq, lk = b.q_index, b.k_index, b.lq, b.lk
        mask, causal = _bucket_mask(b, q.device, window)
        if sinks is not None:  # the sink key at key slot 0 of every member
            head = b.k_index.new_full((b.nb, 1), c)
            k_idx, lk = torch.cat([head, k_idx.view(b.nb, lk)], dim=1).view(-1), lk + 1
            if causal:  # square root bucket: a zero query first keeps it square (and causal)
                q_idx, lq = torch.cat([head, q_idx.view(b.nb, lq)], dim=1).view(-1), lq + 1
            else:
                mask = F.pad(mask, (1, 0), value=True)
        qb = q.index_select(0, q_idx).view(b.nb, lq, hq, d).transpose(1, 2)
        kb = k.index_select(0, k_idx).view(b.nb, lk, hkv, d).transpose(1, 2)
        vb = v.index_select(0, k_idx).view(b.nb, lk, hkv, d).transpose(1, 2)
        if softcap is not None:
            ob = _softcapped_attention(qb, kb, vb, mask, causal, scale, softcap)
        else:
            ob = F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=mask, is_causal=causal, scale=scale, **extra
            )
        ob = ob[:, :, lq - b.lq :]  # drops the zero query of a sink's causal bucket
        return ob.transpose(1, 2).reshape(b.nb * b.lq, hq, d)

    if recompute:
        from torch.utils.checkpoint import checkpoint

        extra_keys = 0 if sinks is None else 1
        outs = [
            checkpoint(run, part, q, k, v, use_reentrant=False)
            for b in plan.buckets
            for part in _key_row_chunks(b, max_key_rows, extra_keys)
        ]
    else:
        outs = [run(b, q, k, v) for b in plan.buckets]
    o = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
    return _finish_heads(o, plan.out_index, dv, gate)


def tree_attention_dense_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    forest: Any,
    *,
    scale: float | None = None,
    gate: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """TEST ORACLE ONLY — O(C²) time and memory. Same contract as :func:`tree_attention`.

    Dense ``[C, C]`` ancestor-or-self mask from preorder subtree sizes
    (``k <= q < k + subtree_size[k]``) and explicit ``softmax(q kᵀ · scale) v`` (no SDPA kernel;
    softmax in float32 for half/bfloat16 inputs); with ``sinks`` the column ``sinks[h]`` joins
    each row's softmax and is dropped before ``· v``; with ``softcap`` the scores are
    ``softcap · tanh(s / softcap)`` before the mask.
    """
    c = int(forest.num_compact_tokens)
    hq, hkv, dqk, _dv = _check_qkv(q, k, v, gate, c)
    _check_sinks(sinks, hq, q.device)
    softcap = _check_softcap(softcap, sinks)
    if scale is None:
        scale = 1.0 / math.sqrt(dqk)
    rows = np.arange(c)
    allowed = forest.is_ancestor_or_self(rows[None, :], rows[:, None])  # [query, key]
    window = _check_window(window)
    if window is not None:
        depth = np.asarray(forest.depth)
        allowed &= depth[:, None] - depth[None, :] < window
    mask = torch.from_numpy(np.ascontiguousarray(allowed)).to(q.device)
    rep = hq // hkv
    qh = q.transpose(0, 1)
    kh = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    vh = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    s = s if q.dtype == torch.float64 else s.float()
    if sinks is not None:  # one more column per row: the head's sink logit, dropped after
        s = torch.cat([s, sinks.to(s.dtype).view(hq, 1, 1).expand(hq, c, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :c].to(q.dtype)
    o = torch.matmul(p, vh).transpose(0, 1)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return o
