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


def _source_dir(
    path, cfg: HybridConfig, seed: int = 0, extra=None, fmt=kimi_linear.FORMAT, model=None
) -> dict:
    """A checkpoint directory in ``fmt`` (Kimi-Linear by default) of ``model`` (a random
    float32 ``cfg`` model without one); ``extra`` edits the source state dict before it is
    saved. Returns the saved tensors."""
    import json

    from safetensors.torch import save_file

    sd = (model if model is not None else _random_model(cfg, seed).float()).state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    source = ck.source_state_dict_from_hybrid(fmt, sd, cfg)
    source = dict(extra(source)) if extra else source
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in source.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(fmt.source_config(cfg, None)))
    return source


_kimi_dir = _source_dir


@pytest.mark.parametrize("model_type", sorted(FORMATS))
def test_tied_model_without_token_ids_exports_for_transformers(model_type, tmp_path):
    """A tied model whose config has no token ids, through harts_hybrid and back, loads in
    transformers with its own logits (float64, 1e-10): transformers' Kimi-Linear and Ling 3
    never tie, so the export writes ``lm_head.weight`` (a copy of the embedding; without it
    they loaded a random head: logits 2.7 off), and the token ids are written as null (left
    out, transformers filled in its own, beyond this 64-token vocabulary: no model loaded)."""
    import json

    from _oracles import max_logit_error, oracle_path, run_oracle
    from safetensors.torch import load_file

    from harts_verl.models.config import preset
    from harts_verl.models.hf import load_causal_lm

    oracle_path()
    fmt = FORMATS[model_type]
    name = "kimi_tiny" if model_type == "kimi_linear" else "ling_tiny"
    cfg = preset(name, vocab_size=64, tie_word_embeddings=True)
    model = _random_model(cfg, 5)
    with torch.no_grad():  # keep activations tame through the layers
        for p in model.parameters():
            p.mul_(0.1)
    _source_dir(tmp_path / "src", cfg, fmt=fmt, model=model)
    ck.convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "harts"))
    ck.convert_checkpoint(str(tmp_path / "harts"), str(tmp_path / "back"), to=model_type)
    written = load_file(str(tmp_path / "back" / "model.safetensors"))
    emb = next(k for k in written if k.endswith(fmt.names.embed[0].split("model.")[-1]))
    assert torch.equal(written["lm_head.weight"], written[emb])
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: saved[k] for k in ck.TOKEN_KEYS} == dict.fromkeys(ck.TOKEN_KEYS)
    assert saved["tie_word_embeddings"] is True
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 17)]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": {"model_type": model_type}, "sequences": seqs}))
    run_oracle("logits", str(spec), str(tmp_path / "back"), str(tmp_path / "logits.pt"))
    ref = torch.load(tmp_path / "logits.pt")
    ours = load_causal_lm(str(tmp_path / "harts"), dtype=torch.float64)
    assert max_logit_error(ours, seqs, ref) <= 1e-10


def test_layers_beyond_the_declared_mtp_layers_are_refused(tmp_path, caplog):
    """Tensors of layers past ``num_hidden_layers`` are multi-token-prediction layers only as
    many as the config declares (``num_nextn_predict_layers`` / ``num_mtp_layers``; Ling's
    transformers default 1, Kimi-Linear 0): those are dropped with a WARNING, any other layer is
    refused by index (a config that undercounts its layers was truncated silently)."""
    import json
    import logging

    from harts_verl.models.config import preset

    cfg = preset("kimi_tiny", vocab_size=64)
    n = cfg.num_hidden_layers

    def copy_layer(d, to):  # layer 0's tensors again under index ``to``
        prefix = "model.layers.0."
        return {
            **d,
            **{
                f"model.layers.{to}.{k[len(prefix) :]}": v.clone()
                for k, v in d.items()
                if k.startswith(prefix)
            },
        }

    _source_dir(tmp_path / "extra", cfg, extra=lambda d: copy_layer(copy_layer(d, n), n + 1))
    with pytest.raises(ValueError, match=rf"tensors of layers \[{n}, {n + 1}\] beyond "):
        ck.convert_checkpoint(str(tmp_path / "extra"), str(tmp_path / "out0"))
    assert not (tmp_path / "out0").exists()
    config = json.loads((tmp_path / "extra" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "extra" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"tensors of layers \[{n + 1}\] beyond .* the 1 multi"):
        ck.convert_checkpoint(str(tmp_path / "extra"), str(tmp_path / "out1"))
    config["num_nextn_predict_layers"] = 2
    (tmp_path / "extra" / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        ck.convert_checkpoint(str(tmp_path / "extra"), str(tmp_path / "out2"))
    assert f"multi-token-prediction layers (index {n}..{n + 1})" in caplog.text
    config["num_nextn_predict_layers"] = -1
    (tmp_path / "extra" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_nextn_predict_layers: expected an int >= 0"):
        ck.convert_checkpoint(str(tmp_path / "extra"), str(tmp_path / "out3"))
    # Ling: one MTP layer unless the config says otherwise (transformers' num_mtp_layers)
    lcfg = preset("ling_tiny", vocab_size=64)
    src = _source_dir(tmp_path / "ling", lcfg, fmt=ling.FORMAT, extra=lambda d: copy_layer(d, n))
    assert ck.mtp_layers_of({}, ling.FORMAT) == 1 and ck.mtp_layers_of({}, kimi_linear.FORMAT) == 0
    back = ck.hybrid_state_dict_from_source(ling.FORMAT, src, lcfg, mtp_layers=1)
    assert not any(k.startswith(f"layers.{n}.") for k in back)
    with pytest.raises(ValueError, match=rf"layers \[{n}\] beyond"):
        ck.hybrid_state_dict_from_source(ling.FORMAT, src, lcfg)


def test_empty_tensors_without_a_place_are_ignored(tmp_path):
    """transformers saves zero-size shared experts (``[0, D]``) for ``num_shared_experts: 0``:
    they hold nothing and convert to nothing; a non-empty stray tensor is still refused."""
    from harts_verl.models.config import preset

    cfg = preset("kimi_tiny", vocab_size=64, shared_expert_intermediate_size=0)
    moe = cfg.moe_layers[0]
    root = f"model.layers.{moe}.block_sparse_moe.shared_experts."
    d = cfg.hidden_size
    empty = {
        root + "gate_proj.weight": torch.zeros(0, d),
        root + "down_proj.weight": torch.zeros(d, 0),
    }
    src = _source_dir(tmp_path / "src", cfg, extra=lambda s: {**s, **empty})
    ck.convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "out"))
    back = ck.hybrid_state_dict_from_source(kimi_linear.FORMAT, src, cfg)
    assert not any("shared" in k for k in back)
    with pytest.raises(ValueError, match="no place in the native model"):
        ck.hybrid_state_dict_from_source(
            kimi_linear.FORMAT, {**src, root + "up_proj.weight": torch.zeros(1, d)}, cfg
        )


def test_tied_checkpoint_may_store_its_head(tmp_path):
    """A tied checkpoint that also stores ``lm_head.weight`` (equal to the embedding) converts
    and loads; a stored head that differs from the embedding is refused by name."""
    from harts_verl.models.config import preset

    cfg = preset("kimi_tiny", vocab_size=64, tie_word_embeddings=True)
    emb = "model.embed_tokens.weight"
    src = _kimi_dir(tmp_path / "tied", cfg, extra=lambda d: {**d, "lm_head.weight": d[emb].clone()})
    ck.convert_checkpoint(str(tmp_path / "tied"), str(tmp_path / "tied_out"))
    back = ck.hybrid_state_dict_from_source(kimi_linear.FORMAT, src, cfg)
    assert "lm_head.weight" not in back
    bad = dict(src, **{"lm_head.weight": src[emb] + 1})
    with pytest.raises(ValueError, match=r"lm_head\.weight differs from the input embedding"):
        ck.hybrid_state_dict_from_source(kimi_linear.FORMAT, bad, cfg)


def test_failed_conversion_leaves_nothing_behind(tmp_path):
    """A conversion that fails after shards were written (an unexpected tensor is found at the
    end) removes them: no hidden partial shards, and a directory it created is gone."""
    import os

    from harts_verl.models.config import preset

    cfg = preset("kimi_tiny", vocab_size=64)
    extra = lambda d: {**d, "model.layers.0.foo.weight": torch.zeros(2)}  # noqa: E731
    _kimi_dir(tmp_path / "src", cfg, extra=extra)
    for dst in (tmp_path / "new", tmp_path / "existing"):
        if dst.name == "existing":
            dst.mkdir()
        with pytest.raises(ValueError, match=r"no place in the native model.*foo"):
            ck.convert_checkpoint(str(tmp_path / "src"), str(dst), max_shard_bytes=4096)
        assert (dst.name == "existing" and os.listdir(dst) == []) or not dst.exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"dst: .* is not a directory"):
        ck.convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "afile"))


def test_unreadable_checkpoints_are_named(tmp_path):
    """Broken configs, indexes and weight files give a ValueError naming the file."""
    import json

    from harts_verl.models.config import preset

    cfg = preset("kimi_tiny", vocab_size=64)
    _kimi_dir(tmp_path / "m", cfg)
    m = tmp_path / "m"
    for src, match in (
        (tmp_path / "missing", r"'.*missing' does not exist"),
        (tmp_path / "m" / "model.safetensors", "'.*' is a file, expected a model directory"),
        (tmp_path, "no config.json at"),
    ):
        with pytest.raises(ValueError, match=f"^src: {match}"):  # the source is named src
            ck.convert_checkpoint(str(src), str(tmp_path / "o0"))
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        ck.convert_checkpoint(str(tmp_path / "list"), str(tmp_path / "o1"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        ck.convert_checkpoint(str(tmp_path / "bad"), str(tmp_path / "o2"))
    index = m / "model.safetensors.index.json"
    for content, match in (
        ({"metadata": {}}, "weight_map"),
        ({"weight_map": {"x": "model-00002.safetensors"}}, "do not exist"),
    ):
        index.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=f"index.json.*{match}"):
            ck.convert_checkpoint(str(m), str(tmp_path / "o3"))
    index.unlink()
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        ck.convert_checkpoint(str(m), str(tmp_path / "o4"))
    bad_group = dict(ling.ling_config_from_hybrid(preset("ling_tiny")), layer_group_size=0)
    bad_group.pop("layer_types", None)
    with pytest.raises(ValueError, match="layer_group_size"):
        ling.hybrid_config_from_ling(bad_group)


def test_load_from_source_dtype(tmp_path):
    """``dtype="auto"`` takes the checkpoint config's dtype (as transformers does); a name that
    is no torch floating dtype is refused by name."""
    import json

    from harts_verl.models.config import preset
    from harts_verl.models.hf import HartsHybridForCausalLM

    _kimi_dir(tmp_path / "m", preset("kimi_tiny", vocab_size=64))
    cfg_file = tmp_path / "m" / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "dtype": "bfloat16"}))
    model = ck.load_from_source(HartsHybridForCausalLM, str(tmp_path / "m"), dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype: expected a torch floating dtype"):
        ck.load_from_source(HartsHybridForCausalLM, str(tmp_path / "m"), dtype="bf16")
