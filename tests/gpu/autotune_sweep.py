"""Every autotune config of fla's KDA kernels vs the torch reference, on this GPU.

fla's Triton kernels have had Hopper miscompiles in single autotune configs (fla #640: gated
``chunk_bwd_dqkwg``; #984: ``prepare_wy_repr_bwd`` at ``num_warps=4``): a job that autotunes
may pick one. This runs fla's ``chunk_kda`` forward + backward at the bench model's heads
(``tests/_gpu_cases.py::sweep_case``: 8 heads of 128, bf16, chunk 64, varlen, initial states,
a gradient into the final state) once per admissible config of each autotuned kernel it reaches
(that kernel forced to the config, every other one at its first), and compares outputs, final
states and every gradient with the float32 torch reference on the same bf16 inputs.

Prints JSON: ``{"kernels": {name: {"configs", "ran", "skipped", "worst": {tensor: ratio}}},
"baseline": {tensor: ratio}, "bad": [...], "runs", "unrun"}`` (``unrun``: configs left when
``--budget-s`` ran out, e.g. with a cold compile cache); exit status 1 when a config is bad (an
error ratio above ``max(tolerance, 4 × the first config's)``; tolerances 8e-3 forward, 2e-2
gradients). Runs in a process of its own (``tests/gpu/test_gpu_backends.py`` spawns it): an
illegal memory access would poison the CUDA context. The GPU check compiles these configs ahead
(``tests/gpu/precompile_cases.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared cases

TOL_FWD, TOL_BWD = 8e-3, 2e-2
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


class _Pruned(Exception):
    """The forced config is not admissible for these shapes (the kernel's own pruning)."""


def run_sweep(
    kern,
    inputs,
    h0,
    cu,
    kw: dict,
    *,
    kernels: tuple[str, ...] | None = None,
    budget_s: float | None = None,
) -> dict:
    """The sweep of ``kern`` (a linear kernel) on ``inputs`` (q, k, v, g, beta), initial states
    ``h0`` and ``cu`` (see the module doc); ``kernels``: only the autotuned kernels of these
    names (all when None); ``budget_s``: stop starting configs after that many seconds (the
    configs left are counted in ``unrun``). Needs
    :func:`~harts_verl.ops.backends.triton_cache.limit_autotune` ``("first")`` active. Returns the
    JSON-ready result (``forced``: per kernel, the configs the forced runs actually used)."""
    import time

    import torch
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import OutOfResources, PTXASError

    # What the autotuner itself skips (a config past the GPU's resources, or one that does not
    # compile for these shapes).
    skipped_errors = (OutOfResources, PTXASError, CompileTimeAssertionFailure)
    t0 = time.perf_counter()
    from _delta_rule_cases import err_ratio
    from triton.runtime.autotuner import Autotuner

    from harts_verl.ops.linear_attention import chunk_delta_rule_varlen

    device = cu.device
    gen = torch.Generator(device=device).manual_seed(0)

    def run(fn, xs_in):
        xs = [x.detach().clone().requires_grad_(True) for x in xs_in]
        out = fn(*xs[:5], cu_seqlens=cu, initial_state=xs[5], **kw)
        ((out.o.float() * do).sum() + (out.final_state * dht).sum()).backward()
        return [out.o.float(), out.final_state.float(), *(x.grad.float() for x in xs)]

    o_shape = (inputs[0].shape[0], inputs[2].shape[1], inputs[2].shape[2])
    do = torch.randn(o_shape, device=device, generator=gen)
    dht = torch.randn(h0.shape, device=device, generator=gen)
    ref = run(chunk_delta_rule_varlen, [x.float() for x in (*inputs, h0)])

    def errors(got) -> dict[str, float]:
        return {n: err_ratio(a, b) for n, a, b in zip(NAMES, got, ref)}

    tuners: dict[int, Autotuner] = {}
    orig_run, orig_prune = Autotuner.run, Autotuner.prune_configs

    def recording_run(self, *args, **kwargs):
        tuners.setdefault(id(self), self)
        return orig_run(self, *args, **kwargs)

    Autotuner.run = recording_run
    try:
        baseline = errors(run(kern, (*inputs, h0)))
    finally:
        Autotuner.run = orig_run
    forced: dict[str, object] = {}

    def forcing_prune(self, kwargs):
        pruned = orig_prune(self, kwargs)
        if self is forced.get("tuner"):
            if forced["config"] not in pruned:
                raise _Pruned()
            return [forced["config"]]
        return pruned

    out: dict = {
        "baseline": baseline,
        "kernels": {},
        "bad": [],
        "runs": 0,
        "unrun": 0,
        "forced": {},
    }
    Autotuner.prune_configs = forcing_prune
    try:
        for tuner in tuners.values():
            name = tuner.base_fn.__name__
            if kernels is not None and name not in kernels:
                continue
            entry = {"configs": len(tuner.configs), "ran": 0, "skipped": 0, "worst": {}}
            out["kernels"][name] = entry
            used = out["forced"].setdefault(name, [])
            if len(tuner.configs) < 2:
                continue
            for config in tuner.configs:
                if budget_s is not None and time.perf_counter() - t0 > budget_s:
                    out["unrun"] += 1
                    continue
                forced.update(tuner=tuner, config=config)
                for t in tuners.values():
                    t.cache.clear()
                try:
                    errs = errors(run(kern, (*inputs, h0)))
                except (_Pruned, *skipped_errors):
                    entry["skipped"] += 1
                    continue
                except Exception as exc:  # a config that faults: bad
                    out["bad"].append({"kernel": name, "config": str(config), "error": repr(exc)})
                    entry["skipped"] += 1
                    continue
                used.append(str(tuner.best_config))
                entry["ran"] += 1
                out["runs"] += 1
                for n, e in errs.items():
                    entry["worst"][n] = max(entry["worst"].get(n, 0.0), e)
                    tol = TOL_FWD if n in ("o", "final_state") else TOL_BWD
                    if e > max(tol, 4 * baseline[n]):
                        out["bad"].append(
                            {"kernel": name, "config": str(config), "tensor": n, "ratio": e}
                        )
    finally:
        Autotuner.prune_configs = orig_prune
        forced.clear()
    out["baseline_bad"] = [
        n for n, e in baseline.items() if e > (TOL_FWD if n in ("o", "final_state") else TOL_BWD)
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch
    from _gpu_cases import sweep_case

    from harts_verl.ops.backends import linear_kernel
    from harts_verl.ops.backends.triton_cache import limit_autotune

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=None, help="stop starting configs after")
    args = p.parse_args(argv)
    cuda = torch.device("cuda")
    kern = linear_kernel("fla", cuda)
    limit_autotune("first")  # after the kernel loads: it applies $HARTS_TRITON_AUTOTUNE
    inputs, h0, cu, kw = sweep_case(cuda)
    out = run_sweep(kern, inputs, h0, cu, kw, budget_s=args.budget_s)
    print(json.dumps(out, indent=2, default=str))
    return 1 if out["bad"] or out["baseline_bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
