"""CPU platform shim for veRL (tests and the local CPU demo only; never imported in GPU runs).

veRL 0.9.1 resolves its device through ``verl.plugin.platform`` (``cuda``/``npu``/``rocm``
only) and registers its FSDP engines for ``cuda``/``npu`` only. :func:`install_cpu_platform`
makes a process run veRL's engine path on CPU:

* registers and selects a :class:`PlatformCPU` (device ``"cpu"``, collective backend ``gloo``,
  ``current_device() -> "cpu"`` so every ``.to(get_device_id())`` stays on CPU);
* registers veRL's stock ``FSDPEngineWithLMHead`` (and the critic's ``FSDPEngineWithValueHead``)
  for ``fsdp``/``fsdp2`` on device ``cpu`` (the parity references of our tests; FSDP2 works on
  CPU with gloo, FSDP1 does not), and loads value models without flash attention;
* builds the FSDP2 CPU offload policy that veRL gives every forward-only engine (the reference
  policy) without pinned memory, which needs an accelerator.

A few veRL modules read the device name at import time (``device_name``, e.g. the FSDP engine's
Ulysses device mesh); those already imported are pointed at ``cpu`` too, so it may be called
after ``import verl``. It is idempotent. The ``harts_fsdp2`` engine itself registers for ``cpu``
through the plugin, so only the stock reference needs this shim.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

__all__ = ["install_cpu_platform"]

_INSTALLED = False


def _platform_cls() -> type:
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    @PlatformRegistry.register(platform="harts_cpu")
    class PlatformCPU(PlatformBase):
        """veRL platform for CPU-only processes: device ``cpu``, collectives over gloo."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return torch.cpu

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> Any:  # veRL passes it to ``.to()``; "cpu" keeps it there
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


def _mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
    """(free, total) host memory in bytes, like ``torch.cuda.mem_get_info``."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError):
        return 0, 0


def _patch_process_group_backend() -> None:
    """veRL's ``initialize_global_process_group_ray`` defaults the backend to
    ``f"cpu:gloo,{device}:{ccl}"``, i.e. ``cpu:gloo,cpu:gloo`` on CPU, which torch rejects
    (duplicate device type); default it to plain ``gloo``. ``engine_workers`` imports the
    function by name, so patch it there too when already imported."""
    import sys

    from verl.utils import distributed

    orig = distributed.initialize_global_process_group_ray
    if getattr(orig, "_harts_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return orig(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._harts_cpu = True  # type: ignore[attr-defined]
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
    for name in ("verl.workers.engine_workers", "verl.checkpoint_engine.base"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "initialize_global_process_group_ray"):
            mod.initialize_global_process_group_ray = initialize_global_process_group_ray


def install_cpu_platform() -> None:
    """Select the CPU platform in this process and register veRL's stock FSDP engines for
    device ``cpu`` (idempotent). Sets ``VERL_PLATFORM=harts_cpu`` for child processes."""
    global _INSTALLED
    if _INSTALLED:
        return
    os.environ["VERL_PLATFORM"] = "harts_cpu"
    from verl.plugin.platform import set_platform

    if _INSTALLED:  # the import above ran verl's plugins, whose harts plugin installed it
        return
    set_platform(_platform_cls()())
    # torch.cpu lacks torch.cuda's memory/cache/RNG helpers that veRL calls on its device module.
    _zero = lambda *a, **k: 0  # noqa: E731
    _none = lambda *a, **k: None  # noqa: E731
    helpers = {
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
        "memory_allocated": _zero,
        "memory_reserved": _zero,
        "memory_stats": lambda *a, **k: {},
        "mem_get_info": _mem_get_info,
        "empty_cache": _none,
        "ipc_collect": _none,
        "reset_peak_memory_stats": _none,
        "reset_accumulated_memory_stats": _none,
        "set_per_process_memory_fraction": _none,
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
    }
    for name, fn in helpers.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    _patch_process_group_backend()
    _patch_import_time_device_names()
    _patch_value_model_loader()
    _patch_offload_policy()
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import (
        FSDPEngineWithLMHead,
        FSDPEngineWithValueHead,
    )

    for model_type, cls in (
        ("language_model", FSDPEngineWithLMHead),
        ("value_model", FSDPEngineWithValueHead),
    ):
        registry = EngineRegistry._engines.setdefault(model_type, {})
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in registry.get(backend, {}):
                EngineRegistry.register(model_type, backend=backend, device="cpu")(cls)
    _INSTALLED = True


# veRL modules that read ``get_device_name()`` into a module-level ``device_name`` on import
_DEVICE_NAME_MODULES = (
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.engine.torchtitan.transformer_impl",
    "verl.experimental.separation.engine_workers",
    "verl.utils.megatron.router_replay_utils",
)


def _patch_import_time_device_names() -> None:
    """Point the module-level ``device_name`` of veRL modules imported before this shim (the
    auto-detected platform's, ``cuda`` on a host without one) at ``cpu``: the FSDP engine
    builds its Ulysses device mesh from it (``torch._C`` has no ``_cuda_setDevice`` on CPU)."""
    import sys

    for name in _DEVICE_NAME_MODULES:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "device_name", "cpu") != "cpu":
            mod.device_name = "cpu"


def _patch_value_model_loader() -> None:
    """veRL's ``load_valuehead_model`` asks for ``flash_attention_2`` (a CUDA kernel) and, when
    that fails, for trl; on the CPU load the token classifier with the attention implementation
    of its config instead (SDPA by default). The engine imports the function at call time."""
    from verl.utils import model as verl_model

    if getattr(verl_model.load_valuehead_model, "_harts_cpu", False):
        return

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            trust_remote_code=trust_remote_code,
        )

    load_valuehead_model._harts_cpu = True  # type: ignore[attr-defined]
    verl_model.load_valuehead_model = load_valuehead_model


def _patch_offload_policy() -> None:
    """veRL's FSDP engine shards a forward-only model (the reference policy) with
    ``CPUOffloadPolicy(pin_memory=True)``, and pinning host memory needs an accelerator
    (``RuntimeError: Cannot access accelerator device``): on the CPU the policy is built
    unpinned (the parameters live in host memory anyway)."""
    from verl.workers.engine.fsdp import transformer_impl

    base = transformer_impl.CPUOffloadPolicy
    if base is None or getattr(base, "_harts_cpu", False):
        return

    class CPUOffloadPolicy(base):  # type: ignore[misc, valid-type]
        _harts_cpu = True

        def __init__(self, pin_memory: bool = True) -> None:
            super().__init__(pin_memory=False)

    transformer_impl.CPUOffloadPolicy = CPUOffloadPolicy
