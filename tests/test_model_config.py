"""HybridConfig validation (bad values raise ValueError naming the field at construction, not a
torch error in the forward), and the transformers wrapper: keyword overrides in
``HartsHybridConfig.from_hybrid_config`` and a tied-embedding save / reload round trip."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch

from harts_verl.models import PRESETS, HybridConfig, HybridForCausalLM, preset
from harts_verl.ops.layout import TreeLayout
from harts_verl.tree import RolloutForest

SEQS = [[1, 2, 3, 4, 5], [1, 2, 3, 6]]

# (overrides of the "tiny" preset, the field the error must name)
BAD = {
    "vocab_zero": (dict(vocab_size=0), "vocab_size"),
    "vocab_negative": (dict(vocab_size=-5), "vocab_size"),
    "vocab_float": (dict(vocab_size=64.0), "vocab_size"),
    "vocab_str": (dict(vocab_size="64"), "vocab_size"),
    "hidden_zero": (dict(hidden_size=0), "hidden_size"),
    "hidden_bool": (dict(hidden_size=True), "hidden_size"),
    "no_layers": (dict(layer_types=[], moe_layers=[]), "layer_types"),
    "layer_types_str": (dict(layer_types="kda"), "layer_types"),
    "layer_types_none": (dict(layer_types=None), "layer_types"),
    "unknown_mixer": (dict(layer_types=["kda", "bogus"], moe_layers=[]), "layer_types[1]"),
    "mixer_not_str": (dict(layer_types=["kda", 3], moe_layers=[]), "layer_types[1]"),
    "moe_layers_str": (dict(moe_layers="1"), "moe_layers"),
    "moe_layer_bool": (dict(moe_layers=[True]), "moe_layers[0]"),
    "moe_layer_out_of_range": (dict(moe_layers=[4]), "moe_layers"),
    "moe_layer_negative": (dict(moe_layers=[-1]), "moe_layers"),
    "moe_layer_twice": (dict(moe_layers=[1, 1]), "moe_layers[1]"),
    "intermediate_zero": (dict(intermediate_size=0), "intermediate_size"),
    "kv_heads_zero": (dict(num_key_value_heads=0), "num_key_value_heads"),
    "heads_not_multiple_of_kv": (
        dict(num_attention_heads=3, num_key_value_heads=2),
        "num_attention_heads",
    ),
    "attention_heads_zero": (
        dict(num_attention_heads=0, num_key_value_heads=1),
        "num_attention_heads",
    ),
    "head_dim_zero": (dict(head_dim=0), "head_dim"),
    "partial_rotary_above_one": (dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
    "linear_heads_zero": (dict(linear_num_heads=0), "linear_num_heads"),
    "linear_value_heads_not_multiple": (
        dict(linear_num_heads=2, linear_num_value_heads=3),
        "linear_num_value_heads",
    ),
    "linear_key_dim_zero": (dict(linear_key_head_dim=0), "linear_key_head_dim"),
    "conv_zero": (dict(conv_size=0), "conv_size"),
    "kda_lower_bound_positive": (dict(kda_lower_bound=1.0), "kda_lower_bound"),
    "kda_lower_bound_str": (dict(kda_lower_bound="-5"), "kda_lower_bound"),
    "chunk_zero": (dict(chunk_size=0), "chunk_size"),
    "chunk_float": (dict(chunk_size=2.5), "chunk_size"),
    "experts_negative": (dict(num_experts=-1), "num_experts"),
    "experts_per_tok_zero": (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    "experts_per_tok_above_experts": (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    "moe_intermediate_zero": (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    "shared_expert_negative": (
        dict(shared_expert_intermediate_size=-1),
        "shared_expert_intermediate_size",
    ),
    "n_group_zero": (dict(n_group=0), "n_group"),
    "n_group_not_divisor": (dict(n_group=3), "n_group"),
    "topk_group_above_n_group": (
        dict(router="sigmoid_grouped", n_group=2, topk_group=3),
        "topk_group",
    ),
    "top_k_above_kept_groups": (
        dict(router="sigmoid_grouped", n_group=4, topk_group=1, num_experts_per_tok=3),
        "num_experts_per_tok",
    ),
    "routed_scaling_zero": (
        dict(router="sigmoid_grouped", routed_scaling_factor=0.0),
        "routed_scaling_factor",
    ),
    "unknown_router": (dict(router="top1"), "router"),
    "rope_odd": (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    "rope_negative": (dict(qk_rope_head_dim=-2), "qk_rope_head_dim"),
    "qk_dim_zero": (dict(qk_rope_head_dim=0, qk_nope_head_dim=0), "qk_nope_head_dim"),
    "kv_lora_zero": (dict(kv_lora_rank=0), "kv_lora_rank"),
    "q_lora_negative": (dict(q_lora_rank=-1), "q_lora_rank"),
    "q_lora_float": (dict(q_lora_rank=8.0), "q_lora_rank"),
    "v_head_dim_zero": (dict(v_head_dim=0), "v_head_dim"),
    "rope_theta_zero": (dict(rope_theta=0.0), "rope_theta"),
    "eps_negative": (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
    "eps_zero": (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    "eps_nan": (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
    "rope_theta_past_float": (dict(rope_theta=10**400), "rope_theta"),
    "eps_str": (dict(rms_norm_eps="1e-6"), "rms_norm_eps"),
    "init_range_negative": (dict(initializer_range=-0.1), "initializer_range"),
    "aux_coef_negative": (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
    "tie_not_bool": (dict(tie_word_embeddings=1), "tie_word_embeddings"),
    "gate_not_bool": (dict(attn_output_gate="yes"), "attn_output_gate"),
    "kda_gate_bias_not_bool": (dict(kda_gate_bias=0), "kda_gate_bias"),
    "mla_use_nope_not_bool": (dict(mla_use_nope="true"), "mla_use_nope"),
    "shared_gate_not_bool": (dict(shared_expert_gate=None), "shared_expert_gate"),
    # sizes torch cannot allocate: named here, not a C++ trace or a storage-size overflow
    "vocab_past_int64": (dict(vocab_size=2**64), "vocab_size"),
    "hidden_past_a_dimension": (dict(hidden_size=2**31), "hidden_size"),
    "q_lora_past_a_dimension": (dict(q_lora_rank=2**40), "q_lora_rank"),
    "expert_weights_past_int64": (
        dict(num_experts=2**21, hidden_size=2**21, moe_intermediate_size=2**22),
        "num_experts × hidden_size × moe_intermediate_size",
    ),
    "kda_gate_weight_past_int64": (
        dict(linear_num_heads=2**20, linear_num_value_heads=2**20, linear_key_head_dim=2**22),
        "linear_key_head_dim × linear_num_value_heads × linear_key_head_dim",
    ),
    "attention_weights_past_int64": (
        dict(hidden_size=2**22, num_attention_heads=2**21, num_key_value_heads=1, head_dim=2**21),
        "hidden_size × attention heads × head_dim",
    ),
    "mla_kv_weight_past_int64": (
        dict(kv_lora_rank=2**21, num_attention_heads=2**21, qk_nope_head_dim=2**22),
        "kv_lora_rank × num_attention_heads × (qk_nope_head_dim + v_head_dim)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_value_rejected_at_construction(case):
    """Each bad value: a ValueError whose message starts with the field's name, raised by
    ``preset``, the constructor and ``from_dict`` alike."""
    overrides, name = BAD[case]
    starts = "^" + re.escape(name) + ":"
    with pytest.raises(ValueError, match=starts):
        preset("tiny", **overrides)
    with pytest.raises(ValueError, match=starts):
        HybridConfig(**overrides)
    with pytest.raises(ValueError, match=starts):
        HybridConfig.from_dict({"model_type": "harts_hybrid", **overrides})


def _forward(cfg: HybridConfig) -> torch.Tensor:
    torch.manual_seed(0)
    model = HybridForCausalLM(cfg)
    layout = TreeLayout(RolloutForest.from_sequences(SEQS), chunk_size=cfg.chunk_size)
    hidden, _ = model(layout.token_ids, layout)
    assert hidden.shape == (layout.num_rows, cfg.hidden_size)
    return hidden


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_construct_and_run(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    assert preset(name) == HybridConfig(**PRESETS[name])
    assert torch.isfinite(_forward(preset(name, vocab_size=32, chunk_size=4))).all()


GOOD = {
    # fields a layer kind does not use are not checked without that kind
    "no_moe_layers_any_moe_fields": dict(moe_layers=[], num_experts_per_tok=0, n_group=0),
    "no_experts": dict(num_experts=0, num_experts_per_tok=0),
    "all_moe_no_dense_size": dict(moe_layers=[0, 1, 2, 3], intermediate_size=0),
    "no_mla_odd_rope": dict(layer_types=["kda", "gqa"], moe_layers=[1], qk_rope_head_dim=7),
    "no_gqa_kv_heads_zero": dict(layer_types=["mla", "gdn"], moe_layers=[], num_key_value_heads=0),
    "no_linear_heads_zero": dict(layer_types=["mla"], moe_layers=[0], linear_num_heads=0),
    "softmax_router_ignores_topk_group": dict(topk_group=5),
    # values valid today
    "nope_mla": dict(qk_rope_head_dim=0),
    "q_lora": dict(q_lora_rank=16),
    "q_lora_zero_is_none": dict(q_lora_rank=0),
    "no_shared_expert": dict(shared_expert_intermediate_size=0),
    "kda_lower_bound": dict(kda_lower_bound=-5.0),
    "odd_partial_rotary": dict(head_dim=10, partial_rotary_factor=0.3),
    "no_rotary": dict(partial_rotary_factor=0.0),
    "grouped_router": dict(
        router="sigmoid_grouped", n_group=4, topk_group=2, num_experts_per_tok=4
    ),
    "tuple_layers": dict(layer_types=("kda", "mla"), moe_layers=(1,)),
    "numpy_ints": dict(vocab_size=np.int64(32), chunk_size=np.int32(4), moe_layers=[np.int64(1)]),
    "int_reals": dict(rope_theta=10000, rms_norm_eps=1),
}


@pytest.mark.parametrize("case", sorted(GOOD))
def test_valid_configs_accepted(case, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    cfg = preset("tiny", **{"vocab_size": 32, "chunk_size": 4, **GOOD[case]})
    # normalized types: plain ints / floats / lists, so JSON and layouts take them
    assert type(cfg.vocab_size) is int and type(cfg.chunk_size) is int
    assert type(cfg.rope_theta) is float and type(cfg.rms_norm_eps) is float
    assert isinstance(cfg.layer_types, list) and isinstance(cfg.moe_layers, list)
    assert all(type(i) is int for i in cfg.moe_layers)
    assert HybridConfig.from_dict(cfg.to_dict()) == cfg
    assert torch.isfinite(_forward(cfg)).all()


def test_preset_and_from_dict_unknown_keys():
    with pytest.raises(ValueError, match="preset: unknown 'TINY'"):
        preset("TINY")
    with pytest.raises(ValueError, match=r"preset: unknown HybridConfig fields \['bogus'\]"):
        preset("tiny", bogus=1)
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        HybridConfig.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="model_type: expected 'harts_hybrid'"):
        HybridConfig.from_dict({"model_type": "llama", "vocab_size": 10})
    with pytest.raises(ValueError, match="vocab_size"):
        HybridConfig.from_dict({"model_type": "harts_hybrid", "vocab_size": 0})


# ------------------------------------------------------------------ transformers wrapper
@pytest.fixture
def hf():
    return pytest.importorskip("harts_verl.models.hf")


def test_from_hybrid_config_overrides(hf):
    base = preset("tiny")
    cfg = hf.HartsHybridConfig.from_hybrid_config(base, vocab_size=77, chunk_size=8)
    assert cfg.vocab_size == 77 and cfg.chunk_size == 8
    hyb = cfg.to_hybrid_config()
    assert hyb == preset("tiny", vocab_size=77, chunk_size=8)
    assert base.vocab_size == 1024  # the source is not modified
    # the mixers, as HybridConfig names (layer_types) or as mixer_types
    cfg = hf.HartsHybridConfig.from_hybrid_config(base, layer_types=["gdn", "mla"], moe_layers=[1])
    assert cfg.mixer_types == ["gdn", "mla"] and cfg.num_hidden_layers == 2
    assert cfg.layer_types == ["linear_attention", "full_attention"]
    cfg = hf.HartsHybridConfig.from_hybrid_config(base, mixer_types=["kda"], moe_layers=[])
    assert cfg.mixer_types == ["kda"] and cfg.layer_types == ["linear_attention"]
    # PreTrainedConfig keys pass through
    cfg = hf.HartsHybridConfig.from_hybrid_config(base, bos_token_id=5)
    assert cfg.bos_token_id == 5
    # overrides are validated
    with pytest.raises(ValueError, match=r"^vocab_size: expected a positive int"):
        hf.HartsHybridConfig.from_hybrid_config(base, vocab_size=0)
    with pytest.raises(ValueError, match=r"^mixer_types\[0\]: unknown mixer 'bogus'"):
        hf.HartsHybridConfig.from_hybrid_config(base, mixer_types=["bogus"], moe_layers=[])
    with pytest.raises(TypeError, match="config: expected a HybridConfig"):
        hf.HartsHybridConfig.from_hybrid_config(base.to_dict())


def test_hf_config_consistency(hf):
    cfg = hf.HartsHybridConfig.from_hybrid_config(preset("tiny"))
    d = cfg.to_dict()
    assert hf.HartsHybridConfig(**d).to_hybrid_config() == preset("tiny")
    with pytest.raises(ValueError, match=r"^num_hidden_layers: 7 does not match"):
        hf.HartsHybridConfig(**{**d, "num_hidden_layers": 7})
    with pytest.raises(ValueError, match=r"^layer_types: .* does not match mixer_types"):
        hf.HartsHybridConfig(**{**d, "layer_types": ["full_attention"] * 4})
    with pytest.raises(ValueError, match=r"^chunk_size"):
        hf.HartsHybridConfig(**{**d, "chunk_size": 0})


@pytest.mark.parametrize("tie", [True, False])
def test_save_reload_tied_and_untied(hf, tie, tmp_path, monkeypatch):
    """save_pretrained / from_pretrained: tied embeddings are saved once and re-tied; untied
    ones are both saved; the state dict and the logits are identical after reloading."""
    import transformers
    from safetensors import safe_open

    monkeypatch.setitem(sys.modules, "fla", None)
    cfg = hf.HartsHybridConfig.from_hybrid_config(
        preset("tiny", vocab_size=50, chunk_size=8, tie_word_embeddings=tie)
    )
    torch.manual_seed(0)
    model = hf.HartsHybridForCausalLM(cfg).eval()
    native = model.model
    assert (native.lm_head.weight is native.embed_tokens.weight) == tie
    model.save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert "model.embed_tokens.weight" in saved
    assert ("model.lm_head.weight" in saved) == (not tie)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert isinstance(loaded, hf.HartsHybridForCausalLM)
    assert loaded.config.tie_word_embeddings == tie
    assert (loaded.model.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    ref, got = model.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    if tie:  # still one parameter after reloading: a step on it moves both
        with torch.no_grad():
            loaded.model.embed_tokens.weight.add_(1.0)
        assert torch.equal(loaded.model.lm_head.weight, loaded.model.embed_tokens.weight)
