"""Short causal depthwise convolution over a rollout forest (fla ``ShortConvolution`` /
Qwen3-Next ``conv1d`` in tree mode).

A row's conv window is its own pre-conv input and those of its ``W - 1`` nearest ancestors
(zeros past the root), which is exactly its window in every trajectory through it
(invariant 6). :func:`conv_window_index` gathers those rows for all rows at once by ``W - 1``
vectorized parent-pointer jumps; :func:`tree_short_conv` applies the taps. Fused q/k/v channels
are just a wider ``D`` (the conv is depthwise).

Math order, as fla's causal-conv kernel: accumulate taps oldest first in float32 (float64 for
float64 input), add the bias, apply the activation, cast to x's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from harts_verl.ops._dtypes import compute_dtype
from harts_verl.ops._index import to_index

__all__ = ["conv_window_index", "short_conv_expanded_ref", "tree_short_conv"]

_ACTIVATIONS = (None, "silu", "swish")


def conv_window_index(
    forest: Any, width: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Rows of each row's conv window.

    Args:
      forest: provides ``parent`` (int64 ``[C]``, -1 at roots).
      width: conv width ``W >= 1``.
      device: device of the result.

    Returns:
      int64 ``[C, W]``: ``[r, W - 1] = r``, ``[r, W - 1 - j]`` = the ``j``-th ancestor of ``r``,
      ``-1`` where the path is shorter (depth < j; read as zeros). Oldest first. One vectorized
      parent jump per tap.
    """
    if not isinstance(width, int | np.integer) or isinstance(width, bool) or width < 1:
        raise ValueError(f"width: expected an int >= 1, got {width!r}")
    parent = np.asarray(forest.parent, dtype=np.int64)
    c = parent.shape[0]
    out = np.empty((c, int(width)), dtype=np.int64)
    cur = np.arange(c, dtype=np.int64)
    out[:, width - 1] = cur
    for j in range(int(width) - 2, -1, -1):
        cur = np.where(cur >= 0, parent[np.maximum(cur, 0)], -1)
        out[:, j] = cur
    return to_index(out, device)


def _check_conv_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """Validate; return the weight as ``[D, W]``."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected a floating-point [C, D] tensor, got {shape}")
    d = x.shape[1]
    if weight.dim() == 3 and weight.shape[1] == 1:  # nn.Conv1d(groups=D) layout [D, 1, W]
        weight = weight[:, 0, :]
    if weight.dim() != 2 or weight.shape[0] != d or weight.shape[1] < 1:
        raise ValueError(
            f"weight: expected shape [{d}, W] (or [{d}, 1, W]), got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (d,):
        raise ValueError(f"bias: expected shape ({d},), got {tuple(bias.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {_ACTIVATIONS}, got {activation!r}")
    return weight


def _finish(
    acc: torch.Tensor, bias: torch.Tensor | None, activation: str | None, dtype: torch.dtype
) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.to(acc.dtype)
    if activation in ("silu", "swish"):
        acc = F.silu(acc)
    return acc.to(dtype)


def tree_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    window_index: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise short causal conv over the forest's ancestor windows.

    Args:
      x: ``[C, D]`` pre-conv inputs in compact row order (any float dtype).
      weight: ``[D, W]`` (or ``[D, 1, W]``), tap ``W - 1`` multiplies the current row.
      bias: ``[D]`` or None.
      window_index: ``[C, W]`` int64 from :func:`conv_window_index` (required; keyword or 4th
        positional argument), on x's device.
      activation: ``"silu"``/``"swish"`` or None.

    Returns:
      ``[C, D]`` in x's dtype: ``act(Σ_j x[win[:, j]] · weight[:, j] + bias)``, taps accumulated
      oldest first in float32 (float64 for float64 x). Differentiable w.r.t. x, weight, bias.
    """
    weight = _check_conv_args(x, weight, bias, activation)
    c, _ = x.shape
    w = weight.shape[1]
    if window_index is None:
        raise ValueError("window_index: required (build it with conv_window_index(forest, W))")
    if tuple(window_index.shape) != (c, w):
        raise ValueError(
            f"window_index: expected shape ({c}, {w}) for x and weight, got {tuple(window_index.shape)}"
        )
    acc_dtype = compute_dtype(x.dtype)
    wf = weight.to(acc_dtype)
    # Row C of x_pad is the zero row that window slots past the root (-1) read.
    x_pad = torch.cat([x, x.new_zeros((1, x.shape[1]))], dim=0)
    idx = torch.where(window_index >= 0, window_index, torch.full_like(window_index, c))
    acc = x_pad.index_select(0, idx[:, 0]).to(acc_dtype) * wf[:, 0]
    for j in range(1, w):  # in place: `acc` is not saved by autograd, only the tap inputs are
        acc += x_pad.index_select(0, idx[:, j]).to(acc_dtype) * wf[:, j]
    return _finish(acc, bias, activation, x.dtype)


def short_conv_expanded_ref(
    x_seq: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Reference for one trajectory (or a batch of equal-length ones), independent algorithm:
    ``torch.nn.functional.conv1d(groups=D)`` with ``W - 1`` left zero padding.

    Args:
      x_seq: ``[L, D]`` or ``[B, L, D]``.
      weight, bias, activation: as in :func:`tree_short_conv`.

    Returns:
      Same shape and dtype as ``x_seq``; computed in float32 for half/bfloat16 inputs.
    """
    squeeze = x_seq.dim() == 2
    xb = x_seq.unsqueeze(0) if squeeze else x_seq
    if xb.dim() != 3:
        raise ValueError(f"x_seq: expected [L, D] or [B, L, D], got {tuple(x_seq.shape)}")
    weight = _check_conv_args(xb[0], weight, bias, activation)
    w = weight.shape[1]
    acc_dtype = compute_dtype(x_seq.dtype)
    y = F.conv1d(
        xb.transpose(1, 2).to(acc_dtype),
        weight.to(acc_dtype).unsqueeze(1),
        None if bias is None else bias.to(acc_dtype),
        padding=w - 1,
        groups=xb.shape[2],
    )[..., : xb.shape[1]]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    y = y.transpose(1, 2).to(x_seq.dtype)
    return y[0] if squeeze else y
