"""τ-bench adapter on the bundled ``retail_mini`` fixture domain (CPU, no network).

Pins: tasks are validated field by field; the reference actions of every task score 1 and a
wrong action sequence 0 (database hash), a missing required output 0; refused tool calls raise
``ValueError`` naming the argument and change nothing; replay is cached without aliasing; the
scripted and LLM users behave as documented (LLM endpoint faked); the veRL tool appends only
successful calls to the action log; ``harts_tau_agent`` driven by a scripted server produces
user turns (mask 0) and, with a fork, one rewarded and one unrewarded branch.
"""

from __future__ import annotations

import asyncio
import copy
import io
import json
import os
from pathlib import Path

import pytest

from harts_verl.workers.envs import tau

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tau3bench"
CANCEL = {
    "name": "cancel_pending_order",
    "arguments": {"order_id": "#W1001", "reason": "no longer needed"},
}


@pytest.fixture(scope="module")
def dom() -> tau.TauDomain:
    return tau.get_domain(tau.FIXTURE_DOMAIN)


def test_task_validation_names_the_field():
    ok = {"task_id": "t", "instruction": "i", "actions": [{"name": "x", "arguments": {}}]}
    assert tau.TauTask.from_dict(ok).actions[0]["requestor"] == "assistant"
    for key in ("task_id", "instruction", "actions"):
        with pytest.raises(ValueError, match=key):
            tau.TauTask.from_dict({k: v for k, v in ok.items() if k != key})
    with pytest.raises(ValueError, match=r"actions\[0\]\.name"):
        tau.TauTask.from_dict({**ok, "actions": [{"arguments": {}}]})
    with pytest.raises(ValueError, match=r"actions\[0\]\.arguments"):
        tau.TauTask.from_dict({**ok, "actions": [{"name": "x", "arguments": [1]}]})
    with pytest.raises(ValueError, match="user_script"):
        tau.TauTask.from_dict({**ok, "user_script": "hello"})
    with pytest.raises(ValueError, match="domain"):
        tau.get_domain("no_such_domain")
    # each bad field is named with the task; nothing is coerced or silently dropped
    for bad, msg in [
        ({**ok, "task_id": ""}, "task_id: expected a non-empty string"),
        ({**ok, "task_id": None}, "task_id: expected a non-empty string"),
        ({**ok, "instruction": None}, "task 't': instruction: expected a string"),
        ({**ok, "output": ["x"]}, "task 't': output: unknown key"),
        ({**ok, "actions": [{"name": "x", "args": {}}]}, r"task 't': actions\[0\]\.args"),
        (
            {**ok, "actions": [{"name": "x", "requestor": "robot"}]},
            r"actions\[0\]\.requestor: expected 'assistant' or 'user'",
        ),
        ({**ok, "reward_basis": ["DB", "VIBES"]}, "task 't': reward_basis"),
        ({**ok, "reward_basis": []}, "task 't': reward_basis"),
    ]:
        with pytest.raises(ValueError, match=msg):
            tau.TauTask.from_dict(bad)
    assert tau.TauTask.from_dict({**ok, "task_id": 7}).task_id == "7"
    assert tau.TauTask.from_dict(ok).reward_basis == ("DB", "COMMUNICATE")


def _fixture_copy(tmp_path, edit) -> tau.FixtureDomain:
    """The bundled fixture domain with its tasks.json rewritten by ``edit(tasks)``."""
    import shutil

    src = os.path.join(tau.FIXTURES, tau.FIXTURE_DOMAIN)
    dst = tmp_path / "dom"
    shutil.copytree(src, dst)
    tasks = json.loads((dst / "tasks.json").read_text())
    (dst / "tasks.json").write_text(json.dumps(edit(tasks)))
    return tau.FixtureDomain(str(dst))


def test_fixture_tasks_are_checked_and_scored_by_their_reward_basis(dom, tmp_path, caplog):
    """Duplicate task ids and broken tasks are named with their place in tasks.json; reference
    calls the domain refuses are listed by ``check_tasks`` and skipped when scored (τ²'s way)
    with one WARNING per task; tasks the reward cannot score are listed too; ``reward_basis``
    selects the components; required outputs match with commas removed (τ²'s check)."""
    with pytest.raises(ValueError, match=r"tasks\.json\[3\]: duplicate task_id 'cancel_pending'"):
        _fixture_copy(tmp_path / "a", lambda t: [*t, t[0]])
    with pytest.raises(ValueError, match=r"tasks\.json\[0\]: task 'cancel_pending': output"):
        _fixture_copy(tmp_path / "b", lambda t: [{**t[0], "output": ["x"]}, *t[1:]])

    def broken(tasks):
        t = dict(tasks[0])
        t["actions"] = [{**t["actions"][-1], "name": "cancel_pendng_order"}]
        return [t, *tasks[1:]]

    d = _fixture_copy(tmp_path / "c", broken)
    found = tau.check_tasks(d, d.tasks())
    assert found["unscorable"] == []
    (msg,) = found["refused_reference"]
    assert msg.startswith("task 'cancel_pending': reference actions[0] (cancel_pendng_order)")
    # scored as τ²'s evaluator does: the refused reference call skipped, one WARNING per task
    with caplog.at_level("WARNING", logger="harts_verl.workers.envs.tau"):
        for _ in range(2):
            assert tau.score(d, "cancel_pending", [])["db_match"] == 1.0
    assert caplog.text.count("reference actions[0] (cancel_pendng_order)") == 1

    def basis(kind):
        def edit(tasks):
            out = []
            for t in tasks:
                if t["task_id"] == "refuse_delivered":
                    t = {**t, "reward_basis": kind, "outputs": ["1000"]}
                out.append(t)
            return out

        return edit

    reads = [{"name": "get_order_details", "arguments": {"order_id": "#W1002"}}]
    d = _fixture_copy(tmp_path / "db", basis(["DB"]))  # outputs do not gate the reward
    assert tau.score(d, "refuse_delivered", reads, "sorry")["score"] == 1.0
    d = _fixture_copy(tmp_path / "com", basis(["COMMUNICATE"]))  # the database does not
    assert tau.score(d, "refuse_delivered", [CANCEL], "The refund is $1,000.")["score"] == 1.0
    assert tau.score(d, "refuse_delivered", [CANCEL], "The refund is $100.")["score"] == 0.0
    d = _fixture_copy(tmp_path / "nl", basis(["NL_ASSERTION"]))
    assert tau.check_tasks(d, d.tasks())["unscorable"] == ["refuse_delivered"]
    with pytest.raises(ValueError, match="has no component this reward computes"):
        tau.score(d, "refuse_delivered", reads, "sorry")


def test_agent_text_is_what_the_agent_said():
    """Reasoning and the drop markers' blocks (tool calls) are left out; an open block runs to
    the end of its turn."""
    from harts_verl.workers.envs import testing
    from harts_verl.workers.envs.tau_agent import agent_text

    tok = testing.byte_tokenizer()
    said = "<think>the order is delivered</think>Sorry, I can't. <tool_call>{}</tool_call>ok"
    ids = tok.encode(said + "<think>still thinking", add_special_tokens=False)
    text = agent_text(tok, ids, [1] * len(ids), (("<tool_call>", "</tool_call>"),))
    assert text == "Sorry, I can't. ok"
    # a special added token that all_special_tokens does not list is not speech either
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken("<|eom|>", special=True)])
    assert "<|eom|>" not in tok.all_special_tokens
    ids = tok.encode("Done.<|eom|>", add_special_tokens=False)
    assert agent_text(tok, ids, [1] * len(ids)) == "Done."
    assert tau.strip_thinking("a<think>b") == "a"
    # a template that opens <think> in the generation prompt: the output starts inside it
    assert tau.strip_thinking("it is delivered</think>Sorry.<think>x</think>!") == "Sorry.!"


# a turn with a tool call in the format of each veRL 0.9.1 tool parser ("delivered" only in
# the call's arguments), and the special tokens its model's tokenizer has
_CALLS = {
    "hermes": '<tool_call>{"name": "get_order_details", "arguments": {"order_id": "#W1 '
    'delivered"}}</tool_call>',
    "qwen3_coder": "<tool_call><function=get_order_details><parameter=order_id>#W1 delivered"
    "</parameter></function></tool_call>",
    "glm": "<tool_call>get_order_details<arg_key>order_id</arg_key><arg_value>#W1 delivered"
    "</arg_value></tool_call>",
    "seed": "<seed:tool_call><function=get_order_details><parameter=order_id>#W1 delivered"
    "</parameter></function></seed:tool_call>",
    "minimax": '<minimax:tool_call><invoke name="get_order_details"><parameter name="order_id">'
    "#W1 delivered</parameter></invoke></minimax:tool_call>",
    "kimi": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_order_details:0"
    '<|tool_call_argument_begin|>{"order_id": "#W1 delivered"}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
    "deepseek_v4": '<｜DSML｜tool_calls><｜DSML｜invoke name="get_order_details"><｜DSML｜parameter '
    'name="order_id" string="true">#W1 delivered</｜DSML｜parameter></｜DSML｜invoke>'
    "</｜DSML｜tool_calls>",
    "gpt-oss": "<|start|>assistant<|channel|>commentary to=functions.get_order_details "
    '<|constrain|>json<|message|>{"order_id": "#W1 delivered"}<|call|>',
    "gemma4": '<|tool_call>call:get_order_details{order_id:<|"|>#W1 delivered<|"|>}<tool_call|>',
}
_SPECIAL = [
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_end|>",
    "<|start|>",
    "<|channel|>",
    "<|constrain|>",
    "<|message|>",
    "<|call|>",
    "<|end|>",
    "<|tool_call>",
    "<tool_call|>",
]


@pytest.mark.parametrize("fmt", sorted(_CALLS))
def test_agent_text_leaves_out_tool_calls_of_every_parser(fmt):
    """What the τ reward searches is what the agent said, whatever the tool parser: the
    markers were read from hermes' attribute names only, so a kimi, deepseek_v4 or gpt-oss
    call's arguments ("#W1 delivered") counted as said and scored a required output."""
    from verl.experimental.agent_loop.tool_parser import ToolParser

    from harts_verl.workers.envs import testing
    from harts_verl.workers.envs.tau_agent import (
        TauTool,
        agent_text,
        call_markers,
        model_runs,
        parser_contents,
    )

    tok = testing.byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": _SPECIAL})
    parser = ToolParser.get_tool_parser(fmt, tok)
    markers = call_markers(parser)
    assert markers and all(start in _CALLS[fmt] for start, _ in markers)
    first = tok.encode("Let me check." + _CALLS[fmt], add_special_tokens=False)
    user = tok.encode("It says delivered?", add_special_tokens=False)  # not the agent's
    second = tok.encode("I cannot cancel it.", add_special_tokens=False)
    ids, mask = first + user + second, [1] * len(first) + [0] * len(user) + [1] * len(second)
    assert model_runs(ids, mask) == [first, second]
    # the agent loop's route: the parser's own content of each turn (given the tools' schema
    # objects, as veRL gives them: kimi's parser reads their attributes), then the markers
    names = ("get_order_details", "cancel_pending_order")
    tools = [TauTool({"type": "native", "domain": "retail_mini", "name": n}) for n in names]
    schemas = [t.tool_schema for t in tools]
    contents = asyncio.run(parser_contents(parser, model_runs(ids, mask), schemas))
    text = agent_text(tok, ids, mask, markers, None, contents)
    assert "delivered" not in text and "Let me check." in text and "I cannot cancel it." in text
    # the markers alone (a call the parser could not read) keep the arguments out as well
    text = agent_text(tok, ids, mask, markers)
    assert "delivered" not in text and "I cannot cancel it." in text


def test_reference_actions_score_one_wrong_actions_zero(dom):
    assert len(dom.tasks()) == 3
    for task in dom.tasks():
        r = tau.score(dom, task.task_id, list(task.actions), "the order is delivered")
        assert r == {"score": 1.0, "db_match": 1.0, "outputs_found": 1.0}, task.task_id
    wrong_reason = {**CANCEL, "arguments": {**CANCEL["arguments"], "reason": "ordered by mistake"}}
    assert tau.score(dom, "cancel_pending", [wrong_reason])["score"] == 0.0
    assert tau.score(dom, "cancel_pending", [])["score"] == 0.0  # did nothing
    extra = {
        "name": "modify_pending_order_address",
        "arguments": {"order_id": "#W1001", "address": "x"},
    }
    assert tau.score(dom, "cancel_pending", [extra, CANCEL])["db_match"] == 0.0
    # read-only calls and refused calls do not change the database
    reads = [{"name": "get_order_details", "arguments": {"order_id": "#W1002"}}]
    refused = [
        {
            "name": "cancel_pending_order",
            "arguments": {"order_id": "#W1002", "reason": "no longer needed"},
        }
    ]
    assert tau.score(dom, "cancel_pending", [*reads, *refused, CANCEL])["score"] == 1.0
    # a required output that was not said
    r = tau.score(dom, "refuse_delivered", reads, "sorry, I cannot do that")
    assert r == {"score": 0.0, "db_match": 1.0, "outputs_found": 0.0}
    info = {"tau_domain": dom.name, "tau_task_id": "cancel_pending", "tau_actions": [CANCEL]}
    assert tau.compute_score("tau_bench", "", "cancel_pending", info)["score"] == 1.0
    with pytest.raises(ValueError, match="tau_task_id"):
        tau.compute_score("tau_bench", "", "", {"tau_domain": dom.name})
    # Required outputs count only where the agent said them: "delivered" in a tool answer of
    # the decoded response is not the agent's word (harts_tau_agent records tau_agent_text).
    said = {"tau_domain": dom.name, "tau_task_id": "refuse_delivered", "tau_actions": reads}
    response = '{"status": "delivered"} Sorry, I cannot help with that.'
    assert tau.compute_score("tau_bench", response, "", said)["outputs_found"] == 1.0
    quiet = {**said, "tau_agent_text": "Sorry, I cannot help with that."}
    assert tau.compute_score("tau_bench", response, "", quiet)["outputs_found"] == 0.0
    told = {**said, "tau_agent_text": "It was delivered already, so I cannot cancel it."}
    assert tau.compute_score("tau_bench", response, "", told)["score"] == 1.0


def test_refused_calls_name_the_argument_and_change_nothing(dom):
    task = dom.task("cancel_pending")
    state = dom.initial_state(task)
    before = dom.db_hash(state)
    for action, field in [
        ({"name": "find_user_id_by_email", "arguments": {}}, "email"),
        ({"name": "find_user_id_by_email", "arguments": {"email": "nobody@x"}}, "email"),
        ({"name": "get_order_details", "arguments": {"order_id": "#W9"}}, "order_id"),
        (
            {"name": "cancel_pending_order", "arguments": {"order_id": "#W1001", "reason": "meh"}},
            "reason",
        ),
        (
            {
                "name": "cancel_pending_order",
                "arguments": {"order_id": "#W1002", "reason": "no longer needed"},
            },
            "order_id",
        ),
        ({"name": "drop_tables", "arguments": {}}, "name"),
    ]:
        with pytest.raises(ValueError, match=field):
            dom.call(state, action)
    assert dom.db_hash(state) == before
    assert (
        dom.call(
            state, {"name": "find_user_id_by_email", "arguments": {"email": "ADA@example.com"}}
        )
        == "ada_lovelace_1"
    )
    with pytest.raises(ValueError, match="task_id"):
        dom.task("nope")


def test_replay_cache_returns_independent_states(dom):
    s1 = tau.state_after(dom, "cancel_pending", [CANCEL])
    assert s1["orders"]["#W1001"]["status"] == "cancelled"
    s1["orders"]["#W1001"]["status"] = "tampered"
    s2 = tau.state_after(dom, "cancel_pending", [CANCEL])
    assert s2["orders"]["#W1001"]["status"] == "cancelled"
    assert tau.state_after(dom, "cancel_pending", [])["orders"]["#W1001"]["status"] == "pending"
    # a domain whose states cost more to copy than to replay (τ²'s: ~10 MB, 300 ms a copy)
    # caches none, with the same states
    assert tau.Tau2Domain.cache_states is False and dom.cache_states is True
    n = len(tau._CACHE)
    uncached = copy.copy(dom)
    uncached.cache_states = False
    log = [CANCEL, {"name": "get_order_details", "arguments": {"order_id": "#W1002"}}]
    s3 = tau.state_after(uncached, "cancel_pending", log)
    assert len(tau._CACHE) == n and s3 == tau.state_after(dom, "cancel_pending", log)


def test_users_scripted_and_llm(dom, monkeypatch):
    task = dom.task("cancel_pending")
    user = tau.make_user({"kind": "scripted"})
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": task.user_script[0]}]
    assert user.reply(task, msgs) == task.user_script[1]
    msgs += [
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert user.reply(task, msgs) is None  # script exhausted: the user stops
    for cfg, field in [
        ({"kind": "robot"}, "user.kind"),
        ({"kind": "scripted", "model": "m"}, "user.model"),
        ({"kind": "llm", "model": "m"}, "user.base_url"),
        ({"kind": "llm", "base_url": "http://h/v1", "model": "m", "top_k": 3}, "user.top_k"),
    ]:
        with pytest.raises(ValueError, match=field):
            tau.make_user(cfg)
    llm = tau.make_user({"kind": "llm", "base_url": "http://sim:8000/v1/", "model": "u"})
    conv = llm.conversation(
        task, [{"role": "system", "content": "policy"}, {"role": "assistant", "content": "Hi!"}]
    )
    assert conv[0]["role"] == "system" and task.instruction in conv[0]["content"]
    assert conv[1:] == [{"role": "user", "content": "Hi!"}]  # roles swapped, agent policy hidden
    # text the agent wrote beside a tool call goes to the environment, as in τ² (the simulator
    # got two user turns in a row, which alternating chat templates refuse)
    conv = llm.conversation(
        task,
        [
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "Cancel my order."},
            {"role": "assistant", "content": "Let me look it up."},
            {"role": "tool", "content": "{...}"},
            {"role": "assistant", "content": "Which reason?"},
        ],
    )
    assert [m["role"] for m in conv[1:]] == ["user", "assistant", "user"]
    assert conv[-1]["content"] == "Which reason?"
    sent = []

    class _Resp(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    replies = iter(
        ["Cancel #W1001 please.", "Thanks! ###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"]
    )

    def fake_urlopen(req, timeout):
        sent.append((req.full_url, json.loads(req.data)))
        body = {"choices": [{"message": {"content": next(replies)}}]}
        return _Resp(json.dumps(body).encode())

    monkeypatch.setattr(tau.urllib.request, "urlopen", fake_urlopen)
    assert llm.reply(task, [{"role": "assistant", "content": "Hi!"}]) == "Cancel #W1001 please."
    assert llm.reply(task, [{"role": "assistant", "content": "Done."}]) is None
    # τ²'s other ends: handed to a human agent, a scenario with no way on (the conversation
    # went on with them as the user's words)
    for _ in range(2):
        assert llm.reply(task, [{"role": "assistant", "content": "Transferring you."}]) is None
    assert "###TRANSFER###" in sent[0][1]["messages"][0]["content"]
    assert sent[0][0] == "http://sim:8000/v1/chat/completions" and sent[0][1]["model"] == "u"
    assert "seed" not in sent[0][1]
    # a reasoning simulator: its thinking is not its message (nor a stop); no text is an error
    cfg = {"kind": "llm", "base_url": "http://sim:8000/v1", "model": "u", "seed": 3}
    cfg["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    llm = tau.make_user({**cfg, "retries": 1})
    replies = iter(
        [
            "<think>say ###STOP### later</think>Where is my order?",
            "the user wants it back ###STOP###</think>Where is it?",  # opened in the prompt
            None,
            "<think>hm",
        ]
    )
    assert llm.reply(task, []) == "Where is my order?"
    assert sent[-1][1]["seed"] == 3
    assert sent[-1][1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert llm.reply(task, []) == "Where is it?"
    n = len(sent)
    for _ in range(2):  # no text: the same request would give the same, so no retry
        with pytest.raises(ValueError, match="returned no message text for task 'cancel_pending'"):
            llm.reply(task, [])
    assert len(sent) == n + 2
    # a failed request is sent again after a pause; the last failure is raised; a client
    # error (HTTP 400) at once
    naps: list[float] = []
    monkeypatch.setattr(tau.time, "sleep", naps.append)
    failures = iter([True, False, True, True, 400])

    def flaky(req, timeout):
        fail = next(failures)
        if fail is True:
            raise tau.urllib.error.URLError("connection refused")
        if fail:
            raise tau.urllib.error.HTTPError(req.full_url, fail, "Bad Request", {}, None)
        return fake_urlopen(req, timeout)

    monkeypatch.setattr(tau.urllib.request, "urlopen", flaky)
    replies = iter(["Hello?"])
    assert llm.reply(task, []) == "Hello?" and naps == [0.5]
    with pytest.raises(tau.urllib.error.URLError):
        llm.reply(task, [])
    with pytest.raises(tau.urllib.error.HTTPError):
        llm.reply(task, [])
    assert naps == [0.5, 0.5]
    with pytest.raises(ValueError, match=r"user\.retries"):
        tau.make_user({**cfg, "retries": -1})
    with pytest.raises(ValueError, match=r"user\.extra_body"):
        tau.make_user({**cfg, "extra_body": [1]})


def test_tau2_package_is_optional():
    try:
        import tau2  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="tau2"):
            tau.get_domain("tau2:retail")
    else:  # pragma: no cover - only where tau2 is installed
        assert tau.get_domain("tau2:retail").tasks()


def test_dataset_rows_parquet_round_trip(dom, tmp_path):
    import pandas as pd

    rows = tau.dataset_rows(dom)
    pd.DataFrame(rows).to_parquet(tmp_path / "t.parquet")
    back = pd.read_parquet(tmp_path / "t.parquet")
    assert list(back["agent_name"].unique()) == ["harts_tau_agent"]
    first = back.iloc[0]
    assert [m["role"] for m in first["prompt"]] == ["system", "assistant", "user"]
    assert "pending" in first["prompt"][0]["content"]  # the policy is in the system message
    info = first["extra_info"]
    assert info["interaction_kwargs"]["task_id"] == info["tau_task_id"]
    names = {s["function"]["name"] for s in dom.tool_schemas()}
    assert {k for k, v in info["tools_kwargs"].items() if v is not None} == names


# ---------------------------------------------------------------------- veRL side
class _AgentData:
    def __init__(self):
        self.extra_fields: dict = {}


def test_tool_logs_successful_calls_only(dom):
    pytest.importorskip("verl")
    from harts_verl.workers.envs.tau_agent import ACTIONS_KEY, TauTool

    tool = TauTool({"type": "native", "domain": dom.name, "name": "cancel_pending_order"})
    assert tool.name == "cancel_pending_order"
    with pytest.raises(ValueError, match=r"config\.name"):
        TauTool({"type": "native", "domain": dom.name, "name": "nope"})
    with pytest.raises(ValueError, match=r"config\.colour"):
        TauTool({"type": "native", "domain": dom.name, "name": "x", "colour": 1})
    data = _AgentData()
    create = {"domain": dom.name, "task_id": "cancel_pending"}

    async def call(args, create=create):
        iid, _ = await tool.create(create_kwargs=create)
        try:
            return (await tool.execute(iid, args, agent_data=data))[0].text
        finally:
            await tool.release(iid)

    with pytest.raises(ValueError, match="reason"):
        asyncio.run(call({"order_id": "#W1001", "reason": "bored"}))
    assert data.extra_fields.get(ACTIONS_KEY) is None
    # an argument the schema does not declare is refused by name, not logged (τ² refuses it)
    with pytest.raises(ValueError, match="refund: unknown argument of cancel_pending_order"):
        asyncio.run(call({**CANCEL["arguments"], "refund": True}))
    assert data.extra_fields.get(ACTIONS_KEY) is None
    assert '"cancelled"' in asyncio.run(call(CANCEL["arguments"]))
    assert data.extra_fields[ACTIONS_KEY] == [{**CANCEL, "requestor": "assistant"}]
    with pytest.raises(ValueError, match="order_id"):  # the log's state is used: now cancelled
        asyncio.run(call(CANCEL["arguments"]))
    assert len(data.extra_fields[ACTIONS_KEY]) == 1
    with pytest.raises(ValueError, match=r"create_kwargs\.task_id"):
        asyncio.run(call(CANCEL["arguments"], create={"domain": dom.name}))


def test_tau_agent_loop_user_turns_and_forks(dom):
    pytest.importorskip("verl")
    import yaml
    from hydra.utils import get_class
    from verl.tools.tool_registry import initialize_tools_from_config

    from harts_verl.workers.envs import testing
    from harts_verl.workers.envs.tau_agent import AGENT_TEXT_KEY, HartsTauAgentLoop
    from harts_verl.workers.rollout.agent_loop import ForkSpec

    (entry,) = yaml.safe_load((RECIPE / "agent_loops.yaml").read_text())
    assert get_class(entry["_target_"]) is HartsTauAgentLoop
    tok = testing.byte_tokenizer()
    row = next(
        r for r in tau.dataset_rows(dom) if r["extra_info"]["tau_task_id"] == "cancel_pending"
    )
    tools = initialize_tools_from_config(str(RECIPE / "tools_retail_mini.yaml"))
    reasons = iter(["no longer needed", "ordered by mistake"])

    def script(rid: str, turn: int, text: str) -> str:
        users = text.count("<|user|>")
        if users == 1:
            return "Sure, what is your email?"
        if users == 2 and "find_user_id_by_email" not in text:
            return testing.hermes_call("find_user_id_by_email", {"email": "ada@example.com"})
        if users == 2:
            return "Found you. Why do you want to cancel #W1001?"
        if users == 3 and "cancel_pending_order" not in text:
            args = {"order_id": "#W1001", "reason": next(reasons)}
            return testing.hermes_call("cancel_pending_order", args)
        return "Your order is cancelled."

    async def main():
        loop = testing.make_loop(
            HartsTauAgentLoop, testing.ScriptedServer(tok, script), tools, max_turns=12
        )
        return await loop.run_tree(
            {},
            fork=ForkSpec(turns=(3,), branching=2, budget=2),
            raw_prompt=row["prompt"],
            tools_kwargs=row["extra_info"]["tools_kwargs"],
            extra_info=row["extra_info"],
            interaction_kwargs=row["extra_info"]["interaction_kwargs"],
        )

    outs = asyncio.run(main())
    assert len(outs) == 2
    task = dom.task("cancel_pending")
    scores = []
    for out in outs:
        text = tok.decode(out.response_ids)
        # both scripted user replies after the opening are in the trajectory, not trained on
        for reply in task.user_script[1:]:
            assert reply in text
            start = text.index(reply)
            ids_before = len(tok.encode(text[:start], add_special_tokens=False))
            assert out.response_mask[ids_before] == 0
        assert text.endswith("Your order is cancelled.<|eos|>")
        said = out.extra_fields[AGENT_TEXT_KEY]  # the model's own tokens only
        assert said.endswith("Your order is cancelled.") and "Sure, what is your email?" in said
        assert not any(reply in said for reply in task.user_script[1:])
        # its tool calls and special tokens are not words to the user
        assert '"order_id"' not in said and "<tool_call>" not in said and "<|" not in said
        assert out.num_turns > 6
        assert out.extra_fields[tau.TERMINATION_KEY] == tau.USER_STOP
        info = {**row["extra_info"], **out.extra_fields}
        scores.append(
            tau.compute_score(row["data_source"], text, row["reward_model"]["ground_truth"], info)[
                "score"
            ]
        )
    assert sorted(scores) == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"interaction_kwargs\.task_id"):

        async def bad():
            loop = testing.make_loop(HartsTauAgentLoop, testing.ScriptedServer(tok, script), tools)
            return await loop.run_tree(
                {}, raw_prompt=row["prompt"], interaction_kwargs={"domain": dom.name}
            )

        asyncio.run(bad())


def _cancel_pending_run(dom, script, max_turns: int = 8, *, tok=None, **loop_kwargs):
    """One ``harts_tau_agent`` trajectory of the fixture task ``cancel_pending`` with the
    scripted model ``script`` (ScriptedServer's ``(rid, turn, text) -> str``): (tokenizer, the
    task's row, the output). ``tok``: the tokenizer (default a byte tokenizer);
    ``loop_kwargs``: :func:`testing.make_loop`'s (``config``, ``hf_model_type``)."""
    from verl.tools.tool_registry import initialize_tools_from_config

    from harts_verl.workers.envs import testing
    from harts_verl.workers.envs.tau_agent import HartsTauAgentLoop

    tok = testing.byte_tokenizer() if tok is None else tok
    row = next(
        r for r in tau.dataset_rows(dom) if r["extra_info"]["tau_task_id"] == "cancel_pending"
    )
    tools = initialize_tools_from_config(str(RECIPE / "tools_retail_mini.yaml"))

    async def main():
        loop = testing.make_loop(
            HartsTauAgentLoop,
            testing.ScriptedServer(tok, script),
            tools,
            max_turns=max_turns,
            **loop_kwargs,
        )
        return await loop.run_tree(
            {},
            raw_prompt=row["prompt"],
            tools_kwargs=row["extra_info"]["tools_kwargs"],
            extra_info=row["extra_info"],
            interaction_kwargs=row["extra_info"]["interaction_kwargs"],
        )

    (out,) = asyncio.run(main())
    return tok, row, out


def test_tau_conversation_cut_off_by_a_limit_scores_zero(dom):
    """As τ²: only a conversation the user ended is scored; one a turn limit cut off (here
    right after a correct cancellation, the model then looping on look-ups) scored 1.0 on its
    database."""
    pytest.importorskip("verl")
    from harts_verl.workers.envs import testing

    def script(rid: str, turn: int, text: str) -> str:
        if "cancel_pending_order" not in text:
            args = {"order_id": "#W1001", "reason": "no longer needed"}
            return testing.hermes_call("cancel_pending_order", args)
        return testing.hermes_call("get_order_details", {"order_id": "#W1001"})

    tok, row, out = _cancel_pending_run(dom, script, max_turns=4)
    assert out.extra_fields[tau.TERMINATION_KEY] != tau.USER_STOP
    info = {**row["extra_info"], **out.extra_fields}
    text = tok.decode(out.response_ids)
    got = tau.compute_score(row["data_source"], text, row["reward_model"]["ground_truth"], info)
    assert got["db_match"] == 1.0  # the database is right ...
    assert got["score"] == 0.0 and got["user_stopped"] == 0.0  # ... but the user never ended it
    # the same actions in a conversation the user ended score 1
    ended = {**info, tau.TERMINATION_KEY: tau.USER_STOP}
    got = tau.compute_score(row["data_source"], text, row["reward_model"]["ground_truth"], ended)
    assert got["score"] == 1.0 and got["user_stopped"] == 1.0


def test_too_many_failed_tool_calls_end_the_conversation_scored_zero(dom):
    """As τ²'s orchestrator (max_errors 10): after ten failed tool calls (here unknown order
    ids) the conversation ends, ``too_many_errors``, and scores 0 even if the agent then got
    the task right (it scored 1.0)."""
    pytest.importorskip("verl")
    from harts_verl.workers.envs import testing
    from harts_verl.workers.envs.tau_agent import ERRORS_KEY, MAX_ERRORS, TOO_MANY_ERRORS

    def script(rid: str, turn: int, text: str) -> str:
        errors = text.count("Error executing tool")
        if errors < 12:
            return testing.hermes_call("get_order_details", {"order_id": f"#W9{errors:03d}"})
        if "cancel_pending_order" not in text:
            args = {"order_id": "#W1001", "reason": "no longer needed"}
            return testing.hermes_call("cancel_pending_order", args)
        return "Your order #W1001 is cancelled."

    tok, row, out = _cancel_pending_run(dom, script, max_turns=40)
    text = tok.decode(out.response_ids)
    assert text.count("Error executing tool") == out.extra_fields[ERRORS_KEY] == MAX_ERRORS
    assert out.extra_fields[tau.TERMINATION_KEY] == TOO_MANY_ERRORS
    info = {**row["extra_info"], **out.extra_fields}
    got = tau.compute_score(row["data_source"], text, row["reward_model"]["ground_truth"], info)
    assert got["score"] == 0.0


def test_a_tool_call_marker_inside_reasoning_is_no_call_and_schemas_stay_whole(dom):
    """A message to the user whose reasoning mentions ``<tool_call>`` reaches the user (it was
    answered as an unparsable call); the tools' schemas reach the chat template whole (veRL's
    schema model dropped an array's ``items``, ``anyOf``, ``$defs``)."""
    pytest.importorskip("verl")
    from verl.tools.schemas import OpenAIFunctionToolSchema

    from harts_verl.workers.envs.tau_agent import FullToolSchema

    def script(rid: str, turn: int, text: str) -> str:
        if text.count("<|user|>") == 1 and "could not be parsed" not in text:
            return "<think>No email yet, so no <tool_call> now.</think>Sure, what is your email?"
        return "Thanks, goodbye."

    tok, _, out = _cancel_pending_run(dom, script, max_turns=6)
    text = tok.decode(out.response_ids)
    assert "could not be parsed" not in text
    assert text.index(dom.task("cancel_pending").user_script[1]) > text.index("what is your email?")
    flights = {
        "type": "array",
        "description": "flights",
        "items": {"anyOf": [{"$ref": "#/$defs/FlightInfo"}, {"type": "object"}]},
    }
    raw = {
        "type": "function",
        "function": {
            "name": "book",
            "description": "Book.",
            "parameters": {
                "type": "object",
                "properties": {"flights": flights},
                "required": ["flights"],
                "$defs": {
                    "FlightInfo": {"type": "object", "properties": {"date": {"type": "string"}}}
                },
            },
        },
    }
    shown = FullToolSchema.of(raw).model_dump(exclude_unset=True, exclude_none=True)
    assert shown == raw
    lost = OpenAIFunctionToolSchema.model_validate(raw).model_dump(
        exclude_unset=True, exclude_none=True
    )
    assert "items" not in lost["function"]["parameters"]["properties"]["flights"]  # why


def test_tau_agent_loop_answers_unparsable_tool_calls_from_the_tool_side(dom):
    """A tool call the parser cannot read gets an error message as a tool turn (mask 0), not a
    user reply: the user's script is not consumed by it."""
    pytest.importorskip("verl")

    def script(rid: str, turn: int, text: str) -> str:
        if "could not be parsed" not in text:
            return '<tool_call>{"name": "find_user_id_by_email", "arguments": {bad</tool_call>'
        if text.count("<|user|>") == 1:
            return "Sure, what is your email?"
        return "Thank you, goodbye."

    tok, _, out = _cancel_pending_run(dom, script, max_turns=6)
    text = tok.decode(out.response_ids)
    task = dom.task("cancel_pending")
    err = text.index("the tool call could not be parsed")
    assert out.response_mask[len(tok.encode(text[:err], add_special_tokens=False))] == 0
    # the user's next scripted line answers the agent's real message, after the error
    assert text.index(task.user_script[1]) > text.index("Sure, what is your email?") > err


def test_tau_agent_loop_one_call_per_turn_and_the_user_sees_messages_only():
    """Parallel tool calls would each replay the log without the other's action (one lost):
    refused. The user simulator sees the agent's messages without reasoning, tool calls and
    special tokens."""
    pytest.importorskip("verl")
    from harts_verl.workers.envs import testing
    from harts_verl.workers.envs.tau_agent import HartsTauAgentLoop

    tok = testing.byte_tokenizer()
    parallel = testing.loop_config()
    parallel.actor_rollout_ref.rollout.multi_turn.max_parallel_calls = 2

    async def build(config):
        server = testing.ScriptedServer(tok, lambda *a: "x")
        return testing.make_loop(HartsTauAgentLoop, server, [], config=config)

    with pytest.raises(ValueError, match=r"max_parallel_calls: .* set 1, got 2"):
        asyncio.run(build(parallel))
    loop = asyncio.run(build(None))
    msgs = [
        {"role": "assistant", "content": "<think>it is delivered</think>Hello!<|eos|>"},
        {"role": "assistant", "content": 'One moment.<tool_call>{"name": "x"}</tool_call>'},
        {"role": "tool", "content": "<think>kept</think>"},
    ]
    assert loop._for_user(msgs) == [
        {"role": "assistant", "content": "Hello!"},
        {"role": "assistant", "content": "One moment."},
        msgs[2],
    ]


def test_tau2_domain_reads_reward_basis_and_task_splits(monkeypatch):
    """Against a stand-in of tau2's registry (tasks as tau2's pydantic models expose them):
    ``reward_basis`` enum values become the task's basis (τ-bench's pair when absent) and
    ``split_tasks`` filters by the loader's ``task_split_name``."""
    import enum
    import sys
    import types
    from types import SimpleNamespace as NS

    class RewardType(str, enum.Enum):  # noqa: UP042  # as tau2 defines it (str() is the name)
        DB = "DB"
        COMMUNICATE = "COMMUNICATE"

    def task(tid, basis):
        act = NS(name="t", arguments={"a": 1}, requestor="assistant")
        crit = NS(actions=[act], communicate_info=["x"], reward_basis=basis)
        return NS(id=tid, user_scenario="want", evaluation_criteria=crit, initial_state=None)

    tasks = [task("1", [RewardType.DB]), task("2", None), task("3", [RewardType.COMMUNICATE])]
    splits = {"train": ["1", "3"], "test": ["2"]}

    def loader(task_split_name=None):
        if task_split_name is None:
            return tasks
        if task_split_name not in splits:
            raise ValueError(f"Invalid task split name: {task_split_name}")
        return [t for t in tasks if t.id in splits[task_split_name]]

    env = NS(get_policy=lambda: "policy", get_tools=lambda: [])
    registry = NS(get_env_constructor=lambda d: lambda: env, get_tasks_loader=lambda d: loader)
    mod = types.ModuleType("tau2.registry")
    mod.registry = registry
    monkeypatch.setitem(sys.modules, "tau2", types.ModuleType("tau2"))
    monkeypatch.setitem(sys.modules, "tau2.registry", mod)
    d = tau.Tau2Domain("retail")
    by_id = {t.task_id: t for t in d.tasks()}
    assert by_id["1"].reward_basis == ("DB",) and by_id["3"].reward_basis == ("COMMUNICATE",)
    assert by_id["2"].reward_basis == ("DB", "COMMUNICATE")
    assert by_id["1"].actions[0] == {"name": "t", "arguments": {"a": 1}, "requestor": "assistant"}
    assert [t.task_id for t in d.split_tasks("train")] == ["1", "3"]
    assert [t.task_id for t in d.split_tasks("test")] == ["2"]
    with pytest.raises(ValueError, match="split: tau2:retail has no task split 'dev'"):
        d.split_tasks("dev")


def test_unparsable_calls_and_empty_messages_count_as_tool_errors(dom):
    """Broken hermes JSON never reaches veRL's _call_tool (the parser drops it): such turns
    were answered but not counted, so fifteen of them still scored 1.0. An empty message (only
    reasoning) is not a message to the user either: the LLM user was shown the agent's greeting
    in its place and the scripted user spent a line on it."""
    pytest.importorskip("verl")
    from harts_verl.workers.envs import testing
    from harts_verl.workers.envs.tau_agent import ERRORS_KEY, MAX_ERRORS, TOO_MANY_ERRORS

    bad = '<tool_call>{"name": "cancel_pending_order", "arguments": {reason: x}}</tool_call>'

    def script(rid: str, turn: int, text: str) -> str:
        if text.count("error: the") < 6:
            return bad
        if text.count("error: the") < 12:
            return "<think>hm</think>"
        return testing.hermes_call(
            "cancel_pending_order", {"order_id": "#W1001", "reason": "no longer needed"}
        )

    tok, _, out = _cancel_pending_run(dom, script, max_turns=40)
    assert out.extra_fields[ERRORS_KEY] == MAX_ERRORS
    assert out.extra_fields[tau.TERMINATION_KEY] == TOO_MANY_ERRORS
    text = tok.decode(out.response_ids)
    assert "the message was empty" in text
    assert dom.task("cancel_pending").user_script[1] not in text  # no user line spent


def test_scripted_user_line_with_a_stop_marker_ends_the_conversation():
    task = tau.TauTask.from_dict(
        {"task_id": "t", "instruction": "i", "actions": [], "user_script": ["a", "b ###STOP###"]}
    )
    assert tau.ScriptedUser().reply(task, [{"role": "user", "content": "a"}]) is None


def _gpt_oss_tree(dom, script, extra_special=()):
    """(tokenizer, the one output) of ``harts_tau_agent`` on the ``cancel_pending`` task with
    veRL's gpt-oss parser and token builder, the model's turns from ``script``."""
    pytest.importorskip("verl")
    from harts_verl.workers.envs import testing

    tok = testing.byte_tokenizer()
    extra = [s for s in _SPECIAL if s.startswith("<|") and "tool" not in s] + list(extra_special)
    tok.add_special_tokens({"additional_special_tokens": extra})
    config = testing.loop_config(tool_format="gpt-oss")
    tok, _, out = _cancel_pending_run(dom, script, tok=tok, config=config, hf_model_type="gpt_oss")
    return tok, out


def test_unparsable_gpt_oss_call_is_answered_not_a_crash(dom):
    """veRL's gpt-oss token builder names the tool of each tool message from the assistant's
    calls; the loop's answer to an unparsable call had none to name (ValueError)."""
    bad = (  # no <|constrain|>json: the parser's pattern does not match
        "<|start|>assistant<|channel|>commentary to=functions.find_user_id_by_email "
        '<|message|>{"email": "ada@example.com"}<|call|>'
    )

    def script(rid: str, turn: int, text: str) -> str:
        return bad if "could not be parsed" not in text else "Thanks, goodbye."

    tok, out = _gpt_oss_tree(dom, script)
    text = tok.decode(out.response_ids)
    assert "functions.find_user_id_by_email to=assistant" in text and "could not be parsed" in text


def test_gpt_oss_empty_final_message_and_the_named_tool(dom):
    """gpt-oss: an empty final message ("<|channel|>final<|message|><|return|>") said
    "assistantfinal" once special tokens were out, so it reached the user and was not counted;
    an unparsable call's answer named the first tool the turn's reasoning mentioned."""
    from harts_verl.workers.envs.tau_agent import ERRORS_KEY

    bad = (
        "<|channel|>analysis<|message|>get_order_details says pending<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.cancel_pending_order "
        '<|message|>{"order_id": "#W1001"}<|call|>'
    )
    empty = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|><|return|>"

    def script(rid: str, turn: int, text: str) -> str:
        return bad if "could not be parsed" not in text else empty

    tok, out = _gpt_oss_tree(dom, script, ["<|return|>"])
    text = tok.decode(out.response_ids)
    assert "functions.cancel_pending_order to=assistant" in text
    assert "functions.get_order_details to=assistant" not in text
    assert "the message was empty" in text and out.extra_fields[ERRORS_KEY] >= 2
    assert out.extra_fields.get(tau.TERMINATION_KEY) != tau.USER_STOP
