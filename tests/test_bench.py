"""``harts-verl bench`` (``harts_verl.benchmark``) on small workloads: the native preset and HF
models given as ``--model`` (a config.json, random weights), the JSON figures it reports, and its
errors. Speed itself is measured by running the benchmark, never asserted here."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from harts_verl.benchmark import BenchConfig, run_bench

SMALL = dict(
    scale=0.004,
    workload_overrides={"path_caps": [512], "prompt_tokens": [100, 200]},
    repeats=1,
    warmup=0,
    chunk_size=16,
    capacity_tokens=1024,
    progress=False,
)


def _config_json(tmp_path, kind: str) -> str:
    from harts_verl.workers.testing import tiny_hf_config

    tiny_hf_config(kind).save_pretrained(str(tmp_path / kind))
    return str(tmp_path / kind / "config.json")


def _check_result(res: dict) -> None:
    assert res["trajectories"] > 1 and res["compression"] > 1.5
    assert res["compact_tokens"] < res["semantic_tokens"]
    assert res["ideal_flop_ratio"] > 1.0
    assert res["speedup"] > 0 and res["efficiency"] == pytest.approx(
        res["speedup"] / res["ideal_flop_ratio"], rel=1e-3
    )
    assert res["max_abs_dlogp"] <= 1e-4 and res["mean_logit_cos"] > 0.99999
    assert len(res["tree_seconds"]) == len(res["expanded_seconds"]) == 1
    json.dumps(res)


def test_native_preset():
    res = run_bench(BenchConfig(preset="tiny", **SMALL))
    assert res["preset"] == "tiny" and res["model"] is None
    _check_result(res)


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "deepseek_v3"])
def test_hf_model_from_config(tmp_path, monkeypatch, kind):
    monkeypatch.setitem(sys.modules, "fla", None)
    path = _config_json(tmp_path, kind)
    res = run_bench(BenchConfig(model=path, **SMALL))
    assert res["model"] == path and res["preset"] is None
    assert res["model_type"] == ("qwen3_5_moe_text" if kind == "qwen3_5_moe" else kind)
    _check_result(res)


def test_model_errors(tmp_path):
    import transformers

    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64).save_pretrained(
        str(tmp_path / "gpt2")
    )
    with pytest.raises(ValueError, match="'gpt2' model, which has no tree mode"):
        run_bench(BenchConfig(model=str(tmp_path / "gpt2" / "config.json"), **SMALL))
    with pytest.raises(ValueError, match="does not exist"):
        run_bench(BenchConfig(model=str(tmp_path / "nothing.json"), **SMALL))
    with pytest.raises(ValueError, match=r"HF model directory or a config\.json"):
        run_bench(BenchConfig(model=str(tmp_path / "missing_dir"), **SMALL))


def test_load_causal_lm_reads_the_named_config_file(tmp_path, monkeypatch):
    """A ``.json`` spec is that file, not the ``config.json`` beside it."""
    monkeypatch.setitem(sys.modules, "fla", None)
    from harts_verl.models.hf import load_causal_lm
    from harts_verl.workers.testing import tiny_hf_config

    tiny_hf_config("llama").save_pretrained(str(tmp_path))  # tmp_path/config.json: llama
    tiny_hf_config("mistral").to_json_file(str(tmp_path / "variant.json"))
    model = load_causal_lm(str(tmp_path / "variant.json"), dtype=torch.float64, seed=1)
    assert model.config.model_type == "mistral" and not model.training
    assert next(model.parameters()).dtype == torch.float64
    assert load_causal_lm(str(tmp_path / "config.json")).config.model_type == "llama"


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("repeats", 0, "repeats"),
        ("warmup", -1, "warmup"),
        ("chunk_size", 0, "chunk_size"),
        ("max_semantic_tokens", -5, "max_semantic_tokens"),
        ("capacity_tokens", -1, "capacity_tokens"),
        ("workload_overrides", {"vocab_size": 100}, "vocab_size"),
        ("plot", "/nonexistent_dir/x.png", "plot"),
        ("device", "nope", "device"),
        ("dtype", "float8", "dtype"),
    ],
)
def test_settings_checked_before_running(field, value, msg, monkeypatch):
    """A bad setting is a ValueError naming it, raised before any model or workload is built."""
    import harts_verl.benchmark as bench

    monkeypatch.setattr(bench, "_bench_model", lambda *a: pytest.fail("built before checking"))
    with pytest.raises(ValueError, match=msg):
        run_bench(BenchConfig(**{**SMALL, field: value}))


def test_result_records_its_settings_and_survives_a_failed_plot(tmp_path, monkeypatch):
    import harts_verl.benchmark as bench

    def broken_plot(result, path):
        raise OSError("disk full")

    monkeypatch.setattr(bench, "plot_bench", broken_plot)
    res = run_bench(BenchConfig(preset="tiny", plot=str(tmp_path / "b.png"), **SMALL))
    assert res["plot_error"] == "OSError: disk full" and "plot" not in res
    for key in ("chunk_size", "workload_overrides", "max_semantic_tokens", "repeats", "warmup"):
        assert res[key] == (SMALL.get(key) if key != "max_semantic_tokens" else None)


def test_cli_argument_errors(tmp_path, capsys):
    from harts_verl.cli import main

    for argv, msg in [
        (["bench", "--threads", "0"], "expected an int >= 1"),
        (["bench", "--workload-option", "=5"], "KEY=VALUE"),
        (["bench", "--workload-option", "a=1", "--workload-option", "a=2"], "given twice"),
        (["inspect", str(tmp_path / "f.npz"), "--dp", "2"], "--dp needs --capacity"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert msg in str(info.value) + capsys.readouterr().err, argv
