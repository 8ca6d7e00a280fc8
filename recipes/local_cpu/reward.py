"""Reward function file for the local CPU recipe (``reward.custom_reward_function.path``):
the calculator task's checker, :func:`harts_verl.workers.rollout.local_task.compute_score`."""

from harts_verl.workers.rollout.local_task import compute_score

__all__ = ["compute_score"]
