"""Kimi-Linear checkpoints as the native hybrid model (``harts_verl.models.kimi_linear``,
``harts_verl.models.checkpoints``).

The oracle is transformers' own ``KimiLinearForCausalLM`` (transformers >= 5.23, run in a
subprocess: ``_source_oracle.py``), in float64 with its float32 islands lifted: the converted
native model gives the same logits (<= 1e-10) trajectory-wise and in tree mode, from Moonshot's
checkpoint format and from transformers' in-memory names; the checkpoint converted back loads in
transformers and gives bitwise the same logits. ``make test`` installs that transformers into
``.oracles/transformers`` (``HARTS_ORACLE_TRANSFORMERS``) and requires it (``HARTS_REQUIRE_ORACLES=1``).
"""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch
from _oracles import (
    assert_round_trip_in_transformers,
    assert_tree_mode_matches,
    assert_verl_engine_matches,
    build_oracle,
    max_logit_error,
    shared_prefix_sequences,
)

from harts_verl.models import checkpoints as ck
from harts_verl.models import kimi_linear as kl
from harts_verl.models.config import HybridConfig, preset
from harts_verl.models.hf import HartsHybridForCausalLM, load_causal_lm
from harts_verl.models.hybrid import HybridForCausalLM

# Moonshot-style config: 6 layers (KDA, KDA, MLA, KDA, KDA, MLA), first layer dense, MoE with
# 2 expert groups (1 kept), a shared expert, MLA with a q bottleneck off and a NoPE shared part.
KIMI_CONFIG = {
    "model_type": "kimi_linear",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "linear_attn_config": {
        "head_dim": 16,
        "num_heads": 2,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 4, 5],
        "full_attn_layers": [3, 6],
    },
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _sequences() -> list[list[int]]:
    return shared_prefix_sequences(11, 96)


def _to_hybrid(sd, cfg):
    return ck.hybrid_state_dict_from_source(kl.FORMAT, sd, cfg)


def _to_kimi(sd, cfg):
    return ck.source_state_dict_from_hybrid(kl.FORMAT, sd, cfg)


# --- configuration ---------------------------------------------------------------------------


def test_config_maps_moonshot_keys():
    cfg = kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    assert cfg.layer_types == ["kda", "kda", "mla", "kda", "kda", "mla"]
    assert cfg.moe_layers == [1, 2, 3, 4, 5]
    assert (cfg.linear_num_heads, cfg.linear_key_head_dim, cfg.conv_size) == (2, 16, 4)
    assert cfg.shared_expert_intermediate_size == 32
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (2, 1, 2)
    assert cfg.router == "sigmoid_grouped" and cfg.routed_scaling_factor == 2.446
    assert not cfg.kda_gate_bias and cfg.mla_use_nope and not cfg.shared_expert_gate
    assert cfg.router_aux_loss_coef == 0.0


def test_config_transformers_keys_and_precedence():
    """transformers' names (``layer_types``, ``mlp_layer_types``, ``num_local_experts``, ...)
    work, and ``layer_types`` wins over ``linear_attn_config``'s lists (as in transformers)."""
    d = {
        k: v
        for k, v in KIMI_CONFIG.items()
        if k not in ("num_experts", "num_experts_per_token", "num_shared_experts")
    }
    d.update(
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=2,
        layer_types=["linear_attention"] * 5 + ["full_attention"],
        mlp_layer_types=["dense", "dense", "sparse", "dense", "sparse", "sparse"],
    )
    cfg = kl.hybrid_config_from_kimi_linear(d)
    assert cfg.layer_types == ["kda"] * 5 + ["mla"]
    assert cfg.moe_layers == [2, 4, 5]
    assert cfg.shared_expert_intermediate_size == 64
    freq = dict(KIMI_CONFIG, first_k_dense_replace=2, moe_layer_freq=2)
    assert kl.hybrid_config_from_kimi_linear(freq).moe_layers == [2, 4]
    flat = dict(KIMI_CONFIG, use_grouped_topk=False)
    assert (kl.hybrid_config_from_kimi_linear(flat).n_group, flat["num_expert_group"]) == (1, 2)


def test_config_round_trip():
    cfg = kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    back = kl.kimi_linear_config_from_hybrid(cfg, KIMI_CONFIG)
    assert back["linear_attn_config"]["kda_layers"] == [1, 2, 4, 5]
    assert back["linear_attn_config"]["full_attn_layers"] == [3, 6]
    assert back["bos_token_id"] == 1 and back["mla_use_nope"] is True
    assert kl.hybrid_config_from_kimi_linear(back) == cfg


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(mla_use_nope=False), "mla_use_nope"),
        (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(model_type="qwen3_next"), "model_type"),
        (
            dict(linear_attn_config=dict(KIMI_CONFIG["linear_attn_config"], kda_layers=[1, 2, 4])),
            r"layers \[5\]",
        ),
        (
            dict(linear_attn_config=dict(KIMI_CONFIG["linear_attn_config"], kda_layers=[1, 2, 3])),
            "both",
        ),
        (  # JSON true is no layer number (it was read as layer 1)
            dict(
                linear_attn_config=dict(
                    KIMI_CONFIG["linear_attn_config"], kda_layers=[True, 2, 4, 5]
                )
            ),
            "kda_layers has True",
        ),
        (dict(layer_types=["linear_attention"] * 5), "layer_types"),
        (dict(mlp_layer_types=["dense"] * 5 + ["moe"]), "mlp_layer_types"),
    ],
)
def test_config_errors_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        kl.hybrid_config_from_kimi_linear(dict(KIMI_CONFIG, **change))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(kda_gate_bias=True), "kda_gate_bias"),
        (dict(layer_types=["kda", "gdn", "mla", "kda", "kda", "mla"]), "layer_types"),
        (dict(shared_expert_gate=True), "shared_expert_gate"),
        (dict(router="softmax", n_group=1), "router"),
        (dict(mla_use_nope=False), "mla_use_nope"),
        (dict(router_aux_loss_coef=0.01), "router_aux_loss_coef"),
    ],
)
def test_export_refuses_other_architectures(change, match):
    cfg = kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    other = HybridConfig(**{**cfg.to_dict(), **change})
    with pytest.raises(ValueError, match=match):
        kl.kimi_linear_config_from_hybrid(other)
    with pytest.raises(ValueError, match=match):
        _to_kimi({}, other)


# --- state dicts -----------------------------------------------------------------------------


def _native(cfg: HybridConfig, seed: int = 0) -> HybridForCausalLM:
    torch.manual_seed(seed)
    model = HybridForCausalLM(cfg).double()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name or name.endswith("correction_bias"):
                t.add_(0.1 * torch.randn_like(t))
    return model


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_state_dict_round_trip_is_exact(q_lora_rank):
    cfg = kl.hybrid_config_from_kimi_linear(dict(KIMI_CONFIG, q_lora_rank=q_lora_rank))
    sd = _native(cfg).state_dict()
    kimi = _to_kimi(sd, cfg)
    assert "model.layers.0.mlp.gate_proj.weight" in kimi
    assert kimi["model.layers.0.self_attn.A_log"].shape == (1, 1, 2, 1)
    assert kimi["model.layers.0.self_attn.q_conv1d.weight"].shape == (32, 1, 4)
    assert kimi["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (64, 32)
    back = _to_hybrid(kimi, cfg)
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_state_dict_errors_name_the_tensor():
    cfg = kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    kimi = _to_kimi(_native(cfg).state_dict(), cfg)
    missing = dict(kimi)
    del missing["model.layers.3.self_attn.b_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.b_proj\.weight"):
        _to_hybrid(missing, cfg)
    extra = dict(kimi, **{"model.layers.2.self_attn.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"no place.*model\.layers\.2\.self_attn\.extra"):
        _to_hybrid(extra, cfg)
    wrong = dict(kimi)
    wrong["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(3, 16)
    with pytest.raises(ValueError, match=r"layers\.2\.mixer\.kv_b\.weight.*shape \(3, 16\)"):
        _to_hybrid(wrong, cfg)
    native = _native(cfg).state_dict()
    with pytest.raises(ValueError, match=r"unexpected tensors \['layers\.0\.extra'\]"):
        _to_kimi(dict(native, **{"layers.0.extra": torch.zeros(1)}), cfg)
    del native["layers.4.mixer.dt_bias"]
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.4\.mixer\.dt_bias"):
        _to_kimi(native, cfg)
    # the multi-token-prediction layers the config declares after num_hidden_layers are
    # dropped (logged); a layer beyond them is refused (Kimi-Linear declares none by default)
    mtp = dict(kimi, **{"model.layers.6.self_attn.q_proj.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"tensors of layers \[6\] beyond num_hidden_layers = 6"):
        _to_hybrid(mtp, cfg)
    back = ck.hybrid_state_dict_from_source(kl.FORMAT, mtp, cfg, mtp_layers=1)
    assert back.keys() == _native(cfg).state_dict().keys()
    # a misshapen routed expert, transformers' fused conv or fused experts: named, never a
    # torch error from the stacking or splitting
    bad = dict(kimi)
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    bad[name] = torch.zeros(bad[name].shape[0] + 1, bad[name].shape[1])
    with pytest.raises(ValueError, match=rf"'{re.escape(name)}' has shape \(33, 64\)"):
        _to_hybrid(bad, cfg)
    fused = dict(kimi)
    p = "model.layers.0.self_attn."
    qkv = [fused.pop(f"{p}{c}_conv1d.weight") for c in "qkv"]
    fused[p + "conv1d.weight"] = torch.cat(qkv, 0)[:-1]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.conv1d\.weight' has"):
        _to_hybrid(fused, cfg)
    experts = {
        k: v
        for k, v in kimi.items()
        if ".block_sparse_moe.experts." not in k or not k.startswith("model.layers.1.")
    }
    experts["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(8, 64)
    experts["model.layers.1.mlp.experts.down_proj"] = torch.zeros(4, 64, 32)
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj' has shape \(8, 64\)"):
        _to_hybrid(experts, cfg)


def test_kimi_tiny_preset_is_a_kimi_linear_architecture():
    cfg = preset("kimi_tiny")
    d = kl.kimi_linear_config_from_hybrid(cfg)
    assert kl.hybrid_config_from_kimi_linear(d) == HybridConfig(
        **{**cfg.to_dict(), "chunk_size": 64}
    )


# --- checkpoints -----------------------------------------------------------------------------


def _write_kimi_checkpoint(path: str, cfg_dict: dict, model: HybridForCausalLM) -> None:
    from safetensors.torch import save_file

    cfg = kl.hybrid_config_from_kimi_linear(cfg_dict)
    sd = _to_kimi(model.state_dict(), cfg)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg_dict, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 128}, f)


def test_convert_checkpoint_both_ways(tmp_path):
    cfg = kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    model = _native(cfg, seed=4)
    src = str(tmp_path / "kimi")
    _write_kimi_checkpoint(src, KIMI_CONFIG, model)
    harts = str(tmp_path / "harts")
    summary = ck.convert_checkpoint(src, harts, max_shard_bytes=200_000)
    assert summary["layers"] == 6 and len(summary["files"]) > 1  # sharded, with an index
    # every file written, and only those
    assert sorted(summary["files"]) == sorted(os.listdir(harts))
    assert summary["files"][0] == "config.json"
    assert os.path.isfile(os.path.join(harts, "model.safetensors.index.json"))
    assert os.path.isfile(os.path.join(harts, "tokenizer_config.json"))
    loaded = HartsHybridForCausalLM.from_pretrained(harts, dtype=torch.float64)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v), k
    back = str(tmp_path / "back")
    ck.convert_checkpoint(harts, back, to="kimi_linear")
    with open(os.path.join(back, "config.json")) as f:
        back_cfg = json.load(f)
    assert kl.hybrid_config_from_kimi_linear(back_cfg) == cfg
    assert back_cfg["eos_token_id"] == 2
    a = ck.CheckpointTensors(path=src)
    b = ck.CheckpointTensors(path=back)
    assert a.names == b.names
    for k in a.names:
        assert torch.equal(a.take(k), b.take(k)), k
    with pytest.raises(ValueError, match="already holds a model"):
        ck.convert_checkpoint(src, harts)
    with pytest.raises(ValueError, match="needs a 'harts_hybrid' model"):
        ck.convert_checkpoint(src, str(tmp_path / "x"), to="kimi_linear")


def test_cli_convert(tmp_path, capsys):
    from harts_verl.cli import main

    cfg = kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    src = str(tmp_path / "kimi")
    _write_kimi_checkpoint(src, KIMI_CONFIG, _native(cfg, seed=2))
    assert main(["convert", src, str(tmp_path / "harts")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["from"] == "kimi_linear" and out["to"] == "harts_hybrid" and out["layers"] == 6
    assert (
        main(["convert", str(tmp_path / "harts"), str(tmp_path / "back"), "--to", "kimi_linear"])
        == 0
    )


def test_convert_refuses_stale_weights_and_malformed_configs(tmp_path, capsys, monkeypatch):
    """A destination left with weight files (an interrupted conversion without config.json) is
    refused, not mixed with the new shards; malformed config values name the field; a shard
    size past int64 bytes writes one shard."""
    from harts_verl.cli import main

    monkeypatch.delenv("HARTS_VERL_DEBUG", raising=False)
    cfg = kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    src = str(tmp_path / "kimi")
    _write_kimi_checkpoint(src, KIMI_CONFIG, _native(cfg, seed=2))
    dst = str(tmp_path / "dst")
    ck.convert_checkpoint(src, dst, max_shard_bytes=200_000)
    os.remove(os.path.join(dst, "config.json"))
    before = sorted(os.listdir(dst))
    with pytest.raises(ValueError, match=r"dst: .* already holds weight files \(model-00001"):
        ck.convert_checkpoint(src, dst)
    assert sorted(os.listdir(dst)) == before
    with pytest.raises(ValueError, match="max_shard_bytes"):
        ck.convert_checkpoint(src, str(tmp_path / "d0"), max_shard_bytes=0)
    for key, value, msg in [
        ("linear_attn_config", [1], "linear_attn_config: expected an object, got list"),
        ("num_experts", "abc", "num_experts: expected an integer, got 'abc'"),
        ("num_hidden_layers", 6.5, "num_hidden_layers: expected an integer, got 6.5"),
        ("rms_norm_eps", True, "rms_norm_eps: expected a finite number, got True"),
        ("rms_norm_eps", 10**400, "rms_norm_eps: expected a finite number"),  # no OverflowError
    ]:
        with pytest.raises(ValueError, match=re.escape(f"kimi_linear config: {msg}")):
            kl.hybrid_config_from_kimi_linear({**KIMI_CONFIG, key: value})
    assert kl.hybrid_config_from_kimi_linear({**KIMI_CONFIG, "num_hidden_layers": 6.0}) == cfg
    assert main(["convert", src, str(tmp_path / "one"), "--max-shard-gib", "1e308"]) == 0
    written = ["config.json", "model.safetensors", "tokenizer_config.json"]
    assert json.loads(capsys.readouterr().out)["files"] == written
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**KIMI_CONFIG, "num_experts": "abc"}))
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"harts-verl convert: {bad}: kimi_linear config: num_experts: expected an "
        "integer, got 'abc'"
    ], err
    assert not (tmp_path / "out").exists()


def test_load_causal_lm_reads_kimi_linear_config_and_checkpoint(tmp_path):
    """``harts-verl bench/check --model`` accept a Kimi-Linear config (random weights) or
    checkpoint (its weights, converted in memory)."""
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(KIMI_CONFIG))
    model = load_causal_lm(str(cfg_file), dtype=torch.float64)
    assert isinstance(model, HartsHybridForCausalLM)
    assert model.config.to_hybrid_config() == kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    cfg = kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    native = _native(cfg, seed=6)
    src = str(tmp_path / "kimi")
    _write_kimi_checkpoint(src, KIMI_CONFIG, native)
    loaded = load_causal_lm(src, dtype=torch.float64)
    for k, v in native.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v), k


# --- transformers' KimiLinear as the oracle --------------------------------------------------


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """transformers' KimiLinear, random float64 weights: its checkpoint (Moonshot's format), its
    in-memory state dict, and its logits for :func:`_sequences`."""
    return build_oracle(tmp_path_factory.mktemp("kimi_oracle"), KIMI_CONFIG, _sequences())


@pytest.mark.parametrize("layout", ["checkpoint", "inmemory"])
def test_converted_model_matches_transformers_float64(oracle, layout):
    out, ref = oracle
    model = load_causal_lm(str(out / layout), dtype=torch.float64)
    assert max_logit_error(model, _sequences(), ref) <= 1e-10


def test_tree_mode_matches_transformers_float64(oracle, tmp_path):
    """Converted once to harts_hybrid, the model in tree mode (the sequences share a prompt and
    a turn, forks inside and past a chunk) gives transformers' per-trajectory log-probs."""
    out, ref = oracle
    assert_tree_mode_matches(out, _sequences(), ref, tmp_path)


def test_converted_back_loads_in_transformers(oracle, tmp_path):
    out, ref = oracle
    assert_round_trip_in_transformers(out, ref, tmp_path, "kimi_linear")


def test_oracle_sees_a_wrong_mapping(oracle):
    """The comparison has teeth: swapping two KDA projections in the conversion is caught."""
    out, ref = oracle
    model = load_causal_lm(str(out / "checkpoint"), dtype=torch.float64)
    sd = copy.deepcopy(model.model.state_dict())
    sd["layers.0.mixer.q_proj.weight"], sd["layers.0.mixer.k_proj.weight"] = (
        sd["layers.0.mixer.k_proj.weight"],
        sd["layers.0.mixer.q_proj.weight"],
    )
    model.model.load_state_dict(sd)
    assert max_logit_error(model, _sequences(), ref) > 1e-4


def test_verl_engine_trains_a_kimi_linear_checkpoint_in_place(oracle, tmp_path):
    """veRL trains the Kimi-Linear checkpoint in place (see ``assert_verl_engine_matches``).
    transformers saves the dense layer under block_sparse_moe (a global rename); Moonshot's
    checkpoints and vLLM name it mlp, as the export does."""
    out, ref = oracle

    def checkpoint_name(name, src):
        return name if src.has(name) else name.replace(".mlp.", ".block_sparse_moe.")

    assert_verl_engine_matches(out, _sequences(), [40, 40, 40, 20], ref, tmp_path, checkpoint_name)


def test_bench_and_check_read_kimi_linear(tmp_path):
    """``harts-verl bench / check --model`` take a Kimi-Linear config.json or directory: the
    config check gives the harts_hybrid conversion, the loader the converted model."""
    from harts_verl.workers import check

    cfg_file = tmp_path / "kimi.json"
    cfg_file.write_text(json.dumps(KIMI_CONFIG))
    hf_cfg = check.tree_model_config(str(cfg_file))
    assert hf_cfg.model_type == "harts_hybrid"
    assert hf_cfg.to_hybrid_config() == kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    model = check.load_tree_model(str(cfg_file), dtype=torch.float64)
    assert isinstance(model, HartsHybridForCausalLM)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(KIMI_CONFIG, hidden_act="gelu")))
    with pytest.raises(ValueError, match=r"model: cannot read the config.*hidden_act"):
        check.tree_model_config(str(bad))


def test_config_round_trip_keeps_the_sources_moe_spelling():
    """HF -> harts_hybrid -> HF keeps ``first_k_dense_replace`` / ``moe_layer_freq`` (readers of
    those fields, not of ``mlp_layer_types``, must see the same MoE layers: 1 / 2 came back as
    2 / 1, i.e. layers [2, 3, 4, 5] for [2, 4]) and ungrouped routing as spelled."""
    d = dict(KIMI_CONFIG, first_k_dense_replace=1, moe_layer_freq=2)
    back = kl.kimi_linear_config_from_hybrid(kl.hybrid_config_from_kimi_linear(d), d)
    assert (back["first_k_dense_replace"], back["moe_layer_freq"]) == (1, 2)
    assert back["mlp_layer_types"] == ["dense", "dense", "sparse", "dense", "sparse", "dense"]
    assert ck.moe_layers_of({**back, "mlp_layer_types": None}, 6, "x") == [2, 4]
    flat = dict(KIMI_CONFIG, use_grouped_topk=False)
    back = kl.kimi_linear_config_from_hybrid(kl.hybrid_config_from_kimi_linear(flat), flat)
    # transformers reads the group sizes only, Moonshot's code and vLLM the flag: both ungrouped
    assert (back["use_grouped_topk"], back["num_expert_group"], back["topk_group"]) == (
        False,
        1,
        1,
    )
    # a changed MoE layout is written anew
    cfg = kl.hybrid_config_from_kimi_linear(d)
    moved = HybridConfig(**{**cfg.to_dict(), "moe_layers": [3, 5]})
    back = kl.kimi_linear_config_from_hybrid(moved, d)
    assert ck.moe_layers_of(back, 6, "x") == [3, 5] and back["first_k_dense_replace"] == 3


@pytest.mark.parametrize(
    ("moe", "n", "spelled"),
    [([2, 4], 6, (2, 2)), ([0, 2, 4], 6, (0, 2)), ([9], 11, (9, 3)), ([1, 2, 3], 4, (1, 1))],
)
def test_export_spells_moe_layers_for_readers_of_first_k_dense_replace(moe, n, spelled, caplog):
    """Without a source config (a native model) the exported first_k_dense_replace /
    moe_layer_freq name exactly the MoE layers ([2, 4] was written 2 / 1: [2, 3, 4, 5]); a
    layout no such pair names is written in mlp_layer_types with a WARNING."""
    base = kl.hybrid_config_from_kimi_linear(KIMI_CONFIG).to_dict()
    mixers = ["kda"] * (n - 1) + ["mla"]
    cfg = HybridConfig(**{**base, "layer_types": mixers, "moe_layers": moe})
    back = kl.kimi_linear_config_from_hybrid(cfg)
    assert (back["first_k_dense_replace"], back["moe_layer_freq"]) == spelled
    assert ck.moe_layers_of({**back, "mlp_layer_types": None}, n, "x") == moe
    if n >= 6:
        odd = HybridConfig(**{**base, "layer_types": mixers, "moe_layers": [3, 5]})
        with caplog.at_level("WARNING"):
            back = kl.kimi_linear_config_from_hybrid(odd)
        assert ck.moe_layers_of(back, n, "x") == [3, 5]
        assert "no first_k_dense_replace / moe_layer_freq pattern" in caplog.text


@pytest.mark.parametrize(
    "key", ["rms_norm_eps", "routed_scaling_factor", "num_shared_experts", "first_k_dense_replace"]
)
def test_keys_whose_defaults_disagree_must_be_set(key):
    """transformers (2.446, 1 shared expert, first MoE layer 1, eps 1e-5) and Moonshot's
    configuration_kimi.py, which vLLM copies (1.0, 0, 0, 1e-6), default these differently: a
    config without one is refused by name (the old 1.0 default was 2.49 away from transformers
    in the logits, a transformers default would be as far from the rollout server)."""
    d = {k: v for k, v in KIMI_CONFIG.items() if k != key}
    with pytest.raises(ValueError, match=rf"{key} is missing, and its default differs"):
        kl.hybrid_config_from_kimi_linear(d)
    if key == "num_shared_experts":  # transformers' name counts
        assert kl.hybrid_config_from_kimi_linear(dict(d, n_shared_experts=1)) == (
            kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
        )
    if key == "first_k_dense_replace":  # not needed where mlp_layer_types names the layers
        mlp = ["dense"] + ["sparse"] * 5
        cfg = kl.hybrid_config_from_kimi_linear(dict(d, mlp_layer_types=mlp))
        assert cfg.moe_layers == [1, 2, 3, 4, 5]
    if key != "rms_norm_eps":  # MoE keys are not needed without experts
        kl.hybrid_config_from_kimi_linear(dict(d, num_experts=None))


def test_omitted_group_keys_and_routed_expert_names():
    d = {k: v for k, v in KIMI_CONFIG.items() if k not in ("num_expert_group", "topk_group")}
    cfg = kl.hybrid_config_from_kimi_linear(d)
    assert (cfg.n_group, cfg.topk_group) == (1, 1)  # both readers' default
    routed = dict(KIMI_CONFIG, n_routed_experts=4)
    del routed["num_experts"]
    assert kl.hybrid_config_from_kimi_linear(routed).num_experts == 4


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(quantization_config={"quant_method": "fp8"}), r"quantization_config \('fp8'\)"),
        (dict(first_k_dense_replace=1.5), "first_k_dense_replace: expected an integer"),
        (dict(first_k_dense_replace="1"), "first_k_dense_replace: expected an integer"),
        (dict(moe_layer_freq=1.9), "moe_layer_freq: expected an integer"),
        (dict(moe_layer_freq=True), "moe_layer_freq: expected an integer"),
        (
            dict(
                layer_types=None,
                linear_attn_config=dict(KIMI_CONFIG["linear_attn_config"], kda_layers=5),
            ),
            "linear_attn_config.kda_layers: expected a list",
        ),
        # flags are JSON booleans: the string "false" is not read as true
        (dict(tie_word_embeddings="false"), "tie_word_embeddings: expected true or false"),
        (dict(moe_renormalize="false"), "moe_renormalize: expected true or false"),
        (dict(use_grouped_topk=0), "use_grouped_topk: expected true or false"),
        (dict(attention_bias="no"), "attention_bias: expected true or false"),
        (dict(layer_types=5), "layer_types: expected a list, got int"),
        (dict(layer_types="linear_attention"), "layer_types: expected a list, got str"),
        (dict(mlp_layer_types="dense"), "mlp_layer_types: expected a list"),
    ],
)
def test_config_values_are_checked_and_named(change, match):
    with pytest.raises(ValueError, match=match):
        kl.hybrid_config_from_kimi_linear(dict(KIMI_CONFIG, **change))


def test_kimi_linear_checkpoint_loads_as_a_token_classifier(tmp_path):
    """A Kimi-Linear directory loads through ``AutoModelForTokenClassification`` (what veRL
    loads for a critic) with the config of ``convert --config-only``: the backbone takes the
    checkpoint's weights, there is no LM head, ``score`` (one label) keeps its init."""
    from transformers import AutoModelForTokenClassification

    from harts_verl.models.hf import HartsHybridForTokenClassification

    cfg = kl.hybrid_config_from_kimi_linear(KIMI_CONFIG)
    native = _native(cfg, seed=7)
    src = str(tmp_path / "kimi")
    _write_kimi_checkpoint(src, KIMI_CONFIG, native)
    hf_cfg = ck.harts_config_from_source(KIMI_CONFIG)
    hf_cfg.num_labels = 1
    critic = AutoModelForTokenClassification.from_pretrained(
        src, config=hf_cfg, dtype=torch.float64
    )
    assert isinstance(critic, HartsHybridForTokenClassification)
    assert not hasattr(critic.model, "lm_head") and critic.score.out_features == 1
    own = critic.model.state_dict()
    for k, v in native.state_dict().items():
        if not k.startswith("lm_head."):
            assert torch.equal(own[k], v), k
    assert set(own) == {k for k in native.state_dict() if not k.startswith("lm_head.")}
    # without a config, keyword arguments set the converted config's attributes (as
    # transformers does): one label, the chunk size; an architecture change is refused
    bare = HartsHybridForTokenClassification.from_pretrained(src, num_labels=1, chunk_size=8)
    assert bare.score.out_features == 1 and bare.config.chunk_size == 8
    with pytest.raises(ValueError, match="does not describe the Kimi-Linear checkpoint"):
        HartsHybridForTokenClassification.from_pretrained(src, hidden_size=48)
