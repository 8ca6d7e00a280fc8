"""Kernel backends of the tree ops, chosen by device (CUDA ⇒ fast kernels) or by name.

Linear attention (KDA / GatedDeltaNet), :func:`linear_kernel`:

- ``"reference"`` — :func:`~harts_verl.ops.linear_attention.chunk_delta_rule_varlen` (torch, any
  device, float64-capable, exact chunk-start states).
- ``"fla"`` — fla 0.6 ``chunk_kda`` / ``chunk_gated_delta_rule`` per round with ``cu_seqlens``
  (:class:`~harts_verl.ops.backends.fla_linear.FlaLinearKernel`). It returns only final states
  in float32, so its kernels report ``final_states_only = True`` and layouts split members at kept
  boundaries (:func:`~harts_verl.ops.backends.plan_split.split_members_at_saved_boundaries`).
  Scalar gates (GatedDeltaNet, Mamba-2) run on fla's per-channel kernels where fla refuses its
  scalar-gate backward (Hopper with Triton in [3.4.0, 3.7.1);
  :func:`~harts_verl.ops.backends.fla_linear.scalar_gate_route`).

Tree attention, :func:`attention_kernel`:

- ``"sdpa"`` — bucketed SDPA (:func:`~harts_verl.ops.tree_attention.tree_attention`), any device
  and dtype.
- ``"flash_attn"`` — ``flash_attn.flash_attn_varlen_func``, one varlen sequence per segment
  (:mod:`~harts_verl.ops.backends.varlen_attention`).
- ``"torch_varlen"`` — the same packing through ``torch.nn.attention.varlen.varlen_attn``
  (torch's built-in flash kernel, torch >= 2.9): needs no extra package.

Short convolution has one backend: the gather conv of :mod:`harts_verl.ops.short_conv` (a
row's window follows parent pointers, so fla's per-sequence ``causal_conv1d`` would need one
member per path plus conv caches; the gather conv is one memory-bound pass on every device).

Selection rules:

- ``"auto"``: on CUDA the fast backend if its package imports (linear: ``fla``; attention:
  ``flash_attn``, then ``torch_varlen``), else the reference, with one WARNING per
  (kind, reason) naming the import error. On other devices the reference (no log: that is the
  intended path). The fast kernels handle only some dtypes; ``auto`` routes the others per call
  to the reference (float64 linear attention, non-fp16/bf16 attention), and attention with
  sinks (gpt-oss) or logit soft-capping (Gemma 2), which the varlen kernels do not take, to
  the bucketed reference path.
- Environment override, read only when the requested name is ``"auto"``:
  ``HARTS_LINEAR_BACKEND`` / ``HARTS_ATTENTION_BACKEND`` (a backend name, treated as explicit).
  ``HARTS_TRITON_AUTOTUNE=first`` (read when fla's kernels load): every autotuned Triton kernel
  runs its first config, untimed (:mod:`~harts_verl.ops.backends.triton_cache`).
- An explicit name never falls back: an unavailable backend raises
  :class:`BackendUnavailableError` naming it and carrying the import error; an unsupported dtype,
  attention sinks or soft-capping raise at call time.
- A kernel object (anything with the protocol's attributes) is returned as is: tests and callers
  can inject their own.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol, runtime_checkable

import torch

from harts_verl.ops.backends.fla_linear import FlaLinearKernel, load_fla_ops, scalar_gate_route
from harts_verl.ops.backends.plan_split import split_members_at_saved_boundaries
from harts_verl.ops.backends.routes import count_route, kernel_routes
from harts_verl.ops.backends.varlen_attention import (
    FLASH_DTYPES,
    VarlenAttentionPlan,
    build_varlen_attention_plan,
    load_flash_attn_varlen,
    load_torch_varlen,
    sdpa_varlen_reference,
    tree_attention_varlen,
)
from harts_verl.ops.linear_attention import DeltaRuleOutput, chunk_delta_rule_varlen

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_ENV",
    "LINEAR_BACKENDS",
    "LINEAR_ENV",
    "AttentionKernel",
    "BackendUnavailableError",
    "FlaLinearKernel",
    "LinearKernel",
    "ReferenceLinearKernel",
    "SdpaAttentionKernel",
    "VarlenAttentionKernel",
    "attention_kernel",
    "backend_report",
    "build_varlen_attention_plan",
    "kernel_routes",
    "linear_kernel",
    "scalar_gate_route",
    "sdpa_varlen_reference",
    "split_members_at_saved_boundaries",
    "tree_attention_varlen",
]

logger = logging.getLogger(__name__)

LINEAR_BACKENDS = ("reference", "fla")
ATTENTION_BACKENDS = ("sdpa", "flash_attn", "torch_varlen")
LINEAR_ENV = "HARTS_LINEAR_BACKEND"
ATTENTION_ENV = "HARTS_ATTENTION_BACKEND"

_logged: set[tuple[str, str]] = set()


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (package missing, wrong device)."""


def _log_once(kind: str, message: str, level: int = logging.WARNING) -> None:
    key = (kind, message)
    if key not in _logged:
        _logged.add(key)
        logger.log(level, message)


# ------------------------------------------------------------------------------ protocols
@runtime_checkable
class LinearKernel(Protocol):
    """A chunkwise delta-rule kernel with the signature and return type of
    :func:`~harts_verl.ops.linear_attention.chunk_delta_rule_varlen`.

    ``final_states_only``: the kernel cannot return exact chunk-start states, so layouts must
    be split (every kept state a final state). ``delta_rule`` is passed only when False
    (gated linear attention, Mamba-2 layers): a kernel without it serves delta-rule models.
    """

    name: str
    final_states_only: bool

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
    ) -> DeltaRuleOutput: ...


@runtime_checkable
class AttentionKernel(Protocol):
    """Tree attention: ``build_plan(forest, device=...)`` once per layout, then
    ``kernel(q, k, v, plan, scale=..., gate=..., window=..., sinks=..., softcap=...,
    max_key_rows=...)`` with the contract of
    :func:`~harts_verl.ops.tree_attention.tree_attention`. A kernel without sliding windows,
    attention sinks, soft-capping or a key-row bound may leave those keywords out: layouts pass
    them only when set."""

    name: str

    def build_plan(self, forest: Any, *, device: torch.device | str | None = None) -> Any: ...

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: Any,
        *,
        scale: float | None = None,
        gate: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


# ------------------------------------------------------------------------------ linear
class ReferenceLinearKernel:
    """The torch reference :func:`~harts_verl.ops.linear_attention.chunk_delta_rule_varlen`."""

    name = "reference"
    final_states_only = False

    def __repr__(self) -> str:
        return "ReferenceLinearKernel()"

    def __call__(self, *args: Any, **kwargs: Any) -> DeltaRuleOutput:
        count_route("linear/reference")
        return chunk_delta_rule_varlen(*args, **kwargs)


def _device_type(device: torch.device | str | None) -> str:
    return torch.device(device).type if device is not None else "cpu"


def _pre_ampere(device: torch.device | str | None) -> str | None:
    """Why the varlen flash kernels cannot run on CUDA ``device`` (flash-attn 2 and torch's
    ``varlen_attn`` need compute capability 8.0 or newer), or None where they can (or where no
    CUDA runtime answers: the kernel's own call then says why)."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return None
    return f"the varlen flash kernels need compute capability >= 8.0 (Ampere), got {major}.{minor}"


def _requested(backend: str, env: str, allowed: tuple[str, ...], kind: str) -> tuple[str, bool]:
    """``(name, explicit)`` after the environment override; validates the name."""
    explicit = backend != "auto"
    name = backend
    if not explicit:
        override = os.environ.get(env, "").strip()
        if override and override != "auto":
            name, explicit = override, True
    if name != "auto" and name not in allowed:
        src = f" (from ${env})" if backend == "auto" else ""
        raise ValueError(
            f"{kind} backend: unknown {name!r}{src}, expected 'auto' or one of {allowed}"
        )
    return name, explicit


def _apply_autotune_env() -> None:
    """``$HARTS_TRITON_AUTOTUNE`` (``first`` | ``all``), applied when fla's kernels are loaded:
    :func:`~harts_verl.ops.backends.triton_cache.limit_autotune`. An unknown value is a
    ValueError naming the variable; a Triton the hook does not know, one WARNING."""
    from harts_verl.ops.backends.triton_cache import AUTOTUNE_ENV, AUTOTUNE_MODES, limit_autotune

    mode = os.environ.get(AUTOTUNE_ENV, "").strip()
    if not mode:
        return
    if mode not in AUTOTUNE_MODES:
        raise ValueError(f"${AUTOTUNE_ENV}: unknown {mode!r}, expected one of {AUTOTUNE_MODES}")
    try:
        limit_autotune(mode)
    except (ImportError, RuntimeError) as exc:
        _log_once("autotune", f"${AUTOTUNE_ENV}={mode} not applied: {exc}")


def linear_kernel(backend: Any = "auto", device: torch.device | str | None = None) -> LinearKernel:
    """The linear-attention kernel for ``backend`` on ``device`` (see the module docstring).

    Args:
      backend: ``"auto"``, ``"reference"``, ``"fla"``, or a :class:`LinearKernel` object
        (returned as is).
      device: where the inputs live; ``auto`` picks fla only for CUDA.

    Raises:
      ValueError: unknown name.
      BackendUnavailableError: ``"fla"`` requested explicitly but not importable or the device
        is not CUDA.
    """
    if not isinstance(backend, str):
        if not isinstance(backend, LinearKernel):
            raise TypeError(
                f"linear backend: expected a name or a LinearKernel (name, final_states_only, "
                f"__call__), got {type(backend).__name__}"
            )
        return backend
    name, explicit = _requested(backend, LINEAR_ENV, LINEAR_BACKENDS, "linear")
    dev = _device_type(device)
    if name == "reference":
        return ReferenceLinearKernel()
    if name == "fla":
        if dev != "cuda":
            raise BackendUnavailableError(
                f"linear backend 'fla' needs a CUDA device (Triton kernels), got device {dev!r}"
            )
        try:
            kda, gdn = load_fla_ops()
        except ImportError as exc:
            raise BackendUnavailableError(f"linear backend 'fla' is unavailable: {exc}") from exc
        _apply_autotune_env()
        return FlaLinearKernel(kda, gdn, float64_fallback=False)
    assert not explicit
    if dev != "cuda":
        return ReferenceLinearKernel()
    try:
        kda, gdn = load_fla_ops()
    except ImportError as exc:
        _log_once(
            "linear", f"linear backend auto: fla unavailable, using the torch reference ({exc})"
        )
        return ReferenceLinearKernel()
    _log_once("linear", "linear backend auto: using fla on CUDA", logging.INFO)
    _apply_autotune_env()
    return FlaLinearKernel(kda, gdn, float64_fallback=True)


# ------------------------------------------------------------------------------ attention
class SdpaAttentionKernel:
    """Bucketed SDPA tree attention (:mod:`harts_verl.ops.tree_attention`)."""

    name = "sdpa"

    def __repr__(self) -> str:
        return "SdpaAttentionKernel()"

    def build_plan(self, forest: Any, *, device: torch.device | str | None = None) -> Any:
        from harts_verl.ops.tree_attention import build_attention_plan

        return build_attention_plan(forest, device=device)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: Any,
        *,
        scale: float | None = None,
        gate: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
        max_key_rows: int | None = None,
    ) -> torch.Tensor:
        from harts_verl.ops.tree_attention import tree_attention

        count_route("attention/sdpa (window)" if window is not None else "attention/sdpa")
        return tree_attention(
            q,
            k,
            v,
            plan,
            scale=scale,
            gate=gate,
            window=window,
            sinks=sinks,
            softcap=softcap,
            max_key_rows=max_key_rows,
        )


class VarlenAttentionKernel:
    """Tree attention through a varlen flash kernel (one sequence per segment).

    Args:
      name: backend name (``"flash_attn"`` / ``"torch_varlen"``, or anything for a test double).
      varlen_fn: the ``flash_attn_varlen_func``-style kernel.
      sdpa_fallback: route dtypes the kernel does not take (anything but fp16/bf16) and calls
        with attention sinks (gpt-oss; no varlen kernel takes them) to SDPA (``auto``); False
        raises instead (explicit choice).
      require_half: the kernel takes only fp16/bf16 (True for flash kernels; False for
        :func:`sdpa_varlen_reference`).
    """

    def __init__(
        self,
        name: str,
        varlen_fn: Any,
        *,
        sdpa_fallback: bool = False,
        require_half: bool = True,
    ) -> None:
        self.name = name
        self.varlen_fn = varlen_fn
        self.sdpa_fallback = sdpa_fallback
        self.require_half = require_half

    def __repr__(self) -> str:
        return f"VarlenAttentionKernel({self.name!r}, sdpa_fallback={self.sdpa_fallback})"

    def build_plan(
        self, forest: Any, *, device: torch.device | str | None = None
    ) -> VarlenAttentionPlan:
        return build_varlen_attention_plan(forest, device=device)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: VarlenAttentionPlan,
        *,
        scale: float | None = None,
        gate: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
        max_key_rows: int | None = None,
    ) -> torch.Tensor:
        no_softcap = softcap is not None and not getattr(self.varlen_fn, "supports_softcap", False)
        for what, missing in (
            ("attention sinks (gpt-oss)", sinks is not None),
            ("logit soft-capping", no_softcap),
        ):
            if missing and not self.sdpa_fallback:
                raise NotImplementedError(
                    f"attention backend {self.name!r}: the varlen kernel has no {what}; use "
                    "the 'sdpa' or 'auto' attention backend"
                )
        unsupported_dtype = self.require_half and q.dtype not in FLASH_DTYPES
        no_window = window is not None and not getattr(self.varlen_fn, "supports_window", False)
        special = sinks is not None or no_softcap
        # an explicitly chosen kernel refuses a dtype it lacks (TypeError below), window or not
        refused = unsupported_dtype and not self.sdpa_fallback
        if not refused and (special or no_window or unsupported_dtype):
            # Sinks, soft-capping the kernel cannot take (with sdpa_fallback) and sliding
            # windows it cannot take run the bucketed path (exact).
            from harts_verl.ops.tree_attention import build_attention_plan, tree_attention

            cache = plan.cache
            if "sdpa" not in cache:
                cache["sdpa"] = build_attention_plan(plan.forest, device=plan.device)
            why = [
                name
                for name, hit in (
                    ("sinks", sinks is not None),
                    ("softcap", no_softcap),
                    (str(q.dtype).removeprefix("torch."), unsupported_dtype),
                    ("window", window is not None),
                )
                if hit
            ]
            count_route(f"attention/sdpa ({', '.join(why)})")
            return tree_attention(
                q,
                k,
                v,
                cache["sdpa"],
                scale=scale,
                gate=gate,
                window=window,
                sinks=sinks,
                softcap=softcap,
                max_key_rows=max_key_rows,
            )
        count_route(f"attention/{self.name}" + (" (window)" if window is not None else ""))
        return tree_attention_varlen(
            q,
            k,
            v,
            plan,
            varlen_fn=self.varlen_fn,
            scale=scale,
            gate=gate,
            require_half=self.require_half,
            window=window,
            softcap=softcap,
            max_key_rows=max_key_rows,
        )


_ATTENTION_LOADERS = {"flash_attn": load_flash_attn_varlen, "torch_varlen": load_torch_varlen}


def attention_kernel(
    backend: Any = "auto", device: torch.device | str | None = None
) -> AttentionKernel:
    """The tree-attention kernel for ``backend`` on ``device`` (see the module docstring).

    Args:
      backend: ``"auto"``, ``"sdpa"``, ``"flash_attn"``, ``"torch_varlen"``, or an
        :class:`AttentionKernel` object (returned as is).
      device: where the inputs live; ``auto`` picks a flash kernel only for CUDA.

    Raises:
      ValueError: unknown name.
      BackendUnavailableError: a flash backend requested explicitly but not importable or the
        device is not CUDA.
    """
    if not isinstance(backend, str):
        if not isinstance(backend, AttentionKernel):
            raise TypeError(
                f"attention backend: expected a name or an AttentionKernel (name, build_plan, "
                f"__call__), got {type(backend).__name__}"
            )
        return backend
    name, explicit = _requested(backend, ATTENTION_ENV, ATTENTION_BACKENDS, "attention")
    dev = _device_type(device)
    if name == "sdpa":
        return SdpaAttentionKernel()
    if name in _ATTENTION_LOADERS:
        if dev != "cuda":
            raise BackendUnavailableError(
                f"attention backend {name!r} needs a CUDA device, got device {dev!r}"
            )
        old_gpu = _pre_ampere(device)
        if old_gpu:
            raise BackendUnavailableError(f"attention backend {name!r} is unavailable: {old_gpu}")
        try:
            fn = _ATTENTION_LOADERS[name]()
        except ImportError as exc:
            raise BackendUnavailableError(
                f"attention backend {name!r} is unavailable: {exc}"
            ) from exc
        return VarlenAttentionKernel(name, fn, sdpa_fallback=False)
    assert not explicit
    if dev != "cuda":
        return SdpaAttentionKernel()
    old_gpu = _pre_ampere(device)
    if old_gpu:
        _log_once("attention", f"attention backend auto: using SDPA ({old_gpu})")
        return SdpaAttentionKernel()
    reasons = []
    for cand, loader in _ATTENTION_LOADERS.items():
        try:
            fn = loader()
        except ImportError as exc:
            reasons.append(str(exc))
            continue
        if reasons:
            _log_once("attention", f"attention backend auto: using {cand} ({'; '.join(reasons)})")
        else:
            _log_once("attention", f"attention backend auto: using {cand} on CUDA", logging.INFO)
        return VarlenAttentionKernel(cand, fn, sdpa_fallback=True)
    _log_once(
        "attention",
        f"attention backend auto: no varlen flash kernel, using SDPA ({'; '.join(reasons)})",
    )
    return SdpaAttentionKernel()


def backend_report(device: torch.device | str | None = None) -> dict[str, Any]:
    """What ``auto`` resolves to on ``device`` and why each fast backend is (un)available;
    JSON-ready (used by ``scripts/gpu_check.sh``)."""
    out: dict[str, Any] = {"device": str(torch.device(device) if device else "cpu")}
    out["linear_auto"] = linear_kernel("auto", device).name
    out["attention_auto"] = attention_kernel("auto", device).name
    avail: dict[str, str] = {}
    for name in ("fla",):
        try:
            load_fla_ops()
            avail[name] = "ok"
        except ImportError as exc:
            avail[name] = str(exc)
    for name, loader in _ATTENTION_LOADERS.items():
        try:
            loader()
            avail[name] = "ok"
        except ImportError as exc:
            avail[name] = str(exc)
    out["packages"] = avail
    route, why = scalar_gate_route(device)
    out["fla_scalar_gate"] = {"route": route, "why": why}
    return out
