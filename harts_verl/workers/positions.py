"""A batch's token ids as per-trajectory arrays, and its ``position_ids`` against the
positions tree mode runs (each row at its depth: ``0 .. L-1`` per trajectory), for the engine,
the trainer's balancing and ``harts-verl check``'s note. Imports torch and numpy only."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["first_misplaced", "token_rows", "token_sequences"]


def token_rows(t: torch.Tensor, total: int) -> torch.Tensor | None:
    """``t``'s per-token values as ``[k, total]`` (trajectories concatenated in batch order):
    a nested ``[bsz, j]`` / ``[bsz, k, j]`` / ``[bsz, j, k]`` tensor (told apart by which
    dimension holds the ``total`` tokens, not by the nesting's ragged index, which a pickled
    batch can carry wrong) or a dense ``[bsz, L]`` / ``[bsz, k, L]`` one; None for another
    layout or size."""
    if t.is_nested:
        v = t.values()
        if v.dim() == 1:
            v = v[None]
        elif v.dim() == 2 and v.shape[1] != total and v.shape[0] == total:
            v = v.T
    elif t.dim() == 2:
        v = t.reshape(1, -1)
    elif t.dim() == 3:
        v = t.transpose(0, 1).reshape(t.shape[1], -1)
    else:
        return None
    return v if v.dim() == 2 and v.shape[1] == total else None


def first_misplaced(rows: torch.Tensor, offsets: torch.Tensor) -> tuple[int, int, list] | None:
    """The first token whose positions (a column of ``rows``, ``[k, total]``) differ from its
    index in its trajectory (``offsets``: ``[n + 1]`` int64 token offsets, on ``rows``' device)
    as ``(trajectory, token, its k positions)``, or None when every trajectory is at
    ``0 .. L-1`` in every row. Vectorized; one device sync when all match."""
    total = rows.shape[1]
    lengths = offsets.diff()
    expected = torch.arange(total, device=rows.device) - offsets[:-1].repeat_interleave(lengths)
    bad = (rows != expected[None]).any(dim=0)
    if not bool(bad.any()):
        return None
    at = int(bad.nonzero()[0, 0])
    i = int(torch.searchsorted(offsets, at, right=True)) - 1
    return i, at - int(offsets[i]), rows[:, at].tolist()


def token_sequences(input_ids: torch.Tensor) -> list[np.ndarray]:
    """Per-trajectory token ids (numpy int64) of a nested (jagged) ``[bsz, j1]`` tensor (a
    dense ``[bsz, L]`` tensor is taken row by row). TypeError naming ``input_ids`` unless its
    dtype is an integer one (a float id would be truncated silently). Views of one host copy:
    no per-token Python objects."""
    if (
        input_ids.dtype.is_floating_point
        or input_ids.dtype.is_complex
        or input_ids.dtype == torch.bool
    ):
        raise TypeError(f"input_ids: expected integer token ids, got dtype {input_ids.dtype}")
    if not input_ids.is_nested:
        return [r for r in input_ids.detach().cpu().numpy().astype(np.int64, copy=False)]
    if input_ids.layout != torch.jagged or not input_ids.is_contiguous():
        # a strided nested tensor has no offsets; a non-contiguous jagged one (``lengths``,
        # e.g. from torch.nested.narrow) has holes in values(): take each trajectory as is
        return [t.detach().cpu().numpy().astype(np.int64) for t in input_ids.unbind()]
    values = input_ids.values().detach().cpu().numpy().astype(np.int64, copy=False)
    offsets = input_ids.offsets().detach().cpu().numpy()
    return [values[offsets[i] : offsets[i + 1]] for i in range(offsets.shape[0] - 1)]
