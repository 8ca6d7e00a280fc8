"""Shared body of the multi-modal wrappers' engine tests (Qwen3.5, Gemma 3): a batch with
``multi_modal_inputs`` takes the stock path, text-only batches of the same engine run in tree
mode, both equal veRL's stock fsdp2 engine."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch


def image_batch(
    seed: int, text_vocab: int, make_image: Callable[[torch.Generator], dict]
) -> tuple[list, list, list]:
    """One prompt with an image (image-start token, 4 image tokens, image-end token; ids from
    ``TINY_IMAGE_TOKEN_ID``) and text, 3 responses (two share a prefix); each trajectory carries
    the image's vision inputs ``make_image(generator)`` (a copy of the dict each), as veRL's agent
    loop stores them. Returns (sequences, prompt lengths, multi-modal inputs)."""
    from harts_verl.workers.testing import TINY_IMAGE_TOKEN_ID as img

    rng = np.random.default_rng(seed)
    prompt = [img + 2, img, img, img, img, img + 3, *rng.integers(0, text_vocab, 9).tolist()]
    r = [rng.integers(0, text_vocab, n).tolist() for n in (10, 7, 6)]
    seqs = [prompt + r[0], prompt + r[1], prompt + r[0][:4] + r[2]]
    image = make_image(torch.Generator().manual_seed(seed))
    return seqs, [len(prompt)] * 3, [dict(image) for _ in seqs]


# The tree side of the text-batch parity tests: several micro-batches of a multi-turn tree batch.
TEXT_HARTS = {"chunk_size": 8, "capacity_tokens": 48}


def run_tree_text(testing: Any, ve: Any, path: str, data: tuple) -> tuple:
    """harts_fsdp2 on the text batch ``data`` (``TEXT_HARTS``, veRL's gradient checkpointing on:
    layers re-run in backward): ``ve._run``'s result."""
    return ve._run(
        testing,
        path,
        "harts_fsdp2",
        data,
        loss_mode="vanilla",
        harts=TEXT_HARTS,
        gradient_checkpointing=True,
    )


def check_tree_text(ve: Any, ref: tuple, tree: tuple) -> None:
    """The tree run equals the stock one (``ve._compare``: log-probs, entropy, grad norm,
    parameters after the step), in tree mode, over several micro-batches of a compressed batch."""
    ve._compare(ref, tree)
    assert tree[1]["harts/fallback"] == [0.0]
    assert tree[1]["harts/microbatches"][0] >= 2
    assert tree[1]["harts/compression"][0] > 1.0


def run_vision_engines(
    testing: Any,
    ve: Any,
    path: str,
    image_batch: tuple[list, list, list],
    text_vocab: int,
    *,
    image_calls: int = 1,
) -> dict[str, tuple]:
    """Per strategy (``fsdp2``, then ``harts_fsdp2``; padded rows, temperature 0.8): the image
    batch inferred ``image_calls`` times (a list), the same batch without its images, a text-only
    GRPO batch (tokens below ``text_vocab``), and one train step on the image batch."""
    seqs, prompt_lens, mm = image_batch
    text_seqs, text_prompt_lens, spans = ve.BATCHES["grpo"](seed=7)
    text_seqs = [[t % text_vocab for t in s] for s in text_seqs]
    mk = partial(testing.make_batch, use_remove_padding=False, temperature=0.8)
    out = {}
    for strategy in ("fsdp2", "harts_fsdp2"):
        cfg = testing.actor_config(strategy=strategy, harts={"chunk_size": 8})
        engine = testing.build_engine(path, cfg, use_remove_padding=False)
        with engine.eval_mode():
            image = [
                engine.infer_batch(mk(seqs, prompt_lens, multi_modal_inputs=mm))
                for _ in range(image_calls)
            ]
            no_image = engine.infer_batch(mk(seqs, prompt_lens))
            text = engine.infer_batch(mk(text_seqs, text_prompt_lens, tool_spans=spans))
        with engine.train_mode():
            train = engine.train_batch(
                mk(seqs, prompt_lens, multi_modal_inputs=mm),
                loss_function=partial(ve._ppo_loss(), config=cfg),
            )
        out[strategy] = image, no_image, text, train
    return out


def max_log_prob_diff(a: dict, b: dict) -> float:
    """max |Δ log-prob| over positions 0..L−2 of two engine outputs."""
    a, b = a["model_output"]["log_probs"].unbind(), b["model_output"]["log_probs"].unbind()
    return max(float((x[:-1] - y[:-1]).abs().max()) for x, y in zip(a, b, strict=True))


def check_vision_fallback(out: dict[str, tuple]) -> None:
    """Image batches (and the train step on them) take the stock path in harts_fsdp2, batches
    without images run in tree mode; every result equals the stock engine's (log-probs ≤ 1e-6,
    grad norm ≤ 1e-6 relative), and the image is in effect (dropping it moves the log-probs)."""
    (img_r, noimg_r, text_r, train_r), (img_t, noimg_t, text_t, train_t) = out.values()
    for o in (*img_t, train_t):
        assert o["metrics"]["harts/fallback"] == [1.0]
    assert text_t["metrics"]["harts/fallback"] == [0.0]
    assert noimg_t["metrics"]["harts/fallback"] == [0.0]
    assert max_log_prob_diff(img_t[0], img_r[0]) <= 1e-6
    assert max_log_prob_diff(noimg_t, noimg_r) <= 1e-6
    assert max_log_prob_diff(text_t, text_r) <= 1e-6
    assert max_log_prob_diff(img_r[0], noimg_r) > 1e-3  # the image is in the stock result
    gr, gt = train_r["metrics"]["grad_norm"], train_t["metrics"]["grad_norm"]
    assert abs(gr - gt) <= 1e-6 * abs(gr), (gr, gt)
