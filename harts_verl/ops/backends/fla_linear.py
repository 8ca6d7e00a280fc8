"""fla (flash-linear-attention 0.6) chunk kernels behind the signature of
:func:`~harts_verl.ops.linear_attention.chunk_delta_rule_varlen`.

Convention mapping (ours → fla):

- tensors ``[T, ...]`` → ``[1, T, ...]`` (varlen needs batch size 1), outputs squeezed back;
- ``g`` is a log decay in both (natural log; fla rescales by ``1/ln 2`` internally for ``exp2``),
  passed as float32: ``[T, HV, K]`` → :func:`fla.ops.kda.chunk_kda`, ``[T, HV]`` →
  :func:`fla.ops.gated_delta_rule.chunk_gated_delta_rule`; gates are computed outside the kernel
  (``use_gate_in_kernel=False``), exactly as the reference receives them;
- ``beta`` post-sigmoid unless ``use_beta_sigmoid`` (→ ``use_beta_sigmoid_in_kernel``);
- ``use_qk_l2norm`` → ``use_qk_l2norm_in_kernel`` (same ``x / sqrt(Σx² + 1e-6)``);
- ``scale`` passed through (default ``K ** -0.5`` on both sides);
- ``cu_seqlens`` as int64 on the inputs' device; ``initial_state`` float32 ``[N, HV, K, V]``
  (fla asserts float32); ``output_final_state=True`` always: the final state is float32 and
  differentiable (fla's backward returns ``dh0`` and takes ``dht``), which is what the tree
  handoff needs;
- ``chunk_size`` forwarded as fla's ``chunk_size`` keyword (KDA: 32/64, GDN: 16/32/64).

Gated linear attention without the delta rule (``delta_rule=False``, Mamba-2 SSD) maps to
:func:`fla.ops.simple_gla.chunk_simple_gla` (``g`` ``[T, HV]``) or :func:`fla.ops.gla.chunk_gla`
(``g`` ``[T, HV, K]``): ``beta`` scales ``v`` before the call (the write is
``beta_t k_t v_t^T``), grouped q/k heads are repeated to the value heads, q/k L2 norm and the
beta sigmoid are applied outside; fla's own chunk length (64) is used. Value heads narrower than
:data:`MIN_GLA_VALUE_DIM` (Mamba-1's selective scan: one channel per head) are zero-padded to it
(fla's GLA tiles are at least that wide): the padded columns carry zero values, states and
outputs, and are cut off again; key heads narrower than :data:`MIN_GLA_KEY_DIM` (RecurrentGemma's
RG-LRU: one state entry per channel) likewise, with zero q / k entries (``scale`` defaults to the
true key width).

Scalar gates on Hopper: fla 0.6 refuses, in the backward, the scalar-gate chunk kernels
(``chunk_gated_delta_rule``, ``chunk_simple_gla``: their shared ``chunk_bwd_dqkwg``) on Hopper GPUs
with Triton in [3.4.0, 3.7.1) — a Triton miscompile gives wrong ``dk`` / ``dg`` there (fla issue
#640) — with a RuntimeError. :func:`scalar_gate_route` then sends scalar-gate calls to the
per-channel kernels, which are unaffected: a scalar decay is a per-channel decay equal in every
key channel, so GatedDeltaNet runs as KDA (``chunk_kda``, chunk 32 / 64) and SSD as GLA
(``chunk_gla``) with ``g`` broadcast to ``[T, HV, K]`` (its gradient sums back over ``K``).
``HARTS_FLA_SCALAR_GATE=native|channels`` overrides the choice (``native``: e.g. Triton patched,
or fla's TileLang backend installed).

fla exposes no exact per-chunk states (its ``h`` is stored in the input dtype and is internal), so
``output_chunk_states=True`` is refused: plans run with this kernel are first rewritten by
:func:`~harts_verl.ops.backends.plan_split.split_members_at_saved_boundaries`
(``final_states_only = True``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from harts_verl.ops.backends.routes import count_route
from harts_verl.ops.linear_attention import DeltaRuleOutput, chunk_delta_rule_varlen, l2norm

__all__ = [
    "SCALAR_GATE_ENV",
    "SCALAR_GATE_MODES",
    "FlaLinearKernel",
    "load_fla_gla_ops",
    "load_fla_ops",
    "scalar_gate_guard",
    "scalar_gate_route",
]

logger = logging.getLogger(__name__)

KDA_CHUNK_SIZES = (32, 64)
GDN_CHUNK_SIZES = (16, 32, 64)
MAX_KEY_DIM = 256
# The narrowest value head fla's GLA kernels take (their value tile feeds ``tl.dot``).
MIN_GLA_VALUE_DIM = 16
# The narrowest key head passed to them (``chunk_gla`` sizes its key tile from K, and ``tl.dot``
# needs 16): RecurrentGemma's RG-LRU has one-entry heads.
MIN_GLA_KEY_DIM = 16
SCALAR_GATE_MODES = ("auto", "native", "channels")
SCALAR_GATE_ENV = "HARTS_FLA_SCALAR_GATE"
# Triton versions whose Hopper code for fla's gated ``chunk_bwd_dqkwg`` is wrong (fla #640): fla
# 0.6 raises in the backward of its scalar-gate kernels there.
_BLOCKED_TRITON = ("3.4.0", "3.7.1")


def scalar_gate_guard(capability: tuple[int, int], triton_version: str | None) -> str | None:
    """Why fla 0.6 refuses its scalar-gate backward on a GPU of compute ``capability`` with
    Triton ``triton_version`` (None: Triton missing), or None where it runs: Hopper (9.x) with
    Triton in [3.4.0, 3.7.1) (fla issue #640), compared as fla compares them
    (``packaging.version``: a pre-release such as 3.7.1rc1 is below 3.7.1)."""
    from packaging.version import InvalidVersion, Version

    if capability[0] != 9 or not triton_version:
        return None
    try:
        version = Version(triton_version)
    except InvalidVersion:
        return None
    low, high = (Version(v) for v in _BLOCKED_TRITON)
    if not low <= version < high:
        return None
    return (
        f"Hopper (sm_{capability[0]}{capability[1]}) with Triton {triton_version}: fla refuses "
        "its scalar-gate backward there (fla issue #640)"
    )


def _scalar_gate_blocked(device: torch.device) -> str | None:
    """:func:`scalar_gate_guard` for ``device`` (None off CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        import triton
    except ImportError:
        return None
    capability = tuple(torch.cuda.get_device_capability(device))
    return scalar_gate_guard(capability, str(getattr(triton, "__version__", "")))  # type: ignore[arg-type]


def scalar_gate_route(
    device: torch.device | str | None, mode: str | None = None
) -> tuple[str, str]:
    """``(route, why)`` for scalar-gate calls (GatedDeltaNet, Mamba-2 SSD) on ``device``:
    ``"native"`` (fla's ``chunk_gated_delta_rule`` / ``chunk_simple_gla``) or ``"channels"``
    (``chunk_kda`` / ``chunk_gla`` with the gate broadcast over key channels).

    ``mode``: ``"auto"`` (default; ``$HARTS_FLA_SCALAR_GATE`` when set) picks ``"channels"``
    exactly where fla would refuse the scalar-gate backward (Hopper, Triton in [3.4.0, 3.7.1));
    ``"native"`` / ``"channels"`` force a route.

    Raises:
      ValueError: an unknown mode (naming ``$HARTS_FLA_SCALAR_GATE`` when it came from there).
    """
    source = "scalar_gate"
    if mode is None or mode == "auto":
        env = os.environ.get(SCALAR_GATE_ENV, "").strip()
        if env and env != "auto":
            mode, source = env, f"${SCALAR_GATE_ENV}"
        else:
            mode = "auto"
    if mode not in SCALAR_GATE_MODES:
        raise ValueError(f"{source}: unknown {mode!r}, expected one of {SCALAR_GATE_MODES}")
    if mode != "auto":
        return mode, f"{source}={mode}"
    dev = torch.device(device) if device is not None else torch.device("cpu")
    why = _scalar_gate_blocked(dev)
    return ("channels", why) if why else ("native", "fla's scalar-gate kernels run here")


def _import_fla(*paths: str) -> tuple[Callable[..., Any], ...]:
    """The fla functions ``paths`` (``"fla.ops.kda.chunk_kda"`` …), imported.

    Raises:
      ImportError: fla (or triton) is not installed or fails to import; the message names the
        functions and the error.
    """
    import importlib

    try:
        return tuple(
            getattr(importlib.import_module(p.rpartition(".")[0]), p.rpartition(".")[2])
            for p in paths
        )
    except Exception as exc:  # fla raises assorted errors when triton/drivers are missing
        raise ImportError(
            f"fla kernels unavailable: cannot import {' / '.join(paths)} "
            f"({type(exc).__name__}: {exc}); install fla-core and flash-linear-attention >= 0.6 "
            "with triton on a CUDA machine"
        ) from exc


@functools.cache
def _takes(fn: Callable[..., Any], keyword: str) -> bool:
    """Whether ``fn`` (an fla entry point) takes ``keyword`` (older fla builds may not)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def load_fla_ops() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Import ``(chunk_kda, chunk_gated_delta_rule)`` from fla (ImportError naming them when
    fla or triton is missing or broken)."""
    kda, gdn = _import_fla(
        "fla.ops.kda.chunk_kda", "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    )
    return kda, gdn


def load_fla_gla_ops() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Import ``(chunk_gla, chunk_simple_gla)`` from fla (ImportError naming them when fla or
    triton is missing or broken)."""
    gla, simple = _import_fla("fla.ops.gla.chunk_gla", "fla.ops.simple_gla.chunk_simple_gla")
    return gla, simple


class FlaLinearKernel:
    """Callable with the signature and return type of
    :func:`~harts_verl.ops.linear_attention.chunk_delta_rule_varlen`, running fla's kernels.

    Args:
      chunk_kda, chunk_gdn: fla's ``chunk_kda`` and ``chunk_gated_delta_rule`` (injectable so
        the argument mapping is testable on CPU with stand-ins).
      float64_fallback: run float64 inputs through the torch reference (fla has no float64
        kernels). True for the ``auto`` backend; False for an explicit ``fla`` choice, which then
        raises on float64.
      chunk_gla, chunk_simple_gla: fla's gated linear attention kernels for
        ``delta_rule=False`` (imported on first use when not given).
      scalar_gate: ``"auto"``, ``"native"`` or ``"channels"``: how scalar-gate calls run (see
        :func:`scalar_gate_route`; resolved per device on first use).

    Attributes:
      name: ``"fla"``.
      final_states_only: True — plans must be split so that every kept state is a final state.
    """

    name = "fla"
    final_states_only = True
    takes_cu_seqlens_cpu = True  # fla reads the offsets on the host: no device sync per call

    def __init__(
        self,
        chunk_kda: Callable[..., Any],
        chunk_gdn: Callable[..., Any],
        *,
        float64_fallback: bool = False,
        chunk_gla: Callable[..., Any] | None = None,
        chunk_simple_gla: Callable[..., Any] | None = None,
        scalar_gate: str = "auto",
    ) -> None:
        if scalar_gate not in SCALAR_GATE_MODES:
            raise ValueError(
                f"scalar_gate: unknown {scalar_gate!r}, expected one of {SCALAR_GATE_MODES}"
            )
        self.scalar_gate = scalar_gate
        self._routes: dict[str, str] = {}
        self._chunk_kda = chunk_kda
        self._chunk_gdn = chunk_gdn
        self._chunk_gla = chunk_gla
        self._chunk_simple_gla = chunk_simple_gla
        self._gla_missing_logged = False
        self.float64_fallback = float64_fallback

    def __repr__(self) -> str:
        return (
            f"FlaLinearKernel(float64_fallback={self.float64_fallback}, "
            f"scalar_gate={self.scalar_gate!r})"
        )

    def _scalar_route(self, device: torch.device) -> str:
        """The route of scalar-gate calls on ``device`` (cached per device; one INFO log when
        they go through the per-channel kernels)."""
        key = str(device)
        route = self._routes.get(key)
        if route is None:
            route, why = scalar_gate_route(device, self.scalar_gate)
            self._routes[key] = route
            if route == "channels":
                logger.info(
                    "linear backend 'fla' on %s: scalar gates run through chunk_kda / chunk_gla "
                    "with the gate broadcast over key channels (%s)",
                    key,
                    why,
                )
        return route

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None,
        initial_state: torch.Tensor | None = None,
        scale: float | None = None,
        chunk_size: int = 64,
        use_qk_l2norm: bool = False,
        use_beta_sigmoid: bool = False,
        output_chunk_states: bool = False,
        delta_rule: bool = True,
        cu_seqlens_cpu: torch.Tensor | None = None,
    ) -> DeltaRuleOutput:
        """See :func:`~harts_verl.ops.linear_attention.chunk_delta_rule_varlen`; returns
        ``DeltaRuleOutput(o [T, HV, V] in q's dtype, final_state [N, HV, K, V] float32, None)``.
        ``cu_seqlens_cpu``: ``cu_seqlens`` on the host (the caller's word that they are equal),
        handed to fla, which then computes its chunk indices without a device sync.

        Raises:
          NotImplementedError: ``output_chunk_states=True`` (fla has no exact chunk states).
          TypeError: float64 inputs without ``float64_fallback``.
          ValueError: shapes or chunk size fla does not support.
        """
        reference = q.dtype == torch.float64
        if reference and not self.float64_fallback:
            raise TypeError(
                "linear backend 'fla': float64 is not supported by fla's kernels; use "
                "linear_backend='reference' (or 'auto', which runs float64 on the reference)"
            )
        if output_chunk_states and not reference:
            raise NotImplementedError(
                "linear backend 'fla': exact chunk-start states are not exposed by fla (its "
                "per-chunk states are internal and stored in the input dtype); build the layout "
                "with final_states_only=True so kept states are member final states"
            )
        if reference or (not delta_rule and not self._has_gla_kernels()):
            count_route(f"linear/reference ({'float64' if reference else 'no gla kernel'})")
            return chunk_delta_rule_varlen(
                q,
                k,
                v,
                g,
                beta,
                cu_seqlens=cu_seqlens,
                initial_state=initial_state,
                scale=scale,
                chunk_size=chunk_size,
                use_qk_l2norm=use_qk_l2norm,
                use_beta_sigmoid=use_beta_sigmoid,
                output_chunk_states=output_chunk_states,
                delta_rule=delta_rule,
            )
        if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
            raise ValueError(
                f"q, k must be [T, H, K] and v [T, HV, V]; got {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}"
            )
        t, _, kdim = q.shape
        hv = v.shape[1]
        kda = g.dim() == 3
        if g.shape not in ((t, hv, kdim), (t, hv)):
            raise ValueError(f"g must be [T, HV, K] or [T, HV], got {tuple(g.shape)}")
        if beta.shape != (t, hv):
            raise ValueError(f"beta must be [T, HV] = {(t, hv)}, got {tuple(beta.shape)}")
        # Scalar gates through the per-channel kernels where fla refuses its scalar-gate ones.
        channels = not kda and self._scalar_route(q.device) == "channels"
        allowed = KDA_CHUNK_SIZES if kda or channels else GDN_CHUNK_SIZES
        if delta_rule and chunk_size not in allowed:
            kind = "KDA" if kda else "GDN"
            via = " (GDN runs as KDA here: see scalar_gate_route)" if channels else ""
            raise ValueError(
                f"linear backend 'fla': {kind} chunk_size must be in {allowed}{via}, "
                f"got {chunk_size}"
            )
        if kdim > MAX_KEY_DIM:
            raise ValueError(f"linear backend 'fla': key head dim {kdim} > {MAX_KEY_DIM}")
        if cu_seqlens is None:
            n = 1
            cu = cu_cpu = None
        else:
            cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
            n = int(cu.shape[0]) - 1
            cu_cpu = None if cu_seqlens_cpu is None else cu_seqlens_cpu.to("cpu", torch.int64)
        h0 = None
        if initial_state is not None:
            if initial_state.shape != (n, hv, kdim, v.shape[2]):
                raise ValueError(
                    f"initial_state must be [N, HV, K, V] = {(n, hv, kdim, v.shape[2])}, "
                    f"got {tuple(initial_state.shape)}"
                )
            if initial_state.dtype != torch.float32:  # the reference's rule (q, k, v not float64)
                raise ValueError(
                    f"initial_state must be float32 (exact boundary states), got "
                    f"{initial_state.dtype}"
                )
            h0 = initial_state
        count_route("linear/fla")  # a call refused above is not tallied
        if channels:  # a scalar decay is a per-channel decay equal in every key channel
            g = g.unsqueeze(-1).expand(t, hv, kdim)
            kda = True
        if not delta_rule:
            return self._gla(
                q, k, v, g, beta, cu, cu_cpu, h0, scale, use_qk_l2norm, use_beta_sigmoid
            )
        kwargs: dict[str, Any] = {
            "scale": scale,
            "initial_state": h0,
            "output_final_state": True,
            "use_qk_l2norm_in_kernel": use_qk_l2norm,
            "cu_seqlens": cu,
        }
        if use_beta_sigmoid:
            kwargs["use_beta_sigmoid_in_kernel"] = True
        if chunk_size != 64:  # fla's default is 64; older builds may not take the keyword
            kwargs["chunk_size"] = chunk_size
        fn = self._chunk_kda if kda else self._chunk_gdn
        if cu_cpu is not None and _takes(fn, "cu_seqlens_cpu"):
            kwargs["cu_seqlens_cpu"] = cu_cpu
        o, final = fn(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            g.to(torch.float32).contiguous().unsqueeze(0),
            beta.unsqueeze(0),
            **kwargs,
        )
        return DeltaRuleOutput(o=o.squeeze(0).to(v.dtype), final_state=final, chunk_states=None)

    def _has_gla_kernels(self) -> bool:
        """Whether fla's GLA kernels are loaded (imported on first use). Without them the
        ``auto`` kernel (``float64_fallback``) runs SSD on the torch reference (one WARNING);
        an explicit ``fla`` kernel raises the ImportError."""
        if self._chunk_gla is None or self._chunk_simple_gla is None:
            try:
                self._chunk_gla, self._chunk_simple_gla = load_fla_gla_ops()
            except ImportError as exc:
                if not self.float64_fallback:
                    raise
                if not self._gla_missing_logged:
                    self._gla_missing_logged = True
                    logger.warning("linear backend auto: %s; using the torch reference", exc)
                return False
        return True

    def _gla(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cu: torch.Tensor | None,
        cu_cpu: torch.Tensor | None,
        h0: torch.Tensor | None,
        scale: float | None,
        use_qk_l2norm: bool,
        use_beta_sigmoid: bool,
    ) -> DeltaRuleOutput:
        """``delta_rule=False``: fla's ``chunk_simple_gla`` (scalar g) / ``chunk_gla``; value
        and key heads narrower than :data:`MIN_GLA_VALUE_DIM` / :data:`MIN_GLA_KEY_DIM`
        zero-padded to them."""
        if use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        b = torch.sigmoid(beta) if use_beta_sigmoid else beta
        group = v.shape[1] // q.shape[1]
        if group > 1:
            q = q.repeat_interleave(group, dim=1)
            k = k.repeat_interleave(group, dim=1)
        fn = self._chunk_gla if g.dim() == 3 else self._chunk_simple_gla
        kdim, vdim = q.shape[-1], v.shape[-1]
        if scale is None:  # the default of the true key width, not the padded one
            scale = kdim**-0.5
        written = v * b.to(v.dtype)[..., None]
        g = g.to(torch.float32).contiguous()
        pad = max(0, MIN_GLA_VALUE_DIM - vdim)
        if pad:  # zero value columns: zero states and outputs there
            written = torch.nn.functional.pad(written, (0, pad))
            h0 = None if h0 is None else torch.nn.functional.pad(h0, (0, pad))
        kpad = max(0, MIN_GLA_KEY_DIM - kdim)
        if kpad:  # zero key entries: they add nothing to q·k, and their state rows stay zero
            q, k = (torch.nn.functional.pad(x, (0, kpad)) for x in (q, k))
            if g.dim() == 3:
                g = torch.nn.functional.pad(g, (0, kpad))
            h0 = None if h0 is None else torch.nn.functional.pad(h0, (0, 0, 0, kpad))
        host = (
            {"cu_seqlens_cpu": cu_cpu}
            if cu_cpu is not None and _takes(fn, "cu_seqlens_cpu")
            else {}
        )
        o, final = fn(
            q.unsqueeze(0),
            k.unsqueeze(0),
            written.unsqueeze(0),
            g=g.unsqueeze(0),
            scale=scale,
            initial_state=h0,
            output_final_state=True,
            cu_seqlens=cu,
            **host,
        )
        if pad or kpad:
            o, final = o[..., :vdim], final[..., :kdim, :vdim]
        return DeltaRuleOutput(o=o.squeeze(0).to(v.dtype), final_state=final, chunk_states=None)
