"""Reward function file of the SWE-bench recipe (``reward.custom_reward_function.path``):
:func:`harts_verl.workers.envs.swe.compute_score` (1.0 iff the trajectory's patch makes every
FAIL_TO_PASS and PASS_TO_PASS test pass; SWE-bench harness in docker, local pytest for the
bundled fixtures)."""

from harts_verl.workers.envs.swe import compute_score

__all__ = ["compute_score"]
