"""GPU tests: collected only with a CUDA device (skipped otherwise), small shapes.

Set ``HARTS_GPU_REPORT=/path/file.json`` to have the session write the numbers the tests measured
(error ratios, cosines, which comparisons were bitwise) for ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

_REPORT: dict[str, Any] = {}


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
    path = os.environ.get("HARTS_GPU_REPORT")
    if path and _REPORT:
        with open(path, "w") as f:
            json.dump(_REPORT, f, indent=2, sort_keys=True, default=str)


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda")
