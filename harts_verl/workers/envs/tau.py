"""τ-bench style tasks (τ²/τ³-Bench): domain tools over a database, a user simulator, and a
reward that compares the final database with the one the task's reference actions produce.

* :class:`TauDomain`: tool schemas, tasks, a fresh state per task, tool calls that mutate the
  state, a database hash. Two implementations: :class:`FixtureDomain` (a JSON database with
  four retail tools, bundled as ``fixtures/tau/retail_mini``) and :class:`Tau2Domain` (the
  ``tau2`` package's domains ``retail``, ``airline``, ``telecom``, ...; imported lazily).
* Trajectory state is the *action log*: the list of successful tool calls
  (``{"name", "arguments", "requestor"}``). The state after a log is obtained by replaying it
  on the task's initial state (:func:`state_after`, cached by prefix), so a forked branch
  only needs its own copy of the log, and the reward needs no live environment.
* :func:`score`: 1.0 iff the database after the agent's actions has the same hash as after
  the task's reference actions (τ-bench's database check) and every required output string
  appears in the agent's text.
* User simulators (:func:`make_user`): :class:`ScriptedUser` (the task's scripted replies, for
  tests and fixtures) and :class:`LLMUser` (an OpenAI-compatible chat endpoint playing the
  user from the task instruction, τ-bench style, ``###STOP###`` ends the conversation).
"""

from __future__ import annotations

import copy
import hashlib
import http.client
import json
import logging
import os
import threading
import time
import urllib.request
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

from harts_verl.tree._checks import check_int

__all__ = [
    "ENDS",
    "FIXTURE_DOMAIN",
    "STOP",
    "TERMINATION_KEY",
    "USER_STOP",
    "FixtureDomain",
    "LLMUser",
    "RefusedReference",
    "ScriptedUser",
    "Tau2Domain",
    "TauDomain",
    "TauTask",
    "check_tasks",
    "compute_score",
    "dataset_rows",
    "get_domain",
    "make_user",
    "reference_state",
    "score",
    "state_after",
    "strip_thinking",
]

logger = logging.getLogger(__name__)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "tau")
FIXTURE_DOMAIN = "retail_mini"
DATA_SOURCE = "tau_bench"
STOP = "###STOP###"
# τ²'s user simulator ends a conversation with any of these: done, handed to a human agent, or
# a scenario that does not say how to go on
TRANSFER, OUT_OF_SCOPE = "###TRANSFER###", "###OUT-OF-SCOPE###"
ENDS = (STOP, TRANSFER, OUT_OF_SCOPE)
GREETING = "Hi! How can I help you today?"
# ``extra_fields`` key the τ agent loop sets to USER_STOP when the user simulator ended the
# conversation (τ²'s USER_STOP); a trajectory a turn or length limit cut off carries another
# value and scores 0, as τ² scores every termination but an agent's or user's stop
TERMINATION_KEY = "tau_termination"
USER_STOP = "user_stop"
THINK = ("<think>", "</think>")


def strip_thinking(text: str, blocks: tuple[tuple[str, str], ...] = (THINK,)) -> str:
    """``text`` without its ``start ... end`` blocks (a reasoning model's ``<think>...</think>``
    by default); a block left open runs to the end of the text, and an ``end`` before any
    ``start`` closes a block opened before the text (a chat template that puts ``<think>`` in
    the generation prompt): everything up to it is dropped."""
    for start, end in blocks:
        if not start:
            continue
        first_end = text.find(end) if end else -1
        if first_end >= 0 and not 0 <= text.find(start) < first_end:
            text = text[first_end + len(end) :]
        out, pos = [], 0
        while True:
            i = text.find(start, pos)
            if i < 0:
                out.append(text[pos:])
                break
            out.append(text[pos:i])
            j = text.find(end, i + len(start)) if end else -1
            if j < 0:
                break
            pos = j + len(end)
        text = "".join(out)
    return text


# τ²'s reward components (``RewardType``); this reward computes DB and COMMUNICATE
REWARD_TYPES = ("DB", "COMMUNICATE", "ENV_ASSERTION", "NL_ASSERTION", "ACTION")
COMPUTED_REWARD_TYPES = ("DB", "COMMUNICATE")


def _scorable(task: TauTask) -> bool:
    """Whether :func:`score` computes a component of ``task``'s ``reward_basis``."""
    return bool(set(task.reward_basis) & set(COMPUTED_REWARD_TYPES))


@dataclass(frozen=True)
class TauTask:
    """One task: ``instruction`` (what the simulated user wants), reference ``actions``
    (``{"name", "arguments", "requestor"}``), required ``outputs`` (strings the agent must say),
    for scripted users ``user_script`` (the user's messages in order), and ``reward_basis``
    (τ²'s: the components that gate the reward; :func:`score` computes ``DB`` and
    ``COMMUNICATE``, τ-bench's default pair)."""

    task_id: str
    instruction: str
    actions: tuple[dict[str, Any], ...]
    outputs: tuple[str, ...] = ()
    user_script: tuple[str, ...] = ()
    reward_basis: tuple[str, ...] = ("DB", "COMMUNICATE")

    KEYS: ClassVar[frozenset[str]] = frozenset(
        {"task_id", "instruction", "actions", "outputs", "user_script", "reward_basis"}
    )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TauTask:
        """Parse a task dict; ``ValueError`` names the task (its ``task_id``) and a missing,
        unknown or malformed field: ``task_id`` a non-empty string (or an int), ``instruction``
        a string, ``actions`` objects with a tool ``name``, ``arguments`` (an object) and
        ``requestor`` (``assistant`` or ``user``), ``outputs`` / ``user_script`` lists of
        strings, ``reward_basis`` a list of :data:`REWARD_TYPES`."""
        if not isinstance(d, dict):
            raise TypeError(f"task: expected a dict, got {type(d).__name__}")
        tid = d.get("task_id")
        if isinstance(tid, int) and not isinstance(tid, bool):
            tid = str(tid)
        if not isinstance(tid, str) or not tid:
            raise ValueError(f"task_id: expected a non-empty string, got {tid!r}")
        where = f"task {tid!r}"
        unknown = sorted(set(d) - cls.KEYS)
        if unknown:
            raise ValueError(f"{where}: {unknown[0]}: unknown key (known: {sorted(cls.KEYS)})")
        for key in ("instruction", "actions"):
            if key not in d:
                raise ValueError(f"{where}: {key}: missing from the task")
        if not isinstance(d["instruction"], str):
            raise ValueError(f"{where}: instruction: expected a string")
        actions = d["actions"]
        if not isinstance(actions, (list, tuple)):
            raise ValueError(f"{where}: actions: expected a list, got {type(actions).__name__}")
        norm = []
        for i, a in enumerate(actions):
            if not isinstance(a, dict) or not isinstance(a.get("name"), str) or not a["name"]:
                raise ValueError(f"{where}: actions[{i}].name: expected a tool name")
            bad = sorted(set(a) - {"name", "arguments", "requestor"})
            if bad:
                raise ValueError(f"{where}: actions[{i}].{bad[0]}: unknown key")
            if not isinstance(a.get("arguments", {}), dict):
                raise ValueError(f"{where}: actions[{i}].arguments: expected an object")
            requestor = a.get("requestor", "assistant")
            if requestor not in ("assistant", "user"):
                raise ValueError(
                    f"{where}: actions[{i}].requestor: expected 'assistant' or 'user', "
                    f"got {requestor!r}"
                )
            norm.append(_action(a["name"], a.get("arguments", {}), requestor))
        for key in ("outputs", "user_script"):
            v = d.get(key, [])
            if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
                raise ValueError(f"{where}: {key}: expected a list of strings")
        basis = d.get("reward_basis", cls.reward_basis)
        if (
            not isinstance(basis, (list, tuple))
            or not basis
            or not all(b in REWARD_TYPES for b in basis)
        ):
            raise ValueError(
                f"{where}: reward_basis: expected a non-empty list of {list(REWARD_TYPES)}, "
                f"got {basis!r}"
            )
        return cls(
            task_id=tid,
            instruction=d["instruction"],
            actions=tuple(norm),
            outputs=tuple(d.get("outputs", ())),
            user_script=tuple(d.get("user_script", ())),
            reward_basis=tuple(basis),
        )


def _action(name: str, arguments: dict[str, Any], requestor: str = "assistant") -> dict[str, Any]:
    return {"name": str(name), "arguments": dict(arguments), "requestor": str(requestor)}


class TauDomain(ABC):
    """A tool environment over a database (see module docstring)."""

    name: str
    policy: str
    # whether :func:`state_after` caches replayed states (copies) of this domain
    cache_states: bool = True

    @abstractmethod
    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI function-tool schemas (``{"type": "function", "function": {...}}``)."""

    @abstractmethod
    def tasks(self) -> list[TauTask]:
        """All tasks of the domain."""

    @property
    def cache_key(self) -> str:
        """What the replay cache tells this domain's states by: its name (a fixture domain, its
        folder)."""
        return self.name

    def split_tasks(self, split: str) -> list[TauTask]:
        """The tasks of the named split; a domain without splits raises ``ValueError``."""
        raise ValueError(f"split: domain {self.name} has no task splits (got {split!r})")

    def task(self, task_id: str) -> TauTask:
        """The task ``task_id``; ``ValueError`` naming it if unknown."""
        for t in self.tasks():
            if t.task_id == task_id:
                return t
        raise ValueError(f"task_id: unknown task {task_id!r} in domain {self.name}")

    @abstractmethod
    def initial_state(self, task: TauTask) -> Any:
        """A fresh state for ``task``."""

    @abstractmethod
    def call(self, state: Any, action: dict[str, Any]) -> str:
        """Execute ``action`` on ``state`` (mutating it) and return the tool's answer text. A
        call the tool refuses raises ``ValueError`` naming the argument, and leaves ``state``
        unchanged."""

    @abstractmethod
    def db_hash(self, state: Any) -> str:
        """A hash of the database in ``state`` (equal hash = equal database)."""

    def copy_state(self, state: Any) -> Any:
        """An independent copy of ``state``."""
        return copy.deepcopy(state)


# ---------------------------------------------------------------------- fixture domain
class FixtureDomain(TauDomain):
    """A tiny retail domain: users, products, orders in a JSON database; tools
    ``find_user_id_by_email``, ``get_order_details``, ``cancel_pending_order``,
    ``modify_pending_order_address``; a policy text; tasks from ``tasks.json``."""

    REASONS = ("no longer needed", "ordered by mistake")

    def __init__(self, path: str | None = None) -> None:
        path = path or os.path.join(FIXTURES, FIXTURE_DOMAIN)
        self.name = os.path.basename(path.rstrip("/"))
        self._folder = os.path.abspath(path)
        with open(os.path.join(path, "db.json")) as f:
            self._db = json.load(f)
        with open(os.path.join(path, "tasks.json")) as f:
            raw = json.load(f)
        if not isinstance(raw, list):
            raise ValueError(f"{path}/tasks.json: expected a list of tasks")
        self._tasks = []
        seen: set[str] = set()
        for i, t in enumerate(raw):
            try:
                task = TauTask.from_dict(t)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}/tasks.json[{i}]: {exc}") from exc
            if task.task_id in seen:
                raise ValueError(f"{path}/tasks.json[{i}]: duplicate task_id {task.task_id!r}")
            seen.add(task.task_id)
            self._tasks.append(task)
        with open(os.path.join(path, "policy.md")) as f:
            self.policy = f.read()

    @property
    def cache_key(self) -> str:
        return self._folder

    def tasks(self) -> list[TauTask]:
        return list(self._tasks)

    def tool_schemas(self) -> list[dict[str, Any]]:
        def fn(name: str, desc: str, props: dict[str, str]) -> dict[str, Any]:
            return {
                "type": "function",
                "function": {
                    "name": name,
                    "description": desc,
                    "parameters": {
                        "type": "object",
                        "properties": {
                            k: {"type": "string", "description": v} for k, v in props.items()
                        },
                        "required": list(props),
                    },
                },
            }

        return [
            fn("find_user_id_by_email", "Find a user's id by email.", {"email": "the email"}),
            fn(
                "get_order_details",
                "Status, items and address of an order.",
                {"order_id": "e.g. #W1001"},
            ),
            fn(
                "cancel_pending_order",
                "Cancel a pending order.",
                {"order_id": "e.g. #W1001", "reason": "'no longer needed' or 'ordered by mistake'"},
            ),
            fn(
                "modify_pending_order_address",
                "Change the shipping address of a pending order.",
                {"order_id": "e.g. #W1001", "address": "the new address"},
            ),
        ]

    def initial_state(self, task: TauTask) -> dict[str, Any]:
        return copy.deepcopy(self._db)

    @staticmethod
    def _arg(args: dict[str, Any], name: str) -> str:
        v = args.get(name)
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"{name}: missing or not a string")
        return v.strip()

    def _order(self, db: dict[str, Any], args: dict[str, Any], pending: bool) -> dict[str, Any]:
        oid = self._arg(args, "order_id")
        order = db["orders"].get(oid)
        if order is None:
            raise ValueError(f"order_id: order {oid} not found")
        if pending and order["status"] != "pending":
            raise ValueError(f"order_id: order {oid} is {order['status']}, not pending")
        return order

    def call(self, state: dict[str, Any], action: dict[str, Any]) -> str:
        name, args = action["name"], action.get("arguments", {})
        if name == "find_user_id_by_email":
            email = self._arg(args, "email").lower()
            for uid, user in state["users"].items():
                if user["email"] == email:
                    return uid
            raise ValueError(f"email: no user with email {email}")
        if name == "get_order_details":
            oid = self._arg(args, "order_id")
            return json.dumps({"order_id": oid, **self._order(state, args, pending=False)})
        if name == "cancel_pending_order":
            reason = self._arg(args, "reason")
            if reason not in self.REASONS:
                raise ValueError(f"reason: expected one of {list(self.REASONS)}, got {reason!r}")
            order = self._order(state, args, pending=True)
            order["status"], order["cancel_reason"] = "cancelled", reason
            return json.dumps({"order_id": args["order_id"], **order})
        if name == "modify_pending_order_address":
            address = self._arg(args, "address")
            order = self._order(state, args, pending=True)
            order["address"] = address
            return json.dumps({"order_id": args["order_id"], **order})
        raise ValueError(f"name: unknown tool {name!r}")

    def db_hash(self, state: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------- tau2 package
class Tau2Domain(TauDomain):
    """A domain of the ``tau2`` package (sierra-research/tau2-bench): environment, tools and
    tasks from its registry. The reward is τ²'s action-replay database check plus its
    ``communicate_info`` items as required outputs (each searched case-insensitively, as a
    substring, in the agent's own text: no LLM judge); τ²'s natural-language assertions need
    an LLM judge and are not computed. Reference actions a *user* performs (``requestor:
    "user"``, the telecom domain) are replayed into the reference database, but neither the
    agent nor this package's user simulators can call user tools, so such tasks cannot reach
    the reference state."""

    # a copy of a τ² environment (about 10 MB for retail: 512 cached states, 5 GB per process)
    # took about 300 ms, a fresh one replaying a 6-call log about 50 ms: replays are not cached
    cache_states = False

    def __init__(self, domain: str) -> None:
        try:
            from tau2.registry import registry
        except ImportError as exc:
            raise ImportError(
                f"domain 'tau2:{domain}' needs the 'tau2' package "
                "(pip install git+https://github.com/sierra-research/tau2-bench)"
            ) from exc
        self.name = f"tau2:{domain}"
        self._make_env = registry.get_env_constructor(domain)
        self._load_tasks = registry.get_tasks_loader(domain)
        self._raw = {t.id: t for t in self._load_tasks()}
        env = self._make_env()
        self.policy = env.get_policy()
        self._schemas = [t.openai_schema for t in env.get_tools()]
        self._tasks = self._converted_tasks()  # once: every reward looks its task up

    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self._schemas)

    def tasks(self) -> list[TauTask]:
        return list(self._tasks)

    def _converted_tasks(self) -> list[TauTask]:
        """The registry's tasks as :class:`TauTask`."""
        out = []
        for tid, t in self._raw.items():
            crit = t.evaluation_criteria
            acts = (crit.actions or []) if crit is not None else []
            outs = (crit.communicate_info or []) if crit is not None else []
            basis = (crit.reward_basis or ()) if crit is not None else ()
            out.append(
                TauTask(
                    task_id=str(tid),
                    instruction=str(t.user_scenario),
                    actions=tuple(_action(a.name, a.arguments, a.requestor) for a in acts),
                    outputs=tuple(str(o) for o in outs),
                    reward_basis=tuple(str(getattr(b, "value", b)) for b in basis)
                    or TauTask.reward_basis,
                )
            )
        return out

    def split_tasks(self, split: str) -> list[TauTask]:
        """The tasks of τ²'s task split ``split`` (``train``, ``test``, ...: the domain's
        ``split_tasks.json``); ``ValueError`` naming the split when the domain has no such
        split."""
        try:
            ids = {str(t.id) for t in self._load_tasks(task_split_name=split)}
        except (TypeError, ValueError, FileNotFoundError) as exc:
            raise ValueError(f"split: {self.name} has no task split {split!r} ({exc})") from exc
        return [t for t in self.tasks() if t.task_id in ids]

    def initial_state(self, task: TauTask) -> Any:
        env = self._make_env()
        init = self._raw[task.task_id].initial_state
        if init is not None:
            env.set_state(
                initialization_data=init.initialization_data,
                initialization_actions=init.initialization_actions,
                message_history=[],
            )
        return env

    def call(self, state: Any, action: dict[str, Any]) -> str:
        try:
            resp = state.make_tool_call(
                action["name"],
                requestor=action.get("requestor", "assistant"),
                **action["arguments"],
            )
            state.sync_tools()
        except Exception as exc:  # tau2 tools raise on refused calls
            raise ValueError(f"{action['name']}: {exc}") from exc
        return state.to_json_str(resp)

    def db_hash(self, state: Any) -> str:
        return f"{state.get_db_hash()}/{state.get_user_db_hash()}"


_DOMAINS: dict[str, TauDomain] = {}
_DOMAINS_LOCK = threading.Lock()


def get_domain(name: str) -> TauDomain:
    """The domain ``name`` (cached per process): ``retail_mini`` (bundled fixture) or
    ``tau2:<domain>`` (the ``tau2`` package)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"domain: expected a domain name, got {name!r}")
    with _DOMAINS_LOCK:
        if name not in _DOMAINS:
            if name.startswith("tau2:"):
                _DOMAINS[name] = Tau2Domain(name.split(":", 1)[1])
            elif os.path.isdir(os.path.join(FIXTURES, name)):
                _DOMAINS[name] = FixtureDomain(os.path.join(FIXTURES, name))
            else:
                raise ValueError(f"domain: unknown domain {name!r} (fixtures: {FIXTURE_DOMAIN})")
        return _DOMAINS[name]


# ---------------------------------------------------------------------- replay and reward
class RefusedReference(ValueError):
    """A task's reference action that the domain refuses (:func:`state_after` with
    ``strict``)."""


_CACHE: OrderedDict[tuple, Any] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 512


def _key(
    domain: TauDomain, task_id: str, actions: list[dict[str, Any]], strict: bool = False
) -> tuple:
    """Cache key of a replay (the domain's ``cache_key``: its name, or a fixture's folder);
    strict replays (every action succeeded) are cached apart."""
    return (domain.cache_key, task_id, json.dumps(actions, sort_keys=True), strict)


def state_after(
    domain: TauDomain, task_id: str, actions: list[dict[str, Any]], strict: bool = False
) -> Any:
    """The state of ``task_id`` after replaying ``actions`` in order (a fresh object the caller
    may mutate). Calls the domain refuses are skipped (they changed nothing when made); with
    ``strict`` (a task's reference actions, :func:`reference_state` / :func:`check_tasks`) a
    refused call raises :class:`RefusedReference` naming the task and the action."""
    actions = [
        _action(a["name"], a.get("arguments", {}), a.get("requestor", "assistant")) for a in actions
    ]
    base = None
    cached = domain.cache_states
    with _CACHE_LOCK:  # the longest cached prefix
        for k in range(len(actions) if cached else 0, 0, -1):
            key = _key(domain, task_id, actions[:k], strict)
            if key in _CACHE:
                base = _CACHE[key]
                _CACHE.move_to_end(key)  # least recently used goes first
                break
        else:
            k = 0
    state = (
        domain.copy_state(base) if base is not None else domain.initial_state(domain.task(task_id))
    )
    for i, a in enumerate(actions[k:], start=k):
        try:
            domain.call(state, a)
        except ValueError as exc:
            if strict:
                raise RefusedReference(
                    f"task {task_id!r}: reference actions[{i}] ({a['name']}) is refused by "
                    f"domain {domain.name}: {exc}"
                ) from exc
    if cached:
        with _CACHE_LOCK:
            _CACHE[_key(domain, task_id, actions, strict)] = domain.copy_state(state)
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return state


def score(
    domain: TauDomain, task_id: str, actions: list[dict[str, Any]], agent_text: str = ""
) -> dict[str, float]:
    """τ-bench reward: ``db_match`` (database after ``actions`` == after the reference actions,
    :func:`reference_state`; 1.0 when ``DB`` is not in the task's ``reward_basis``),
    ``outputs_found`` (every required output occurs in ``agent_text`` with its commas removed,
    case-insensitive, as τ²'s check reads the agent's messages), ``score`` = 1.0 iff those of
    them in the task's ``reward_basis`` hold. ``ValueError`` naming the task when its basis
    holds neither ``DB`` nor ``COMMUNICATE`` (the other components, ``ENV_ASSERTION``,
    ``NL_ASSERTION``, ``ACTION``, are not computed here; :func:`check_tasks` finds such tasks
    before training)."""
    task = domain.task(task_id)
    if not _scorable(task):
        raise ValueError(
            f"task {task_id!r}: reward_basis {list(task.reward_basis)} has no component this "
            f"reward computes ({list(COMPUTED_REWARD_TYPES)})"
        )
    db = True
    if "DB" in task.reward_basis:
        got = domain.db_hash(state_after(domain, task_id, actions))
        db = got == domain.db_hash(reference_state(domain, task))
    text = (agent_text or "").lower().replace(",", "")
    outputs = all(o.lower() in text for o in task.outputs)
    ok = db and ("COMMUNICATE" not in task.reward_basis or outputs)
    return {
        "score": 1.0 if ok else 0.0,
        "db_match": float(db),
        "outputs_found": float(outputs),
    }


_REFUSED_REFERENCES: set[tuple] = set()  # (domain, task) whose reference has a refused call
_REFUSED_LOCK = threading.Lock()


def reference_state(domain: TauDomain, task: TauTask) -> Any:
    """The database the task's reference actions produce. A reference call the domain refuses
    is skipped, as τ²'s evaluator does (its retail tasks have such calls, mostly read-only
    look-ups), with one WARNING per task naming it (:func:`check_tasks` lists them up front)."""
    key = (domain.cache_key, task.task_id)
    if key not in _REFUSED_REFERENCES:  # known refused: straight to the lenient replay
        try:
            return state_after(domain, task.task_id, list(task.actions), strict=True)
        except RefusedReference as exc:
            with _REFUSED_LOCK:
                first = key not in _REFUSED_REFERENCES
                _REFUSED_REFERENCES.add(key)
            if first:
                logger.warning("%s; the refused call is skipped (as τ²'s evaluator does)", exc)
    return state_after(domain, task.task_id, list(task.actions))


def check_tasks(domain: TauDomain, tasks: list[TauTask]) -> dict[str, list[str]]:
    """Two kinds of task among ``tasks``: ``unscorable`` (a ``reward_basis`` with neither
    ``DB`` nor ``COMMUNICATE``, e.g. τ² telecom's ``ENV_ASSERTION``: :func:`score` raises for
    them) and ``refused_reference`` (a DB task whose reference actions include a call the
    domain refuses: the message naming the first such call, per task; skipped when scored).
    Components of a basis other than DB and COMMUNICATE are not computed, so a task that also
    lists them is scored more leniently than τ² does."""
    unscorable, refused = [], []
    for task in tasks:
        if not _scorable(task):
            unscorable.append(task.task_id)
        elif "DB" in task.reward_basis:
            try:
                state_after(domain, task.task_id, list(task.actions), strict=True)
            except RefusedReference as exc:
                refused.append(str(exc))
    return {"unscorable": unscorable, "refused_reference": refused}


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    """veRL reward function: :func:`score` of the trajectory's ``tau_actions`` (recorded by the
    tools in ``extra_fields``) for the row's ``tau_domain`` / ``tau_task_id``. Required outputs
    are searched in what the agent itself wrote: ``tau_agent_text``, which ``harts_tau_agent``
    records (its model-generated tokens, decoded; tool answers and user turns, which veRL's
    decoded ``solution_str`` also holds, are left out); ``solution_str`` only for a trajectory
    without it. As τ²: a conversation the user did not end (``tau_termination`` other than
    ``user_stop``: a turn or length limit cut it off) scores 0, whatever its database;
    ``user_stopped`` says which (1.0 also for a row without ``tau_termination``, e.g. from
    another agent loop)."""
    info = extra_info or {}
    for key in ("tau_domain", "tau_task_id"):
        if not info.get(key):
            raise ValueError(f"extra_info.{key}: missing (build rows with tau.dataset_rows)")
    actions = info.get("tau_actions") or []
    text = info.get("tau_agent_text")
    text = solution_str if text is None else str(text)
    out = score(get_domain(info["tau_domain"]), info["tau_task_id"], list(actions), text)
    stopped = info.get(TERMINATION_KEY, USER_STOP) == USER_STOP
    out["user_stopped"] = float(stopped)
    if not stopped:
        out["score"] = 0.0
    return out


# ---------------------------------------------------------------------- users
class ScriptedUser:
    """Replies with the task's ``user_script``: the k-th user message of the conversation is
    ``user_script[k]``; after the script, the user stops (``None``)."""

    def reply(self, task: TauTask, messages: list[dict[str, Any]]) -> str | None:
        k = sum(1 for m in messages if m.get("role") == "user")
        line = task.user_script[k] if k < len(task.user_script) else None
        # a line with a stop marker ends the conversation, as it does for the LLM user
        return None if line is None or any(end in line for end in ENDS) else line


USER_SYSTEM_PROMPT = (
    "You are a customer talking to a customer-service agent. Your goal and what you know:\n"
    "{instruction}\n\nWrite only your next message, one or two sentences, in character. "
    "Do not invent information you were not given. When your goal is reached or cannot be "
    f"reached, reply with exactly {STOP}. If you are transferred to another agent, reply with "
    f"exactly {TRANSFER}."
)


class LLMUser:
    """A user simulated by an OpenAI-compatible ``/chat/completions`` endpoint (vLLM, SGLang,
    a hosted API). The agent's messages are the simulator's "user" turns and vice versa; tool
    messages are not shown to it. A reply containing ``###STOP###`` (or τ²'s ``###TRANSFER###``
    / ``###OUT-OF-SCOPE###``) ends the conversation."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        temperature: float = 0.0,
        max_tokens: int = 256,
        timeout: float = 120.0,
        seed: int | None = None,
        extra_body: dict[str, Any] | None = None,
        retries: int = 2,
    ) -> None:
        if not base_url:
            raise ValueError("user.base_url: expected the endpoint URL (e.g. http://host:8000/v1)")
        if not model:
            raise ValueError("user.model: expected the model name")
        if extra_body is not None and not isinstance(extra_body, dict):
            raise ValueError(
                "user.extra_body: expected a mapping of request fields (e.g. "
                "{chat_template_kwargs: {enable_thinking: false}})"
            )
        self.base_url, self.model = base_url.rstrip("/"), model
        self.api_key_env, self.temperature = api_key_env, float(temperature)
        self.max_tokens, self.timeout = int(max_tokens), float(timeout)
        self.seed = None if seed is None else int(seed)
        self.extra_body = dict(extra_body or {})
        # transport failures only: the same request gives the same text
        self.retries = check_int("user.retries", retries, 0)

    def conversation(self, task: TauTask, messages: list[dict[str, Any]]) -> list[dict[str, str]]:
        """The simulator's chat: its system prompt, then the visible turns with roles swapped.
        An agent turn answered by a tool (its text beside a tool call) goes to the environment,
        not the user, as in τ²; turns of one role in a row are joined (chat templates that
        require alternating roles refused two user turns in a row)."""
        conv = [
            {"role": "system", "content": USER_SYSTEM_PROMPT.format(instruction=task.instruction)}
        ]
        swap = {"assistant": "user", "user": "assistant"}
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role not in swap or not isinstance(content, str) or not content.strip():
                continue
            nxt = messages[i + 1].get("role") if i + 1 < len(messages) else None
            if role == "assistant" and nxt == "tool":
                continue
            if len(conv) > 1 and conv[-1]["role"] == swap[role]:
                conv[-1] = {**conv[-1], "content": f"{conv[-1]['content']}\n\n{content}"}
            else:
                conv.append({"role": swap[role], "content": content})
        if len(conv) == 1 or conv[-1]["role"] != "user":
            conv.append({"role": "user", "content": GREETING})
        return conv

    def reply(self, task: TauTask, messages: list[dict[str, Any]]) -> str | None:
        """The simulator's next message (its reasoning, ``<think>...</think>``, removed), or
        None when it says one of :data:`ENDS` (``###STOP###``, ...). A failed request
        (connection, timeout, HTTP 408 / 429 / 5xx) is sent again, ``retries`` times, after
        0.5 s, 1 s, ... (then its error is raised; other HTTP errors at once). ``ValueError``
        for a reply without message text (e.g. a reasoning model cut off by ``max_tokens``
        while thinking): an empty reply would otherwise end the conversation as if the user
        had stopped."""
        body = {
            **self.extra_body,
            "model": self.model,
            "messages": self.conversation(task, messages),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        req = urllib.request.Request(
            f"{self.base_url}/chat/completions",
            data=json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {os.environ.get(self.api_key_env, 'EMPTY')}",
            },
        )
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    choice = json.loads(resp.read())["choices"][0]
                break
            except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, ...
                code = getattr(exc, "code", None)
                transient = code is None or code in (408, 429) or code >= 500
                if attempt == self.retries or not transient:
                    raise
                time.sleep(0.5 * 2**attempt)
        text = strip_thinking(choice["message"].get("content") or "")
        if any(end in text for end in ENDS):
            return None
        if text.strip():
            return text.strip()
        raise ValueError(
            f"user: the simulator {self.model!r} returned no message text for task "
            f"{task.task_id!r} (finish_reason {choice.get('finish_reason')!r}; a reasoning "
            "model cut off while thinking? raise user.max_tokens or turn thinking off with "
            "user.extra_body)"
        )


def make_user(config: dict[str, Any] | None) -> ScriptedUser | LLMUser:
    """A user simulator from ``{"kind": "scripted"}`` or ``{"kind": "llm", "base_url", "model",
    ...}`` (:class:`LLMUser` arguments); ``ValueError`` names a bad key."""
    cfg = dict(config or {"kind": "scripted"})
    kind = cfg.pop("kind", "scripted")
    if kind == "scripted":
        if cfg:
            raise ValueError(f"user.{sorted(cfg)[0]}: not an option of the scripted user")
        return ScriptedUser()
    if kind == "llm":
        allowed = {"base_url", "model", "api_key_env", "temperature", "max_tokens", "timeout"}
        allowed |= {"seed", "extra_body", "retries"}
        bad = set(cfg) - allowed
        if bad:
            raise ValueError(f"user.{sorted(bad)[0]}: not an option of the LLM user")
        for key in ("base_url", "model"):
            if not cfg.get(key):
                raise ValueError(f"user.{key}: required for the LLM user")
        return LLMUser(**cfg)
    raise ValueError(f"user.kind: expected 'scripted' or 'llm', got {kind!r}")


# ---------------------------------------------------------------------- dataset
def system_prompt(domain: TauDomain) -> str:
    """The agent's system message: the domain policy and how to talk to the user."""
    return (
        "You are a customer-service agent. Follow the policy below. Use the tools to look up "
        "and change data, one tool call per turn; write plain messages to talk to the user."
        "\n\n" + domain.policy.strip()
    )


def dataset_rows(
    domain: TauDomain, tasks: list[TauTask] | None = None, split: str = "train"
) -> list[dict[str, Any]]:
    """Rows of veRL's RLHF dataset (``agent_name: harts_tau_agent``), one per task. The prompt
    is the system message and the agent's greeting, plus the user's first message when the
    task is scripted (otherwise the agent loop asks the user simulator for it).
    ``extra_info`` holds ``tau_domain``/``tau_task_id`` (for the tools, the user simulator and
    the reward) and ``tools_kwargs`` for every domain tool."""
    rows = []
    for i, task in enumerate(tasks if tasks is not None else domain.tasks()):
        if not isinstance(task, TauTask):
            raise TypeError(f"tasks[{i}]: expected TauTask, got {type(task).__name__}")
        prompt = [
            {"role": "system", "content": system_prompt(domain)},
            {"role": "assistant", "content": GREETING},
        ]
        if task.user_script:
            prompt.append({"role": "user", "content": task.user_script[0]})
        create = {"domain": domain.name, "task_id": task.task_id}
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": prompt,
                "agent_name": "harts_tau_agent",
                "ability": "tau",
                "reward_model": {"style": "rule", "ground_truth": task.task_id},
                "extra_info": {
                    "index": i,
                    "split": split,
                    "tau_domain": domain.name,
                    "tau_task_id": task.task_id,
                    "interaction_kwargs": create,
                    "tools_kwargs": {
                        s["function"]["name"]: {"create_kwargs": create}
                        for s in domain.tool_schemas()
                    },
                },
            }
        )
    return rows
