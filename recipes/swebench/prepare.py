"""Write the SWE-bench recipe's train/val parquet files.

    python recipes/swebench/prepare.py OUT --dataset princeton-nlp/SWE-bench_Verified --split test
    python recipes/swebench/prepare.py OUT --jsonl instances.jsonl     # SWE-bench records, one per line
    python recipes/swebench/prepare.py OUT --fixtures                  # bundled fixture task(s)

``--dataset`` needs the ``datasets`` package and network access; ``--val-fraction`` holds out the
last records (in a fixed shuffled order) for validation.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from harts_verl.workers.envs import swe


def load_records(args: argparse.Namespace) -> list[swe.SweInstance]:
    """The instances selected by the command line."""
    if args.fixtures:
        return swe.fixture_instances()
    if args.jsonl:
        out = []
        with open(args.jsonl) as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:  # a bad row is named by its file and line
                    out.append(swe.SweInstance.from_record(json.loads(line)))
                except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
                    raise ValueError(f"{args.jsonl}:{n}: {exc}") from None
        return out
    try:
        from datasets import load_dataset
    except ImportError as exc:
        raise SystemExit("--dataset needs the 'datasets' package (pip install datasets)") from exc
    return [
        swe.SweInstance.from_record(dict(r)) for r in load_dataset(args.dataset, split=args.split)
    ]


def prepare(
    out: str, instances: list[swe.SweInstance], val_fraction: float = 0.0, seed: int = 0
) -> dict:
    """Write ``out/train.parquet`` and ``out/val.parquet`` (val = train when there are too few
    instances to hold any out); returns the paths and counts."""
    import pandas as pd

    if not instances:
        raise ValueError("instances: nothing to write")
    order = list(instances)
    random.Random(seed).shuffle(order)
    n_val = int(len(order) * val_fraction)
    train, val = (
        (order[: len(order) - n_val], order[len(order) - n_val :]) if n_val else (order, order)
    )
    os.makedirs(out, exist_ok=True)
    paths = {}
    for name, part in (("train", train), ("val", val)):
        paths[name] = os.path.join(out, f"{name}.parquet")
        pd.DataFrame(swe.dataset_rows(part, split=name)).to_parquet(paths[name])
    return {**paths, "n_train": len(train), "n_val": len(val)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--dataset", default="princeton-nlp/SWE-bench_Verified")
    src.add_argument("--jsonl")
    src.add_argument("--fixtures", action="store_true")
    ap.add_argument("--split", default="test")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    a = ap.parse_args()
    print(json.dumps(prepare(a.out, load_records(a), a.val_fraction)))
