"""The bundled calculator task (``local_task``) under ``harts_tool_agent`` with a fake server
client, shared by the recorder and fork tests (needs veRL)."""

from __future__ import annotations

from typing import Any

from harts_verl.workers.envs.testing import loop_config, make_loop


def calc_loop_env(**rollout: Any) -> dict[str, Any]:
    """``tok`` (the calculator tokenizer), ``cfg`` (:func:`loop_config` with the ``harts_calc``
    tool format, 64-token tool answers truncated on the right, and ``rollout``: lengths, turns,
    extra rollout keys), ``make(client)`` (a ``HartsToolAgentLoop`` over ``client`` with the
    calculator tool; call it inside the event loop that runs it), ``ids(text)`` (the token ids
    of space-separated tokens), ``raw_prompt`` (task 0's prompt) and ``local_task``."""
    from harts_verl.workers.rollout import local_task
    from harts_verl.workers.rollout.agent_loop import HartsToolAgentLoop

    tok = local_task.build_tokenizer()
    cfg = loop_config(
        tool_format="harts_calc",
        max_tool_response_length=64,
        tool_response_truncate_side="right",
        **rollout,
    )

    def make(client: Any) -> Any:
        return make_loop(
            HartsToolAgentLoop, client, [local_task.calc_tool()], config=cfg, tokenizer=tok
        )

    return {
        "tok": tok,
        "cfg": cfg,
        "make": make,
        "ids": lambda text: tok.convert_tokens_to_ids(text.split()),
        "raw_prompt": local_task.make_tasks(1, seed=0)[0]["prompt"],
        "local_task": local_task,
    }
