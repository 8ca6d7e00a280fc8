"""Rollout forest and planners (numpy only, no torch)."""

from harts_verl.tree.forest import RolloutForest, Segments, Turn
from harts_verl.tree.linear_plan import (
    InitialState,
    LinearCall,
    LinearCallArrays,
    LinearCallPlan,
    LinearMember,
    LinearRoundArrays,
    MaterializedState,
    plan_linear_calls,
)
from harts_verl.tree.microbatch import (
    Microbatch,
    MicrobatchPlan,
    check_plan_arguments,
    plan_microbatches,
)

__all__ = [
    "InitialState",
    "LinearCall",
    "LinearCallArrays",
    "LinearCallPlan",
    "LinearMember",
    "LinearRoundArrays",
    "MaterializedState",
    "Microbatch",
    "MicrobatchPlan",
    "RolloutForest",
    "Segments",
    "Turn",
    "check_plan_arguments",
    "plan_linear_calls",
    "plan_microbatches",
]
