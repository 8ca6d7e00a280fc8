"""Triton compile time for fla's kernels: limit autotuning, log compiles, compile ahead of time.

fla's chunk kernels are Triton kernels with autotuning: the first call of a kernel family for a new
(dtype, head shape) compiles every autotune config of every kernel it touches (KDA forward and
backward at one shape: 227 compiles, 136 s on one core of the 2-core CPU this was measured on)
and times each on the GPU. A short GPU session or the first training step pays that.

- :func:`limit_autotune` — ``"first"``: every autotuned Triton kernel runs its first admissible
  config (after the kernel's own pruning), nothing is timed and no timing is written to Triton's
  cache (what the interpreter tests of fla run too); ``"all"``: Triton's own autotuning.
- :class:`CompileLog` — counts Triton compiles (real ones and cache hits) and their time, through
  Triton's compilation listener.
- :func:`compile_ahead` — runs a workload (Python calls into fla on CPU tensors) against a
  stand-in CUDA driver whose launches do nothing, collects every kernel specialization the calls
  reach (every autotune config with ``autotune="all"``) and compiles them for the target GPU in a
  thread pool into Triton's on-disk cache (``TRITON_CACHE_DIR``). A later run on that GPU, with the
  same Triton and cache, then loads them instead of compiling (Triton's compile releases the GIL:
  threads scale with cores). Nothing runs on a GPU; the process's ``torch.cuda`` queries answer
  for the target, so run it in a process of its own, before importing fla.

Tied to the Triton internals of 3.6 (``JITFunction._do_compile``, ``Autotuner._bench`` /
``check_disk_cache``, ``knobs.compilation.listener``): :func:`check_triton` refuses others by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from harts_verl.ops._version import release_tuple

__all__ = [
    "AUTOTUNE_ENV",
    "AUTOTUNE_MODES",
    "CompileLog",
    "DeviceInfo",
    "check_triton",
    "compile_ahead",
    "limit_autotune",
]

AUTOTUNE_MODES = ("all", "first")
AUTOTUNE_ENV = "HARTS_TRITON_AUTOTUNE"
_SUPPORTED_TRITON = ((3, 6),)
_state: dict[str, Any] = {"mode": "all", "originals": None}
_lock = threading.Lock()
# An H100 SXM as Triton's get_device_properties reports it; the values a DeviceInfo lacks.
_HOPPER_PROPERTIES = {
    "max_shared_mem": 232448,
    "multiprocessor_count": 132,
    "max_num_regs": 65536,
    "warpSize": 32,
    "sm_clock_rate": 1980000,
    "mem_clock_rate": 2619000,
    "mem_bus_width": 5120,
}


def check_triton() -> Any:
    """Import triton and check it is a version these helpers were written against.

    Raises:
      ImportError: triton is missing.
      RuntimeError: another triton version (naming it and the supported ones).
    """
    import triton

    if release_tuple(triton.__version__)[:2] not in _SUPPORTED_TRITON:
        raise RuntimeError(
            f"triton {triton.__version__}: the compile helpers hook Triton internals of "
            f"{' / '.join('.'.join(map(str, v)) for v in _SUPPORTED_TRITON)} only"
        )
    return triton


# ------------------------------------------------------------------------------ autotuning
def limit_autotune(mode: str) -> None:
    """Set how autotuned Triton kernels pick a config, process-wide (idempotent).

    ``"first"``: the first config the kernel's own pruning admits, without timing anything and
    without reading or writing autotune timings in Triton's cache; ``"all"``: Triton's autotuning.

    Raises:
      ValueError: an unknown mode.
    """
    if mode not in AUTOTUNE_MODES:
        raise ValueError(f"autotune: unknown {mode!r}, expected one of {AUTOTUNE_MODES}")
    check_triton()
    from triton.runtime.autotuner import Autotuner

    with _lock:
        if _state["originals"] is None:
            _state["originals"] = (Autotuner._bench, Autotuner.check_disk_cache)
            bench, disk = _state["originals"]

            def _bench(self: Any, *args: Any, config: Any, **meta: Any) -> Any:
                if _state["mode"] == "first":
                    return [0.0, 0.0, 0.0]  # equal timings: the first candidate wins
                return bench(self, *args, config=config, **meta)

            def check_disk_cache(self: Any, tuning_key: Any, configs: Any, bench_fn: Any) -> Any:
                if _state["mode"] == "first":
                    bench_fn()
                    return False
                return disk(self, tuning_key, configs, bench_fn)

            Autotuner._bench = _bench
            Autotuner.check_disk_cache = check_disk_cache
        _state["mode"] = mode


# ------------------------------------------------------------------------------ compile log
class CompileLog:
    """Counts Triton compiles while installed (Triton's compilation listener): real compiles and
    on-disk cache hits, with their time. One at a time per process.

    ``summary()``: ``{"compiles", "compile_seconds", "cache_hits", "cache_hit_seconds",
    "kernels": {name: compiles}}``.
    """

    def __init__(self) -> None:
        self.compiles = 0
        self.cache_hits = 0
        self.compile_us = 0
        self.hit_us = 0
        self.kernels: dict[str, int] = {}
        self._lock = threading.Lock()
        self._previous: Any = None
        self._installed = False

    def __call__(
        self, *, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool
    ):
        with self._lock:
            if cache_hit:
                self.cache_hits += 1
                self.hit_us += int(times.total)
            else:
                self.compiles += 1
                self.compile_us += int(times.total)
                name = str(getattr(src, "name", "?"))
                self.kernels[name] = self.kernels.get(name, 0) + 1
        if self._previous is not None:
            self._previous(
                src=src,
                metadata=metadata,
                metadata_group=metadata_group,
                times=times,
                cache_hit=cache_hit,
            )

    def install(self) -> CompileLog:
        triton = check_triton()
        if not self._installed:
            self._previous = triton.knobs.compilation.listener
            triton.knobs.compilation.listener = self
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            import triton

            triton.knobs.compilation.listener = self._previous
            self._installed = False

    def __enter__(self) -> CompileLog:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "compiles": self.compiles,
                "compile_seconds": round(self.compile_us / 1e6, 3),
                "cache_hits": self.cache_hits,
                "cache_hit_seconds": round(self.hit_us / 1e6, 3),
                "kernels": dict(sorted(self.kernels.items(), key=lambda kv: -kv[1])),
            }


# ------------------------------------------------------------------------------ ahead of time
@dataclass(frozen=True)
class DeviceInfo:
    """The GPU the kernels are compiled for, as fla and Triton query it.

    ``properties``: Triton's ``get_device_properties`` dict (``max_shared_mem``,
    ``multiprocessor_count``, …).
    """

    name: str
    capability: tuple[int, int]
    properties: dict[str, int] = field(default_factory=dict)

    @classmethod
    def hopper(cls) -> DeviceInfo:
        """An H100 SXM (sm_90, 132 SMs, 227 KiB of shared memory per block)."""
        return cls(
            name="NVIDIA H100 80GB HBM3", capability=(9, 0), properties=dict(_HOPPER_PROPERTIES)
        )

    def all_properties(self) -> dict[str, int]:
        """``properties``, with an H100's values for the ones it lacks."""
        return {**_HOPPER_PROPERTIES, **self.properties}

    @classmethod
    def current(cls) -> DeviceInfo:
        """The visible CUDA device (raises RuntimeError without one)."""
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: pass the target's DeviceInfo (e.g. hopper())")
        triton = check_triton()
        props = dict(triton.runtime.driver.active.utils.get_device_properties(0))
        return cls(
            name=torch.cuda.get_device_name(0),
            capability=tuple(torch.cuda.get_device_capability(0)),  # type: ignore[arg-type]
            properties={k: v for k, v in props.items() if isinstance(v, int)},
        )


class _NoKernel:
    """What a launch gets under the stand-in driver: a kernel whose launch does nothing."""

    function = None
    packed_metadata = None

    def launch_metadata(self, *args: Any) -> None:
        return None

    def run(self, *args: Any, **kwargs: Any) -> None:
        return None


def _stand_in_driver(device: DeviceInfo) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import ty_to_cpp

    major, minor = device.capability
    props = device.all_properties()

    class Utils:
        def load_binary(self, name: str, kernel: Any, shared: int, dev: int) -> tuple:
            return (0, 0, 64, 0, 1024)

        def get_device_properties(self, dev: int) -> dict[str, int]:
            return dict(props)

    class Launcher:
        def __init__(self, src: Any, metadata: Any) -> None:
            pass

        def __call__(self, *args: Any, **kwargs: Any) -> None:
            return None

    def bench(fn: Callable[[], Any], quantiles: Any = None, **kwargs: Any) -> list[float]:
        fn()  # reaches every config's compile; the timing is never used
        return [1.0, 1.0, 1.0]

    class Driver:
        utils = Utils()
        launcher_cls = Launcher

        @staticmethod
        def is_active() -> bool:
            return True

        def get_current_target(self) -> Any:
            return GPUTarget("cuda", major * 10 + minor, 32)

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, dev: int) -> None:
            pass

        def get_current_stream(self, dev: int | None = None) -> int:
            return 0

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_device_interface(self) -> Any:
            return torch.cuda

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty_to_cpp(ty)

        def get_benchmarker(self) -> Callable[..., list[float]]:
            return bench

        def get_empty_cache_for_benchmark(self) -> torch.Tensor:
            return torch.empty(1)

        def clear_cache(self, cache: Any) -> None:
            pass

    return Driver()


class _DeviceZeroList(list):
    """A per-device list read at index None as at index 0."""

    def __getitem__(self, i: Any) -> Any:
        return super().__getitem__(0 if i is None else i)


def _fla_cpu_tensors_as_device_zero() -> None:
    """fla sizes some tiles from ``check_shared_mem(arch, tensor.device.index)``; the workload's
    CPU tensors have index None (read as no shared memory there, while the GPU's tensors have
    index 0): make index None read device 0's, so the tiles, and so the compiled
    specializations, are the GPU's. No-op without fla."""
    try:
        import fla.utils.hardware as hw
    except ImportError:
        return
    original = hw.get_all_max_shared_mem
    if getattr(original, "_harts_device_zero", False):
        return

    def get_all_max_shared_mem() -> list:
        return _DeviceZeroList(original())

    get_all_max_shared_mem._harts_device_zero = True  # type: ignore[attr-defined]
    hw.get_all_max_shared_mem = get_all_max_shared_mem
    hw.check_shared_mem.cache_clear()


@contextlib.contextmanager
def _patched(obj: Any, **attrs: Any) -> Iterator[None]:
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def compile_ahead(
    workload: Callable[[], Any],
    *,
    device: DeviceInfo,
    autotune: str = "all",
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    compile: bool = True,
) -> dict[str, Any]:
    """Compile every Triton kernel specialization ``workload()`` reaches, for ``device``, into
    Triton's on-disk cache, without a GPU (``compile=False``: only count them).

    ``workload`` makes its calls into fla with CPU tensors of the shapes, dtypes and options of the
    real run (values are never read: launches do nothing, so outputs are garbage). Kernels whose
    specialization depends on integer values (``== 1``, divisible by 16) compile for the values
    the workload passes. ``autotune``: ``"all"`` collects every autotune config the kernels' own
    pruning admits, ``"first"`` only the one :func:`limit_autotune` ``("first")`` will run; the
    stand-in timings are never written to the cache. Compiles that fail (e.g. a config past the
    target's limits) are counted, as the autotuner would skip them.

    Run it in a process of its own, before fla is imported: fla reads the GPU's name and
    capability at import, and this process's ``torch.cuda`` queries answer for ``device`` while
    the workload runs (they are restored afterwards; the stand-in driver stays active).

    Returns ``{"target", "autotune", "kernels", "specializations", "compiled", "cached",
    "failed", "errors", "too_large", "threads", "workload_seconds", "compile_seconds",
    "compile_cpu_seconds", "interrupted"}`` (``cached``: found in the cache already;
    ``kernels``: distinct Triton functions; ``too_large``: specializations past the target's
    shared memory, which cannot launch there; ``interrupted``: a SIGINT (a time limit) stopped
    the compiles, the queued ones were dropped and the counts are of those that ran; SIGINT is
    then ignored, so the summary is still returned).

    Raises:
      ValueError: an unknown ``autotune``.
      RuntimeError: an unsupported triton (see :func:`check_triton`).
    """
    if autotune not in AUTOTUNE_MODES:
        raise ValueError(f"autotune: unknown {autotune!r}, expected one of {AUTOTUNE_MODES}")
    triton = check_triton()
    import triton.runtime.jit as jit
    from triton.runtime.autotuner import Autotuner

    limit_autotune(autotune)
    jobs: dict[tuple[int, str], tuple[Any, Any, Any, Any]] = {}
    fn_names: dict[int, str] = {}

    def collect(
        self: Any,
        key: Any,
        signature: Any,
        dev: Any,
        constexprs: Any,
        options: Any,
        attrs: Any,
        warmup: Any,
    ) -> _NoKernel:
        _, _, target, _, _ = self.device_caches[dev]
        job_key = (id(self), str(key))
        if job_key not in jobs:
            jobs[job_key] = (
                self,
                self.ASTSource(self, signature, constexprs, attrs),
                target,
                options,
            )
            fn_names[id(self)] = self._fn_name
        return _NoKernel()

    def no_disk_cache(self: Any, tuning_key: Any, configs: Any, bench_fn: Any) -> bool:
        bench_fn()  # stand-in timings: never written
        return False

    cap = device.capability
    props = device.all_properties()
    fake_props = types.SimpleNamespace(
        name=device.name,
        major=cap[0],
        minor=cap[1],
        multi_processor_count=props["multiprocessor_count"],
        shared_memory_per_block_optin=props["max_shared_mem"],
        shared_memory_per_block=49152,
        total_memory=80 << 30,
        warp_size=32,
    )

    class _Device(contextlib.nullcontext):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__()

    triton.runtime.driver.set_active(_stand_in_driver(device))
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            _patched(
                torch.cuda,
                get_device_name=lambda *a, **k: device.name,
                get_device_capability=lambda *a, **k: cap,
                get_device_properties=lambda *a, **k: fake_props,
                current_device=lambda: 0,
                device_count=lambda: 1,
                device=_Device,
                synchronize=lambda *a, **k: None,
            )
        )
        stack.enter_context(_patched(jit.JITFunction, _do_compile=collect))
        if autotune == "all":
            stack.enter_context(_patched(Autotuner, check_disk_cache=no_disk_cache))
        _fla_cpu_tensors_as_device_zero()
        if progress:
            progress("running the workload against a stand-in CUDA driver")
        workload()
    t1 = time.perf_counter()

    threads = max(1, threads or os.cpu_count() or 1)
    log = CompileLog()
    errors: list[str] = []
    failed = 0
    too_large: list[str] = []  # past the target's shared memory: they cannot launch there
    max_shared = props["max_shared_mem"]

    done = 0
    step = max(1, len(jobs) // 10)  # a progress line every ~10 % of the specializations

    def tick() -> None:
        nonlocal done
        with log._lock:
            done += 1
            n = done
        if progress and (n % step == 0 or n == len(jobs)):
            progress(f"compiled {n}/{len(jobs)} specializations ({time.perf_counter() - t1:.0f} s)")

    def compile_one(job: tuple[Any, Any, Any, Any]) -> None:
        nonlocal failed
        fn, src, target, options = job
        try:
            kernel = fn.compile(src, target=target, options=options.__dict__)
        except Exception as exc:  # the autotuner skips configs that do not compile
            with log._lock:
                failed += 1
                if len(errors) < 10:
                    errors.append(f"{fn._fn_name}: {type(exc).__name__}: {str(exc)[:200]}")
            tick()
            return
        shared = int(getattr(kernel.metadata, "shared", 0) or 0)
        if shared > max_shared:
            with log._lock:
                too_large.append(f"{fn._fn_name} ({shared} bytes of shared memory)")
        tick()

    interrupted = False
    if compile:
        if progress:
            progress(f"compiling {len(jobs)} kernel specializations on {threads} threads")
        pool = ThreadPoolExecutor(threads)
        with log:
            try:
                list(pool.map(compile_one, list(jobs.values())))
            except KeyboardInterrupt:  # a time limit's SIGINT: keep what is compiled, report
                interrupted = True
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a second one, its group's)
            finally:  # on an interrupt the queued compiles are dropped, the running ones end
                pool.shutdown(wait=not interrupted, cancel_futures=True)
    summary = log.summary()
    return {
        "target": {"name": device.name, "capability": list(cap)},
        "autotune": autotune,
        "kernels": len(fn_names),
        "specializations": len(jobs),
        "compiled": summary["compiles"],
        "cached": summary["cache_hits"],
        "failed": failed,
        "errors": errors,
        # The autotuner skips these (``autotune="all"``); with ``"first"`` they would fail.
        "too_large": sorted(too_large),
        "threads": threads,
        "workload_seconds": round(t1 - t0, 3),
        "compile_seconds": round(time.perf_counter() - t1, 3),
        "compile_cpu_seconds": summary["compile_seconds"],
        "interrupted": interrupted,
    }
