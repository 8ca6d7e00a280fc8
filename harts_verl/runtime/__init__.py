"""Runtime: execute planned forests (tree) or packed trajectories (expanded)."""

from harts_verl.runtime.runner import ExpandedRunner, StepStats, TreeRunner

__all__ = ["ExpandedRunner", "StepStats", "TreeRunner"]
