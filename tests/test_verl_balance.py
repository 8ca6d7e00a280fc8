"""Tree-aware DP balancing (``harts_verl.workers.balance``), the trainer's balancing step, and the
engine's micro-batch count equalisation (no process group needed)."""

from __future__ import annotations

import numpy as np
import pytest

from harts_verl.tree import RolloutForest
from harts_verl.tree.microbatch import compact_work
from harts_verl.workers.balance import partition_work, tree_balanced_partition


def _grpo(rng, prompt_lens, n=4, shared=0):
    """GRPO-style trees: per prompt ``n`` samples (optionally sharing ``shared`` response
    tokens); returns sequences and each one's tree id."""
    seqs, tree_of = [], []
    for t, plen in enumerate(prompt_lens):
        p = [t + 1, *rng.integers(0, 50, plen).tolist()]
        r0 = rng.integers(0, 50, shared).tolist()
        for _ in range(n):
            seqs.append(p + r0 + rng.integers(0, 50, int(rng.integers(2, 12))).tolist())
            tree_of.append(t)
    return seqs, tree_of


def _cells(parts, nm):
    m = len(parts[0]) // nm
    return [[p[k * m : (k + 1) * m] for p in parts] for k in range(nm)]  # [mini-batch][rank]


@pytest.mark.parametrize("dp,nm", [(2, 1), (4, 1), (2, 2), (2, 4)])
def test_trees_whole_equal_sizes_and_balanced(dp, nm):
    rng = np.random.default_rng(dp * 10 + nm)
    lens = rng.integers(5, 120, 16).tolist()
    seqs, tree_of = _grpo(rng, lens)
    forest = RolloutForest.from_sequences(seqs)
    parts = tree_balanced_partition(seqs, dp, nm)
    assert len(parts) == dp
    assert sorted(i for p in parts for i in p) == list(range(len(seqs)))
    assert {len(p) for p in parts} == {len(seqs) // dp}
    cells = _cells(parts, nm)
    for row in cells:
        for cell in row:  # every tree whole inside one (rank, mini-batch) cell
            for t in {tree_of[i] for i in cell}:
                assert sum(tree_of[i] == t for i in cell) == 4
            pos = np.argsort(forest.leaf_order)[cell]
            assert list(pos) == sorted(pos)  # leaf order inside a cell
    work = np.array([[partition_work(forest, c) for c in row] for row in cells])
    total = forest.num_compact_tokens
    assert work.sum() == total  # whole trees share nothing across cells
    # balanced: the heaviest cell exceeds the ideal by less than one tree
    biggest_tree = max(
        compact_work(forest, [i for i, t in enumerate(tree_of) if t == k]) for k in range(16)
    )
    assert work.max() <= total / (dp * nm) + biggest_tree
    # mini-batches are formed from cells of similar work (placement sorts by work)
    assert list(work.max(axis=1)) == sorted(work.max(axis=1), reverse=True)


def test_balanced_beats_naive_and_verl_seqlen_split():
    """Trees with very different sharing: veRL's sequence-length balancing (and a contiguous
    split) equalise semantic tokens, not the compact work the tree engine runs."""
    seqlen = pytest.importorskip("verl.utils.seqlen_balancing")
    rng = np.random.default_rng(3)
    seqs = []
    for t in range(
        8
    ):  # long shared prompts for half the trees, long private responses for the rest
        plen, rlen = (200, 5) if t % 2 == 0 else (5, 50)
        p = [t + 1, *rng.integers(0, 50, plen).tolist()]
        for _ in range(4):
            seqs.append(p + rng.integers(0, 50, rlen).tolist())
    order = rng.permutation(len(seqs))
    seqs = [seqs[i] for i in order]
    forest = RolloutForest.from_sequences(seqs)
    dp = 4
    ours = max(partition_work(forest, p) for p in tree_balanced_partition(seqs, dp))
    k = len(seqs) // dp
    naive = max(partition_work(forest, list(range(r * k, (r + 1) * k))) for r in range(dp))
    stock = seqlen.get_seqlen_balanced_partitions(
        [len(s) for s in seqs], k_partitions=dp, equal_size=True
    )
    stock_max = max(partition_work(forest, p) for p in stock)
    ideal = forest.num_compact_tokens / dp
    assert ours <= 1.05 * ideal
    assert ours < naive and ours < stock_max
    assert stock_max > 1.3 * ideal  # the stock split duplicates prompts across ranks


def test_deterministic_and_forest_input():
    rng = np.random.default_rng(5)
    seqs, _ = _grpo(rng, rng.integers(5, 60, 12).tolist(), shared=3)
    a = tree_balanced_partition(seqs, 4, 3)
    b = tree_balanced_partition(RolloutForest.from_sequences(seqs), 4, 3)
    c = tree_balanced_partition([list(s) for s in seqs], 4, 3)
    assert a == b == c


def test_big_tree_cut_at_lowest_lcp_and_errors():
    # one tree of 6 (two sub-branches of 3 below [1, 2]) + a tree of 2: share 4
    big = [[1, 2, 3, 4, k] for k in range(3)] + [[1, 2, 7, 8, k] for k in range(3)]
    big += [[9, k] for k in range(2)]
    parts = tree_balanced_partition(big, 2)
    assert sorted(len(p) for p in parts) == [4, 4]
    for p in parts:  # the big tree is cut between its two branches, not inside one
        branches = {tuple(big[i][:4]) for i in p if big[i][0] == 1}
        for br in branches:
            assert sum(tuple(big[i][:4]) == br for i in p) in (3, 0) or len(branches) == 1
    seqs = [[1, 2, k] for k in range(6)]
    with pytest.raises(ValueError, match="dp_size"):
        tree_balanced_partition(seqs, 4)
    with pytest.raises(ValueError, match="num_mini_batches"):
        tree_balanced_partition(seqs, 2, 0)
    with pytest.raises(ValueError, match="dp_size"):
        tree_balanced_partition(seqs, 0)


def test_partition_work_is_the_planner_model():
    rng = np.random.default_rng(9)
    seqs, _ = _grpo(rng, [30, 7, 12], shared=4)
    forest = RolloutForest.from_sequences(seqs)
    for part in ([0, 5, 9], [3], [], list(range(len(seqs)))):
        ref = forest.subset(np.asarray(part, np.int64)).num_compact_tokens if part else 0
        assert partition_work(forest, part) == compact_work(forest, part) == ref


def test_trainer_balance_step_and_mini_batches():
    pytest.importorskip("verl")
    from omegaconf import OmegaConf

    from harts_verl.workers.trainer import harts_balance_batch, num_mini_batches_of

    rng = np.random.default_rng(1)
    seqs, tree_of = _grpo(rng, rng.integers(5, 80, 8).tolist())
    order, metrics = harts_balance_batch(seqs, 2, 2)
    assert sorted(order) == list(range(len(seqs)))
    assert order == [i for p in tree_balanced_partition(seqs, 2, 2) for i in p]
    for q in range(4):  # veRL: rank = consecutive half, mini-batch = consecutive quarter of it
        cell = order[q * 8 : (q + 1) * 8]
        assert all(sum(tree_of[i] == tree_of[j] for j in cell) == 4 for i in cell)
    assert metrics["harts/dp_max_work"] >= metrics["harts/dp_min_work"] > 0
    assert 0 <= metrics["harts/dp_minibatch_imbalance"] < 0.5
    assert metrics["harts/dp_compression"] > 1
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "actor": {"ppo_mini_batch_size": 4, "shuffle": False},
                "rollout": {"n": 4},
            }
        }
    )
    assert num_mini_batches_of(cfg, 32) == 2
    assert num_mini_batches_of(cfg, 24) == 1  # not a multiple of the global mini-batch (16)
    cfg.actor_rollout_ref.actor.shuffle = True
    assert num_mini_batches_of(cfg, 32) == 1
    assert num_mini_batches_of(OmegaConf.create({}), 32) == 1


def test_engine_equalize_splits_by_work_then_pads():
    pytest.importorskip("verl")
    from harts_verl.tree.microbatch import plan_microbatches
    from harts_verl.workers.engine import HartsFSDPEngine, _split_by_work

    rng = np.random.default_rng(2)
    seqs, _ = _grpo(rng, [40, 10, 25], shared=5)
    forest = RolloutForest.from_sequences(seqs)
    plan = plan_microbatches(forest, capacity_tokens=10_000)
    groups = [
        (mb.compact_tokens, mb.trajectories) for mb in plan.microbatches if mb.trajectories.size
    ]
    assert len(groups) == 1
    for target in (1, 2, 5, 12):
        out = HartsFSDPEngine._equalize(forest, groups, target)
        assert len(out) == target and all(g is not None for g in out)
        assert sorted(int(i) for g in out for i in g) == list(range(12))
        works = [compact_work(forest, g) for g in out]
        assert works == sorted(works, reverse=True)
    three = HartsFSDPEngine._equalize(forest, groups, 3)
    assert compact_work(forest, three[0]) < forest.num_compact_tokens * 0.5
    out = HartsFSDPEngine._equalize(forest, groups, 15)  # 12 trajectories: 3 dummies
    assert len(out) == 15 and out[12:] == [None] * 3
    (w1, a), (w2, b) = _split_by_work(forest, np.arange(12))
    assert w1 == compact_work(forest, a) and w2 == compact_work(forest, b)
    # the best-halving cut: no other leaf-order cut has a smaller larger half
    leaf = np.asarray(forest.leaf_order)
    best = min(
        max(compact_work(forest, leaf[:j]), compact_work(forest, leaf[j:])) for j in range(1, 12)
    )
    assert max(w1, w2) == best


def test_trainer_balance_batch_override(monkeypatch):
    """``HartsPPOTrainerSync._balance_batch`` on a fake trainer: reads ``input_ids`` from the
    transfer queue, reorders the batch by rank and mini-batch cells, reports metrics."""
    pytest.importorskip("transfer_queue")
    import types

    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf

    from harts_verl.workers.trainer import harts_balance_batch, trainer_class

    cls = trainer_class()
    rng = np.random.default_rng(4)
    seqs, tree_of = _grpo(rng, rng.integers(5, 60, 8).tolist())  # 8 trees of 4
    nested = torch.nested.as_nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)

    class Batch:
        keys, partition_id, order = list(range(len(seqs))), "train", None

        def __len__(self) -> int:
            return len(self.keys)

        def reorder(self, order):
            self.order = order

    def kv_batch_get(keys, partition_id, select_fields):
        assert select_fields == ["input_ids"] and partition_id == "train"
        return {"input_ids": nested}

    monkeypatch.setattr(tq, "kv_batch_get", kv_batch_get)
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "actor": {"strategy": "harts_fsdp2", "ppo_mini_batch_size": 2, "shuffle": False},
                "rollout": {"n": 4},
            }
        }
    )
    fake = types.SimpleNamespace(
        config=cfg,
        actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": [0, 0, 1, 1]}),
        _get_required_batch_multiple=lambda dp: 8,
        tokenizer=types.SimpleNamespace(eos_token_id=0),
    )
    batch, metrics = Batch(), {}
    assert cls._balance_batch(fake, batch, metrics) is batch
    order, expected = harts_balance_batch(seqs, 2, 4)  # 32 / (2 x 4) = 4 prompts x n per step
    assert batch.order == order and metrics == expected
    for q in range(8):  # rank r, mini-batch k = the q-th consecutive block of 4: one whole tree
        assert len({tree_of[i] for i in order[q * 4 : (q + 1) * 4]}) == 1
