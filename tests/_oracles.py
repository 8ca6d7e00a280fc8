"""transformers >= 5.23 as an oracle for the converted source formats (Kimi-Linear, Ling 3):
``_source_oracle.py`` run in a subprocess whose ``PYTHONPATH`` puts that transformers first.
``make test`` installs it into ``.oracles/transformers`` (``HARTS_ORACLE_TRANSFORMERS``) and requires it
(``HARTS_REQUIRE_ORACLES=1``); elsewhere the oracle tests skip, saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def shared_prefix_sequences(seed: int, vocab: int) -> list[list[int]]:
    """Four trajectories over tokens [3, vocab): a 70-token prompt shared by all, a 30-token turn
    shared by two whose tails fork after it (inside a 64-token chunk), one forking right after
    the prompt (past the first chunk) and one that is a 50-token prefix of the prompt."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (70,), generator=g).tolist()
    turn = torch.randint(3, vocab, (30,), generator=g).tolist()
    tails = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (25, 40, 9)]
    return [prompt + turn + tails[0], prompt + turn + tails[1], prompt + tails[2], prompt[:50]]


def reference_log_probs(seq: list[int], logits: torch.Tensor) -> torch.Tensor:
    """``log p(seq[t+1] | seq[<=t])`` from the oracle's logits ``[L, V]`` of ``seq``."""
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def max_logit_error(model: Any, sequences: list[list[int]], ref: list[torch.Tensor]) -> float:
    """Largest |logit difference| of the HF-style ``model`` (each sequence run alone) vs ``ref``."""
    err = 0.0
    with torch.no_grad():
        for seq, r in zip(sequences, ref, strict=True):
            got = model(input_ids=torch.tensor([seq])).logits[0]
            err = max(err, (got - r).abs().max().item())
    return err


def assert_tree_mode_matches(
    out: Path, sequences: list[list[int]], ref: list[torch.Tensor], tmp: Path
) -> None:
    """The oracle's checkpoint converted once to harts_hybrid, run in tree mode over
    ``sequences`` (they share prefixes): the oracle's per-trajectory log-probs within 1e-10."""
    from harts_verl.models import checkpoints
    from harts_verl.models.hf import HartsHybridForCausalLM
    from harts_verl.runtime import TreeRunner

    harts = str(tmp / "harts")
    checkpoints.convert_checkpoint(str(out / "checkpoint"), harts)
    model = HartsHybridForCausalLM.from_pretrained(harts, dtype=torch.float64).model
    runner = TreeRunner(model, chunk_size=16)
    lps = runner.log_probs(sequences)
    assert runner.last_stats.compact_tokens < sum(len(s) for s in sequences)
    for seq, lp, r in zip(sequences, lps, ref, strict=True):
        torch.testing.assert_close(lp, reference_log_probs(seq, r), rtol=0, atol=1e-10)


def assert_round_trip_in_transformers(
    out: Path, ref: list[torch.Tensor], tmp: Path, to: str
) -> None:
    """Converted to harts_hybrid and back to ``to``, the checkpoint loads in transformers and
    gives bitwise the oracle's logits."""
    from harts_verl.models import checkpoints

    harts, back = str(tmp / "harts_rt"), str(tmp / "back")
    checkpoints.convert_checkpoint(str(out / "checkpoint"), harts)
    summary = checkpoints.convert_checkpoint(harts, back, to=to)
    assert summary["to"] == to
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["model_type"] == to
    run_oracle("logits", str(out / "spec.json"), back, str(tmp / "back.pt"))
    for a, b in zip(torch.load(tmp / "back.pt"), ref, strict=True):
        assert torch.equal(a, b)


def assert_verl_engine_matches(
    out: Path,
    sequences: list[list[int]],
    prompt_lengths: list[int],
    ref: list[torch.Tensor],
    tmp: Path,
    source_name: Callable[[str, Any], str] = lambda name, src: name,
) -> None:
    """veRL with ``model.path`` = the oracle's checkpoint (what the rollout serves) and
    ``model.hf_config_path`` = ``convert --config-only``: the harts_fsdp2 engine converts the
    weights while loading, its tree-mode log-probs equal the oracle's (fp32 engine, 2e-5), and
    its weight export gives every checkpoint tensor under the source's name (``source_name``
    maps an exported name to the checkpoint's where the two differ)."""
    pytest.importorskip("verl")
    from _verl_cpu import verl_cpu_process

    from harts_verl.models import checkpoints

    testing = verl_cpu_process()
    ckpt, cfg_dir = str(out / "checkpoint"), str(tmp / "cfg")
    summary = checkpoints.convert_checkpoint(ckpt, cfg_dir, config_only=True)
    assert summary["files"] == ["config.json"] and os.listdir(cfg_dir) == ["config.json"]
    engine = testing.build_engine(ckpt, testing.actor_config(), hf_config_path=cfg_dir)
    params, peft = engine.get_per_tensor_param()
    exported = dict(params)
    src = checkpoints.CheckpointTensors(path=ckpt)
    assert peft is None and len(exported) == len(src.names)
    for k, v in exported.items():
        assert v.is_contiguous(), k  # veRL's bucketed senders flatten with view(-1)
        assert torch.equal(v, src.take(source_name(k, src)).to(v.dtype)), k
    assert src.taken == src.names
    with engine.eval_mode():
        inf = engine.infer_batch(testing.make_batch(sequences, prompt_lengths))
    assert inf["metrics"]["harts/compression"][0] > 1.0
    lps = inf["model_output"]["log_probs"].unbind()
    for seq, lp, r in zip(sequences, lps, ref, strict=True):
        torch.testing.assert_close(lp[:-1].double(), reference_log_probs(seq, r), rtol=0, atol=2e-5)
