"""Compact log-probs and entropy: vocabulary-sized work once per distinct row (invariant 8).

The label of semantic position (i, t) is ``x_i[t+1]``; its hidden state is that of row
``semantic_rows[off_i + t]`` and its label is the token of the next row on the path, whose parent
is that row. So every *non-root* row ``c`` defines exactly one (hidden row ``parent[c]``,
label ``token_ids[c]``) pair, and every semantic position with t < L_i − 1 maps to the pair of
its child row ``semantic_rows[off_i + t + 1]``. Identical trajectory prefixes share the pair;
a row with several children gives several labels from one set of logits.

:func:`compact_log_probs` therefore computes logits, log-softmax (and entropy) once for every
row that has a child (H ≤ C rows), in chunks of ``rows_per_chunk`` rows, inside a custom
autograd function that saves only hidden/weight/bias (no logits): the backward recomputes each
chunk. Peak extra memory is O(rows_per_chunk · V) in forward and backward (a few reusable
chunk buffers, plus a [V, D] weight-gradient accumulator); no S×V or C×V tensor exists. The per-position outputs are gathers of the per-pair values, so the
gradient of a row collects the contributions of all semantic positions on it — exactly the
trajectory-wise gradient after the semantic gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from harts_verl.ops._dtypes import compute_dtype
from harts_verl.tree._checks import check_positive, holds_bool

__all__ = [
    "LabelPairs",
    "LogProbResult",
    "LogitTransform",
    "compact_log_probs",
    "expanded_log_probs_ref",
    "label_rows",
    "mean_logit_cosine",
    "semantic_to_row_index",
]


class LabelPairs(NamedTuple):
    """The (hidden row, label) pair of every non-root row (int64 numpy arrays of length P =
    C − #roots, in preorder of the child rows)."""

    child_rows: np.ndarray
    hidden_rows: np.ndarray
    labels: np.ndarray


class LogProbResult(NamedTuple):
    """Output of :func:`compact_log_probs`.

    Attributes:
      log_probs: ``output="nested"``: list of N tensors, tensor i of length L_i − 1 with
        ``log p(x_i[t+1] | x_i[≤t])`` for t = 0..L_i−2; ``output="flat"``: their concatenation
        [S − N]. float32 for float32/bf16/fp16 inputs, float64 for float64.
      entropy: same layout, entropy of the predictive distribution at t = 0..L_i−2
        (None unless ``with_entropy``).
      offsets: int64 [N+1], trajectory i occupies ``flat[offsets[i]:offsets[i+1]]``.
      sum_pi_squared: same layout, ``Σ_v p(v | x_i[≤t])²`` of the (temperature-scaled)
        predictive distribution at t = 0..L_i−2 (None unless ``with_sum_pi_squared``).
    """

    log_probs: Tensor | list[Tensor]
    entropy: Tensor | list[Tensor] | None
    offsets: Tensor
    sum_pi_squared: Tensor | list[Tensor] | None = None


def label_rows(forest: Any) -> LabelPairs:
    """The (hidden row, label) pair defined by every non-root row of ``forest``."""
    child = np.flatnonzero(np.asarray(forest.parent) >= 0).astype(np.int64)
    return LabelPairs(child, forest.parent[child].astype(np.int64), forest.token_ids[child])


def semantic_to_row_index(forest: Any) -> np.ndarray:
    """int64 [S − N]: for each position of the flat output (trajectory i, t = 0..L_i−2, in
    trajectory order) the child row whose pair it takes, ``semantic_rows[off_i + t + 1]``."""
    keep = np.ones(forest.num_semantic_tokens, dtype=bool)
    keep[forest.row_offsets[:-1]] = False  # every trajectory has >= 1 token
    return forest.semantic_rows[keep]


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> Tensor:
    """Logits ``h @ weightᵀ + bias`` of one chunk of rows, written to ``out`` ([n, V], input
    dtype); the only vocabulary-sized matmul (what ``F.linear`` computes)."""
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


class LogitTransform(NamedTuple):
    """What a causal LM's own forward does to its LM head's logits ``x`` before the sampler's
    temperature: ``z = x · scale``, then, with ``softcap``, ``z = softcap · tanh(z / softcap)``
    (Gemma 2 / Gemma 3: ``final_logit_softcapping``; Granite: ``scale = 1 / logits_scaling``;
    Cohere: ``scale = logit_scale``). The default is the identity."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None


def _check_transform(logit_transform: Any) -> LogitTransform:
    """``logit_transform`` (None or a :class:`LogitTransform` with a finite positive scale and a
    finite positive or None softcap), as a LogitTransform of python floats."""
    if logit_transform is None:
        return LogitTransform()
    if not isinstance(logit_transform, LogitTransform):
        raise TypeError(
            "logit_transform: expected a LogitTransform or None, got "
            f"{type(logit_transform).__name__}"
        )
    scale, cap = logit_transform
    return LogitTransform(
        check_positive("logit_transform.scale", scale),
        check_positive("logit_transform.softcap", cap, none_ok=True),
    )


class _Workspace:
    """Reusable [rows, V] buffers (logits in the input dtype; two in the compute dtype, three
    in a backward with a soft-cap), so a pass over the chunks allocates its vocabulary-sized
    memory once. ``keep_tanh``: keep each chunk's ``tanh`` for :meth:`to_raw_logits` (backward
    only; the forward soft-caps in place)."""

    def __init__(
        self,
        rows: int,
        weight: Tensor,
        cdt: torch.dtype,
        transform: LogitTransform,
        keep_tanh: bool = False,
    ) -> None:
        v = weight.shape[0]
        self.a = torch.empty(rows, v, dtype=cdt, device=weight.device)
        self.b = torch.empty(rows, v, dtype=cdt, device=weight.device)
        same = weight.dtype == cdt
        self.logits = (
            self.a if same else torch.empty(rows, v, dtype=weight.dtype, device=weight.device)
        )
        self.transform = transform
        # tanh(x · scale / softcap) of the last chunk (its derivative in backward)
        self.tanh = (
            torch.empty(rows, v, dtype=cdt, device=weight.device)
            if transform.softcap is not None and keep_tanh
            else None
        )

    def log_softmax(
        self, h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float
    ) -> Tensor:
        """``log_softmax(transform(logits.to(cdt)) / temperature)`` of chunk ``h`` [n, D], in
        buffer b (with a soft-cap and ``keep_tanh``, ``tanh`` of the chunk stays in
        ``self.tanh``)."""
        n = h.shape[0]
        z = _chunk_logits(h, weight, bias, self.logits[:n])
        if z.data_ptr() != self.a.data_ptr():
            z = self.a[:n].copy_(z)
        scale, cap = self.transform
        if scale != 1.0:
            z.mul_(scale)
        if cap is not None and self.tanh is not None:
            t = torch.tanh(z.div_(cap), out=self.tanh[:n])
            z = torch.mul(t, cap, out=z)
        elif cap is not None:
            z.div_(cap).tanh_().mul_(cap)
        if temperature != 1.0:
            z.div_(temperature)
        return torch.log_softmax(z, dim=-1, out=self.b[:n])

    def to_raw_logits(self, dz: Tensor, temperature: float) -> Tensor:
        """Turn ``dz``, a gradient with respect to the chunk's tempered log-softmax input (just
        after :meth:`log_softmax` of the same chunk), into one with respect to the raw logits, in
        place."""
        if temperature != 1.0:
            dz.div_(temperature)
        scale, cap = self.transform
        if cap is not None:  # d(cap · tanh(y / cap)) / dy = 1 − tanh²
            t = self.tanh[: dz.shape[0]]
            dz.mul_(t.square_().neg_().add_(1.0))
        if scale != 1.0:
            dz.mul_(scale)
        return dz


class _ChunkedLogProbs(torch.autograd.Function):
    """Per-pair log-probs and per-hidden-row entropy and Σp², chunked over hidden rows.

    Inputs: hidden [C, D], weight [V, D], bias [V] | None, hid_rows int64 [H] (distinct hidden
    rows, ascending), pair_hidx int64 [P] (index into hid_rows, non-decreasing), pair_label int64
    [P], pair_bounds (python list: pairs of chunk j are ``pair_bounds[j]:pair_bounds[j+1]``),
    chunk, temperature, with_entropy, with_sq, transform (a checked :class:`LogitTransform`
    applied before the temperature). Outputs: log-probs [P], entropy [H] (or [0]),
    Σp² [H] (or [0]); all three differentiable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        hid_rows: Tensor,
        pair_hidx: Tensor,
        pair_label: Tensor,
        pair_bounds: list[int],
        chunk: int,
        temperature: float,
        with_entropy: bool,
        with_sq: bool,
        transform: LogitTransform,
    ) -> tuple[Tensor, Tensor, Tensor]:
        cdt = compute_dtype(hidden.dtype)
        n_hid = hid_rows.shape[0]
        logp = torch.empty(pair_label.shape[0], dtype=cdt, device=hidden.device)
        ent = torch.empty(n_hid if with_entropy else 0, dtype=cdt, device=hidden.device)
        sq = torch.empty(n_hid if with_sq else 0, dtype=cdt, device=hidden.device)
        ws = _Workspace(min(chunk, n_hid), weight, cdt, transform)
        for j, a in enumerate(range(0, n_hid, chunk)):
            b = min(a + chunk, n_hid)
            logp_full = ws.log_softmax(hidden[hid_rows[a:b]], weight, bias, temperature)
            p0, p1 = pair_bounds[j], pair_bounds[j + 1]
            logp[p0:p1] = logp_full[pair_hidx[p0:p1] - a, pair_label[p0:p1]]
            if with_entropy or with_sq:
                p = torch.exp(logp_full, out=ws.a[: b - a])
                if with_entropy:
                    ent[a:b] = -torch.linalg.vecdot(p, logp_full)
                if with_sq:
                    sq[a:b] = torch.linalg.vecdot(p, p)
        ctx.save_for_backward(hidden, weight, bias, hid_rows, pair_hidx, pair_label)
        ctx.pair_bounds = pair_bounds
        ctx.chunk = chunk
        ctx.temperature = temperature
        ctx.transform = transform
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        if not with_sq:
            ctx.mark_non_differentiable(sq)
        return logp, ent, sq

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None, g_sq: Tensor | None
    ) -> tuple[Any, ...]:
        hidden, weight, bias, hid_rows, pair_hidx, pair_label = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none_rest = (None,) * 9
        use_ent = g_ent is not None and g_ent.numel() > 0
        use_sq = g_sq is not None and g_sq.numel() > 0
        if (g_logp is None and not use_ent and not use_sq) or not (need_h or need_w or need_b):
            return (None, None, None, *none_rest)
        cdt = compute_dtype(hidden.dtype)
        temperature, chunk, bounds = ctx.temperature, ctx.chunk, ctx.pair_bounds
        n_hid = hid_rows.shape[0]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        grad_b = (
            torch.zeros(weight.shape[0], dtype=cdt, device=weight.device)
            if need_b and bias is not None
            else None
        )
        ws = _Workspace(min(chunk, n_hid), weight, cdt, ctx.transform, keep_tanh=True)
        for j, a in enumerate(range(0, n_hid, chunk)):
            b = min(a + chunk, n_hid)
            rows = hid_rows[a:b]
            h = hidden[rows]
            logp_full = ws.log_softmax(h, weight, bias, temperature)
            # d logp[label] / dz = onehot(label) - p;  d entropy / dz = -p * (logp + entropy);
            # d Σp² / dz = 2 p (p - Σp²).
            p = torch.exp(logp_full, out=ws.a[: b - a])
            if use_sq:
                gq = g_sq[a:b].to(cdt)[:, None]
                d_sq = (p - torch.linalg.vecdot(p, p)[:, None]).mul_(p).mul_(2.0 * gq)
            gsum = torch.zeros(b - a, dtype=cdt, device=p.device)
            if g_logp is not None:
                p0, p1 = bounds[j], bounds[j + 1]
                local = pair_hidx[p0:p1] - a
                g = g_logp[p0:p1].to(cdt)
                gsum.index_add_(0, local, g)
            if use_ent:
                ge = g_ent[a:b].to(cdt)
                ent = -torch.linalg.vecdot(p, logp_full)
                coef = logp_full.add_(ent[:, None]).mul_(-ge[:, None]).sub_(gsum[:, None])
                dz = p.mul_(coef)
            else:
                dz = p.mul_(-gsum[:, None])
            if use_sq:
                dz.add_(d_sq)
            if g_logp is not None:
                dz.index_put_((local, pair_label[p0:p1]), g, accumulate=True)
            ws.to_raw_logits(dz, temperature)
            if grad_h is not None:
                dz_in = dz if dz.dtype == weight.dtype else ws.logits[: b - a].copy_(dz)
                grad_h[rows] = dz_in @ weight
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h.to(cdt))
            if grad_b is not None:
                grad_b.add_(dz.sum(dim=0))
        gw = grad_w.to(weight.dtype) if grad_w is not None else None
        gb = grad_b.to(bias.dtype) if grad_b is not None else None
        return (grad_h, gw, gb, *none_rest)


def _check_inputs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, forest: Any, c: int
) -> tuple[int, int]:
    if not isinstance(hidden, Tensor) or hidden.ndim != 2 or hidden.shape[0] != c:
        shape = tuple(hidden.shape) if isinstance(hidden, Tensor) else None
        raise ValueError(f"hidden: expected [C={c}, D] (or [1, C, D]), got shape {shape}")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden: expected a floating-point tensor, got {hidden.dtype}")
    d = hidden.shape[1]
    if not isinstance(weight, Tensor) or weight.ndim != 2 or weight.shape[1] != d:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else None
        raise ValueError(f"lm_head_weight: expected [V, D={d}], got shape {shape}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"lm_head_weight: dtype {weight.dtype} differs from hidden {hidden.dtype}")
    v = weight.shape[0]
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (v,)):
        shape = tuple(bias.shape) if isinstance(bias, Tensor) else None
        raise ValueError(f"lm_head_bias: expected shape ({v},), got {shape}")
    if bias is not None and bias.dtype != hidden.dtype:
        raise ValueError(f"lm_head_bias: dtype {bias.dtype} differs from hidden {hidden.dtype}")
    tok = np.asarray(forest.token_ids)
    if tok.size and int(tok.max()) >= v:
        raise ValueError(f"forest: token id {int(tok.max())} >= vocabulary size V={v}")
    return d, v


def _check_temperature(temperature: Any) -> float:
    """A finite positive number (python/numpy scalar, one-element tensor or numpy array), as a
    float."""
    value: Any = None
    if isinstance(temperature, Tensor) and temperature.numel() == 1:
        if temperature.dtype != torch.bool and not temperature.is_complex():
            value = temperature.detach().reshape(())
    elif isinstance(temperature, np.ndarray) and temperature.size == 1:
        if temperature.dtype.kind in "iuf":
            value = temperature.reshape(())
    elif isinstance(temperature, int | float | np.integer | np.floating) and not isinstance(
        temperature, bool
    ):
        value = temperature
    try:
        t = float(value) if value is not None else 0.0
    except OverflowError:  # an int past float's range
        t = float("inf")
    if not np.isfinite(t) or t <= 0:
        raise ValueError(f"temperature: expected a finite positive number, got {temperature!r}")
    return t


def check_temperature_floor(temperature: float | np.ndarray, dtype: torch.dtype) -> None:
    """Refuse (ValueError naming ``temperature``) a checked temperature below ``1 / √max`` of
    the compute dtype of ``dtype`` logits (float32: 5.4e-20, float64: 7.5e-155): above it,
    ``logits / temperature`` stays finite for every logit below ``√max`` (float32: 1.8e19),
    where a tinier temperature can turn log-probs and entropies into NaN."""
    finfo = torch.finfo(compute_dtype(dtype))
    floor = float(finfo.max) ** -0.5
    arr = np.atleast_1d(np.asarray(temperature, dtype=np.float64))
    bad = np.flatnonzero(arr < floor)
    if bad.size:
        i = int(bad[0])
        name = "temperature" if np.ndim(temperature) == 0 else f"temperature[{i}]"
        raise ValueError(
            f"{name}: {float(arr[i])!r} is below {floor:.3g}, the smallest temperature "
            f"{finfo.dtype} logits take (logits / temperature could overflow into NaN)"
        )


def check_temperatures(temperature: Any, n: int) -> float | np.ndarray:
    """One temperature (:func:`_check_temperature`; a one-element tensor or numpy array is one
    too, whatever ``n``), or per trajectory: a 1-D array / tensor / sequence of ``n`` finite
    positive numbers, as float64 numpy (one float when they are all equal). Raises
    ``ValueError`` naming ``temperature`` otherwise."""
    per = isinstance(temperature, list | tuple) or (
        isinstance(temperature, Tensor) and temperature.numel() != 1
    )
    per = per or (isinstance(temperature, np.ndarray) and temperature.size != 1)
    if not per:
        return _check_temperature(temperature)
    if isinstance(temperature, Tensor):
        if temperature.is_complex() or temperature.dtype == torch.bool:
            raise ValueError(f"temperature: expected real numbers, got {temperature.dtype}")
        arr = temperature.detach().to("cpu", torch.float64).numpy()
    else:
        if holds_bool(temperature) or getattr(temperature, "dtype", None) == np.bool_:
            raise ValueError(f"temperature: expected numbers, got a bool in {temperature!r}")
        for i, t in enumerate(temperature if isinstance(temperature, list | tuple) else ()):
            if isinstance(t, str | bytes | bytearray) or t is None:
                raise ValueError(f"temperature[{i}]: expected a number, got {t!r}")
        if isinstance(temperature, np.ndarray) and temperature.dtype.kind not in "iuf":
            raise ValueError(f"temperature: expected numbers, got dtype {temperature.dtype}")
        try:
            arr = np.asarray(temperature, dtype=np.float64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"temperature: expected numbers, got {temperature!r}") from exc
    if arr.shape != (n,):
        raise ValueError(
            f"temperature: expected one number or one per trajectory (shape ({n},)), got shape "
            f"{arr.shape}"
        )
    bad = np.flatnonzero(~np.isfinite(arr) | (arr <= 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"temperature[{i}]: expected a finite positive number, got {float(arr[i])!r}"
        )
    if arr.size == 0 or np.all(arr == arr[0]):
        return float(arr[0]) if arr.size else 1.0
    return arr


def select_temperatures(temperature: float | np.ndarray, idx: Any) -> float | np.ndarray:
    """The temperatures of the trajectories ``idx`` (in that order) of a batch whose
    temperature is ``temperature`` (:func:`check_temperatures`: one float, or one per
    trajectory)."""
    return temperature if isinstance(temperature, float) else temperature[idx]


def _group_rows(forest: Any, trajectories: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray]:
    """``(sub, rows, positions)`` for the ``trajectories`` of ``forest``: their forest (in that
    order), the ``forest`` row of every ``sub`` row, and where their shifted positions sit in
    ``forest``'s flat output (``[S − N]`` layout of :func:`compact_log_probs`)."""
    from harts_verl.ops._index import concat_ranges

    sub = forest.subset(trajectories)
    starts = np.asarray(forest.row_offsets)[trajectories]
    lengths = np.asarray(forest.lengths, dtype=np.int64)[trajectories]
    rows = np.empty(int(sub.num_compact_tokens), dtype=np.int64)
    rows[sub.semantic_rows] = np.asarray(forest.semantic_rows)[concat_ranges(starts, lengths)]
    flat_starts = starts - trajectories  # trajectory i's shifted positions start at off_i − i
    positions = concat_ranges(flat_starts, lengths - 1)
    return sub, rows, positions


def compact_log_probs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    forest: Any,
    *,
    lm_head_bias: Tensor | None = None,
    temperature: float | np.ndarray | Tensor = 1.0,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    rows_per_chunk: int = 4096,
    output: Literal["nested", "flat"] = "nested",
    logit_transform: LogitTransform | None = None,
) -> LogProbResult:
    """Per-trajectory shifted log-probs (and entropy, Σp²) from compact hidden states.

    ``hidden``: [C, D] (or [1, C, D]) final hidden states of the compact rows of ``forest`` (a
    RolloutForest or its expanded layout); ``lm_head_weight``: [V, D] and optional
    ``lm_head_bias`` [V], same dtype as ``hidden``. Logits ``hidden @ Wᵀ + b`` are formed in the
    input dtype, upcast (float32 for float32/bf16/fp16, float64 for float64), transformed by
    ``logit_transform`` (the model's own logit scaling / soft-capping, :class:`LogitTransform`;
    None: identity), divided by ``temperature`` and log-softmaxed — once for each row that has a
    child, in chunks of ``rows_per_chunk`` rows; the backward recomputes the chunks (no logits
    are stored). ``temperature`` is one number or one per trajectory (``[N]``, veRL's per-sample
    temperatures): the trajectories of each distinct temperature then form their own sub-forest,
    so a row shared by trajectories of k temperatures has its vocabulary work done k times.

    Guarantees: position t of trajectory i holds ``log p(x_i[t+1] | x_i[≤t])``, equal to a
    trajectory-wise log-softmax over the gathered hidden states (:func:`expanded_log_probs_ref`;
    float64: ≤ 1e-10, tested); every semantic position t < L_i − 1 appears exactly once, in
    order; length-1 trajectories give empty tensors. Entropy and ``Σ_v p_v²`` (veRL's
    ``sum_pi_squared``) take the same layout. Gradients of all outputs flow to hidden, weight
    and bias (float64: ≤ 1e-9 relative to the reference); a row's gradient is the sum over its
    semantic positions. Memory: two (three for bf16/fp16) reusable [min(rows_per_chunk, H), V]
    buffers per pass (one more in a backward through Σp², one more in a backward with a
    soft-cap) plus, in backward, a [V, D] compute-dtype weight-gradient accumulator.
    """
    if isinstance(hidden, Tensor) and hidden.ndim == 3 and hidden.shape[0] == 1:
        hidden = hidden[0]
    if not all(hasattr(forest, a) for a in ("num_compact_tokens", "parent", "semantic_rows")):
        raise TypeError(f"forest: expected a RolloutForest, got {type(forest).__name__}")
    c = int(forest.num_compact_tokens)
    _check_inputs(hidden, lm_head_weight, lm_head_bias, forest, c)
    temperature = check_temperatures(temperature, int(forest.num_trajectories))
    check_temperature_floor(temperature, hidden.dtype)
    transform = _check_transform(logit_transform)
    if (
        not isinstance(rows_per_chunk, int | np.integer)
        or isinstance(rows_per_chunk, bool)
        or rows_per_chunk < 1
    ):
        raise ValueError(f"rows_per_chunk: expected a positive int, got {rows_per_chunk!r}")
    if output not in ("nested", "flat"):
        raise ValueError(f"output: expected 'nested' or 'flat', got {output!r}")
    flags = (bool(with_entropy), bool(with_sum_pi_squared))
    head = (lm_head_weight, lm_head_bias, int(rows_per_chunk), transform)
    if isinstance(temperature, float):
        logp, ent, sq = _compact_flat(hidden, forest, temperature, head, *flags)
    else:
        logp, ent, sq = _per_temperature(hidden, forest, temperature, head, *flags)
    lengths = np.asarray(forest.lengths, dtype=np.int64) - 1
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(torch.from_numpy(lengths), 0, out=offsets[1:])
    if output == "flat":
        return LogProbResult(logp, ent, offsets, sq)
    sizes = lengths.tolist()
    return LogProbResult(
        list(torch.split(logp, sizes)),
        list(torch.split(ent, sizes)) if ent is not None else None,
        offsets,
        list(torch.split(sq, sizes)) if sq is not None else None,
    )


def _per_temperature(
    hidden: Tensor,
    forest: Any,
    temperatures: np.ndarray,
    head: tuple[Tensor, Tensor | None, int, LogitTransform],
    with_entropy: bool,
    with_sq: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`_compact_flat` with one temperature per trajectory: once per distinct temperature
    on the sub-forest of its trajectories (hidden rows gathered), outputs put back in the flat
    order of ``forest`` (differentiable: a gather of the concatenated group outputs)."""
    values, group = np.unique(temperatures, return_inverse=True)
    parts: list[tuple[Tensor, Tensor | None, Tensor | None]] = []
    where = []
    dev = hidden.device
    for g, t in enumerate(values.tolist()):
        sub, rows, positions = _group_rows(forest, np.flatnonzero(group == g))
        h = hidden.index_select(0, torch.from_numpy(rows).to(dev))
        parts.append(_compact_flat(h, sub, float(t), head, with_entropy, with_sq))
        where.append(positions)
    inverse = np.empty(sum(p.shape[0] for p in where), dtype=np.int64)
    inverse[np.concatenate(where)] = np.arange(inverse.shape[0], dtype=np.int64)
    gather = torch.from_numpy(inverse).to(dev)
    out = []
    for k in range(3):
        cols = [p[k] for p in parts]
        out.append(None if cols[0] is None else torch.cat(cols).index_select(0, gather))
    return out[0], out[1], out[2]


def _compact_flat(
    hidden: Tensor,
    forest: Any,
    temperature: float,
    head: tuple[Tensor, Tensor | None, int, LogitTransform],
    with_entropy: bool,
    with_sum_pi_squared: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Flat ``[S − N]`` log-probs, entropy and Σp² (None unless asked) of ``forest`` at one
    temperature (checked inputs; ``head`` = weight, bias, rows per chunk, transform)."""
    lm_head_weight, lm_head_bias, chunk, transform = head
    c = int(forest.num_compact_tokens)
    parent = np.asarray(forest.parent)
    hid_rows = np.flatnonzero(np.asarray(forest.num_children) > 0).astype(np.int64)
    child = np.flatnonzero(parent >= 0)
    order = np.argsort(parent[child], kind="stable")
    pair_child = child[order]
    pair_hidx = np.searchsorted(hid_rows, parent[pair_child]).astype(np.int64)
    pair_label = np.asarray(forest.token_ids)[pair_child].astype(np.int64)
    chunk_starts = np.arange(0, hid_rows.shape[0] + chunk, chunk, dtype=np.int64)
    chunk_starts = np.minimum(chunk_starts, hid_rows.shape[0])
    pair_bounds = np.searchsorted(pair_hidx, chunk_starts).tolist()

    dev = hidden.device
    logp_pairs, ent_hid, sq_hid = _ChunkedLogProbs.apply(
        hidden,
        lm_head_weight,
        lm_head_bias,
        torch.from_numpy(hid_rows).to(dev),
        torch.from_numpy(pair_hidx).to(dev),
        torch.from_numpy(pair_label).to(dev),
        pair_bounds,
        chunk,
        temperature,
        bool(with_entropy),
        bool(with_sum_pi_squared),
        transform,
    )

    pair_of_row = np.full(c, -1, dtype=np.int64)
    pair_of_row[pair_child] = np.arange(pair_child.shape[0], dtype=np.int64)
    pos_pair = pair_of_row[semantic_to_row_index(forest)]
    logp = logp_pairs[torch.from_numpy(pos_pair).to(dev)]
    hid_of_pos = torch.from_numpy(pair_hidx[pos_pair]).to(dev)
    ent = ent_hid[hid_of_pos] if with_entropy else None
    sq = sq_hid[hid_of_pos] if with_sum_pi_squared else None
    return logp, ent, sq


def expanded_log_probs_ref(
    hidden_seq: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    *,
    lm_head_bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    logit_transform: LogitTransform | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Trajectory-wise oracle: full ``log_softmax`` over one trajectory (O(L·V) memory).

    ``hidden_seq``: [L, D] hidden states of one trajectory; ``labels``: int [L−1],
    ``labels[t] = x[t+1]`` (the last hidden row predicts nothing). Returns (log-probs [L−1],
    entropy [L−1] or None, Σp² [L−1] or None) in float32 (float64 for float64 inputs), using
    the same dtype policy and ``logit_transform`` as :func:`compact_log_probs` (written out:
    ``softcap · tanh(x · scale / softcap)``).
    """
    if not isinstance(hidden_seq, Tensor) or hidden_seq.ndim != 2:
        shape = tuple(hidden_seq.shape) if isinstance(hidden_seq, Tensor) else None
        raise ValueError(f"hidden_seq: expected [L, D], got shape {shape}")
    n = hidden_seq.shape[0]
    if not isinstance(labels, Tensor) or labels.shape != (max(n - 1, 0),):
        shape = tuple(labels.shape) if isinstance(labels, Tensor) else None
        raise ValueError(f"labels: expected shape ({max(n - 1, 0)},), got {shape}")
    temperature = _check_temperature(temperature)
    check_temperature_floor(temperature, hidden_seq.dtype)
    scale, cap = _check_transform(logit_transform)
    cdt = compute_dtype(hidden_seq.dtype)
    z = F.linear(hidden_seq[: max(n - 1, 0)], lm_head_weight, lm_head_bias).to(cdt) * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    z = z / temperature
    logp_full = torch.log_softmax(z, dim=-1)
    logp = logp_full.gather(1, labels.long()[:, None])[:, 0]
    ent = -(logp_full.exp() * logp_full).sum(dim=-1) if with_entropy else None
    sq = (logp_full.exp() ** 2).sum(dim=-1) if with_sum_pi_squared else None
    return logp, ent, sq


def mean_logit_cosine(
    hidden_a: Sequence[torch.Tensor],
    hidden_b: Sequence[torch.Tensor],
    weight: torch.Tensor,
    *,
    rows_per_chunk: int = 4096,
) -> float:
    """Mean over positions of the cosine between the LM-head logits (``h @ weight.T``, float64)
    of ``hidden_a[i][t]`` and ``hidden_b[i][t]`` (``[L_i, D]`` each), ``rows_per_chunk`` rows at
    a time (memory O(rows_per_chunk × V)). Two exactly equal logit rows count 1, zero rows
    included (torch's cosine of the zero vector, 0, would read as a total disagreement). NaN
    when there is no position. Raises ValueError when the two lists or their shapes differ."""
    if len(hidden_a) != len(hidden_b):
        raise ValueError(f"hidden_b: {len(hidden_b)} trajectories, hidden_a has {len(hidden_a)}")
    w = weight.detach().double()
    total, count = 0.0, 0
    for i, (a, b) in enumerate(zip(hidden_a, hidden_b)):
        if a.shape != b.shape:
            raise ValueError(f"hidden_b[{i}]: shape {tuple(b.shape)} != {tuple(a.shape)}")
        for k in range(0, int(a.shape[0]), rows_per_chunk):
            la = a[k : k + rows_per_chunk].detach().double() @ w.T
            lb = b[k : k + rows_per_chunk].detach().double() @ w.T
            cos = torch.nn.functional.cosine_similarity(la, lb, dim=-1)
            cos = torch.where((la == lb).all(dim=-1), torch.ones_like(cos), cos)
            total += float(cos.sum())
            count += int(cos.shape[0])
    return total / count if count else float("nan")
