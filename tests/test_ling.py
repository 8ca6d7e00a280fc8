"""Ling 3 checkpoints (``bailing_hybrid``) as the native hybrid model (``harts_verl.models.ling``).

The oracle is transformers' own ``BailingHybridForCausalLM`` (transformers >= 5.23, in a
subprocess: ``_source_oracle.py``), in float64 with its float32 islands lifted: the converted
native model gives the same logits (<= 1e-10) trajectory-wise and in tree mode, from Ling's
checkpoint names and from transformers' in-memory ones; the checkpoint converted back loads in
transformers with bitwise the same logits; the veRL engine trains a Ling checkpoint in place and
exports Ling's names. Ling 3's KDA has full-rank gates and the safe decay, its MLA interleaved
RoPE (reordered into our layout while converting) and a sigmoid gate per head.
"""

from __future__ import annotations

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
from harts_verl.models import ling
from harts_verl.models.config import HybridConfig, preset
from harts_verl.models.hf import load_causal_lm
from harts_verl.models.hybrid import HybridForCausalLM

# 6 layers (KDA, KDA, MLA, KDA, KDA, MLA: layer groups of 3), first layer dense, MoE with 2
# expert groups (1 kept) and a shared expert, MLA with RoPE (base 1e4, so the rotation matters
# over these lengths) and a head gate.
LING_CONFIG = {
    "model_type": "bailing_hybrid",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 6,
    "layer_group_size": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "short_conv_kernel_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rope_theta": 10000.0,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.5,
    "num_expert_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "pad_token_id": 0,
    "eos_token_id": 2,
}


def _sequences() -> list[list[int]]:
    return shared_prefix_sequences(12, 96)


def test_config_maps_ling_keys():
    cfg = ling.hybrid_config_from_ling(LING_CONFIG)
    assert cfg.layer_types == ["kda", "kda", "mla", "kda", "kda", "mla"]
    assert cfg.moe_layers == [1, 2, 3, 4, 5]
    assert (cfg.linear_num_heads, cfg.linear_key_head_dim, cfg.conv_size) == (2, 16, 4)
    assert cfg.kda_lower_bound == -5.0 and not cfg.kda_low_rank_gates and not cfg.kda_gate_bias
    assert cfg.mla_output_gate and not cfg.mla_use_nope and cfg.mla_norm_eps == 1e-6
    assert cfg.rope_theta == 10000.0 and cfg.qk_rope_head_dim == 8
    assert (cfg.n_group, cfg.topk_group, cfg.shared_expert_intermediate_size) == (2, 1, 32)
    unsafe = ling.hybrid_config_from_ling(dict(LING_CONFIG, kda_safe_gate=False))
    assert unsafe.kda_lower_bound is None
    # transformers' defaults: 6-layer groups, the first 2 layers dense
    bare = {k: v for k, v in LING_CONFIG.items() if k not in ("layer_group_size",)}
    bare.pop("first_k_dense_replace")
    cfg = ling.hybrid_config_from_ling(dict(bare, num_hidden_layers=12))
    assert cfg.layer_types == (["kda"] * 5 + ["mla"]) * 2 and cfg.moe_layers == list(range(2, 12))


def test_config_round_trip_and_errors():
    cfg = ling.hybrid_config_from_ling(LING_CONFIG)
    back = ling.ling_config_from_hybrid(cfg, LING_CONFIG)
    assert back["eos_token_id"] == 2 and back["layer_types"][2] == "full_attention"
    assert ling.hybrid_config_from_ling(back) == cfg
    with pytest.raises(ValueError, match="rope_parameters: rope type 'yarn'"):
        ling.hybrid_config_from_ling(dict(LING_CONFIG, rope_parameters={"rope_type": "yarn"}))
    # transformers lets a non-empty rope_scaling beside rope_parameters take precedence (its
    # own rope_theta, else the top-level one): a context-extension edit is refused, not dropped
    saved = dict(LING_CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    with pytest.raises(ValueError, match="rope_scaling: rope type 'yarn'"):
        ling.hybrid_config_from_ling(dict(saved, rope_scaling=yarn))
    plain = dict(saved, rope_scaling={"type": "default"}, rope_theta=7e5)
    assert ling.hybrid_config_from_ling(plain).rope_theta == 7e5
    assert ling.hybrid_config_from_ling(dict(saved, rope_scaling={})).rope_theta == 1e4
    with pytest.raises(ValueError, match="hidden_act"):
        ling.hybrid_config_from_ling(dict(LING_CONFIG, hidden_act="gelu"))
    with pytest.raises(ValueError, match="kda_safe_gate: expected true or false, got 'false'"):
        ling.hybrid_config_from_ling(dict(LING_CONFIG, kda_safe_gate="false"))
    with pytest.raises(ValueError, match="kda_low_rank_gates: Ling 3 needs False"):
        ling.ling_config_from_hybrid(preset("kimi_tiny"))
    assert ling.hybrid_config_from_ling(
        ling.ling_config_from_hybrid(preset("ling_tiny"))
    ) == HybridConfig(**{**preset("ling_tiny").to_dict(), "chunk_size": 64})


def _native(cfg: HybridConfig, seed: int = 0) -> HybridForCausalLM:
    torch.manual_seed(seed)
    return HybridForCausalLM(cfg).double()


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_state_dict_round_trip_is_exact(q_lora_rank):
    """Ling's names, A_log [H], per-expert gate/up/down, the interleaved rope rows."""
    cfg = ling.hybrid_config_from_ling(dict(LING_CONFIG, q_lora_rank=q_lora_rank))
    sd = _native(cfg).state_dict()
    out = ck.source_state_dict_from_hybrid(ling.FORMAT, sd, cfg)
    assert "model.word_embeddings.weight" in out
    assert out["model.layers.0.attention.A_log"].shape == (2,)
    assert out["model.layers.0.attention.o_proj.weight"].shape == (64, 32)  # KDA: o_proj
    assert out["model.layers.2.attention.dense.weight"].shape == (64, 32)  # MLA: dense
    assert "model.layers.0.attention.dense.weight" not in out
    assert out["model.layers.2.attention.g_proj.weight"].shape == (2, 64)
    assert "model.layers.1.mlp.gate.expert_bias" in out
    assert out["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (64, 32)
    q = "q_b_proj" if q_lora_rank else "q_proj"
    theirs = out[f"model.layers.2.attention.{q}.weight"].reshape(2, 24, -1)
    ours = sd[f"layers.2.mixer.{'q_b' if q_lora_rank else 'q_proj'}.weight"].reshape(2, 24, -1)
    assert torch.equal(theirs[:, 16::2], ours[:, 16:20])  # even rope channels first in ours
    back = ck.hybrid_state_dict_from_source(ling.FORMAT, out, cfg)
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


# --- transformers' BailingHybrid as the oracle -----------------------------------------------


@pytest.fixture(scope="module", params=[None, 12], ids=["q_proj", "q_lora"])
def oracle(request, tmp_path_factory):
    config = dict(LING_CONFIG, q_lora_rank=request.param)
    out = tmp_path_factory.mktemp(f"ling_oracle_{request.param}")
    return build_oracle(out, config, _sequences(), seed=4)


@pytest.mark.parametrize("layout", ["checkpoint", "inmemory"])
def test_converted_model_matches_transformers_float64(oracle, layout):
    out, ref = oracle
    model = load_causal_lm(str(out / layout), dtype=torch.float64)
    assert max_logit_error(model, _sequences(), ref) <= 1e-10


def test_tree_mode_matches_transformers_float64(oracle, tmp_path):
    out, ref = oracle
    assert_tree_mode_matches(out, _sequences(), ref, tmp_path)


def test_converted_back_loads_in_transformers(oracle, tmp_path):
    out, ref = oracle
    assert_round_trip_in_transformers(out, ref, tmp_path, "bailing_hybrid")


def test_oracle_sees_unpermuted_rope(oracle):
    """The comparison has teeth: loading the MLA rope rows without reordering them is caught."""
    out, ref = oracle
    model = load_causal_lm(str(out / "checkpoint"), dtype=torch.float64)
    src = ck.CheckpointTensors(path=str(out / "checkpoint"))
    sd = dict(model.model.state_dict())
    sd["layers.2.mixer.kv_a.weight"] = src.take(
        "model.layers.2.attention.kv_a_proj_with_mqa.weight"
    )
    model.model.load_state_dict(sd)
    assert max_logit_error(model, _sequences(), ref) > 1e-6


def test_verl_engine_trains_a_ling_checkpoint_in_place(oracle, tmp_path):
    """veRL trains the Ling 3 checkpoint in place and exports Ling's names (see
    ``assert_verl_engine_matches``)."""
    out, ref = oracle

    def checkpoint_name(name, src):
        # transformers saves every layer's output projection as attention.dense (a global
        # rename); Ling's checkpoints, its modeling code and vLLM name the KDA one o_proj
        return name if src.has(name) else name.replace(".attention.o_proj.", ".attention.dense.")

    assert_verl_engine_matches(out, _sequences(), [40, 40, 40, 20], ref, tmp_path, checkpoint_name)


def test_layer_count_off_the_group_size_needs_layer_types():
    """Without ``layer_types``, a layer count that is not a multiple of ``layer_group_size``
    is refused (Ling's own code and vLLM make the tail full attention, transformers linear);
    with ``layer_types`` it is read as given."""
    bare = {k: v for k, v in LING_CONFIG.items() if k != "layer_types"}
    with pytest.raises(ValueError, match=r"num_hidden_layers \(7\) is not a multiple of "):
        ling.hybrid_config_from_ling(dict(bare, num_hidden_layers=7))
    lin, full = "linear_attention", "full_attention"
    given = dict(bare, num_hidden_layers=7, layer_types=[lin, lin, full, lin, lin, full, full])
    mixers = ["kda", "kda", "mla", "kda", "kda", "mla", "mla"]
    assert ling.hybrid_config_from_ling(given).layer_types == mixers


def test_config_round_trip_keeps_unused_fields_and_drops_mtp():
    """Without the safe gate the source's kda_lower_bound comes back (was -5.0 for -3.0); the
    MTP layers the import drops are not advertised by the exported config (was still 1)."""
    d = dict(LING_CONFIG, kda_safe_gate=False, kda_lower_bound=-3.0, num_nextn_predict_layers=1)
    back = ling.ling_config_from_hybrid(ling.hybrid_config_from_ling(d), d)
    assert back["kda_safe_gate"] is False and back["kda_lower_bound"] == -3.0
    assert back["num_nextn_predict_layers"] == 0
    # a source that left the key out (transformers' default: one MTP layer), and a native
    # model exported without a source config: the written config says none
    implicit = {k: v for k, v in LING_CONFIG.items() if k != "num_nextn_predict_layers"}
    for base in (implicit, None):
        out = ling.ling_config_from_hybrid(ling.hybrid_config_from_ling(LING_CONFIG), base)
        assert out["num_nextn_predict_layers"] == 0 and "num_mtp_layers" not in out
    assert "quantization_config" not in ling.ling_config_from_hybrid(
        ling.hybrid_config_from_ling(LING_CONFIG), dict(LING_CONFIG, quantization_config={})
    )


def test_omitted_moe_keys_take_transformers_defaults():
    """As transformers' BailingHybridConfig: routed_scaling_factor 2.5, one shared expert, 8
    groups with 4 kept (the converter's own 1.0 / 0 / 1 / 1 changed the logits silently)."""
    omit = ("routed_scaling_factor", "num_shared_experts", "num_expert_group", "topk_group")
    d = {k: v for k, v in LING_CONFIG.items() if k not in omit}
    d["num_experts"] = 8
    cfg = ling.hybrid_config_from_ling(d)
    assert cfg.routed_scaling_factor == 2.5
    assert cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size
    assert (cfg.n_group, cfg.topk_group) == (8, 4)
