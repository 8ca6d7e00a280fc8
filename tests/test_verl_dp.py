"""Two-process gloo data parallelism of the ``harts_fsdp2`` engine (CPU shim, tiny Qwen2).

Trees are split between ranks by the tree-aware balancer; every trajectory's log-probs come
back exactly once and equal the single-process run; gradients (gathered from the FSDP shards)
equal the single-process gradients.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("verl")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(world: int, args: dict, tmp_path, tag: str, timeout: float = 240.0) -> list[dict]:
    port = _free_port()
    procs, outs = [], []
    env = {**os.environ, "VERL_PLATFORM": "harts_cpu", "OMP_NUM_THREADS": "1"}
    for rank in range(world):
        out = str(tmp_path / f"{tag}_{rank}.pt")
        outs.append(out)
        call = {**args, "rank": rank, "world_size": world, "port": port, "out_path": out}
        code = (
            "import json,sys; from harts_verl.workers.testing import dp_worker; "
            "dp_worker(**json.loads(sys.argv[1]))"
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(call)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    errors = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                errors.append(err.decode(errors="replace")[-3000:])
    finally:
        for p in procs:  # clean up by pid on timeout/failure
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert not errors, "\n".join(errors)
    return [torch.load(o) for o in outs]


def test_two_rank_dp_equals_single_process(tmp_path):
    from harts_verl.workers.balance import tree_balanced_partition
    from harts_verl.workers.testing import save_tiny_model

    rng = np.random.default_rng(11)
    seqs, pls = [], []
    for _ in range(3):  # three GRPO-style trees of 4 samples with shared response prefixes
        p = rng.integers(0, 64, int(rng.integers(8, 16))).tolist()
        r0 = rng.integers(0, 64, 6).tolist()
        for k in range(4):
            tail = rng.integers(0, 64, int(rng.integers(3, 9))).tolist()
            seqs.append(p + (r0[: 2 + k] if k % 2 else []) + tail)
            pls.append(len(p))
    seqs.append(rng.integers(0, 64, 12).tolist())  # a lone trajectory: 13 total → pad to 14
    seqs.append([*seqs[-1][:7], 1, 2, 3])
    pls += [5, 5]
    path = save_tiny_model("qwen2", str(tmp_path / "qwen2"), seed=4)
    parts = tree_balanced_partition(seqs, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(seqs)))
    base = {"model_path": path, "sequences": seqs, "prompt_lengths": pls}
    single = _launch(1, {**base, "parts": [list(range(len(seqs)))]}, tmp_path, "single")[0]
    ranks = _launch(2, {**base, "parts": parts}, tmp_path, "dp")

    seen = [i for r in ranks for i in r["indices"]]
    assert sorted(seen) == list(range(len(seqs)))  # each trajectory exactly once
    for r in ranks:
        for i, lp in zip(r["indices"], r["log_probs"]):
            ref = single["log_probs"][i]
            assert lp.shape == ref.shape
            assert float((lp[:-1] - ref[:-1]).abs().max()) <= 1e-6
    for r in ranks:
        assert abs(r["grad_norm"] - single["grad_norm"]) <= 1e-6 * single["grad_norm"]
        for name, g in single["grads"].items():
            assert float((r["grads"][name] - g).abs().max()) <= 1e-6 * max(
                float(g.abs().max()), 1e-3
            ), name
