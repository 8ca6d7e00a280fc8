"""Set-up shared by the tests that build veRL engines on the CPU."""

from __future__ import annotations

import os
import sys
from types import ModuleType


def verl_cpu_process() -> ModuleType:
    """Prepare this process for veRL engines on the CPU (idempotent): fla blocked (no fast paths,
    no triton), our CPU platform shim installed, the harts plugin registered, a world-size-1 gloo
    group. Returns :mod:`harts_verl.workers.testing`."""
    sys.modules["fla"] = None
    os.environ["VERL_PLATFORM"] = "harts_cpu"
    from harts_verl.workers.cpu_platform import install_cpu_platform

    install_cpu_platform()
    from harts_verl.workers import plugin, testing

    assert plugin.register()
    testing.init_process_group(port=29000 + os.getpid() % 2000)
    return testing
