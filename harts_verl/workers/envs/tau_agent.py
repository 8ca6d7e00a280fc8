"""veRL side of the τ-bench adapter: the domain tool (``TauTool``) and the agent loop
``harts_tau_agent`` (``harts_tool_agent`` plus user turns from a user simulator).

veRL 0.9.1 has no ``BaseInteraction`` / ``verl.interactions`` module and its ``ToolAgentLoop``
ends a trajectory at the first assistant turn without a tool call. τ-bench conversations need
the user to answer such a turn, so :class:`HartsTauAgentLoop` (a subclass of
:class:`~harts_verl.workers.rollout.agent_loop.HartsToolAgentLoop`, so turns are recorded and
``run_tree`` forks as usual) adds one step: when the model writes to the user (no tool call,
no length/turn limit hit), the user simulator's reply is appended as a ``user`` message
(tokens with response mask 0, like tool answers) and generation continues; the simulator
stopping (``None``) ends the trajectory. A turn with a tool call the parser could not read
(e.g. invalid JSON) is not a message to the user: a tool turn says the call could not be parsed
and generation continues. The simulator reads the conversation only, so forked branches need no
extra state. Each output's ``extra_fields["tau_agent_text"]`` is what the model said (its
response-mask-1 tokens, turn by turn: what the tool parser leaves once it takes the turn's tool
calls out, whatever the parser's format, without reasoning and special tokens), which the
reward searches for required outputs.

Tool state is the action log ``extra_fields["tau_actions"]`` (successful calls in order);
see :mod:`harts_verl.workers.envs.tau`. As in τ², the conversation ends after
:data:`MAX_ERRORS` failed tool calls (``tau_termination`` ``too_many_errors``, scored 0), and
the model sees each tool's whole JSON schema (:class:`FullToolSchema`: nested items, ``$defs``).

Register the loop with veRL either by importing this module (``@register``) or with
``rollout.agent.agent_loop_config_path`` (``recipes/tau3bench/agent_loops.yaml``), which also
passes the user simulator config (``user: {kind: scripted}`` or ``{kind: llm, base_url, model}``).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import re
from typing import Any, ClassVar

import numpy as np
from pydantic import PrivateAttr
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from harts_verl.workers.envs.tau import (
    TERMINATION_KEY,
    THINK,
    USER_STOP,
    TauTask,
    get_domain,
    make_user,
    state_after,
    strip_thinking,
)
from harts_verl.workers.rollout.agent_loop import ForkSpec, HartsToolAgentLoop, TrajectoryTool

__all__ = [
    "ACTIONS_KEY",
    "AGENT_TEXT_KEY",
    "TAU_AGENT_NAME",
    "HartsTauAgentLoop",
    "TauTool",
    "agent_text",
    "call_markers",
    "model_runs",
    "parser_contents",
    "tool_config",
]

ACTIONS_KEY = "tau_actions"
AGENT_TEXT_KEY = "tau_agent_text"  # what the model wrote (its response-mask-1 tokens, decoded)
TAU_AGENT_NAME = "harts_tau_agent"


def _plain(value: Any) -> Any:
    """A DictConfig/ListConfig as plain containers (other values unchanged)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


class TauTool(TrajectoryTool):
    """One tool of a τ domain. ``config``: ``domain`` (``retail_mini`` or ``tau2:<domain>``)
    and ``name`` (the tool); the schema comes from the domain unless given.

    ``execute`` replays the trajectory's action log to get the current state, runs the call,
    and appends it to the log when it succeeds; a refused call raises ``ValueError`` naming the
    argument (veRL returns the message to the model) and is not logged.
    """

    KEYS: ClassVar[set[str]] = {"type", "domain", "name"}
    STATE = "τ tools keep their action log"

    def __init__(self, config: dict[str, Any], tool_schema: Any = None) -> None:
        cfg = dict(_plain(config) or {})
        bad = set(cfg) - self.KEYS
        if bad:
            raise ValueError(f"config.{sorted(bad)[0]}: unknown τ tool option")
        for key in ("domain", "name"):
            if not cfg.get(key):
                raise ValueError(f"config.{key}: missing")
        self.domain = get_domain(cfg["domain"])
        if tool_schema is None:
            match = [s for s in self.domain.tool_schemas() if s["function"]["name"] == cfg["name"]]
            if not match:
                raise ValueError(
                    f"config.name: domain {self.domain.name} has no tool {cfg['name']!r}"
                )
            tool_schema = FullToolSchema.of(match[0])
        super().__init__(cfg, tool_schema)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        agent_data = self._agent_data(kwargs)
        self._check_parameters(parameters)
        self._check_known(parameters)
        create = self._kwargs.get(instance_id, {})
        task_id = create.get("task_id")
        if not task_id:
            raise ValueError("create_kwargs.task_id: missing (build rows with tau.dataset_rows)")
        if create.get("domain", self.domain.name) != self.domain.name:
            raise ValueError(
                f"create_kwargs.domain: row is for {create['domain']!r}, tool for {self.domain.name!r}"
            )
        log = list(agent_data.extra_fields.get(ACTIONS_KEY) or [])
        action = {"name": self.name, "arguments": dict(parameters), "requestor": "assistant"}

        def run() -> str:
            state = state_after(self.domain, task_id, log)
            return self.domain.call(state, action)

        text = await asyncio.to_thread(run)
        agent_data.extra_fields[ACTIONS_KEY] = [*log, action]
        return ToolResponse(text=text), 0.0, {}


class FullToolSchema(OpenAIFunctionToolSchema):
    """veRL's tool schema model whose ``model_dump`` (what veRL's agent loop puts in the chat
    template's tool list) is the whole JSON schema it was built from: veRL's property model
    keeps ``type``, ``description`` and ``enum`` only, so an array's ``items``, an object's
    fields, ``anyOf`` / ``$ref`` / ``$defs`` were dropped (τ² airline's ``book_reservation``
    showed ``passengers`` as a bare array), as τ²'s own agent sends them."""

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @classmethod
    def of(cls, raw: dict[str, Any]) -> FullToolSchema:
        """The schema of ``raw`` (an OpenAI function tool schema; validated as veRL does)."""
        obj = cls.model_validate(raw)
        obj._raw = copy.deepcopy(raw)
        return obj

    def model_dump(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return copy.deepcopy(self._raw) if self._raw else super().model_dump(*args, **kwargs)


def model_runs(response_ids: list[int], response_mask: list[int]) -> list[list[int]]:
    """The runs of ``response_mask`` 1 tokens of a response (what the model generated, turn
    by turn; tool answers and user turns, mask 0, left out), in order."""
    ids, mask = np.asarray(response_ids, np.int64), np.asarray(response_mask) != 0
    if ids.shape != mask.shape:
        raise ValueError(
            f"response_mask: expected {ids.shape[0]} entries (one per response id), "
            f"got {mask.shape[0]}"
        )
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    return [ids[a:b].tolist() for a, b in zip(edges[::2], edges[1::2], strict=True)]


def agent_text(
    tokenizer: Any,
    response_ids: list[int],
    response_mask: list[int],
    drop: tuple[tuple[str, str], ...] = (),
    special: list[str] | None = None,
    contents: list[str] | None = None,
) -> str:
    """The text the model itself wrote in a response: each of its :func:`model_runs` decoded
    on its own (or ``contents``: one text per run, e.g. what the tool parser leaves of it once
    its calls are taken out) without special tokens, its reasoning (``<think>...</think>``)
    and the ``drop`` blocks (``(start, end)`` markers, e.g. the tool parser's
    :func:`call_markers`) removed, runs joined by a line break so words of different turns
    never merge: what the agent said to the user. ``special``: the tokenizer's
    :func:`special_tokens`, when the caller has them."""
    runs = model_runs(response_ids, response_mask)
    if contents is None:
        contents = [tokenizer.decode(run) for run in runs]
    elif len(contents) != len(runs):
        raise ValueError(
            f"contents: expected one text per model run ({len(runs)}), got {len(contents)}"
        )
    special = special_tokens(tokenizer) if special is None else special
    return "\n".join(said(text, special, drop) for text in contents)


# veRL 0.9.1's tool parsers name their call markers differently: (start, end) attribute pairs
_MARKER_ATTRIBUTES = (
    ("tool_call_start_token", "tool_call_end_token"),  # hermes, qwen3_coder, glm, seed, ...
    ("tool_calls_section_start_token", "tool_calls_section_end_token"),  # kimi: all calls
    ("tool_call_begin_token", "tool_call_end_token"),  # kimi: one call
    ("tool_calls_start_token", "tool_calls_end_token"),  # deepseek_v4
)
# gpt-oss's harmony format: a call is "<|channel|>commentary to=functions.NAME ... <|call|>"
_HARMONY_CALL = (" to=functions.", "<|call|>")
# a harmony message header: "<|start|>assistant", "<|channel|>final" (up to <|message|>): its
# words are no text to the user (an empty final message said "assistantfinal")
_HARMONY_HEADER = re.compile(r"<\|start\|>[^<]*|<\|channel\|>[^<]*")


async def parser_contents(parser: Any, runs: list[list[int]], tools: list[Any]) -> list[str]:
    """What a veRL tool ``parser`` leaves of each of the model's token ``runs`` once it takes
    the run's tool calls out (its ``extract_tool_calls`` content), given the loop's ``tools``
    (their ``OpenAIFunctionToolSchema`` objects, as veRL's own generating step passes them)."""
    return [(await parser.extract_tool_calls(run, tools))[0] for run in runs]


def call_markers(parser: Any) -> tuple[tuple[str, str], ...]:
    """The ``(start, end)`` markers of a tool call in the model's text for a veRL tool parser
    (``end`` may be empty), whichever attribute names the parser uses; gpt-oss's harmony
    parser (a pattern, no marker attributes) gets its ``to=functions.`` ... ``<|call|>``."""
    pairs: list[tuple[str, str]] = []
    for start_name, end_name in _MARKER_ATTRIBUTES:
        start, end = getattr(parser, start_name, None), getattr(parser, end_name, None)
        pair = (start, end if isinstance(end, str) else "")
        if isinstance(start, str) and start and pair not in pairs:
            pairs.append(pair)
    pattern = getattr(getattr(parser, "tool_call_pattern", None), "pattern", "")
    if not pairs and isinstance(pattern, str) and "to=functions" in pattern:
        pairs.append(_HARMONY_CALL)
    return tuple(pairs)


def said(text: str, special: list[str], drop: tuple[tuple[str, str], ...] = ()) -> str:
    """What ``text`` (the model's own, decoded with its special tokens) says to the user: its
    reasoning and ``drop`` blocks removed first (a tokenizer may register their markers as
    special tokens), then the ``special`` tokens (:func:`special_tokens`)."""
    text = strip_thinking(text, (THINK, *drop))
    if _HARMONY_CALL in drop:
        text = _HARMONY_HEADER.sub("", text)
    for token in special:
        text = text.replace(token, "")
    return text


def special_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens: ``all_special_tokens`` and every added token flagged
    special (Llama 3's ``<|eom_id|>`` is in the latter only), longest first."""
    found = {t for t in getattr(tokenizer, "all_special_tokens", []) if t}
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False) and getattr(tok, "content", None):
            found.add(tok.content)
    return sorted(found, key=lambda t: (-len(t), t))


# τ²'s orchestrator ends a conversation after max_errors (10) failed tool calls, scored 0
MAX_ERRORS = 10
ERRORS_KEY = "tau_tool_errors"
TOO_MANY_ERRORS = "too_many_errors"
# how veRL's ToolAgentLoop._call_tool answers a call that failed
_TOOL_ERRORS = ("Unknown function '", "Invalid JSON in arguments for '", "Error executing tool '")


def tool_config(domain: str) -> dict[str, Any]:
    """A veRL tool config (``tool_config_path`` yaml content) with every tool of ``domain``."""
    d = get_domain(domain)
    return {
        "tools": [
            {
                "class_name": f"{TauTool.__module__}.{TauTool.__name__}",
                "config": {"type": "native", "domain": d.name, "name": s["function"]["name"]},
            }
            for s in d.tool_schemas()
        ]
    }


@register(TAU_AGENT_NAME)
class HartsTauAgentLoop(HartsToolAgentLoop):
    """``harts_tool_agent`` with user turns from a user simulator (see module docstring).
    Extra constructor argument ``user``: the simulator config for
    :func:`~harts_verl.workers.envs.tau.make_user` (default: scripted)."""

    def __init__(self, *args: Any, user: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.max_parallel_calls != 1:
            raise ValueError(
                "actor_rollout_ref.rollout.multi_turn.max_parallel_calls: the τ agent applies "
                "its tool calls to one database in order (each call sees the ones before it), "
                f"so it runs one call per turn; set 1, got {self.max_parallel_calls!r}"
            )
        self.user = make_user(_plain(user))
        self.task: TauTask | None = None

    async def run_tree(
        self,
        sampling_params: dict[str, Any],
        fork: ForkSpec | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> list[AgentLoopOutput]:
        """As :meth:`HartsToolAgentLoop.run_tree`; the task comes from the row's
        ``interaction_kwargs`` (``domain``, ``task_id``). When the prompt does not end with a
        user message, the simulator's opening message is appended first."""
        ik = _plain(kwargs.get("interaction_kwargs")) or {}
        for key in ("domain", "task_id"):
            if not ik.get(key):
                raise ValueError(
                    f"interaction_kwargs.{key}: missing (build rows with tau.dataset_rows)"
                )
        self.task = get_domain(ik["domain"]).task(ik["task_id"])
        raw = [dict(m) for m in kwargs["raw_prompt"]]
        if not raw or raw[-1].get("role") != "user":
            opening = await asyncio.to_thread(self.user.reply, self.task, raw)
            if not opening:
                raise ValueError(
                    f"user: the simulator gave no opening message for {self.task.task_id}"
                )
            kwargs["raw_prompt"] = [*raw, {"role": "user", "content": opening}]
        outputs = await super().run_tree(sampling_params, fork=fork, priority=priority, **kwargs)
        tools = [tool.tool_schema for tool in self.tools.values()]  # as veRL passes them
        for out in outputs:  # the reward searches what the agent said, not tool or user text
            out.extra_fields.setdefault(TERMINATION_KEY, "limit")  # not ended by the user
            # the parser's own content of each turn: its tool calls out, whatever their format
            runs = model_runs(out.response_ids, out.response_mask)
            contents = await parser_contents(self.tool_parser, runs, tools)
            out.extra_fields[AGENT_TEXT_KEY] = agent_text(
                self.tokenizer, out.response_ids, out.response_mask, *self._not_said, contents
            )
        return outputs

    @functools.cached_property
    def _not_said(self) -> tuple[tuple[tuple[str, str], ...], list[str]]:
        """What the agent's text holds but does not say to the user, found once per loop: the
        tool parser's :func:`call_markers` (hermes: ``<tool_call>``, ``</tool_call>``) and the
        tokenizer's :func:`special_tokens`."""
        return call_markers(self.tool_parser), special_tokens(self.tokenizer)

    def _for_user(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the user sees it: the agent's messages without its reasoning,
        tool calls and special tokens (veRL's parser keeps those in the message content)."""
        markers, special = self._not_said
        out = []
        for m in messages:
            content = m.get("content")
            if m.get("role") == "assistant" and isinstance(content, str):
                m = {**m, "content": said(content, special, markers).strip()}
            out.append(m)
        return out

    async def _call_tool(self, tool_call: Any, tools_kwargs: Any, agent_data: AgentData) -> Any:
        """veRL's tool call, counting the failed ones (an unknown tool, arguments that are no
        JSON, a call the tool refuses) in ``extra_fields[ERRORS_KEY]``, as τ²'s orchestrator
        counts its tool errors."""
        res = await super()._call_tool(tool_call, tools_kwargs, agent_data)
        text = getattr(res[0], "text", None) or ""
        if text.startswith(_TOOL_ERRORS):
            fields = agent_data.extra_fields
            fields[ERRORS_KEY] = int(fields.get(ERRORS_KEY, 0)) + 1
        return res

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        """veRL's tool turn; the conversation ends (``tau_termination`` ``too_many_errors``,
        scored 0 as in τ²) once :data:`MAX_ERRORS` tool calls have failed."""
        state = await super()._handle_processing_tools_state(agent_data)
        if int(agent_data.extra_fields.get(ERRORS_KEY, 0)) >= MAX_ERRORS:
            agent_data.extra_fields[TERMINATION_KEY] = TOO_MANY_ERRORS
            return AgentState.TERMINATED
        return state

    async def _handle_generating_state(
        self,
        agent_data: AgentData,
        sampling_params: dict[str, Any],
        ignore_termination: bool = False,
    ) -> AgentState:
        n_messages = len(agent_data.messages)
        state = await super()._handle_generating_state(
            agent_data, sampling_params, ignore_termination=ignore_termination
        )
        # veRL appends the assistant message only when no limit stopped the turn; with no tool
        # call it then terminates: that is a message to the user.
        spoke = len(agent_data.messages) == n_messages + 1 and not agent_data.tool_calls
        if state != AgentState.TERMINATED or not spoke or self.task is None:
            return state
        # a marker inside the reasoning ("no <tool_call> yet") opens no call
        text = strip_thinking(self.tokenizer.decode(agent_data.response_ids))
        opened = [(s, e) for s, e in self._not_said[0] if s in text]
        if opened:
            # A tool call the parser could not read (e.g. invalid JSON): the model hears so
            # from the tool side, not a user reply to a message it never meant for the user.
            start, end = opened[0]
            if type(self.tool_parser).__name__ == "HermesToolParser":  # its JSON format
                form = f'{start}{{"name": <tool name>, "arguments": {{<JSON object>}}}}{end}'
            else:
                form = f"{start.strip()} ... {end}".rstrip(". ")
            error = (
                f"error: the tool call could not be parsed; write {form} as the tool "
                "instructions say, with valid arguments"
            )
            return await self._tool_side_error(agent_data, error, text[text.find(start) :])
        said_text = said(agent_data.messages[-1].get("content") or "", *self._not_said[::-1])
        if not said_text.strip():
            # nothing for the user (only reasoning or special tokens): the simulator would read
            # it as no message at all (the LLM user got the agent's greeting in its place)
            error = "error: the message was empty; write a message to the user or call a tool"
            return await self._tool_side_error(agent_data, error, "")
        reply = await asyncio.to_thread(
            self.user.reply, self.task, self._for_user(list(agent_data.messages))
        )
        if not reply:  # the user ended the conversation (the only end τ² scores)
            agent_data.extra_fields[TERMINATION_KEY] = USER_STOP
            return AgentState.TERMINATED
        state = await self._append_turn(agent_data, {"role": "user", "content": reply})
        if state == AgentState.GENERATING:
            agent_data.user_turns += 1  # veRL's generating step enforces max_user_turns
        return state

    async def _tool_side_error(self, agent_data: AgentData, error: str, text: str) -> AgentState:
        """``error`` answered from the tool side (a failed tool call: counted against
        :data:`MAX_ERRORS`, and a tool turn for ``max_user_turns``). The message names a tool
        (the one ``text`` tries to call when one is named there) since some token builders
        (gpt-oss, gemma4) must name the tool of every tool message and the turn has no call."""
        fields = agent_data.extra_fields
        fields[ERRORS_KEY] = int(fields.get(ERRORS_KEY, 0)) + 1
        # the tool named first in the call's text (the longest name at that place)
        hits = [(text.find(n), -len(n), n) for n in self.tools if n in text]
        name = min(hits)[2] if hits else "invalid_tool_call"
        state = await self._append_turn(
            agent_data, {"role": "tool", "name": name, "content": error}
        )
        if fields[ERRORS_KEY] >= MAX_ERRORS:
            fields[TERMINATION_KEY] = TOO_MANY_ERRORS
            return AgentState.TERMINATED
        if state == AgentState.GENERATING:
            agent_data.user_turns += 1  # veRL counts tool turns as user turns
        return state

    async def _append_turn(self, agent_data: AgentData, message: dict[str, Any]) -> AgentState:
        """``message`` (a user or tool turn) appended to the conversation and its tokens to
        the context with response mask 0; TERMINATED when the response length is reached."""
        previous = list(agent_data.messages)
        agent_data.messages.append(message)
        schemas = getattr(agent_data, "_active_tool_schemas", self.tool_schemas)
        merged, mask, logprobs = await self.ct_merge_context_msg(
            previous,
            agent_data.messages,
            agent_data.prompt_ids,
            agent_data.response_mask,
            agent_data.response_logprobs if agent_data.response_logprobs else None,
            tools=schemas,
        )
        if len(mask) >= self.response_length:
            return AgentState.TERMINATED
        agent_data.prompt_ids = merged.token_ids
        agent_data.response_mask = mask
        if agent_data.response_logprobs:
            agent_data.response_logprobs = logprobs or []
        return AgentState.GENERATING
