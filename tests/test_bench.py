"""``harts-verl bench`` (``harts_verl.benchmark``) on small workloads: the native preset and HF
models given as ``--model`` (a config.json, random weights), the JSON figures it reports, and its
errors. Speed itself is measured by running the benchmark, never asserted here."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from harts_verl.benchmark import (
    BenchConfig,
    alternating_runs,
    run_bench,
    timing_order,
    wall_timed,
)
from harts_verl.cli import main
from harts_verl.models import kimi_linear
from harts_verl.models.config import preset
from harts_verl.tree.workloads import WORKLOADS

SMALL = dict(
    scale=0.004,
    workload_overrides={"path_caps": [512], "prompt_tokens": [100, 200]},
    repeats=1,
    warmup=1,
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
    assert res["compact_tokens"] <= res["run_compact_tokens"] <= res["semantic_tokens"]
    assert res["run_compression"] == pytest.approx(
        res["semantic_tokens"] / res["run_compact_tokens"], rel=1e-3
    )
    json.dumps(res)


def test_native_preset(monkeypatch):
    """Also: the runners alternate (expanded first in even iterations, tree first in odd ones),
    warm-up included."""
    import harts_verl.benchmark as bench

    order = []
    for name, cls in (("tree", bench.TreeRunner), ("expanded", bench.ExpandedRunner)):
        orig = cls.forward_backward

        def spy(self, *a, _orig=orig, _name=name, **k):
            order.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(cls, "forward_backward", spy)
    res = run_bench(BenchConfig(preset="tiny", **SMALL))
    assert res["preset"] == "tiny" and res["model"] is None
    assert res["replay_tokens"] > 0  # the tiny preset has linear-attention layers
    _check_result(res)
    # the timed iterations' kernels (CPU: the references), one forward+backward per runner
    for name in ("tree", "expanded"):
        assert set(res["kernel_calls"][name]) == {"linear/reference", "attention/sdpa"}
    assert order == ["expanded", "tree", "tree", "expanded"]  # warm-up, then the timed one
    assert [timing_order(i) for i in range(3)] == [
        ("expanded", "tree"),
        ("tree", "expanded"),
        ("expanded", "tree"),
    ]


@pytest.mark.parametrize(
    ("kind", "model_type", "text_model_type"),
    [
        ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_moe_text"),
        ("qwen3_5_mm", "qwen3_5", "qwen3_5_text"),  # multi-modal: its language model runs
        ("deepseek_v3", "deepseek_v3", "deepseek_v3"),
    ],
)
def test_hf_model_from_config(tmp_path, monkeypatch, kind, model_type, text_model_type):
    monkeypatch.setitem(sys.modules, "fla", None)
    path = _config_json(tmp_path, kind)
    res = run_bench(BenchConfig(model=path, **SMALL))
    assert res["model"] == path and res["preset"] is None
    assert res["model_type"] == model_type  # the config given
    assert res["text_model_type"] == text_model_type  # the model that runs
    # Replay exists only with linear attention: DeepSeek-V3 (MLA) has none.
    assert (res["replay_tokens"] > 0) == kind.startswith("qwen3_5")
    _check_result(res)


def test_sliding_window_shorter_than_a_trajectory_reports_no_efficiency(tmp_path, capsys):
    """The FLOP model counts full causal pairs: when a sliding window shorter than a trajectory
    cuts attention calls (Mistral, window 16) ``efficiency`` is null with a note (a CPU run
    reported 1.63, since the masked baseline computes the full square), never a figure the GPU
    gate could pass on; a window no trajectory reaches, or one the config names but no layer
    applies (Qwen2 with every layer full_attention), changes nothing."""
    from harts_verl.workers.testing import tiny_hf_config

    def run(kind: str, name: str, **attrs) -> dict:
        cfg = tiny_hf_config(kind)
        for key, value in attrs.items():
            setattr(cfg, key, value)
        cfg.save_pretrained(str(tmp_path / name))
        return run_bench(BenchConfig(model=str(tmp_path / name / "config.json"), **SMALL))

    cases = [
        (run("mistral", "w16", sliding_window=16), True),
        (run("mistral", "wbig", sliding_window=1 << 20), False),
    ]
    full = ["full_attention"] * tiny_hf_config("qwen2").num_hidden_layers
    qwen2 = run("qwen2", "qfull", use_sliding_window=True, sliding_window=16, layer_types=full)
    cases.append((qwen2, False))
    for res, windowed in cases:
        assert res["sliding_window_active"] is windowed
        assert (res["efficiency"] is None) == (res["efficiency_best"] is None) == windowed
        assert windowed == any("window" in r for c in res["kernel_calls"].values() for r in c)
        assert res["speedup"] > 0 and res["max_abs_dlogp"] <= 1e-4
        json.dumps(res)
    err = capsys.readouterr().err
    assert err.count("efficiency: null: a sliding window") == 1


def test_native_and_kimi_linear_models(tmp_path):
    """A saved ``harts_hybrid`` config and a Kimi-Linear ``config.json`` (converted to it) run
    the whole bench, its fidelity figures (through the wrapper's output head) included."""
    from harts_verl.models.hf import HartsHybridConfig

    native = tmp_path / "native"
    HartsHybridConfig.from_hybrid_config(preset("ling_tiny", vocab_size=64)).save_pretrained(
        str(native)
    )
    kimi = tmp_path / "kimi.json"
    d = kimi_linear.kimi_linear_config_from_hybrid(preset("kimi_tiny", vocab_size=64))
    kimi.write_text(json.dumps(d))
    for spec, given in ((str(native / "config.json"), "harts_hybrid"), (str(kimi), "kimi_linear")):
        res = run_bench(BenchConfig(model=spec, **SMALL))
        assert res["model_type"] == given and res["text_model_type"] == "harts_hybrid"
        _check_result(res)


def test_model_errors(tmp_path, monkeypatch):
    """Unsupported or unreadable models are ValueErrors naming ``model``; an unsupported type
    is refused from its config, before any model is built."""
    import transformers

    import harts_verl.models.hf as hf

    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64).save_pretrained(
        str(tmp_path / "gpt2")
    )
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "notype.json").write_text('{"hidden_size": 4}')
    (tmp_path / "empty").mkdir()
    from harts_verl.workers.testing import tiny_hf_config

    capped = tiny_hf_config("gemma3_text")  # a negative soft-cap: no usable transform
    capped.final_logit_softcapping = -30.0
    capped.save_pretrained(str(tmp_path / "capped"))
    llama = tiny_hf_config("llama").to_dict()  # values transformers' own validation rejects
    (tmp_path / "heads.json").write_text(json.dumps({**llama, "num_attention_heads": 3}))
    (tmp_path / "typed.json").write_text(json.dumps({**llama, "hidden_size": "abc"}))
    qwen3 = tiny_hf_config("qwen3").to_dict()  # sizes transformers accepts but cannot run
    (tmp_path / "heads0.json").write_text(json.dumps({**qwen3, "num_attention_heads": 0}))
    kv3 = {**qwen3, "num_attention_heads": 2, "num_key_value_heads": 3}
    (tmp_path / "kv3.json").write_text(json.dumps(kv3))
    real_load = hf.load_causal_lm
    monkeypatch.setattr(hf, "load_causal_lm", lambda *a, **k: pytest.fail("model built"))
    for spec, msg in [
        (tmp_path / "gpt2" / "config.json", "'gpt2' model, which has no tree mode"),
        (tmp_path / "gpt2", "'gpt2' model, which has no tree mode"),
        (tmp_path / "nothing.json", "does not exist"),
        (tmp_path / "missing_dir", r"HF model directory or a config\.json"),
        (tmp_path / "bad.json", "not a valid JSON file"),
        (tmp_path / "notype.json", "model_type"),
        (tmp_path / "empty", "has no config.json"),
        (tmp_path / "capped" / "config.json", r"config\.final_logit_softcapping: .* -30\.0"),
        (tmp_path / "heads.json", "config of .*not a multiple of the number of attention heads"),
        (tmp_path / "typed.json", "config of .*'hidden_size' expected int"),
        (tmp_path / "heads0.json", "num_attention_heads must be >= 1, got 0"),
        (tmp_path / "kv3.json", "num_attention_heads 2 is not a multiple of num_key_value_heads 3"),
    ]:
        with pytest.raises(ValueError, match=msg) as info:
            run_bench(BenchConfig(model=str(spec), **SMALL))
        assert str(info.value).startswith("model: "), spec
    # A directory with a config but no weights: the loader's OSError, as a model error.
    monkeypatch.setattr(hf, "load_causal_lm", real_load)
    tiny_hf_config("qwen2").save_pretrained(str(tmp_path / "noweights"))
    with pytest.raises(ValueError, match=r"^model: .*no file named.*config\.json for random"):
        run_bench(BenchConfig(model=str(tmp_path / "noweights"), **SMALL))
    # Weights that cannot be read, or do not fit the config: model errors too.
    from harts_verl.workers.testing import save_tiny_model

    save_tiny_model("llama", str(tmp_path / "corrupt"))
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"junk")
    save_tiny_model("llama", str(tmp_path / "reshaped"))
    cfg = json.loads((tmp_path / "reshaped" / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (tmp_path / "reshaped" / "config.json").write_text(json.dumps(cfg))
    records: list[logging.LogRecord] = []
    seen = logging.Handler()
    seen.emit = records.append
    logging.getLogger("transformers").addHandler(seen)
    try:
        for spec, msg in [
            ("corrupt", "deserializing header"),
            ("reshaped", "do not fit its config"),
        ]:
            with pytest.raises(
                ValueError, match=rf"^model: .*{spec}.*cannot load its weights: .*{msg}"
            ):
                run_bench(BenchConfig(model=str(tmp_path / spec), **SMALL))
    finally:
        logging.getLogger("transformers").removeHandler(seen)
    # The failed load's report table is not printed before the one-line error.
    assert not any("LOAD REPORT" in r.getMessage() for r in records)


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
        ("warmup", 0, "warmup"),
        ("scale", float("nan"), "scale"),
        ("scale", 0, "scale"),
        ("scale", 1e30, "scale"),
        ("seed", -1, "seed"),
        ("workload", "nope", "workload"),
        ("workload_overrides", [("path_caps", [512])], "workload_overrides"),
        ("chunk_size", 0, "chunk_size"),
        ("max_semantic_tokens", -5, "max_semantic_tokens"),
        ("capacity_tokens", -1, "capacity_tokens"),
        ("workload_overrides", {"vocab_size": 100}, "vocab_size"),
        ("plot", "/nonexistent_dir/x.png", "plot"),
        ("plot", "/tmp", "plot: '/tmp' is a directory"),
        ("plot", "/tmp/x.nosuchformat", "plot: unsupported format '.nosuchformat'"),
        ("device", "nope", "device"),
        ("dtype", "float8", "dtype"),
    ],
)
def test_settings_checked_before_running(field, value, msg, monkeypatch):
    """A bad setting is a ValueError naming it, raised before any model or workload is built."""
    import harts_verl.benchmark as bench

    monkeypatch.setattr(bench, "bench_model", lambda *a: pytest.fail("built before checking"))
    with pytest.raises(ValueError, match=msg) as info:
        run_bench(BenchConfig(**{**SMALL, field: value}))
    assert str(info.value).startswith(field + ":")


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_every_workload_runs_on_its_bench_defaults(workload):
    """``workload_overrides=None`` (the CLI without ``--workload-option``) takes the workload's
    own bench options, which its generator accepts at the default scale, and the result records
    them; a dict replaces them all."""
    import harts_verl.benchmark as bench

    assert set(bench.BENCH_WORKLOAD_OPTIONS) == set(WORKLOADS)
    cfg = BenchConfig(workload=workload, preset="tiny", max_semantic_tokens=1500, progress=False)
    prepared = bench.prepare_bench(cfg)
    assert prepared.forest.num_trajectories >= 1
    assert bench.workload_options(cfg) == bench.BENCH_WORKLOAD_OPTIONS[workload]
    caps = bench.BENCH_WORKLOAD_OPTIONS[workload].get("path_caps")
    if caps:
        assert max(len(s) for s in prepared.seqs) <= max(caps)
    given = {"max_forks": 1}
    assert bench.workload_options(BenchConfig(workload=workload, workload_overrides=given)) == given


def test_plot_path_resolved_before_running(tmp_path):
    """A plot path without suffix is written (and reported) as PATH.png, decided up front."""
    import harts_verl.benchmark as bench

    assert bench.check_config(BenchConfig(plot=str(tmp_path / "x")))[1] == str(tmp_path) + "/x.png"
    assert bench.check_config(BenchConfig(plot=str(tmp_path / "x.pdf")))[1].endswith("x.pdf")
    assert bench.check_config(BenchConfig())[1] is None


def test_result_records_its_settings_and_survives_a_failed_plot(tmp_path, monkeypatch):
    import harts_verl.benchmark as bench

    def broken_plot(result, path):
        raise OSError("disk full")

    monkeypatch.setattr(bench, "plot_bench", broken_plot)
    res = run_bench(BenchConfig(preset="tiny", plot=str(tmp_path / "b.png"), **SMALL))
    assert res["plot_error"] == "OSError: disk full" and "plot" not in res
    json.dumps(res, allow_nan=False)
    for key in ("chunk_size", "workload_overrides", "max_semantic_tokens", "repeats", "warmup"):
        assert res[key] == (SMALL.get(key) if key != "max_semantic_tokens" else None)


def _one_line_error(capsys, argv: list[str], prefix: str, msg: str) -> str:
    """``main(argv)`` is a user error: exit status 2, one stderr line ``prefix: ...msg...``."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prefix + ": "), (argv, err)
    assert msg in err[0], (argv, err)
    assert "Traceback" not in err[0]
    return err[0]


def test_cli_argument_errors(tmp_path, capsys, monkeypatch):
    """Bad option values are argparse errors (exit 2, naming the option)."""
    for argv, msg in [
        (["bench", "--threads", "0"], "argument --threads: expected an int in [1, 4096]"),
        (["bench", "--threads", str(2**64)], "argument --threads: expected an int in [1, 4096]"),
        (["bench", "--capacity", "-5"], "argument --capacity: expected an int >= 0"),
        (["bench", "--repeats", "0"], "argument --repeats: expected an int >= 1"),
        (["bench", "--warmup", "0"], "argument --warmup: expected an int >= 1"),
        (["bench", "--max-semantic-tokens", "-1"], "argument --max-semantic-tokens"),
        (["bench", "--chunk-size", "0"], "argument --chunk-size"),
        (["bench", "--seed", "-1"], "argument --seed"),
        (["bench", "--scale", "nan"], "argument --scale: expected a finite number in (0, 256]"),
        (["bench", "--scale", "inf"], "argument --scale"),
        (["bench", "--scale", "1e5"], "argument --scale: expected a finite number in (0, 256]"),
        (["bench", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["bench", "--workload", "nope"], "argument --workload: invalid choice: 'nope'"),
        (["bench", "--preset", "nope"], "argument --preset: invalid choice"),
        (["demo", "--repeats", "0"], "argument --repeats"),
        (["inspect", "f.npz", "--dp", "0"], "argument --dp"),
        (["inspect", "f.npz", "--capacity", "-5"], "argument --capacity"),
        (["inspect", "f.npz", "--work-slack", "-1"], "argument --work-slack: expected a finite"),
        (["inspect", "f.npz", "--work-slack", "nan"], "argument --work-slack"),
        (
            ["inspect", "f.npz", "--work-slack", "1.0"],
            "--work-slack: expected a finite number in [0, 1)",
        ),
    ]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, argv
        err = capsys.readouterr().err
        assert msg in err, argv
        # one line (argparse printed its usage text first: six lines)
        assert err.count("\n") == 1 and err.startswith(f"harts-verl {argv[0]}: "), (argv, err)
    # a path the message quotes keeps a field name inside it ('capacity_tokens' was spliced
    # into '--capacity')
    (tmp_path / "capacity_tokens").mkdir()
    assert main(["inspect", "f.npz", "--plot", str(tmp_path / "capacity_tokens")]) == 2
    err = capsys.readouterr().err
    assert "capacity_tokens" in err and "'--capacity'" not in err, err


def test_cli_input_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """Bad inputs found while reading them: exit status 2 and one line naming the flag (config
    field names mapped to flags), before any model is built where the input allows."""
    import harts_verl.benchmark as bench

    monkeypatch.delenv("HARTS_VERL_DEBUG", raising=False)
    monkeypatch.setattr(bench, "measure_bench", lambda *a: pytest.fail("measured"))
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "d").mkdir()
    tiny = ["--preset", "tiny", "--no-progress"]
    for argv, msg in [
        (["bench", "--device", "foo"], "--device: 'foo' is not a torch device"),
        (["bench", "--device", "nocuda:0"], "--device:"),
        (["bench", "--device", "meta"], "--device: expected cpu or cuda[:N], got 'meta'"),
        (["bench", "--device", "cpu:1"], "--device: 'cpu:1': the CPU has one device"),
        (["bench", "--workload-option", "=5"], "--workload-option: expected KEY=VALUE"),
        (["bench", "--workload-option", "a=1", "--workload-option", "a=2"], "given twice"),
        (["bench", "--workload-option", "vocab_size=3"], "--workload-option: vocab_size"),
        # the generator's own arguments: was "swe_like() got multiple values for keyword ..."
        (["bench", *tiny, "--workload-option", "seed=1"], "--workload-option: seed is --seed"),
        (["bench", *tiny, "--workload-option", "scale=1"], "--workload-option: scale is --scale"),
        (["bench", *tiny, "--workload-option", "foo=1"], "--workload-option: foo: unknown"),
        (["bench", "--model", "nofile.json"], "--model: config file 'nofile.json' does not"),
        (["bench", "--model", str(tmp_path / "bad.json")], "not a valid JSON file"),
        (["bench", "--model", str(tmp_path / "list.json")], "holds a JSON list, not an object"),
        (["bench", "--plot", str(tmp_path / "d")], "--plot: "),
        (["bench", "--plot", str(tmp_path / "x.nope")], "--plot: unsupported format"),
        (["demo", "--plot", str(tmp_path / "no" / "x.png")], "--plot: cannot write"),
    ]:
        _one_line_error(capsys, argv, f"harts-verl {argv[0]}", msg)
    if not torch.cuda.is_available():
        _one_line_error(capsys, ["bench", "--device", "cuda"], "harts-verl bench", "--device")
    line = _one_line_error(
        capsys, ["bench", "--model", "nofile.json"], "harts-verl bench", "--model"
    )
    assert "model: config" not in line.replace("--model: config", "")  # no doubled prefix


def test_models_the_runners_cannot_run_are_input_errors(tmp_path, capsys, monkeypatch):
    """Found once the model is built, before anything is measured (exit status 2, one line
    naming ``--model``): no layer with a tree mode, a vocabulary too small for the workload, a
    length-dependent RoPE (``dynamic``) whose exact range the workload's trajectories exceed."""
    import harts_verl.benchmark as bench
    from harts_verl.workers.testing import tiny_hf_config

    monkeypatch.delenv("HARTS_VERL_DEBUG", raising=False)
    monkeypatch.setattr(bench, "prepare_bench", lambda *a: pytest.fail("prepared"))
    llama = {**tiny_hf_config("llama").to_dict(), "bos_token_id": None, "eos_token_id": None}
    llama["pad_token_id"] = None  # transformers warns of special ids beyond a tiny vocabulary
    configs = {
        "layers0": {**llama, "num_hidden_layers": 0},
        "vocab1": {**llama, "vocab_size": 1},
        "vocab2": {**llama, "vocab_size": 2},
        "dynamic": {
            **llama,
            "max_position_embeddings": 16,
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        },
    }
    for name, c in configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(c))
    small = ["--scale", "0.0002", "--repeats", "1", "--no-progress"]
    for name, msg in [
        ("layers0", "--model: LlamaForCausalLM has no supported token mixer"),
        ("vocab1", r"--model: vocab_size: expected an int in \[2, 2\*\*63 - 1\], got 1"),
        ("vocab2", "--model: vocab_size: 2 ids cannot give"),
        ("dynamic", "--model: rope_type 'dynamic': .* exact only up to 15 tokens"),
    ]:
        argv = ["bench", *small, "--model", str(tmp_path / f"{name}.json")]
        line = _one_line_error(capsys, argv, "harts-verl bench", "--model")
        assert re.search(msg, line), (name, line)


def test_cli_capacity_field_is_named_as_the_flag(capsys, monkeypatch):
    """A config-field message (``capacity_tokens: ...``) is shown with the flag's name."""
    import harts_verl.benchmark as bench

    def fail(cfg):
        raise ValueError("capacity_tokens: expected an int >= 1, got -5")

    monkeypatch.setattr(bench, "load_bench_inputs", fail)
    _one_line_error(capsys, ["bench"], "harts-verl bench", "--capacity: expected an int >= 1")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], None),  # the workload's bench defaults (CPU path caps)
        (["--generator-defaults"], {}),  # the generator's own
        (["--generator-defaults", "--workload-option", "max_forks=3"], {"max_forks": 3}),
        (["--workload-option", "max_forks=3"], {"max_forks": 3}),
    ],
)
def test_cli_generator_defaults_drop_the_bench_caps(monkeypatch, argv, expected):
    """``--generator-defaults`` runs the generator's own workload (what the GPU check benches:
    the CPU path caps would make its larger size the 86K-token CPU step)."""
    import harts_verl.benchmark as bench
    from harts_verl.cli import main

    seen = []

    def stop(cfg):
        seen.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(bench, "load_bench_inputs", stop)
    with pytest.raises(SystemExit):
        main(["bench", "--workload", "swe_like", *argv])
    assert seen[0].workload_overrides == expected
    want = bench.BENCH_WORKLOAD_OPTIONS["swe_like"] if expected is None else expected
    assert bench.workload_options(seen[0]) == want


def test_cli_debug_and_internal_errors(capsys, monkeypatch):
    """HARTS_VERL_DEBUG=1 re-raises a user error; an error past the inputs (planning or
    measurement) is never turned into a one-line message."""
    import harts_verl.benchmark as bench

    monkeypatch.setenv("HARTS_VERL_DEBUG", "1")
    with pytest.raises(ValueError, match="device: 'foo'"):
        main(["bench", "--device", "foo"])
    monkeypatch.delenv("HARTS_VERL_DEBUG")

    def internal(prep):
        raise ValueError("an internal bug")

    monkeypatch.setattr(bench, "load_bench_inputs", lambda cfg: object())
    monkeypatch.setattr(bench, "prepare_bench", lambda cfg, inputs: object())
    monkeypatch.setattr(bench, "measure_bench", internal)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["bench"])

    def planning_bug(cfg, inputs):
        raise ValueError("capacity_tokens: a planner bug")

    monkeypatch.setattr(bench, "prepare_bench", planning_bug)
    with pytest.raises(ValueError, match="a planner bug"):
        main(["bench"])


def test_cli_never_prints_invalid_json(capsys, monkeypatch):
    """A non-finite figure is an error naming it (a bug to surface), not NaN in the output."""
    import harts_verl.benchmark as bench

    monkeypatch.setattr(bench, "load_bench_inputs", lambda cfg: object())
    monkeypatch.setattr(bench, "prepare_bench", lambda cfg, inputs: object())
    monkeypatch.setattr(bench, "measure_bench", lambda p: {"speedup": math.nan, "x": [1.0]})
    with pytest.raises(ValueError, match="non-finite values in the result: speedup"):
        main(["bench"])
    assert "NaN" not in capsys.readouterr().out
    monkeypatch.setattr(bench, "measure_bench", lambda p: {"speedup": 2.0})
    assert main(["bench"]) == 0
    assert json.loads(capsys.readouterr().out) == {"speedup": 2.0}


def _load_benchmark(name: str):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module while it executes
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


@pytest.mark.parametrize("name", ["linear_plan", "forest", "balance"])
def test_benchmark_scripts_need_positive_repeats(name, capsys):
    mod = _load_benchmark(name)
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit) as info:
            mod.main(["--repeats", bad])
        assert info.value.code == 2
        assert "argument --repeats: expected an int >= 1" in capsys.readouterr().err


def test_balance_benchmark_reports_what_it_placed(capsys):
    """``benchmarks/balance.py --quick`` prints one JSON case per batch, with counts that
    follow from the placement: no cell of padding only beyond the fewest possible, prompt
    groups cut where a cell is too small for them, timings measured."""
    mod = _load_benchmark("balance")
    assert mod.main(["--quick", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["cases"]) == len(mod.QUICK)
    for case, (groups, _n, dp, nm, extra) in zip(out["cases"], mod.QUICK, strict=True):
        cells = dp * nm
        assert case["trajectories"] % cells == 0 and case["padding"] >= extra * cells
        assert case["padding_only_cells"] == case["fewest_padding_only_cells"]
        assert 0 <= case["groups_cut"] <= groups and case["seconds_best"] > 0
        assert case["max_cell_work"] >= case["mean_cell_work"] > 0 and case["compression"] >= 1
    assert out["padding_only_cells_avoidable"] == 0
    first = out["cases"][0]  # 4 real trajectories padded to 16 on 4 ranks: one each
    assert (first["trajectories"], first["padding"], first["groups_cut"]) == (16, 12, 2)


def test_op_benchmarks_warm_up_and_alternate(capsys):
    """The op benchmarks time each side after an untimed run of each, in alternating order (the
    tree always ran first and cold: its one-off costs read as tree time); ops_linear_attention
    bounds --chunk-size as the library does (a huge one was a traceback)."""
    mod = _load_benchmark("ops_moe_logprobs")
    calls = []
    t, out_t, e, out_e = mod._timed_pair(
        lambda: calls.append("t") or 1, lambda: calls.append("e") or 2, 3
    )
    # the warm-up is iteration 0 of the bench's timing_order, then 3 timed iterations
    assert calls == ["e", "t", "t", "e", "e", "t", "t", "e"] and (out_t, out_e) == (1, 2)
    assert 0 <= t < 1 and 0 <= e < 1
    att = _load_benchmark("ops_attention_conv")
    x = torch.ones(3, requires_grad=True)
    tt, te, o_t, o_e = att._time_pair(lambda: x * 2, [x], lambda: x * 3, [x], 2)
    assert torch.equal(o_t, 2 * torch.ones(3)) and torch.equal(o_e, 3 * torch.ones(3))
    assert set(tt) == set(te) == {"fwd_s", "bwd_s", "fb_s", "fb_raw"}
    assert tt["fb_raw"] >= 0 and x.grad is not None
    lin = _load_benchmark("ops_linear_attention")
    with pytest.raises(SystemExit) as info:
        lin.main(["--chunk-size", "100000"])
    assert (
        info.value.code == 2
        and "argument --chunk-size: expected an int in [1, 4096]" in capsys.readouterr().err
    )


def test_alternating_runs_times_both_sides_in_the_bench_order():
    """alternating_runs: one untimed call of each side in timing_order(0), then `repeats`
    iterations in timing_order(1), timing_order(2), ...; every timed call's seconds kept in
    order; bad sides or repeats are ValueErrors naming them."""
    calls: list[str] = []
    seconds = iter(range(100))

    def side(name):
        def run():
            calls.append(name)
            return (float(next(seconds)), 0.5), f"{name}{len(calls)}"

        return run

    runs, outs = alternating_runs({"tree": side("t"), "expanded": side("e")}, 2)
    assert calls == [n[0] for n in (*timing_order(0), *timing_order(1), *timing_order(2))]
    assert runs == {"tree": [(2.0, 0.5), (5.0, 0.5)], "expanded": [(3.0, 0.5), (4.0, 0.5)]}
    assert outs == {"tree": "t6", "expanded": "e5"}
    with pytest.raises(ValueError, match="sides: expected the keys 'tree' and 'expanded'"):
        alternating_runs({"tree": side("t")}, 1)
    with pytest.raises(ValueError, match="repeats: expected an int >= 1, got 0"):
        alternating_runs({"tree": side("t"), "expanded": side("e")}, 0)
    (dt,), out = wall_timed(lambda: 7)()
    assert out == 7 and 0 <= dt < 1


def test_moe_benchmark_router_groups_fit_the_experts(capsys):
    """ops_moe_logprobs: grouped-router settings that cannot route are argparse errors naming
    the flag (were a ValueError from the router after the forest was built); the defaults fit
    any expert count."""
    mod = _load_benchmark("ops_moe_logprobs")
    for argv, msg in [
        (["--experts", "8"], "--top-k: the grouped router picks from 4 of 8 groups"),
        (["--experts", "12", "--top-k", "2", "--n-group", "5"], "--n-group: expected a divisor"),
        (["--experts", "8", "--top-k", "2", "--topk-group", "9"], "--topk-group: expected at most"),
        (["--experts", "4"], "--top-k: expected at most --experts (4), got 6"),
    ]:
        with pytest.raises(SystemExit) as info:
            mod.main(argv)
        assert info.value.code == 2, argv
        assert msg in capsys.readouterr().err, argv
    small = ["--scale", "0.0002", "--vocab", "300", "--dim", "16", "--rows-per-chunk", "64"]
    out = mod.main([*small, "--experts", "12", "--top-k", "2"])  # 12: not a multiple of 8
    capsys.readouterr()
    assert (out["moe_stats"]["n_group"], out["moe_stats"]["topk_group"]) == (1, 1)


def test_planner_summary_pass_is_null_without_instances():
    """A check that saw no instance neither passes nor fails (``pass: null``)."""
    planner = _load_benchmark("planner")
    empty = planner.summarize([])
    assert empty["speed"]["pass"] is None
    row = {
        "size": "small",
        "workload": "tau_like",
        "dp_size": 1,
        "capacity_tokens": 10,
        "forest": "f",
        "cpsat": {"status": "OPTIMAL", "compact_tokens": 100, "slot_imbalance_p95": 0.0},
        "ours": {"compact_tokens": 100, "microbatches": 2, "slot_imbalance_p95": 0.0},
        "tokens_vs_cpsat_pct": 0.0,
        "speedup_vs_cpsat": 50.0,
    }
    out = planner.summarize([row, {**row, "dp_size": 8, "speedup_vs_cpsat": 5.0}])
    assert out["small_cpsat_optimal_dp1"]["pass"] is True
    assert out["small_cpsat_optimal_dp8"]["pass"] is True
    assert out["speed"]["pass"] is False  # 5 < 10 on one instance
    assert out["swe_dp8_ge64_microbatches"]["instances"] == 0
    assert out["swe_dp8_ge64_microbatches"]["pass"] is None
    json.dumps(out, allow_nan=False)
    real = {**row, "size": "realistic", "cpsat": {**row["cpsat"], "status": "FEASIBLE"}}
    out = planner.summarize([real])
    assert out["realistic_time_limited_dp1"]["pass"] is False  # 0 % fewer tokens
    failed = {**real, "cpsat": {**real["cpsat"], "compact_tokens": -1}}
    out = planner.summarize([failed])
    assert out["realistic_time_limited_dp1"]["instances"] == 0
    assert out["realistic_time_limited_dp1"]["pass"] is None


def test_settings_the_run_cannot_honour_are_reported(capsys, caplog):
    """A token budget below the first trajectory, or a capacity below a trajectory's length,
    runs anyway (whole trajectories) and says so: ``notes`` and ``oversize_microbatches`` in
    the plan (and the JSON), one stderr line each (the runners' own oversize WARNING is not
    repeated on top)."""
    from harts_verl.benchmark import BenchConfig, prepare_bench

    with caplog.at_level("WARNING", logger="harts_verl.runtime.runner"):
        prep = prepare_bench(
            BenchConfig(preset="tiny", scale=0.0005, max_semantic_tokens=10, capacity_tokens=64)
        )
        prep.tree.plan(prep.forest), prep.expanded.plan(prep.forest)
    assert not [r for r in caplog.records if "longer than capacity_tokens" in r.getMessage()]
    assert prep.forest.num_trajectories == 1 and prep.forest.num_semantic_tokens > 64
    assert prep.oversize_microbatches == prep.microbatches == 1
    assert len(prep.notes) == 2
    err = capsys.readouterr().err
    assert (
        "max_semantic_tokens 10 is below" in err
        and "1 microbatch exceeds capacity_tokens 64" in err
    )
    ok = prepare_bench(BenchConfig(preset="tiny", scale=0.0005))
    assert ok.oversize_microbatches == 0 and ok.notes == []


def test_run_compact_tokens_count_each_microbatch_s_rows():
    """A capacity that cuts the trees: ``run_compact_tokens`` is the sum of the microbatches'
    own tries (their shared prefixes repeated), above the forest's ``compact_tokens``, and the
    ideal FLOP ratio is of that work (below the whole forest's)."""
    from harts_verl.benchmark import prepare_bench
    from harts_verl.runtime.flops import ideal_flop_ratio, model_shape
    from harts_verl.tree.microbatch import compact_work

    prep = prepare_bench(BenchConfig(preset="tiny", scale=0.002, capacity_tokens=600))
    groups = prep.tree.plan(prep.forest)
    assert len(groups) > 1
    assert prep.run_compact_tokens == sum(compact_work(prep.forest, g) for g in groups)
    assert prep.run_compact_tokens > prep.forest.num_compact_tokens
    whole = ideal_flop_ratio(model_shape(prep.mcfg), prep.forest, 0)["ideal_flop_ratio"]
    assert prep.ideal_flop_ratio < whole


@pytest.mark.parametrize(("heads", "k", "v"), [(3, 6, 10), (2, 16, 8)])
def test_delta_rule_chunk_cost_matches_the_matmuls_of_a_chunk_kernel(heads, k, v):
    """The per-token delta-rule term equals the matmul FLOPs (FlopCounterMode) of transformers'
    own chunkwise kernel (Qwen3-Next's ``torch_chunk_gated_delta_rule``, B = 64): the slope
    between two lengths, so fixed costs cancel. It once counted q·k and p·v only (2B(K+V)),
    missing k·kᵀ and the WY products."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from harts_verl.runtime.flops import _chunk_terms

    def flops(t: int) -> int:
        g = torch.Generator().manual_seed(t)
        q, kk = (torch.randn(1, t, heads, k, generator=g) for _ in range(2))
        vv = torch.randn(1, t, heads, v, generator=g)
        gate = -torch.rand(1, t, heads, generator=g)
        beta = torch.rand(1, t, heads, generator=g)
        with FlopCounterMode(display=False) as counter:
            torch_chunk_gated_delta_rule(q, kk, vv, gate, beta, chunk_size=64)
        return counter.get_total_flops()

    per_token = (flops(192) - flops(128)) / 64
    fixed, per_b = _chunk_terms(heads, k, v, delta_rule=True)
    assert per_token == pytest.approx(fixed + 64 * per_b, rel=1e-12)


@pytest.mark.parametrize("chunk", [8, 256])
def test_ideal_flop_ratio_counts_linear_attention_at_the_run_chunk_size(chunk):
    """The chunkwise delta rule costs HV·(2B(3K+2V) + 6KV) per processed token at the run's
    chunk size B (``--chunk-size``), in the expanded and the tree count alike; recounted here
    from the model config, the forest, the plan and its replay."""
    from harts_verl.benchmark import prepare_bench
    from harts_verl.runtime.flops import model_shape
    from harts_verl.tree.linear_plan import plan_linear_calls

    prep = prepare_bench(BenchConfig(preset="tiny", scale=0.0005, chunk_size=chunk))
    cfg = prep.mcfg
    k, v, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    n_linear = sum(t in ("kda", "gdn") for t in cfg.layer_types)
    assert n_linear > 0
    lin = n_linear * hv * (2.0 * chunk * (3 * k + 2 * v) + 6.0 * k * v)
    shape = model_shape(cfg)
    assert shape.linear_cost(chunk) == pytest.approx(lin, rel=1e-12)
    # the LM head runs on rows with a next token: S - N expanded, the trie's non-leaf rows
    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    assert shape.head_per_token == head
    groups = prep.tree.plan(prep.forest)
    f_exp = f_tree = 0.0
    for g in groups:
        sub = prep.forest.subset(g)
        lengths = sub.lengths.astype(float)
        s, c = lengths.sum(), float(sub.num_compact_tokens)
        replay = plan_linear_calls(sub, chunk_size=chunk).replay_tokens
        seqs = {tuple(sub.tokens_of(i).tolist()) for i in range(sub.num_trajectories)}
        prefixes = {t[:k] for t in seqs for k in range(1, len(t))}
        leaves = len(seqs - prefixes)  # trie leaves: trajectories no other one extends
        f_exp += (shape.dense_per_token - head) * s + head * (s - len(lengths)) + lin * s
        f_exp += shape.attention_per_pair * float((lengths * (lengths + 1) / 2).sum())
        f_tree += (shape.dense_per_token - head) * c + head * (c - leaves) + lin * (c + replay)
        f_tree += shape.attention_per_pair * float((sub.depth + 1).sum())
    assert prep.ideal_flop_ratio == pytest.approx(f_exp / f_tree, rel=1e-9)


def test_windowed_pairs_match_brute_force():
    """``causal_pairs`` / ``tree_pairs`` count, per query, the keys of its path less than
    ``window`` tokens above it (itself included), as a brute force over every trajectory and
    every compact row; ``ideal_flop_ratio`` averages them over the layers' ``windows`` (full
    layers as without windows)."""
    import numpy as np

    from harts_verl.runtime.flops import (
        ModelShape,
        causal_pairs,
        ideal_flop_ratio,
        tree_pairs,
    )
    from harts_verl.tree import RolloutForest

    rng = np.random.default_rng(3)
    base = rng.integers(0, 5, 30).tolist()
    seqs = [base[: rng.integers(1, 30)] + rng.integers(0, 5, rng.integers(0, 20)).tolist()
            for _ in range(12)]  # fmt: skip
    forest = RolloutForest.from_sequences(seqs)
    lengths = forest.lengths
    rows = np.arange(forest.num_compact_tokens)
    for w in (1, 2, 5, 17, 1000, None):
        lim = math.inf if w is None else w
        want_exp = sum(min(p + 1, lim) for n in lengths.tolist() for p in range(n))
        assert causal_pairs(lengths, w) == want_exp
        anc = forest.is_ancestor_or_self(rows[None, :], rows[:, None])  # [query, key]
        near = forest.depth[:, None] - forest.depth[None, :] < lim
        assert tree_pairs(forest.depth, w) == int((anc & near).sum())
    shape = ModelShape(dense_per_token=10.0, attention_per_pair=3.0, linear_per_token=0.0)
    full = ideal_flop_ratio(shape, forest, 0)
    assert ideal_flop_ratio(shape, forest, 0, windows=[None, None]) == full
    mixed = ideal_flop_ratio(shape, forest, 0, windows=[4, None])
    half_exp = (causal_pairs(lengths, 4) + causal_pairs(lengths)) / 2
    assert mixed["expanded_flops"] == pytest.approx(10.0 * lengths.sum() + 3.0 * half_exp)
    assert mixed["ideal_flop_ratio"] != full["ideal_flop_ratio"]
    # any sequence of windows; numpy ints; a window beyond float range is no window
    assert ideal_flop_ratio(shape, forest, 0, windows=np.array([4, 0])[:1]) == ideal_flop_ratio(
        shape, forest, 0, windows=[4]
    )
    assert ideal_flop_ratio(shape, forest, 0, windows=iter([])) == full
    assert causal_pairs(lengths, 10**400) == causal_pairs(lengths)
    assert tree_pairs(forest.depth, 10**400) == tree_pairs(forest.depth)
    for bad in (0, -3, True, 2.5, "8"):
        with pytest.raises(ValueError, match="windows: expected positive ints or None"):
            ideal_flop_ratio(shape, forest, 0, windows=[bad])


def test_layer_windows_from_a_recorded_log():
    """Each layout's calls are the layers in order; a layer's window is what any layout passed
    (a layout whose paths the window does not reach passes none); logs that are not one
    model's plain forwards give None."""
    from harts_verl.ops.layout import layer_windows, recording_attention_windows

    assert layer_windows([]) == []
    log = [(7, None), (7, 16), (9, None), (9, None)]  # layout 9: every path shorter than 16
    assert layer_windows(log) == [None, 16]
    assert layer_windows([(1, 4), (1, None), (2, 4)]) is None  # 2 calls vs 1
    assert layer_windows([(1, 4), (2, 8)]) is None  # two windows for one layer
    with recording_attention_windows() as outer:
        with pytest.raises(RuntimeError, match="already recording"):
            with recording_attention_windows():
                pass
    assert outer == []


def test_recorded_windows_of_a_mixed_model():
    """The windows a Qwen2 with sliding and full layers applies in a tree forward, per layer in
    order; none where no trajectory is longer than the window."""
    import numpy as np

    from harts_verl.ops.layout import layer_windows, recording_attention_windows
    from harts_verl.runtime import TreeRunner
    from harts_verl.workers.testing import tiny_hf_config

    cfg = tiny_hf_config("qwen2")
    n = cfg.num_hidden_layers
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    cfg.use_sliding_window, cfg.sliding_window, cfg.layer_types = True, 16, types
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).double()
    rng = np.random.default_rng(0)
    base = rng.integers(0, 64, 30).tolist()
    long = [base + rng.integers(0, 64, 10).tolist(), [*base[:20], 1, 2, 3]]
    short = [base[:10], [*base[:6], 5, 6]]
    runner = TreeRunner(model, capacity_tokens=48)
    for seqs, want in ((long, [16 if t == types[0] else None for t in types]), (short, [None] * n)):
        with recording_attention_windows() as log:
            runner.log_probs(seqs)
        assert len(log) == n * runner.last_stats.microbatches
        assert layer_windows(log) == want


def test_bench_counts_windowed_pairs_when_a_varlen_kernel_skips_them(tmp_path, monkeypatch):
    """With a varlen kernel that takes windows (here a CPU stand-in of its contract), a window
    shorter than a trajectory (Mistral, 16) no longer nulls ``efficiency``: the ideal ratio
    counts each layer's windowed pairs (``attention_windows``), recounted here from the plan."""
    from harts_verl.benchmark import _run_flop_ratio, prepare_bench
    from harts_verl.ops import backends
    from harts_verl.ops.backends import VarlenAttentionKernel
    from harts_verl.ops.backends.varlen_attention import sdpa_varlen_reference
    from harts_verl.runtime.flops import model_shape
    from harts_verl.workers.testing import tiny_hf_config

    stand_in = VarlenAttentionKernel("varlen_stand_in", sdpa_varlen_reference, require_half=False)
    real = backends.attention_kernel
    monkeypatch.setattr(
        backends, "attention_kernel", lambda name, device: stand_in if name == "auto" else real(name, device)
    )  # fmt: skip
    cfg = tiny_hf_config("mistral")
    cfg.sliding_window = 16
    cfg.save_pretrained(str(tmp_path / "w16"))
    bench_cfg = BenchConfig(model=str(tmp_path / "w16" / "config.json"), **SMALL)
    res = run_bench(bench_cfg)
    assert res["sliding_window_active"] is True
    assert "attention/varlen_stand_in (window)" in res["kernel_calls"]["tree"]
    assert res["attention_windows"] == [16] * cfg.num_hidden_layers
    prep = prepare_bench(bench_cfg)
    groups = prep.tree.plan(prep.forest)
    subs = [prep.forest.subset(g) for g in groups]
    replays = [0] * len(subs)  # no linear attention
    shape = model_shape(prep.mcfg)
    want = _run_flop_ratio(shape, subs, replays, 16, [16] * cfg.num_hidden_layers)
    assert res["ideal_flop_ratio"] == pytest.approx(want, rel=1e-3)
    assert want != pytest.approx(_run_flop_ratio(shape, subs, replays, 16), rel=1e-3)
    assert res["efficiency"] == pytest.approx(res["speedup"] / res["ideal_flop_ratio"], rel=1e-2)
    assert res["max_abs_dlogp"] <= 1e-4


def _step_file(tmp_path, offset: int) -> tuple[Path, list[list[int]]]:
    """A GRPO-like step (two prompts, four responses each) as JSON Lines, ids from ``offset``."""
    import random

    rng = random.Random(0)
    seqs = []
    for _ in range(2):
        prompt = [offset + rng.randrange(500) for _ in range(40)]
        seqs += [prompt + [offset + rng.randrange(500) for _ in range(12)] for _ in range(4)]
    path = tmp_path / "step.jsonl"
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    return path, seqs


@pytest.mark.parametrize("offset", [0, 10**9], ids=["in-vocab", "renumbered"])
def test_bench_on_your_own_trajectories(tmp_path, capsys, offset):
    """``--trajectories FILE`` benches the file's step: its forest's figures, not a generated
    workload's; ids past the model's vocabulary are renumbered one-to-one in their order, so
    the forest (and every planned figure) is the file's."""
    from harts_verl.benchmark import fit_vocabulary
    from harts_verl.tree import RolloutForest

    path, seqs = _step_file(tmp_path, offset)
    want = RolloutForest.from_sequences(seqs)
    argv = ["bench", "--trajectories", str(path), "--preset", "tiny", "--repeats", "1"]
    assert main([*argv, "--chunk-size", "16", "--capacity", "100", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["trajectories_file"] == str(path) and res["workload"] is None
    assert res["scale"] is None and res["workload_overrides"] is None
    assert res["token_ids_remapped"] is (offset > 0)
    assert res["trajectories"] == len(seqs) == want.num_trajectories
    assert res["semantic_tokens"] == want.num_semantic_tokens
    assert res["compact_tokens"] == want.num_compact_tokens and res["compression"] > 2
    assert res["max_abs_dlogp"] <= 1e-4 and res["microbatches"] >= 2
    arrays = [torch.tensor(s).numpy() for s in seqs]
    got, renumbered = fit_vocabulary(arrays, 1000)
    assert renumbered is (offset > 0) and all(int(a.max()) < 1000 for a in got)
    forest = RolloutForest.from_sequences(got)
    for name in ("first_row", "length", "parent_segment", "fork_position"):
        assert (getattr(forest.segments, name) == getattr(want.segments, name)).all()
    with pytest.raises(ValueError, match=r"trajectories: \d+ distinct token ids, more than the "):
        fit_vocabulary(arrays, 100)


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--workload", "tau_like"], "--workload: a synthetic workload's option, but "),
        (["--scale", "0.1"], "--scale: a synthetic workload's option"),
        (["--workload-option", "max_forks=3"], "--workload-option: a synthetic workload's"),
        (["--generator-defaults"], "--generator-defaults: a synthetic workload's"),
    ],
)
def test_bench_trajectories_refuse_workload_options(tmp_path, capsys, extra, msg):
    path, _ = _step_file(tmp_path, 0)
    assert main(["bench", "--trajectories", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"harts-verl bench: {msg}") and len(err.splitlines()) == 1, err


def test_bench_trajectories_file_errors(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text("[1, 2]\n[3, -1]\n")
    for path, msg in [
        (tmp_path / "bad.jsonl", "--trajectories: .*bad.jsonl: line 2: negative token id -1"),
        (tmp_path / "nope.jsonl", "--trajectories: .*nope.jsonl: no such file"),
    ]:
        argv = ["bench", "--trajectories", str(path), "--preset", "tiny", "--no-progress"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert re.match(f"harts-verl bench: {msg}", err) and len(err.splitlines()) == 1, err


def test_bench_trajectories_fit_the_vocabulary_of_the_benched_prefix_only(tmp_path):
    """With ``max_semantic_tokens`` the benched prefix alone is fitted into the vocabulary:
    trajectories past it (here with more distinct ids than the tiny model's 1,024) neither
    fail the run nor mark its ids renumbered."""
    from harts_verl.benchmark import BenchConfig, load_bench_inputs

    path = tmp_path / "step.jsonl"
    first = [list(range(1, 30)), [*range(1, 20), 5]]
    path.write_text("".join(json.dumps(s) + "\n" for s in [*first, list(range(5000, 7000))]))
    cfg = BenchConfig(preset="tiny", trajectories=str(path), max_semantic_tokens=60)
    got = load_bench_inputs(cfg)
    assert [a.tolist() for a in got.seqs] == first and got.token_ids_remapped is False
    with pytest.raises(ValueError, match=r"trajectories: 2029 distinct token ids, more than"):
        load_bench_inputs(BenchConfig(preset="tiny", trajectories=str(path)))


@pytest.mark.parametrize(
    "seqs,msg",
    [([[1, 2], []], "trajectory 1: empty trajectory"), ([[1, -2]], "trajectory 0: negative")],
)
def test_bench_trajectories_dump_errors_name_the_file(tmp_path, capsys, seqs, msg):
    """A .pt dump's bad trajectory is named with the file, as a token file's line is."""
    path = tmp_path / "b.pt"
    torch.save(seqs, path)
    assert main(["bench", "--trajectories", str(path), "--preset", "tiny", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"harts-verl bench: --trajectories: {path}: {msg}"), err
