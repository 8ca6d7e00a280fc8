"""Makes the shared test helpers in this folder importable (the folder is not a package), and
holds the fixtures several test files use."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def no_fla(monkeypatch):
    """fla blocked for the test: transformers then takes its torch fallbacks (fla's Triton
    kernels would fail on the CPU)."""
    monkeypatch.setitem(sys.modules, "fla", None)


@pytest.fixture
def hf_float64(monkeypatch, no_fla):
    """HF's float32 islands (norms, gated norm, router softmax, ...) lifted to float64 (same
    formulas), so the tree machinery is tested at float64 precision (``_hf_float64``)."""
    from _hf_float64 import lift_float32_islands

    lift_float32_islands(monkeypatch)
