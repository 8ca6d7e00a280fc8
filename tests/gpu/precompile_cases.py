"""Compile the GPU tests' fla kernels ahead of time, in parallel, into Triton's cache.

``scripts/gpu_check.sh`` runs ``python tests/gpu/precompile_cases.py`` before ``pytest tests/gpu``:
the tests' fla calls (``tests/_gpu_cases.py``: the same shapes, dtypes and options) run once on
the CPU against a stand-in CUDA driver, and every kernel specialization they reach is compiled
for the visible GPU (``--target current``) or an sm_90 stand-in (``--target h100``, any machine)
with ``--autotune first`` (what the GPU tests run) or ``all``; then every autotune config of the
KDA calls ``tests/gpu/autotune_sweep.py`` runs. Prints ``{"cases": ..., "sweep": ...}``, the JSON
summaries of :func:`harts_verl.ops.backends.triton_cache.compile_ahead`. Not a test module (no ``test_``
prefix); needs fla and triton.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="current", choices=("current", "h100"))
    p.add_argument("--autotune", default="first", choices=("all", "first"))
    p.add_argument("--jobs", type=int, default=None, help="compile threads (default: all cores)")
    args = p.parse_args(argv)

    import torch

    from harts_verl.ops.backends.triton_cache import compile_ahead
    from harts_verl.precompile import fla_kernel_for, target_device

    device = target_device(args.target)
    cpu = torch.device("cpu")

    def workload() -> None:
        from _gpu_cases import fla_workload

        fla_workload(fla_kernel_for(device), cpu)

    def sweep() -> None:
        from _gpu_cases import sweep_workload

        sweep_workload(fla_kernel_for(device), cpu)

    out = {
        "cases": compile_ahead(workload, device=device, autotune=args.autotune, threads=args.jobs)
    }
    if out["cases"]["interrupted"]:  # a time limit: no time for the sweep either
        out["sweep"] = {"skipped": "the cases' compiles were interrupted", "failed": 0}
    else:
        # autotune_sweep.py runs every config of the KDA kernels at the bench model's heads
        out["sweep"] = compile_ahead(sweep, device=device, autotune="all", threads=args.jobs)
    print(json.dumps(out, indent=2))
    bad = out["cases"]["failed"] or out["sweep"]["failed"] or out["cases"]["interrupted"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
