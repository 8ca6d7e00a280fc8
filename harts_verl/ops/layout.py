"""TreeLayout: everything the mixers need to run one microbatch in compact-row order.

Built from a :class:`~harts_verl.tree.RolloutForest` (the tree layout) or from
``RolloutForest.expanded`` (the trajectory-wise layout: one root chain per trajectory). Index
plans are built lazily on first use and cached, so a layer type that is absent costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from itertools import count

import numpy as np
import torch

from harts_verl.ops.tree_attention import check_key_rows
from harts_verl.tree import RolloutForest
from harts_verl.tree._checks import is_int

# The largest linear-attention chunk size: the chunked ops materialize [chunk, chunk] blocks per
# head whatever the sequence length (4096: 128 MiB per head in float64).
MAX_CHUNK_SIZE = 4096


def check_chunk_size(chunk_size: object, name: str = "chunk_size") -> int:
    """``chunk_size`` as an int in ``[1, MAX_CHUNK_SIZE]``; ValueError naming ``name``."""
    if not is_int(chunk_size) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(
            f"{name}: expected an int in [1, {MAX_CHUNK_SIZE}] (the linear-attention chunk "
            f"size), got {chunk_size!r}"
        )
    return int(chunk_size)


# Softmax-attention calls noted by :func:`recording_attention_windows` (None: not recording).
_WINDOW_LOG: list[tuple[int, int | None]] | None = None
_LAYOUT_SERIALS = count()  # a layout's key in that log (ids of freed layouts are reused)


@contextmanager
def recording_attention_windows() -> Iterator[list[tuple[int, int | None]]]:
    """Note every :meth:`TreeLayout.attention` call made inside the block, in call order, as
    ``(serial number of the layout, window the call passed)`` (None: no window, or one longer than every
    path of the layout); :func:`layer_windows` reads the list. Not reentrant."""
    global _WINDOW_LOG
    if _WINDOW_LOG is not None:
        raise RuntimeError("recording_attention_windows: already recording")
    _WINDOW_LOG = log = []
    try:
        yield log
    finally:
        _WINDOW_LOG = None


def layer_windows(log: list[tuple[int, int | None]]) -> list[int | None] | None:
    """The sliding window of each softmax-attention layer (None: full causal attention), from
    the :func:`recording_attention_windows` log of forwards without recomputation (each layout's
    calls are its model's attention layers in order). A layer's window is what any layout passed
    there; a layer that no layout windowed is None (its window, if any, is longer than every
    path the forwards ran, so it cut nothing). None when the layouts made different numbers of
    calls or passed different windows to one layer (not one model's plain forwards); ``[]`` for
    an empty log."""
    calls: dict[int, list[int | None]] = {}
    for key, window in log:
        calls.setdefault(key, []).append(window)
    per_layout = list(calls.values())
    if not per_layout:
        return []
    if len({len(c) for c in per_layout}) != 1:
        return None
    out: list[int | None] = []
    for seen in zip(*per_layout, strict=True):
        ws = {w for w in seen if w is not None}
        if len(ws) > 1:
            return None
        out.append(ws.pop() if ws else None)
    return out


class TreeLayout:
    """Compact layout of one microbatch: ``C`` rows in DFS preorder (invariant 1).

    ``position_ids [C]`` are the row depths (invariant 2). ``short_conv``, ``attention`` and
    ``linear_attention`` run the tree-aware ops on ``[C, ...]`` tensors.

    ``linear_backend`` / ``attention_backend``: ``"auto"`` (CUDA ⇒ fla / a varlen flash kernel
    when importable, else the torch references), a backend name, or a kernel object; see
    :mod:`harts_verl.ops.backends`.

    ``attention_key_rows``: bound on the key rows an attention layer keeps for backward
    (``max_key_rows`` of the kernels: above it none are kept, and the keys are gathered again
    in backward, in groups of at most that many rows: consecutive sequences for varlen kernels,
    member chunks of each bucket for SDPA; a segment whose own path is longer is a group
    alone; at the cost of one more attention forward); None = no bound.
    """

    def __init__(
        self,
        forest: RolloutForest,
        *,
        chunk_size: int = 64,
        device: torch.device | str | None = None,
        linear_backend: str = "auto",
        attention_backend: str = "auto",
        attention_key_rows: int | None = None,
    ) -> None:
        if not isinstance(forest, RolloutForest):
            raise TypeError(f"forest: expected a RolloutForest, got {type(forest).__name__}")
        self.forest = forest
        self._serial = next(_LAYOUT_SERIALS)
        self.chunk_size = check_chunk_size(chunk_size)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.linear_backend = linear_backend
        self.attention_backend = attention_backend
        self.attention_key_rows = (
            None
            if attention_key_rows is None
            else check_key_rows(attention_key_rows, "attention_key_rows")
        )
        self._conv_index: dict[int, torch.Tensor] = {}
        self._row_weights: dict[torch.dtype, torch.Tensor] = {}

    @property
    def num_rows(self) -> int:
        return self.forest.num_compact_tokens

    @cached_property
    def position_ids(self) -> torch.Tensor:
        return torch.as_tensor(self.forest.depth, device=self.device)

    @cached_property
    def token_ids(self) -> torch.Tensor:
        return torch.as_tensor(self.forest.token_ids, device=self.device)

    def row_weights(self, dtype: torch.dtype) -> torch.Tensor:
        """Row multiplicities (trajectories through each row) as ``dtype``; weights that make
        row statistics equal their trajectory-wise values (invariant 7)."""
        w = self._row_weights.get(dtype)
        if w is None:
            w = torch.as_tensor(self.forest.multiplicity.astype(np.float64), device=self.device).to(
                dtype
            )
            self._row_weights[dtype] = w
        return w

    # ---------------------------------------------------------------- plans (lazy)
    # --- backend selection (issue 9; see harts_verl.ops.backends) ---
    @cached_property
    def attention_kernel(self):
        """The tree-attention kernel resolved from ``attention_backend`` and the device."""
        from harts_verl.ops.backends import attention_kernel

        return attention_kernel(self.attention_backend, self.device)

    @cached_property
    def linear_kernel(self):
        """The linear-attention kernel resolved from ``linear_backend`` and the device."""
        from harts_verl.ops.backends import linear_kernel

        return linear_kernel(self.linear_backend, self.device)

    @cached_property
    def attention_plan(self):
        return self.attention_kernel.build_plan(self.forest, device=self.device)

    @cached_property
    def linear_plan(self):
        from harts_verl.ops.tree_linear_attention import build_linear_layout

        return build_linear_layout(
            self.forest,
            chunk_size=self.chunk_size,
            device=self.device,
            final_states_only=bool(self.linear_kernel.final_states_only),
        )

    # --- end backend selection ---

    def conv_index(self, width: int) -> torch.Tensor:
        idx = self._conv_index.get(width)
        if idx is None:
            from harts_verl.ops.short_conv import conv_window_index

            idx = conv_window_index(self.forest, width).to(self.device)
            self._conv_index[width] = idx
        return idx

    # ---------------------------------------------------------------- ops
    def short_conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str = "silu",
    ) -> torch.Tensor:
        """Depthwise causal conv over each row's path; x ``[C, D]``, weight ``[D, W]``."""
        from harts_verl.ops.short_conv import tree_short_conv

        return tree_short_conv(
            x, weight, bias, self.conv_index(weight.shape[-1]), activation=activation
        )

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        gate: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Softmax attention of each row over its ancestors and itself (with ``window``: only
        those less than ``window`` tokens above it; with ``sinks`` ``[Hq]``: one sink logit per
        query head joins each row's softmax, gpt-oss; with ``softcap``: soft-capped scores,
        Gemma 2); ``[C, Hq, Dv]``. ``window``, ``sinks`` and ``softcap`` reach the kernel only
        when set."""
        if _WINDOW_LOG is not None:
            _WINDOW_LOG.append((self._serial, None if window is None else int(window)))
        kw: dict = {} if window is None else {"window": window}
        if sinks is not None:
            kw["sinks"] = sinks
        if softcap is not None:
            kw["softcap"] = softcap
        if self.attention_key_rows is not None:
            kw["max_key_rows"] = self.attention_key_rows
        return self.attention_kernel(q, k, v, self.attention_plan, scale=scale, gate=gate, **kw)

    def linear_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = False,
        delta_rule: bool = True,
    ) -> torch.Tensor:
        """Chunkwise delta-rule attention (KDA for g ``[C, HV, K]``, GDN for g ``[C, HV]``) over
        the planned rounds; ``[C, HV, V]``. ``delta_rule=False``: gated linear attention
        without the delta correction (Mamba-2 SSD for g ``[C, HV]``)."""
        from harts_verl.ops.tree_linear_attention import tree_delta_rule

        return tree_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            self.linear_plan,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            kernel=self.linear_kernel,
            delta_rule=delta_rule,
        )
