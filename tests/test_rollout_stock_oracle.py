"""``harts_tool_agent`` against veRL's own ``ToolAgentLoop`` as the oracle: every leaf of a forked
tree, replayed through the stock loop with the model outputs along its own branch, gives the
same prompt, response, mask, log-probs, turn count and extra fields (the tree keys aside), and
the tree metadata rebuilds the token forest. Model outputs mix tool calls (with answers, empty
answers and unknown tools) and final answers; response lengths with and without truncation."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

pytest.importorskip("verl")

from harts_verl.tree import RolloutForest
from harts_verl.workers.envs.testing import (
    TokenOut,
    byte_tokenizer,
    hermes_call,
    loop_config,
    make_loop,
)
from harts_verl.workers.rollout.agent_loop import ForkSpec, HartsToolAgentLoop
from harts_verl.workers.rollout.recorder import TREE_KEY, forest_from_metadata

STOCK_FIELDS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "num_turns")
RAW_PROMPT = [{"role": "user", "content": "question?"}]


def _tools():
    from verl.tools.function_tool import FunctionTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    def tool(name, fn):
        schema = OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": name,
                    "parameters": {
                        "type": "object",
                        "properties": {"x": {"type": "string"}},
                        "required": [],
                    },
                },
            }
        )
        return FunctionTool(name=name, fn=fn, tool_schema=schema)

    return [tool("echo", lambda x="": x), tool("empty", lambda x="": "")]


class _Server:
    """Answers ``policy(prompt_ids, request_id)``; logs every call."""

    def __init__(self, policy):
        self.policy = policy
        self.calls: list[tuple[tuple[int, ...], list[int], list[float]]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        ids, lps = self.policy(tuple(prompt_ids), request_id)
        self.calls.append((tuple(prompt_ids), list(ids), list(lps)))
        out = TokenOut(list(ids))
        out.log_probs = list(lps)
        return out


def _policy(tok, seed, p_stop):
    """Tool calls (echo, empty, an unknown tool) until a hashed draw or turn 5 ends with an
    answer; outputs depend on the request id, so fork branches differ (and carry a hash, so
    the replay finds each output by its tokens)."""
    eos = tok.eos_token_id

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    def policy(prompt, request_id):
        turn = tok.decode(list(prompt)).count("<|assistant|>") - 1
        k = int(hashlib.sha256(f"{seed}/{request_id}/{len(prompt)}".encode()).hexdigest(), 16)
        if k % 100 < p_stop * 100 or turn >= 5:
            ids = [*enc(f"ans{k % 100003}"), eos]
        else:
            name = ("echo", "empty", "nope")[k % 3]
            ids = [*enc(hermes_call(name, {"x": f"v{k % 100003}"})), eos]
        # a token's log-prob follows from the output up to it: a leaf cut inside an output
        # shows the same log-probs whichever output with that visible prefix the replay picks
        lps, h = [], 0
        for t in ids:
            h = (h * 1_000_003 + t + 1) % (1 << 61)
            lps.append(-(h % 9973) / 1e4 - 0.001)
        return ids, lps

    return policy


def _run(cls, server, cfg, tok, fork=None):
    async def main():
        loop = make_loop(cls, server, _tools(), config=cfg, tokenizer=tok)
        sampling = {"temperature": 1.0, "logprobs": True}
        if fork is None:
            return await loop.run(sampling, raw_prompt=RAW_PROMPT)
        return await loop.run_tree(sampling, fork=fork, raw_prompt=RAW_PROMPT)

    return asyncio.new_event_loop().run_until_complete(main())


def _replay_policy(calls, leaf):
    """The tree's recorded output for ``prompt`` on ``leaf``'s branch: a call with that prompt
    whose output continues ``leaf``'s tokens (as far as the leaf goes: truncation)."""

    def policy(prompt, _request_id):
        n = len(prompt)
        for p, ids, lps in calls:
            if p == prompt and leaf[: n + len(ids)][n:] == ids[: len(leaf) - n]:
                return ids, lps
        raise AssertionError(f"no recorded output continues the leaf after {n} tokens")

    return policy


SPECS = [
    ForkSpec(turns=(0,), branching=4, budget=4),
    ForkSpec(turns=(1,), branching=3, budget=8),
    ForkSpec(turns=(0, 2), branching=2, budget=5),
    ForkSpec(policy="every", branching=2, budget=5),
    ForkSpec(turns=(0, 1, 2), branching=3, budget=7, group="fork"),
]


# 4096: nothing is cut; 60 cuts the first output, 150 and 300 later tool answers and outputs
@pytest.mark.parametrize("response_length", [4096, 60, 150, 300])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_leaf_equals_the_stock_tool_agent_loop(seed, response_length):
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    tok = byte_tokenizer()
    cfg = loop_config(prompt_length=512, response_length=response_length, max_turns=6)
    for spec in SPECS:
        for p_stop in (0.0, 0.4):
            server = _Server(_policy(tok, seed, p_stop))
            outs = _run(HartsToolAgentLoop, server, cfg, tok, fork=spec)
            assert len(outs) == spec.budget
            seqs = [o.prompt_ids + o.response_ids for o in outs]
            forest, why = forest_from_metadata(seqs, [o.extra_fields[TREE_KEY] for o in outs])
            assert why == "" and forest.equals(RolloutForest.from_sequences(seqs))
            for out, leaf in zip(outs, seqs):
                stock = _run(ToolAgentLoop, _Server(_replay_policy(server.calls, leaf)), cfg, tok)
                for field in STOCK_FIELDS:
                    assert getattr(out, field) == getattr(stock, field), (spec, p_stop, field)
                ours = {k: v for k, v in out.extra_fields.items() if not k.startswith("harts_")}
                assert ours == stock.extra_fields, (spec, p_stop)
