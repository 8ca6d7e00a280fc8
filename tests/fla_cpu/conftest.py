"""fla's real kernels on the CPU (Triton interpreter): collected by ``make test-fla-cpu``, which
builds ``.venv-fla`` (CPU torch, triton, fla-core; no transformers) and sets
``HARTS_REQUIRE_FLA=1``, which turns a missing or broken fla into a collection error. Elsewhere fla
is not importable and these tests are skipped with that reason."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

try:
    if importlib.util.find_spec("fla") is None:
        raise ImportError("fla is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":  # read when fla's kernels are decorated
        raise RuntimeError("TRITON_INTERPRET=1 is not set")
    import _triton_interpret

    _triton_interpret.install()
    from harts_verl.ops.backends.fla_linear import FlaLinearKernel, load_fla_ops

    with warnings.catch_warnings():  # fla's notice that it runs without a GPU, torch.jit's
        warnings.filterwarnings("ignore", "Triton is not supported", UserWarning)
        warnings.filterwarnings("ignore", "`torch.jit", DeprecationWarning)
        _KERNELS = load_fla_ops()
    _WHY = ""
except Exception as exc:  # fla/triton missing (the default .venv) or an unsupported triton
    _KERNELS = None
    _WHY = f"fla on the Triton interpreter unavailable ({type(exc).__name__}: {exc}); run `make test-fla-cpu`"
    if os.environ.get("HARTS_REQUIRE_FLA") == "1":
        raise RuntimeError(_WHY) from exc


def pytest_configure(config: pytest.Config) -> None:
    # numpy overflow in lanes the kernels mask out (exp2 of padded gates): expected under the
    # interpreter.
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _KERNELS is not None:
        return
    skip = pytest.mark.skip(reason=_WHY)
    for item in items:
        if "tests/fla_cpu" in str(item.path).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fla_kernel():
    """fla's ``chunk_kda`` / ``chunk_gated_delta_rule`` behind our kernel signature (explicit:
    float64 raises, no fallback)."""
    return FlaLinearKernel(*_KERNELS, float64_fallback=False)


@pytest.fixture(scope="session")
def fla_channels_kernel():
    """The same kernels with scalar gates routed through ``chunk_kda`` / ``chunk_gla`` (the
    route taken on Hopper with Triton in [3.4.0, 3.7.1), where fla refuses its scalar-gate
    backward)."""
    return FlaLinearKernel(*_KERNELS, float64_fallback=False, scalar_gate="channels")
