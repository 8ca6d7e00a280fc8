"""``harts_fsdp2`` vs veRL's stock ``fsdp2`` engine on CPU (gloo, FSDP2, fp32, tiny models).

Parity: log-probs and entropy ≤ 1e-6, grad_norm ≤ 1e-6 relative, parameters after one AdamW
step ≤ 1e-6, on GRPO-style (shared prompt, n samples) and multi-turn tree batches (shared
turns, tool tokens masked), for a tiny Qwen2 and a tiny Qwen3-Next, with the ``vanilla``,
``gspo`` and ``cispo`` policy losses. The Qwen3-Next reference runs veRL's padded path: without
fla, HF's torch fallback would carry linear-attention state across packed sequences.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

VOCAB = 64


@pytest.fixture(scope="module")
def verl_cpu(tmp_path_factory):
    """CPU platform shim + a world-size-1 gloo group + tiny saved models (once per module)."""
    sys.modules["fla"] = None  # no fla fast paths (and no triton) in tests
    os.environ["VERL_PLATFORM"] = "harts_cpu"
    from harts_verl.workers.cpu_platform import install_cpu_platform

    install_cpu_platform()
    from harts_verl.workers import plugin, testing

    assert plugin.register()
    testing.init_process_group(port=29000 + os.getpid() % 2000)
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


BATCHES = {"grpo": _grpo_batch, "multiturn": _multiturn_batch}


def _params(engine) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }


def _run(testing, path, strategy, batch, *, loss_mode, harts=None, padded=False, entropy=0.0):
    seqs, prompt_lens, spans = batch
    cfg = testing.actor_config(
        strategy=strategy, loss_mode=loss_mode, harts=harts, entropy_coeff=entropy
    )
    engine = testing.build_engine(path, cfg, use_remove_padding=not padded)
    mk = partial(testing.make_batch, seqs, prompt_lens, tool_spans=spans, temperature=0.8)
    with engine.eval_mode():
        inf = engine.infer_batch(mk(calculate_entropy=True, use_remove_padding=not padded))
    before = _params(engine)
    with engine.train_mode():
        out = engine.train_batch(
            mk(calculate_entropy=entropy != 0.0, use_remove_padding=not padded),
            loss_function=partial(_ppo_loss(), config=cfg),
        )
    after = _params(engine)
    return inf["model_output"], out["metrics"], before, after


def _ppo_loss():
    from verl.workers.utils.losses import ppo_loss

    return ppo_loss


def _compare(ref, tree, *, tol=1e-6):
    (inf_r, met_r, p0_r, p1_r), (inf_t, met_t, p0_t, p1_t) = ref, tree
    for key in ("log_probs", "entropy"):
        for a, b in zip(inf_r[key].unbind(), inf_t[key].unbind(), strict=True):
            assert a.shape == b.shape
            assert float((a[:-1] - b[:-1]).abs().max()) <= tol, key
            assert float(b[-1]) == 0.0  # no next token at the last position
    gr, gt = met_r["grad_norm"], met_t["grad_norm"]
    assert abs(gr - gt) <= tol * abs(gr), (gr, gt)
    assert met_t["harts/fallback"] == [0.0]
    for n in p0_r:
        torch.testing.assert_close(p0_t[n], p0_r[n], rtol=0, atol=0)
        assert float((p1_t[n] - p1_r[n]).abs().max()) <= tol, n
    moved = max(float((p1_r[n] - p0_r[n]).abs().max()) for n in p0_r)
    assert moved > 1e-6  # the step did something


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_next"])
@pytest.mark.parametrize("batch", ["grpo", "multiturn"])
def test_parity_vanilla(verl_cpu, kind, batch):
    testing, paths = verl_cpu
    data = BATCHES[batch](seed=len(kind) + len(batch))
    padded = kind == "qwen3_next"
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
@pytest.mark.parametrize("loss_mode", ["gspo", "cispo"])
def test_parity_loss_modes(verl_cpu, kind, loss_mode):
    testing, paths = verl_cpu
    data = _multiturn_batch(seed=7)
    padded = kind == "qwen3_next"
    ref = _run(
        testing, paths[kind], "fsdp2", data, loss_mode=loss_mode, padded=padded, entropy=0.01
    )
    tree = _run(testing, paths[kind], "harts_fsdp2", data, loss_mode=loss_mode, entropy=0.01)
    _compare(ref, tree)


def test_fallback_and_audit(verl_cpu):
    """Below ``min_compression`` the batch takes the stock path (counted); the audit compares
    tree and stock log-probs every ``audit_every`` calls."""
    testing, paths = verl_cpu
    seqs, prompt_lens, spans = _grpo_batch(seed=1)
    cfg = testing.actor_config(harts={"min_compression": 100.0})
    engine = testing.build_engine(paths["qwen2"], cfg)
    with engine.eval_mode():
        out = engine.infer_batch(testing.make_batch(seqs, prompt_lens, tool_spans=spans))
    assert out["metrics"]["harts/fallback"] == [1.0]
    assert out["model_output"]["log_probs"].size(0) == len(seqs)

    cfg = testing.actor_config(harts={"audit_every": 2, "audit_trajectories": 3})
    engine = testing.build_engine(paths["qwen2"], cfg)
    audits = []
    for _ in range(2):
        with engine.eval_mode():
            out = engine.infer_batch(testing.make_batch(seqs, prompt_lens, tool_spans=spans))
        audits.append(out["metrics"].get("harts/audit"))
    assert audits[0] is None
    assert audits[1] is not None and 0.0 <= audits[1][0] <= 1e-6
    with engine.train_mode():
        out = engine.train_batch(
            testing.make_batch(seqs, prompt_lens, tool_spans=spans),
            loss_function=partial(_ppo_loss(), config=cfg),
        )
    assert out["metrics"]["harts/fallback"] == [0.0]
