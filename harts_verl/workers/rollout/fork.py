"""Fork sampling in veRL's V1 agent-loop worker: ``HartsAgentLoopManager`` / fork worker.

Enable with::

    ++actor_rollout_ref.rollout.agent.agent_loop_manager_class=harts_verl.workers.rollout.fork.HartsAgentLoopManager
    actor_rollout_ref.rollout.agent.default_agent_loop=harts_tool_agent
    +harts_rollout.fork.enable=true
    +harts_rollout.fork.turns=[0,1]        # turn boundaries (completed assistant turns)
    +harts_rollout.fork.branching=2
    +harts_rollout.fork.budget=4           # leaf trajectories per prompt (set rollout.n to it)
    +harts_rollout.fork.policy=turns       # or "every"
    +harts_rollout.fork.group=prompt       # GRPO groups: "prompt" (default) or "fork"

For each prompt, the worker runs the ``harts_tool_agent`` loop's shared prefix once and forks
continuations at the chosen turn boundaries (:meth:`~harts_verl.workers.rollout.agent_loop.
HartsToolAgentLoop.run_tree`): exactly ``budget`` leaves. Every branch is stored as its own
session (session id = its leaf index), with its own reward computed by veRL's reward loop.

GRPO group ids (:func:`branch_uids`): veRL's GRPO groups by the ``uid`` field of each stored
trajectory, which ``_agent_loop_postprocess`` copies from its ``uid`` argument, and it keys the
trajectory ``{uid}_{session}_{index}`` in TransferQueue. Every veRL reader of those keys takes
the prompt uid as the part before the first ``_`` (replay buffer, prompt status, eviction,
DAPO filter) and the session key as all but the last ``_`` part (advantage broadcast). So the
worker passes ``uid = group uid``: the prompt uid itself for the prompt-level group, and
``{prompt uid}_f{fork path}`` for a fork group (``group=fork``). Prompt bookkeeping is
unchanged, and ``uid`` (what GRPO reads) is the group. Each branch's ``extra_fields`` carry
``harts_fork_path``, ``harts_fork_group``, ``harts_group`` (= its ``uid``), ``harts_traj_uid``
(``{uid}_{session}``, its TransferQueue key without the ``_0``) and ``harts_prompt_uid``.

Without ``harts_rollout.fork.enable`` (or for validation, or another agent loop) the worker is
veRL's. veRL's V1 worker module imports ``transfer_queue``, so the classes are built lazily.
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from harts_verl.workers.rollout.agent_loop import FORK_GROUP_KEY, FORK_PATH_KEY, ForkSpec

__all__ = [
    "GROUP_UID_KEY",
    "MANAGER_PATH",
    "PROMPT_UID_KEY",
    "TRAJ_UID_KEY",
    "branch_uids",
    "check_fork_manager",
    "check_rollout_n",
    "fork_spec_of",
    "fork_worker_class",
    "group_uid",
    "manager_class",
]

logger = logging.getLogger(__name__)

GROUP_UID_KEY = "harts_group"
"""``extra_fields`` key: the branch's GRPO group id (the ``uid`` veRL's GRPO groups by)."""
TRAJ_UID_KEY = "harts_traj_uid"
"""``extra_fields`` key: the branch's own id ``{uid}_{session}`` (distinct per branch)."""
PROMPT_UID_KEY = "harts_prompt_uid"
"""``extra_fields`` key: the uid of the prompt the branch was sampled from."""


def fork_spec_of(config: Any) -> ForkSpec | None:
    """The :class:`ForkSpec` of a PPO config (``harts_rollout.fork``), None when disabled (no
    ``harts_rollout.fork`` node, or ``enable`` absent/false).

    ``ValueError`` naming the key for a malformed node: ``harts_rollout``/``harts_rollout.fork``
    not a mapping, ``enable`` not a bool (a string such as ``"false"`` is not read as a bool:
    ``bool("false")`` is True; OmegaConf's ``${oc.env:...}`` gives strings, wrap it in
    ``${oc.decode:...}``), a key of ``harts_rollout`` other than ``fork``, or a bad fork
    setting (:meth:`ForkSpec.from_config`)."""
    try:
        cfg = config.get("harts_rollout", None)
    except AttributeError:
        cfg = None
    if cfg is None:
        return None
    if not _is_mapping(cfg):
        raise ValueError(f"harts_rollout: expected a mapping, got {type(cfg).__name__}")
    unknown = [k for k in cfg.keys() if k != "fork"]
    if unknown:  # a misspelled ``fork`` turned forking off without a word
        close = difflib.get_close_matches(str(unknown[0]), ["fork"], n=1)
        hint = " (did you mean 'fork'?)" if close else ""
        raise ValueError(f"harts_rollout.{unknown[0]}: unknown key{hint}; expected fork")
    fork = cfg.get("fork", None)
    if fork is None:
        return None
    if not _is_mapping(fork):
        raise ValueError(
            f"harts_rollout.fork: expected a mapping of fork settings, got {type(fork).__name__}"
        )
    enable = fork.get("enable", False)
    if not isinstance(enable, bool | np.bool_):
        hint = (
            " (a string is not read as a bool; OmegaConf's ${oc.env:...} gives strings: use "
            "${oc.decode:${oc.env:VAR,false}})"
            if isinstance(enable, str)
            else ""
        )
        raise ValueError(
            f"harts_rollout.fork.enable: expected a bool (true/false), got {enable!r}{hint}"
        )
    spec = ForkSpec.from_config(fork)  # validates the settings even when disabled
    return spec if enable else None


def _is_mapping(value: Any) -> bool:
    """A dict/DictConfig-like node (``keys`` and ``get``)."""
    return hasattr(value, "keys") and hasattr(value, "get")


def check_rollout_n(config: Any) -> str | None:
    """A warning when fork sampling is on and ``rollout.n`` differs from ``fork.budget`` (None
    otherwise). A forked prompt gives ``budget`` trajectories, but veRL sizes PPO mini-batches
    (``ppo_mini_batch_size * rollout.n`` trajectories) and the batch multiple it pads to with
    ``rollout.n``: a mismatch splits groups across mini-batches or pads with dummy samples."""
    spec = fork_spec_of(config)
    if spec is None:
        return None
    n = int(config.actor_rollout_ref.rollout.n)
    if n == spec.budget:
        return None
    return (
        f"harts_rollout.fork.budget={spec.budget} but actor_rollout_ref.rollout.n={n}: each "
        f"prompt gives {spec.budget} trajectories while veRL sizes mini-batches and pads the "
        "batch for rollout.n; set rollout.n to the fork budget"
    )


MANAGER_PATH = "harts_verl.workers.rollout.fork.HartsAgentLoopManager"
"""The ``rollout.agent.agent_loop_manager_class`` that runs fork sampling."""


def check_fork_manager(config: Any) -> None:
    """``ValueError`` when fork sampling is on (``harts_rollout.fork.enable``) but
    ``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` is not
    :data:`MANAGER_PATH` or a subclass of it: only that manager reads ``harts_rollout``, so the
    run would sample unforked without a word. Nothing when fork sampling is off."""
    if fork_spec_of(config) is None:
        return
    key = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"
    try:
        path = config.actor_rollout_ref.rollout.agent.get("agent_loop_manager_class", None)
    except AttributeError:
        path = None
    if path == MANAGER_PATH:
        return
    cls = None
    if isinstance(path, str) and "." in path:
        import importlib

        module, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            cls = None
    if isinstance(cls, type) and getattr(cls, "harts_fork_sampling", False):
        return
    raise ValueError(
        f"harts_rollout.fork.enable=true needs {key}={MANAGER_PATH} (only it forks; on the "
        f"command line ++{key}=..., veRL's rollout.yaml has no such key), got {path!r}"
    )


def group_uid(prompt_uid: str, fork_group: str) -> str:
    """GRPO group id of a branch: the prompt uid for the prompt-level group (``fork_group ==
    ""``), ``{prompt_uid}_f{fork_group}`` for a fork group. veRL's key readers still find the
    prompt uid before the first ``_`` (see the module docstring)."""
    if "_" in str(fork_group):
        raise ValueError(f"fork group {fork_group!r}: must not contain '_'")
    return str(prompt_uid) if fork_group == "" else f"{prompt_uid}_f{fork_group}"


def branch_uids(prompt_uid: str, outputs: Sequence[Any]) -> list[str]:
    """The ``uid`` to store each branch under (its GRPO group id); writes ``harts_group``,
    ``harts_traj_uid`` (``{uid}_{i}``, session id ``i`` = the branch's index) and
    ``harts_prompt_uid`` into each output's ``extra_fields``."""
    uids = []
    for i, out in enumerate(outputs):
        extra = out.extra_fields
        uid = group_uid(prompt_uid, extra.get(FORK_GROUP_KEY, ""))
        extra.setdefault(FORK_PATH_KEY, "")
        extra.setdefault(FORK_GROUP_KEY, "")
        extra[GROUP_UID_KEY] = uid
        extra[TRAJ_UID_KEY] = f"{uid}_{i}"
        extra[PROMPT_UID_KEY] = str(prompt_uid)
        uids.append(uid)
    return uids


@functools.cache
def _forks(target: str) -> bool:
    """Whether the agent loop class ``target`` (a ``_target_`` path) can run forked trees:
    ``HartsToolAgentLoop`` or a subclass of it (e.g. the τ³ recipe's ``HartsTauAgentLoop``)."""
    if not target:
        return False
    import hydra

    from harts_verl.workers.rollout.agent_loop import HartsToolAgentLoop

    try:
        cls = hydra.utils.get_class(target)
    except Exception as exc:  # an unresolvable target runs veRL's own path
        logger.warning("harts fork: cannot resolve agent loop %r (%r); not forking", target, exc)
        return False
    return isinstance(cls, type) and issubclass(cls, HartsToolAgentLoop)


_unforked_warned: set[str] = set()
"""Agent loops the unforked-prompt WARNING was given for in this process."""


def _warn_unforked(agent_name: Any, target: str) -> None:
    """One WARNING per agent loop and process: fork sampling is on, but prompts of
    ``agent_name`` run veRL's unforked sessions (its loop is not a tree loop)."""
    if agent_name in _unforked_warned:
        return
    _unforked_warned.add(agent_name)
    logger.warning(
        "harts_rollout.fork.enable=true, but agent loop %r (%s) is not harts_tool_agent or a "
        "subclass: its training prompts are not forked (rollout.n independent sessions each). "
        "Set actor_rollout_ref.rollout.agent.default_agent_loop=harts_tool_agent (or the "
        "rows' agent_name)",
        agent_name,
        target or "not registered",
    )


@functools.cache
def fork_worker_class() -> type:
    """``AgentLoopWorkerTQ`` whose ``_run_prompt`` forks (a ``ray.remote`` class)."""
    import asyncio

    import hydra
    import ray
    import transfer_queue as tq
    from verl.experimental.agent_loop.agent_loop import (
        DictConfigWrap,
        ToolListWrap,
        _agent_loop_registry,
    )
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ, apply_greedy_sampling_params

    base = AgentLoopWorkerTQ.__ray_metadata__.modified_class

    class HartsForkAgentLoopWorker(base):
        """Runs each training prompt as one forked rollout tree (see module docstring)."""

        async def _run_prompt(
            self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False
        ) -> None:
            spec = fork_spec_of(self.config)
            agent_name = prompt.get("agent_name")
            target = _agent_loop_registry.get(agent_name, {}).get("_target_", "")
            if spec is None or trajectory["validate"] or not _forks(target):
                if spec is not None and not trajectory["validate"]:
                    _warn_unforked(agent_name, target)
                return await super()._run_prompt(prompt, sampling_params, trajectory, trace)
            uid, partition_id = prompt["uid"], "train"
            await tq.async_kv_put(key=uid, partition_id=partition_id, tag={"status": "running"})
            status = "finished"
            try:
                prompt = dict(prompt)
                prompt.pop("__rollout_n__", None)
                run_sampling_params = dict(sampling_params)
                if not prompt.pop("__do_sample__", True):
                    apply_greedy_sampling_params(run_sampling_params)
                agent_name = prompt.pop("agent_name")
                agent_loop = hydra.utils.instantiate(
                    config=_agent_loop_registry[agent_name],
                    trainer_config=DictConfigWrap(config=self.config),
                    server_manager=self.llm_client,
                    tokenizer=self.tokenizer,
                    processor=self.processor,
                    hf_model_type=self.hf_model_type,
                    dataset_cls=self.dataset_cls,
                    data_config=DictConfigWrap(self.config.data),
                    tools=ToolListWrap(self.tools),
                )
                outputs = await agent_loop.run_tree(run_sampling_params, fork=spec, **prompt)
                uids = branch_uids(uid, outputs)
                # as veRL's _run_agent_loop: postprocess kwargs are the prompt fields (no
                # agent_name) + session_id; ``uid`` is the branch's GRPO group id
                results = await asyncio.gather(
                    *[
                        self._agent_loop_postprocess(
                            out, False, **{**prompt, "uid": group, "session_id": i}
                        )
                        for i, (out, group) in enumerate(zip(outputs, uids, strict=True))
                    ],
                    return_exceptions=True,
                )
                for r in results:
                    if isinstance(r, BaseException):
                        logger.error("harts fork rollout of uid=%s failed: %r", uid, r)
                        status = "failure"
            except Exception as exc:
                logger.exception("harts fork rollout of uid=%s failed: %r", uid, exc)
                status = "failure"
            await tq.async_kv_put(key=uid, partition_id=partition_id, tag={"status": status})

    return ray.remote(HartsForkAgentLoopWorker)


@functools.cache
def manager_class() -> type:
    """``AgentLoopManagerTQ`` whose workers fork (built on first use)."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

    class HartsAgentLoopManager(AgentLoopManagerTQ):
        """veRL's V1 agent-loop manager with fork-sampling workers."""

        harts_fork_sampling = True  # what check_fork_manager looks for (subclasses too)

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            warning = check_rollout_n(config)
            if warning:
                logger.warning(warning)
            super().__init__(config, *args, **kwargs)
            self.agent_loop_workers_class = fork_worker_class()

    return HartsAgentLoopManager


def __getattr__(name: str) -> Any:
    """``HartsAgentLoopManager`` is resolved lazily (importing it needs ``transfer_queue``), so
    ``rollout.agent.agent_loop_manager_class=harts_verl.workers.rollout.fork.HartsAgentLoopManager``
    works while importing this module does not."""
    if name == "HartsAgentLoopManager":
        return manager_class()
    raise AttributeError(name)
