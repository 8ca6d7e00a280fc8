"""The bundled multi-turn tool task of the local CPU recipe (``recipes/local_cpu``).

A toy "calculator world" small enough for a randomly initialised tiny model:

* a word-level vocabulary (:data:`VOCAB`) and a :class:`~transformers.PreTrainedTokenizerFast`
  with a whitespace chat template (:func:`build_tokenizer`, no hub access);
* the tool ``calc(op, a, b)`` (:func:`calc_tool`) and a tool-call format ``harts_calc``
  (:class:`CalcToolParser`): a response containing ``<call>`` calls ``calc`` with the three
  tokens that follow (malformed calls still get a tool answer, ``error``), so even an untrained
  model produces multi-turn trajectories;
* tasks "what is A add|sub B ?" (:func:`make_tasks`, parquet rows in veRL's RLHF dataset format)
  and a checker reward (:func:`compute_score`): 1 when the last assistant turn says the answer.

Everything is deterministic given its seed.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "VOCAB",
    "CalcToolParser",
    "build_tokenizer",
    "calc",
    "calc_tool",
    "compute_score",
    "make_tasks",
    "write_dataset",
]

SPECIAL = ["<pad>", "<unk>", "<eos>", "<system>", "<user>", "<assistant>", "<tool>", "<call>"]
WORDS = ["what", "is", "add", "sub", "?", "answer", "error", "calc", "use", "the", "tool"]
NUMBERS = [str(i) for i in range(-9, 19)]
VOCAB: list[str] = SPECIAL + WORDS + NUMBERS
"""Token strings in id order (64 ids or fewer: fits the tiny test models)."""

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}"
)

SYSTEM_PROMPT = "use the calc tool"


def build_tokenizer(path: str | None = None) -> Any:
    """A word-level fast tokenizer over :data:`VOCAB` with :data:`CHAT_TEMPLATE`; saved to
    ``path`` when given (load it back with ``PreTrainedTokenizerFast.from_pretrained``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    if path is not None:
        fast.save_pretrained(path)
    return fast


def calc(op: str, a: int, b: int) -> str:
    """Calculator tool: ``add`` or ``sub`` two small integers.

    Args:
        op: "add" or "sub".
        a: first operand.
        b: second operand.
    """
    try:
        x, y = int(a), int(b)
    except (TypeError, ValueError):
        return "error"
    if op == "add":
        return str(x + y)
    if op == "sub":
        return str(x - y)
    return "error"


def calc_tool() -> Any:
    """The ``calc`` function as a veRL ``FunctionTool``."""
    from verl.tools.function_tool import FunctionTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    schema = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "calc",
                "description": "add or sub two integers",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "op": {"type": "string"},
                        "a": {"type": "integer"},
                        "b": {"type": "integer"},
                    },
                    "required": ["op", "a", "b"],
                },
            },
        }
    )
    return FunctionTool(name="calc", fn=calc, tool_schema=schema)


def _register_parser() -> type:
    from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

    @ToolParser.register("harts_calc")
    class CalcToolParser(ToolParser):
        """``<call> op a b``: a call of ``calc`` with the three tokens after ``<call>``."""

        async def extract_tool_calls(self, responses_ids, tools=None):
            words = self.tokenizer.convert_ids_to_tokens(list(responses_ids))
            text = " ".join(w for w in words if w not in ("<eos>", "<pad>"))
            if "<call>" not in words:
                return text, []
            k = words.index("<call>")
            args = [*words[k + 1 : k + 4], "", "", ""][:3]
            call = FunctionCall(
                name="calc", arguments=json.dumps({"op": args[0], "a": args[1], "b": args[2]})
            )
            return " ".join(words[:k]), [call]

    return CalcToolParser


try:  # registered on import (the agent loop worker resolves the format by name)
    CalcToolParser = _register_parser()
except ImportError:  # veRL absent: the tokenizer/task helpers still work
    CalcToolParser = None  # type: ignore[assignment,misc]


def make_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` calculator tasks as rows of veRL's RLHF dataset (``prompt`` = chat messages,
    ``agent_name``, ``reward_model.ground_truth``, ``extra_info``)."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        op = rng.choice(["add", "sub"])
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        answer = a + b if op == "add" else a - b
        rows.append(
            {
                "data_source": "harts_calc",
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"what is {a} {op} {b} ?"},
                ],
                "agent_name": "harts_tool_agent",
                "ability": "calc",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"index": i, "split": "train"},
            }
        )
    return rows


def write_dataset(path: str, n: int, seed: int = 0) -> str:
    """Write :func:`make_tasks` rows to a parquet file at ``path``."""
    import pandas as pd

    pd.DataFrame(make_tasks(n, seed)).to_parquet(path)
    return path


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kw: Any
) -> float:
    """Checker reward: 1.0 when the last assistant turn of ``solution_str`` contains the answer
    token (after the last ``<tool>`` reply), 0.1 for a well-formed ``calc`` call, else 0."""
    words = solution_str.split()
    tail = words
    if "<tool>" in words:
        tail = words[len(words) - words[::-1].index("<tool>") :]
    if str(ground_truth) in tail:
        return 1.0
    if "<call>" in words:
        k = words.index("<call>")
        if words[k + 1 : k + 2] in (["add"], ["sub"]):
            return 0.1
    return 0.0
