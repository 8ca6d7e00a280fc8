"""Turn recorder, ``harts_tool_agent`` and fork sampling with a fake server client (no Ray).

The fake client follows veRL's ``generate(request_id, *, prompt_ids, sampling_params, **kw) ->
TokenOutput`` contract and answers deterministically from (request id, context length), so
branches of a fork diverge. Pins: recorded trees equal the token-prefix forest; rewrites become
siblings; forks give the budgeted branch count with distinct request ids and own rewards (fork
groups, budget refill and GRPO uids: ``test_rollout_fork.py``);
``extra_fields`` metadata round-trips through veRL's TensorDict conversion and rebuilds the
forest in batch order.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json

import numpy as np
import pytest

from harts_verl.tree import RolloutForest
from harts_verl.workers.envs.testing import TokenOut
from harts_verl.workers.rollout.recorder import (
    TREE_KEY,
    RecordingServerClient,
    TurnRecorder,
    forest_from_metadata,
    tree_metadata,
)


class _ScriptClient:
    """Answers with a short pseudo-random token list from (request id, context length)."""

    def __init__(self, vocab: int = 40):
        self.vocab = vocab
        self.calls: list[tuple[str, list[int]]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        self.calls.append((request_id, list(prompt_ids)))
        h = hashlib.sha256(f"{request_id}/{len(prompt_ids)}".encode()).digest()
        return TokenOut([8 + b % (self.vocab - 8) for b in h[: 2 + h[31] % 4]])


def _run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def _run_loop(make, client, fn):
    """Build the agent loop inside the event loop it runs on (veRL captures the loop)."""

    async def main():
        loop = make(client)
        return loop, await fn(loop)

    return _run(main())


# ---------------------------------------------------------------------- recorder only
def test_recording_client_copies_and_forwards():
    """A copy shares the wrapped client and the recorder; a bare instance (as copy / unpickling
    build it) raises AttributeError, not RecursionError."""
    import copy

    inner = _ScriptClient()
    client = RecordingServerClient(inner)
    dup = copy.copy(client)
    assert dup._inner is inner and dup.recorder is client.recorder
    assert dup.calls is inner.calls  # other attributes are forwarded
    bare = object.__new__(RecordingServerClient)
    with pytest.raises(AttributeError):
        _ = bare.recorder


def test_recorder_chain_equals_token_prefix_forest():
    client = RecordingServerClient(_ScriptClient())
    rng = np.random.default_rng(0)

    async def session(rid: str, prompt: list[int], turns: int) -> list[int]:
        ctx = list(prompt)
        for _ in range(turns):
            out = await client.generate(rid, prompt_ids=ctx, sampling_params={})
            ctx = ctx + out.token_ids + rng.integers(0, 40, 3).tolist()  # tool answer
        return ctx

    async def main():
        p = [1, 2, 3, 4]
        return await asyncio.gather(session("a", p, 3), session("b", p, 2), session("c", [5], 1))

    _run(main())
    rec = client.recorder
    assert len(rec.turns) == 6 and rec.rewrites == 0
    forest = rec.forest()
    assert forest.equals(RolloutForest.from_sequences(rec.leaf_contexts()))
    # every request's spans spell its last context
    for rid in "abc":
        ctx = rec.chain(rid)[-1].context
        spans = rec.spans(rid, ctx)
        assert spans[0][1] is None and spans[-1][3] == len(ctx)
        assert all(s[2] == p[3] for p, s in itertools.pairwise(spans))


def test_rewrite_becomes_sibling():
    rec = TurnRecorder()
    t1 = rec.record("r", [1, 2, 3], [10, 11])
    t2 = rec.record("r", [1, 2, 3, 10, 11, 20], [12])
    # context management: drop turn 2's tool answer and summarise -> not a prefix any more
    t3 = rec.record("r", [1, 2, 3, 10, 11, 30, 31], [13, 14])
    assert t2.parent_turn_id == t1.turn_id
    assert t3.parent_turn_id == t1.turn_id and t3.rewrite and rec.rewrites == 1
    # a rewrite that keeps nothing becomes a new root
    t4 = rec.record("r", [9, 9], [1])
    assert t4.parent_turn_id is None
    forest = rec.forest()
    assert forest.num_trajectories == 3
    assert forest.equals(RolloutForest.from_sequences(rec.leaf_contexts()))
    # the final trajectory's spans cover it exactly (tail span for tokens after the last call)
    spans = rec.spans("r", [9, 9, 1, 7])
    assert spans == [[t4.turn_id, None, 0, 3], [f"{rec.prefix}:r#tail4", t4.turn_id, 3, 4]]


def test_recorder_stores_each_token_once():
    """A long multi-turn request stores O(its tokens), not O(turns x context): each turn keeps
    only what it adds; the list views (context, prompt, response) are rebuilt exactly."""
    rng = np.random.default_rng(3)
    rec = TurnRecorder()
    ctx: list[int] = rng.integers(0, 1000, 50).tolist()
    turns = []
    for _ in range(40):
        resp = rng.integers(0, 1000, int(rng.integers(1, 20))).tolist()
        turns.append((rec.record("r", ctx, np.asarray(resp, np.int32)), list(ctx), resp))
        ctx = ctx + resp + rng.integers(0, 1000, int(rng.integers(0, 30))).tolist()
    last = turns[-1][0]
    assert sum(t.tokens.shape[0] for t in rec.turns.values()) == last.end  # each token once
    for t, prompt, resp in turns:
        assert t.prompt_ids == prompt and t.response_ids == resp and t.context == prompt + resp
        assert t.tokens.dtype == np.int64 and t.token_ids == t.context[t.start :]
    with pytest.raises(TypeError, match="prompt_ids: expected a flat sequence of integer"):
        rec.record("r", [1.5, 2.0], [3])
    with pytest.raises(TypeError, match="response_ids: expected a flat sequence of integer"):
        rec.record("r", [1, 2], [[3]])
    with pytest.raises(TypeError, match="sequence: expected a flat sequence of integer"):
        rec.spans("r", ["a"])


def test_trimmed_turns_share_their_matched_part():
    """A chat template that drops each response's last token (its stop token) before the tool
    output (veRL's GLM token builder): no turn's context is a prefix of the next
    prompt, so every turn became a new root holding the whole context (O(turns x context)).
    Now the matched part of the trimmed turn is a turn of its own: storage stays within twice
    the request's tokens, and the forest, spans and metadata still spell every context."""
    rng = np.random.default_rng(7)
    rec = TurnRecorder()
    ctx: list[int] = rng.integers(0, 1000, 60).tolist()
    calls = []
    for _ in range(30):
        resp = [*rng.integers(0, 1000, int(rng.integers(1, 20))).tolist(), 7]
        lp = rng.normal(size=len(resp)).tolist()
        turn = rec.record("r", ctx, resp, lp)
        calls.append((turn, list(ctx), resp, lp))
        ctx = ctx + resp[:-1] + rng.integers(0, 1000, int(rng.integers(1, 30))).tolist()
    final = [*ctx, 5, 6]
    stored = sum(t.tokens.shape[0] for t in rec.turns.values())
    assert stored <= 2 * len(final)  # was Σ over turns of the whole context (≈ 15×)
    assert rec.rewrites == 29
    for turn, prompt, resp, lp in calls:  # every call's own views are kept exactly
        assert turn.prompt_ids == prompt and turn.response_ids == resp and turn.log_probs == lp
    for t in rec.turns.values():  # a matched part keeps what it holds of its turn's response
        assert t.log_probs is None or len(t.log_probs) == t.num_response
    head = rec.chain("r")[-1]
    assert head is calls[-1][0] and head.parent.parent_turn_id is not None  # not a root
    spans = rec.spans("r", final)
    assert spans[-1][3] == len(final) and all(s[2] == p[3] for p, s in itertools.pairwise(spans))
    forest, why = forest_from_metadata([final], [tree_metadata(spans)])
    assert why == "" and forest.equals(RolloutForest.from_sequences([final]))
    assert rec.forest().equals(RolloutForest.from_sequences(rec.leaf_contexts()))
    # a prompt that ends inside the matched part, with an empty generation: the head moves to
    # the part, nothing else is recorded
    rec2 = TurnRecorder()
    t1 = rec2.record("q", [1, 2, 3], [4, 5, 6])
    assert rec2.record("q", [1, 2, 3, 4, 5], []) is None
    (part,) = (t for t in rec2.turns.values() if t is not t1)
    assert rec2.heads["q"] == part.turn_id and part.context == [1, 2, 3, 4, 5]
    assert part.response_ids == [4, 5] and part.parent_turn_id is None


def test_metadata_forest_in_batch_order_and_fallback():
    rec = TurnRecorder()
    rec.record("a", [1, 2, 3], [4, 5])
    rec.fork("a", "b")
    rec.fork("a", "c")
    rec.record("b", [1, 2, 3, 4, 5, 6], [7])
    rec.record("c", [1, 2, 3, 4, 5, 8], [9, 9])
    seqs = [[1, 2, 3, 4, 5, 8, 9, 9], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7]]
    rids = ["c", "a", "b"]
    meta = [tree_metadata(rec.spans(r, s)) for r, s in zip(rids, seqs)]
    forest, why = forest_from_metadata(seqs, meta)
    assert why == "" and forest.equals(RolloutForest.from_sequences(seqs))
    # a's turn is shared by b and c's spans (same id, same tokens)
    ids = [json.loads(m)["turns"][0][0] for m in meta]
    assert len(set(ids)) == 1
    # inconsistent metadata is refused with a reason
    bad = list(meta)
    bad[0] = tree_metadata([["x", None, 0, 3]])
    assert forest_from_metadata(seqs, bad)[0] is None
    assert forest_from_metadata(seqs, [None, *meta[1:]])[1].startswith("trajectory 0")


def test_turn_ids_unique_across_recorders_with_the_same_request_id():
    """veRL's ``rollout.full_determinism`` gives every sample the request id ``det-0`` and each
    agent loop has its own recorder: the samples' turn ids must still differ, so the batch's
    forest comes from the metadata (it used to be refused: "turn 'det-0#0' differs")."""
    seqs, metas, ids = [], [], []
    for prompt, gen in (([1, 2, 3], [4, 5]), ([1, 2, 3], [6, 7]), ([1, 2, 3], [4, 5, 9])):
        rec = TurnRecorder()  # one recorder per agent loop instance
        rec.record("det-0", prompt, gen)
        seq = [*prompt, *gen, 8]  # a tail span too
        spans = rec.spans("det-0", seq)
        ids.append({s[0] for s in spans})
        seqs.append(seq)
        metas.append(tree_metadata(spans))
    assert all(not (a & b) for a, b in itertools.combinations(ids, 2))
    forest, why = forest_from_metadata(seqs, metas)
    assert why == "" and forest.equals(RolloutForest.from_sequences(seqs))
    # ids are unique per recorder, deterministic in form
    rec = TurnRecorder(prefix="p")
    assert rec.record("det-0", [1], [2]).turn_id == "p:det-0#0"
    assert rec.spans("det-0", [1, 2, 3])[-1][0] == "p:det-0#tail3"
    with pytest.raises(TypeError, match=r"prefix: expected a non-empty string"):
        TurnRecorder(prefix=3)


def test_full_determinism_batch_forest_from_metadata():
    """Two ``harts_tool_agent`` samples under ``rollout.full_determinism`` (request id
    ``det-0`` each): the engine builds the batch forest from the metadata."""
    pytest.importorskip("verl")
    import torch
    from _calc_loop import calc_loop_env
    from omegaconf import OmegaConf
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from harts_verl.workers.engine import forest_of_batch
    from harts_verl.workers.envs.testing import make_loop
    from harts_verl.workers.rollout.agent_loop import HartsToolAgentLoop

    calc = calc_loop_env(prompt_length=64, response_length=64, max_turns=2)
    cfg = OmegaConf.merge(
        calc["cfg"], {"actor_rollout_ref": {"rollout": {"full_determinism": True}}}
    )
    answers = iter(["answer 3 <eos>", "answer 4 <eos>"])

    class Client:
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            assert request_id == "det-0"
            return TokenOut(calc["ids"](next(answers)))

    async def main():
        outs = []
        for _ in range(2):
            loop = make_loop(
                HartsToolAgentLoop,
                Client(),
                [calc["local_task"].calc_tool()],
                config=cfg,
                tokenizer=calc["tok"],
            )
            outs.append(await loop.run({"temperature": 1.0}, raw_prompt=calc["raw_prompt"]))
        return outs

    outs = _run(main())
    seqs = [o.prompt_ids + o.response_ids for o in outs]
    rows = [
        {"input_ids": torch.tensor(s), "extra_fields": {TREE_KEY: o.extra_fields[TREE_KEY]}}
        for s, o in zip(seqs, outs, strict=True)
    ]
    forest = forest_of_batch(list_of_dict_to_tensordict(rows))
    assert forest.harts_source == "metadata"
    assert forest.equals(RolloutForest.from_sequences(seqs))


_GOOD = ["b", None, 0, 4]


@pytest.mark.parametrize(
    ("turns", "why"),
    [
        (
            [["a", None, 4]],
            "turns[0]: expected a [turn_id, parent_turn_id, start, end] list, got 3",
        ),
        ([["a", None, 0, 4, "x"]], "turns[0]: expected a [turn_id, parent_turn_id, start, end]"),
        ([None], "turns[0]: expected a [turn_id, parent_turn_id, start, end] list, got NoneType"),
        ([1, 2], "turns[0]: expected a [turn_id, parent_turn_id, start, end] list, got int"),
        ([{"id": "a", "start": 0, "end": 4}], "got dict"),
        ([["a", None, 0, 3.0], ["t", "a", 3.0, 4]], "turns[0]: end: expected an integer"),
        ([["a", None, "0", 4]], "turns[0]: start: expected an integer"),
        ([["a", None, 0, True], ["c", "a", 1, 4]], "turns[0]: end: expected an integer"),
        ([[7, None, 0, 4]], "turns[0]: turn_id: expected a string, got int"),
        ([["a", None, 0, 2], ["c", 3, 2, 4]], "turns[1]: parent_turn_id: expected a string"),
        ([["a", None, 0, 2], ["c", "a", 2, 2], ["d", "c", 2, 4]], "turns[1]: span [2, 2)"),
        ([["a", None, -1, 4]], "turns[0]: span [-1, 4)"),
        ([["a", None, 0, 9]], "turns[0]: span [0, 9)"),
        ([["a", None, 0, 2], ["c", "x", 2, 4]], "turns[1]: parent_turn_id 'x'"),
        ([["a", None, 0, 2]], "spans cover 2 of 4 tokens"),
    ],
)
def test_malformed_spans_are_refused_with_a_reason(turns, why):
    """Spans of the wrong shape or type never raise: ``(None, reason)`` naming the trajectory
    and the span, so the engine detects prefixes from the tokens instead."""
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5]]
    meta = [json.dumps({"v": 1, "turns": turns}), tree_metadata([_GOOD])]
    forest, reason = forest_from_metadata(seqs, meta)
    assert forest is None
    assert reason.startswith("trajectory 0: ") and why in reason, reason


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (json.dumps([["a", None, 0, 4]]), "expected a JSON object, got list"),
        (json.dumps({"v": 2, "turns": [["a", None, 0, 4]]}), "unsupported version 2"),
        (json.dumps({"turns": []}), "non-empty 'turns' list"),
        ("{not json", "not a JSON string"),
        (None, "no tree metadata"),
    ],
)
def test_malformed_metadata_is_refused_with_a_reason(raw, why):
    forest, reason = forest_from_metadata([[1, 2, 3, 4]], [raw])
    assert forest is None and reason.startswith("trajectory 0: ") and why in reason, reason


def test_metadata_spans_accept_numpy_ints_and_tuples():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5]]
    meta = [
        {"turns": [("p", None, np.int64(0), np.int32(3)), ("a", "p", np.int64(3), np.int64(4))]},
        {"v": 1, "turns": [["p", None, 0, 3], ["b", "p", 3, 4]]},
    ]
    forest, why = forest_from_metadata(seqs, meta)
    assert why == "" and forest.equals(RolloutForest.from_sequences(seqs))


def test_metadata_count_must_match_sequences():
    with pytest.raises(ValueError, match=r"metadata: expected one value per sequence \(2\), got 1"):
        forest_from_metadata([[1, 2], [1, 3]], [tree_metadata([["a", None, 0, 2]])])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([1.7, 2.9], r"sequences\[1\]: .*integer"),  # was silently read as [1, 2]
        ([True, 5], r"sequences\[1\]: token ids must be integers, got a bool"),
        ([np.uint64(2**63 + 5), 3], r"sequences\[1\]: token id 9223372036854775813"),
        ([-1, 3], r"sequences\[1\]: .*negative"),
        ([2**70, 3], r"sequences\[1\]: token id 1180591620717411303424 does not fit"),
    ],
)
def test_metadata_forest_checks_token_ids_like_from_sequences(bad, match):
    """Token ids are read as RolloutForest.from_sequences reads them: a float, a bool or an id
    outside int64 is a ValueError naming the sequence (not truncated, not wrapped)."""
    meta = [tree_metadata([["a", None, 0, 2]])] * 2
    with pytest.raises(ValueError, match=match):
        RolloutForest.from_sequences([[1, 2], bad])
    with pytest.raises(ValueError, match=match):
        forest_from_metadata([[1, 2], bad], meta)


def test_tree_metadata_reserved_keys():
    with pytest.raises(ValueError, match="reserved"):
        tree_metadata([["a", None, 0, 2]], turns=[])
    assert json.loads(tree_metadata([["a", None, 0, 2]], fork_path="0"))["fork_path"] == "0"


def test_engine_falls_back_to_tokens_on_malformed_spans():
    """A custom loop's 3-item spans (or dict spans) reach ``forest_of_batch``: documented
    fallback to prefix detection, not a crash."""
    pytest.importorskip("verl")
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from harts_verl.workers.engine import forest_of_batch

    seqs = [[1, 2, 3, 4], [1, 2, 3, 5]]
    for spans in ([["t", 0, 4]], [{"id": "t", "start": 0, "end": 4}], [["t", None, 0, 4.0]]):
        rows = [
            {"input_ids": torch.tensor(s), "extra_fields": {TREE_KEY: tree_metadata(spans)}}
            for s in seqs
        ]
        forest = forest_of_batch(list_of_dict_to_tensordict(rows))
        assert forest.harts_source == "tokens"
        assert forest.equals(RolloutForest.from_sequences(seqs))


def test_turn_that_adds_no_tokens_is_not_recorded():
    """An empty generation with no new prompt tokens (aborted request) is not a turn: spans,
    metadata and the recorder's forest stay valid."""
    rec = TurnRecorder()
    t1 = rec.record("r", [1, 2], [3])
    assert rec.record("r", [1, 2, 3], []) is None
    assert len(rec.turns) == 1 and rec.heads["r"] == t1.turn_id and rec.rewrites == 0
    spans = rec.spans("r", [1, 2, 3])
    assert spans == [[t1.turn_id, None, 0, 3]]
    forest, why = forest_from_metadata([[1, 2, 3]], [tree_metadata(spans)])
    assert why == "" and forest.equals(RolloutForest.from_sequences([[1, 2, 3]]))
    assert rec.forest().equals(forest)
    # the next real turn still hangs below t1
    t2 = rec.record("r", [1, 2, 3, 4], [5])
    assert t2.parent_turn_id == t1.turn_id and t2.token_ids == [4, 5]
    # a rewrite back to exactly t1's context with an empty generation: head moves to t1
    assert rec.record("r", [1, 2, 3], []) is None
    assert rec.heads["r"] == t1.turn_id and rec.rewrites == 1
    t3 = rec.record("r", [1, 2, 3, 6], [7])
    assert t3.parent_turn_id == t1.turn_id
    assert rec.forest().equals(RolloutForest.from_sequences(rec.leaf_contexts()))
    assert rec.forest().num_trajectories == 2
    # an empty call of a fresh request (nothing to record) and of a forked child
    assert rec.record("s", [], []) is None and rec.heads["s"] is None
    rec.fork("r", "c")
    assert rec.record("c", [1, 2, 3, 6, 7], []) is None and rec.heads["c"] == t3.turn_id
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3, 6, 7, 8]]
    meta = [tree_metadata(rec.spans(r, s)) for r, s in zip(["r", "r", "c"], seqs, strict=True)]
    forest, why = forest_from_metadata(seqs, meta)
    assert why == "" and forest.equals(RolloutForest.from_sequences(seqs))


# ---------------------------------------------------------------------- agent loop
@pytest.fixture(scope="module")
def agent_env():
    pytest.importorskip("verl")
    from _calc_loop import calc_loop_env

    calc = calc_loop_env(prompt_length=64, response_length=64, max_turns=4)
    tok, w = calc["tok"], calc["ids"]

    class CalcClient:
        """Turn 1: a calc call whose operand depends on the request (branches differ);
        later turns: an answer (correct for some request ids)."""

        def __init__(self):
            self.requests: list[str] = []

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            self.requests.append(request_id)
            k = int(hashlib.sha256(request_id.encode()).hexdigest(), 16)
            if tok.convert_tokens_to_ids("<tool>") not in prompt_ids[-6:]:
                return TokenOut(w(f"<call> add 3 {k % 3}"))
            return TokenOut(w(f"answer {k % 5 + 3} <eos>"))

    return calc["make"], CalcClient, calc["raw_prompt"], calc["local_task"]


def test_agent_loop_records_turns(agent_env):
    make, Client, raw_prompt, _ = agent_env
    loop, out = _run_loop(
        make, Client(), lambda lp: lp.run({"temperature": 1.0}, raw_prompt=raw_prompt)
    )
    seq = out.prompt_ids + out.response_ids
    meta = json.loads(out.extra_fields[TREE_KEY])
    assert [s[2:] for s in meta["turns"]][-1][1] == len(seq)
    assert len(loop.recorder.turns) == out.num_turns // 2 == 2
    # the response mask marks the tool answer as 0
    assert 0 in out.response_mask and out.response_mask[0] == 1
    forest, why = forest_from_metadata([seq], [out.extra_fields[TREE_KEY]])
    assert why == "" and forest.equals(RolloutForest.from_sequences([seq]))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"turns": (0,), "branching": 4, "budget": 4}, 4),
        ({"turns": (1,), "branching": 3, "budget": 8}, 8),  # last fork level takes the budget
        ({"turns": (0, 1), "branching": 2, "budget": 3}, 3),
        ({"policy": "every", "branching": 2, "budget": 4}, 4),
    ],
)
def test_fork_branches(agent_env, spec, expected):
    from harts_verl.workers.rollout.agent_loop import ForkSpec

    make, Client, raw_prompt, local_task = agent_env
    client = Client()
    fork = ForkSpec(**spec)
    _, outs = _run_loop(
        make, client, lambda lp: lp.run_tree({"temperature": 1.0}, fork=fork, raw_prompt=raw_prompt)
    )
    assert len(outs) == expected
    branches = [o.extra_fields["harts_fork_path"] for o in outs]
    assert len(set(branches)) == expected
    seqs = [o.prompt_ids + o.response_ids for o in outs]
    metas = [o.extra_fields[TREE_KEY] for o in outs]
    # each branch ran as its own request after the fork; the shared prefix ran once
    last_turns = {json.loads(m)["turns"][-1][0] for m in metas}
    assert len(last_turns) == expected
    first_turn = spec.get("turns", (0,))[0] if spec.get("policy") != "every" else 0
    if first_turn == 1:
        assert len({json.loads(m)["turns"][0][0] for m in metas}) == 1  # shared turn 1
        assert client.requests.count(client.requests[0]) == 1
    forest, why = forest_from_metadata(seqs, metas)
    assert why == "", why
    assert forest.equals(RolloutForest.from_sequences(seqs))
    assert forest.compression > 1.0
    # own rewards: computed per branch from its own text
    tok = local_task.build_tokenizer()
    rewards = [
        local_task.compute_score("harts_calc", tok.decode(o.response_ids), "3") for o in outs
    ]
    assert len(rewards) == expected


def test_fork_spec_validation():
    pytest.importorskip("verl")
    from harts_verl.workers.rollout.agent_loop import ForkSpec

    with pytest.raises(ValueError, match=r"fork\.policy"):
        ForkSpec(policy="random")
    with pytest.raises(ValueError, match=r"fork\.turns"):
        ForkSpec(turns=(2, 1))
    spec = ForkSpec.from_config({"turns": [0, 2], "branching": 3, "budget": 9})
    assert spec.boundary(1) == 2 and spec.boundary(2) is None


def test_extra_fields_round_trip_through_tensordict():
    """veRL stores ``extra_fields`` dicts as a NonTensorStack (``list_of_dict_to_tensordict``);
    the metadata string survives and the engine's reader rebuilds the same forest."""
    pytest.importorskip("verl")
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from harts_verl.workers.engine import forest_of_batch

    rec = TurnRecorder()
    rec.record("a", [1, 2, 3], [4, 5])
    rec.fork("a", "b")
    rec.record("b", [1, 2, 3, 4, 5, 6], [7])
    rec.record("a", [1, 2, 3, 4, 5, 9], [9])
    seqs = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 9, 9]]
    fields = [
        {
            "input_ids": torch.tensor(s),
            "extra_fields": {TREE_KEY: tree_metadata(rec.spans(r, s)), "turn_scores": []},
        }
        for r, s in zip("ba", seqs)
    ]
    td = list_of_dict_to_tensordict(fields)
    forest = forest_of_batch(td)
    assert forest.equals(RolloutForest.from_sequences(seqs))
    assert getattr(forest, "harts_source", None) == "metadata"
    td2 = list_of_dict_to_tensordict([{"input_ids": torch.tensor(s)} for s in seqs])
    forest2 = forest_of_batch(td2)
    assert forest2.equals(forest) and forest2.harts_source == "tokens"


def test_fork_manager_resolves_and_reads_config():
    pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ
    from verl.utils.import_utils import load_class_from_fqn

    from harts_verl.workers.rollout import fork

    cls = load_class_from_fqn(
        "harts_verl.workers.rollout.fork.HartsAgentLoopManager", "AgentLoopManager"
    )
    assert issubclass(cls, AgentLoopManagerTQ)
    assert hasattr(fork.fork_worker_class(), "remote")
    cfg = OmegaConf.create({"harts_rollout": {"fork": {"enable": True, "turns": [0, 1]}}})
    spec = fork.fork_spec_of(cfg)
    assert spec is not None and spec.turns == (0, 1)
    assert fork.fork_spec_of(OmegaConf.create({})) is None
