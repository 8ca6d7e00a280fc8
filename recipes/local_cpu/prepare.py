"""Write the local CPU recipe's inputs into a directory: a tiny Qwen3-Next (hybrid: gated
DeltaNet + gated attention, built from a config in code) with the word-level tokenizer of the
bundled calculator task, and train/val parquet files (a few dozen tasks with the agent prompt:
tool documentation and worked examples, 280 tokens, the same for every task; 288 with the
question and the generation prompt).

The model is warm-started with a short supervised fine-tuning on the task's tool-call format
(:func:`warm_start`: 16 AdamW steps on correct rollouts of random tasks, about 10 s on one CPU
thread), so that RL starts from a policy that calls the tool (mostly with wrong operands: the
reward is then 0.1, and 1.0 now and then) instead of emitting 64 random tokens: SFT, then RL.
``--sft-steps 0`` keeps the random initialisation."""

from __future__ import annotations

import argparse
import os
import time

from harts_verl.workers import testing
from harts_verl.workers.rollout import local_task


def warm_start(
    model,
    tok,
    *,
    steps: int = 16,
    batch: int = 4,
    episodes: int = 12,
    lr: float = 1e-2,
    seed: int = 0,
) -> list[float]:
    """Supervised warm-up of ``model`` in place on :func:`local_task.sft_examples` (agent prompt
    followed by ``episodes`` correct rollouts per sequence; loss on the model-generated tokens
    only), one CPU thread, deterministic given ``seed``. Returns the per-step losses."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier than 2 threads on a shared 2-core machine
    torch.manual_seed(seed)
    data = local_task.sft_examples(steps * batch, seed=seed + 2, episodes=episodes, tokenizer=tok)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    try:
        for s in range(steps):
            rows = data[s * batch : (s + 1) * batch]  # equal lengths: no padding
            ids = torch.tensor([r[0] for r in rows])
            mask = torch.tensor([r[1] for r in rows])[:, 1:].float()
            logits = model(input_ids=ids).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            ).view_as(mask)
            loss = (nll * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return losses


def prepare(
    out: str, n_train: int = 48, n_val: int = 8, kind: str = "qwen3_next", sft_steps: int = 16
) -> dict:
    """Create ``out/model`` (model + tokenizer), ``out/train.parquet``, ``out/val.parquet``."""
    model_dir = os.path.join(out, "model")
    os.makedirs(model_dir, exist_ok=True)
    tok = local_task.build_tokenizer(model_dir)
    # generation stops at <eos>; veRL reads eos/pad from the tokenizer
    assert tok.eos_token_id == local_task.VOCAB.index("<eos>")
    model = testing.tiny_hf_model(kind, seed=0, vocab_size=local_task.VOCAB_SIZE)
    # the tokenizer's special ids in the model config too (generation stops at eos)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = (
            tok.eos_token_id,
            tok.pad_token_id,
            None,
        )
    info: dict = {"model": model_dir}
    if sft_steps > 0:
        t0 = time.perf_counter()
        losses = warm_start(model, tok, steps=sft_steps)
        info["sft"] = {
            "steps": sft_steps,
            "loss_first": round(losses[0], 3),
            "loss_last": round(losses[-1], 3),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    model.save_pretrained(model_dir)
    info["train"] = local_task.write_dataset(
        os.path.join(out, "train.parquet"), n_train, seed=0, prompt="agent"
    )
    info["val"] = local_task.write_dataset(
        os.path.join(out, "val.parquet"), n_val, seed=1, prompt="agent", split="val"
    )
    return info


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--kind", default="qwen3_next")
    ap.add_argument("--sft-steps", type=int, default=16, help="warm-start steps (0: random init)")
    args = ap.parse_args()
    if args.sft_steps < 0:
        ap.error(f"--sft-steps: expected an int >= 0, got {args.sft_steps}")
    from harts_verl.workers.testing import TINY_KINDS, TINY_MULTIMODAL_KINDS

    kinds = TINY_KINDS + TINY_MULTIMODAL_KINDS
    if args.kind not in kinds:
        ap.error(f"--kind: expected one of {', '.join(kinds)}, got {args.kind!r}")
    print(prepare(args.out, kind=args.kind, sft_steps=args.sft_steps))
