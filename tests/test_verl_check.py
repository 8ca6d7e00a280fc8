"""``harts-verl check`` (``harts_verl.workers.check``): fidelity audit on a saved model and a
dumped batch, for every model family that runs in tree mode; the analytic FLOP model
(``harts_verl.runtime.flops``) of the same families."""

from __future__ import annotations

import json
import sys
import types
from functools import partial

import numpy as np
import pytest
import torch


def _batch(tmp_path) -> str:
    rng = np.random.default_rng(0)
    p = rng.integers(0, 64, 20).tolist()
    seqs = [p + rng.integers(0, 64, 9).tolist(), p[:11] + rng.integers(0, 64, 5).tolist(), p]
    nested = torch.nested.as_nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)
    torch.save({"input_ids": nested}, tmp_path / "batch.pt")
    return str(tmp_path / "batch.pt")


def _save_native(path: str) -> str:
    from harts_verl.models import preset
    from harts_verl.models.hf import HartsHybridConfig, HartsHybridForCausalLM

    torch.manual_seed(1)
    cfg = HartsHybridConfig.from_hybrid_config(preset("tiny", vocab_size=64))
    HartsHybridForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "kind,layers",
    [
        ("qwen2", 2),
        ("qwen3_5", 4),
        ("qwen3_5_moe", 4),
        ("harts_hybrid", 4),
        ("deepseek_v3", 2),
        ("qwen3_moe", 2),
        ("gpt_oss", 2),
        # transformers maps it as image-text-to-text only: loaded with that class, as veRL
        # does (AutoModelForCausalLM refused it with a 2.8 KB line, exit 2)
        ("mistral4", 2),
    ],
)
@pytest.mark.parametrize("source", ["weights", "config"])
def test_check_reports_fidelity(tmp_path, capsys, monkeypatch, kind, layers, source):
    monkeypatch.setitem(sys.modules, "fla", None)
    from harts_verl.workers.check import main
    from harts_verl.workers.testing import save_tiny_model

    if kind == "harts_hybrid":
        path = _save_native(str(tmp_path / "m"))
    else:
        path = save_tiny_model(kind, str(tmp_path / "m"), seed=1)
    model = path if source == "weights" else f"{path}/config.json"
    assert main(["--model", model, "--batch", _batch(tmp_path), "--chunk-size", "8"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["trajectories"] == 3 and res["compression"] > 1
    assert res["max_abs_dlogp"] <= 1e-6 and res["mean_cos"] > 0.999999
    # vs the model's own forward of each trajectory (HF's code; float32 rounding only)
    assert 0 < res["own_forward_max_abs_dlogp"] <= 5e-6
    # the native model's own forward runs this package's ops: no independent oracle of them
    assert res["own_forward_independent"] is (kind != "harts_hybrid")
    assert len(res["per_layer_max_abs_diff"]) == layers and res["first_divergent_layer"] is None
    assert res["ideal_flop_ratio"] > 1


def test_check_per_layer_figures_and_a_config_that_cannot_run(tmp_path, capsys, monkeypatch):
    """Per-layer max |Δ| (now compared as the expanded run produces each layer, without
    keeping both runs' outputs) equals a direct computation with its own hooks, and names the
    layer of an injected fault. A config its class accepts but cannot run (top-k above the
    expert count) is one line, exit 2, before the audit (was a traceback, exit 1)."""
    monkeypatch.setitem(sys.modules, "fla", None)
    from harts_verl.runtime import ExpandedRunner, TreeRunner
    from harts_verl.workers import check
    from harts_verl.workers.testing import save_tiny_model

    path = save_tiny_model("qwen2", str(tmp_path / "m"), seed=1)
    model = check.load_tree_model(f"{path}/config.json", dtype=torch.float64)
    seqs = check.load_sequences(_batch(tmp_path))
    layers = check.decoder_layers(model)

    def outputs(runner):  # per layer, per semantic position (trajectory order)
        got = []
        hooks = [
            lyr.register_forward_hook(
                lambda _m, _i, o: got.append(o[0] if isinstance(o, tuple) else o)
            )
            for lyr in layers
        ]
        try:
            runner.hidden_states(seqs)
        finally:
            for h in hooks:
                h.remove()
        forest = runner.build_forest(seqs)
        sem = torch.as_tensor(np.asarray(forest.semantic_rows))
        return [(g[0] if g.dim() == 3 else g)[sem] for g in got]

    tree, exp = TreeRunner(model, chunk_size=8), ExpandedRunner(model, chunk_size=8)
    direct = [float((a - b).abs().max()) for a, b in zip(outputs(tree), outputs(exp))]
    assert check._layer_max_abs_diffs(tree, exp, model, seqs) == direct
    # a fault in layer 1 of the tree run only (its C compact rows; the expanded run has S)
    c = tree.build_forest(seqs).num_compact_tokens

    def fault(_m, _i, out):
        h = out[0] if isinstance(out, tuple) else out
        if (h[0] if h.dim() == 3 else h).shape[0] != c:
            return None
        return (h * 1.5, *out[1:]) if isinstance(out, tuple) else h * 1.5

    hook = layers[1].register_forward_hook(fault)
    try:
        faulty = check._layer_max_abs_diffs(tree, exp, model, seqs)
    finally:
        hook.remove()
    assert faulty[0] == direct[0] <= 1e-12 and faulty[1] > 1e-3
    # a config its class accepts but cannot run
    cfg = json.loads(open(f"{path}/config.json").read())
    cfg.update(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_experts=4,
        num_local_experts=4,
        num_experts_per_tok=8,
        moe_intermediate_size=16,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=False,
    )
    (tmp_path / "bad.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert check.main(["--model", str(tmp_path / "bad.json"), "--batch", _batch(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "own forward fails on a 2-token input" in err and "--model" in err


def test_check_compares_nothing_without_a_next_token(tmp_path, capsys, monkeypatch):
    """Trajectories of one token have no log-prob: both Δlogp figures are null (they read 0.0,
    an agreement nothing measured)."""
    monkeypatch.setitem(sys.modules, "fla", None)
    from harts_verl.workers.check import main
    from harts_verl.workers.testing import save_tiny_model

    path = save_tiny_model("qwen2", str(tmp_path / "m"), seed=1)
    torch.save([[5], [6], [5]], tmp_path / "b.pt")
    assert main(["--model", path, "--batch", str(tmp_path / "b.pt")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["trajectories"] == 3 and res["compact_tokens"] == 2
    assert res["max_abs_dlogp"] is None and res["own_forward_max_abs_dlogp"] is None


def test_cli_check_on_native_config_in_a_fresh_process(tmp_path):
    """``harts-verl check`` registers the native model's Auto classes itself."""
    import os
    import subprocess

    path = _save_native(str(tmp_path / "m"))
    code = (
        "import sys; sys.modules['fla'] = None; from harts_verl.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    args = ["check", "--model", f"{path}/config.json", "--batch", _batch(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout[out.stdout.index("{") :])
    assert res["max_abs_dlogp"] <= 1e-6 and len(res["per_layer_max_abs_diff"]) == 4


def _param_flops(model: torch.nn.Module) -> float:
    """2 x the weights a token multiplies (linears, convolutions, routers, its share of the
    routed experts): the per-token forward FLOPs counted from the module tree. Routers:
    ``…TopKRouter`` / ``…TopkRouter``; stacked routed experts: ``…Experts`` / ``…NaiveMoe``
    (their own weight matrices, each with one leading row per expert; gpt-oss's stacked biases
    are not matmuls)."""
    cfg = model.config
    top_k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "moe_topk", 0)
    total = 0.0
    for m in model.modules():
        name = type(m).__name__
        if isinstance(m, torch.nn.Linear | torch.nn.Conv1d):
            total += m.weight.numel()
        elif name.lower().endswith("topkrouter") and hasattr(m, "weight"):  # else: a Linear
            total += m.weight.numel()
        elif name == "RecurrentGemmaRglru":  # block-diagonal input and recurrence gates
            total += m.input_gate_weight.numel() + m.recurrent_gate_weight.numel()
        elif name.endswith(("Experts", "NaiveMoe")):
            # one expert: one row of each stacked weight (LongCat-Flash allocates gate_up rows
            # for its zero-computation experts too)
            own = [p for p in m.parameters(recurse=False) if p.dim() == 3]
            total += sum(p[0].numel() for p in own) * top_k
    return 2.0 * total


_FLOP_KINDS = ("qwen2", "qwen3_next", "qwen3_5", "qwen3_5_moe", "llama", "qwen3", "mistral")
_FLOP_KINDS += ("olmo2", "olmo3", "phi3", "seed_oss", "glm4", "gemma3_text", "gemma2", "granite")
_FLOP_KINDS += ("cohere", "cohere2", "smollm3", "ministral", "exaone4", "ernie4_5")
_FLOP_KINDS += ("hunyuan_v1_dense", "apertus", "arcee")
_FLOP_MOE_KINDS = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss")
_FLOP_MOE_KINDS += ("granitemoe", "granitemoeshared", "minimax_m2")
_FLOP_MOE_KINDS += ("olmoe", "flex_olmo", "dots1", "solar_open", "glm4_moe_lite", "exaone_moe")
_FLOP_MOE_KINDS += ("ministral3", "mistral4")
_FLOP_MOE_KINDS += ("hunyuan_v1_moe", "ernie4_5_moe", "cohere2_moe", "longcat_flash")
_FLOP_MAMBA2_KINDS = ("granitemoehybrid", "bamba", "nemotron_h", "falcon_h1")
_FLOP_CONV_KINDS = ("lfm2", "lfm2_moe")
_FLOP_LIGHTNING_KINDS = ("minimax",)
_FLOP_MAMBA1_KINDS = ("jamba",)
_FLOP_RECURRENT_GEMMA_KINDS = ("recurrent_gemma",)
_FLOP_SSM_KINDS = ("mamba", "falcon_mamba", "mamba2")


@pytest.mark.parametrize(
    "kind",
    _FLOP_KINDS
    + _FLOP_MOE_KINDS
    + _FLOP_MAMBA2_KINDS
    + _FLOP_MAMBA1_KINDS
    + _FLOP_CONV_KINDS
    + _FLOP_LIGHTNING_KINDS
    + _FLOP_RECURRENT_GEMMA_KINDS
    + _FLOP_SSM_KINDS,
)
def test_flop_model_matches_the_module_tree(kind, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    from harts_verl.runtime.flops import model_shape
    from harts_verl.workers.testing import tiny_hf_model

    model = tiny_hf_model(kind)
    shape = model_shape(model.config)
    assert shape.dense_per_token == pytest.approx(_param_flops(model), rel=1e-12)
    cfg = model.config
    # softmax-attention layers: full or sliding-window (OLMo 3, Gemma 3, gpt-oss), not linear
    # attention
    n_full = sum(t != "linear_attention" for t in getattr(cfg, "layer_types", None) or [])
    n_full = n_full or cfg.num_hidden_layers
    if kind in _FLOP_MAMBA2_KINDS + _FLOP_MAMBA1_KINDS + _FLOP_RECURRENT_GEMMA_KINDS and (
        kind != "falcon_h1"
    ):
        # Mamba-2, Mamba-1 or RG-LRU / attention (/ MLP / MoE) blocks
        n_full = sum(t == "attention" for t in cfg.layers_block_type)
        assert 0 < n_full < cfg.num_hidden_layers
    if kind in _FLOP_CONV_KINDS:  # conv / full_attention layers
        n_full = sum(t == "full_attention" for t in cfg.layer_types)
        assert 0 < n_full < cfg.num_hidden_layers
    if kind in _FLOP_SSM_KINDS:  # no attention; every layer a mixer
        assert shape.attention_per_pair == 0.0 and shape.linear_per_token > 0
        return
    h = cfg.num_attention_heads
    if kind in (
        "deepseek_v3",
        "glm4_moe_lite",
        "mistral4",
        "longcat_flash",
    ):  # MLA: q·k over nope + rope, p·v over v dims
        per_layer = 2.0 * h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    else:
        per_layer = 4.0 * h * (getattr(cfg, "head_dim", None) or cfg.hidden_size // h)
    assert shape.attention_per_pair == per_layer * n_full
    linear = ("qwen3_next", "qwen3_5", "qwen3_5_moe", *_FLOP_MAMBA2_KINDS, *_FLOP_MAMBA1_KINDS)
    linear += _FLOP_LIGHTNING_KINDS + _FLOP_RECURRENT_GEMMA_KINDS
    assert (shape.linear_per_token > 0) == (kind in linear)


def test_flop_model_hunyuan_top_k_per_layer():
    """Hunyuan-MoE takes ``moe_topk`` per layer (a list; ``num_experts_per_tok`` aliases it): each
    layer counts its own experts (the list reached the arithmetic whole: TypeError)."""
    import copy

    from harts_verl.runtime.flops import model_shape
    from harts_verl.workers.testing import tiny_hf_config

    cfg = tiny_hf_config("hunyuan_v1_moe")
    assert cfg.num_hidden_layers == 2

    def dense(top_k):
        c = copy.deepcopy(cfg)
        c.moe_topk = top_k
        return model_shape(c).dense_per_token

    assert dense(1) < dense(2)
    assert dense([1, 2]) == pytest.approx((dense(1) + dense(2)) / 2, rel=1e-12)


def test_flop_model_zamba2_counts_every_use_of_its_shared_block(monkeypatch):
    """Zamba2 runs one shared transformer block in each of its ``hybrid`` layers (tied weights;
    each block keeps the LoRA adapters of every use): the FLOP model equals 2 × the weights of every linear and conv call of
    a one-token forward (each use counted), and its attention pairs those of each use."""
    monkeypatch.setitem(sys.modules, "fla", None)
    from harts_verl.runtime.flops import model_shape
    from harts_verl.workers.testing import tiny_hf_model

    model = tiny_hf_model("zamba2")
    calls: list[float] = []
    q_calls: list[str] = []
    hooks = [
        m.register_forward_hook(lambda m, _i, _o: calls.append(2.0 * m.weight.numel()))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear | torch.nn.Conv1d)
    ]
    hooks += [
        m.register_forward_hook(lambda _m, _i, _o, n=name: q_calls.append(n))
        for name, m in model.named_modules()
        if name.endswith("self_attn.q_proj")
    ]
    with torch.no_grad():
        model(torch.tensor([[1]]), use_cache=False)
    for h in hooks:
        h.remove()
    cfg = model.config
    shape = model_shape(cfg)
    assert shape.dense_per_token == pytest.approx(sum(calls), rel=1e-12)
    uses = cfg.layers_block_type.count("hybrid")
    assert uses == 2 and len(q_calls) == uses  # the shared block runs in each use
    per_use = 4.0 * cfg.num_attention_heads * cfg.attention_head_dim
    assert shape.attention_per_pair == uses * per_use and shape.linear_per_token > 0


def test_flop_model_nemotron_h_latent_moe(monkeypatch):
    """Nemotron-H's MoE with ``moe_latent_size`` (experts between two latent projections) and
    ``n_shared_experts = 2`` (HF still builds one shared expert): the FLOP model matches the
    module tree."""
    monkeypatch.setitem(sys.modules, "fla", None)
    import transformers

    from harts_verl.runtime.flops import model_shape
    from harts_verl.workers.testing import tiny_hf_config

    cfg = tiny_hf_config("nemotron_h")
    cfg.moe_latent_size = 8
    cfg.n_shared_experts = 2
    model = transformers.NemotronHForCausalLM(cfg)
    assert model_shape(cfg).dense_per_token == pytest.approx(_param_flops(model), rel=1e-12)


def test_flop_model_dispatch(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    import transformers

    from harts_verl.models import preset
    from harts_verl.models.hf import HartsHybridConfig
    from harts_verl.runtime.flops import model_shape, native_model_shape
    from harts_verl.workers.testing import tiny_hf_config

    native = preset("tiny")
    assert model_shape(native) == native_model_shape(native)
    assert model_shape(HartsHybridConfig.from_hybrid_config(native)) == native_model_shape(native)
    text = tiny_hf_config("qwen3_5")
    wrapper = transformers.Qwen3_5Config(text_config=text.to_dict())
    assert model_shape(wrapper) == model_shape(text)
    with pytest.raises(ValueError, match="gpt2"):
        model_shape(transformers.GPT2Config())


def test_load_sequences_formats_and_errors(tmp_path):
    """Every dump format a veRL user produces loads to the same trajectories (dense batches
    through their attention mask); malformed dumps raise ValueError naming the file."""
    from tensordict import TensorDict
    from verl import DataProto

    from harts_verl.tree import RolloutForest
    from harts_verl.workers.check import load_sequences, run_check

    seqs = [[5, 6, 7], [5, 6], [9]]
    nested = torch.nested.as_nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)
    dense = torch.tensor([[5, 6, 7], [5, 6, 0], [9, 0, 0]])
    mask = (torch.arange(3)[None] < torch.tensor([3, 2, 1])[:, None]).long()
    good = {
        "list": seqs,
        "tensors": [torch.tensor(s) for s in seqs],
        "nested": nested,
        "dict": {"input_ids": nested},
        "dense": {"input_ids": dense, "attention_mask": mask},
        "tensordict": TensorDict({"input_ids": dense, "attention_mask": mask}, batch_size=[3]),
        "dataproto": DataProto.from_dict({"input_ids": dense, "attention_mask": mask}),
        # padded rows as lists with their mask: the mask applies (padding is not a token)
        "listmask": {"input_ids": dense.tolist(), "attention_mask": mask},
        "tensorrowsmask": {"input_ids": list(dense), "attention_mask": mask},
        "listrowslistmask": {"input_ids": dense.tolist(), "attention_mask": mask.tolist()},
        # numpy uint64 scalars beside Python ints (numpy made them float64: refused)
        "mixedscalars": [[np.uint64(x) if k == 0 else x for k, x in enumerate(t)] for t in seqs],
    }
    for name, obj in good.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        assert load_sequences(str(tmp_path / f"{name}.pt")) == seqs, name
    RolloutForest.from_sequences(seqs).save(str(tmp_path / "f.npz"))
    assert load_sequences(str(tmp_path / "f.npz")) == seqs
    # a forest file is told by its content under any name (RolloutForest.save keeps the name)
    for name in ("forest.bin", "F.NPZ"):
        (tmp_path / name).write_bytes((tmp_path / "f.npz").read_bytes())
        assert load_sequences(str(tmp_path / name)) == seqs, name
    # one trajectory as a 1-D tensor with its mask: the mask applies (it was ignored)
    torch.save(
        {"input_ids": torch.tensor([5, 6, 0, 0]), "attention_mask": torch.tensor([1, 1, 0, 0])},
        tmp_path / "pad1d.pt",
    )
    assert load_sequences(str(tmp_path / "pad1d.pt")) == [[5, 6]]
    bad = {
        "floats": ([[1.0, 2.0]], "integer token ids"),
        "empty": ([], "no trajectories"),
        "nokey": ({"sequences": seqs}, "no 'input_ids'"),
        "densenomask": ({"input_ids": dense}, "without attention_mask"),
        "maskshape": ({"input_ids": dense, "attention_mask": mask[:2]}, "does not match"),
        "raggedmask": ({"input_ids": seqs, "attention_mask": mask}, "of different widths"),
        "dense3d": ({"input_ids": dense[None], "attention_mask": mask[None]}, "got a 3-D"),
        "scalar": ({"input_ids": torch.tensor(5)}, "got a 0-D"),
        "ragged": ([[1, 2], [3, [4]]], "trajectory 1: expected a flat sequence"),
        "mask1d": (
            {"input_ids": torch.tensor([5, 6]), "attention_mask": torch.tensor([[7, 7]])},
            "only 0 / 1 values",
        ),
        "mask1dshape": (
            {"input_ids": torch.tensor([5, 6]), "attention_mask": torch.tensor([1, 1, 0])},
            "does not match",
        ),
        # a 0 between a row's 1s: the tokens on both sides were joined into one trajectory
        # (token 7 dropped, 8 moved to position 2); veRL's masks pad on the left / right only
        "maskgap": (
            {
                "input_ids": torch.tensor([[5, 6, 7, 8]]),
                "attention_mask": torch.tensor([[1, 1, 0, 1]]),
            },
            r"attention_mask row 0: a gap \(0 at position 2 between 1s\)",
        ),
        # Python ints numpy cannot hold in one integer dtype (it made floats / objects)
        "huge": ([[1, 2, 2**63]], "trajectory 0: token id 9223372036854775808 is beyond int64"),
        "huger": ([[1, 2**70]], "token id 1180591620717411303424 is beyond int64"),
        # dtypes numpy has no match for, and tensors without data: named by trajectory (they
        # were torch's own messages, "Got unsupported ScalarType BFloat16", no trajectory)
        "bf16": (
            [torch.tensor([1, 2]), torch.tensor([1, 2], dtype=torch.bfloat16)],
            r"trajectory 1: expected a 1-D sequence of integer token ids, got dtype "
            r"torch\.bfloat16",
        ),
        "bf16nested": (
            {"input_ids": [torch.tensor([3.0], dtype=torch.bfloat16)]},
            "trajectory 0: .* got dtype torch.bfloat16",
        ),
        "meta": ([torch.tensor([1, 2], device="meta")], "trajectory 0: a meta tensor holds no"),
        # these were tracebacks (exit status 1) from inside torch
        "metamask": (
            {"input_ids": dense.to("meta"), "attention_mask": mask.to("meta")},
            "attention_mask: a meta tensor holds no data",
        ),
        "metanested": ({"input_ids": nested.to("meta")}, "input_ids: a meta tensor holds no"),
        "sparse": (
            {"input_ids": dense.to_sparse(), "attention_mask": mask},
            "input_ids: expected a dense or nested tensor, got torch.sparse_coo",
        ),
        "metarows": (
            {"input_ids": [dense[0].to("meta")], "attention_mask": mask[:1]},
            "input_ids row 0: a meta tensor holds no data",
        ),
    }
    bad["protonobatch"] = (DataProto(), "no tensor batch")
    for name, (obj, msg) in bad.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        with pytest.raises(ValueError, match=msg) as info:
            load_sequences(str(tmp_path / f"{name}.pt"))
        assert f"{name}.pt" in str(info.value)
    with pytest.raises(ValueError, match="no trajectories"):
        run_check(None, [])


def test_load_sequences_reads_files_by_content(tmp_path):
    """A ``torch.save`` file named ``.npz`` is read as one (it was refused as no forest file),
    a forest saved under another name as a forest."""
    from harts_verl.tree import RolloutForest
    from harts_verl.workers.check import load_sequences

    seqs = [[5, 6, 7], [5, 6]]
    torch.save(seqs, tmp_path / "batch.npz")
    assert load_sequences(str(tmp_path / "batch.npz")) == seqs
    RolloutForest.from_sequences(seqs).save(str(tmp_path / "f.npz"))
    (tmp_path / "f.npz").rename(tmp_path / "f.pt")
    assert load_sequences(str(tmp_path / "f.pt")) == seqs


def test_load_sequences_notes_positions_other_than_depths(tmp_path, capsys):
    """A dump whose ``position_ids`` are 0..L-1 in every trajectory (nested, mrope rows, dense
    with left padding read through the mask) loads silently; another one loads with one note
    naming the trajectory (the audit runs 0..L-1, the engine would take the stock path)."""
    from harts_verl.workers.check import load_sequences

    seqs = [[5, 6, 7], [5, 6], [9]]
    lens = [3, 2, 1]

    def nested(ts):
        return torch.nested.as_nested_tensor(ts, layout=torch.jagged)

    ids = nested([torch.tensor(s) for s in seqs])
    left = torch.tensor([[5, 6, 7], [0, 5, 6], [0, 0, 9]])
    lmask = (left != 0).long()
    lpos = (lmask.cumsum(1) - 1).clamp(min=0)
    mrope = [torch.arange(n).expand(4, n).clone() for n in lens]
    quiet = {
        "nested": {"input_ids": ids, "position_ids": nested([torch.arange(n) for n in lens])},
        "mrope": {"input_ids": ids, "position_ids": nested(mrope)},
        "mrope_t": {"input_ids": ids, "position_ids": nested([m.T.contiguous() for m in mrope])},
        "left": {"input_ids": left, "attention_mask": lmask, "position_ids": lpos},
        "left3d": {
            "input_ids": left,
            "attention_mask": lmask,
            "position_ids": lpos[:, None].expand(3, 4, 3),
        },
        # a width that does not match the mask: nothing to note, no crash
        "badwidth": {"input_ids": left, "attention_mask": lmask, "position_ids": lpos[:, :2]},
        # lists of per-trajectory positions (lists or tensors)
        "lists": {"input_ids": seqs, "position_ids": [list(range(n)) for n in lens]},
        "list_t": {"input_ids": ids, "position_ids": [torch.arange(n) for n in lens]},
    }
    for name, obj in quiet.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        assert load_sequences(str(tmp_path / f"{name}.pt")) == seqs, name
        assert capsys.readouterr().err == "", name
    mrope[1][2, 1] = 7
    loud = {
        "shifted": {"input_ids": ids, "position_ids": nested([torch.arange(n) + 1 for n in lens])},
        "mrope": {"input_ids": ids, "position_ids": nested(mrope)},
        "left": {"input_ids": left, "attention_mask": lmask, "position_ids": lpos + lmask},
        # list and 1-D layouts were not read: no note (they got the audit at other positions)
        "lists": {"input_ids": seqs, "position_ids": [list(range(3, 3 + n)) for n in lens]},
        "list_t": {"input_ids": ids, "position_ids": [torch.arange(n) + 3 for n in lens]},
    }
    for name, obj in {
        "one": {"input_ids": torch.tensor([5, 6, 7]), "position_ids": torch.tensor([3, 4, 5])},
        "one_mask": {
            "input_ids": torch.tensor([5, 6, 7]),
            "attention_mask": torch.tensor([1, 1, 1]),
            "position_ids": torch.tensor([3, 4, 5]),
        },
    }.items():
        torch.save(obj, tmp_path / f"bad_{name}.pt")
        assert load_sequences(str(tmp_path / f"bad_{name}.pt")) == [[5, 6, 7]], name
        assert "trajectory 0 are not 0..2" in capsys.readouterr().err, name
    for name, obj in loud.items():
        torch.save(obj, tmp_path / f"bad_{name}.pt")
        assert load_sequences(str(tmp_path / f"bad_{name}.pt")) == seqs, name
        err = capsys.readouterr().err
        want = "trajectory 1 are not 0..1" if name == "mrope" else "trajectory 0 are not 0..2"
        assert err.startswith("harts-verl check: note: ") and want in err, (name, err)
        assert err.count("\n") == 1


def _check_error(capsys, argv: list[str], msg: str, *, entry: str = "cli") -> str:
    """``check`` with ``argv`` is a user error: exit status 2, one stderr line naming it."""
    if entry == "cli":
        from harts_verl.cli import main

        rc = main(["check", *argv])
    else:
        from harts_verl.workers.check import main

        rc = main(argv)
    assert rc == 2, argv
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("harts")]
    assert len(err) == 1 and err[0].startswith("harts-verl check: "), (argv, err)
    assert msg in err[0], (argv, err)
    return err[0]


def _counting_load(calls: list, load, *args, **kwargs):
    calls.append(1)
    return load(*args, **kwargs)


def test_check_input_errors(tmp_path, capsys, monkeypatch):
    """Bad models and batches end ``harts-verl check`` (and ``python -m ...check``) with one
    line naming the flag; an unsupported model type is refused before the model is built."""
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.delenv("HARTS_VERL_DEBUG", raising=False)
    import transformers

    import harts_verl.models.hf as hf
    from harts_verl.workers.testing import tiny_hf_config

    tiny_hf_config("qwen2").save_pretrained(str(tmp_path / "noweights"))
    model = str(tmp_path / "noweights" / "config.json")
    batch = _batch(tmp_path)
    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64).save_pretrained(
        str(tmp_path / "gpt2")
    )
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "junk.pt").write_bytes(b"junk\n")
    (tmp_path / "trunc.pt").write_bytes((tmp_path / "batch.pt").read_bytes()[:200])
    torch.save([[1, 2, 3], [1, 2, 64]], tmp_path / "oov.pt")
    torch.save([[1, 2, 3], [1, -5]], tmp_path / "neg.pt")
    torch.save([[1.0, 2.0]], tmp_path / "floats.pt")
    np.savez(tmp_path / "other.npz", a=np.arange(3))
    torch.save([np.array([1, 2**63], dtype=np.uint64)], tmp_path / "huge.pt")
    # a pickle of a class whose module is gone when the file is read
    fake = types.ModuleType("harts_check_fake_module")
    fake.Gone = type("Gone", (), {"__module__": fake.__name__})
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    torch.save([fake.Gone()], tmp_path / "gone.pt")
    monkeypatch.delitem(sys.modules, fake.__name__)

    real_load = hf.load_causal_lm
    monkeypatch.setattr(hf, "load_causal_lm", lambda *a, **k: pytest.fail("model built"))
    for spec, msg in [
        (str(tmp_path / "gpt2" / "config.json"), "--model: "),
        (str(tmp_path / "gpt2"), "'gpt2' model, which has no tree mode"),
        ("nofile.json", "--model: config file 'nofile.json' does not exist"),
        (str(tmp_path / "bad.json"), "not a valid JSON file"),
        (str(tmp_path / "nodir"), "--model: expected an HF model directory or a config.json"),
    ]:
        line = _check_error(capsys, ["--model", spec, "--batch", batch], msg)
        assert "model: model:" not in line and "--model: --model" not in line
    monkeypatch.setattr(hf, "load_causal_lm", real_load)
    _check_error(
        capsys,
        ["--model", str(tmp_path / "noweights"), "--batch", batch],
        "config.json for random weights",
    )
    for name, msg in [
        ("missing.pt", "missing.pt: no such file"),
        ("junk.pt", "junk.pt: not a torch.save file"),
        ("trunc.pt", "trunc.pt: not a torch.save file"),
        ("oov.pt", "outside the model's vocabulary"),
        ("neg.pt", "negative token id -5"),
        ("floats.pt", "integer token ids"),
        ("other.npz", "other.npz: not a forest file"),
        ("huge.pt", "token id 9223372036854775808 is beyond int64"),
        ("gone.pt", "gone.pt: not a torch.save file or a forest .npz (ModuleNotFoundError"),
    ]:
        # a malformed batch file is refused before any weights are loaded
        built: list[int] = []
        monkeypatch.setattr(hf, "load_causal_lm", partial(_counting_load, built, real_load))
        line = _check_error(capsys, ["--model", model, "--batch", str(tmp_path / name)], msg)
        assert line.startswith("harts-verl check: --batch: ")
        assert bool(built) == (name == "oov.pt"), name
    _check_error(
        capsys, ["--model", "nofile.json", "--batch", batch], "--model: config", entry="module"
    )
    monkeypatch.setenv("HARTS_VERL_DEBUG", "1")
    from harts_verl.cli import main

    with pytest.raises(ValueError, match="--model: config file"):
        main(["check", "--model", "nofile.json", "--batch", batch])


def test_check_input_errors_name_the_right_flag(tmp_path, capsys, monkeypatch):
    """Numeric flags past what the audit can run, a malformed mask, a model the tree runner
    cannot drive, a config its model class fails on and a batch longer than a dynamic RoPE's
    exact range: one line naming the flag at fault."""
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.delenv("HARTS_VERL_DEBUG", raising=False)
    from harts_verl.workers.testing import tiny_hf_config

    tiny_hf_config("qwen2").save_pretrained(str(tmp_path / "m"))
    model = str(tmp_path / "m" / "config.json")
    batch = _batch(tmp_path)
    torch.save(
        {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": [[1, 1, 1]]}, tmp_path / "ml.pt"
    )
    torch.save(
        {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.tensor([[0, 2, 1]])},
        tmp_path / "m2.pt",
    )
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "layers0.json").write_text(json.dumps({**cfg, "num_hidden_layers": 0}))
    (tmp_path / "act.json").write_text(json.dumps({**cfg, "hidden_act": "no_such_act"}))
    # dynamic NTK RoPE: tree mode is exact below the original context only (the batch: 29 tokens)
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    dynamic = {**cfg, "rope_parameters": rope, "max_position_embeddings": 16}
    (tmp_path / "dynamic.json").write_text(json.dumps(dynamic))
    big = str(2**64)
    for argv, msg in [
        (["--model", model, "--batch", batch, "--chunk-size", big], "--chunk-size: expected"),
        (["--model", model, "--batch", batch, "--chunk-size", "100000"], "in [1, 4096]"),
        (["--model", model, "--batch", batch, "--seed", big], "--seed: expected an int <="),
        (["--model", model, "--batch", str(tmp_path / "ml.pt")], "attention_mask: expected a"),
        (["--model", model, "--batch", str(tmp_path / "m2.pt")], "only 0 / 1 values"),
        (["--model", str(tmp_path / "layers0.json"), "--batch", batch], "--model: "),
        (["--model", str(tmp_path / "act.json"), "--batch", batch], "'no_such_act'"),
    ]:
        line = _check_error(capsys, argv, msg)
        if "json" in argv[1] and argv[1] != model:
            assert line.startswith("harts-verl check: --model: "), line
    line = _check_error(
        capsys,
        ["--model", str(tmp_path / "dynamic.json"), "--batch", batch],
        "exact only up to 15 tokens per trajectory; this batch has a trajectory of 29 tokens",
    )
    assert line.startswith("harts-verl check: --batch: ")
    # a JSON Lines file's longest trajectory is named by its line
    (tmp_path / "long.jsonl").write_text(f"[1, 2, 3]\n\n{list(range(1, 30))}\n[4, 5]\n")
    line = _check_error(
        capsys,
        ["--model", str(tmp_path / "dynamic.json"), "--batch", str(tmp_path / "long.jsonl")],
        "long.jsonl: line 3 (trajectory 1): rope_type 'dynamic': the rotary frequencies",
    )


@pytest.mark.parametrize("tol", ["nan", "inf", "-inf", "-1", "x"])
def test_check_rejects_bad_tol(tol, capsys):
    from harts_verl.cli import main
    from harts_verl.workers.check import run_check

    with pytest.raises(SystemExit) as info:
        main(["check", "--model", "m.json", "--batch", "b.pt", f"--tol={tol}"])
    assert info.value.code == 2
    assert "argument --tol: expected a finite number >= 0" in capsys.readouterr().err
    if tol != "x":
        with pytest.raises(ValueError, match="tol: expected a finite number >= 0"):
            run_check(None, [[1, 2]], tol=float(tol))
    else:  # an int past float's range (OverflowError before)
        with pytest.raises(ValueError, match="tol: expected a finite number >= 0"):
            run_check(None, [[1, 2]], tol=10**400)


def test_check_output_is_strict_json(tmp_path, capsys, monkeypatch):
    """A non-finite figure is an error naming it (never NaN / Infinity in the output)."""
    monkeypatch.setitem(sys.modules, "fla", None)
    import harts_verl.workers.check as check
    from harts_verl.cli import main
    from harts_verl.workers.testing import tiny_hf_config

    tiny_hf_config("qwen2").save_pretrained(str(tmp_path / "m"))
    monkeypatch.setattr(check, "run_check", lambda *a, **k: {"max_abs_dlogp": float("nan")})
    argv = ["check", "--model", str(tmp_path / "m" / "config.json"), "--batch", _batch(tmp_path)]
    with pytest.raises(ValueError, match="non-finite values in the result: max_abs_dlogp"):
        main(argv)
    assert "NaN" not in capsys.readouterr().out


def test_check_names_nan_and_gives_a_verdict(tmp_path, capsys, monkeypatch):
    """A NaN log-prob in a trajectory after the first was dropped by Python's max (the audit
    read 0.0: perfect agreement); now it is null, named in ``non_finite`` and exit status 3.
    ``--fail-above``: ``agree`` and exit 3 on a log-prob disagreement that no layer shows (a
    shifted head); an empty trajectory given as a list is named as such."""
    monkeypatch.setitem(sys.modules, "fla", None)
    from harts_verl.cli import main
    from harts_verl.runtime import runner
    from harts_verl.workers.testing import save_tiny_model

    path = save_tiny_model("qwen2", str(tmp_path / "m"), seed=1)
    argv = ["check", "--model", path, "--batch", _batch(tmp_path)]
    assert main([*argv, "--fail-above", "1e-4"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["agree"] is True and res["fail_above"] == 1e-4 and res["non_finite"] == []
    log_probs = runner.TreeRunner.log_probs

    def broken(shift: float, nan_at: int | None):
        def lp(self, seqs, *a, **k):
            out = [t + shift for t in log_probs(self, seqs, *a, **k)]
            if nan_at is not None:
                out[nan_at] = torch.full_like(out[nan_at], float("nan"))
            return out

        return lp

    monkeypatch.setattr(runner.TreeRunner, "log_probs", broken(0.0, 1))
    assert main(argv) == 3
    res = json.loads(capsys.readouterr().out)
    assert res["max_abs_dlogp"] is None and res["own_forward_max_abs_dlogp"] is None
    assert res["non_finite"] == ["max_abs_dlogp", "own_forward_max_abs_dlogp"]
    assert "agree" not in res
    monkeypatch.setattr(runner.TreeRunner, "log_probs", broken(0.5, None))
    assert main(argv) == 0  # no verdict asked for
    res = json.loads(capsys.readouterr().out)
    assert res["max_abs_dlogp"] == pytest.approx(0.5) and res["first_divergent_layer"] is None
    assert main([*argv, "--fail-above", "1e-4"]) == 3
    assert json.loads(capsys.readouterr().out)["agree"] is False
    torch.save([[5, 6, 7], []], tmp_path / "e.pt")
    rc = main(["check", "--model", path, "--batch", str(tmp_path / "e.pt")])
    # named as the file's trajectory, as load_sequences names them ("sequences[1]" was the
    # argument name of RolloutForest.from_sequences, nothing in the user's file)
    assert rc == 2 and "e.pt: trajectory 1: empty trajectory" in capsys.readouterr().err
    torch.save([[5, 6, 7], [5, 99]], tmp_path / "v.pt")
    rc = main(["check", "--model", path, "--batch", str(tmp_path / "v.pt")])
    err = capsys.readouterr().err
    assert rc == 2 and "v.pt: trajectory 1: token id 99 at position 1 is outside" in err
    # a JSON Lines token file's trajectory is named by its line (blank lines skipped)
    (tmp_path / "v.jsonl").write_text('[5, 6, 7]\n\n{"input_ids": [5, 99]}\n')
    rc = main(["check", "--model", path, "--batch", str(tmp_path / "v.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "v.jsonl: line 3 (trajectory 1): token id 99 at position 1 is" in err
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):
            main([*argv, "--fail-above", bad])


def test_check_refuses_a_checkpoint_that_lacks_a_tensor(tmp_path, capsys, monkeypatch):
    """A weights directory missing a tensor is refused by name (exit 2): transformers would
    initialise it at random, unseeded, so the audit (and the bench) ran another model, with
    figures that changed from run to run."""
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.delenv("HARTS_VERL_DEBUG", raising=False)
    from safetensors.torch import load_file, save_file

    from harts_verl.workers.check import main
    from harts_verl.workers.testing import save_tiny_model

    path = save_tiny_model("qwen2", str(tmp_path / "m"), seed=1)
    weights = tmp_path / "m" / "model.safetensors"
    sd = load_file(str(weights))
    name = "model.layers.0.mlp.up_proj.weight"
    del sd[name]
    save_file(sd, str(weights), metadata={"format": "pt"})
    assert main(["--model", path, "--batch", _batch(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and name in err and "lacks 1 tensor" in err


def test_check_flop_ratio_counts_the_windows_its_tree_forward_applied(monkeypatch):
    """A Gemma 3 text model (sliding and full layers) with a window shorter than the batch's
    trajectories: ``ideal_flop_ratio`` counts each sliding layer's windowed pairs, as recounted
    from the layer types; a window no trajectory reaches changes nothing."""
    monkeypatch.setitem(sys.modules, "fla", None)
    from transformers import AutoModelForCausalLM

    from harts_verl.runtime.flops import ideal_flop_ratio, model_shape
    from harts_verl.tree import RolloutForest
    from harts_verl.workers.check import run_check
    from harts_verl.workers.testing import tiny_hf_config

    rng = np.random.default_rng(0)
    base = rng.integers(0, 64, 24).tolist()
    seqs = [base + rng.integers(0, 64, 8).tolist(), [*base[:12], 1, 2, 3], base[:20]]
    forest = RolloutForest.from_sequences(seqs)
    for window, bites in ((6, True), (1000, False)):
        cfg = tiny_hf_config("gemma3_text")
        cfg.sliding_window = window
        types = list(cfg.layer_types)
        assert "sliding_attention" in types and "full_attention" in types
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        res = run_check(model, seqs, chunk_size=8)
        windows = [window if t == "sliding_attention" and bites else None for t in types]
        shape = model_shape(cfg)
        want = ideal_flop_ratio(shape, forest, 0, 8, windows)["ideal_flop_ratio"]
        assert res["ideal_flop_ratio"] == pytest.approx(want, rel=1e-12)
        full = ideal_flop_ratio(shape, forest, 0, 8)["ideal_flop_ratio"]
        assert (want != pytest.approx(full, rel=1e-9)) is bites
