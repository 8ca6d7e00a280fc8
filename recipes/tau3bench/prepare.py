"""Write the tau3-Bench recipe's inputs: train/val parquet files and the veRL tool config.

    python recipes/tau3bench/prepare.py OUT                     # bundled fixture domain retail_mini
    python recipes/tau3bench/prepare.py OUT --domain tau2:retail --split train --val-split test

``tau2:<domain>`` needs the ``tau2`` package (sierra-research/tau2-bench); ``--split`` /
``--val-split`` pick τ²'s task splits (its ``split_tasks.json``: ``train``, ``test``), without
them both files hold all of the domain's tasks (τ²'s test tasks included). Writes
``OUT/train.parquet``, ``OUT/val.parquet`` and ``OUT/tools.yaml`` (every tool of the domain;
give it as ``rollout.multi_turn.tool_config_path``). One tool config serves one domain, so the
validation tasks come from the train domain.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

from harts_verl.workers.envs import tau


def prepare(
    out: str,
    domain: str = tau.FIXTURE_DOMAIN,
    val_domain: str | None = None,
    split: str | None = None,
    val_split: str | None = None,
) -> dict:
    """Write the files; returns their paths and row counts. The train rows are the tasks of
    ``split`` (all without it), the validation rows those of ``val_split`` (all without it);
    ``val_domain`` must be ``domain`` (one tool config). Tasks the reward cannot score
    (:func:`tau.check_tasks`: a ``reward_basis`` without DB or COMMUNICATE, e.g. τ² telecom)
    are left out and named on stderr, as are reference calls the domain refuses (kept: skipped
    when scored). ``ValueError`` names a split the domain lacks, or one left empty."""
    import pandas as pd

    from harts_verl.workers.envs.tau_agent import tool_config

    os.makedirs(out, exist_ok=True)
    val_dom = val_domain or domain
    if val_dom != domain:
        raise ValueError(
            f"val_domain: {val_dom!r} differs from {domain!r}; one tool config serves one domain"
        )
    dom = tau.get_domain(domain)
    warned: set[str] = set()
    chosen_of: dict[str | None, list[tau.TauTask]] = {}  # per split: checked and warned once

    def tasks(name: str | None, flag: str) -> list[tau.TauTask]:
        if name in chosen_of:
            return chosen_of[name]
        try:
            chosen = dom.tasks() if name is None else dom.split_tasks(name)
        except ValueError as exc:
            raise ValueError(f"{flag}: {str(exc).removeprefix('split: ')}") from exc
        found = tau.check_tasks(dom, chosen)
        for msg in found["refused_reference"]:
            if msg not in warned:
                warned.add(msg)
                print(f"prepare: WARNING: {msg} (skipped when scored, as τ² does)", file=sys.stderr)
        if found["unscorable"]:
            print(
                f"prepare: WARNING: {flag}: {len(found['unscorable'])} task(s) left out, their "
                f"reward_basis has no component this reward computes (DB, COMMUNICATE): "
                f"{found['unscorable']}",
                file=sys.stderr,
            )
            left_out = set(found["unscorable"])
            chosen = [t for t in chosen if t.task_id not in left_out]
        if not chosen:
            raise ValueError(f"{flag}: no scorable tasks of {dom.name} in split {name!r}")
        chosen_of[name] = chosen
        return chosen

    train = tau.dataset_rows(dom, tasks(split, "split"), split="train")
    val = tau.dataset_rows(dom, tasks(val_split, "val_split"), split="val")
    paths = {"train": os.path.join(out, "train.parquet"), "val": os.path.join(out, "val.parquet")}
    pd.DataFrame(train).to_parquet(paths["train"])
    pd.DataFrame(val).to_parquet(paths["val"])
    paths["tools"] = os.path.join(out, "tools.yaml")
    with open(paths["tools"], "w") as f:
        yaml.safe_dump(tool_config(domain), f, sort_keys=False)
    return {**paths, "n_train": len(train), "n_val": len(val)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out")
    ap.add_argument("--domain", default=tau.FIXTURE_DOMAIN)
    ap.add_argument("--val-domain", default=None, help="must be --domain (one tool config)")
    ap.add_argument("--split", default=None, help="the train rows' τ² task split (all tasks)")
    ap.add_argument("--val-split", default=None, help="the validation rows' split (all tasks)")
    a = ap.parse_args()
    print(json.dumps(prepare(a.out, a.domain, a.val_domain, a.split, a.val_split)))
