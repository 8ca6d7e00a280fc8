"""``harts-verl precompile`` and the Triton helpers, where no triton / fla is installed (the
default suite): the warm-up forest has the round kinds of a real plan, the command refuses to
run without triton / fla or a GPU naming what is missing, the helpers refuse unknown modes.
Compiling for sm_90 with fla's real kernels is tested in ``tests/fla_cpu/test_compile_ahead.py``
(the venv with triton and fla)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from harts_verl.ops.tree_linear_attention import build_linear_layout
from harts_verl.precompile import TARGETS, target_device, warmup_sequences
from harts_verl.tree import RolloutForest


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_warmup_forest_has_the_round_kinds_of_a_real_plan(chunk):
    """Rounds without and with initial states, rounds whose final states are handed on and
    rounds whose are not, after the fla split (final states only); trajectories sharing
    prefixes, a prefix trajectory, a one-token trajectory, lengths off and on 16."""
    seqs = warmup_sequences(chunk, vocab_size=50, seed=3)
    assert seqs == warmup_sequences(chunk, vocab_size=50, seed=3)  # deterministic
    assert all(0 <= t < 50 for s in seqs for t in s)
    forest = RolloutForest.from_sequences(seqs)
    assert forest.num_compact_tokens < forest.num_semantic_tokens
    lengths = [len(s) for s in seqs]
    assert 1 in lengths and any(n % 16 for n in lengths) and any(n % 16 == 0 for n in lengths)
    assert any(a != b and b[: len(a)] == a for a in seqs for b in seqs), "a prefix trajectory"
    layout = build_linear_layout(forest, chunk_size=chunk, final_states_only=True)
    rounds = layout.rounds
    assert len(rounds) >= 3
    assert not rounds[0].has_initial and any(r.has_initial for r in rounds)
    assert any(r.save_src.numel() for r in rounds) and any(not r.save_src.numel() for r in rounds)


def test_warmup_sequences_refuse_a_tiny_vocabulary():
    with pytest.raises(ValueError, match="vocab_size"):
        warmup_sequences(64, vocab_size=1)


def test_target_device_names_what_is_missing(monkeypatch):
    with pytest.raises(ValueError, match="target: unknown 'a100'"):
        target_device("a100")
    monkeypatch.setitem(sys.modules, "triton", None)
    for name in TARGETS:
        with pytest.raises(ValueError, match=r"needs triton 3.6 and fla \(the \[gpu\] extra\)"):
            target_device(name)


def test_precompile_cli_without_triton_is_a_one_line_error():
    res = subprocess.run(
        [sys.executable, "-m", "harts_verl.cli", "precompile", "--target", "h100", "--jobs", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if res.returncode == 0:
        pytest.skip("triton and fla are installed here")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("harts-verl precompile: precompile needs"), lines
    bad = subprocess.run(
        [sys.executable, "-m", "harts_verl.cli", "precompile", "--autotune", "some"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--autotune" in bad.stderr


def test_triton_helpers_refuse_unknown_modes_and_missing_triton(monkeypatch):
    from harts_verl.ops.backends import triton_cache

    with pytest.raises(ValueError, match="autotune: unknown 'best'"):
        triton_cache.limit_autotune("best")
    with pytest.raises(ValueError, match="autotune: unknown 'best'"):
        triton_cache.compile_ahead(
            lambda: None, device=triton_cache.DeviceInfo.hopper(), autotune="best"
        )
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ImportError):
        triton_cache.limit_autotune("first")
    with pytest.raises(ImportError):
        triton_cache.CompileLog().install()


def test_hopper_stand_in_describes_an_sm90_gpu():
    from harts_verl.ops.backends.triton_cache import DeviceInfo

    h = DeviceInfo.hopper()
    assert h.capability == (9, 0) and h.name.startswith("NVIDIA H")
    assert h.properties["max_shared_mem"] == 232448 and h.properties["multiprocessor_count"] == 132
    assert np.all([isinstance(v, int) for v in h.properties.values()])


def test_precompile_cli_names_bad_inputs_before_compiling(monkeypatch, capsys, tmp_path):
    """A bad --model / --seed / --chunk-size is one line naming the flag and exit 2, checked
    before the target is read or anything compiled (they were tracebacks, exit 1); a model
    directory without weights, read inside the compile, is one line too. The Triton-dependent
    steps are stood in for: the order of the checks is what is tested."""
    import json
    import types

    import harts_verl.precompile as pc
    from harts_verl.cli import main
    from harts_verl.workers import testing

    reached: list[str] = []
    monkeypatch.setattr(pc, "target_device", lambda name: reached.append("target") or object())
    monkeypatch.setattr(pc, "compile_ahead", lambda workload, **kw: (workload(), {})[1])
    monkeypatch.setattr(pc, "fla_kernel_for", lambda d: types.SimpleNamespace(scalar_gate="x"))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    cfg_path = testing.save_tiny_model("qwen3_next", str(tmp_path / "m"), seed=0)
    config = json.load(open(f"{cfg_path}/config.json"))
    (no_weights / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' notes while saving the model
    for argv, flag in [
        (["--model", str(tmp_path / "missing")], "--model"),
        (["--seed", str(2**70)], "--seed"),
        (["--chunk-size", "5000"], "--chunk-size"),
        (["--dtype", "float32", "--model", str(no_weights)], "--model"),
    ]:
        reached.clear()
        code = main(["precompile", "--no-progress", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (argv, err)
        assert err[0].startswith(f"harts-verl precompile: {flag}"), (argv, err)
        assert reached == ([] if flag != "--model" or "missing" in argv[-1] else ["target"])
    # an error of the compile itself keeps its traceback (exit 1, not a one-line user error)
    monkeypatch.setattr(pc, "bench_model", lambda *a, **k: (_ for _ in ()).throw(TypeError("x")))
    with pytest.raises(TypeError, match="x"):
        main(["precompile", "--no-progress", "--preset", "tiny"])
