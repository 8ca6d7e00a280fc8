"""fla's real Python code against a stand-in sm_90 (Hopper) driver, without a GPU
(:mod:`harts_verl.ops.backends.triton_cache`), each in a subprocess without the Triton
interpreter (fla reads the GPU at import):

- fla 0.6 refuses its scalar-gate backward on Hopper with this Triton (3.6): GatedDeltaNet
  through ``chunk_gated_delta_rule`` raises fla's RuntimeError, and the route
  :class:`~harts_verl.ops.backends.fla_linear.FlaLinearKernel` takes there
  (``chunk_kda`` with the gate broadcast) passes forward and backward;
- ``harts-verl precompile`` compiles a model's kernels for sm_90 with Triton's own ptxas into
  the cache directory, and a second run finds every one of them there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def _run(args: list[str], tmp_path: Path, timeout: int = 600) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout[res.stdout.index("{") :])


GUARD = """
import json, torch
from _delta_rule_cases import delta_rule_inputs
from harts_verl.ops.backends.triton_cache import DeviceInfo, compile_ahead
from harts_verl.precompile import fla_kernel_for

res = {}

def workload():
    from harts_verl.ops.backends.fla_linear import FlaLinearKernel, load_fla_ops

    from fla.utils import check_shared_mem  # CPU tensors (index None) read as the GPU's (0)

    res["shared"] = [check_shared_mem("hopper", None), check_shared_mem("hopper", 0)]
    auto = fla_kernel_for(DeviceInfo.hopper())
    res["route"] = auto.scalar_gate
    for name, kern in (("native", FlaLinearKernel(*load_fla_ops(), scalar_gate="native")),
                       ("auto", auto)):
        q, k, v, g, b = delta_rule_inputs(80, False, h=1, hv=2, d=16)
        xs = [x.requires_grad_(True) for x in (q, k, v, g, torch.sigmoid(b))]
        try:
            out = kern(*xs, cu_seqlens=torch.tensor([0, 30, 80]), chunk_size=64)
            (out.o.sum() + out.final_state.sum()).backward()
            res[name] = "ok" if xs[3].grad is not None else "no gate gradient"
        except RuntimeError as exc:
            res[name] = str(exc)

out = compile_ahead(workload, device=DeviceInfo.hopper(), autotune="first", compile=False)
print(json.dumps({**res, "specializations": out["specializations"], "kernels": out["kernels"]}))
"""


def test_hopper_guard_and_the_scalar_gate_route(tmp_path):
    got = _run(["-c", GUARD], tmp_path)
    assert got["route"] == "channels", got
    assert "Triton >= 3.4.0 and < 3.7.1 on Hopper" in got["native"], got
    assert got["auto"] == "ok", got
    assert got["specializations"] > 0 and got["kernels"] > 0, got
    assert got["shared"] == [True, True], got  # fla's tile choices: the H100's, not the CPU's


def test_precompile_fills_the_cache_and_hits_it(tmp_path):
    args = [
        "-m",
        "harts_verl.cli",
        "precompile",
        "--preset",
        "tiny",
        "--target",
        "h100",
        "--autotune",
        "first",
        "--jobs",
        "2",
        "--no-progress",
    ]
    first = _run(args, tmp_path)
    assert first["target"]["capability"] == [9, 0] and first["scalar_gate"] == "channels"
    assert first["specializations"] > 10 and first["failed"] == 0, first
    assert first["compiled"] == first["specializations"] and first["cached"] == 0, first
    assert first["too_large"] == [], first  # the first configs fit an H100's shared memory
    assert first["compact_tokens"] < first["semantic_tokens"]
    assert any((tmp_path / "triton").rglob("*.cubin")), "no sm_90 binaries in the cache"
    second = _run(args, tmp_path)
    assert second["specializations"] == first["specializations"]
    assert second["cached"] == second["specializations"] and second["compiled"] == 0, second


INTERRUPT = """
import json, torch
import triton.compiler

real, calls = triton.compiler.compile, []

def compile_until_interrupted(*args, **kwargs):  # the second compile meets a time limit's SIGINT
    calls.append(1)
    if len(calls) == 2:
        raise KeyboardInterrupt
    return real(*args, **kwargs)

# JITFunction binds triton.compiler.compile when it first runs (in the workload)
triton.compiler.compile = compile_until_interrupted
from _delta_rule_cases import delta_rule_inputs
from harts_verl.ops.backends.triton_cache import DeviceInfo, compile_ahead
from harts_verl.precompile import fla_kernel_for

def workload():
    q, k, v, g, b = delta_rule_inputs(80, False, h=1, hv=2, d=16)
    xs = [x.requires_grad_(True) for x in (q, k, v, g, torch.sigmoid(b))]
    out = fla_kernel_for(DeviceInfo.hopper())(*xs, cu_seqlens=torch.tensor([0, 30, 80]), chunk_size=64)
    (out.o.sum() + out.final_state.sum()).backward()

out = compile_ahead(workload, device=DeviceInfo.hopper(), autotune="first", threads=1)
print(json.dumps({**out, "calls": len(calls)}))
"""


def test_an_interrupted_compile_still_reports(tmp_path):
    """A SIGINT during the compiles (a time limit's) stops them: the queued ones are dropped
    and the summary still comes back, ``interrupted`` and counting what was compiled."""
    got = _run(["-c", INTERRUPT], tmp_path)
    assert got["interrupted"] is True, got
    assert got["compiled"] == 1 and got["calls"] <= 3 < got["specializations"], got
