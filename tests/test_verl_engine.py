"""``harts_fsdp2`` vs veRL's stock ``fsdp2`` engine on CPU (gloo, FSDP2, fp32, tiny models).

Parity: log-probs and entropy ≤ 1e-6, grad_norm ≤ 1e-6 relative, parameters after one SGD
step ≤ 1e-6, on GRPO-style (shared prompt, n samples) and multi-turn tree batches (shared
turns, tool tokens masked), for tiny Qwen2, Qwen3-Next, Qwen3.5 and Qwen3.5-MoE models, with the
``vanilla``, ``gspo`` and ``cispo`` policy losses (on Qwen2 also GPG, SAPO, DPPO, DRO and
dual-clip PPO, fixed-size micro-batches, PPO epochs and a checkpoint resume); AdamW with its own
sensitivity bound (see ``test_adamw_step_parity`` and docs/verl.md). The hybrid references run veRL's padded path:
without fla, HF's torch fallback would carry linear-attention state across packed sequences.
"""

from __future__ import annotations

import logging
import types
from contextlib import nullcontext
from functools import partial

import numpy as np
import pytest
import torch
from _verl_cpu import assert_stock_metrics

pytest.importorskip("verl")

VOCAB = 64


@pytest.fixture(scope="module")
def verl_cpu(tmp_path_factory):
    """CPU platform shim + a world-size-1 gloo group + tiny saved models (once per module)."""
    from _verl_cpu import verl_cpu_process

    testing = verl_cpu_process()
    root = tmp_path_factory.mktemp("models")
    paths = {k: testing.save_tiny_model(k, str(root / k), seed=3) for k in testing.TINY_KINDS}
    return testing, paths


def _grpo_batch(seed: int) -> tuple[list[list[int]], list[int], list]:
    """One prompt, 4 samples (two share a response prefix), plus a second prompt with 2."""
    rng = np.random.default_rng(seed)
    p1 = rng.integers(0, VOCAB, 21).tolist()
    p2 = rng.integers(0, VOCAB, 9).tolist()
    r = [rng.integers(0, VOCAB, n).tolist() for n in (11, 7, 13, 5, 6)]
    seqs = [p1 + r[0], p1 + r[1], p1 + r[0][:4] + r[2], p1 + r[3], p2 + r[4], p2 + r[4][:2]]
    return seqs, [21, 21, 21, 21, 9, 9], []


def _multiturn_batch(seed: int) -> tuple[list[list[int]], list[int], list]:
    """Agentic tree: system+task prompt, turn 1 (LLM), tool output, then 3 branches of turn 2,
    one of which continues with a tool call and turn 3; tool tokens have loss mask 0."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 17).tolist()
    t1 = rng.integers(0, VOCAB, 8).tolist()
    tool1 = rng.integers(0, VOCAB, 6).tolist()
    base = prompt + t1 + tool1
    b = [rng.integers(0, VOCAB, n).tolist() for n in (9, 12, 5)]
    tool2 = rng.integers(0, VOCAB, 4).tolist()
    t3 = rng.integers(0, VOCAB, 7).tolist()
    seqs = [base + b[0], base + b[1], base + b[2] + tool2 + t3, base + b[0][:3]]
    spans = [(i, 8, 14) for i in range(4)] + [(2, 14 + 5, 14 + 5 + 4)]
    return seqs, [17] * 4, spans


def _random_batch(seed: int) -> tuple[list[list[int]], list[int], list]:
    """A random tree batch: 1-3 prompts of 1-24 tokens, each with a group of 1-4 samples. A
    sample's response is fresh (1-20 tokens) or forks a sibling's at a random point (0: a
    shared first token; the whole response: an exact duplicate, possibly with other tool
    spans); some samples move the prompt/response boundary into their prompt (the same tokens,
    a shorter prompt); random tool spans (loss mask 0) in half of the longer responses."""
    rng = np.random.default_rng(seed)
    seqs: list[list[int]] = []
    prompt_lens: list[int] = []
    spans: list[tuple[int, int, int]] = []
    for _ in range(int(rng.integers(1, 4))):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 25))).tolist()
        group: list[list[int]] = []
        for _ in range(int(rng.integers(1, 5))):
            if group and rng.random() < 0.6:
                base = group[int(rng.integers(len(group)))]
                cut = int(rng.integers(0, len(base) + 1))
                fresh = rng.integers(0, VOCAB, int(rng.integers(0, 12))).tolist()
                resp = (base[:cut] + fresh) or base[:1]
            else:
                resp = rng.integers(0, VOCAB, int(rng.integers(1, 21))).tolist()
            group.append(resp)
        for resp in group:
            plen = len(prompt)
            if plen > 1 and rng.random() < 0.2:  # the same tokens, a shorter prompt
                plen = int(rng.integers(1, plen))
            i = len(seqs)
            seqs.append(prompt + resp)
            prompt_lens.append(plen)
            n = len(seqs[i]) - plen
            if n > 4 and rng.random() < 0.5:
                a = int(rng.integers(1, n - 2))
                spans.append((i, a, int(rng.integers(a + 1, n))))
    return seqs, prompt_lens, spans


BATCHES = {"grpo": _grpo_batch, "multiturn": _multiturn_batch}


def _params(engine) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }


def _run(
    testing,
    path,
    strategy,
    batch,
    *,
    loss_mode,
    loss_agg_mode="token-mean",
    max_token_len=4096,
    harts=None,
    padded=False,
    entropy=0.0,
    gradient_checkpointing=False,
    fused=False,
    lora=0,
    temperature=0.8,
    ref_log_probs=False,
    rollout_is_weights=False,
    micro_batch_size=None,
    trainer_format=False,
    **optim,
):
    """Infer, then one train step; returns (model output, metrics, params before, params after,
    gradients as the optimizer saw them). ``optim``: ``actor_config`` keywords (``optimizer``,
    ``lr``, ``weight_decay``, ``kl_loss_type``, ``policy_loss``, other ``ActorConfig``
    fields); ``ref_log_probs`` / ``rollout_is_weights``: ``make_batch``'s per-token fields;
    ``micro_batch_size``: fixed-size micro-batches of that many trajectories
    (``use_dynamic_bsz`` false) instead of the token budget;
    ``gradient_checkpointing``: veRL's (HF's activation checkpointing, non-reentrant);
    ``trainer_format``: the batch as veRL's trainer passes it (``make_trainer_batch``: padded,
    then ``left_right_2_no_padding``; per-token fields dense)."""
    from verl.utils import tensordict_utils as tu

    seqs, prompt_lens, spans = batch
    cfg = testing.actor_config(
        strategy=strategy,
        loss_mode=loss_mode,
        loss_agg_mode=loss_agg_mode,
        harts=harts,
        entropy_coeff=entropy,
        max_token_len=max_token_len,
        **optim,
    )
    torch.manual_seed(1234)  # LoRA's A matrices are drawn at build: the same for both engines
    engine = testing.build_engine(
        path,
        cfg,
        use_remove_padding=not padded,
        gradient_checkpointing=gradient_checkpointing,
        use_fused_kernels=fused,
        lora_rank=lora,
    )

    def mk(**kwargs):
        td = (testing.make_trainer_batch if trainer_format else testing.make_batch)(
            seqs,
            prompt_lens,
            tool_spans=spans,
            temperature=temperature,
            use_fused_kernels=fused,
            max_token_len=max_token_len,
            ref_log_probs=ref_log_probs,
            rollout_is_weights=rollout_is_weights,
            **kwargs,
        )
        if micro_batch_size is not None:
            tu.assign_non_tensor(
                td, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch_size
            )
        return td

    with engine.eval_mode():
        inf = engine.infer_batch(mk(calculate_entropy=True, use_remove_padding=not padded))
    before = _params(engine)
    grads: dict[str, torch.Tensor] = {}
    step = engine.optimizer.step

    def snapshot_then_step(*args, **kwargs):
        for n, p in engine.module.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        return step(*args, **kwargs)

    engine.optimizer.step = snapshot_then_step
    with engine.train_mode():
        out = engine.train_batch(
            mk(calculate_entropy=entropy != 0.0, use_remove_padding=not padded),
            loss_function=partial(_ppo_loss(), config=cfg),
        )
    after = _params(engine)
    return inf["model_output"], out["metrics"], before, after, grads


def _ppo_loss():
    from verl.workers.utils.losses import ppo_loss

    return ppo_loss


def _compare(ref, tree, *, tol=1e-6):
    (inf_r, met_r, p0_r, p1_r, _), (inf_t, met_t, p0_t, p1_t, _) = ref, tree
    for key in ("log_probs", "entropy"):
        for a, b in zip(inf_r[key].unbind(), inf_t[key].unbind(), strict=True):
            assert a.shape == b.shape
            # relative above 1 (entropies of ~4 nats differ by a few fp32 ulps, 4.8e-7 each)
            err = (a[:-1] - b[:-1]).abs() / a[:-1].abs().clamp_min(1.0)
            assert float(err.max()) <= tol, key
            assert float(b[-1]) == 0.0  # no next token at the last position
    gr, gt = met_r["grad_norm"], met_t["grad_norm"]
    assert abs(gr - gt) <= tol * abs(gr), (gr, gt)
    assert_stock_metrics(met_r, met_t, tol=tol)
    assert met_t["harts/fallback"] == [0.0]
    for n in p0_r:
        torch.testing.assert_close(p0_t[n], p0_r[n], rtol=0, atol=0)
        assert float((p1_t[n] - p1_r[n]).abs().max()) <= tol, n
    moved = max(float((p1_r[n] - p0_r[n]).abs().max()) for n in p0_r)
    assert moved > 1e-6  # the step did something


HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


@pytest.mark.parametrize("kind", ["qwen2", *HYBRIDS])
@pytest.mark.parametrize("batch", ["grpo", "multiturn"])
def test_parity_vanilla(verl_cpu, kind, batch):
    testing, paths = verl_cpu
    data = BATCHES[batch](seed=len(kind) + len(batch))
    padded = kind in HYBRIDS
    ref = _run(testing, paths[kind], "fsdp2", data, loss_mode="vanilla", padded=padded)
    # capacity 48 forces several micro-batches (and a sub-forest per micro-batch).
    tree = _run(
        testing,
        paths[kind],
        "harts_fsdp2",
        data,
        loss_mode="vanilla",
        harts={"chunk_size": 8, "capacity_tokens": 48},
    )
    _compare(ref, tree)
    assert tree[1]["harts/microbatches"][0] >= 2
    assert tree[1]["harts/compression"][0] > 1.0


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_next"])
@pytest.mark.parametrize("batch", ["grpo", "multiturn"])
def test_parity_in_the_trainers_batch_format(verl_cpu, kind, batch):
    """The batch as veRL's trainer hands it over (left-padded prompts of different lengths,
    right-padded responses, then ``left_right_2_no_padding``: response masks, advantages and
    old log-probs stay dense ``[B, R]``), with a KL loss: the same numbers as stock."""
    testing, paths = verl_cpu
    data = BATCHES[batch](seed=7 + len(kind))
    assert len({p for p in data[1]}) > 1 or batch == "multiturn"
    kw = dict(loss_mode="vanilla", trainer_format=True, ref_log_probs=True, entropy=0.01)
    kw["kl_loss_type"] = "low_var_kl"
    ref = _run(testing, paths[kind], "fsdp2", data, padded=kind in HYBRIDS, **kw)
    harts = {"chunk_size": 8, "capacity_tokens": 48}
    tree = _run(testing, paths[kind], "harts_fsdp2", data, harts=harts, **kw)
    _compare(ref, tree)
    assert tree[1]["harts/microbatches"][0] >= 2


def test_parity_in_the_trainers_batch_format_with_per_sample_temperatures(verl_cpu):
    """Per-sample temperatures (a ``[B]`` tensor field) reach the engine in the trainer's
    format too (``make_trainer_batch`` once dropped them)."""
    testing, paths = verl_cpu
    data = BATCHES["multiturn"](seed=5)
    kw = dict(loss_mode="vanilla", trainer_format=True, temperature=[0.7, 1.0, 1.3, 0.9])
    td = testing.make_trainer_batch(data[0], data[1], temperature=kw["temperature"])
    assert td["temperature"].tolist() == pytest.approx(kw["temperature"])
    ref = _run(testing, paths["qwen2"], "fsdp2", data, **kw)
    harts = {"chunk_size": 8, "capacity_tokens": 48}
    _compare(ref, _run(testing, paths["qwen2"], "harts_fsdp2", data, harts=harts, **kw))


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_5", "deepseek_v3"])
def test_parity_with_an_attention_key_row_bound(verl_cpu, monkeypatch, kind):
    """``harts.attention_key_rows`` reaches every attention call of the tree micro-batches
    (there: bucket checkpoints, keys gathered again in backward) and changes no number."""
    from harts_verl.ops import backends

    testing, paths = verl_cpu
    seen: list = []
    sdpa_call = backends.SdpaAttentionKernel.__call__

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("max_key_rows"))
        return sdpa_call(self, *args, **kwargs)

    monkeypatch.setattr(backends.SdpaAttentionKernel, "__call__", spy)
    data = BATCHES["grpo"](seed=3)  # groups share their prompt: forks
    padded = kind in HYBRIDS
    ref = _run(testing, paths[kind], "fsdp2", data, loss_mode="vanilla", padded=padded)
    tree = _run(
        testing,
        paths[kind],
        "harts_fsdp2",
        data,
        loss_mode="vanilla",
        harts={"chunk_size": 8, "capacity_tokens": 48, "attention_key_rows": 16},
    )
    _compare(ref, tree)
    assert seen and set(seen) == {16}
    # Σ Lk / C: at least each row's own key; forks add their root paths (a prefix
    # trajectory alone adds none)
    assert tree[1]["harts/attention_key_rows_ratio"][0] > 1.0


@pytest.mark.parametrize(
    "kind",
    [
        "qwen2",
        "qwen3_5",
        "deepseek_v3",
        "gpt_oss",
        "granitemoehybrid",
        "jamba",
        "lfm2",
        "minimax",
        "recurrent_gemma",
    ],
)
@pytest.mark.parametrize("seed", range(5))
def test_parity_random_batches(verl_cpu, kind, seed):
    """Random tree batches (:func:`_random_batch`: duplicates, forks at every depth, moved
    prompt boundaries, tool spans, one-token prompts and responses): inference and one train
    step equal the stock engine's, over several micro-batches (GQA / MLA / sink attention,
    GatedDeltaNet, Mamba-2 and Mamba-1 mixers, short convolutions, lightning attention)."""
    testing, paths = verl_cpu
    data = _random_batch(seed)
    padded = kind in HYBRIDS or kind in _PADDED_REFERENCE
    ref = _run(testing, paths[kind], "fsdp2", data, loss_mode="vanilla", padded=padded)
    harts = {"chunk_size": 8, "capacity_tokens": 40}
    tree = _run(testing, paths[kind], "harts_fsdp2", data, loss_mode="vanilla", harts=harts)
    _compare(ref, tree)


# Full-attention families beyond Qwen2: Llama (no per-layer mask mapping), the MoE Qwen3-MoE and
# Mixtral, DeepSeek-V3 (MLA, sigmoid routing), GLM-4-MoE (partial RoPE), OLMo 2 (q/k norms over
# all heads, post-norm layers), OLMo 3 (a sliding and a full layer: HF's per-type mask mapping),
# Phi-3 (fused qkv, partial RoPE), GLM-4 (extra post norms), Gemma 3 (scaled embeddings, a
# rotary table per layer type, tied LM head), gpt-oss (attention sinks, eager attention, biased
# MoE; padded stock reference, see below), Gemma 2 (attention and final logit soft-caps, eager
# attention), Granite and Granite-MoE-Shared (logits / logits_scaling, embedding and residual
# multipliers; top-k gated experts and a shared expert), SmolLM3 (a NoPE layer), EXAONE 4 (a
# sliding RoPE layer and a full NoPE one whose module keeps a sliding_window), MiniMax-M2 (sigmoid
# router with a correction bias, q/k norms over all heads) and Cohere 2
# (logits · logit_scale, parallel attention and MLP, a sliding RoPE layer and a full NoPE one): the
# compact head applies the logit transforms that their causal-LM forwards apply in the stock
# path; packed stock reference otherwise, veRL's gradient
# checkpointing on (its default: layers re-run in backward, in tree mode too). Seed-OSS is left
# out here: its tiny model has Qwen2's layer math (q/k/v biases) and gives Qwen2's numbers.
_ENGINE_FAMILIES = ["llama", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe"]
_ENGINE_FAMILIES += ["olmo2", "olmo3", "phi3", "glm4", "gemma3_text", "gpt_oss", "gemma2"]
_ENGINE_FAMILIES += ["granite", "cohere2", "granitemoeshared", "smollm3", "exaone4", "minimax_m2"]
# The MoE OLMoE and FlexOlmo (softmax routing, q/k norms over all heads), dots.llm1 and
# Solar-Open (sigmoid routing with a correction bias, shared expert), GLM-4-MoE-Lite (MLA) and
# EXAONE-MoE (a sliding RoPE layer and a full NoPE one).
_ENGINE_FAMILIES += ["olmoe", "flex_olmo", "dots1", "solar_open", "glm4_moe_lite", "exaone_moe"]
# Ministral 3 and Mistral 4 (MLA, MoE): YaRN with Llama 4's position-dependent query scaling.
_ENGINE_FAMILIES += ["ministral3", "mistral4"]
# Hunyuan-MoE (q/k norms after RoPE), ERNIE 4.5 MoE (correction-biased routing, shared expert),
# Cohere 2 MoE (logit scale, sliding RoPE + full NoPE layers), LongCat-Flash (two MLA attentions
# a layer, zero-computation experts).
_ENGINE_FAMILIES += ["hunyuan_v1_moe", "ernie4_5_moe", "cohere2_moe", "longcat_flash"]
# The Mamba-2 hybrids Granite 4.0-H (MoE + shared MLP, NoPE attention), Bamba, Nemotron-H
# (Mamba-2, attention, MLP and MoE blocks) and Falcon-H1 (mixer and attention in parallel, µP
# multipliers, logits times lm_head_multiplier); the short-conv hybrids LFM2 (tied embeddings) and
# LFM2-MoE; the lightning-attention hybrid MiniMax-Text-01 / M1 (MoE every layer); the Mamba-1
# hybrid Jamba (NoPE attention, MoE every other layer); the Griffin hybrid RecurrentGemma (RG-LRU
# and local MQA attention, logits soft-capped, tied embeddings). (Zamba2 is left out: veRL's FSDP2
# wrapping fails on its tied shared blocks, a plain tensor meeting a DTensor in the stock path.)
_RECURRENT = ["granitemoehybrid", "bamba", "nemotron_h", "falcon_h1", "lfm2", "lfm2_moe"]
_RECURRENT += ["minimax", "jamba", "recurrent_gemma"]
_ENGINE_FAMILIES += _RECURRENT
# gpt-oss (attention sinks, a sliding and a full layer) runs HF's eager attention on the CPU, and
# transformers 5.10's GptOssModel builds its masks without ``position_ids``: packed sequences
# (veRL's remove-padding path) would attend across each other there, so its stock reference runs
# veRL's padded path. So do the recurrent hybrids: HF's Mamba-2 / Mamba-1 mixers, LFM2's and
# RecurrentGemma's convolutions and MiniMax's lightning attention take no ``position_ids`` (one recurrence /
# convolution through the packed row).
_PADDED_REFERENCE = ("gpt_oss", *_RECURRENT)


@pytest.mark.parametrize("kind", _ENGINE_FAMILIES)
def test_parity_full_attention_families(verl_cpu, kind):
    testing, paths = verl_cpu
    data = _multiturn_batch(seed=len(kind))
    run = partial(_run, testing, paths[kind], batch=data, gradient_checkpointing=True)
    ref = run(strategy="fsdp2", loss_mode="vanilla", padded=kind in _PADDED_REFERENCE)
    tree = run(strategy="harts_fsdp2", loss_mode="vanilla", harts={"capacity_tokens": 48})
    _compare(ref, tree)
    assert tree[1]["harts/microbatches"][0] >= 2


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_attention_free_models_are_refused_by_name(verl_cpu, kind):
    """veRL's FSDP engine cannot build a pure state-space model (its monkey patch reads
    ``num_attention_heads``): ``harts_fsdp2`` says so, naming the model type, before veRL
    fails on the missing attribute."""
    testing, paths = verl_cpu
    cfg = testing.actor_config(strategy="harts_fsdp2", loss_mode="vanilla")
    with pytest.raises(ValueError, match=f"model_type '{kind}'.*num_attention_heads"):
        testing.build_engine(paths[kind], cfg, use_remove_padding=False)


def test_the_callers_config_keeps_naming_the_tree_engine(verl_cpu):
    """The engine runs veRL's FSDP2 build on its own copy of the config (which says ``fsdp2``);
    the caller's config still says ``harts_fsdp2``, so a second engine built from it (as veRL
    builds a ref model's from a shared section) is a tree engine too, not a stock one."""
    from harts_verl.workers.engine import HartsFSDPEngine

    testing, paths = verl_cpu
    cfg = testing.actor_config(strategy="harts_fsdp2", loss_mode="vanilla")
    engines = [testing.build_engine(paths["qwen2"], cfg) for _ in range(2)]
    assert cfg.engine.strategy == "harts_fsdp2"
    for engine in engines:
        assert isinstance(engine, HartsFSDPEngine) and engine._tree_supported
        assert engine.engine_config.strategy == "fsdp2"
        assert engine.engine_config is not cfg.engine


def test_tree_mode_only_for_the_listed_model_types(verl_cpu, caplog, monkeypatch):
    """A model type outside TREE_MODEL_TYPES (what ``harts-verl check`` takes) runs the stock
    path, named in a WARNING, even when it holds an attention class tree mode can patch (a
    llava wrapper around Llama did run tree batches nothing had checked)."""
    from harts_verl.workers import engine as engine_mod

    testing, paths = verl_cpu
    listed = tuple(t for t in engine_mod.TREE_MODEL_TYPES if t != "qwen2")
    monkeypatch.setattr(engine_mod, "TREE_MODEL_TYPES", listed)
    seqs, prompt_lens, spans = _grpo_batch(seed=3)
    with caplog.at_level("WARNING"):
        engine = testing.build_engine(paths["qwen2"], testing.actor_config())
    assert not engine._tree_supported
    assert any(
        "model type 'qwen2' has no tree-mode support" in r.getMessage() for r in caplog.records
    )
    with engine.eval_mode():
        out = engine.infer_batch(testing.make_batch(seqs, prompt_lens, tool_spans=spans))
    assert out["metrics"]["harts/fallback"] == [1.0]


def test_gemma2_sdpa_fallback_batches_keep_the_soft_cap(verl_cpu, caplog, monkeypatch):
    """Gemma 2 on sdpa (which drops its attention soft-cap): the build warns, and a fallback
    batch runs eager attention, so it computes what a tree batch computes (log-probs <= 1e-6
    relative) rather than the cap-less model (what it would compute on sdpa, > 1e-3 away)."""
    from harts_verl.workers.engine import HartsFSDPEngine

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _multiturn_batch(seed=8)

    def log_probs(enable: bool) -> torch.Tensor:
        cfg = testing.actor_config(harts={"enable": enable})
        engine = testing.build_engine(paths["gemma2"], cfg, attn_implementation="sdpa")
        assert engine.module.config._attn_implementation == "sdpa"
        with engine.eval_mode():
            res = engine.infer_batch(testing.make_batch(seqs, prompt_lens, tool_spans=spans))
        assert engine.module.config._attn_implementation == "sdpa"  # restored
        assert res["metrics"]["harts/fallback"] == [0.0 if enable else 1.0]
        # positions 0..L-2 (the stock and tree paths differ at L-1, which no RL loss reads)
        return torch.cat([t[:-1] for t in res["model_output"]["log_probs"].unbind()])

    with caplog.at_level("WARNING"):
        tree = log_probs(True)
    assert any("sdpa drops its attention logit soft-cap" in r.getMessage() for r in caplog.records)
    scale = tree.abs().clamp_min(1.0)  # fp32: 1e-6 relative above 1, as _compare
    assert float(((log_probs(False) - tree).abs() / scale).max()) <= 1e-6
    monkeypatch.setattr(HartsFSDPEngine, "_stock_attention", lambda self: nullcontext())
    assert float((log_probs(False) - tree).abs().max()) > 1e-3


@pytest.mark.parametrize("kind", ["granitemoehybrid", "gpt_oss"])
def test_fallback_batches_of_packing_unsafe_models_run_padded(verl_cpu, caplog, monkeypatch, kind):
    """A Mamba-2 hybrid's (or gpt-oss's) stock forward runs veRL's packed sequences as one: its
    fallback batches run padded rows (with a warning), so they equal tree mode per trajectory
    (<= 1e-6 relative); packed, the first trajectory's state leaks into the others (> 1e-3)."""
    from harts_verl.workers import engine as engine_mod

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _multiturn_batch(seed=9)

    def log_probs(enable: bool) -> torch.Tensor:
        engine = testing.build_engine(paths[kind], testing.actor_config(harts={"enable": enable}))
        with engine.eval_mode():
            res = engine.infer_batch(testing.make_batch(seqs, prompt_lens, tool_spans=spans))
        assert res["metrics"]["harts/fallback"] == [0.0 if enable else 1.0]
        return torch.cat([t[:-1] for t in res["model_output"]["log_probs"].unbind()])

    tree = log_probs(True)
    with caplog.at_level("WARNING"):
        padded = log_probs(False)
    assert any("run veRL's padded path" in r.getMessage() for r in caplog.records)
    scale = tree.abs().clamp_min(1.0)
    assert float(((padded - tree).abs() / scale).max()) <= 1e-6
    monkeypatch.setattr(engine_mod, "_PADDED_STOCK_TYPES", ())
    assert float((log_probs(False) - tree).abs().max()) > 1e-3


def test_trajectories_over_the_token_budget_run_whole_and_are_named(verl_cpu, caplog):
    """A trajectory longer than the micro-batch budget (here harts.capacity_tokens = 12) runs
    whole in its own micro-batch — nothing truncated, the same log-probs as with a budget that
    fits — and the engine says so (one WARNING, the metric harts/oversize_microbatches), where
    the stock engine refuses the batch."""
    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _multiturn_batch(seed=12)
    assert max(len(s) for s in seqs) > 12

    def infer(capacity: int):
        cfg = testing.actor_config(harts={"capacity_tokens": capacity})
        engine = testing.build_engine(paths["qwen2"], cfg)
        with engine.eval_mode():
            res = engine.infer_batch(testing.make_batch(seqs, prompt_lens, tool_spans=spans))
        return res["model_output"]["log_probs"], res["metrics"]

    with caplog.at_level("WARNING"):
        small, met_small = infer(12)
    assert met_small["harts/oversize_microbatches"][0] >= 1
    assert any("exceed the token budget of 12 rows" in r.getMessage() for r in caplog.records)
    fits, met_fits = infer(4096)
    assert met_fits["harts/oversize_microbatches"] == [0.0]
    for a, b in zip(small.unbind(), fits.unbind(), strict=True):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-6


@pytest.mark.parametrize("loss_mode", ["vanilla", "geo_mean"])
@pytest.mark.parametrize("refusal", ["budget", "fixed_size"])
def test_batches_verl_cannot_cut_train_on_tree_micro_batches(verl_cpu, caplog, loss_mode, refusal):
    """veRL's own micro-batching refuses a trajectory over the token budget, and with
    fixed-size micro-batches a batch size the size does not divide; the tree engine runs such
    a batch whole. The loss (a split-dependent one too) and its metrics are then evaluated on
    the tree micro-batches (``harts/stock_metrics`` = 0, one WARNING naming the reason), with
    the gradient of a budget that fits (``harts/stock_metrics`` = 1 there)."""
    from verl.utils import tensordict_utils as tu

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _multiturn_batch(seed=12)
    longest = max(map(len, seqs))

    def train(refused: bool):
        cfg = testing.actor_config(loss_mode=loss_mode, harts={"capacity_tokens": 4096})
        engine = testing.build_engine(paths["qwen2"], cfg)
        batch = testing.make_batch(seqs, prompt_lens, tool_spans=spans, max_token_len=4096)
        if refused and refusal == "budget":
            tu.assign_non_tensor(batch, max_token_len_per_gpu=longest - 1)
        elif refusal == "fixed_size":
            size = 2 if len(seqs) % 2 else 3  # one that does not divide the batch
            size = size if refused else 1
            tu.assign_non_tensor(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=size)
        with engine.train_mode():
            out = engine.train_batch(batch, loss_function=partial(_ppo_loss(), config=cfg))
        return out["metrics"]

    assert len(seqs) % 2 or len(seqs) % 3
    with caplog.at_level("WARNING"):
        refused = train(True)
    assert refused["harts/stock_metrics"] == [0.0]
    assert refused["harts/stock_split_loss"] == [0.0]
    assert refused["harts/fallback"] == [0.0]
    reason = "max_token_len_per_gpu" if refusal == "budget" else "micro_batch_size_per_gpu"
    assert any(
        "veRL's own micro-batching refuses this batch" in r.getMessage()
        and reason in r.getMessage()
        for r in caplog.records
    )
    fits = train(False)
    assert fits["harts/stock_metrics"] == [1.0]
    assert fits["harts/stock_split_loss"] == [float(loss_mode == "geo_mean")]
    if loss_mode == "vanilla":  # the gradient does not depend on the micro-batching
        assert abs(refused["grad_norm"] - fits["grad_norm"]) <= 1e-6 * fits["grad_norm"]


def test_compression_counts_the_rows_the_micro_batches_run(verl_cpu):
    """``harts/compression`` and the ``min_compression`` gate count the compact rows that the
    micro-batches run: a tree that the token budget splits pays its shared rows in each part
    (at 4 rows every trajectory is over the budget: little is shared, and the gate sees it)."""
    from harts_verl.tree import RolloutForest

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=2)
    tree_rows = RolloutForest.from_sequences(seqs).num_compact_tokens
    semantic = sum(map(len, seqs))
    assert semantic / tree_rows > 1.5

    def infer(**harts):
        engine = testing.build_engine(paths["qwen2"], testing.actor_config(harts=harts))
        with engine.eval_mode():
            out = engine.infer_batch(testing.make_batch(seqs, prompt_lens, tool_spans=spans))
        return out["metrics"]

    whole = infer(capacity_tokens=4096)
    assert whole["harts/compact_tokens"] == [float(tree_rows)]
    assert whole["harts/compression"] == pytest.approx([semantic / tree_rows], rel=1e-12)
    split = infer(capacity_tokens=40)
    assert split["harts/fallback"] == [0.0]
    run = split["harts/compact_tokens"][0]
    assert tree_rows < run <= semantic
    assert split["harts/compression"] == pytest.approx([semantic / run], rel=1e-12)
    # every trajectory over the budget: whole, alone or with its own prefixes and copies
    alone = infer(capacity_tokens=4)["harts/compact_tokens"][0]
    assert semantic / alone < 1.5
    gated = infer(capacity_tokens=4, min_compression=1.5)
    assert gated["harts/fallback"] == [1.0]
    assert gated["harts/compression"] == pytest.approx([semantic / alone], rel=1e-12)
    assert infer(capacity_tokens=4096, min_compression=1.5)["harts/fallback"] == [0.0]


def test_the_compression_gate_yields_where_the_stock_path_cannot_run(verl_cpu, caplog):
    """Below ``min_compression`` a batch takes the stock path, unless veRL's micro-batching
    refuses it (here a trajectory over the token budget): the stock path would stop there, so
    it runs in tree mode, with one WARNING."""
    from verl.utils import tensordict_utils as tu

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=2)
    engine = testing.build_engine(
        paths["qwen2"], testing.actor_config(harts={"min_compression": 100.0})
    )
    batch = testing.make_batch(seqs, prompt_lens, tool_spans=spans)
    tu.assign_non_tensor(batch, max_token_len_per_gpu=max(map(len, seqs)) - 1)
    with engine.eval_mode(), caplog.at_level("WARNING"):
        out = engine.infer_batch(batch)
    assert out["metrics"]["harts/fallback"] == [0.0]
    assert out["model_output"]["log_probs"].size(0) == len(seqs)
    assert any("but the stock path cannot run this batch" in r.getMessage() for r in caplog.records)


def test_a_zero_token_budget_is_named(verl_cpu):
    from verl.utils import tensordict_utils as tu

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=2)
    engine = testing.build_engine(paths["qwen2"], testing.actor_config())
    batch = testing.make_batch(seqs, prompt_lens, tool_spans=spans)
    for bad in (0, 10**400):  # 10**400: not an OverflowError
        tu.assign_non_tensor(batch, max_token_len_per_gpu=bad)
        with engine.eval_mode(), pytest.raises(ValueError, match="max_token_len_per_gpu: expected"):
            engine.infer_batch(batch)


def test_fused_kernels_with_a_logit_transform_warn(verl_cpu, caplog, monkeypatch):
    """veRL's fused forward leaves out Granite's logits_scaling (stock batches would differ from
    tree mode, HF and the rollout): the build says so."""
    import transformers

    testing, paths = verl_cpu
    cls = transformers.GraniteForCausalLM
    monkeypatch.setattr(cls, "forward", cls.forward)  # veRL's patch is undone at teardown
    with caplog.at_level("WARNING"):
        testing.build_engine(paths["granite"], testing.actor_config(), use_fused_kernels=True)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("leaves out the model's own logit transform" in m for m in msgs), msgs


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_parity_with_fused_kernels(verl_cpu, monkeypatch, tmp_path, kind):
    """veRL's fused LM-head forward (``use_fused_kernels``, torch backend) replaces the model
    class's ``forward``: tree mode runs HF's backbone-then-head forward for its calls instead
    (log-probs of the next token of every trajectory, not of the next compact row) and matches
    the stock fused engine; the class keeps veRL's forward. Tied embeddings: veRL 0.9.1's fused
    forward reads ``lm_head.weight`` without the LM head's FSDP2 unshard, which fails when the
    untied head is its own FSDP unit (tree mode calls the head, so it runs either way)."""
    import transformers

    testing, _ = verl_cpu
    cls = getattr(transformers, type(testing.tiny_hf_model(kind)).__name__)
    monkeypatch.setattr(cls, "forward", cls.forward)  # veRL's patch is undone at teardown
    path = _save_variant(testing, kind, tmp_path / kind, tie_word_embeddings=True)
    data = _multiturn_batch(seed=7)
    run = partial(_run, testing, path, batch=data, loss_mode="vanilla", fused=True)
    ref = run(strategy="fsdp2")
    assert cls.forward.__module__.startswith("verl.")  # the fused forward is in place
    tree = run(strategy="harts_fsdp2", harts={"capacity_tokens": 48})
    _compare(ref, tree)
    assert tree[1]["harts/microbatches"][0] >= 2
    assert cls.forward.__module__.startswith("verl.")


def test_fused_kernels_audit_with_per_sample_temperatures(verl_cpu, monkeypatch, tmp_path):
    """veRL's fused forward refuses per-sample temperatures (``AssertionError: use_fused_kernels
    does not support per sample temperature yet``); tree mode runs them (the compact head takes
    one temperature per trajectory) and equals the stock *unfused* engine. The audit's stock
    reference then runs unfused too (HF's backbone-then-head forward through veRL's stock
    path) rather than stopping the training step at veRL's assertion."""
    import transformers

    testing, _ = verl_cpu
    cls = transformers.Qwen2ForCausalLM
    monkeypatch.setattr(cls, "forward", cls.forward)  # veRL's fused patch is undone at teardown
    path = _save_variant(testing, "qwen2", tmp_path / "qwen2", tie_word_embeddings=True)
    data = _multiturn_batch(seed=7)
    run = partial(
        _run, testing, path, batch=data, loss_mode="vanilla", temperature=[0.7, 1.0, 1.3, 0.9]
    )
    ref = run(strategy="fsdp2")  # unfused: built before the fused patch replaces the forward
    harts = {"capacity_tokens": 48, "audit_every": 1}
    tree = run(strategy="harts_fsdp2", harts=harts, fused=True)
    assert cls.forward.__module__.startswith("verl.")  # the fused forward is in place
    _compare(ref, tree)
    assert tree[1]["harts/audit"][0] <= 1e-6


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_next"])
def test_parity_with_lora(verl_cpu, monkeypatch, kind):
    """veRL's LoRA (peft adapters on every linear layer, wrapped after the model is built and
    patched): tree mode runs through the peft wrapper and matches the stock engine; the adapters
    train (B moves from 0). With fused kernels the plain forward goes on peft's base model."""
    import transformers

    testing, paths = verl_cpu
    data = _multiturn_batch(seed=5)
    padded = kind in HYBRIDS
    run = partial(_run, testing, paths[kind], batch=data, loss_mode="vanilla", lora=4)
    ref = run(strategy="fsdp2", padded=padded)
    tree = run(strategy="harts_fsdp2", harts={"chunk_size": 8, "capacity_tokens": 48})
    assert any("lora_B" in n for n in tree[2])
    _compare(ref, tree)
    assert tree[1]["harts/microbatches"][0] >= 2
    if kind == "qwen2":
        cls = getattr(transformers, type(testing.tiny_hf_model(kind)).__name__)
        monkeypatch.setattr(cls, "forward", cls.forward)  # veRL's fused patch, undone
        fused = run(strategy="harts_fsdp2", harts={"capacity_tokens": 48}, fused=True)
        _compare(ref, fused)


def test_lora_reference_in_actor_runs_without_adapters(verl_cpu):
    """With LoRA, veRL computes the reference log-probs on the actor with its adapters disabled
    (``no_lora_adapter`` -> ``engine.disable_adapter()``): tree mode honours that context and
    matches the stock engine with and without adapters, once the adapters have moved."""
    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _multiturn_batch(seed=5)
    out: dict[str, dict[bool, torch.Tensor]] = {}
    for strategy, padded in (("fsdp2", True), ("harts_fsdp2", False)):
        harts = {"chunk_size": 8, "capacity_tokens": 48} if strategy == "harts_fsdp2" else None
        cfg = testing.actor_config(strategy=strategy, harts=harts)
        torch.manual_seed(1234)  # LoRA's A matrices: the same for both engines
        engine = testing.build_engine(
            paths["qwen3_next"], cfg, use_remove_padding=not padded, lora_rank=4
        )
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():  # trained adapters: B away from its zero start
            for name, p in engine.module.named_parameters():
                if "lora_B" in name:
                    local = p.to_local() if hasattr(p, "to_local") else p
                    local.copy_(0.5 * torch.randn(local.shape, generator=gen))
        out[strategy] = {}
        for no_adapter in (False, True):
            td = testing.make_batch(
                seqs, prompt_lens, tool_spans=spans, use_remove_padding=not padded
            )
            with engine.eval_mode():
                ctx = engine.disable_adapter() if no_adapter else nullcontext()
                with ctx:
                    out[strategy][no_adapter] = engine.infer_batch(td)["model_output"]["log_probs"]

    def max_diff(a, b):  # the last position has no next token
        return max(float((x[:-1] - y[:-1]).abs().max()) for x, y in zip(a.unbind(), b.unbind()))

    for no_adapter in (False, True):
        assert max_diff(out["fsdp2"][no_adapter], out["harts_fsdp2"][no_adapter]) <= 1e-5
    assert max_diff(out["harts_fsdp2"][False], out["harts_fsdp2"][True]) > 1e-2


def test_wrapped_lm_head_falls_back(verl_cpu):
    """A LoRA adapter or peft's modules_to_save copy wrapping the LM head would bypass the
    compact log-prob kernel: such a batch takes the stock path, with the reason named."""
    from harts_verl.workers.engine import _causal_lm_of

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=4)
    engine = testing.build_engine(paths["qwen2"], testing.actor_config(), lora_rank=2)
    td = testing.make_batch(seqs, prompt_lens, tool_spans=spans)
    longest = max(map(len, seqs))
    assert engine._local_fallback_reasons(td, longest, True) == {}
    lm = _causal_lm_of(engine.module)
    head = lm.lm_head
    lm.lm_head = torch.nn.Sequential(head)  # stands in for peft's wrapper
    try:
        reasons = engine._local_fallback_reasons(td, longest, True)
    finally:
        lm.lm_head = head
    assert set(reasons) == {"lm_head"} and "Sequential" in reasons["lm_head"]


@pytest.mark.parametrize(
    ("kind", "impl", "dropped"),
    [
        ("gpt_oss", "flash_attention_2", "attention sinks"),
        ("gemma2", "sdpa", "attention logit soft-cap (attn_logit_softcapping)"),
    ],
)
def test_audit_with_an_attention_term_dropping_kernel(verl_cpu, kind, impl, dropped):
    """gpt-oss configured for flash attention (whose kernel takes no sinks, so HF's stock forward
    drops them), Gemma 2 for sdpa (transformers' sdpa path ignores the attention soft-cap): the
    engine names what the kernel drops, and the audit's stock reference runs eager attention
    (padded for gpt-oss), so it stays exact against tree mode, which always applies both."""
    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _multiturn_batch(seed=6)
    cfg = testing.actor_config(harts={"audit_every": 1, "audit_trajectories": 3})
    engine = testing.build_engine(paths[kind], cfg)
    config = engine.module.config
    saved = config._attn_implementation_internal
    assert engine._attention_term_dropped() is None  # eager, as built
    config._attn_implementation_internal = impl
    try:
        assert engine._attention_term_dropped() == dropped
        with engine.train_mode():  # the audit runs on training calls
            out = engine.train_batch(
                testing.make_batch(seqs, prompt_lens, tool_spans=spans),
                loss_function=partial(_ppo_loss(), config=cfg),
            )
        assert config._attn_implementation_internal == impl  # restored
    finally:
        config._attn_implementation_internal = saved
    assert out["metrics"]["harts/fallback"] == [0.0]
    # max |Δ log-prob| in fp32 over log-probs down to about -8: a few ulps there (without the
    # eager reference it is > 0.1)
    assert 0.0 <= out["metrics"]["harts/audit"][0] <= 4e-6


def test_parity_sliding_window(verl_cpu, tmp_path):
    """Mistral with a 6-token sliding window (shorter than every trajectory): the tree path
    windows each row's ancestor path; the stock engine's packed sdpa path its sliding mask."""
    import transformers

    testing, _ = verl_cpu
    cfg = testing.tiny_hf_config("mistral")
    cfg.sliding_window = 6
    torch.manual_seed(3)
    transformers.MistralForCausalLM(cfg).float().save_pretrained(str(tmp_path / "m"))
    data = _multiturn_batch(seed=11)
    ref = _run(testing, str(tmp_path / "m"), "fsdp2", data, loss_mode="vanilla")
    tree = _run(
        testing,
        str(tmp_path / "m"),
        "harts_fsdp2",
        data,
        loss_mode="vanilla",
        harts={"capacity_tokens": 48},
    )
    _compare(ref, tree)


def _save_variant(testing, kind: str, path, **overrides) -> str:
    import transformers

    cfg = testing.tiny_hf_config(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(3)
    cls = getattr(transformers, type(testing.tiny_hf_model(kind)).__name__)
    cls(cfg).float().save_pretrained(str(path))
    return str(path)


def test_parity_with_router_logits_requested(verl_cpu, tmp_path):
    """A checkpoint saved with ``output_router_logits = True`` (Qwen3-MoE): HF's load-balancing
    loss must not read the tree-mode mask; veRL's losses ignore the aux loss either way."""
    testing, _ = verl_cpu
    path = _save_variant(testing, "qwen3_moe", tmp_path / "m", output_router_logits=True)
    data = _grpo_batch(seed=5)
    ref = _run(testing, path, "fsdp2", data, loss_mode="vanilla")
    tree = _run(testing, path, "harts_fsdp2", data, loss_mode="vanilla")
    _compare(ref, tree)


def test_length_dependent_rope_falls_back(verl_cpu, tmp_path):
    """Dynamic-NTK rope beyond the original context has no exact tree form: such a batch takes
    the stock path (and equals it), with the reason counted in ``harts/fallback``."""
    testing, _ = verl_cpu
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    path = _save_variant(
        testing, "llama", tmp_path / "m", rope_parameters=rope, max_position_embeddings=16
    )
    seqs, prompt_lens, spans = _grpo_batch(seed=2)
    cfg = testing.actor_config(strategy="harts_fsdp2")
    engine = testing.build_engine(path, cfg)
    assert engine._rope_limit == ("dynamic", 15)
    with engine.eval_mode():
        out = engine.infer_batch(testing.make_batch(seqs, prompt_lens, tool_spans=spans))
    assert out["metrics"]["harts/fallback"] == [1.0]
    assert out["model_output"]["log_probs"].size(0) == len(seqs)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_next"])
@pytest.mark.parametrize("loss_mode", ["gspo", "cispo"])
def test_parity_loss_modes(verl_cpu, kind, loss_mode):
    testing, paths = verl_cpu
    data = _multiturn_batch(seed=7)
    padded = kind in HYBRIDS
    ref = _run(
        testing, paths[kind], "fsdp2", data, loss_mode=loss_mode, padded=padded, entropy=0.01
    )
    tree = _run(testing, paths[kind], "harts_fsdp2", data, loss_mode=loss_mode, entropy=0.01)
    _compare(ref, tree)


@pytest.mark.parametrize(
    "loss_mode,fields",
    [
        ("gpg", {}),
        ("sapo", {}),
        ("dppo_tv", {}),
        ("dppo_kl", {}),
        ("dro", {"policy_loss": {"loss_mode": "dro", "dro_beta": 0.1}}),
        ("vanilla", {"clip_ratio_c": 1.5, "clip_ratio_low": 0.1, "clip_ratio_high": 0.28}),
    ],
)
def test_parity_more_policy_losses(verl_cpu, loss_mode, fields):
    """veRL's other policy losses (GPG, SAPO, DPPO-TV / -KL, DRO) and the dual-clip PPO loss
    with a low ``clip_ratio_c`` and asymmetric clip ratios (its lower clip engaged), with an
    entropy bonus, at a token budget that cuts the batch into several micro-batches."""
    testing, paths = verl_cpu
    data = _random_batch(seed=0)  # 9 trajectories, 174 tokens
    run = partial(
        _run,
        testing,
        paths["qwen2"],
        batch=data,
        loss_mode=loss_mode,
        entropy=0.01,
        max_token_len=64,
    )
    ref = run(strategy="fsdp2", **fields)
    tree = run(strategy="harts_fsdp2", **fields)
    _compare(ref, tree)
    assert tree[1]["harts/microbatches"][0] >= 2
    if "clip_ratio_c" in fields:
        assert ref[1]["actor/pg_clipfrac_lower"].aggregate() > 0


@pytest.mark.parametrize("micro_batch_size", [1, 3])
@pytest.mark.parametrize(
    "loss_agg_mode", ["token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_parity_fixed_micro_batches(verl_cpu, loss_agg_mode, micro_batch_size):
    """Fixed-size micro-batches (``use_dynamic_bsz`` false, ``ppo_micro_batch_size_per_gpu`` 1
    or an odd 3 that divides the batch) with the sum aggregations (``seq-mean-token-sum-norm``
    without ``loss_scale_factor`` depends on the cut: evaluated on veRL's micro-batches)."""
    testing, paths = verl_cpu
    data = _random_batch(seed=0)  # 9 trajectories
    assert len(data[0]) % micro_batch_size == 0
    run = partial(
        _run,
        testing,
        paths["qwen2"],
        batch=data,
        loss_mode="vanilla",
        loss_agg_mode=loss_agg_mode,
        entropy=0.01,
        micro_batch_size=micro_batch_size,
    )
    ref, tree = run(strategy="fsdp2"), run(strategy="harts_fsdp2")
    _compare(ref, tree)
    assert tree[1]["harts/stock_metrics"] == [1.0]


def _train_worker(engine, cfg):
    """veRL's ``TrainingWorker.train_mini_batch`` / ``train_batch`` (undecorated) on a stand-in
    worker holding ``engine``: the loop over mini-batches and PPO epochs that the trainer's
    ``update_actor`` runs, with veRL's loss of ``cfg``."""
    import inspect

    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    w = types.SimpleNamespace(
        engine=engine,
        engine_config=engine.engine_config,
        model_config={"use_remove_padding": True, "use_fused_kernels": False},
        loss_fn=partial(ppo_loss, config=cfg),
        device_name="cpu",
        flops_counter=None,
        enable_routing_replay=False,
        profiler=types.SimpleNamespace(step=lambda: None),
    )
    train = inspect.unwrap(TrainingWorker.train_batch)
    w.train_batch = lambda td: train(w, td)
    w._postprocess_output = partial(TrainingWorker._postprocess_output, w)
    mini = inspect.unwrap(TrainingWorker.train_mini_batch)
    return lambda td: mini(w, td)


def test_ppo_epochs_and_checkpoint_resume(verl_cpu, tmp_path):
    """``ppo_epochs`` = 2 with shuffled mini-batches through veRL's worker loop (each epoch
    re-cuts the batch; every call plans its own trees): the metrics of every update and the
    parameters equal the stock engine's. Then a checkpoint (``save_checkpoint``, AdamW state,
    LR scheduler) loaded into a fresh engine continues exactly as the uninterrupted run."""
    from verl.utils import tensordict_utils as tu

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _random_batch(seed=10)  # 8 trajectories

    def update(step):
        td = testing.make_batch(seqs, prompt_lens, tool_spans=spans, calculate_entropy=True)
        tu.assign_non_tensor(
            td,
            global_batch_size=4,
            mini_batch_size=4,
            epochs=2,
            seed=42,
            dataloader_kwargs={"shuffle": True},
        )
        return tu.get(step(td), "metrics")

    def engine(strategy, **optim):
        harts = {"capacity_tokens": 48} if strategy == "harts_fsdp2" else None
        cfg = testing.actor_config(
            strategy=strategy, harts=harts, entropy_coeff=0.01, ppo_epochs=2, **optim
        )
        eng = testing.build_engine(paths["qwen2"], cfg)
        return eng, _train_worker(eng, cfg)

    out = {}
    for strategy in ("fsdp2", "harts_fsdp2"):
        eng, step = engine(strategy)
        out[strategy] = update(step), _params(eng)
    (m_ref, p_ref), (m_tree, p_tree) = out["fsdp2"], out["harts_fsdp2"]
    assert len(m_ref["grad_norm"]) == 4  # 2 mini-batches x 2 epochs
    assert m_tree["harts/fallback"] == [0.0] * 4
    for key, ref in m_ref.items():
        if not key.startswith("perf/"):
            np.testing.assert_allclose(m_tree[key], ref, rtol=1e-6, atol=1e-7, err_msg=key)
    for n in p_ref:
        assert float((p_tree[n] - p_ref[n]).abs().max()) <= 1e-6, n

    adam = dict(optimizer="AdamW", lr=1e-3, weight_decay=0.01)
    eng, step = engine("harts_fsdp2", **adam)
    update(step)
    eng.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
    m_full = update(step)
    resumed, step2 = engine("harts_fsdp2", **adam)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    m_resumed = update(step2)
    assert m_resumed["grad_norm"] == m_full["grad_norm"]
    assert m_resumed["harts/fallback"] == [0.0] * 4
    full, again = _params(eng), _params(resumed)
    for n in full:
        assert torch.equal(again[n], full[n]), n


@pytest.mark.parametrize(
    "kind,kl_loss_type,loss_agg_mode",
    [("qwen2", "low_var_kl", "token-mean"), ("qwen3_next", "k3+", "seq-mean-token-mean")],
)
def test_parity_kl_loss_and_rollout_is_weights(verl_cpu, kind, kl_loss_type, loss_agg_mode):
    """veRL's KL loss against ``ref_log_prob`` (``use_kl_loss``) and rollout-correction
    ``rollout_is_weights``, per-token fields the tree micro-batches carry for each trajectory:
    log-probs, gradient norm, the KL loss and the step equal the stock engine's, also at a
    token budget that cuts the batch into several micro-batches."""
    testing, paths = verl_cpu
    data = _random_batch(seed=10)  # 8 trajectories, 246 tokens (136 compact), tool spans
    for max_token_len in (4096, 64):
        run = partial(
            _run,
            testing,
            paths[kind],
            batch=data,
            loss_mode="vanilla",
            loss_agg_mode=loss_agg_mode,
            entropy=0.01,
            max_token_len=max_token_len,
            kl_loss_type=kl_loss_type,
            ref_log_probs=True,
            rollout_is_weights=True,
        )
        ref = run(strategy="fsdp2", padded=kind in HYBRIDS)
        tree = run(strategy="harts_fsdp2")
        _compare(ref, tree)
        assert (sum(tree[1]["harts/microbatches"]) > 1) == (max_token_len == 64)
        kl_ref, kl_tree = (out[1]["kl_loss"].aggregate() for out in (ref, tree))
        assert kl_ref > 1e-3  # the reference differs from the policy
        np.testing.assert_allclose(kl_tree, kl_ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_next"])
def test_sum_pi_squared_parity(verl_cpu, kind):
    """``calculate_sum_pi_squared`` (veRL's optimal-token-baseline estimators): the tree engine
    returns ``sum_pi_squared`` equal to the stock engine's (≤ 1e-6, float32), in tree mode."""
    from verl.utils import tensordict_utils as tu

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _multiturn_batch(seed=5)
    outs = {}
    for strategy in ("fsdp2", "harts_fsdp2"):
        padded = strategy == "fsdp2" and kind in HYBRIDS
        engine = testing.build_engine(
            paths[kind], testing.actor_config(strategy=strategy), use_remove_padding=not padded
        )
        td = testing.make_batch(
            seqs,
            prompt_lens,
            tool_spans=spans,
            temperature=0.8,
            calculate_entropy=True,
            use_remove_padding=not padded,
        )
        tu.assign_non_tensor(td, calculate_sum_pi_squared=True)
        with engine.eval_mode():
            outs[strategy] = engine.infer_batch(td)
    assert outs["harts_fsdp2"]["metrics"]["harts/fallback"] == [0.0]
    ref, tree = (outs[k]["model_output"] for k in ("fsdp2", "harts_fsdp2"))
    for key in ("log_probs", "entropy", "sum_pi_squared"):
        for a, b in zip(ref[key].unbind(), tree[key].unbind(), strict=True):
            assert a.shape == b.shape  # float32: ≤ 1e-6 relative to max(1, |value|)
            err = (a[:-1] - b[:-1]).abs() / a[:-1].abs().clamp_min(1.0)
            assert float(err.max()) <= 1e-6, key
    for sq in tree["sum_pi_squared"].unbind():  # a distribution over VOCAB tokens
        assert 1 / VOCAB - 1e-7 <= float(sq[:-1].min()) and float(sq[:-1].max()) <= 1.0


def test_distillation_and_sequence_parallel_fall_back(verl_cpu):
    """Top-k distillation reads full logits through veRL's logits processor: stock path. Under
    Ulysses SP the SP ranks share tree micro-batches, each trajectory whole on one rank: a batch
    with a trajectory longer than one rank's token budget takes the stock (slicing) path; the
    fixed-size budget is one rank's share of a stock micro-batch."""
    from verl.utils import tensordict_utils as tu

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=2)
    engine = testing.build_engine(paths["qwen2"], testing.actor_config())
    td = testing.make_batch(seqs, prompt_lens, tool_spans=spans)
    longest = max(map(len, seqs))
    assert engine._local_fallback_reasons(td, longest, True) == {}
    tu.assign_non_tensor(td, distillation_use_topk=True)
    reasons = engine._local_fallback_reasons(td, longest, True)
    assert "distillation_use_topk" in reasons["distillation"]
    engine.ulysses_sequence_parallel_size = 2
    assert set(engine._local_fallback_reasons(td, longest, False)) == {"distillation"}
    tu.assign_non_tensor(td, max_token_len_per_gpu=longest - 1)
    reasons = engine._local_fallback_reasons(td, longest, False)
    assert set(reasons) == {"distillation", "sequence_parallel"}
    assert f"trajectory of {longest} tokens" in reasons["sequence_parallel"]
    assert f"({longest - 1})" in reasons["sequence_parallel"]
    tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=3)
    assert engine._capacity(td, longest) == -(-3 * longest // 2)
    assert "sequence_parallel" not in engine._local_fallback_reasons(td, longest, False)
    tu.assign_non_tensor(td, micro_batch_size_per_gpu=1)  # half a trajectory per rank
    assert "sequence_parallel" in engine._local_fallback_reasons(td, longest, False)
    engine.ulysses_sequence_parallel_size = 1


def test_topk_distillation_fallback_runs_the_stock_loss(verl_cpu):
    """The fallback batch of top-k distillation trains as stock fsdp2 does: veRL's loss branches
    on the bound actor config's literal strategy name, which was ``harts_fsdp2`` there
    (NotImplementedError at the first update)."""
    from verl.trainer.distillation.losses import distillation_ppo_loss
    from verl.utils import tensordict_utils as tu
    from verl.workers.config.distillation import DistillationConfig, DistillationLossConfig

    testing, paths = verl_cpu
    seqs, prompt_lens, _ = _grpo_batch(seed=2)
    dc = DistillationConfig(
        enabled=False,
        distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk", topk=2, use_policy_gradient=False, use_task_rewards=False
        ),
    )

    def nested(ts):
        return torch.nested.as_nested_tensor(ts, layout=torch.jagged)

    metrics = {}
    for strategy in ("fsdp2", "harts_fsdp2"):
        cfg = testing.actor_config(strategy=strategy)
        engine = testing.build_engine(paths["qwen2"], cfg)
        td = testing.make_batch(seqs, prompt_lens)
        td["teacher_logprobs"] = nested([torch.log(torch.full((len(q), 2), 0.4)) for q in seqs])
        td["teacher_ids"] = nested([torch.tensor([[1, 2]] * len(q)) for q in seqs])
        tu.assign_non_tensor(td, distillation_use_topk=True, distillation_only=True)
        loss = partial(distillation_ppo_loss, config=cfg, distillation_config=dc)
        metrics[strategy] = engine.train_batch(td, loss_function=loss)["metrics"]
        assert cfg.strategy == strategy  # the caller's config is left as it was
    ref, tree = metrics["fsdp2"], metrics["harts_fsdp2"]
    assert tree["harts/fallback"] == [1.0]
    assert tree["grad_norm"] == ref["grad_norm"] and ref["grad_norm"] > 0


def test_split_dependent_losses_are_named(verl_cpu, caplog):
    """Losses whose value depends on the micro-batching (per-micro-batch padded width,
    covariance selection, means over a micro-batch) are named, and once in a WARNING when they
    are evaluated on tree micro-batches; the others are not."""
    from harts_verl.workers.engine import split_dependent_loss

    testing, paths = verl_cpu
    loss = lambda cfg: partial(_ppo_loss(), config=cfg)  # noqa: E731
    assert split_dependent_loss(loss(testing.actor_config())) is None
    assert split_dependent_loss(lambda **kw: None) is None
    norm = testing.actor_config(loss_agg_mode="seq-mean-token-sum-norm")
    assert "loss_scale_factor" in split_dependent_loss(loss(norm))
    # the config bound by position (``partial(value_loss, cfg)``) is found too
    assert "loss_scale_factor" in split_dependent_loss(partial(_ppo_loss(), norm))
    assert split_dependent_loss(partial(_ppo_loss(), testing.actor_config())) is None
    assert split_dependent_loss(partial(print, norm)) is None  # no signature to bind
    for mode in ("kl_cov", "clip_cov", "geo_mean"):
        assert mode in split_dependent_loss(loss(testing.actor_config(loss_mode=mode)))
    # bypass_mode: only the per-micro-batch normalization of the IS weights depends on the cut
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config.actor import PolicyLossConfig

    for normalize in (False, True):
        rc = RolloutCorrectionConfig(
            rollout_is="sequence", rollout_is_batch_normalize=normalize, bypass_mode=True
        )
        cfg = types.SimpleNamespace(
            loss_agg_mode="token-mean",
            policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc),
        )
        why = split_dependent_loss(loss(cfg))
        assert (why is not None and "rollout_is_batch_normalize" in why) == normalize, why

    seqs, prompt_lens, spans = _grpo_batch(seed=3)  # evaluated on tree micro-batches: named
    norm = testing.actor_config(
        loss_agg_mode="seq-mean-token-sum-norm", harts={"split_dependent_losses": "tree"}
    )
    engine = testing.build_engine(paths["qwen2"], norm)
    with caplog.at_level("WARNING"), engine.train_mode():
        for _ in range(2):
            out = engine.train_batch(
                testing.make_batch(seqs, prompt_lens, tool_spans=spans), loss_function=loss(norm)
            )
    assert out["metrics"]["harts/fallback"] == [0.0]
    assert sum("seq-mean-token-sum-norm" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    "kind,loss_mode,loss_agg_mode",
    [
        ("qwen2", "geo_mean", "token-mean"),
        ("qwen2", "clip_cov", "token-mean"),
        ("qwen3_next", "kl_cov", "token-mean"),
        ("qwen3_next", "vanilla", "seq-mean-token-sum-norm"),
    ],
)
def test_split_dependent_losses_match_stock(verl_cpu, caplog, kind, loss_mode, loss_agg_mode):
    """A loss that depends on the micro-batching is evaluated on veRL's own micro-batches
    (``harts.split_dependent_losses: stock``, the default): log-probs, gradient norm and the
    step equal the stock engine's at a token budget that cuts the batch into several
    micro-batches; with ``tree`` the loss sees the tree micro-batches (a WARNING), and the step
    differs (so the comparison can fail)."""
    testing, paths = verl_cpu
    data = _grpo_batch(seed=2)
    run = partial(
        _run,
        testing,
        paths[kind],
        batch=data,
        loss_mode=loss_mode,
        loss_agg_mode=loss_agg_mode,
        entropy=0.01,
        max_token_len=64,
    )
    ref = run(strategy="fsdp2", padded=kind in HYBRIDS)
    with caplog.at_level("WARNING"):
        tree = run(strategy="harts_fsdp2")
    assert not [r for r in caplog.records if "micro-batch" in r.getMessage()]
    assert tree[1]["harts/stock_split_loss"] == [1.0]
    _compare(ref, tree)
    if loss_mode == "geo_mean":
        with caplog.at_level("WARNING"):
            other = run(strategy="harts_fsdp2", harts={"split_dependent_losses": "tree"})
        assert other[1]["harts/stock_split_loss"] == [0.0]
        assert any("split_dependent_losses=tree" in r.getMessage() for r in caplog.records)
        gr, gt = ref[1]["grad_norm"], other[1]["grad_norm"]
        assert abs(gr - gt) > 1e-3 * abs(gr), (gr, gt)


@pytest.mark.parametrize(
    "loss_mode,loss_agg_mode", [("geo_mean", "token-mean"), ("vanilla", "seq-mean-token-sum-norm")]
)
def test_split_dependent_loss_of_an_evaluation_call_matches_stock(
    verl_cpu, loss_mode, loss_agg_mode
):
    """``infer_batch`` with a loss function (an evaluation call, no gradient) evaluates a loss
    that depends on the micro-batching on veRL's own micro-batches too: the per-micro-batch
    losses and the log-probs are the stock engine's."""
    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=2)
    outs = {}
    for strategy in ("fsdp2", "harts_fsdp2"):
        cfg = testing.actor_config(
            strategy=strategy, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode, max_token_len=64
        )
        engine = testing.build_engine(paths["qwen2"], cfg)
        td = testing.make_batch(seqs, prompt_lens, tool_spans=spans, max_token_len=64)
        with engine.eval_mode():
            outs[strategy] = engine.infer_batch(td, loss_function=partial(_ppo_loss(), config=cfg))
    ref, tree = outs["fsdp2"], outs["harts_fsdp2"]
    assert tree["metrics"]["harts/stock_split_loss"] == [1.0]
    assert len(ref["loss"]) >= 2  # the budget cuts the batch
    np.testing.assert_allclose(tree["loss"], ref["loss"], rtol=1e-5, atol=1e-7)
    for a, b in zip(
        ref["model_output"]["log_probs"].unbind(),
        tree["model_output"]["log_probs"].unbind(),
        strict=True,
    ):
        assert float((a[:-1] - b[:-1]).abs().max()) <= 1e-6


def test_a_user_registered_policy_loss_runs_on_verls_micro_batches(verl_cpu, monkeypatch, caplog):
    """A policy loss the user registers with veRL (``register_policy_loss``) may normalize per
    micro-batch, as this one does (the micro-batch's own token mean): whether it depends on the
    micro-batching is unknown, so it is evaluated on veRL's own micro-batches. It used to run on
    the tree micro-batches as a loss that does not depend on them: grad_norm 1.4566 for stock's
    1.6649 and the step 1e-2 away, while the metrics replayed on veRL's micro-batches read as
    stock's. veRL's built-in losses other than the named ones stay on the tree micro-batches."""
    import verl.utils.torch_functional as verl_F
    from verl.trainer.ppo import core_algos

    from harts_verl.workers.engine import split_dependent_loss

    def micro_batch_token_mean(old_log_prob, log_prob, advantages, response_mask, *_, **__):
        ratio = torch.exp(log_prob - old_log_prob)
        return verl_F.masked_mean(-advantages * ratio, response_mask), {}

    testing, paths = verl_cpu
    loss = lambda cfg: partial(_ppo_loss(), config=cfg)  # noqa: E731
    for mode in ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "cispo"):
        assert split_dependent_loss(loss(testing.actor_config(loss_mode=mode))) is None, mode
    dro = testing.actor_config(policy_loss={"loss_mode": "dro", "dro_beta": 0.1})
    assert split_dependent_loss(loss(dro)) is None
    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "mb_token_mean", micro_batch_token_mean)
    why = split_dependent_loss(loss(testing.actor_config(loss_mode="mb_token_mean")))
    assert why is not None and "'mb_token_mean'" in why
    # registered under one of veRL's names, it replaces veRL's loss: the user's all the same
    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "gpg", micro_batch_token_mean)
    why = split_dependent_loss(loss(testing.actor_config(loss_mode="gpg")))
    assert why is not None and "'gpg'" in why
    run = partial(
        _run,
        testing,
        paths["qwen2"],
        batch=_random_batch(seed=0),
        loss_mode="mb_token_mean",
        max_token_len=37,
    )
    ref = run(strategy="fsdp2")
    with caplog.at_level(logging.INFO, logger="harts_verl.workers.engine"):
        tree = run(strategy="harts_fsdp2")
    _compare(ref, tree)
    assert tree[1]["harts/microbatches"][0] >= 2
    assert tree[1]["harts/stock_split_loss"] == [1.0]
    said = [r.getMessage() for r in caplog.records if "veRL's own micro-batches" in r.getMessage()]
    assert len(said) == 1 and "'mb_token_mean'" in said[0]  # once, with the reason


def test_fixed_micro_batch_size_bounds_capacity(verl_cpu):
    """``use_dynamic_bsz`` false: no tree micro-batch holds more rows than a stock micro-batch
    of ``micro_batch_size_per_gpu`` trajectories could; outputs equal the stock engine's."""
    from verl.utils import tensordict_utils as tu

    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=4)
    outs, caps = {}, []
    for strategy in ("fsdp2", "harts_fsdp2"):
        engine = testing.build_engine(paths["qwen2"], testing.actor_config(strategy=strategy))
        if strategy == "harts_fsdp2":
            engine._plan = partial(
                lambda plan, forest, cap: caps.append(cap) or plan(forest, cap), engine._plan
            )
        td = testing.make_batch(seqs, prompt_lens, tool_spans=spans, calculate_entropy=True)
        tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        with engine.eval_mode():
            outs[strategy] = engine.infer_batch(td)
    tree = outs["harts_fsdp2"]
    assert caps == [max(map(len, seqs))]
    assert tree["metrics"]["harts/fallback"] == [0.0]
    assert tree["metrics"]["harts/microbatches"][0] >= 2  # two trees, each near the cap
    # no loss function: the placeholder 1.0 per tree micro-batch (stock: per veRL micro-batch;
    # documented in docs/verl.md)
    assert outs["fsdp2"]["loss"] == [1.0] * len(seqs)
    assert tree["loss"] == [1.0] * int(tree["metrics"]["harts/microbatches"][0])
    for key in ("log_probs", "entropy"):
        for a, b in zip(
            outs["fsdp2"]["model_output"][key].unbind(),
            tree["model_output"][key].unbind(),
            strict=True,
        ):
            assert float((a[:-1] - b[:-1]).abs().max()) <= 1e-6, key


def test_dropout_added_after_build_is_seen(verl_cpu):
    """veRL wraps LoRA adapters (whose dropout counts) after the module is built: the engine
    looks at the module as it trains, on first use."""
    testing, paths = verl_cpu
    engine = testing.build_engine(paths["qwen2"], testing.actor_config())
    seqs, prompt_lens, spans = _grpo_batch(seed=2)
    td = testing.make_batch(seqs, prompt_lens, tool_spans=spans)
    longest = max(map(len, seqs))
    assert engine._local_fallback_reasons(td, longest, False) == {}
    engine._dropout = False  # as built, before a wrapper adds dropout
    engine.module.lora_dropout = torch.nn.Dropout(0.05)
    reasons = engine._local_fallback_reasons(td, longest, False)
    assert "p = 0.05" in reasons["dropout"]
    assert engine._local_fallback_reasons(td, longest, True) == {}  # inference: no dropout


def test_dropout_in_training_is_named():
    """Dropout draws one mask per row, which a shared row would share across trajectories:
    training such a model in tree mode is refused by name (inference is unaffected)."""
    from types import SimpleNamespace

    from harts_verl.workers.engine import _dropout_reason

    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))
    assert _dropout_reason(plain) is None
    assert "p = 0.1" in _dropout_reason(torch.nn.Sequential(torch.nn.Dropout(0.1)))
    attn = torch.nn.Linear(2, 2)
    attn.config = SimpleNamespace(text_config=SimpleNamespace(attention_dropout=0.2))
    assert "attention_dropout = 0.2" in _dropout_reason(attn)
    seed_oss = torch.nn.Linear(2, 2)  # Seed-OSS draws residual dropout from its config
    seed_oss.config = SimpleNamespace(attention_dropout=0.0, residual_dropout=0.1)
    assert (
        _dropout_reason(seed_oss)
        == "residual_dropout = 0.1 in training (a shared row would share its dropout mask)"
    )


def test_fallback_and_audit(verl_cpu):
    """Below ``min_compression`` the batch takes the stock path (counted; every micro-batch
    through veRL's own step, never the tree step); the audit compares tree and stock log-probs
    every ``audit_every`` calls."""
    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=1)
    cfg = testing.actor_config(harts={"min_compression": 100.0})
    engine = testing.build_engine(paths["qwen2"], cfg)
    tree_steps = []
    tree_step = engine._tree_forward_step
    engine._tree_forward_step = lambda *a, **k: tree_steps.append(1) or tree_step(*a, **k)
    with engine.eval_mode():
        out = engine.infer_batch(testing.make_batch(seqs, prompt_lens, tool_spans=spans))
    assert out["metrics"]["harts/fallback"] == [1.0]
    assert out["model_output"]["log_probs"].size(0) == len(seqs)
    assert not tree_steps

    # the audit counts training calls, the ones whose metrics veRL's trainer logs (a log-prob
    # call's audit was computed and dropped): a veRL step is a log-prob call, then an update
    cfg = testing.actor_config(harts={"audit_every": 2, "audit_trajectories": 3})
    engine = testing.build_engine(paths["qwen2"], cfg)
    audits = []
    for _ in range(2):
        with engine.eval_mode():
            out = engine.infer_batch(testing.make_batch(seqs, prompt_lens, tool_spans=spans))
        assert "harts/audit" not in out["metrics"]
        with engine.train_mode():
            out = engine.train_batch(
                testing.make_batch(seqs, prompt_lens, tool_spans=spans),
                loss_function=partial(_ppo_loss(), config=cfg),
            )
        assert out["metrics"]["harts/fallback"] == [0.0]
        audits.append(out["metrics"].get("harts/audit"))
    assert audits[0] is None
    assert audits[1] is not None and 0.0 <= audits[1][0] <= 1e-6


def test_position_ids_other_than_depths_run_on_the_stock_path(verl_cpu, caplog):
    """Tree mode places every row at its depth: a trajectory whose ``position_ids`` are not
    ``0..L-1`` (packed, restarting or shifted: a custom agent loop) takes the stock path, which
    feeds them to the model, and gives stock's numbers (merged with its token-identical sibling,
    it got depths instead: 6e-2 off, silently)."""
    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=1)
    batch = testing.make_batch(seqs, prompt_lens, tool_spans=spans)
    pos = [t.clone() for t in batch["position_ids"].unbind()]
    pos[1][3:] += 5
    batch["position_ids"] = torch.nested.as_nested_tensor(pos, layout=torch.jagged)
    out = {}
    for strategy in ("fsdp2", "harts_fsdp2"):
        engine = testing.build_engine(paths["qwen2"], testing.actor_config(strategy=strategy))
        with caplog.at_level(logging.WARNING), engine.eval_mode():
            out[strategy] = engine.infer_batch(batch.clone())
    assert out["harts_fsdp2"]["metrics"]["harts/fallback"] == [1.0]
    assert "position_ids of trajectory 1 are not 0.." in caplog.text
    for a, b in zip(
        out["fsdp2"]["model_output"]["log_probs"].unbind(),
        out["harts_fsdp2"]["model_output"]["log_probs"].unbind(),
    ):
        assert float((a - b).abs().max()) <= 1e-6


def test_position_ids_reason_layouts():
    """0..L-1 per trajectory passes in veRL's layouts (nested 1-D, nested mrope ``[bsz, 4, j]``,
    dense rows); the first trajectory and token that differ are named; a count mismatch too."""
    from tensordict import TensorDict

    from harts_verl.workers.engine import _position_ids_reason

    lens = (5, 3, 7)
    ids = torch.nested.as_nested_tensor([torch.arange(n) for n in lens], layout=torch.jagged)

    def batch(pos, input_ids=ids):
        return TensorDict({"input_ids": input_ids, "position_ids": pos}, batch_size=len(lens))

    def nested(ts):
        return torch.nested.as_nested_tensor(ts, layout=torch.jagged)

    assert _position_ids_reason(TensorDict({"input_ids": ids}, batch_size=3)) is None
    assert _position_ids_reason(batch(nested([torch.arange(n) for n in lens]))) is None
    mrope = [torch.arange(n).expand(4, n).clone() for n in lens]
    assert _position_ids_reason(batch(nested(mrope))) is None
    assert _position_ids_reason(batch(nested([m.T.contiguous() for m in mrope]))) is None
    mrope[2][3, 4] = 9  # one mrope row of trajectory 2, token 4
    why = _position_ids_reason(batch(nested(mrope)))
    assert why.startswith("position_ids of trajectory 2 are not 0..6 (token 4 is at [4, 4, 4, 9])")
    shifted = [torch.arange(n) + (i == 0) for i, n in enumerate(lens)]  # a uniform shift too
    assert "trajectory 0 are not 0..4 (token 0 is at 1)" in _position_ids_reason(
        batch(nested(shifted))
    )
    dense = torch.arange(4).expand(3, 4)
    assert _position_ids_reason(batch(dense, input_ids=torch.zeros(3, 4, dtype=torch.long))) is None
    assert "do not hold one position (per row) for each of the 15" in _position_ids_reason(
        batch(nested([torch.arange(4)] * 3))
    )
    # a pickled batch can carry [bsz, 4, j] with the wrong ragged index: told apart by shape
    wrong = nested([m.T.contiguous() for m in mrope])
    wrong._ragged_idx = 2
    assert "trajectory 2 are not 0..6" in _position_ids_reason(batch(wrong))
    odd = torch.zeros(3, 1, 1, 4, dtype=torch.long)  # a layout it cannot read: stock path
    why = _position_ids_reason(batch(odd, input_ids=torch.zeros(3, 4, dtype=torch.long)))
    assert "do not hold one position" in why


@pytest.mark.parametrize("kind", ["qwen3_next", "gpt_oss"])
def test_audit_where_packed_stock_forward_leaks_is_exact(verl_cpu, kind):
    """The audit's stock forward runs padded rows where the packed one mixes sequences: a
    linear-attention hybrid without fla (HF's torch fallback carries state across packed
    sequences), gpt-oss on eager attention (masks built without the packed position ids)."""
    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _multiturn_batch(seed=3)
    cfg = testing.actor_config(harts={"audit_every": 1, "audit_trajectories": 4})
    engine = testing.build_engine(paths[kind], cfg)  # packed (remove-padding) engine
    with engine.train_mode():  # the audit runs on training calls
        out = engine.train_batch(
            testing.make_batch(seqs, prompt_lens, tool_spans=spans),
            loss_function=partial(_ppo_loss(), config=cfg),
        )
    assert out["metrics"]["harts/fallback"] == [0.0]
    assert 0.0 <= out["metrics"]["harts/audit"][0] <= 1e-6


# torch.optim.AdamW's default; veRL does not set eps (betas (0.9, 0.999), weight decay 0.01).
ADAM_EPS = 1e-8


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_adamw_step_parity(verl_cpu, lr):
    """One AdamW step with veRL's optimizer defaults, Qwen3-Next.

    Gradients agree to ≤ 1e-6 × grad_norm everywhere. AdamW's first step moves each entry by
    lr·g/(|g| + eps): its sensitivity to the gradient is lr/eps (10³ at lr 1e-5) for entries
    with |g| ≲ eps, so fp32 rounding of a gradient that cancels to ~0 (some ``A_log`` /
    ``dt_bias`` entries: 1e-10 true value, 1e-9 rounding) moves the parameter by up to
    lr·|Δg|/eps. The test pins exactly that bound per entry, and |Δparam| ≤ 1e-6 at veRL's
    default actor lr 1e-6 (at lr 1e-5 one A_log entry differs by ≈1.2e-6; see
    ``test_gate_gradients_vs_float64`` for which side is closer to the exact gradient).
    """
    testing, paths = verl_cpu
    data = _grpo_batch(seed=len("qwen3_next") + len("grpo"))
    optim = dict(optimizer="AdamW", lr=lr, weight_decay=0.01)
    path = paths["qwen3_next"]
    ref = _run(testing, path, "fsdp2", data, loss_mode="vanilla", padded=True, **optim)
    harts = {"chunk_size": 8, "capacity_tokens": 48}
    tree = _run(testing, path, "harts_fsdp2", data, loss_mode="vanilla", harts=harts, **optim)
    (_, met_r, p0, p1_r, g_r), (_, met_t, p0_t, p1_t, g_t) = ref, tree
    gn = met_r["grad_norm"]
    assert abs(gn - met_t["grad_norm"]) <= 1e-6 * gn
    assert max(float((g_t[n] - g_r[n]).abs().max()) for n in g_r) <= 1e-6 * gn
    worst = 0.0
    for n in p0:
        assert torch.equal(p0_t[n], p0[n])
        dp = (p1_t[n] - p1_r[n]).abs()
        sensitivity = lr * torch.clamp((g_t[n] - g_r[n]).abs() / ADAM_EPS, max=2.0)
        rounding = lr * 1e-5 + 2 * torch.finfo(torch.float32).eps * p1_r[n].abs()
        assert bool((dp <= sensitivity + rounding).all()), n
        worst = max(worst, float(dp.max()))
    if lr <= 1e-6:
        assert worst <= 1e-6, worst


def test_gate_gradients_vs_float64(verl_cpu, monkeypatch):
    """Which side of the Qwen3-Next gate-gradient difference is rounding: both fp32 engines
    against the exact (float64) gradient of the same loss. Both are ≤ 1e-6 relative overall;
    on ``A_log`` / ``dt_bias`` the tree engine is the closer one (HF's torch fallback, which the
    stock engine runs, accumulates in-chunk log-decays over 64 tokens in fp32)."""
    import transformers
    from _hf_float64 import lift_float32_islands
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from harts_verl.runtime import TreeRunner

    testing, paths = verl_cpu
    path = paths["qwen3_next"]
    data = _grpo_batch(seed=len("qwen3_next") + len("grpo"))
    harts = {"chunk_size": 8, "capacity_tokens": 48}
    g_r = _run(testing, path, "fsdp2", data, loss_mode="vanilla", padded=True)[4]
    g_t = _run(testing, path, "harts_fsdp2", data, loss_mode="vanilla", harts=harts)[4]

    lift_float32_islands(monkeypatch)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", experts_implementation="eager"
    ).double()
    seqs, prompt_lens, spans = data
    cfg = testing.actor_config(strategy="fsdp2")
    td = testing.make_batch(seqs, prompt_lens, tool_spans=spans, temperature=0.8)
    tu.assign_non_tensor(td, batch_num_tokens=int(td["loss_mask"].sum()), dp_size=1)

    def loss_fn(lps):
        full = [torch.cat([lp, lp.new_zeros(1)]) for lp in lps]
        nested = torch.nested.as_nested_tensor(full, layout=torch.jagged)
        return ppo_loss(config=cfg, model_output={"log_probs": nested}, data=td)[0]

    TreeRunner(model, chunk_size=16).forward_backward(
        seqs, loss_fn, temperature=0.8, include_aux_loss=False
    )
    g64 = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    norm = sum(float((g**2).sum()) for g in g64.values()) ** 0.5

    def rel_err(g):
        return sum(float(((g[n].double() - g64[n]) ** 2).sum()) for n in g64) ** 0.5 / norm

    assert rel_err(g_r) <= 1e-6 and rel_err(g_t) <= 1e-6
    gates = [n for n in g64 if n.endswith(("A_log", "dt_bias"))]
    assert gates
    for n in gates:
        err_t = float((g_t[n].double() - g64[n]).abs().max())
        err_r = float((g_r[n].double() - g64[n]).abs().max())
        assert err_t <= err_r, (n, err_t, err_r)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_next"])
def test_parity_per_sample_temperatures(verl_cpu, kind):
    """veRL's per-sample temperatures (a ``[N]`` tensor; rows shared by trajectories of
    different temperatures): tree mode (no fallback) equals the stock engine — log-probs and
    entropies at inference, the training step with an entropy bonus."""
    testing, paths = verl_cpu
    data = _multiturn_batch(seed=9)
    temps = [(0.5, 1.0, 0.75)[i % 3] for i in range(len(data[0]))]
    run = partial(
        _run, testing, paths[kind], batch=data, loss_mode="vanilla", entropy=0.01, temperature=temps
    )
    ref = run(strategy="fsdp2", padded=kind in HYBRIDS)
    tree = run(strategy="harts_fsdp2", harts={"capacity_tokens": 48})
    _compare(ref, tree)
    assert tree[1]["harts/fallback"] == [0.0]
    assert tree[1]["harts/microbatches"][0] >= 2


def test_batch_temperature_validation():
    """One temperature per batch, or one per sample where they differ (veRL's per-sample
    temperatures); a non-finite or non-positive one is a ValueError naming ``temperature``."""
    from tensordict import TensorDict

    from harts_verl.workers.engine import _batch_temperature

    def batch(t):
        td = TensorDict({"input_ids": torch.zeros(2, 1)}, batch_size=[2])
        if t is not None:
            td["temperature"] = t
        return td

    assert _batch_temperature(batch(None)) == 1.0
    assert _batch_temperature(batch(torch.tensor([0.7, 0.7]))) == pytest.approx(0.7)
    per = _batch_temperature(batch(torch.tensor([0.75, 0.5])))
    assert isinstance(per, np.ndarray) and per.tolist() == [0.75, 0.5]
    for bad in (
        torch.tensor([float("nan"), 0.7]),
        torch.tensor([0.0, 0.0]),
        torch.tensor([-1.0, -1.0]),
    ):
        with pytest.raises(ValueError, match="temperature"):
            _batch_temperature(batch(bad))


def test_bad_token_ids_are_named(verl_cpu):
    """A token id outside the vocabulary is a ValueError naming the trajectory, the position
    and the vocabulary size (stock: a bare IndexError from the embedding); float ``input_ids``
    are a TypeError (never truncated to ids)."""
    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=4)
    engine = testing.build_engine(paths["qwen2"], testing.actor_config(strategy="harts_fsdp2"))
    bad = [list(s) for s in seqs]
    bad[2][30] = VOCAB
    td = testing.make_batch(bad, prompt_lens, tool_spans=spans, calculate_entropy=True)
    with engine.eval_mode(), pytest.raises(ValueError) as info:
        engine.infer_batch(td)
    assert str(info.value) == (
        f"sequences[2]: token id {VOCAB} at position 30 is outside the model's vocabulary "
        f"(size {VOCAB})"
    )
    td = testing.make_batch(seqs, prompt_lens, tool_spans=spans, calculate_entropy=True)
    ids = td["input_ids"]
    td["input_ids"] = torch.nested.nested_tensor_from_jagged(
        ids.values().to(torch.float32), ids.offsets()
    )
    with engine.eval_mode(), pytest.raises(TypeError, match="input_ids: expected integer"):
        engine.infer_batch(td)


def test_micro_batch_select_equals_verls_index_select():
    """The engine's per-batch micro-batch selection (each nested tensor unbound once) gives
    exactly veRL's ``index_select_tensor_dict``: same keys, dtypes, values, offsets and ragged
    index for nested tensors, dense rows, non-tensor stacks and scalar non-tensor data, for
    selections in any order and with repeats."""
    from tensordict import NonTensorStack, TensorDict
    from verl.utils import tensordict_utils as tu

    from harts_verl.workers.engine import _MicroBatchSelect

    rng = np.random.default_rng(0)
    n = 23
    lens = rng.integers(1, 20, n)

    def nested(parts):
        return torch.nested.nested_tensor(parts, layout=torch.jagged)

    td = TensorDict(
        {
            "input_ids": nested([torch.from_numpy(rng.integers(0, 99, k)) for k in lens]),
            "old_log_probs": nested([torch.randn(int(k), dtype=torch.float64) for k in lens]),
            "dense": torch.randn(n, 3),
        },
        batch_size=[n],
    )
    td["extra_fields"] = NonTensorStack(*[{"turns": i} for i in range(n)])
    tu.assign_non_tensor(td, temperature=0.7, use_dynamic_bsz=True)
    select = _MicroBatchSelect(td)
    for trial in range(12):
        sel = rng.choice(n, int(rng.integers(1, n)), replace=bool(trial % 2)).tolist()
        want, got = tu.index_select_tensor_dict(td, sel), select(sel)
        assert set(got.keys()) == set(want.keys()) and got.batch_size == want.batch_size
        for key in want.keys():
            a, b = got[key], want[key]
            if isinstance(b, torch.Tensor) and b.is_nested:
                assert a.is_nested and a.dtype == b.dtype
                assert torch.equal(a.values(), b.values())
                assert torch.equal(a.offsets(), b.offsets())
                assert getattr(a, "_ragged_idx", None) == getattr(b, "_ragged_idx", None)
            elif isinstance(b, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b)
            else:
                assert type(a) is type(b)
                assert (a.tolist() if hasattr(a, "tolist") else a) == (
                    b.tolist() if hasattr(b, "tolist") else b
                ), key
