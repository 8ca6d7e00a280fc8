"""Set-up shared by the tests that build veRL engines on the CPU."""

from __future__ import annotations

import os
import sys
from types import ModuleType

import numpy as np


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


def assert_stock_metrics(stock: dict, tree: dict, *, tol: float) -> None:
    """Every metric the stock engine's call reports (veRL ``Metric`` or plain lists, one value
    per micro-batch; ``grad_norm`` left to the caller) is in ``tree`` with the same aggregation,
    count and values (``harts.stock_metrics``: veRL's own micro-batches' means, not the tree
    micro-batches')."""
    for key, ref in stock.items():
        if key == "grad_norm":
            continue
        assert key in tree, key
        got = tree[key]
        assert type(got) is type(ref), key
        if hasattr(ref, "aggregation"):  # a veRL Metric, else a plain list of values
            assert ref.aggregation == got.aggregation, key
            ref, got = ref.values, got.values
        a, b = np.asarray(ref, float), np.asarray(got, float)
        assert a.shape == b.shape, (key, a, b)
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol, err_msg=key)
