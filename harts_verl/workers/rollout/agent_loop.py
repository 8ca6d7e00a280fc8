"""Agent loop ``harts_tool_agent``: veRL's ``ToolAgentLoop`` with a turn recorder and forks.

* The server client is wrapped by a :class:`~harts_verl.workers.rollout.recorder.
  RecordingServerClient`: every ``generate`` call becomes a turn with a parent link. Each output
  carries its chain of turns in ``extra_fields["harts_tree"]`` (JSON spans over
  ``prompt_ids + response_ids``); the ``harts_fsdp2`` engine builds the batch forest from it.
* :meth:`HartsToolAgentLoop.run_tree` runs a shared prefix once and forks continuations at turn
  boundaries (:class:`ForkSpec`): the agent state is copied after the tool responses of turn t
  are merged (just before the (t+1)-th ``generate``; t = 0 is "after the prompt"), and every
  branch continues as its own request (own request id, own tool calls, own reward). Prefix turns
  are recorded once and shared by the branches' metadata.

The state machine is veRL's (``_handle_*_state`` are inherited unchanged); only ``run`` is
re-assembled so it can stop at a boundary and fork. Tools must not keep per-trajectory state
outside ``AgentData`` (veRL's ``FunctionTool`` and ``BaseTool`` create/release per call).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop

from harts_verl.workers.rollout.recorder import (
    TREE_KEY,
    RecordingServerClient,
    TurnRecorder,
    tree_metadata,
)

__all__ = ["AGENT_NAME", "ForkSpec", "HartsToolAgentLoop"]

logger = logging.getLogger(__name__)

AGENT_NAME = "harts_tool_agent"


@dataclass(frozen=True)
class ForkSpec:
    """Where and how wide to fork.

    Attributes:
      turns: turn boundaries to fork at, as numbers of completed assistant turns (0 = after the
        prompt, before the first generate; 1 = after the first turn's tool responses; ...).
      branching: children per fork (>= 1).
      budget: most leaf trajectories per prompt (>= 1); children beyond it are not started.
      policy: ``"turns"`` (fork at ``turns``) or ``"every"`` (fork at every boundary
        0, 1, 2, ... until the budget is used).
    """

    turns: tuple[int, ...] = (0,)
    branching: int = 2
    budget: int = 4
    policy: str = "turns"

    def __post_init__(self) -> None:
        if self.policy not in ("turns", "every"):
            raise ValueError(f"fork.policy: expected 'turns' or 'every', got {self.policy!r}")
        if self.branching < 1:
            raise ValueError(f"fork.branching: expected >= 1, got {self.branching}")
        if self.budget < 1:
            raise ValueError(f"fork.budget: expected >= 1, got {self.budget}")
        if any(t < 0 for t in self.turns) or list(self.turns) != sorted(set(self.turns)):
            raise ValueError(f"fork.turns: expected increasing turn numbers >= 0, got {self.turns}")

    @classmethod
    def from_config(cls, cfg: Any) -> ForkSpec:
        """From a mapping/DictConfig with keys ``turns``, ``branching``, ``budget``, ``policy``."""
        get = cfg.get if hasattr(cfg, "get") else lambda k, d=None: getattr(cfg, k, d)
        turns = get("turns", (0,))
        return cls(
            turns=tuple(int(t) for t in (turns if turns is not None else (0,))),
            branching=int(get("branching", 2)),
            budget=int(get("budget", 4)),
            policy=str(get("policy", "turns")),
        )

    def boundary(self, level: int) -> int | None:
        """Turn boundary of fork level ``level`` (None: no more forks)."""
        if self.policy == "every":
            return level
        return self.turns[level] if level < len(self.turns) else None


def _copy_agent_data(src: AgentData, request_id: str) -> AgentData:
    """A branch copy of the agent state: token/message state and metrics are copied, tools and
    media are shared."""
    dst = copy.copy(src)
    for name in (
        "messages",
        "prompt_ids",
        "response_ids",
        "response_mask",
        "response_logprobs",
        "turn_scores",
        "tool_rewards",
        "metrics",
        "extra_fields",
        "tool_calls",
    ):
        setattr(dst, name, copy.deepcopy(getattr(src, name)))
    dst.request_id = request_id
    return dst


@register(AGENT_NAME)
class HartsToolAgentLoop(ToolAgentLoop):
    """``ToolAgentLoop`` that records its turns and can fork (see module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.server_manager, RecordingServerClient):
            self.server_manager = RecordingServerClient(self.server_manager, TurnRecorder())
        self.recorder: TurnRecorder = self.server_manager.recorder

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """One trajectory (no forks), with its turn metadata in ``extra_fields``."""
        outputs = await self.run_tree(sampling_params, fork=None, **kwargs)
        return outputs[0]

    # ------------------------------------------------------------------ tree rollout
    def _new_agent_data(self, priority: int, kwargs: dict[str, Any]) -> AgentData:
        messages = list(kwargs["raw_prompt"])
        request_id = self._make_request_id(priority, self.rollout_config.full_determinism)
        agent_data = AgentData(
            messages=messages,
            image_data=None,
            video_data=None,
            audio_data=None,
            mm_processor_kwargs=self._get_mm_processor_kwargs(None),
            metrics={},
            request_id=request_id,
            tools_kwargs=kwargs.get("tools_kwargs", {}),
        )
        extra_info = kwargs.get("extra_info", {}) or {}
        tool_selection = extra_info.get("tool_selection")
        if tool_selection and self.tools:
            selected = {name: self.tools[name] for name in tool_selection if name in self.tools}
            agent_data._active_tools = selected
            agent_data._active_tool_schemas = [
                t.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                for t in selected.values()
            ]
        else:
            agent_data._active_tools = self.tools
            agent_data._active_tool_schemas = self.tool_schemas
        return agent_data

    async def _advance(
        self,
        agent_data: AgentData,
        state: AgentState,
        sampling_params: dict[str, Any],
        stop_at_turn: int | None,
    ) -> AgentState:
        """Run the state machine until it terminates or, when ``stop_at_turn`` is given, until
        it is about to generate after ``stop_at_turn`` completed assistant turns."""
        while state != AgentState.TERMINATED:
            if (
                stop_at_turn is not None
                and state == AgentState.GENERATING
                and agent_data.assistant_turns >= stop_at_turn
            ):
                return state
            if state == AgentState.PENDING:
                state = await self._handle_pending_state(agent_data, sampling_params)
            elif state == AgentState.GENERATING:
                state = await self._handle_generating_state(agent_data, sampling_params)
            elif state == AgentState.PROCESSING_TOOLS:
                state = await self._handle_processing_tools_state(agent_data)
            else:
                logger.error("harts_tool_agent: invalid state %s", state)
                state = AgentState.TERMINATED
        return state

    def _finalize(self, agent_data: AgentData, branch: str) -> AgentLoopOutput:
        """The ``AgentLoopOutput`` of one trajectory (as ``ToolAgentLoop.run`` builds it) with
        the tree metadata in ``extra_fields``."""
        n_resp = len(agent_data.response_mask)
        response_ids = agent_data.prompt_ids[len(agent_data.prompt_ids) - n_resp :]
        prompt_ids = agent_data.prompt_ids[: len(agent_data.prompt_ids) - n_resp]
        response_ids = response_ids[: self.response_length]
        output = AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=agent_data.response_mask[: self.response_length],
            multi_modal_data={},
            mm_processor_kwargs=agent_data.mm_processor_kwargs,
            response_logprobs=agent_data.response_logprobs[: self.response_length]
            if agent_data.response_logprobs
            else None,
            num_turns=agent_data.user_turns + agent_data.assistant_turns + 1,
            metrics=agent_data.metrics,
            routed_experts=(
                agent_data.routed_experts[: len(prompt_ids) + self.response_length]
                if agent_data.routed_experts is not None
                else None
            ),
            extra_fields=agent_data.extra_fields,
        )
        spans = self.recorder.spans(agent_data.request_id, prompt_ids + response_ids)
        output.extra_fields.update(
            {
                "turn_scores": agent_data.turn_scores,
                "tool_rewards": agent_data.tool_rewards,
                TREE_KEY: tree_metadata(spans, branch=branch),
                "harts_branch": branch,
            }
        )
        return output

    async def _grow(
        self,
        agent_data: AgentData,
        state: AgentState,
        sampling_params: dict[str, Any],
        fork: ForkSpec | None,
        level: int,
        budget: int,
        branch: str,
    ) -> list[AgentLoopOutput]:
        stop = fork.boundary(level) if fork is not None else None
        state = await self._advance(agent_data, state, sampling_params, stop)
        if state == AgentState.TERMINATED or fork is None or budget <= 1:
            if state != AgentState.TERMINATED:
                state = await self._advance(agent_data, state, sampling_params, None)
            return [self._finalize(agent_data, branch)]
        children = min(fork.branching, budget)
        shares = [budget // children + (1 if i < budget % children else 0) for i in range(children)]
        tasks = []
        for i, share in enumerate(shares):
            child_id = uuid4().hex
            self.recorder.fork(agent_data.request_id, child_id)
            child = _copy_agent_data(agent_data, child_id)
            child_branch = f"{branch}.{i}" if branch else str(i)
            tasks.append(
                self._grow(child, state, sampling_params, fork, level + 1, share, child_branch)
            )
        results = await asyncio.gather(*tasks)
        return [o for r in results for o in r]

    async def run_tree(
        self,
        sampling_params: dict[str, Any],
        fork: ForkSpec | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> list[AgentLoopOutput]:
        """Roll out one prompt; with ``fork``, a tree of at most ``fork.budget`` trajectories
        (branches in depth-first order). Each output's ``extra_fields`` holds ``harts_tree``
        (its turn spans, shared turns keep their ids) and ``harts_branch`` (e.g. ``"1.0"``)."""
        agent_data = self._new_agent_data(priority, kwargs)
        budget = fork.budget if fork is not None else 1
        return await self._grow(
            agent_data, AgentState.PENDING, sampling_params, fork, 0, budget, ""
        )
