"""Reward function file of the tau3-Bench recipe (``reward.custom_reward_function.path``):
:func:`harts_verl.workers.envs.tau.compute_score` (1.0 iff the database after the trajectory's
tool calls equals the one after the task's reference actions and every required output was
said)."""

from harts_verl.workers.envs.tau import compute_score

__all__ = ["compute_score"]
