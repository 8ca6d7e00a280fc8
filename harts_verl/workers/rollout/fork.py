"""Fork sampling in veRL's V1 agent-loop worker: ``HartsAgentLoopManager`` / fork worker.

Enable with::

    actor_rollout_ref.rollout.agent.agent_loop_manager_class=harts_verl.workers.rollout.fork.HartsAgentLoopManager
    actor_rollout_ref.rollout.agent.default_agent_loop=harts_tool_agent
    +harts_rollout.fork.enable=true
    +harts_rollout.fork.turns=[0,1]        # turn boundaries (completed assistant turns)
    +harts_rollout.fork.branching=2
    +harts_rollout.fork.budget=4           # leaf trajectories per prompt (set rollout.n to it)
    +harts_rollout.fork.policy=turns       # or "every"

For each prompt, the worker runs the ``harts_tool_agent`` loop's shared prefix once and forks
continuations at the chosen turn boundaries (:meth:`~harts_verl.workers.rollout.agent_loop.
HartsToolAgentLoop.run_tree`). Every branch is stored as its own session (TransferQueue key
``{uid}_{session}_0``; session = branch index), with its own reward computed by veRL's reward
loop, and enters GRPO with the prompt's ``uid`` as group id (as veRL's ``rollout.n`` sessions
do). Without ``harts_rollout.fork.enable`` (or for validation, or another agent loop) the worker
is veRL's. veRL's V1 worker module imports ``transfer_queue``, so the classes are built lazily.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from harts_verl.workers.rollout.agent_loop import ForkSpec

__all__ = ["fork_spec_of", "fork_worker_class", "manager_class"]

logger = logging.getLogger(__name__)


def fork_spec_of(config: Any) -> ForkSpec | None:
    """The :class:`ForkSpec` of a PPO config (``harts_rollout.fork``), None when disabled."""
    try:
        cfg = config.get("harts_rollout", None)
    except AttributeError:
        cfg = None
    fork = cfg.get("fork", None) if cfg is not None else None
    if fork is None or not bool(fork.get("enable", False)):
        return None
    return ForkSpec.from_config(fork)


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
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    base = AgentLoopWorkerTQ.__ray_metadata__.modified_class

    class HartsForkAgentLoopWorker(base):
        """Runs each training prompt as one forked rollout tree (see module docstring)."""

        async def _run_prompt(
            self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False
        ) -> None:
            spec = fork_spec_of(self.config)
            agent_name = prompt.get("agent_name")
            target = _agent_loop_registry.get(agent_name, {}).get("_target_", "")
            if spec is None or trajectory["validate"] or not target.endswith("HartsToolAgentLoop"):
                return await super()._run_prompt(prompt, sampling_params, trajectory, trace)
            uid, partition_id = prompt["uid"], "train"
            await tq.async_kv_put(key=uid, partition_id=partition_id, tag={"status": "running"})
            status = "finished"
            try:
                prompt = dict(prompt)
                prompt.pop("__rollout_n__", None)
                prompt.pop("__do_sample__", None)
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
                outputs = await agent_loop.run_tree(dict(sampling_params), fork=spec, **prompt)
                results = await asyncio.gather(
                    *[
                        self._agent_loop_postprocess(
                            out, False, agent_name=agent_name, session_id=i, **prompt
                        )
                        for i, out in enumerate(outputs)
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

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.agent_loop_workers_class = fork_worker_class()

    return HartsAgentLoopManager


def __getattr__(name: str) -> Any:
    """``HartsAgentLoopManager`` is resolved lazily (importing it needs ``transfer_queue``), so
    ``rollout.agent.agent_loop_manager_class=harts_verl.workers.rollout.fork.HartsAgentLoopManager``
    works while importing this module does not."""
    if name == "HartsAgentLoopManager":
        return manager_class()
    raise AttributeError(name)
