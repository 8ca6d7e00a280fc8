"""GPU tests: collected only with a CUDA device (skipped otherwise), small shapes.

Set ``HARTS_GPU_REPORT=/path/file.json`` to have the session write the numbers the tests measured
(error ratios, cosines, which comparisons were bitwise) for ``scripts/gpu_check.sh``.

fla's Triton kernels run their first autotune config (``HARTS_TRITON_AUTOTUNE``, default
``first``: these are correctness tests, and autotuning every config of every kernel family would
compile and time hundreds of configs); the report's ``triton`` entry counts the compiles the
session still made (``tests/gpu/precompile_cases.py`` compiles the cases' kernels ahead).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest
import torch

_REPORT: dict[str, Any] = {}
_COMPILES: list[Any] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    if not torch.cuda.is_available():
        return
    mode = os.environ.get("HARTS_TRITON_AUTOTUNE", "first")
    try:
        from harts_verl.ops.backends.triton_cache import CompileLog, limit_autotune

        limit_autotune(mode)
        _COMPILES.append(CompileLog().install())
        _REPORT["triton"] = {"autotune": mode}
    except (ImportError, RuntimeError, ValueError) as exc:  # no triton, an unknown one or mode
        _REPORT["triton"] = {"unavailable": f"{type(exc).__name__}: {exc}"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu" in str(item.path).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def report() -> dict[str, Any]:
    """Shared dict of measurements; written to ``$HARTS_GPU_REPORT`` at the end."""
    return _REPORT


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _COMPILES:
        _REPORT["triton"].update(_COMPILES[0].summary())
    path = os.environ.get("HARTS_GPU_REPORT")
    if path and _REPORT:
        with open(path, "w") as f:  # strict JSON: a NaN / inf measurement as its text
            json.dump(_strict(_REPORT), f, indent=2, sort_keys=True, default=str)


def _strict(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by its text (``"nan"``, ``"inf"``)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strict(v) for v in obj]
    return obj


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda")
