"""Two-process gloo data parallelism of the ``harts_fsdp2`` engine (CPU shim, tiny Qwen2).

Trees are split between ranks by the tree-aware balancer; every trajectory's log-probs come
back exactly once and equal the single-process run; gradients (gathered from the FSDP shards)
equal the single-process gradients. A second split gives the ranks very uneven work (one rank
plans several micro-batches, the other one): every engine call still runs the same number of
micro-batches on both ranks (splits, then zero-loss dummies), with the same results.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from harts_verl.tree import RolloutForest

pytest.importorskip("verl")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A rank of dp_worker that also records, per engine call, the planned micro-batch count and
# each micro-batch step run (dummy or not), to ``out_path + ".json"``.
_WORKER = """
import atexit, json, sys
sys.modules["fla"] = None
args = json.loads(sys.argv[1])
from harts_verl.workers import engine as E
log = []
plan0, step0 = E.HartsFSDPEngine._plan, E.HartsFSDPEngine._tree_forward_step
def plan(self, *a, **k):
    groups, ms = plan0(self, *a, **k)
    log.append(["plan", self._calls, len(groups)])
    return groups, ms
def step(self, *a, **k):
    log.append(["step", self._calls, bool(k.get("dummy", False))])
    return step0(self, *a, **k)
E.HartsFSDPEngine._plan, E.HartsFSDPEngine._tree_forward_step = plan, step
atexit.register(lambda: json.dump(log, open(args["out_path"] + ".json", "w")))
from harts_verl.workers.testing import dp_worker
dp_worker(**args)
"""


def _calls(log: list) -> dict[int, dict]:
    """Per engine call: planned micro-batches, steps run, dummy steps."""
    out: dict[int, dict] = {}
    for kind, call, val in log:
        c = out.setdefault(call, {"planned": 0, "steps": 0, "dummies": 0})
        if kind == "plan":
            c["planned"] = val
        else:
            c["steps"] += 1
            c["dummies"] += int(val)
    return out


def _launch(world: int, args: dict, tmp_path, tag: str, timeout: float = 240.0) -> list[dict]:
    port = _free_port()
    procs, outs = [], []
    env = {**os.environ, "VERL_PLATFORM": "harts_cpu", "OMP_NUM_THREADS": "1"}
    for rank in range(world):
        out = str(tmp_path / f"{tag}_{rank}.pt")
        outs.append(out)
        call = {**args, "rank": rank, "world_size": world, "port": port, "out_path": out}
        code = _WORKER
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(call)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    errors = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                errors.append(err.decode(errors="replace")[-3000:])
    finally:
        for p in procs:  # clean up by pid on timeout/failure
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert not errors, "\n".join(errors)
    res = [torch.load(o) for o in outs]
    for r, o in zip(res, outs):
        with open(o + ".json") as f:
            r["calls"] = _calls(json.load(f))
    return res


def test_two_rank_dp_equals_single_process(tmp_path):
    from harts_verl.workers.balance import tree_balanced_partition
    from harts_verl.workers.testing import save_tiny_model

    rng = np.random.default_rng(11)
    seqs, pls = [], []
    for _ in range(3):  # three GRPO-style trees of 4 samples with shared response prefixes
        p = rng.integers(0, 64, int(rng.integers(8, 16))).tolist()
        r0 = rng.integers(0, 64, 6).tolist()
        for k in range(4):
            tail = rng.integers(0, 64, int(rng.integers(3, 9))).tolist()
            seqs.append(p + (r0[: 2 + k] if k % 2 else []) + tail)
            pls.append(len(p))
    seqs.append(rng.integers(0, 64, 12).tolist())  # a lone trajectory: 13 total → pad to 14
    seqs.append([*seqs[-1][:7], 1, 2, 3])
    pls += [5, 5]
    path = save_tiny_model("qwen2", str(tmp_path / "qwen2"), seed=4)
    parts = tree_balanced_partition(seqs, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(seqs)))
    base = {"model_path": path, "sequences": seqs, "prompt_lengths": pls}
    single = _launch(1, {**base, "parts": [list(range(len(seqs)))]}, tmp_path, "single")[0]
    # Uneven: rank 0 holds the three big trees (several micro-batches at capacity 40), rank 1
    # the two-trajectory tree (one micro-batch, splittable once, then dummies).
    uneven = [list(range(12)), [12, 13]]
    for tag, split in (("dp", parts), ("uneven", uneven)):
        ranks = _launch(2, {**base, "parts": split}, tmp_path, tag)
        _check_against_single(ranks, single, len(seqs))
        # harts/compression is the realized one: Σ S / Σ of the compact rows each rank's
        # micro-batches run (at least each rank's own tree rows: a split tree pays its shared
        # rows in each micro-batch)
        for r, p in zip(ranks, split):
            own = RolloutForest.from_sequences([seqs[i] for i in p]).num_compact_tokens
            assert r["metrics"]["harts/compact_tokens"][0] >= own
        rows = sum(r["metrics"]["harts/compact_tokens"][0] for r in ranks)
        realized = sum(map(len, seqs)) / rows
        for r in ranks:
            assert r["metrics"]["harts/compression"] == pytest.approx([realized], rel=1e-12)
        c0, c1 = ranks[0]["calls"], ranks[1]["calls"]
        assert sorted(c0) == sorted(c1) == [1, 2]  # infer_batch, train_batch
        for call in c0:  # every engine call: the same number of micro-batches on both ranks
            assert c0[call]["steps"] == c1[call]["steps"]
            assert c0[call]["steps"] == max(c0[call]["planned"], c1[call]["planned"])
        _check_dp_metrics(ranks, single)
        if tag == "uneven":
            for call in c0:
                assert c0[call]["planned"] >= 3 and c1[call]["planned"] == 1
                assert c0[call]["dummies"] == 0
                assert c1[call]["dummies"] == c0[call]["planned"] - 2  # split once, then pad
            # the min_compression gate counts the rows of that split too: just above the
            # realized compression, both ranks fall back, and the gate saw that very ratio
            gate = {"min_compression": realized * (1 + 1e-9)}
            gated = _launch(2, {**base, "parts": split, "harts": gate}, tmp_path, "gated")
            for r in gated:
                assert r["metrics"]["harts/fallback"] == [1.0]
                assert r["metrics"]["harts/compression"] == pytest.approx([realized], rel=1e-12)


def _four_trees(tmp_path) -> dict:
    """``dp_worker`` arguments of four GRPO-style trees of 3 samples with shared response
    prefixes, on a tiny Qwen2: model path, sequences and prompt lengths."""
    from harts_verl.workers.testing import save_tiny_model

    rng = np.random.default_rng(12)
    seqs, pls = [], []
    for _ in range(4):
        p = rng.integers(0, 64, int(rng.integers(8, 14))).tolist()
        r0 = rng.integers(0, 64, 5).tolist()
        for k in range(3):
            seqs.append(p + r0[: 1 + 2 * k] + rng.integers(0, 64, int(rng.integers(2, 7))).tolist())
            pls.append(len(p))
    path = save_tiny_model("qwen2", str(tmp_path / "qwen2"), seed=8)
    return {"model_path": path, "sequences": seqs, "prompt_lengths": pls}


@pytest.mark.parametrize("loss_mode", ["geo_mean", "vanilla"])
def test_two_rank_dp_losses_and_metrics_equal_stock(tmp_path, loss_mode):
    """Under DP 2, at a token budget of several micro-batches per rank: ``geo_mean`` (a mean
    over each micro-batch) runs on veRL's own micro-batches, and ``vanilla`` runs on the tree
    micro-batches with its metrics evaluated again on veRL's (``harts.stock_metrics``). Either
    way the per-micro-batch losses, every metric (``actor/pg_clipfrac``, ``actor/ppo_kl``, …,
    one value per veRL micro-batch), the gradients and the grad norm are the stock engine's."""
    from harts_verl.workers.balance import tree_balanced_partition

    base = _four_trees(tmp_path)
    base = {
        **base,
        "parts": tree_balanced_partition(base["sequences"], 2),
        "loss_mode": loss_mode,
        "max_token_len": 48,
    }
    stock = _launch(2, {**base, "strategy": "fsdp2"}, tmp_path, "stock")
    tree = _launch(2, base, tmp_path, "tree")
    for s, t in zip(stock, tree):
        assert t["indices"] == s["indices"]
        assert t["metrics"]["harts/stock_split_loss"] == [float(loss_mode == "geo_mean")]
        assert t["metrics"]["harts/fallback"] == [0.0]
        assert len(s["metrics"]["loss"]) >= 2  # the budget cuts each rank's batch
        np.testing.assert_allclose(t["metrics"]["loss"], s["metrics"]["loss"], rtol=1e-5, atol=1e-7)
        assert set(t["metric_values"]) == set(s["metric_values"])
        for key, (aggregation, values) in s["metric_values"].items():
            assert t["metric_values"][key][0] == aggregation, key
            np.testing.assert_allclose(
                t["metric_values"][key][1], values, rtol=1e-5, atol=1e-7, err_msg=key
            )
        assert abs(t["grad_norm"] - s["grad_norm"]) <= 1e-6 * s["grad_norm"]
        for name, g in s["grads"].items():
            assert float((t["grads"][name] - g).abs().max()) <= 1e-6 * max(
                float(g.abs().max()), 1e-3
            ), name


def test_two_rank_dp_agree_when_verl_cannot_cut(tmp_path):
    """Only rank 0 holds a trajectory over veRL's token budget, which veRL's micro-batching
    refuses (the tree engine runs it whole). The ranks agree to evaluate the loss and its
    metrics on the tree micro-batches (``harts/stock_metrics`` = 0 on both; a refusal on one
    rank alone used to stop that rank while its peer waited), and the step equals the
    single-process one."""
    base = _four_trees(tmp_path)
    seqs = base["sequences"]
    seqs[2] = seqs[2] + [1, 2, 3, 4, 5, 6]  # tree 0 holds the longest trajectory
    trees = [list(range(3 * t, 3 * t + 3)) for t in range(4)]
    longest = [max(len(seqs[i]) for i in tree) for tree in trees]
    first = int(np.argmax(longest))
    assert first == 0 and sorted(longest)[-2] < longest[first]
    rest = [t for k, t in enumerate(trees) if k != first]
    parts = [trees[first] + rest[0], rest[1] + rest[2]]
    base = {**base, "max_token_len": longest[first] - 1}
    single = _launch(1, {**base, "parts": [list(range(len(seqs)))]}, tmp_path, "single")[0]
    ranks = _launch(2, {**base, "parts": parts}, tmp_path, "refused")
    _check_against_single(ranks, single, len(seqs))
    for r in (*ranks, single):
        assert r["metrics"]["harts/stock_metrics"] == [0.0]
        assert r["metrics"]["harts/fallback"] == [0.0]
        assert r["metrics"]["harts/oversize_microbatches"] == [0.0]  # capacity 40 rows


def test_two_rank_dp_loss_with_collectives_on_tree_micro_batches(tmp_path):
    """``bypass_mode`` with batch-normalized importance weights all-reduces in every loss call.
    Evaluated on tree micro-batches (``split_dependent_losses: tree``) with one rank padding its
    count with dummies, the ranks still make the same collectives: the step finishes (it used to
    hang), every real micro-batch reports its loss, and the gradient is the same on both ranks
    and close to the stock engine's (the loss is documented to differ by the micro-batching)."""

    base = {
        **_four_trees(tmp_path),
        "parts": [list(range(10)), [10, 11]],  # rank 1: one small tree, then dummies
        "capacity_tokens": 30,
        "policy_loss": {
            "loss_mode": "bypass_mode",
            "rollout_correction": {
                "rollout_is": "token",
                "loss_type": "reinforce",
                "rollout_is_batch_normalize": True,
                "bypass_mode": True,
            },
        },
        "harts": {"split_dependent_losses": "tree"},
    }
    tree = _launch(2, base, tmp_path, "tree", timeout=180)
    stock = _launch(2, {**base, "strategy": "fsdp2"}, tmp_path, "stock")
    c0, c1 = tree[0]["calls"], tree[1]["calls"]
    train = max(c0)
    assert c1[train]["dummies"] >= 1 and c0[train]["steps"] == c1[train]["steps"]
    for r, t in enumerate(tree):
        assert t["metrics"]["harts/stock_split_loss"] == [0.0]
        real = c0[train]["steps"] - (c1 if r else c0)[train]["dummies"]
        assert len(t["metrics"]["loss"]) == real
        assert all(np.isfinite(t["metrics"]["loss"]))
    gs = stock[0]["grad_norm"]
    assert tree[0]["grad_norm"] == tree[1]["grad_norm"]
    assert 0 < abs(tree[0]["grad_norm"] - gs) <= 0.1 * gs
    for name, g in tree[0]["grads"].items():
        torch.testing.assert_close(tree[1]["grads"][name], g, rtol=0, atol=0)


def test_ulysses_sp_ranks_share_the_trees(tmp_path):
    """Ulysses SP 2 (one DP group of two ranks): the SP ranks share the tree micro-batches
    (equal counts, each micro-batch on one rank) instead of slicing sequences; both ranks return
    every trajectory's log-probs and entropy, and gradients and grad norm equal the
    single-process run; the merged metrics hold every micro-batch's loss once. Then DP 2 x SP 2
    (four ranks): the same against the single-process run."""
    from harts_verl.workers.balance import tree_balanced_partition
    from harts_verl.workers.testing import save_tiny_model

    rng = np.random.default_rng(5)
    seqs, pls = [], []
    for _ in range(4):  # four GRPO-style trees of 3 samples
        p = rng.integers(0, 64, int(rng.integers(6, 14))).tolist()
        for _ in range(3):
            seqs.append(p + rng.integers(0, 64, int(rng.integers(3, 10))).tolist())
            pls.append(len(p))
    path = save_tiny_model("qwen2", str(tmp_path / "qwen2"), seed=6)
    base = {"model_path": path, "sequences": seqs, "prompt_lengths": pls, "capacity_tokens": 30}
    # the tree micro-batches' losses and metrics in both runs (the replay on veRL's own
    # micro-batches under SP: test_ulysses_sp_losses_and_metrics_equal_stock)
    base["harts"] = {"stock_metrics": False}
    everything = [list(range(len(seqs)))]
    single = _launch(1, {**base, "parts": everything}, tmp_path, "single")[0]
    ranks = _launch(2, {**base, "parts": everything, "sp": 2}, tmp_path, "sp")
    for r in ranks:
        assert r["indices"] == everything[0]
        for i, (lp, ent) in enumerate(zip(r["log_probs"], r["entropy"])):
            assert float((lp[:-1] - single["log_probs"][i][:-1]).abs().max()) <= 1e-6
            assert float((ent[:-1] - single["entropy"][i][:-1]).abs().max()) <= 1e-6
        for name, g in single["grads"].items():
            assert float((r["grads"][name] - g).abs().max()) <= 1e-6 * max(
                float(g.abs().max()), 1e-3
            ), name
        # merged metrics: the same totals as the single run, every micro-batch's loss once
        for key in ("harts/compact_tokens", "harts/compression", "harts/fallback"):
            assert r["metrics"][key] == single["metrics"][key], key
        assert r["metrics"]["harts/fallback"] == [0.0]
        assert len(r["metrics"]["loss"]) == len(single["metrics"]["loss"])
        assert sum(r["metrics"]["loss"]) == pytest.approx(sum(single["metrics"]["loss"]), 1e-6)
    assert abs(ranks[0]["grad_norm"] - single["grad_norm"]) <= 1e-6 * single["grad_norm"]
    c0, c1, cs = ranks[0]["calls"], ranks[1]["calls"], single["calls"]
    for call in c0:  # each SP rank runs half of the (even) micro-batch count, at least one real
        assert c0[call]["planned"] == c1[call]["planned"] == cs[call]["planned"] >= 3
        assert c0[call]["steps"] == c1[call]["steps"] == -(-cs[call]["planned"] // 2)
        assert c0[call]["steps"] > c0[call]["dummies"] and c1[call]["steps"] > c1[call]["dummies"]

    # DP 2 x SP 2 (ranks 0, 1: DP rank 0; ranks 2, 3: DP rank 1), trees split between DP ranks
    parts = tree_balanced_partition(seqs, 2)
    grid = _launch(4, {**base, "parts": parts, "sp": 2}, tmp_path, "dp_sp", timeout=480)
    _check_against_single([grid[0], grid[2]], single, len(seqs))  # the collecting SP rank 0s
    for a, b in ((0, 1), (2, 3)):  # SP rank 1 returns the same outputs and gradients
        assert grid[a]["indices"] == grid[b]["indices"]
        for x, y in zip(grid[a]["log_probs"], grid[b]["log_probs"]):
            assert torch.equal(x, y)
        for name, g in grid[a]["grads"].items():
            assert torch.equal(g, grid[b]["grads"][name]), name
    steps = {call: {r["calls"][call]["steps"] for r in grid} for call in grid[0]["calls"]}
    assert all(len(v) == 1 for v in steps.values())  # every rank: the same micro-batch count
    _check_dp_metrics([grid[0], grid[2]], single)


@pytest.mark.parametrize("loss_mode", ["vanilla", "geo_mean"])
def test_ulysses_sp_losses_and_metrics_equal_stock(tmp_path, loss_mode):
    """Under Ulysses SP 2 every SP rank evaluates the loss on veRL's own micro-batches over the
    merged outputs, as the stock engine does (its SP ranks all evaluate every micro-batch on
    SP-gathered outputs, cut at ``max_token_len_per_gpu × sp``): ``vanilla`` replays it for
    the metrics (``harts.stock_metrics``), ``geo_mean`` (a mean over each micro-batch) takes
    its gradient there too. The per-micro-batch losses, every metric (``actor/pg_clipfrac``,
    …, one value per veRL micro-batch), the gradients and the grad norm are the stock
    engine's. gloo has no all-to-all, so the stock side is one process at twice the budget,
    which is the cut stock SP 2 makes."""
    base = {**_four_trees(tmp_path), "loss_mode": loss_mode}
    everything = [list(range(len(base["sequences"])))]
    budget = 24
    stock = _launch(
        1,
        {**base, "parts": everything, "strategy": "fsdp2", "max_token_len": 2 * budget},
        tmp_path,
        "stock",
    )[0]
    ranks = _launch(
        2, {**base, "parts": everything, "sp": 2, "max_token_len": budget}, tmp_path, "sp"
    )
    assert len(stock["metrics"]["loss"]) >= 2  # the budget cuts the batch
    compact = RolloutForest.from_sequences(base["sequences"]).num_compact_tokens
    for r in ranks:
        assert r["metrics"]["harts/stock_metrics"] == [1.0]
        assert r["metrics"]["harts/stock_split_loss"] == [float(loss_mode == "geo_mean")]
        assert r["metrics"]["harts/fallback"] == [0.0]
        # the SP ranks' shares summed: at least the whole batch's compact rows, the same on both
        assert r["metrics"]["harts/compact_tokens"] == ranks[0]["metrics"]["harts/compact_tokens"]
        assert r["metrics"]["harts/compact_tokens"][0] >= compact
        np.testing.assert_allclose(
            r["metrics"]["loss"], stock["metrics"]["loss"], rtol=1e-5, atol=1e-7
        )
        assert set(r["metric_values"]) == set(stock["metric_values"])
        for key, (aggregation, values) in stock["metric_values"].items():
            assert r["metric_values"][key][0] == aggregation, key
            np.testing.assert_allclose(
                r["metric_values"][key][1], values, rtol=1e-5, atol=1e-7, err_msg=key
            )
        for name, g in stock["grads"].items():
            assert float((r["grads"][name] - g).abs().max()) <= 1e-6 * max(
                float(g.abs().max()), 1e-3
            ), name
    assert abs(ranks[0]["grad_norm"] - stock["grad_norm"]) <= 1e-6 * stock["grad_norm"]


def test_sp_assignment_equal_counts_balanced_work():
    from harts_verl.workers.engine import sp_assignment

    works = [9, 1, 7, 3, 0, 5]  # a dummy (0) among them
    owner = sp_assignment(works, 2)
    assert np.bincount(owner, minlength=2).tolist() == [3, 3]
    loads = np.bincount(owner, weights=works, minlength=2)
    assert sorted(loads.tolist()) == [12.0, 13.0]  # 9+3+1 / 7+5+0: the best equal-count split
    assert np.array_equal(owner, sp_assignment(works, 2))  # deterministic
    assert sp_assignment([4, 4, 4, 4], 4).tolist() == [0, 1, 2, 3]
    assert sp_assignment([5, 2], 1).tolist() == [0, 0]
    with pytest.raises(ValueError, match="5 micro-batches do not divide among 2 SP ranks"):
        sp_assignment([1, 2, 3, 4, 5], 2)


def _check_dp_metrics(ranks: list[dict], single: dict) -> None:
    """veRL's ``Metric.aggregate_dp`` (which the worker runs over the DP ranks' train metrics)
    needs equal value counts per key on every rank, dummy micro-batches included; the filled
    values leave every SUM total unchanged: Σ over ranks and micro-batches of the DP-scaled
    ``actor/pg_loss`` = DP x the single-process total."""
    from verl.utils.metric.utils import Metric

    per_rank = [r["metric_values"] for r in ranks]
    assert per_rank[0] and all(set(m) == set(per_rank[0]) for m in per_rank)
    for key in per_rank[0]:
        metrics = [Metric(aggregation=m[key][0]) for m in per_rank]
        for metric, m in zip(metrics, per_rank):
            metric.extend(m[key][1])
        assert len({len(m.values) for m in metrics}) == 1, key
        Metric.aggregate_dp(metrics)  # raises on unequal counts
    assert per_rank[0]["actor/pg_loss"][0] == "sum"
    total = sum(sum(m["actor/pg_loss"][1]) for m in per_rank)
    assert total == pytest.approx(len(ranks) * sum(single["metric_values"]["actor/pg_loss"][1]))


def _check_against_single(ranks: list[dict], single: dict, n: int) -> None:
    seen = [i for r in ranks for i in r["indices"]]
    assert sorted(seen) == list(range(n))  # each trajectory exactly once
    for r in ranks:
        for i, lp in zip(r["indices"], r["log_probs"]):
            ref = single["log_probs"][i]
            assert lp.shape == ref.shape
            assert float((lp[:-1] - ref[:-1]).abs().max()) <= 1e-6
    for r in ranks:
        assert abs(r["grad_norm"] - single["grad_norm"]) <= 1e-6 * single["grad_norm"]
        for name, g in single["grads"].items():
            assert float((r["grads"][name] - g).abs().max()) <= 1e-6 * max(
                float(g.abs().max()), 1e-3
            ), name
