"""Rollout side of HARTS in veRL: turn recorder, ``harts_tool_agent`` loop with fork sampling,
the CPU rollout server, and the bundled local task. Modules that import veRL are loaded lazily
(import them by name); :mod:`.recorder` needs neither veRL nor torch."""

from harts_verl.workers.rollout.recorder import (
    TREE_KEY,
    RecordedTurn,
    RecordingServerClient,
    TurnRecorder,
    forest_from_metadata,
    parse_tree_metadata,
    tree_metadata,
)

__all__ = [
    "TREE_KEY",
    "RecordedTurn",
    "RecordingServerClient",
    "TurnRecorder",
    "forest_from_metadata",
    "parse_tree_metadata",
    "tree_metadata",
]
