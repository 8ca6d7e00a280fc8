"""Fork sampling: budget, fork paths, GRPO groups and the uids veRL's GRPO reads (no Ray).

A scripted server client answers each request with calculator calls for a number of turns chosen
per request id (request ids are made deterministic by patching ``uuid4`` in the agent loop), so
tests decide which branches end before their next fork point. The worker test drives the fork
worker's ``_run_prompt`` with veRL's own ``_agent_loop_postprocess`` (TransferQueue puts are
captured) and feeds what it stores to veRL's GRPO advantage computation.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import re

import numpy as np
import pytest
from _calc_loop import calc_loop_env

pytest.importorskip("verl")

from harts_verl.tree import RolloutForest
from harts_verl.workers.envs.testing import TokenOut
from harts_verl.workers.rollout import agent_loop as agent_loop_mod
from harts_verl.workers.rollout.agent_loop import (
    FORK_GROUP_KEY,
    FORK_PATH_KEY,
    ForkSpec,
    fork_groups,
)
from harts_verl.workers.rollout.fork import (
    GROUP_UID_KEY,
    PROMPT_UID_KEY,
    TRAJ_UID_KEY,
    branch_uids,
    check_rollout_n,
    group_uid,
)
from harts_verl.workers.rollout.recorder import TREE_KEY, forest_from_metadata

PROMPT_UID = "0b9e3c1a-5f7d-4e2b-9c1d-2a3b4c5d6e7f"


# ---------------------------------------------------------------------- fork_groups (pure)
def test_fork_groups_prompt_and_fork_modes():
    paths = [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert fork_groups(paths, "prompt") == [()] * 4
    assert fork_groups(paths, "fork") == [(0,), (0,), (1,), (1,)]
    # leaves directly below the prompt form the prompt's group
    assert fork_groups([(0,), (1,), (2,)], "fork") == [(), (), ()]
    assert fork_groups([()], "fork") == [()]  # one leaf: nothing to merge with
    with pytest.raises(ValueError, match=r"fork\.group"):
        fork_groups(paths, "leaf")


@pytest.mark.parametrize(
    ("paths", "expected"),
    [
        # 0.1 is alone at fork 0: it joins its sibling subtree 0.0's group (diverged at fork 0),
        # not the cousins 1.x (diverged at the prompt)
        ([(0, 0, 0), (0, 0, 1), (0, 1), (1, 0), (1, 1)], [(0, 0), (0, 0), (0, 0), (1,), (1,)]),
        # leaf 1 is alone at the prompt level: joins the smallest group (ties: lowest path)
        ([(0, 0), (0, 1), (1,), (2, 0), (2, 1)], [(0,), (0,), (0,), (2,), (2,)]),
        # budget 3 on turns [0, 1]: the share-1 branch joins its sibling subtree
        ([(0, 0), (0, 1), (1,)], [(0,), (0,), (0,)]),
        # two singletons at different depths end up together at the prompt level
        ([(0, 0), (0, 1), (1, 0), (2,)], [(0,), (0,), (), ()]),
        ([(0,), (1, 0), (2, 0, 0)], [(), (), ()]),
    ],
)
def test_fork_groups_merge_singletons(paths, expected):
    groups = fork_groups(paths, "fork")
    assert groups == expected
    assert min(groups.count(g) for g in groups) >= 2


# ---------------------------------------------------------------------- uids (pure)
def test_group_uid_keeps_prompt_uid_first():
    assert group_uid(PROMPT_UID, "") == PROMPT_UID
    g = group_uid(PROMPT_UID, "0.1")
    assert g == f"{PROMPT_UID}_f0.1"
    key = f"{g}_3_0"  # veRL's TransferQueue key {uid}_{session}_{index}
    # replay buffer / prompt status read the prompt uid before the first "_"
    assert key.split("_")[0] == PROMPT_UID and key.split("_", 1)[0] == PROMPT_UID
    # advantage broadcast reads the session key as all but the last two parts
    uid, session, index = key.rsplit("_", 2)
    assert (uid, session, index) == (g, "3", "0")
    with pytest.raises(ValueError):
        group_uid(PROMPT_UID, "0_1")


class _FakeOut:
    def __init__(self, path, group):
        self.extra_fields = {FORK_PATH_KEY: path, FORK_GROUP_KEY: group}


def test_branch_uids_writes_ids():
    outs = [_FakeOut("0.0", "0"), _FakeOut("0.1", "0"), _FakeOut("1", "")]
    uids = branch_uids(PROMPT_UID, outs)
    assert uids == [f"{PROMPT_UID}_f0", f"{PROMPT_UID}_f0", PROMPT_UID]
    trajs = [o.extra_fields[TRAJ_UID_KEY] for o in outs]
    assert trajs == [f"{PROMPT_UID}_f0_0", f"{PROMPT_UID}_f0_1", f"{PROMPT_UID}_2"]
    assert all(o.extra_fields[PROMPT_UID_KEY] == PROMPT_UID for o in outs)
    assert [o.extra_fields[GROUP_UID_KEY] for o in outs] == uids


def test_check_rollout_n():
    from omegaconf import OmegaConf

    def cfg(n, budget, enable=True):
        return OmegaConf.create(
            {
                "actor_rollout_ref": {"rollout": {"n": n}},
                "harts_rollout": {"fork": {"enable": enable, "budget": budget}},
            }
        )

    assert check_rollout_n(cfg(4, 4)) is None
    assert check_rollout_n(cfg(2, 4, enable=False)) is None
    assert "rollout.n=2" in check_rollout_n(cfg(2, 4))


# ---------------------------------------------------------------------- ForkSpec config (pure)
@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"budget": 4.7}, r"fork\.budget: expected an int >= 1, got 4\.7"),
        ({"branching": 2.9}, r"fork\.branching: expected an int >= 1, got 2\.9"),
        ({"turns": [0.5, 1.5]}, r"fork\.turns: expected integer turn numbers, got 0\.5"),
        ({"turns": "01"}, r"fork\.turns: expected a list of turn numbers"),
        ({"turns": 1}, r"fork\.turns: expected a list of turn numbers"),
        ({"turns": [0, True]}, r"fork\.turns: expected integer turn numbers, got True"),
        ({"budgte": 8}, r"fork\.budgte: unknown key \(did you mean 'budget'\?\)"),
        ({"budget": "four"}, r"fork\.budget: expected an int >= 1, got 'four'"),
        ({"budget": True}, r"fork\.budget: expected an int >= 1, got True"),
        ({"budget": float("inf")}, r"fork\.budget: expected an int >= 1, got inf"),
        ({"budget": 0}, r"fork\.budget: expected >= 1, got 0"),
        ({"policy": 3}, r"fork\.policy: expected 'turns' or 'every', got 3"),
        ({"group": None}, r"fork\.group: expected one of"),
    ],
)
def test_fork_spec_from_config_rejects_bad_values(cfg, match):
    """No truncation (4.7 is not 4), no string-to-list splitting, no ignored typos."""
    with pytest.raises(ValueError, match=match):
        ForkSpec.from_config(cfg)


def test_fork_spec_rejects_bad_values_directly():
    for kw, field in (
        ({"budget": 4.7}, "budget"),
        ({"budget": float("inf")}, "budget"),
        ({"branching": 2.0}, "branching"),
        ({"turns": "01"}, "turns"),
        ({"turns": (0, 1.5)}, "turns"),
    ):
        with pytest.raises(ValueError, match=rf"fork\.{field}"):
            ForkSpec(**kw)
    with pytest.raises(ValueError, match=r"fork: expected a mapping"):
        ForkSpec.from_config(["budget", 4])


def test_fork_spec_accepts_numpy_ints_and_normalises():
    spec = ForkSpec(turns=[np.int64(0), 2], branching=np.int32(3), budget=np.int64(6))
    assert spec.turns == (0, 2) and type(spec.turns[0]) is int
    assert type(spec.branching) is int and type(spec.budget) is int
    assert hash(spec) == hash(ForkSpec(turns=(0, 2), branching=3, budget=6))
    assert ForkSpec.from_config({"turns": None, "enable": True}) == ForkSpec()


def test_fork_spec_of_reads_enable_strictly(monkeypatch):
    from omegaconf import OmegaConf

    from harts_verl.workers.rollout.fork import fork_spec_of

    def cfg(fork):
        return OmegaConf.create({"harts_rollout": {"fork": fork}})

    # bool("false") is True: a string must not switch forking on (or off)
    for value in ("false", "true", 1, None):
        with pytest.raises(ValueError, match=r"harts_rollout\.fork\.enable: expected a bool"):
            fork_spec_of(cfg({"enable": value}))
    with pytest.raises(ValueError, match=r"oc\.decode"):
        fork_spec_of(cfg({"enable": "false"}))
    assert fork_spec_of(cfg({"enable": False})) is None
    assert fork_spec_of(cfg({"enable": True, "budget": 8})).budget == 8
    # the documented way to take it from the environment
    monkeypatch.setenv("HARTS_TEST_FORK", "false")
    assert fork_spec_of(cfg({"enable": "${oc.decode:${oc.env:HARTS_TEST_FORK,true}}"})) is None
    monkeypatch.setenv("HARTS_TEST_FORK", "true")
    assert fork_spec_of(cfg({"enable": "${oc.decode:${oc.env:HARTS_TEST_FORK,false}}"}))
    # misspelled keys are errors even while disabled; malformed nodes name their key
    with pytest.raises(ValueError, match=r"fork\.budgte: unknown key"):
        fork_spec_of(cfg({"enable": True, "budgte": 8}))
    with pytest.raises(ValueError, match=r"fork\.brnaching: unknown key"):
        fork_spec_of(cfg({"enable": False, "brnaching": 8}))
    with pytest.raises(ValueError, match=r"harts_rollout\.fork: expected a mapping"):
        fork_spec_of(cfg("on"))
    with pytest.raises(ValueError, match=r"harts_rollout: expected a mapping"):
        fork_spec_of(OmegaConf.create({"harts_rollout": 3}))
    assert fork_spec_of(OmegaConf.create({"harts_rollout": None})) is None
    assert fork_spec_of(OmegaConf.create({"harts_rollout": {"fork": None}})) is None
    # a misspelled ``fork`` turned forking off without a word
    forks = OmegaConf.create({"harts_rollout": {"forks": {"enable": True, "budget": 4}}})
    with pytest.raises(ValueError, match=r"harts_rollout\.forks: unknown key \(did you mean"):
        fork_spec_of(forks)


def test_fork_sampling_needs_the_fork_manager():
    """Only HartsAgentLoopManager reads harts_rollout: fork sampling enabled beside another
    manager sampled unforked without a word; main_ppo now refuses it at startup."""
    from omegaconf import OmegaConf

    from harts_verl.workers.rollout.fork import MANAGER_PATH, check_fork_manager

    def cfg(manager, enable=True):
        return OmegaConf.create(
            {
                "actor_rollout_ref": {
                    "rollout": {"n": 4, "agent": {"agent_loop_manager_class": manager}}
                },
                "harts_rollout": {"fork": {"enable": enable, "budget": 4}},
            }
        )

    check_fork_manager(cfg(MANAGER_PATH))
    check_fork_manager(cfg(None, enable=False))  # off: any manager
    for manager in (None, "verl.trainer.ppo.v1.agent_loop_tq.AgentLoopManagerTQ", "no.such.Mgr"):
        with pytest.raises(ValueError, match=r"agent_loop_manager_class=harts_verl\.workers"):
            check_fork_manager(cfg(manager))


def test_fork_spec_refuses_turns_with_policy_every():
    """policy='every' forks at every boundary: turns given with it were silently unused."""
    for make in (
        lambda: ForkSpec(policy="every", turns=(2, 3)),
        lambda: ForkSpec.from_config({"policy": "every", "turns": [0, 1], "budget": 4}),
    ):
        with pytest.raises(ValueError, match=r"fork\.turns: \[\S+, \S+\] is not used by"):
            make()
    assert ForkSpec.from_config({"policy": "every", "turns": None}).boundary(3) == 3
    assert ForkSpec(policy="every", turns=[0]).boundary(1) == 1


# ---------------------------------------------------------------------- agent loop
@pytest.fixture(scope="module")
def env():
    calc = calc_loop_env(n=4, prompt_length=64, response_length=96, max_turns=6)
    tok, ids = calc["tok"], calc["ids"]
    tool_id = tok.convert_tokens_to_ids("<tool>")

    class Client:
        """Request ``r`` makes ``depth(r)`` calculator calls (operands from its id, so branches
        differ), then answers; ``depth`` defaults to ``default``."""

        def __init__(self, depth=None, default=3):
            self.depth = dict(depth or {})
            self.default = default
            self.calls: list[tuple[str, int]] = []

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            done = list(prompt_ids).count(tool_id)
            self.calls.append((request_id, done))
            k = int(hashlib.sha256(f"{request_id}/{done}".encode()).hexdigest(), 16)
            if done < self.depth.get(request_id, self.default):
                return TokenOut(ids(f"<call> add {k % 10} {k // 10 % 9}"))
            return TokenOut(ids(f"answer {k % 19 - 9} <eos>"))

    return {
        "make": calc["make"],
        "Client": Client,
        "raw_prompt": calc["raw_prompt"],
        "cfg": calc["cfg"],
        "tok": tok,
    }


class _Id:
    def __init__(self, n):
        self.hex = f"q{n}"


@pytest.fixture
def seq_ids(monkeypatch):
    """Deterministic request ids ``q0, q1, ...`` in creation order (``q0``: the prompt
    snapshot of a forked tree; children follow in spawn order)."""
    counter = itertools.count()
    monkeypatch.setattr(agent_loop_mod, "uuid4", lambda: _Id(next(counter)))


def _tree(env, client, spec):
    async def main():
        loop = env["make"](client)
        return await loop.run_tree({"temperature": 1.0}, fork=spec, raw_prompt=env["raw_prompt"])

    return asyncio.new_event_loop().run_until_complete(main())


def _paths(outs):
    return [o.extra_fields[FORK_PATH_KEY] for o in outs]


def _check_tree(outs, budget):
    """Budget met, distinct branches and last turns, metadata forest = token forest."""
    assert len(outs) == budget
    paths = _paths(outs)
    assert len(set(paths)) == budget
    tup = [tuple(p.split(".")) if p else () for p in paths]
    assert not any(a != b and a == b[: len(a)] for a in tup for b in tup)  # leaves only
    metas = [json.loads(o.extra_fields[TREE_KEY]) for o in outs]
    assert len({m["turns"][-1][0] for m in metas}) == budget
    assert [m["fork_path"] for m in metas] == paths
    seqs = [o.prompt_ids + o.response_ids for o in outs]
    forest, why = forest_from_metadata(seqs, [o.extra_fields[TREE_KEY] for o in outs])
    assert why == "", why
    assert forest.equals(RolloutForest.from_sequences(seqs))


def test_full_tree_groups_by_fork(env, seq_ids):
    client = env["Client"]()
    outs = _tree(env, client, ForkSpec(turns=(0, 1), branching=2, budget=4, group="fork"))
    _check_tree(outs, 4)
    assert _paths(outs) == ["0.0", "0.1", "1.0", "1.1"]
    assert [o.extra_fields[FORK_GROUP_KEY] for o in outs] == ["0", "0", "1", "1"]
    # the two turn-1 prefixes ran once each: 2 + 4 generate calls before the answers
    first_turn_calls = [c for c in client.calls if c[1] == 0]
    assert len(first_turn_calls) == 2


def test_budget_refilled_when_branches_end_before_next_fork(env, seq_ids):
    """The local CPU recipe's case: no branch makes a tool call, so none reaches fork turn 1.
    Before, each prompt gave 2 of its 4 trajectories (veRL padded 8 -> 16)."""
    client = env["Client"](default=0)
    outs = _tree(env, client, ForkSpec(turns=(0, 1), branching=2, budget=4, group="fork"))
    _check_tree(outs, 4)
    assert _paths(outs) == ["0", "1", "2", "3"]
    assert [o.extra_fields[FORK_GROUP_KEY] for o in outs] == [""] * 4
    assert len(client.calls) == 4


def test_budget_mixed_early_end(env, seq_ids):
    """Branch 0 (request q1) answers at once; branch 1 (q2) forks at turn 1; the refill child
    (branch 2) gets branch 0's unused share."""
    client = env["Client"](depth={"q1": 0})
    outs = _tree(env, client, ForkSpec(turns=(0, 1), branching=2, budget=4, group="fork"))
    _check_tree(outs, 4)
    assert _paths(outs) == ["0", "1.0", "1.1", "2"]
    assert [o.extra_fields[FORK_GROUP_KEY] for o in outs] == ["", "1", "1", ""]


def test_prefix_ending_before_first_fork_restarts_from_prompt(env, seq_ids):
    client = env["Client"](default=0)
    outs = _tree(env, client, ForkSpec(turns=(1,), branching=2, budget=3, group="fork"))
    _check_tree(outs, 3)
    assert sorted(_paths(outs)) == ["0", "1", "2"]
    assert len({c[0] for c in client.calls}) == 3  # three independent requests


@pytest.mark.parametrize(
    ("spec", "paths"),
    [
        (ForkSpec(turns=(1,), branching=3, budget=5), ["0", "1", "2", "3", "4"]),
        (ForkSpec(turns=(0, 1), branching=2, budget=3), ["0.0", "0.1", "1"]),
        (ForkSpec(policy="every", branching=2, budget=5), None),
        (ForkSpec(turns=(), branching=2, budget=3), ["0", "1", "2"]),  # plain n samples
    ],
)
def test_budget_is_exact(env, seq_ids, spec, paths):
    client = env["Client"]()
    outs = _tree(env, client, spec)
    _check_tree(outs, spec.budget)
    if paths is not None:
        assert _paths(outs) == paths
    if spec.turns == (1,):  # turn 1 is shared by every branch: generated once
        assert len([c for c in client.calls if c[1] == 0]) == 1


def test_no_fork_is_one_trajectory(env, seq_ids):
    client = env["Client"](default=1)
    outs = _tree(env, client, None)
    assert len(outs) == 1 and outs[0].extra_fields[FORK_PATH_KEY] == ""
    outs = _tree(env, client, ForkSpec(turns=(0,), budget=1, group="fork"))
    assert len(outs) == 1 and outs[0].extra_fields[FORK_GROUP_KEY] == ""


def test_an_empty_first_generation_is_an_empty_response(env, seq_ids):
    """A first generate call that returns no tokens (an aborted vLLM request) gives an empty
    response and the whole prompt as the prompt. veRL 0.9.1's ToolAgentLoop slices
    ``prompt_ids[-0:]`` there and returns the prompt again as the response (mask 0); the
    loop keeps the tokens the model saw once (documented in docs/recipes.md)."""

    class Empty:
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            self.prompt = list(prompt_ids)
            return TokenOut([])

    client = Empty()
    outs = _tree(env, client, None)
    assert len(outs) == 1
    out = outs[0]
    assert out.prompt_ids == client.prompt and out.response_ids == [] and out.response_mask == []
    forest, why = forest_from_metadata([out.prompt_ids], [out.extra_fields[TREE_KEY]])
    assert why == "" and forest.equals(RolloutForest.from_sequences([client.prompt]))


def test_fork_copies_run_off_the_event_loop(env, seq_ids, monkeypatch):
    """Copying a fork point (a SWE sandbox clones itself there: a docker commit) runs in a
    worker thread, one copy of a point at a time (two points, in two branches, may copy at
    once), not on the event loop every trajectory shares."""
    import threading
    from collections import Counter

    threads, active, peak = [], Counter(), Counter()
    lock = threading.Lock()
    copy_fn = agent_loop_mod._copy_agent_data

    def recording(src, *args, **kwargs):
        with lock:
            threads.append(threading.current_thread())
            active[id(src)] += 1
            peak[id(src)] = max(peak[id(src)], active[id(src)])
        try:
            return copy_fn(src, *args, **kwargs)
        finally:
            with lock:
                active[id(src)] -= 1

    monkeypatch.setattr(agent_loop_mod, "_copy_agent_data", recording)
    outs = _tree(env, env["Client"](), ForkSpec(turns=(0, 1), branching=2, budget=4))
    _check_tree(outs, 4)
    branch_copies = [t for t in threads if t is not threading.main_thread()]
    assert len(branch_copies) == 6  # 2 + 2 × 2 branches, each off the event loop
    assert len(peak) == 3 and set(peak.values()) == {1}  # 3 fork points, one copy each at a time


def test_full_determinism_tree_does_not_follow_completion_order(env):
    """Under ``full_determinism`` the children that make up a branch's missing leaves are
    numbered from their lineage (each child reserves indices for its refills), so their paths,
    ids and seeds, and with them the tree, do not depend on which branch the server finishes
    first. Before, refills were numbered in completion order: a slow branch 0 or a slow branch
    1 gave two different trees (and a set's iteration order a third way to differ)."""
    calc = calc_loop_env(n=4, prompt_length=64, response_length=96, max_turns=6)
    calc["cfg"].actor_rollout_ref.rollout.full_determinism = True
    calc["cfg"].actor_rollout_ref.rollout.name = "harts_hf"  # seeds a request by its id
    tool_id = env["tok"].convert_tokens_to_ids("<tool>")
    ids = calc["ids"]

    class Client:
        """Deterministic in (request id, context); the root's fork children 0 and 1 end before
        fork turn 2, the others make two calls; ``slow``: the id suffix that answers late."""

        def __init__(self, slow):
            self.slow = slow

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            done = list(prompt_ids).count(tool_id)
            if self.slow and request_id.endswith(self.slow):
                await asyncio.sleep(0.02)
            k = int(hashlib.sha256(f"{request_id}/{len(prompt_ids)}".encode()).hexdigest(), 16)
            root_child = request_id.count("/") == 1 and request_id[-2:] in ("/0", "/1")
            if done < (1 if root_child else 2):
                return TokenOut(ids(f"<call> add {k % 10} {k // 10 % 9}"))
            return TokenOut(ids(f"answer {k % 19 - 9} <eos>"))

    spec = ForkSpec(turns=(0, 2), branching=2, budget=7)  # root shares [4, 3]
    trees = set()
    for slow in ("/0", "/1", None, None):
        outs = _tree({**env, "make": calc["make"]}, Client(slow), spec)
        _check_tree(outs, spec.budget)
        trees.add(
            tuple((p, tuple(o.prompt_ids + o.response_ids)) for p, o in zip(_paths(outs), outs))
        )
    assert len(trees) == 1
    paths = [p for p, _ in next(iter(trees))]
    # children 0 and 1 end early: 0's three missing leaves go to 2 (share 2: forks) and 3,
    # 1's two to 5 and 6 (4 stays reserved for child 2's refill, unused)
    assert paths == ["0", "1", "2.0", "2.1", "3", "5", "6"]


@pytest.mark.parametrize(
    ("spec", "depth", "ids"),
    [
        (
            ForkSpec(turns=(0, 1), branching=2, budget=4),
            {},
            {"det-0/0", "det-0/1"} | {f"det-0/{i}/{i}.{j}" for i in (0, 1) for j in (0, 1)},
        ),
        # the prefix ends before the first fork point: the others start from the prompt
        (
            ForkSpec(turns=(1,), budget=3),
            {"det-0": 0},
            {"det-0", "det-0/prompt/1", "det-0/prompt/2"},
        ),
    ],
)
def test_full_determinism_forked_rollout_is_reproducible(env, spec, depth, ids):
    """``rollout.full_determinism``: veRL names the root request ``det-{priority}``; the fork
    branches' ids derive from it and their fork paths (not random), so a server that seeds a
    request by its id samples the same tree twice, and the branches still differ. On vLLM each
    branch also gets a seed of its own (veRL's vLLM server seeds every request alike there),
    the same in every run; a caller's seed is kept."""
    calc = calc_loop_env(n=4, prompt_length=64, response_length=96, max_turns=6)
    calc["cfg"].actor_rollout_ref.rollout.full_determinism = True
    calc["cfg"].actor_rollout_ref.rollout.name = "vllm"
    env = {**env, "make": calc["make"], "cfg": calc["cfg"]}
    runs = []
    for _ in range(2):
        client = env["Client"](depth=depth, default=2 if spec.turns == (0, 1) else 0)
        seeds: dict[str, set] = {}
        generate = client.generate

        async def recording(request_id, *, sampling_params, _gen=generate, _seeds=seeds, **kw):
            _seeds.setdefault(request_id, set()).add(sampling_params.get("seed"))
            return await _gen(request_id, sampling_params=sampling_params, **kw)

        client.generate = recording
        outs = _tree(env, client, spec)
        _check_tree(outs, spec.budget)
        runs.append(([o.prompt_ids + o.response_ids for o in outs], sorted(client.calls), seeds))
    assert runs[0] == runs[1]
    # below the root, ids carry a hash of the root's conversation (other prompts: other ids)
    tagged = {c[0] for c in runs[0][1]} - {"det-0"}
    assert all(re.match(r"det-0:[0-9a-f]{8}/", rid) for rid in tagged), tagged
    assert {re.sub(r"^det-0:[0-9a-f]{8}", "det-0", c[0]) for c in runs[0][1]} == ids
    assert len({tuple(s) for s in runs[0][0]}) == spec.budget
    seeds = runs[0][2]
    assert seeds.get("det-0", {None}) == {None}  # the root: the server's own seed
    branch = {rid: s for rid, s in seeds.items() if rid != "det-0"}
    assert all(len(s) == 1 and None not in s for s in branch.values())
    assert len({next(iter(s)) for s in branch.values()}) == len(branch)
    # a caller's seed wins
    client = env["Client"](depth=depth, default=2 if spec.turns == (0, 1) else 0)
    seen = []
    generate = client.generate

    async def recording2(request_id, *, sampling_params, **kw):
        seen.append(sampling_params.get("seed"))
        return await generate(request_id, sampling_params=sampling_params, **kw)

    client.generate = recording2

    async def main():
        loop = env["make"](client)
        params = {"temperature": 1.0, "seed": 5}
        return await loop.run_tree(params, fork=spec, raw_prompt=env["raw_prompt"])

    asyncio.new_event_loop().run_until_complete(main())
    assert set(seen) == {5}
    # another server (harts_hf seeds a request by its id): no seeds added
    calc["cfg"].actor_rollout_ref.rollout.name = "harts_hf"
    seen.clear()
    client.calls.clear()
    _tree(env, client, spec)
    assert set(seen) == {None} and {c[0] for c in client.calls} == {c[0] for c in runs[0][1]}
    # another prompt: other branch ids
    other = {**env, "raw_prompt": [{"role": "user", "content": "what is 2 add 3"}]}
    client = env["Client"](depth=depth, default=2 if spec.turns == (0, 1) else 0)
    _tree(other, client, spec)
    assert not ({c[0] for c in client.calls} - {"det-0"}) & tagged


# ---------------------------------------------------------------------- fork worker + GRPO
def _reward(response_ids):
    """Scripted reward from the branch's own tokens."""
    h = hashlib.sha256(bytes(int(t) % 256 for t in response_ids)).digest()
    return int.from_bytes(h[:4], "little") / 2**32


def _run_worker(env, monkeypatch, group, depth, agent_name="harts_tool_agent"):
    tq = pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf

    from harts_verl.workers.rollout import fork as fork_mod
    from harts_verl.workers.rollout import local_task

    cfg = OmegaConf.merge(
        env["cfg"],
        {
            "harts_rollout": {
                "fork": {
                    "enable": True,
                    "turns": [0, 1],
                    "branching": 2,
                    "budget": 4,
                    "group": group,
                }
            }
        },
    )
    cls = fork_mod.fork_worker_class().__ray_metadata__.modified_class
    worker = cls.__new__(cls)
    worker.config = cfg
    worker.llm_client = env["Client"](depth=depth)
    worker.tokenizer = env["tok"]
    worker.processor = None
    worker.hf_model_type = None
    worker.dataset_cls = None
    worker.tools = [local_task.calc_tool()]
    worker.distillation_enabled = False

    async def score(outputs, kwargs):
        out = outputs[-1]
        out.reward_score = _reward(out.response_ids)
        out.extra_fields["reward_extra_info"] = {}

    worker._compute_score = score
    puts, statuses = [], []

    async def kv_put(key, partition_id, tag=None, **kw):
        statuses.append((key, partition_id, tag["status"]))

    async def kv_batch_put(keys, fields, tags, partition_id):
        puts.append((keys, fields, tags, partition_id))

    monkeypatch.setattr(tq, "async_kv_put", kv_put)
    monkeypatch.setattr(tq, "async_kv_batch_put", kv_batch_put)
    prompt = {
        "raw_prompt": env["raw_prompt"],
        "uid": PROMPT_UID,
        "index": 0,
        "global_steps": 1,
        "agent_name": agent_name,
        "data_source": "harts_calc",
        "extra_info": {},
    }
    traj = {"validate": False, "step": 1, "sample_index": 0, "rollout_n": 0}
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    asyncio.new_event_loop().run_until_complete(worker._run_prompt(prompt, params, traj))
    assert statuses == [
        (PROMPT_UID, "train", "running"),
        (PROMPT_UID, "train", "finished"),
    ], statuses
    keys, rows = [], []
    for k, td, _, part in puts:
        assert part == "train" and len(k) == 1
        keys.append(k[0])
        rows.append(td[0])
    return keys, rows


def _grpo(keys, rows):
    """veRL's V1 advantage step on the stored fields (as ``_compute_advantage`` reads them)."""
    import torch
    from torch.nn.utils.rnn import pad_sequence
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    rm = pad_sequence([r["rm_scores"] for r in rows], batch_first=True)
    mask = pad_sequence([r["response_mask"] for r in rows], batch_first=True)
    uids = np.array([r["uid"] for r in rows], dtype=object)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rm.float(), "response_mask": mask},
        non_tensors={"uid": uids},
    )
    out = compute_advantage_for_multi_trajectories(
        data, batch_keys=keys, adv_estimator="grpo", num_repeat=4, norm_adv_by_std_in_grpo=True
    )
    adv = out.batch["advantages"]
    first = mask.argmax(dim=1)
    return adv[torch.arange(len(rows)), first], rm.sum(dim=1)


def _expected(scores, groups):
    import torch

    exp = torch.empty_like(scores)
    for g in set(groups):
        idx = [i for i, h in enumerate(groups) if h == g]
        s = scores[idx]
        exp[idx] = (s - s.mean()) / (s.std() + 1e-6) if len(idx) > 1 else s
    return exp


@pytest.mark.parametrize(
    ("group", "depth", "paths", "groups"),
    [
        ("fork", {}, ["0.0", "0.1", "1.0", "1.1"], ["0", "0", "1", "1"]),
        ("prompt", {}, ["0.0", "0.1", "1.0", "1.1"], ["", "", "", ""]),
        # branch 0 (q1) ends at turn 1: leaves 0 and the refill 2 form the prompt-level group
        ("fork", {"q1": 0}, ["0", "1.0", "1.1", "2"], ["", "1", "1", ""]),
    ],
)
def test_worker_stores_group_uids_for_grpo(env, seq_ids, monkeypatch, group, depth, paths, groups):
    import torch

    keys, rows = _run_worker(env, monkeypatch, group, depth)
    extra = [r["extra_fields"] for r in rows]
    assert [e[FORK_PATH_KEY] for e in extra] == paths
    assert [e[FORK_GROUP_KEY] for e in extra] == groups
    # GRPO reads "uid": the group id; prompt bookkeeping reads the key's first part
    uids = [r["uid"] for r in rows]
    assert uids == [group_uid(PROMPT_UID, g) for g in groups]
    assert [e[GROUP_UID_KEY] for e in extra] == uids
    assert all(k.split("_")[0] == PROMPT_UID for k in keys)
    assert keys == [f"{u}_{i}_0" for i, u in enumerate(uids)]
    trajs = [e[TRAJ_UID_KEY] for e in extra]
    assert len(set(trajs)) == 4 and [f"{t}_0" for t in trajs] == keys
    assert [r["session_id"] for r in rows] == [0, 1, 2, 3]
    assert "agent_name" not in rows[0].keys()  # as veRL's own sessions
    # own rewards: from each branch's tokens, all different
    rewards = [float(r["rm_scores"].sum()) for r in rows]
    assert rewards == pytest.approx([_reward(r["responses"].tolist()) for r in rows])
    assert len(set(rewards)) == 4
    # veRL's GRPO step normalises within the intended groups
    adv, scores = _grpo(keys, rows)
    torch.testing.assert_close(adv, _expected(scores, groups), rtol=1e-4, atol=1e-5)
    for g in set(groups):
        idx = [i for i, h in enumerate(groups) if h == g]
        assert abs(float(adv[idx].sum())) < 1e-4  # zero mean per group
        assert float(adv[idx].abs().min()) > 0


def test_singleton_would_get_raw_score_in_verl_grpo():
    """Why singletons are merged: veRL's GRPO gives a group of one its raw score (mean 0,
    std 1), an advantage with no baseline."""
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    scores = torch.tensor([0.2, 0.9, 0.7])
    rewards = torch.zeros(3, 3)
    rewards[:, -1] = scores
    mask = torch.ones(3, 3)
    paths = [(0, 0), (0, 1), (1,)]  # budget 3 on turns [0, 1]: leaf 1 is alone at the prompt
    unmerged = np.array([str(p[:-1]) for p in paths], dtype=object)
    raw, _ = compute_grpo_outcome_advantage(rewards, mask, unmerged)
    assert raw[2, 0] == pytest.approx(0.7)
    merged = fork_groups(paths, "fork")
    assert merged == [(0,)] * 3
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([str(g) for g in merged]))
    expected = (scores - scores.mean()) / (scores.std() + 1e-6)
    torch.testing.assert_close(adv[:, 0], expected)


def test_fork_worker_accepts_subclasses_of_the_tree_loop():
    """The fork worker forks HartsToolAgentLoop and its subclasses (the τ³ loop), nothing else."""
    from harts_verl.workers.rollout.fork import _forks

    assert _forks("harts_verl.workers.rollout.agent_loop.HartsToolAgentLoop")
    assert _forks("harts_verl.workers.envs.tau_agent.HartsTauAgentLoop")
    assert not _forks("verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop")
    assert not _forks("")
    assert not _forks("no.such.module.Loop")


def test_fork_sampling_on_a_loop_that_cannot_fork_says_so(env, seq_ids, monkeypatch, caplog):
    """``harts_rollout.fork.enable=true`` with prompts whose agent loop is not a tree loop (the
    default ``single_turn_agent`` or veRL's ``tool_agent``: ``default_agent_loop`` left out and
    rows without ``agent_name``) samples them as veRL does, ``rollout.n`` unforked sessions.
    That ran without a word (only an unresolvable loop was named); now a WARNING names the
    agent loop and the key to set, once per agent loop and process."""
    import logging

    from harts_verl.workers.rollout import fork as fork_mod

    monkeypatch.setattr(fork_mod, "_unforked_warned", set())
    with caplog.at_level(logging.WARNING, logger=fork_mod.__name__):
        keys, rows = _run_worker(env, monkeypatch, "prompt", {}, agent_name="tool_agent")
        _run_worker(env, monkeypatch, "prompt", {}, agent_name="tool_agent")
    assert len(keys) == 4  # veRL's rollout.n sessions, no fork paths
    assert all(FORK_PATH_KEY not in r["extra_fields"] for r in rows)
    said = [r.getMessage() for r in caplog.records if "not forked" in r.getMessage()]
    assert len(said) == 1, said
    assert "'tool_agent'" in said[0] and "default_agent_loop" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=fork_mod.__name__):
        _run_worker(env, monkeypatch, "prompt", {})  # a tree loop: nothing to say
    assert not [r for r in caplog.records if "not forked" in r.getMessage()]


# ---------------------------------------------------------------------- review fixes
def test_fork_spec_accepts_integer_arrays():
    spec = ForkSpec(turns=np.array([0, 1]), budget=4)
    assert spec.turns == (0, 1) and all(type(t) is int for t in spec.turns)
    assert spec == ForkSpec(turns=(0, 1), budget=4) == ForkSpec(turns=[0, 1], budget=4)
    assert ForkSpec(turns=np.array([], dtype=np.int64)).turns == ()
    assert ForkSpec(turns=np.array([2], dtype=np.uint8)).turns == (2,)
    with pytest.raises(ValueError, match=r"fork\.turns: expected a 1-D list .* shape \(1, 2\)"):
        ForkSpec(turns=np.array([[0, 1]]))
    with pytest.raises(ValueError, match=r"fork\.turns: expected integer turn numbers, got 0\.5"):
        ForkSpec(turns=np.array([0.5]))
    with pytest.raises(ValueError, match=r"fork\.turns: expected integer turn numbers, got"):
        ForkSpec(turns=np.array([True]))
    with pytest.raises(ValueError, match=r"fork\.turns: expected a 1-D list"):
        ForkSpec(turns=np.array(1))


def test_independent_samples_start_together(env, seq_ids):
    """``turns=[]``: every sample's first generate starts before any sample's second one (the
    first sample used to run to its end before the others started)."""
    base = env["Client"]

    class Sleepy(base):
        def __init__(self):
            super().__init__(default=1)
            self.events: list[tuple[str, int]] = []

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            out = await super().generate(
                request_id, prompt_ids=prompt_ids, sampling_params=sampling_params
            )
            self.events.append(self.calls[-1])  # (request id, calls done) at start
            await asyncio.sleep(0.01)
            return out

    client = Sleepy()
    outs = _tree(env, client, ForkSpec(turns=(), budget=4))
    _check_tree(outs, 4)
    assert _paths(outs) == ["0", "1", "2", "3"]
    turns = [done for _, done in client.events]
    assert turns == [0] * 4 + [1] * 4, client.events
    assert len({rid for rid, _ in client.events}) == 4


def test_fork_with_state_that_cannot_be_copied_names_the_key(env, seq_ids):
    import threading

    base = env["Client"]

    class LockClient(base):
        async def generate(self, request_id, **kw):
            out = await super().generate(request_id, **kw)
            out.extra_fields = {"session": threading.Lock(), "step": 1}
            return out

    with pytest.raises(TypeError) as info:
        _tree(env, LockClient(), ForkSpec(turns=(1,), branching=2, budget=2))
    msg = str(info.value)
    assert "fork branch '0' (turn boundary 1 of request" in msg
    assert "agent_data.extra_fields['session'] (lock) is not deep-copyable" in msg
    assert "cannot pickle" in msg and isinstance(info.value.__cause__, TypeError)


def test_prompt_media_pass_through_and_are_copied_per_branch(env, seq_ids, monkeypatch):
    """As veRL's ``ToolAgentLoop.run``: the prompt's images/videos/audios (from
    ``process_multi_modal_info``) go to every generate call and to each output's
    ``multi_modal_data``; branches hold their own copies (a tool that appends an image to one
    branch must not change another)."""
    from harts_verl.workers.rollout.agent_loop import HartsToolAgentLoop

    seen = []

    async def mm(self, messages):  # what a VLM processor returns for one image and one audio
        return {"images": [["pixels"]], "audios": [[0.0, 0.5]]}

    monkeypatch.setattr(HartsToolAgentLoop, "process_multi_modal_info", mm)
    monkeypatch.setattr(HartsToolAgentLoop, "_assert_mm_supported", lambda self, flag: None)
    base = env["Client"]

    class MMClient(base):
        async def generate(self, request_id, **kw):
            seen.append((kw.pop("image_data"), kw.pop("audio_data"), kw.pop("video_data")))
            kw = {k: kw[k] for k in ("prompt_ids", "sampling_params")}
            return await super().generate(request_id, **kw)

    outs = _tree(env, MMClient(default=1), ForkSpec(turns=(1,), branching=2, budget=2))
    _check_tree(outs, 2)
    assert len(seen) == 3 and all(s == ([["pixels"]], [[0.0, 0.5]], None) for s in seen)
    mm0, mm1 = (o.multi_modal_data for o in outs)
    assert mm0 == mm1 == {"images": [["pixels"]], "audios": [[0.0, 0.5]]}
    assert mm0["images"] is not mm1["images"] and mm0["images"][0] is not mm1["images"][0]
    mm0["images"].append("tool image")
    assert mm1["images"] == [["pixels"]]
    # one trajectory without forks: the same pass-through
    seen.clear()
    (out,) = _tree(env, MMClient(default=0), None)
    assert out.multi_modal_data == {"images": [["pixels"]], "audios": [[0.0, 0.5]]}
    assert seen == [([["pixels"]], [[0.0, 0.5]], None)]


def test_derived_fork_ids_hash_images_by_their_bytes():
    """The root-conversation hash of a derived fork id is the same in every process: an image
    in the messages counts by its bytes, size and mode (``str()`` of a PIL image holds its
    memory address)."""
    pil = pytest.importorskip("PIL.Image")
    from harts_verl.workers.rollout.agent_loop import _canonical

    a, b = pil.new("RGB", (2, 2), (1, 2, 3)), pil.new("RGB", (2, 2), (1, 2, 3))
    assert str(a) != str(b) and _canonical(a) == _canonical(b)
    assert _canonical(a) != _canonical(pil.new("RGB", (2, 2), (1, 2, 4)))
    assert _canonical(object()) == "object"


def test_a_copy_that_fails_while_it_runs_is_named_and_not_retried():
    """A value whose ``__deepcopy__`` fails at run time (a sandbox clone whose ``docker
    commit`` fails, say) is a RuntimeError naming the key, copied once (the diagnosis used to
    copy every item again: a second clone); a plain dict copies as ``copy.deepcopy`` does, a
    value referring back to the dict included."""
    from harts_verl.workers.rollout.agent_loop import _deepcopy_field

    calls = []

    class Clones:
        def __deepcopy__(self, memo):
            calls.append(1)
            raise OSError("no space left on device")

    with pytest.raises(
        RuntimeError, match=r"failed at agent_data.extra_fields\['box'\] \(Clones\)"
    ):
        _deepcopy_field({"a": [1], "box": Clones()}, "extra_fields", "fork branch '0'")
    assert calls == [1]
    d = {"a": [1, 2]}
    d["self"] = d
    c = _deepcopy_field(d, "extra_fields", "x")
    assert c["self"] is c and c["a"] == [1, 2] and c["a"] is not d["a"]
