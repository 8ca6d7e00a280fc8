"""transformers >= 5.23 as an oracle for the converted source formats (Kimi-Linear, Ling 3):
``_source_oracle.py`` run in a subprocess whose ``PYTHONPATH`` puts that transformers first.
``make test`` installs it into ``.oracles/transformers`` (``HARTS_ORACLE_TRANSFORMERS``) and requires it
(``HARTS_REQUIRE_ORACLES=1``); elsewhere the oracle tests skip, saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def oracle_path() -> str:
    path = os.environ.get(
        "HARTS_ORACLE_TRANSFORMERS", os.path.join(HERE, "..", ".oracles", "transformers")
    )
    if not os.path.isdir(os.path.join(path, "transformers")):
        why = f"transformers >= 5.23 for the source-format oracles not installed at {path!r}"
        if os.environ.get("HARTS_REQUIRE_ORACLES") == "1":
            pytest.fail(why + " (make test installs it)")
        pytest.skip(why + " (make test installs it)")
    return path


def run_oracle(*args: str) -> None:
    """Run ``_source_oracle.py`` with ``args``; an AssertionError with its stderr on failure."""
    env = dict(os.environ, PYTHONPATH=oracle_path(), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_source_oracle.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode:
        raise AssertionError(f"oracle failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def build_oracle(
    out: Path, config: dict, sequences: list[list[int]], seed: int = 3
) -> tuple[Path, list[torch.Tensor]]:
    """transformers' model of ``config`` (its ``model_type``), random float64 weights: its
    checkpoint (``out/checkpoint``, the source's format), its in-memory state dict
    (``out/inmemory``) and its logits for ``sequences``; returns (out, logits)."""
    oracle_path()
    spec = {"seed": seed, "config": dict(config), "sequences": sequences}
    (out / "spec.json").write_text(json.dumps(spec))
    run_oracle("build", str(out / "spec.json"), str(out))
    return out, torch.load(out / "logits.pt")
