"""The local CPU recipe's tool, for veRL's ``rollout.multi_turn.function_tool_path`` (``run.sh``
passes this file's absolute path): registers
:func:`harts_verl.workers.rollout.local_task.calc` as the function tool ``calc`` with its schema
(without it, veRL's agent-loop workers load no tool and answer every call "Unknown function")."""

from verl.tools.function_tool import function_tool

from harts_verl.workers.rollout.local_task import CALC_SCHEMA, calc

function_tool("calc", schema=CALC_SCHEMA)(calc)
