"""Tree-aware DP balancing (``harts_verl.workers.balance``), the trainer's balancing step, and the
engine's micro-batch count equalisation (no process group needed)."""

from __future__ import annotations

import numpy as np
import pytest
from _strategies import sequence_lists
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harts_verl.tree import RolloutForest
from harts_verl.tree.microbatch import compact_work
from harts_verl.workers.balance import tree_balanced_cells, tree_balanced_partition


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
    work = np.array([[compact_work(forest, c) for c in row] for row in cells])
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
    ours = max(compact_work(forest, p) for p in tree_balanced_partition(seqs, dp))
    k = len(seqs) // dp
    naive = max(compact_work(forest, list(range(r * k, (r + 1) * k))) for r in range(dp))
    stock = seqlen.get_seqlen_balanced_partitions(
        [len(s) for s in seqs], k_partitions=dp, equal_size=True
    )
    stock_max = max(compact_work(forest, p) for p in stock)
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
    # one tree of 8 (two sub-branches of 4 below [1, 2]) + a tree of 4: share 4, the big tree is
    # cut between its two branches, not inside one
    big = [[1, 2, 3, 4, k] for k in range(4)] + [[1, 2, 7, 8, k] for k in range(4)]
    big += [[9, k] for k in range(4)]
    parts = tree_balanced_partition(big, 3)
    assert sorted(sorted({tuple(big[i][:-1]) for i in p}) for p in parts) == [
        [(1, 2, 3, 4)],
        [(1, 2, 7, 8)],
        [(9,)],
    ]
    # one tree of 6 (branches of 3) + a tree of 2, share 4: a tree that fits a cell stays
    # whole (the big one, cut anyway, is cut inside a branch); it was the one cut
    big = [[1, 2, 3, 4, k] for k in range(3)] + [[1, 2, 7, 8, k] for k in range(3)]
    big += [[9, k] for k in range(2)]
    parts = tree_balanced_partition(big, 2)
    assert sorted(len(p) for p in parts) == [4, 4]
    assert sum(any(big[i][0] == 9 for i in p) for p in parts) == 1
    seqs = [[1, 2, k] for k in range(6)]
    with pytest.raises(ValueError, match="dp_size"):
        tree_balanced_partition(seqs, 4)
    with pytest.raises(ValueError, match="num_mini_batches"):
        tree_balanced_partition(seqs, 2, 0)
    with pytest.raises(ValueError, match="dp_size"):
        tree_balanced_partition(seqs, 0)


# a chat template every trajectory starts with
_TEMPLATE = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]


@pytest.mark.parametrize(("dp", "nm"), [(2, 1), (4, 1), (2, 2)])
def test_a_shared_template_changes_nothing(dp, nm):
    """A prefix every trajectory shares (a chat template) made the whole batch one tree: it was
    cut into contiguous leaf-order chunks, and balancing had nothing left to do (one rank 2095
    rows, the other 575). Now the batch splits into the trees below the template, as without."""
    rng = np.random.default_rng(0)
    seqs = []
    for g in range(8):  # long and short prompts alternate in leaf order
        p = [1000 + g, *rng.integers(0, 50, 400 if g < 4 else 20).tolist()]
        seqs += [p + rng.integers(0, 50, 30).tolist() for _ in range(4)]
    plain = tree_balanced_cells(seqs, dp, nm)
    templ = tree_balanced_cells([_TEMPLATE + s for s in seqs], dp, nm)
    assert templ[0] == plain[0]  # the same partition
    assert (templ[1] == plain[1] + len(_TEMPLATE)).all()  # each cell pays the template once
    # GRPO groups of sizes 2, 3, 2, 3, 2 below a template, two cells of 6: {3, 3} | {2, 2, 2}
    seqs, group = [], []
    for g, size in enumerate([2, 3, 2, 3, 2]):
        for k in range(size):
            seqs.append([*_TEMPLATE, 1000 + g, *[g] * 20, k])
            group.append(g)
    parts = tree_balanced_partition(seqs, 2)
    assert all(
        len({r for r, p in enumerate(parts) if g in {group[i] for i in p}}) == 1 for g in range(5)
    )


def test_a_shared_template_cuts_no_more_trees():
    """Below a template the trees are the template's children: the first criterion (fewest
    trees cut) counted one tree for the whole batch, and a refinement round split a whole tree
    below the template (a tree of 3 beside one of 5, cells of 4: both were cut)."""
    body = [[100, 0, 1, 1, 0], [100, 1, 0, 1, 1], [100, 0, 2]]  # a tree of 3
    body += [[101, 0], [101, 0, 1], [101, 1, 2], [101, 0, 1, 3], [101, 1, 1, 4]]  # of 5

    def trees_cut(seqs, root, dp, nm=1):
        parts = tree_balanced_partition(seqs, dp, nm)
        m = len(parts[0]) // nm
        cells = [p[k * m : (k + 1) * m] for p in parts for k in range(nm)]
        roots = {s[root] for s in seqs}
        return sum(
            len({c for c, cell in enumerate(cells) for i in cell if seqs[i][root] == t}) > 1
            for t in roots
        )

    assert trees_cut(body, 0, 2) == trees_cut([[7, 7, *s] for s in body], 2, 2) == 1
    rng = np.random.default_rng(3)
    for _ in range(40):  # GRPO-like groups of random sizes: the template cuts no more trees
        sizes = rng.integers(1, 7, int(rng.integers(2, 9))).tolist()
        seqs = []
        for g, size in enumerate(sizes):
            p = [1000 + g, *rng.integers(0, 4, int(rng.integers(1, 6))).tolist()]
            seqs += [p + rng.integers(0, 4, int(rng.integers(1, 5))).tolist() for _ in range(size)]
        grid = [
            (dp, nm)
            for dp in (1, 2, 3, 4)
            for nm in (1, 2)
            if dp * nm > 1 and len(seqs) % (dp * nm) == 0
        ]
        for dp, nm in grid:
            templ = [[*_TEMPLATE, *q] for q in seqs]
            assert trees_cut(templ, len(_TEMPLATE), dp, nm) == trees_cut(seqs, 0, dp, nm), (
                sizes,
                dp,
                nm,
            )


def test_a_tree_that_fits_stays_whole_beside_one_cut_anyway():
    """Trees of 6 (3 | 3 at its lowest LCP), 4 and 2 on three cells of 4: the tree of 6 must be
    cut; it is cut again ({4} | {2 + 2 of it} | {4 of it}) rather than cutting the tree of 2."""
    a = [[1, 9, 9, 9, 0, 0, k] for k in range(3)] + [[1, 9, 9, 9, 5, 5, k] for k in range(3)]
    b = [[2, 7, 7, k] for k in range(4)]
    c = [[3] + [8] * 20 + [k] for k in range(2)]
    seqs = a + b + c
    parts = tree_balanced_partition(seqs, 3)
    for first in (2, 3):
        assert sum(any(seqs[i][0] == first for i in p) for p in parts) == 1


def test_swaps_never_raise_the_largest_cell():
    """Pieces cut from one tree share their prefix in a cell, so the sum of their works
    overcounts it; a swap that lowered that sum raised the real largest cell (28 to 29)."""
    import harts_verl.workers.balance as balance

    p = [7] * 20
    a = [[101, *p, 0], [101, *p, 1], [101, *p, 2], [101, *p, 0, 3], [101, *p, 0, 4]]
    a += [[101, *p, 0, 0, k] for k in range(5, 12)]
    seqs = [*a, [102, 0], [102, 1], [102, 2]]
    with_swap = tree_balanced_cells(seqs, 3)[1].max()
    real = balance._swap
    try:
        balance._swap = lambda *args: None
        without = tree_balanced_cells(seqs, 3)[1].max()
    finally:
        balance._swap = real
    assert with_swap <= without


def test_exact_search_is_exhaustive_within_its_budget():
    """The branch and bound after a first placement skipped cells alike in room (but not in
    work) in the frames built before it: largest cell 140 where 124 keeps every tree whole."""
    import itertools

    from harts_verl.workers.balance import _exact

    sizes, works = [2, 5, 3, 4, 8, 5, 1, 2, 2], [61, 34, 33, 30, 36, 58, 41, 49, 32]
    ids, _ = _exact(np.array(sizes), np.array(works), 8, 4)
    got = max(sum(works[i] for i in c) for c in ids)
    best = min(
        max(sum(w for w, x in zip(works, assign) if x == c) for c in range(4))
        for assign in itertools.product(range(4), repeat=len(sizes))
        if all(sum(s for s, x in zip(sizes, assign) if x == c) == 8 for c in range(4))
    )
    assert got == best == 124


@settings(max_examples=60, deadline=None)
@given(sequence_lists(max_traj=12, alphabet=3), st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 1)]))
def test_cell_works_are_the_cells_compact_work(seqs, grid):
    """:func:`tree_balanced_cells`' works (the trainer's metrics; they were recomputed per
    cell, O(n) each) are the compact work of each rank's mini-batch."""
    dp, nm = grid
    seqs = seqs[: len(seqs) - len(seqs) % (dp * nm)]
    if not seqs:
        return
    forest = RolloutForest.from_sequences(seqs)
    parts, works = tree_balanced_cells(forest, dp, nm)
    assert parts == tree_balanced_partition(forest, dp, nm)
    expected = [[compact_work(forest, c) for c in row] for row in _cells(parts, nm)]
    assert works.tolist() == expected


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


def test_tree_balancing_follows_every_tree_section():
    """A trained critic on ``harts_fsdp2`` turns tree balancing on by itself, and the cells
    follow its mini-batches (with a tree actor too: both, the least common multiple)."""
    pytest.importorskip("verl")
    from omegaconf import OmegaConf

    from harts_verl.workers.trainer import is_harts_config, num_mini_batches_of

    def cfg(actor="fsdp2", critic="fsdp2", enable=None, adv="gae", critic_shuffle=False):
        return OmegaConf.create(
            {
                "actor_rollout_ref": {
                    "actor": {"strategy": actor, "ppo_mini_batch_size": 4, "shuffle": False},
                    "rollout": {"n": 2},
                },
                "critic": {
                    "strategy": critic,
                    "enable": enable,
                    "ppo_mini_batch_size": 2,
                    "shuffle": critic_shuffle,
                },
                "algorithm": {"adv_estimator": adv},
            }
        )

    assert not is_harts_config(cfg())
    assert is_harts_config(cfg(actor="harts_fsdp2"))
    assert is_harts_config(cfg(critic="harts_fsdp2"))  # GAE: veRL trains the critic
    assert not is_harts_config(cfg(critic="harts_fsdp2", adv="grpo"))  # no critic is trained
    assert is_harts_config(cfg(critic="harts_fsdp2", adv="grpo", enable=True))
    assert not is_harts_config(cfg(critic="harts_fsdp2", enable=False))
    # harts.enable: false is the stock fsdp2 path, veRL's own balancing included
    off = cfg(actor="harts_fsdp2", critic="harts_fsdp2")
    off.actor_rollout_ref.actor.harts = {"enable": False}
    off.critic.harts = {"enable": False}
    assert not is_harts_config(off)
    off.critic.harts.enable = True
    assert is_harts_config(off)
    assert num_mini_batches_of(off, 32) == 8  # the critic's cells only
    # 32 trajectories: the actor's global mini-batch is 8 (4 pieces), the critic's 4 (8 pieces)
    assert num_mini_batches_of(cfg(actor="harts_fsdp2"), 32) == 4
    assert num_mini_batches_of(cfg(critic="harts_fsdp2"), 32) == 8
    assert num_mini_batches_of(cfg(critic="harts_fsdp2", adv="grpo"), 32) == 4  # actor's
    both = cfg(actor="harts_fsdp2", critic="harts_fsdp2")
    assert num_mini_batches_of(both, 32) == 8
    both.critic.ppo_mini_batch_size = 3  # global 6
    assert num_mini_batches_of(both, 24) == 12  # 3 actor and 4 critic pieces: lcm 12
    assert num_mini_batches_of(both, 32) == 1  # 6 does not divide 32
    shuffled = cfg(actor="harts_fsdp2", critic="harts_fsdp2", critic_shuffle=True)
    assert num_mini_batches_of(shuffled, 32) == 1
    assert num_mini_batches_of(cfg(actor="harts_fsdp2", critic_shuffle=True), 32) == 4
    # the critic's warm-up (veRL updates the critic alone): only its mini-batches count
    both.critic.ppo_mini_batch_size = 2
    assert num_mini_batches_of(both, 20, actor_updates=False) == 5
    assert num_mini_batches_of(both, 20) == 1  # the actor's 8 does not divide 20
    # the advantage estimator as veRL's enum (a config built in code)
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    coded = cfg(critic="harts_fsdp2")
    coded.algorithm = {"adv_estimator": "grpo"}
    assert not is_harts_config(coded)
    coded.algorithm = OmegaConf.create(flags={"allow_objects": True})
    coded.algorithm.adv_estimator = AdvantageEstimator.GAE
    assert is_harts_config(coded)


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
        out = [g for _, g in HartsFSDPEngine._equalize(forest, groups, target)]
        assert len(out) == target and all(g is not None for g in out)
        assert sorted(int(i) for g in out for i in g) == list(range(12))
        works = [compact_work(forest, g) for g in out]
        assert works == sorted(works, reverse=True)
    three = [g for _, g in HartsFSDPEngine._equalize(forest, groups, 3)]
    assert compact_work(forest, three[0]) < forest.num_compact_tokens * 0.5
    out = [
        g for _, g in HartsFSDPEngine._equalize(forest, groups, 15)
    ]  # 12 trajectories, 3 dummies
    assert len(out) == 15 and out[12:] == [None] * 3
    (w1, a), (w2, b) = _split_by_work(forest, np.arange(12))
    assert w1 == compact_work(forest, a) and w2 == compact_work(forest, b)
    # the best-halving cut: no other leaf-order cut has a smaller larger half
    leaf = np.asarray(forest.leaf_order)
    best = min(
        max(compact_work(forest, leaf[:j]), compact_work(forest, leaf[j:])) for j in range(1, 12)
    )
    assert max(w1, w2) == best


@pytest.mark.parametrize(
    ("tree_section", "mode"),
    [("actor", "sync"), ("critic", "sync"), ("actor", "colocate_async")],
)
def test_trainer_balance_batch_override(monkeypatch, tree_section, mode):
    """The tree-aware ``_balance_batch`` of :func:`trainer_class` on a fake trainer: reads
    ``input_ids`` from the transfer queue, reorders the batch by rank and mini-batch cells,
    reports metrics; so also when only the (GAE) critic runs trees, and in veRL's other
    trainer modes (the class is a subclass of the mode's own)."""
    pytest.importorskip("transfer_queue")
    import types

    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import get_trainer_cls

    from harts_verl.workers.trainer import harts_balance_batch, trainer_class

    cls = trainer_class(mode)
    assert issubclass(cls, get_trainer_cls(mode)) and cls.__name__.startswith("Harts")
    rng = np.random.default_rng(4)
    seqs, tree_of = _grpo(rng, rng.integers(5, 60, 8).tolist())  # 8 trees of 4
    nested = torch.nested.as_nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)

    from transfer_queue.metadata import KVBatchMeta

    # the transfer queue's batch: its reorder moves the keys and the tags (seq_len) alike
    lens = [len(s) for s in seqs]
    keys = [f"k{i}" for i in range(len(seqs))]
    tags = [{"seq_len": n} for n in lens]
    batch = KVBatchMeta(keys=list(keys), tags=tags, partition_id="train")

    def kv_batch_get(keys, partition_id, select_fields):
        assert select_fields == ["input_ids"] and partition_id == "train"
        return {"input_ids": nested}

    monkeypatch.setattr(tq, "kv_batch_get", kv_batch_get)
    tree, stock = {"strategy": "harts_fsdp2"}, {"strategy": "fsdp2"}
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "actor": {
                    **(tree if tree_section == "actor" else stock),
                    "ppo_mini_batch_size": 2,
                    "shuffle": False,
                },
                "rollout": {"n": 4},
            },
            "critic": {
                **(tree if tree_section == "critic" else stock),
                "ppo_mini_batch_size": 2,
                "shuffle": False,
            },
            "algorithm": {"adv_estimator": "gae"},
        }
    )
    fake = types.SimpleNamespace(
        config=cfg,
        actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": [0, 0, 1, 1]}),
        _get_required_batch_multiple=lambda dp: 8,
        tokenizer=types.SimpleNamespace(eos_token_id=0),
    )
    metrics = {}
    assert cls._balance_batch(fake, batch, metrics) is batch
    order, expected = harts_balance_batch(
        seqs, 2, 4, [False] * len(seqs)
    )  # 32 / (2 x 4) = 4 prompts x n per step
    assert batch.keys == [keys[i] for i in order]
    assert [t["seq_len"] for t in batch.tags] == [lens[i] for i in order]
    assert {k: v for k, v in metrics.items() if k.startswith("harts/")} == expected
    # veRL's own per-rank token metrics, of the ranks' parts of this order (stock names; they
    # were read from the tags after the reorder, with the indices of before it)
    rank_tokens = [sum(lens[i] for i in order[r * 16 : (r + 1) * 16]) for r in range(2)]
    assert metrics["global_seqlen/balanced_min"] == min(rank_tokens)
    assert metrics["global_seqlen/balanced_max"] == max(rank_tokens)
    assert metrics["global_seqlen/mean"] == sum(lens) / 2
    assert metrics["global_seqlen/max"] == max(sum(lens[:16]), sum(lens[16:]))
    for q in range(8):  # rank r, mini-batch k = the q-th consecutive block of 4: one whole tree
        assert len({tree_of[i] for i in order[q * 4 : (q + 1) * 4]}) == 1


# ----------------------------------------------------------------------------- placement search
def _sized_trees(sizes, prefix_lens=None, tail=1):
    """Tree t: ``sizes[t]`` trajectories sharing a root token ``100 + t`` and a prefix of
    ``prefix_lens[t]`` tokens, each with its own ``tail``-token suffix."""
    seqs, tree_of = [], []
    for t, size in enumerate(sizes):
        plen = 5 if prefix_lens is None else prefix_lens[t]
        for k in range(size):
            seqs.append([100 + t] + [t % 7] * plen + [k] * tail)
            tree_of.append(t)
    return seqs, tree_of


def _split_trees(parts, nm, tree_of):
    """Trees whose trajectories lie in more than one (rank, mini-batch) cell."""
    cell_of = {}
    for r, row in enumerate(zip(*_cells(parts, nm), strict=True)):
        for k, cell in enumerate(row):
            for i in cell:
                cell_of[i] = (r, k)
    seen: dict[int, set] = {}
    for i, t in enumerate(tree_of):
        seen.setdefault(t, set()).add(cell_of[i])
    return {t for t, c in seen.items() if len(c) > 1}


def _split_free_exists(sizes, cells, share):
    """Brute force: can whole trees fill ``cells`` cells of exactly ``share`` each?"""
    from functools import cache

    sizes = sorted(sizes, reverse=True)

    @cache
    def go(i, rooms):  # rooms sorted: cells with equal room are interchangeable
        if i == len(sizes):
            return all(r == 0 for r in rooms)
        return any(
            go(i + 1, tuple(sorted((*rooms[:c], r - sizes[i], *rooms[c + 1 :]))))
            for c, r in enumerate(rooms)
            if r >= sizes[i] and r not in rooms[:c]
        )

    return go(0, (share,) * cells)


def _check_shape(parts, n, dp, nm, forest):
    assert len(parts) == dp
    assert sorted(i for p in parts for i in p) == list(range(n))  # every trajectory once
    assert {len(p) for p in parts} <= {n // dp}
    rank = np.argsort(forest.leaf_order)
    for row in _cells(parts, nm):
        for cell in row:  # leaf order inside a cell
            assert list(rank[cell]) == sorted(rank[cell])


def test_split_free_placement_when_greedy_would_cut():
    """Sizes 3,3,2,2,2 on two cells of 6: largest-first onto the least-loaded cell ends 3+2 per
    cell and would cut a 2; the exact search finds {3,3} | {2,2,2}."""
    seqs, tree_of = _sized_trees([3, 3, 2, 2, 2], prefix_lens=[20, 20, 10, 10, 10])
    parts = tree_balanced_partition(seqs, 2)
    forest = RolloutForest.from_sequences(seqs)
    _check_shape(parts, len(seqs), 2, 1, forest)
    assert not _split_trees(parts, 1, tree_of)
    assert sorted(sorted({tree_of[i] for i in p}) for p in parts) == [[0, 1], [2, 3, 4]]
    # nothing is duplicated across ranks: the ranks' work adds up to the whole trie
    assert sum(compact_work(forest, p) for p in parts) == forest.num_compact_tokens


@pytest.mark.parametrize(
    "dp,nm,sizes",
    [
        (2, 1, [5, 5, 2, 2, 2, 2, 2]),
        (2, 1, [4, 4, 4, 3, 3, 3, 3]),
        (3, 1, [6, 6, 4, 4, 4, 4, 4, 4]),
        (1, 3, [3, 3, 3, 3, 2, 2, 2]),
        (2, 2, [5, 5, 5, 5, 5, 5, 2, 2, 2, 2, 2]),
    ],
)
def test_split_free_placement_greedy_hard_cases(dp, nm, sizes, monkeypatch):
    """Instances where the greedy placement alone cuts a tree (checked with the search off)."""
    import harts_verl.workers.balance as balance

    seqs, tree_of = _sized_trees(sizes, prefix_lens=[3 * s + t for t, s in enumerate(sizes)])
    parts = tree_balanced_partition(seqs, dp, nm)
    _check_shape(parts, len(seqs), dp, nm, RolloutForest.from_sequences(seqs))
    assert not _split_trees(parts, nm, tree_of)
    monkeypatch.setattr(balance, "_SEARCH_BUDGET", 0)
    monkeypatch.setattr(balance, "_COMPLETE_BUDGET", 0)
    assert _split_trees(tree_balanced_partition(seqs, dp, nm), nm, tree_of)


def test_cut_only_when_no_split_free_placement_or_budget(monkeypatch):
    import harts_verl.workers.balance as balance

    # 4,4,4 into cells of 6: impossible without cutting a tree; sizes stay equal
    seqs, tree_of = _sized_trees([4, 4, 4])
    parts = tree_balanced_partition(seqs, 2)
    _check_shape(parts, 12, 2, 1, RolloutForest.from_sequences(seqs))
    assert len(_split_trees(parts, 1, tree_of)) == 1
    # search budgets exhausted: the greedy placement with its cut, still a valid partition
    monkeypatch.setattr(balance, "_SEARCH_BUDGET", 0)
    monkeypatch.setattr(balance, "_COMPLETE_BUDGET", 0)
    seqs, tree_of = _sized_trees([3, 3, 2, 2, 2])
    parts = tree_balanced_partition(seqs, 2)
    _check_shape(parts, 12, 2, 1, RolloutForest.from_sequences(seqs))
    assert len(_split_trees(parts, 1, tree_of)) == 1


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.integers(1, 10), st.data())
def test_cell_by_cell_search_finds_a_placement_iff_one_exists(cells, share, data):
    """The cell-by-cell search alone (``_patterns``, dealt by ``_deal``) vs brute force: a
    placement of whole pieces filling every cell exactly whenever one exists (returns every
    piece once), None otherwise."""
    from harts_verl.workers.balance import _deal, _patterns

    sizes: list[int] = []
    while sum(sizes) < cells * share:
        left = cells * share - sum(sizes)
        sizes.append(data.draw(st.integers(1, min(share, left)), label="size"))
    size = np.array(sizes, np.int64)
    work = np.array(
        data.draw(st.lists(st.integers(1, 99), min_size=len(sizes), max_size=len(sizes))), np.int64
    )
    patterns = _patterns(size, share, cells)
    ids = _deal(patterns, size, work) if isinstance(patterns, list) else None
    assert (ids is not None) == _split_free_exists(sizes, cells, share)
    if ids is not None:
        assert sorted(i for c in ids for i in c) == list(range(len(sizes)))
        assert [int(size[c].sum()) for c in ids] == [share] * cells


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.integers(1, 10), st.data())
def test_exact_search_proves_there_is_no_filling(cells, share, data):
    """``_exact`` within its budget: a filling whenever one exists, else None with
    ``ran_out`` False, a proof the balancer relies on to skip the size-count search's whole
    budget (brute force)."""
    from harts_verl.workers.balance import _exact

    sizes: list[int] = []
    while sum(sizes) < cells * share:
        left = cells * share - sum(sizes)
        sizes.append(data.draw(st.integers(1, min(share, left)), label="size"))
    work = np.arange(1, len(sizes) + 1, dtype=np.int64)[::-1].copy()
    ids, ran_out = _exact(np.array(sizes, np.int64), work, share, cells)
    assert not ran_out
    assert (ids is not None) == _split_free_exists(sizes, cells, share)
    if ids is not None:
        assert [sum(sizes[i] for i in c) for c in ids] == [share] * cells


def _fewest_cells(sizes, share):
    """Brute force: the fewest cells of ``share`` that hold the pieces ``sizes`` whole."""
    return next(c for c in range(1, len(sizes) + 1) if _fits_whole(sizes, c, share))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(1, 12), min_size=1, max_size=9))
def test_cells_needed_is_a_lower_bound(share, sizes):
    """The bound that spares the searches a hopeless batch never exceeds the fewest cells
    whole pieces need (brute force): a placement it rules out does not exist."""
    from harts_verl.workers.balance import _cells_needed

    sizes = [min(v, share) for v in sizes]
    need = _cells_needed(np.bincount(sizes, minlength=share + 1), share)
    assert -(-sum(sizes) // share) <= need <= _fewest_cells(sizes, share)


@pytest.mark.parametrize(
    "sizes,share,cells",
    [
        ([16] * 46 + [1] * 160, 28, 32),  # 46 pieces over half a cell, 32 cells
        ([8] * 39 + [1] * 56, 23, 16),  # three pieces of 8 exceed a cell of 23: 32 at most
    ],
)
def test_hopeless_batches_are_ruled_out_without_a_search(sizes, share, cells, monkeypatch):
    """Pieces no exact filling can place (the bound says so) are ruled out before the searches,
    which spent their whole budgets on such batches (~2 s per balancing step)."""
    import harts_verl.workers.balance as balance

    def searched(*_):
        raise AssertionError("searched")

    monkeypatch.setattr(balance, "_completions", searched)
    monkeypatch.setattr(balance, "_exact", searched)  # the searches it spares
    size = np.array(sizes, np.int64)
    assert int(size.sum()) == share * cells
    assert balance._patterns(size, share, cells) is False
    assert not _split_free_exists(sizes, cells, share)


@pytest.mark.parametrize("dp,nm,share,smallest", [(8, 8, 16, 5), (8, 16, 24, 7), (16, 16, 16, 4)])
def test_no_tree_split_with_many_cells(dp, nm, share, smallest, monkeypatch):
    """64-256 cells built from trees of ``smallest``..``share`` trajectories (a split-free
    placement exists by construction): the first search runs out on these, the cell-by-cell one
    finds a placement; with both budgets at zero, trees are cut."""
    import harts_verl.workers.balance as balance

    rng = np.random.default_rng(dp * nm + share)
    sizes: list[int] = []
    for _ in range(dp * nm):
        left = share
        while left:
            s = int(rng.integers(min(smallest, left), left + 1)) if left > smallest else left
            sizes.append(s)
            left -= s
    sizes = rng.permutation(sizes).tolist()
    seqs, tree_of = _sized_trees(sizes, prefix_lens=rng.integers(0, 30, len(sizes)).tolist())
    forest = RolloutForest.from_sequences(seqs)
    parts = tree_balanced_partition(forest, dp, nm)
    _check_shape(parts, len(seqs), dp, nm, forest)
    assert not _split_trees(parts, nm, tree_of)
    cell_work = [compact_work(forest, c) for row in _cells(parts, nm) for c in row]
    assert sum(cell_work) == forest.num_compact_tokens  # whole trees: nothing duplicated
    assert parts == tree_balanced_partition(seqs, dp, nm)  # deterministic
    monkeypatch.setattr(balance, "_COMPLETE_BUDGET", 0)
    assert _split_trees(tree_balanced_partition(forest, dp, nm), nm, tree_of)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([(2, 1), (3, 1), (2, 2), (4, 1), (1, 3)]),
    st.sampled_from([1, 2, 3, 4, 5, 6, 8, 10, 12]),
    st.booleans(),
    st.data(),
)
def test_no_tree_split_when_a_split_free_placement_exists(grid, share, built, data):
    """Random tree sizes (brute force decides whether a split-free placement exists, else how
    few trees a placement can cut), or cells built from equal trees of a divisor of the cell
    size (one exists; greedy often misses it)."""
    dp, nm = grid
    cells = dp * nm
    sizes: list[int] = []
    if built:
        divisors = [d for d in range(1, share + 1) if share % d == 0]
        for _ in range(cells):
            d = data.draw(st.sampled_from(divisors), label="tree size")
            sizes += [d] * (share // d)
        sizes = data.draw(st.permutations(sizes), label="order")
    else:
        while sum(sizes) < cells * share:
            left = cells * share - sum(sizes)
            sizes.append(data.draw(st.integers(1, min(share, left)), label="size"))
    plens = data.draw(st.lists(st.integers(0, 30), min_size=len(sizes), max_size=len(sizes)))
    tail = data.draw(st.integers(1, 4), label="tail")
    seqs, tree_of = _sized_trees(sizes, plens, tail)
    parts = tree_balanced_partition(seqs, dp, nm)
    forest = RolloutForest.from_sequences(seqs)
    _check_shape(parts, len(seqs), dp, nm, forest)
    if built or _split_free_exists(sizes, cells, share):
        assert not _split_trees(parts, nm, tree_of)
        cell_work = [compact_work(forest, c) for row in _cells(parts, nm) for c in row]
        assert sum(cell_work) == forest.num_compact_tokens
    elif len(sizes) <= 8:  # else the fewest trees any placement cuts (brute force)
        assert len(_split_trees(parts, nm, tree_of)) == _fewest_cut(sizes, cells, share)


@settings(max_examples=120, deadline=None)
@given(
    sequence_lists(max_traj=24, alphabet=3),
    st.sampled_from([(1, 1), (2, 1), (3, 1), (2, 2), (4, 1), (2, 3), (4, 2)]),
)
def test_partition_covers_once_equal_sizes_deterministic(seqs, grid):
    dp, nm = grid
    seqs = seqs[: len(seqs) // (dp * nm) * (dp * nm)]
    forest = RolloutForest.from_sequences(seqs)
    parts = tree_balanced_partition(seqs, dp, nm)
    _check_shape(parts, len(seqs), dp, nm, forest)
    assert parts == tree_balanced_partition(forest, dp, nm)  # deterministic, same on a forest
    assert parts == tree_balanced_partition([list(s) for s in seqs], dp, nm)


def _swap_reference(sizes, work, ids):
    """The plain-loop swap rule (first strictly best swap in (other cell, a, b) order)."""
    for _ in range(64):
        loads = [sum(work[i] for i in c) for c in ids]
        hi = int(np.argmax(loads))
        best = None
        for lo in range(len(ids)):
            if lo == hi:
                continue
            for a in ids[hi]:
                for b in ids[lo]:
                    if sizes[a] != sizes[b] or work[a] <= work[b]:
                        continue
                    d = work[a] - work[b]
                    new_max = max(loads[hi] - d, loads[lo] + d)
                    if new_max < loads[hi] and (best is None or new_max < best[0]):
                        best = (new_max, lo, a, b)
        if best is None:
            return
        _, lo, a, b = best
        ids[hi][ids[hi].index(a)] = b
        ids[lo][ids[lo].index(b)] = a


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 5), st.integers(1, 14), st.data())
def test_vectorized_swap_matches_reference(cells, p, data):
    from types import SimpleNamespace

    from harts_verl.workers.balance import _swap, _Work

    sizes = data.draw(st.lists(st.integers(1, 3), min_size=p, max_size=p))
    work = data.draw(st.lists(st.integers(4, 40), min_size=p, max_size=p))  # ties likely
    cell = data.draw(st.lists(st.integers(0, cells - 1), min_size=p, max_size=p))
    ids = [[i for i in range(p) if cell[i] == c] for c in range(cells)]
    ref = [list(c) for c in ids]
    _swap_reference(sizes, work, ref)
    # piece i: a tree of its own (first token i + 1) of sizes[i] trajectories and work[i] rows,
    # so a cell's exact work is the sum of its pieces' (the estimate is exact, no swap refused)
    seqs = [
        [i + 1] + [0] * (w - s - 1) + [k]
        for i, (s, w) in enumerate(zip(sizes, work))
        for k in range(s)
    ]
    lv = _Work(RolloutForest.from_sequences(seqs))
    starts = np.cumsum([0, *sizes]).tolist()
    pcs = SimpleNamespace(ranges=[(starts[i], starts[i + 1]) for i in range(p)])
    assert [lv.range_work(a, b) for a, b in pcs.ranges] == work
    _swap(lv, pcs, np.array(sizes, np.int64), np.array(work, np.int64), ids)
    assert ids == ref


def test_many_single_trajectory_trees():
    """rollout.n = 1: every trajectory its own tree (2496 of them, dp 8; this was cubic)."""
    rng = np.random.default_rng(0)
    seqs = [[i + 1, *rng.integers(0, 1000, int(rng.integers(5, 40))).tolist()] for i in range(2496)]
    forest = RolloutForest.from_sequences(seqs)
    parts = tree_balanced_partition(forest, 8, 2)
    _check_shape(parts, len(seqs), 8, 2, forest)
    work = np.array([[compact_work(forest, c) for c in row] for row in _cells(parts, 2)])
    assert work.sum() == forest.num_compact_tokens
    assert work.max() <= forest.num_compact_tokens / 16 + max(len(s) for s in seqs)


def test_padding_samples_beside_a_chat_template_cut_no_more_prompt_groups():
    """veRL's V1 upsampler pads a batch with 128-EOS samples: beside a chat template every real
    trajectory is then below the batch's one branch (one 'tree', cut anyway), so cutting a
    prompt group cost nothing in the ranking; the placement keeping the groups whole wins."""
    eos = 151645
    rng = np.random.default_rng(0)
    base = []
    for g, s in enumerate([3, 5, 5, 6]):
        prompt = rng.integers(0, 150000, 30).tolist()
        base += [(g, prompt + rng.integers(0, 150000, int(rng.integers(10, 200))).tolist())]
        base += [
            (g, prompt + rng.integers(0, 150000, int(rng.integers(10, 200))).tolist())
            for _ in range(s - 1)
        ]
    seqs = [_TEMPLATE + s for _, s in base] + [[eos] * 128]
    tree_of = [g for g, _ in base] + [-1]
    parts = tree_balanced_partition(seqs, 2)
    assert not _split_trees(parts, 1, tree_of)  # {5, 5} | {3, 6, pad}


def test_trainer_balances_for_a_tree_critic_with_another_dp_size(monkeypatch):
    """Actor DP 2 (Ulysses SP 2), tree critic DP 4 (its SP 1): the critic's chunks keep the
    trees whole too (they were halves of the actor's cells)."""
    pytest.importorskip("transfer_queue")
    import types

    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from transfer_queue.metadata import KVBatchMeta

    from harts_verl.workers.trainer import trainer_class

    rng = np.random.default_rng(0)
    seqs, tree_of = [], []
    for t, size in enumerate([3, 5, 2, 6, 4, 4, 1, 7]):
        prompt = [1000 + t, *rng.integers(0, 9000, 40).tolist()]
        for _ in range(size):
            seqs.append(prompt + rng.integers(0, 9000, int(rng.integers(20, 300))).tolist())
            tree_of.append(t)
    nested = torch.nested.as_nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)
    monkeypatch.setattr(tq, "kv_batch_get", lambda **kw: {"input_ids": nested})
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "actor": {"strategy": "harts_fsdp2", "ppo_mini_batch_size": 32, "shuffle": False},
                "rollout": {"n": 1},
            },
            "critic": {"strategy": "harts_fsdp2", "ppo_mini_batch_size": 32, "shuffle": False},
            "algorithm": {"adv_estimator": "gae"},
            "trainer": {"critic_warmup": 0},
        }
    )
    fake = types.SimpleNamespace(
        config=cfg,
        global_steps=1,
        actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": [0, 0, 1, 1]}),
        critic_wg=types.SimpleNamespace(_dispatch_info={"train": [0, 1, 2, 3]}),
        _get_required_batch_multiple=lambda dp: 32,
        tokenizer=types.SimpleNamespace(eos_token_id=0),
    )
    keys = [f"k{i}" for i in range(32)]
    batch = KVBatchMeta(keys=list(keys), tags=[{"seq_len": len(s)} for s in seqs])
    trainer_class("sync")._balance_batch(fake, batch, {})
    order = [keys.index(k) for k in batch.keys]
    for dp in (2, 4):  # the actor's chunks and the critic's
        per = 32 // dp
        rank = {i: pos // per for pos, i in enumerate(order)}
        assert all(len({rank[i] for i in range(32) if tree_of[i] == t}) == 1 for t in range(8))


def _fits_whole(sizes, cells, share, empty=None):
    """Brute force: do whole trees fit ``cells`` cells of at most ``share`` each (the padding
    fills the rest), leaving at most ``empty`` cells without a tree (None: any number)?"""
    from functools import cache

    sizes = sorted(sizes, reverse=True)

    @cache
    def go(i, rooms):
        if i == len(sizes):
            return empty is None or rooms.count(share) <= empty
        return any(
            go(i + 1, tuple(sorted((*rooms[:c], r - sizes[i], *rooms[c + 1 :]))))
            for c, r in enumerate(rooms)
            if r >= sizes[i] and r not in rooms[:c]
        )

    return go(0, (share,) * cells)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.integers(1, 7), min_size=1, max_size=7),
    st.integers(1, 4),
    st.integers(1, 2),
    st.booleans(),
    st.integers(0, 2**31),
    st.integers(0, 2),
)
@example(sizes=[1, 1, 3, 1, 1], dp=3, nm=1, template=True, seed=0, extra=0)  # cut without tags
@example(sizes=[3, 4, 4, 4, 5], dp=3, nm=1, template=False, seed=0, extra=0)  # one must be cut
@example(sizes=[1, 3, 1, 1, 3], dp=4, nm=1, template=False, seed=484505, extra=0)  # idle rank
@example(sizes=[1, 1], dp=2, nm=1, template=False, seed=7, extra=1)  # [R, R] | [P, P]
def test_padding_samples_never_cost_a_cut_tree(sizes, dp, nm, template, seed, extra):
    """veRL's upsampler pads a batch with identical 128-EOS samples tagged ``is_padding``
    (``extra``: to a multiple larger than the cells, whole cells' worth of padding more):
    passed as ``padding``, they fill cells one by one. No cell holds padding only where there
    are real trajectories enough (such a rank or mini-batch has no loss token and veRL's DP
    mean would average its zero metrics in), and beyond that no more real trees are cut than
    any placement must (brute force); the cells stay in leaf order and their works exact."""
    rng = np.random.default_rng(seed)
    eos = 151645
    seqs, tree_of = [], []
    for t, s in enumerate(sizes):
        prompt = [1000 + t, *rng.integers(0, 150000, int(rng.integers(5, 300))).tolist()]
        for _ in range(s):
            tail = rng.integers(0, 150000, int(rng.integers(1, 200))).tolist()
            seqs.append((_TEMPLATE if template else []) + prompt + tail)
            tree_of.append(t)
    cells = dp * nm
    npad = (-len(seqs)) % cells + extra * cells
    at = sorted(rng.choice(len(seqs) + npad, npad, replace=False).tolist())  # anywhere
    for i in at:
        seqs.insert(i, [eos] * 128)
        tree_of.insert(i, -1 - i)
    padding = [t < 0 for t in tree_of]
    if len(sizes) == 1:  # one prompt: the trees are below its lowest branch (each trajectory)
        sizes, tree_of = [1] * sizes[0], [i if t >= 0 else t for i, t in enumerate(tree_of)]
    forest = RolloutForest.from_sequences(seqs)
    parts, grid = tree_balanced_cells(forest, dp, nm, padding)
    _check_shape(parts, len(seqs), dp, nm, forest)
    for k, row in enumerate(_cells(parts, nm)):
        assert [compact_work(forest, c) for c in row] == grid[k].tolist()
    share = len(seqs) // cells
    split = _split_trees(parts, nm, tree_of)
    if not npad:
        assert len(split) == 0 if _fits_whole(sizes, cells, share) else len(split) >= 1
        return
    idle = [c for row in _cells(parts, nm) for c in row if all(padding[i] for i in c)]
    assert len(idle) == max(cells - sum(sizes), 0)
    assert len(split) == _fewest_cut(sizes, cells, share, busy=True)


def _fewest_cut(sizes, cells, share, busy=False):
    """Brute force: the fewest trees to cut so that the others fit whole (:func:`_fits_whole`);
    ``busy``: and every cell holds a real trajectory, as far as there are real trajectories
    (the cut trees' trajectories fill the cells the whole trees leave empty)."""
    import itertools

    for k in range(len(sizes) + 1):
        for cut in itertools.combinations(range(len(sizes)), k):
            rest = [s for t, s in enumerate(sizes) if t not in cut]
            spare = sum(sizes) - sum(rest) + max(cells - sum(sizes), 0)
            if _fits_whole(rest, cells, share, spare if busy else None):
                return k
    raise AssertionError("cutting every tree always fits")


def test_padding_info_costs_no_cut_tree_under_a_chat_template():
    """Trees of 4, 5, 4, 3, 4 under a chat template and one padding sample on 3 cells of 7: one
    tree must be cut. Without the tags the template made the real trajectories one tree whose
    pieces were cut finer until one real tree was cut; with them the trees are whole pieces,
    so one of them (the largest) is cut at its lowest branch, not two by the greedy fill."""
    seqs, tree_of = [], []
    for t, size in enumerate([4, 5, 4, 3, 4]):
        for k in range(size):
            seqs.append(_TEMPLATE + [1000 + t, t, t] + [2000 + k] * 2)
            tree_of.append(t)
    seqs.append([151645] * 128)
    tree_of.append(-1)
    forest = RolloutForest.from_sequences(seqs)
    parts, grid = tree_balanced_cells(forest, 3, 1, [t < 0 for t in tree_of])
    _check_shape(parts, len(seqs), 3, 1, forest)
    assert grid[0].tolist() == [compact_work(forest, c) for c in parts]
    assert len(_split_trees(parts, 1, tree_of)) == 1 == _fewest_cut([4, 5, 4, 3, 4], 3, 7)
    assert len(_split_trees(tree_balanced_partition(forest, 3), 1, tree_of)) == 1


def test_identical_padding_samples_count_once():
    """veRL's padding samples are identical: two in one cell run 128 rows, not 256. Counted
    twice, the placement {t0, t1, P} | {t2, t2', P} (max 336) looked better than
    {t1, t2, t2'} | {t0, P, P} (max 271, the best that keeps t2 whole)."""
    import itertools

    seqs = [
        [1000] + [0] * 50 + [7] * 59,
        [1001] + [1] * 50 + [7] * 47,
        [1002] + [2] * 50 + [7] * 58,
        [1002] + [2] * 50 + [8] * 64,
        [151645] * 128,
        [151645] * 128,
    ]
    forest = RolloutForest.from_sequences(seqs)
    best = min(
        max(compact_work(forest, list(c)), compact_work(forest, sorted({*range(6)} - {*c})))
        for c in itertools.combinations(range(6), 3)
        if len({2, 3} & {*c}) != 1
    )
    parts, grid = tree_balanced_cells(forest, 2, 1, [False] * 4 + [True] * 2)
    assert grid.max() == best == 271
    assert grid[0].tolist() == [compact_work(forest, c) for c in parts]


def test_padding_samples_spread_rather_than_leave_a_rank_without_a_loss_token():
    """Two padding samples and 1 + 3 real trajectories on 3 cells of 2: the tree of 3 is cut
    anyway. The two identical padding samples together (128 rows) would balance best, largest
    cell 128, but that cell has no loss token (veRL's DP mean would average its zero metrics
    in); so each goes beside a real trajectory, at the least largest cell of such placements
    (brute force over all 15 placements)."""
    import itertools

    seqs = [
        [1000] + [0] * 6 + [2000] * 26,
        [1001] + [1] * 17 + [2000] * 25,
        [1001] + [1] * 17 + [2001] * 17,
        [1001] + [1] * 17 + [2002] * 16,
        [151645] * 128,
        [151645] * 128,
    ]
    forest = RolloutForest.from_sequences(seqs)
    assert tree_balanced_cells(forest, 3, 1)[1].max() == 128  # without the tags: [P, P]
    parts, grid = tree_balanced_cells(forest, 3, 1, [False] * 4 + [True] * 2)
    _check_shape(parts, 6, 3, 1, forest)
    assert grid[0].tolist() == [compact_work(forest, c) for c in parts]
    assert len(_split_trees(parts, 1, [0, 1, 1, 1, -1, -2])) == 1
    assert all(min(c) < 4 for c in parts)  # a real trajectory in every cell
    best = min(
        max(compact_work(forest, list(c)) for c in cells)
        for a in itertools.combinations(range(1, 6), 1)
        for b in itertools.combinations(sorted({*range(1, 6)} - {*a}), 2)
        if b[0] == min({*range(1, 6)} - {*a})
        for cells in [((0, *a), b, tuple(sorted({*range(1, 6)} - {*a} - {*b})))]
        if all(min(c) < 4 for c in cells)
    )
    assert grid.max() == best


def test_padding_mask_is_checked():
    seqs = [[1, 2], [1, 3], [4], [4]]
    with pytest.raises(ValueError, match=r"padding: expected one bool per trajectory \(4\)"):
        tree_balanced_partition(seqs, 2, padding=[True, False])
    with pytest.raises(ValueError, match=r"padding: .*int64"):
        tree_balanced_partition(seqs, 2, padding=np.array([0, 0, 1, 1]))
    assert tree_balanced_partition(seqs, 2, padding=[False] * 4) == tree_balanced_partition(seqs, 2)


def test_trainer_passes_veRL_padding_tags(monkeypatch):
    """The trainer reads the upsampler's ``is_padding`` tags: three padding samples beside
    trees of 3 and 2 at dp 2 (cells of 4) go 1 + 2, keeping both trees whole (as one tree the
    three would have been kept together and a real tree cut)."""
    pytest.importorskip("transfer_queue")
    import types

    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from transfer_queue.metadata import KVBatchMeta

    from harts_verl.workers.trainer import trainer_class

    rng = np.random.default_rng(1)
    seqs, tree_of = [], []
    for t, size in enumerate([3, 2]):
        prompt = [1000 + t, *rng.integers(0, 9000, 400).tolist()]
        for _ in range(size):
            seqs.append(_TEMPLATE + prompt + rng.integers(0, 9000, 20).tolist())
            tree_of.append(t)
    seqs += [[0] * 128] * 3
    tree_of += [-1, -2, -3]
    nested = torch.nested.as_nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)
    monkeypatch.setattr(tq, "kv_batch_get", lambda **kw: {"input_ids": nested})
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "actor": {"strategy": "harts_fsdp2", "ppo_mini_batch_size": 8, "shuffle": False},
                "rollout": {"n": 1},
            },
            "algorithm": {"adv_estimator": "grpo"},
            "trainer": {"critic_warmup": 0},
        }
    )
    fake = types.SimpleNamespace(
        config=cfg,
        global_steps=1,
        actor_rollout_wg=types.SimpleNamespace(_dispatch_info={"actor": [0, 1]}),
        _get_required_batch_multiple=lambda dp: 8,
        tokenizer=types.SimpleNamespace(eos_token_id=0),
    )
    keys = [f"k{i}" for i in range(8)]
    tags = [
        {"seq_len": len(s), **({"is_padding": True} if t < 0 else {})}
        for s, t in zip(seqs, tree_of)
    ]
    batch = KVBatchMeta(keys=list(keys), tags=tags)
    metrics = {}
    trainer_class("sync")._balance_batch(fake, batch, metrics)
    assert metrics["harts/dp_padding_samples"] == 3.0
    assert metrics["harts/dp_padding_only_cells"] == 0.0
    rank = {keys.index(k): pos // 4 for pos, k in enumerate(batch.keys)}
    assert all(len({rank[i] for i in range(8) if tree_of[i] == t}) == 1 for t in range(2))


@pytest.mark.parametrize(
    "real,dp,nm,idle", [(1, 2, 2, 3), (3, 2, 2, 1), (4, 2, 2, 0), (6, 4, 1, 0)]
)
def test_padding_only_cells_metric(real, dp, nm, idle):
    """``harts/dp_padding_only_cells``: the ranks' mini-batches left without a loss token,
    which only a batch with fewer real trajectories than cells has (one group of ``real``
    samples padded to two trajectories per cell)."""
    from harts_verl.workers.trainer import harts_balance_batch

    prompt = list(range(100, 400))
    seqs = [prompt + [1000 + i] * (10 + i) for i in range(real)]
    npad = 2 * dp * nm - real
    order, metrics = harts_balance_batch(
        seqs + [[0] * 128] * npad, dp, nm, [False] * real + [True] * npad
    )
    assert sorted(order) == list(range(real + npad))
    assert metrics["harts/dp_padding_samples"] == npad
    assert metrics["harts/dp_padding_only_cells"] == idle == max(dp * nm - real, 0)
    cells = [order[c * 2 : c * 2 + 2] for c in range(dp * nm)]
    assert sum(all(i >= real for i in c) for c in cells) == idle
    assert "harts/dp_padding_only_cells" not in harts_balance_batch(seqs[:1] * 4, 2, 2)[1]


@pytest.mark.parametrize("template", [False, True])
def test_real_trajectories_that_fit_one_cell_spread_over_the_padded_cells(template):
    """veRL's upsampler can pad a batch to a multiple larger than its cells (4 real → 16 at
    dp 4): two prompt groups of 2 beside 12 padding samples on 4 cells of 4. Kept as one piece
    the real trajectories all ran on one rank ([2002, 128, 128, 128]); kept as whole groups two
    ranks held padding only (no loss token: veRL's DP mean would halve their metrics). Now every
    rank holds one real trajectory, both groups cut, and the largest cell is the longest
    trajectory's beside one padding sample (a whole group's was larger)."""
    rng = np.random.default_rng(0)
    seqs, tree_of = [], []
    for t in range(2):
        prompt = [1000 + t, *rng.integers(0, 9000, 400).tolist()]
        for _ in range(2):
            seqs.append(
                (_TEMPLATE if template else []) + prompt + rng.integers(0, 9000, 300).tolist()
            )
            tree_of.append(t)
    seqs += [[151645] * 128] * 12
    tree_of += list(range(-1, -13, -1))
    forest = RolloutForest.from_sequences(seqs)
    parts, grid = tree_balanced_cells(forest, 4, 1, [t < 0 for t in tree_of])
    _check_shape(parts, 16, 4, 1, forest)
    assert grid[0].tolist() == [compact_work(forest, c) for c in parts]
    assert sorted(sum(i < 4 for i in p) for p in parts) == [1, 1, 1, 1]
    assert _split_trees(parts, 1, tree_of) == {0, 1}
    assert grid.max() == max(len(s) for s in seqs) + 128
    assert grid.max() < compact_work(forest, [0, 1]) + 128  # a whole group's cell
    assert tree_balanced_cells(forest, 4, 1)[1].max() == compact_work(forest, [0, 1, 2, 3])


def test_no_rank_of_padding_only_when_the_trees_can_fill_every_rank():
    """Four prompt groups of 2 below one 288-token prompt and 8 padding samples on 2 ranks: the
    least work keeps every real trajectory on rank 0 ([356, 128]), but rank 1 then has no loss
    token and veRL's DP mean halves ``ppo_kl`` / ``pg_clipfrac``; the groups spread instead."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 9000, 288).tolist()
    seqs = []
    for _ in range(4):
        prompt = shared + rng.integers(3, 9000, 5).tolist()
        seqs += [prompt + rng.integers(3, 9000, 6).tolist() for _ in range(2)]
    seqs += [[2] * 128] * 8
    padding = [False] * 8 + [True] * 8
    forest = RolloutForest.from_sequences(seqs)
    assert tree_balanced_cells(forest, 2, 1)[1].tolist() == [[356, 128]]  # without the tags
    parts, grid = tree_balanced_cells(forest, 2, 1, padding)
    _check_shape(parts, 16, 2, 1, forest)
    assert all(any(not padding[i] for i in p) for p in parts)
    assert not _split_trees(parts, 1, [i // 2 for i in range(8)] + list(range(-1, -9, -1)))
    assert grid.tolist() == [[compact_work(forest, p) for p in parts]] == [[450, 450]]


def test_one_whole_tree_is_cut_when_some_tree_must_be():
    """Trees of 2, 2, 2, 4, 6, 6, 6 on 4 cells of 7: no placement keeps every tree whole, and
    with every piece a whole tree the greedy fills cut two; cutting the largest tree at its
    lowest branch and searching again cuts one (the brute-force minimum)."""
    sizes = [2, 2, 2, 4, 6, 6, 6]
    seqs, tree_of = _sized_trees(sizes, [20] * 7, 3)
    parts = tree_balanced_partition(seqs, 2, 2)
    _check_shape(parts, 28, 2, 2, RolloutForest.from_sequences(seqs))
    assert len(_split_trees(parts, 2, tree_of)) == 1 == _fewest_cut(sizes, 4, 7)


@pytest.mark.parametrize(
    "real",
    [
        [[1000] + [5] * 299, [1001] + [6] * 59],  # two one-trajectory prompts
        [[1000] + [5] * 39, [1001] + [6] * 200 + [7] * 50, [1001] + [6] * 200 + [8] * 60],
    ],
)
def test_padding_fills_behind_the_real_trees(real):
    """Whole trees that can give every rank a loss token do so, even where a rank of padding
    only balances better: the greedy placed the 128-row padding samples before a lighter real
    tree (all onto the empty rank), and a swap of a real trajectory for a padding sample moved
    a rank's last real trajectory away ([R, R] | [P, P] at dp 2 before)."""
    seqs = real + [[151645] * 128] * len(real)
    padding = [False] * len(real) + [True] * len(real)
    forest = RolloutForest.from_sequences(seqs)
    parts, grid = tree_balanced_cells(forest, 2, 1, padding)
    _check_shape(parts, len(seqs), 2, 1, forest)
    assert grid[0].tolist() == [compact_work(forest, p) for p in parts]
    assert all(any(not padding[i] for i in p) for p in parts), parts
    tree_of = [s[0] if not pad else -1 - i for i, (s, pad) in enumerate(zip(seqs, padding))]
    assert not _split_trees(parts, 1, tree_of)


@pytest.mark.parametrize("dp,nm", [(4, 1), (2, 2)])
def test_a_tree_cut_anyway_fills_the_cells_padding_would_fill_alone(dp, nm):
    """Trees of 4 and 3 and 5 padding samples on 4 cells of 3: the tree of 4 is cut anyway.
    Cut into two pieces (3 + 1), the pieces and the tree of 3 left a cell of padding only; cut
    further (still one tree cut), every cell holds a real trajectory."""
    seqs = [[1000] + [5] * 100 + [10 + k] * (30 + 7 * k) for k in range(4)]
    seqs += [[1001] + [6] * 80 + [20 + k] * (40 + 5 * k) for k in range(3)]
    seqs += [[151645] * 128] * 5
    padding = [False] * 7 + [True] * 5
    forest = RolloutForest.from_sequences(seqs)
    parts, grid = tree_balanced_cells(forest, dp, nm, padding)
    _check_shape(parts, 12, dp, nm, forest)
    cells = [c for row in _cells(parts, nm) for c in row]
    assert [compact_work(forest, c) for c in cells] == grid.ravel().tolist()
    assert all(any(not padding[i] for i in c) for c in cells), cells
    assert _split_trees(parts, nm, [0] * 4 + [1] * 3 + list(range(-1, -6, -1))) == {0}


@pytest.mark.parametrize(
    "groups,dp,nm,n",
    [
        (12, 8, 3, 48),  # every group must be cut: one per refine round left 4 such cells
        (19, 16, 2, 64),  # veRL's upsampler: 38 real → 64 (mini-batches of 32), 5 were left
        (480, 64, 8, 1024),  # 512 cells, past the refinement's cell bound: 32 were left
    ],
)
def test_no_cell_of_padding_only_when_many_prompt_groups_must_be_cut(groups, dp, nm, n):
    """Prompt groups of 2 beside padding on more cells than groups: every cell can hold a real
    trajectory only if more groups are cut than the refine rounds cut one by one (or, past
    :data:`~harts_verl.workers.balance._REFINE_MAX_CELLS` cells, than none at all); the groups
    are cut as the cells need, and no cell (a rank's mini-batch) holds padding only."""
    rng = np.random.default_rng(0)
    seqs = []
    for t in range(groups):
        prompt = [1000 + t % 7000, *rng.integers(0, 9000, 12).tolist()]
        for _ in range(2):
            seqs.append(prompt + rng.integers(0, 9000, int(rng.integers(5, 30))).tolist())
    padding = [False] * len(seqs) + [True] * (n - len(seqs))
    seqs += [[151645] * 128] * (n - len(seqs))
    forest = RolloutForest.from_sequences(seqs)
    parts, grid = tree_balanced_cells(forest, dp, nm, padding)
    _check_shape(parts, n, dp, nm, forest)
    cells = [c for row in _cells(parts, nm) for c in row]
    assert [compact_work(forest, c) for c in cells] == grid.ravel().tolist()
    assert all(any(not padding[i] for i in c) for c in cells)
