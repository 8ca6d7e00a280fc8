"""veRL plugin entry point (group ``verl.plugins``): registers engine backend ``harts_fsdp2``,
the native model type ``harts_hybrid`` with transformers' Auto classes,
the agent loop ``harts_tool_agent`` (with the ``harts_calc`` tool format of the local recipe)
and the CPU rollout server ``harts_hf`` (:mod:`harts_verl.workers.rollout`).

``verl/__init__.py`` imports every entry point of the group in every process that imports verl
(Ray workers included) but logs a failing plugin only at DEBUG; this module logs its own
failures at WARNING with the reason, so a broken install is visible. When the environment
selects the CPU platform shim (``VERL_PLATFORM=harts_cpu``, tests and the CPU demo only) the
shim is installed first; GPU runs never import it.
"""

from __future__ import annotations

import importlib
import logging
import os

__all__ = ["REGISTERED", "register", "register_rollout"]

logger = logging.getLogger("harts_verl.workers.plugin")

REGISTERED: dict[str, bool] = {"harts_fsdp2": False, "harts_tool_agent": False, "harts_hf": False}

# name -> modules to import; a "module:function" entry also calls that function.
_ROLLOUT_MODULES = {
    "harts_tool_agent": (
        "harts_verl.workers.rollout.agent_loop",
        "harts_verl.workers.rollout.local_task",
    ),
    "harts_hf": ("harts_verl.workers.rollout.cpu_server:register",),
}


def register_rollout() -> bool:
    """Import the rollout modules (agent loop ``harts_tool_agent``, tool format ``harts_calc``);
    on failure logs a WARNING with the reason and returns False."""
    ok = True
    for name, modules in _ROLLOUT_MODULES.items():
        try:
            for entry in modules:
                module, _, func = entry.partition(":")
                mod = importlib.import_module(module)
                if func:
                    getattr(mod, func)()
        except Exception as exc:
            logger.warning("harts-verl: could not register %r: %r", name, exc)
            ok = False
            continue
        REGISTERED[name] = True
    return ok


def register() -> bool:
    """Import the engine module (its decorator registers ``harts_fsdp2`` for cuda and cpu) and
    register the native model (``model_type: harts_hybrid``) with transformers' Auto classes, so
    veRL's engines load it from ``model.path``. Returns True on success; on failure logs a
    WARNING with the reason and returns False."""
    try:
        if os.environ.get("VERL_PLATFORM", "").strip().lower() == "harts_cpu":
            from harts_verl.workers.cpu_platform import install_cpu_platform

            install_cpu_platform()
        importlib.import_module("harts_verl.models.hf")  # registers harts_hybrid on import
        importlib.import_module("harts_verl.workers.engine")  # registers on import
    except Exception as exc:
        logger.warning("harts-verl: could not register engine backend 'harts_fsdp2': %r", exc)
        return False
    REGISTERED["harts_fsdp2"] = True
    return True


register()
register_rollout()
