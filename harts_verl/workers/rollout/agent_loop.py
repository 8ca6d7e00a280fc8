"""Agent loop ``harts_tool_agent``: veRL's ``ToolAgentLoop`` with a turn recorder and forks.

* The server client is wrapped by a :class:`~harts_verl.workers.rollout.recorder.
  RecordingServerClient`: every ``generate`` call becomes a turn with a parent link. Each output
  carries its chain of turns in ``extra_fields["harts_tree"]`` (JSON spans over
  ``prompt_ids + response_ids``); the ``harts_fsdp2`` engine builds the batch forest from it.
* :meth:`HartsToolAgentLoop.run_tree` runs a shared prefix once and forks continuations at turn
  boundaries (:class:`ForkSpec`): the agent state is copied after the tool responses of turn t
  are merged (just before the (t+1)-th ``generate``; t = 0 is "after the prompt"), and every
  branch continues as its own request (own request id, own tool calls, own reward). Turns
  generated before the fork are recorded once and shared by the branches' metadata; the tokens
  a branch's first ``generate`` adds (the prompt at t = 0, the merged tool responses) are in its
  own first turn, so the metadata shares them only by value — the forest, built from the tokens,
  computes them once either way. A tree has exactly ``budget`` leaves
  (branches that end early hand their share back to their fork point); each leaf carries its
  fork path and GRPO fork group (:func:`fork_groups`) in ``extra_fields``.

The state machine is veRL's (``_handle_*_state`` are inherited unchanged); only ``run`` is
re-assembled so it can stop at a boundary and fork. Tools must not keep per-trajectory state
outside ``AgentData`` (veRL's ``FunctionTool`` and ``BaseTool`` create/release per call), and
the state inside it must be deep-copyable: each branch deep-copies messages, token state,
metrics, ``extra_fields`` and the prompt's media (a lock or client there is a ``TypeError``
naming the branch and the ``extra_fields`` key). Multi-modal prompts are handled as in veRL's
``ToolAgentLoop.run`` (``process_multi_modal_info``; media passed to every ``generate`` call and
to ``multi_modal_data``).
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from uuid import uuid4

import numpy as np
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

from harts_verl.tree._checks import is_int as _is_int
from harts_verl.workers.rollout.recorder import (
    TREE_KEY,
    RecordingServerClient,
    TurnRecorder,
    tree_metadata,
)

__all__ = [
    "AGENT_NAME",
    "FORK_GROUP_KEY",
    "FORK_KEYS",
    "FORK_PATH_KEY",
    "GROUP_MODES",
    "ForkSpec",
    "HartsToolAgentLoop",
    "TrajectoryTool",
    "fork_groups",
    "path_str",
]

logger = logging.getLogger(__name__)

AGENT_NAME = "harts_tool_agent"

FORK_PATH_KEY = "harts_fork_path"
"""``extra_fields`` key: the branch's fork path, e.g. ``"0.1"`` (``""``: no fork)."""
FORK_GROUP_KEY = "harts_fork_group"
"""``extra_fields`` key: fork path of the fork point that defines the branch's GRPO group
(``""``: the prompt), see :func:`fork_groups`."""


GROUP_MODES = ("prompt", "fork")
"""Values of ``harts_rollout.fork.group`` (see :func:`fork_groups`)."""

FORK_KEYS = ("enable", "turns", "branching", "budget", "policy", "group")
"""Keys of ``harts_rollout.fork`` (:meth:`ForkSpec.from_config`)."""


@dataclass(frozen=True)
class ForkSpec:
    """Where and how wide to fork, and how branches are grouped for GRPO.

    Attributes:
      turns: turn boundaries to fork at, as numbers of completed assistant turns (0 = after the
        prompt, before the first generate; 1 = after the first turn's tool responses; ...): a
        list, tuple or 1-D integer numpy array (stored as a tuple of ints). ``()``: no fork
        point, ``budget`` independent samples that all start at once (as ``turns=(0,)``).
      branching: children per fork (>= 1).
      budget: leaf trajectories per prompt (>= 1), exact: a branch that ends before its next
        fork point hands its unused share back to its fork point, which starts more children;
        the last fork level (``policy="turns"``) is widened to the whole remaining share; a
        prefix that ends before the first fork point is re-run from the prompt. So every prompt
        gives ``budget`` trajectories (veRL sizes mini-batches with ``rollout.n``: set it equal).
      policy: ``"turns"`` (fork at ``turns``) or ``"every"`` (fork at every boundary
        0, 1, 2, ... until the budget is used; ``turns`` other than the default ``(0,)`` is
        refused with it).
      group: GRPO grouping of the leaves (:func:`fork_groups`): ``"prompt"`` (default: all
        leaves of a prompt form one group, like ``rollout.n`` samples) or ``"fork"`` (leaves
        are grouped by their last fork point; singleton groups are merged).
    """

    turns: tuple[int, ...] = (0,)
    branching: int = 2
    budget: int = 4
    policy: str = "turns"
    group: str = "prompt"

    def __post_init__(self) -> None:
        # Types first (no silent truncation: 4.7 is not a budget); numpy ints are kept as ints.
        if isinstance(self.turns, np.ndarray):
            if self.turns.ndim != 1:
                raise ValueError(
                    f"fork.turns: expected a 1-D list of turn numbers, got an array of shape "
                    f"{self.turns.shape}"
                )
            object.__setattr__(self, "turns", self.turns.tolist())  # checked below
        if isinstance(self.turns, str | bytes) or not isinstance(self.turns, Sequence):
            raise ValueError(
                f"fork.turns: expected a list of turn numbers, e.g. [0, 1], got {self.turns!r}"
            )
        for t in self.turns:
            if not _is_int(t):
                raise ValueError(
                    f"fork.turns: expected integer turn numbers, got {t!r} in {list(self.turns)!r}"
                )
        object.__setattr__(self, "turns", tuple(int(t) for t in self.turns))
        for name in ("branching", "budget"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"fork.{name}: expected an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.policy, str) or self.policy not in ("turns", "every"):
            raise ValueError(f"fork.policy: expected 'turns' or 'every', got {self.policy!r}")
        if not isinstance(self.group, str) or self.group not in GROUP_MODES:
            raise ValueError(f"fork.group: expected one of {GROUP_MODES}, got {self.group!r}")
        if self.branching < 1:
            raise ValueError(f"fork.branching: expected >= 1, got {self.branching}")
        if self.budget < 1:
            raise ValueError(f"fork.budget: expected >= 1, got {self.budget}")
        if any(t < 0 for t in self.turns) or list(self.turns) != sorted(set(self.turns)):
            raise ValueError(f"fork.turns: expected increasing turn numbers >= 0, got {self.turns}")
        if self.policy == "every" and self.turns != (0,):
            raise ValueError(
                f"fork.turns: {list(self.turns)} is not used by policy='every' (it forks at every "
                "turn boundary 0, 1, 2, ... until the budget): leave turns out (or null), or use "
                "policy='turns'"
            )

    @classmethod
    def from_config(cls, cfg: Any) -> ForkSpec:
        """From a mapping/DictConfig with keys ``turns``, ``branching``, ``budget``, ``policy``,
        ``group`` (absent keys take the defaults; ``turns: null`` is the default ``[0]``) and
        ``enable`` (read by :func:`~harts_verl.workers.rollout.fork.fork_spec_of`, ignored
        here). ``ValueError`` naming ``fork.<key>`` for an unknown key or a value of the wrong
        type (no conversion: ``budget: 4.7`` or ``turns: "01"`` are errors, not 4 and (0, 1))."""
        if not hasattr(cfg, "keys") or not hasattr(cfg, "get"):
            raise ValueError(f"fork: expected a mapping of fork settings, got {type(cfg).__name__}")
        unknown = [k for k in cfg.keys() if k not in FORK_KEYS]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(str(key), FORK_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"fork.{key}: unknown key{hint}; expected some of {', '.join(FORK_KEYS)}"
            )
        kwargs = {k: cfg.get(k) for k in FORK_KEYS if k != "enable" and k in cfg.keys()}
        if kwargs.get("turns", ()) is None:
            del kwargs["turns"]
        return cls(**kwargs)

    def boundary(self, level: int) -> int | None:
        """Turn boundary of fork level ``level`` (None: no more forks)."""
        if self.policy == "every":
            return level
        return self.turns[level] if level < len(self.turns) else None


Path = tuple[int, ...]
"""A branch's fork path: its child index at each fork point it passed (``()``: no fork)."""


def path_str(path: Path) -> str:
    """``(0, 1)`` -> ``"0.1"``; ``()`` -> ``""`` (the prompt / root)."""
    return ".".join(str(i) for i in path)


def _common_prefix(a: Path, b: Path) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def fork_groups(paths: Sequence[Path], mode: str = "fork") -> list[Path]:
    """The GRPO group of each leaf of one prompt's rollout tree, named by the fork path of the
    fork point that defines it (``()`` = the prompt).

    ``mode="prompt"``: every leaf in the prompt's group. ``mode="fork"``: a leaf's group is its
    last fork point (``path[:-1]``): the leaves that share the longest common prefix with it.

    A group of one has no baseline (veRL's GRPO gives a lone member its raw score as advantage:
    mean 0, std 1), so each singleton (deepest first) joins the group whose fork point shares the
    longest prefix with its own: the group of a sibling subtree (its members diverged from the
    leaf at the leaf's fork point) before a group higher up; ties go to the smallest group, then
    the shallowest, then the lowest path. Only a tree with a single leaf keeps a group of one.
    """
    if mode not in GROUP_MODES:
        raise ValueError(f"fork.group: expected one of {GROUP_MODES}, got {mode!r}")
    if mode == "prompt":
        return [() for _ in paths]
    groups: list[Path] = [tuple(p[:-1]) for p in paths]
    counts = Counter(groups)
    for k in sorted(range(len(groups)), key=lambda k: (-len(groups[k]), groups[k])):
        g = groups[k]
        if counts[g] != 1 or len(counts) == 1:
            continue
        target = min(
            (h for h in counts if h != g),
            key=lambda h: (-_common_prefix(h, g), counts[h], len(h), h),
        )
        del counts[g]
        counts[target] += 1
        groups[k] = target
    return groups


class TrajectoryTool(BaseTool):
    """A veRL tool whose state lives in the trajectory (``agent_data.extra_fields``) and that
    reads its row's ``create_kwargs`` (kept per instance in ``_kwargs`` from ``create`` to
    ``release``). ``STATE`` says what the tool keeps in the trajectory (error messages)."""

    STATE: ClassVar[str] = "state"

    def __init__(self, config: dict[str, Any], tool_schema: Any) -> None:
        super().__init__(config, tool_schema)
        self._kwargs: dict[str, dict[str, Any]] = {}

    async def create(
        self, instance_id: str | None = None, create_kwargs: dict | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        iid, resp = await super().create(instance_id)
        self._kwargs[iid] = dict(create_kwargs or {})
        return iid, resp

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._kwargs.pop(instance_id, None)

    def _agent_data(self, kwargs: dict[str, Any]) -> AgentData:
        """The call's ``agent_data`` (``ValueError`` when the caller passed none)."""
        agent_data = kwargs.get("agent_data")
        if agent_data is None:
            raise ValueError(f"agent_data: {self.STATE} in the trajectory state")
        return agent_data

    @staticmethod
    def _check_parameters(parameters: Any) -> None:
        if not isinstance(parameters, dict):
            raise ValueError(f"parameters: expected an object, got {type(parameters).__name__}")

    def _check_known(self, parameters: dict[str, Any]) -> None:
        """``ValueError`` naming the arguments the tool's schema does not declare (a
        misspelled or unsupported option is never ignored silently)."""
        known = set(self.tool_schema.function.parameters.properties)
        unknown = sorted(set(parameters) - known)
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)}: unknown argument{'s' if len(unknown) > 1 else ''} of "
                f"{self.name} (it takes {', '.join(sorted(known)) or 'none'})"
            )


def _shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal positive shares (larger first)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


_COPIED_FIELDS = (
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
    "image_data",
    "video_data",
    "audio_data",
    "mm_processor_kwargs",
    "mm_processor_output",
)
"""``AgentData`` attributes a branch deep-copies (everything a turn mutates or appends to: the
media lists grow when a tool returns images)."""


def _deepcopy_field(value: Any, name: str, what: str) -> Any:
    """``copy.deepcopy(value)`` (a dict's items one at a time, with one memo: the same copy).
    A value that cannot be copied (``TypeError``: a lock, a client) is a ``TypeError`` naming
    ``agent_data.<name>`` and, for a dict, its key; a copy that fails while it runs (a
    ``__deepcopy__`` that clones a sandbox, say) is a ``RuntimeError`` naming them. Nothing is
    copied twice: a second try would clone such a resource again."""
    memo: dict[int, Any] = {}
    where = f"agent_data.{name}"
    try:
        if type(value) is not dict:
            return copy.deepcopy(value, memo)
        out: dict[Any, Any] = {}
        memo[id(value)] = out  # an item that refers back to the dict gets the copy, as deepcopy
        for key, item in value.items():
            where = f"agent_data.{name}[{key!r}] ({type(item).__name__})"
            out[copy.deepcopy(key, memo)] = copy.deepcopy(item, memo)
        return out
    except TypeError as exc:
        raise TypeError(
            f"harts_tool_agent: cannot copy the agent state for {what}: {where} is not "
            f"deep-copyable ({type(exc).__name__}: {exc}). Forked branches deep-copy the "
            "trajectory state (messages, token state, extra_fields, media); keep locks, clients "
            "and sessions outside AgentData (e.g. on the tool, keyed by request id)"
        ) from exc
    except Exception as exc:
        raise RuntimeError(
            f"harts_tool_agent: copying the agent state for {what} failed at {where} "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _copy_agent_data(src: AgentData, request_id: str, what: str = "a fork branch") -> AgentData:
    """A branch copy of the agent state: every field in :data:`_COPIED_FIELDS` (token and
    message state, metrics, ``extra_fields``, the prompt's media) is deep-copied, so branches
    never share a mutable list; tools and tool selection are shared. ``TypeError`` naming
    ``what`` (the branch) and the field (``extra_fields`` key) that cannot be deep-copied,
    ``RuntimeError`` naming them when a copy fails while it runs (see :func:`_deepcopy_field`)."""
    dst = copy.copy(src)
    for name in _COPIED_FIELDS:
        if hasattr(src, name):
            setattr(dst, name, _deepcopy_field(getattr(src, name), name, what))
    dst.request_id = request_id
    return dst


def _canonical(obj: Any) -> str:
    """A JSON stand-in for a message part JSON cannot hold that is the same in every process
    (an image by its bytes, size and mode; never ``str()``, which can hold a memory address)."""
    if hasattr(obj, "tobytes"):
        digest = hashlib.sha256(obj.tobytes()).hexdigest()
        return (
            f"{type(obj).__name__}:{getattr(obj, 'size', '')}:{getattr(obj, 'mode', '')}:{digest}"
        )
    return type(obj).__name__


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
    async def _new_agent_data(self, priority: int, kwargs: dict[str, Any]) -> AgentData:
        """The initial agent state, as ``ToolAgentLoop.run`` builds it: the prompt's images,
        videos and audios come from ``process_multi_modal_info`` (veRL then checks in the
        pending state that the model can take them)."""
        messages = list(kwargs["raw_prompt"])
        multi_modal_data = await self.process_multi_modal_info(messages)
        audios = multi_modal_data.get("audios")
        request_id = self._make_request_id(priority, self.rollout_config.full_determinism)
        agent_data = AgentData(
            messages=messages,
            image_data=multi_modal_data.get("images"),
            video_data=multi_modal_data.get("videos"),
            audio_data=audios,
            mm_processor_kwargs=self._get_mm_processor_kwargs(audios),
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
        sampling_params = self._request_sampling_params(sampling_params, agent_data)
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

    def _finalize(self, agent_data: AgentData, path: Path, group: Path) -> AgentLoopOutput:
        """The ``AgentLoopOutput`` of one trajectory (as ``ToolAgentLoop.run`` builds it: the
        branch's own media in ``multi_modal_data``) with the tree metadata and fork path/group
        in ``extra_fields``."""
        n_resp = len(agent_data.response_mask)
        response_ids = agent_data.prompt_ids[len(agent_data.prompt_ids) - n_resp :]
        prompt_ids = agent_data.prompt_ids[: len(agent_data.prompt_ids) - n_resp]
        response_ids = response_ids[: self.response_length]
        multi_modal_data = {}
        if agent_data.image_data is not None:
            multi_modal_data["images"] = agent_data.image_data
        if agent_data.video_data is not None:
            multi_modal_data["videos"] = agent_data.video_data
        if agent_data.audio_data is not None:
            multi_modal_data["audios"] = agent_data.audio_data
        output = AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=agent_data.response_mask[: self.response_length],
            multi_modal_data=multi_modal_data,
            mm_processor_kwargs=agent_data.mm_processor_kwargs,
            mm_processor_output=agent_data.mm_processor_output,
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
                TREE_KEY: tree_metadata(spans, fork_path=path_str(path)),
                FORK_PATH_KEY: path_str(path),
                FORK_GROUP_KEY: path_str(group),
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
        path: Path,
    ) -> list[tuple[AgentData, Path]]:
        """Run one branch to its next fork point (``fork.boundary(level)``) and fork there with
        ``budget`` leaves, or to its end: between 1 and ``budget`` leaves ``(state, path)``."""
        forks = fork is not None and budget > 1
        stop = fork.boundary(level) if forks else None  # type: ignore[union-attr]
        state = await self._advance(agent_data, state, sampling_params, stop)
        if state != AgentState.TERMINATED and forks and stop is not None:
            return await self._fork(
                agent_data, state, sampling_params, fork, level + 1, budget, path
            )
        if state != AgentState.TERMINATED:
            await self._advance(agent_data, state, sampling_params, None)
        return [(agent_data, path)]

    async def _fork(
        self,
        point: AgentData,
        state: AgentState,
        sampling_params: dict[str, Any],
        fork: ForkSpec,
        level: int,
        budget: int,
        path: Path,
        first_child: int = 0,
    ) -> list[tuple[AgentData, Path]]:
        """Children of the fork point ``point`` (each a copy of its state and its own request,
        at fork level ``level``) until they give exactly ``budget`` leaves.

        ``min(branching, budget)`` children share the budget; at the last fork level (no
        boundary below) every leaf is a child. A child that ends before its next fork point
        returns fewer leaves than its share; the missing ones are started as new children of
        this point at once, so the budget is met whatever the branches do.

        Numbering: the children of one spawn of ``total`` leaves at ``offset`` take the next
        indices, and each child with share ``s`` reserves the ``s - 1`` indices after them (in
        child order) for the children that would make up its missing leaves, recursively. So
        every child's index (its path and, under ``full_determinism``, its request id and seed)
        follows from its lineage alone, never from which branch the server finishes first;
        without early ends the children are numbered ``first_child, first_child + 1, ...``.
        """
        last = fork.boundary(level) is None
        pending: dict[asyncio.Future, tuple[int, int, int]] = {}
        leaves: dict[int, list[tuple[AgentData, Path]]] = {}
        # Copying the fork point can block (a tool's sandbox clones itself: a docker commit):
        # it runs off the event loop, one copy of this point at a time.
        copying = asyncio.Lock()

        async def branch(child_id: str, child_path: Path, share: int) -> list:
            what = (
                f"fork branch {path_str(child_path)!r} (turn boundary "
                f"{point.assistant_turns} of request {point.request_id})"
            )
            async with copying:
                child = await asyncio.to_thread(_copy_agent_data, point, child_id, what)
            child._harts_branch = True  # type: ignore[attr-defined]  # its own seed
            return await self._grow(child, state, sampling_params, fork, level, share, child_path)

        def spawn(total: int, offset: int) -> None:
            shares = _shares(total, total if last else min(fork.branching, total))
            reserve = offset + len(shares)  # the first child's block of refill indices
            for index, share in enumerate(shares, start=offset):
                child_id = self._branch_request_id(point, (*path, index))
                self.recorder.fork(point.request_id, child_id)
                task = asyncio.ensure_future(branch(child_id, (*path, index), share))
                pending[task] = (index, share, reserve)
                reserve += share - 1

        try:
            spawn(budget, first_child)
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i, share, reserve = pending.pop(task)
                    leaves[i] = task.result()
                    if len(leaves[i]) < share:  # a branch gives at least one leaf
                        spawn(share - len(leaves[i]), reserve)
        finally:
            for task in pending:
                task.cancel()
        return [leaf for i in sorted(leaves) for leaf in leaves[i]]

    def _branch_request_id(self, point: AgentData, path: Path | None) -> str:
        """The request id of a fork branch (``path``) of ``point`` or of the prompt snapshot
        (None): a fresh random id, or under ``rollout.full_determinism`` (where veRL names every
        root request ``det-{priority}``) one derived from the parent's id and the branch's fork
        path, so a forked rollout samples the same tokens again on a server that seeds each
        request by its id (``harts_hf``) and its branches still have ids of their own. Below a
        root the id also carries a hash of the root's conversation (``det-0:1a2b3c4d/0.1``), so
        the trees of different prompts in a batch do not share branch ids."""
        if not self.rollout_config.full_determinism:
            return uuid4().hex
        parent = point.request_id
        if "/" not in parent:  # a root: veRL's det-{priority}, which prompts can share
            text = json.dumps(point.messages, sort_keys=True, default=_canonical)
            parent = f"{parent}:{hashlib.sha256(text.encode()).hexdigest()[:8]}"
        return f"{parent}/{'prompt' if path is None else path_str(path)}"

    def _request_sampling_params(
        self, params: dict[str, Any], agent_data: AgentData
    ) -> dict[str, Any]:
        """The sampling parameters of ``agent_data``'s requests: the caller's ``params``, and
        for a fork branch on vLLM (``rollout.name``) under ``rollout.full_determinism`` without
        a caller's ``seed`` a seed of the branch's own, from ``rollout.seed`` and its request id.
        veRL's vLLM server seeds every request alike there (``rollout.seed`` + replica rank),
        whatever its id, so the branches of a fork point would repeat each other; with their
        own seeds they differ and still repeat from run to run. The root request keeps the
        server's seed, as ``ToolAgentLoop`` has it; other servers get ``params`` as they are
        (``harts_hf`` seeds a request by its id; SGLang takes no ``seed`` key)."""
        if (
            not getattr(agent_data, "_harts_branch", False)
            or not self.rollout_config.full_determinism
            or getattr(self.rollout_config, "name", None) != "vllm"
            or "seed" in params
        ):
            return params
        base = getattr(self.rollout_config, "seed", None) or 0
        digest = hashlib.sha256(f"{base}/{agent_data.request_id}".encode()).digest()
        return {**params, "seed": int.from_bytes(digest[:4], "big") & 0x7FFFFFFF}

    async def run_tree(
        self,
        sampling_params: dict[str, Any],
        fork: ForkSpec | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> list[AgentLoopOutput]:
        """Roll out one prompt; with ``fork``, a tree of exactly ``fork.budget`` trajectories
        (branches in depth-first order of their fork paths; with no fork point, ``turns=()``,
        all ``budget`` samples start at once). Each output's ``extra_fields``
        holds ``harts_tree`` (its turn spans, shared turns keep their ids),
        ``harts_fork_path`` (e.g. ``"1.0"``) and ``harts_fork_group`` (:func:`fork_groups`)."""
        agent_data = await self._new_agent_data(priority, kwargs)
        budget = fork.budget if fork is not None else 1
        if fork is not None and budget > 1 and fork.boundary(0) is None:
            # No fork point (turns=[]): budget independent samples, all started at once from
            # the tokenized prompt (as turns=[0]), not one after the other.
            state = await self._advance(agent_data, AgentState.PENDING, sampling_params, 0)
            leaves = await self._fork(agent_data, state, sampling_params, fork, 0, budget, ())
            return self._outputs(leaves, fork)
        prompt_state = (
            _copy_agent_data(
                agent_data,
                self._branch_request_id(agent_data, None),
                "the prompt snapshot",
            )
            if budget > 1
            else None
        )
        leaves = await self._grow(
            agent_data, AgentState.PENDING, sampling_params, fork, 0, budget, ()
        )
        if len(leaves) < budget:
            # The shared prefix ended before the first fork point: the prompt is the fork point
            # of the missing leaves (the first run becomes branch 0).
            assert fork is not None and prompt_state is not None
            (first, _), missing = leaves[0], budget - len(leaves)
            more = await self._fork(
                prompt_state, AgentState.PENDING, sampling_params, fork, 0, missing, (), 1
            )
            leaves = [(first, (0,)), *more]
        return self._outputs(leaves, fork)

    def _outputs(
        self, leaves: list[tuple[AgentData, Path]], fork: ForkSpec | None
    ) -> list[AgentLoopOutput]:
        """The outputs of a tree's leaves (in order) with their GRPO fork groups."""
        groups = fork_groups([p for _, p in leaves], fork.group if fork is not None else "prompt")
        return [self._finalize(d, p, g) for (d, p), g in zip(leaves, groups, strict=True)]
