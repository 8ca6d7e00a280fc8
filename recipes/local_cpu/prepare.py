"""Write the local CPU recipe's inputs into a directory: a tiny Qwen3-Next (hybrid: gated
DeltaNet + gated attention, random init, built from a config in code) with the word-level
tokenizer of the bundled calculator task, and train/val parquet files (a few dozen tasks)."""

from __future__ import annotations

import argparse
import os

from harts_verl.workers import testing
from harts_verl.workers.rollout import local_task


def prepare(out: str, n_train: int = 48, n_val: int = 8, kind: str = "qwen3_next") -> dict:
    """Create ``out/model`` (model + tokenizer), ``out/train.parquet``, ``out/val.parquet``."""
    model = os.path.join(out, "model")
    testing.save_tiny_model(kind, model, seed=0, vocab_size=64)
    tok = local_task.build_tokenizer(model)
    # generation stops at <eos>; veRL reads eos/pad from the tokenizer
    assert tok.eos_token_id == local_task.VOCAB.index("<eos>")
    train = local_task.write_dataset(os.path.join(out, "train.parquet"), n_train, seed=0)
    val = local_task.write_dataset(os.path.join(out, "val.parquet"), n_val, seed=1)
    return {"model": model, "train": train, "val": val}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--kind", default="qwen3_next")
    args = ap.parse_args()
    print(prepare(args.out, kind=args.kind))
