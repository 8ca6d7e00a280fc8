"""Rollout forest and planners (numpy only, no torch)."""

from harts_verl.tree.forest import RolloutForest, Segments, Turn

__all__ = ["RolloutForest", "Segments", "Turn"]
