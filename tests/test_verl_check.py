"""``harts-verl check`` (``harts_verl.workers.check``): fidelity audit on a saved model and a
dumped batch."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def test_check_reports_fidelity(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    from harts_verl.workers.check import main
    from harts_verl.workers.testing import save_tiny_model

    path = save_tiny_model("qwen2", str(tmp_path / "m"), seed=1)
    rng = np.random.default_rng(0)
    p = rng.integers(0, 64, 20).tolist()
    seqs = [p + rng.integers(0, 64, 9).tolist(), p[:11] + rng.integers(0, 64, 5).tolist(), p]
    nested = torch.nested.as_nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)
    torch.save({"input_ids": nested}, tmp_path / "batch.pt")
    assert main(["--model", path, "--batch", str(tmp_path / "batch.pt"), "--chunk-size", "8"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["trajectories"] == 3 and res["compression"] > 1
    assert res["max_abs_dlogp"] <= 1e-6 and res["mean_cos"] > 0.999999
    assert len(res["per_layer_max_abs_diff"]) == 2 and res["first_divergent_layer"] is None
