"""Every architecture Kimi-Linear or Ling 3 can express survives the round trips exactly
(hypothesis over layer patterns, q bottleneck, tied embeddings, dense-only or MoE with any
sparse-layer pattern, groups, safe decay): native config -> source config -> native config, and
native weights -> source checkpoint names -> native weights (bitwise), with every source tensor
used and the per-tensor export (veRL's weight sync) equal to the whole-state-dict one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_verl.models import checkpoints as ck
from harts_verl.models import kimi_linear, ling
from harts_verl.models.config import HybridConfig
from harts_verl.models.hybrid import HybridForCausalLM

FORMATS = {"kimi_linear": kimi_linear.FORMAT, "bailing_hybrid": ling.FORMAT}


@st.composite
def architectures(draw, model_type: str) -> HybridConfig:
    n = draw(st.integers(1, 5))
    layer_types = draw(st.lists(st.sampled_from(["kda", "mla"]), min_size=n, max_size=n))
    experts = draw(st.sampled_from([0, 4]))
    moe_layers = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1))) if experts else []
    n_group = draw(st.sampled_from([1, 2])) if experts else 1
    kw = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        layer_types=layer_types,
        moe_layers=moe_layers,
        tie_word_embeddings=draw(st.booleans()),
        linear_num_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        conv_size=draw(st.sampled_from([2, 4])),
        kda_gate_bias=False,
        num_attention_heads=2,
        q_lora_rank=draw(st.sampled_from([None, 6])),
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=draw(st.sampled_from([2, 4])),
        v_head_dim=8,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=draw(st.sampled_from([0, 8, 16])),
        router="sigmoid_grouped",
        n_group=n_group,
        topk_group=1,
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        norm_topk_prob=draw(st.booleans()),
        shared_expert_gate=False,
        router_aux_loss_coef=0.0,
    )
    if model_type == "kimi_linear":
        kw.update(mla_use_nope=True, rms_norm_eps=1e-5)
    else:
        kw.update(
            kda_low_rank_gates=False,
            kda_lower_bound=draw(st.sampled_from([None, -5.0])),
            mla_output_gate=True,
            mla_norm_eps=1e-6,
            rope_theta=draw(st.sampled_from([1e4, 6e6])),
        )
    return HybridConfig(**kw)


def _random_model(cfg: HybridConfig, seed: int) -> HybridForCausalLM:
    torch.manual_seed(seed)
    model = HybridForCausalLM(cfg).double()
    with torch.no_grad():
        for _, t in list(model.named_parameters()) + list(model.named_buffers()):
            t.copy_(torch.randn_like(t))  # every entry distinct: a misplaced one shows
    return model


@pytest.mark.parametrize("model_type", sorted(FORMATS))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_round_trips_are_exact(model_type, data):
    fmt = FORMATS[model_type]
    cfg = data.draw(architectures(model_type))
    back_cfg = fmt.hybrid_config(fmt.source_config(cfg, None))
    if not cfg.num_experts:  # a dense model: the MoE fields describe nothing and are not kept
        moe = (
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "n_group",
            "topk_group",
            "routed_scaling_factor",
            "norm_topk_prob",
        )
        back_cfg = HybridConfig(**{**back_cfg.to_dict(), **{k: getattr(cfg, k) for k in moe}})
    assert back_cfg == cfg
    sd = _random_model(cfg, data.draw(st.integers(0, 2**16))).state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    source = ck.source_state_dict_from_hybrid(fmt, sd, cfg)
    streamed = {}
    for name, t in sd.items():  # what the engine's weight export sends, tensor by tensor
        streamed.update(ck.source_tensors_from_hybrid(fmt, "model." + name, t, cfg))
    assert streamed.keys() == source.keys()
    assert all(torch.equal(streamed[k], source[k]) for k in source)
    src = ck.CheckpointTensors(source)
    back = ck.hybrid_state_dict_from_source(fmt, src, cfg)
    assert src.taken == src.names
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
