"""Command line: ``harts-verl demo | inspect | bench``."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from harts_verl.tree import RolloutForest, workloads

    seqs = workloads.swe_like(scale=args.scale, seed=args.seed)
    forest = RolloutForest.from_sequences(seqs.sequences, group_ids=seqs.group_ids)
    print(json.dumps(forest.summary(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harts-verl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded default job and print its summary")
    demo.add_argument("--scale", type=float, default=0.05)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
