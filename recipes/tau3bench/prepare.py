"""Write the tau3-Bench recipe's inputs: train/val parquet files and the veRL tool config.

    python recipes/tau3bench/prepare.py OUT                     # bundled fixture domain retail_mini
    python recipes/tau3bench/prepare.py OUT --domain tau2:retail --val-domain tau2:airline

``tau2:<domain>`` needs the ``tau2`` package (sierra-research/tau2-bench). Writes
``OUT/train.parquet``, ``OUT/val.parquet`` and ``OUT/tools.yaml`` (every tool of the train
domain; give it as ``rollout.multi_turn.tool_config_path``).
"""

from __future__ import annotations

import argparse
import json
import os

import yaml

from harts_verl.workers.envs import tau


def prepare(out: str, domain: str = tau.FIXTURE_DOMAIN, val_domain: str | None = None) -> dict:
    """Write the files; returns their paths and row counts. Without ``val_domain`` the
    validation set is the train domain's tasks."""
    import pandas as pd

    from harts_verl.workers.envs.tau_agent import tool_config

    os.makedirs(out, exist_ok=True)
    train = tau.dataset_rows(tau.get_domain(domain), split="train")
    val_dom = val_domain or domain
    if val_dom != domain:
        raise ValueError(
            f"val_domain: {val_dom!r} differs from {domain!r}; one tool config serves one domain"
        )
    val = tau.dataset_rows(tau.get_domain(val_dom), split="val")
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
    ap.add_argument("--val-domain", default=None)
    a = ap.parse_args()
    print(json.dumps(prepare(a.out, a.domain, a.val_domain)))
