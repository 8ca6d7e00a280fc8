"""The bundled multi-turn tool task of the local CPU recipe (``recipes/local_cpu``).

A toy "calculator world" small enough for a randomly initialised tiny model:

* a word-level vocabulary (:data:`VOCAB`) and a :class:`~transformers.PreTrainedTokenizerFast`
  with a whitespace chat template (:func:`build_tokenizer`, no hub access);
* the tool ``calc(op, a, b)`` (:func:`calc_tool`) and a tool-call format ``harts_calc``
  (:class:`CalcToolParser`): a response containing ``<call>`` calls ``calc`` with the three
  tokens that follow (malformed calls still get a tool answer, ``error``), so even an untrained
  model produces multi-turn trajectories;
* tasks "what is A add|sub B ?" (:func:`make_tasks`, parquet rows in veRL's RLHF dataset format)
  and a checker reward (:func:`compute_score`): 1 when the last assistant turn says
  ``answer <result>``;
* an agent prompt (``make_tasks(..., prompt="agent")``, the local recipe's): a system prompt
  with the tool's documentation and schema (:data:`AGENT_SYSTEM_PROMPT`) and worked examples of
  the tool-call format as chat turns (:data:`FEW_SHOT`), identical for every task (280
  tokens; 288 with the task's question and the generation prompt); the vocabulary contains
  every word of it;
* supervised warm-start sequences in that format (:func:`sft_examples`: prompt + the correct
  call, tool answer and final answer, with the mask of the model-generated tokens).

Everything is deterministic given its seed.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = [
    "AGENT_SYSTEM_PROMPT",
    "CHAT_TEMPLATE",
    "FEW_SHOT",
    "VOCAB",
    "VOCAB_SIZE",
    "CalcToolParser",
    "build_tokenizer",
    "calc",
    "calc_tool",
    "compute_score",
    "make_tasks",
    "sft_examples",
    "task_prompt",
    "write_dataset",
]

SPECIAL = ["<pad>", "<unk>", "<eos>", "<system>", "<user>", "<assistant>", "<tool>", "<call>"]
WORDS = ["what", "is", "add", "sub", "?", "answer", "error", "calc", "use", "the", "tool"]
NUMBERS = [str(i) for i in range(-9, 19)]

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}"
)

SYSTEM_PROMPT = "use the calc tool"
"""The short system prompt (``make_tasks(..., prompt="short")``: unit tests with small budgets)."""

AGENT_SYSTEM_PROMPT = " ".join(
    [
        "you are a math assistant . you solve each question with the help of one tool .",
        "# tools",
        "name : calc",
        "description : add or sub two integers and return the result .",
        "schema : { type : function , function : { name : calc , parameters : { type : object ,",
        "properties : { op : { type : string , enum : [ add , sub ] } , a : { type : integer } ,",
        "b : { type : integer } } , required : [ op , a , b ] } } }",
        "# how to call the tool",
        "write <call> then op then a then b , each as one word , then stop with <eos> .",
        "the tool answers in the next <tool> turn with the result , or with error when the call",
        "is malformed ( an unknown op or a missing number ) .",
        "after the tool answer , write answer then the result , then stop with <eos> .",
        "# rules",
        "always call the tool before you answer . do not guess the result .",
        "make one call per turn . if the tool says error , fix the call and call it again .",
        "the answer is one number from -9 to 18 .",
        "# examples",
    ]
)
"""System prompt of the agent tasks: tool documentation and JSON-like schema, the call format,
rules; followed by the :data:`FEW_SHOT` turns."""


def _example(a: int, op: str, b: int) -> list[dict[str, str]]:
    r = str(a + b if op == "add" else a - b)
    return [
        {"role": "user", "content": f"what is {a} {op} {b} ?"},
        {"role": "assistant", "content": f"<call> {op} {a} {b} <eos>"},
        {"role": "tool", "content": r},
        {"role": "assistant", "content": f"answer {r} <eos>"},
    ]


FEW_SHOT: list[dict[str, str]] = [
    *_example(4, "add", 7),
    *_example(2, "sub", 8),
    *_example(9, "add", 9),
]
"""Worked examples as chat turns, rendered exactly as a rollout of the task is (an assistant
turn ends with the ``<eos>`` it generated; the tool turn is the calculator's answer)."""


def _words(*texts: str) -> list[str]:
    seen: dict[str, None] = {}
    for text in texts:
        for w in text.split():
            seen.setdefault(w, None)
    return list(seen)


_BASE = SPECIAL + WORDS + NUMBERS
_PROMPT_WORDS = [
    w for w in _words(AGENT_SYSTEM_PROMPT, *(m["content"] for m in FEW_SHOT)) if w not in _BASE
]
VOCAB_SIZE = -(-(len(_BASE) + len(_PROMPT_WORDS)) // 32) * 32
VOCAB: list[str] = (
    _BASE
    + _PROMPT_WORDS
    + [f"<reserved{i}>" for i in range(VOCAB_SIZE - len(_BASE) - len(_PROMPT_WORDS))]
)
"""Token strings in id order: the task's special tokens, words and numbers (ids unchanged from
the 47-token original), then every other word of the agent prompt, then reserved tokens up to
:data:`VOCAB_SIZE` (a multiple of 32; the recipe's model has exactly this many ids, so every
sampled id decodes)."""


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
    """Calculator tool: ``add`` or ``sub`` two small integers. Returns the result, or
    ``"error"`` for a bad operation or operand, or a result the vocabulary has no word for
    (outside -9 … 18: it would be tokenized as ``<unk>``).

    Args:
        op: "add" or "sub".
        a: first operand.
        b: second operand.
    """
    x, y = _operand(a), _operand(b)
    if x is None or y is None or op not in ("add", "sub"):
        return "error"
    out = str(x + y if op == "add" else x - y)
    return out if out in NUMBERS else "error"


def _operand(v: Any) -> int | None:
    """An operand as an int: an int (not a bool), an integral float or the text of an int; None
    otherwise (``2.9`` was truncated to 2, ``True`` read as 1)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return int(v) if v.is_integer() else None
    if isinstance(v, str):
        t = v.strip()
        return int(t) if re.fullmatch(r"[+-]?[0-9]+", t) else None  # ASCII digits ("²": no)
    return None


# the ``calc`` tool's OpenAI function schema (``calc_tool``, ``recipes/local_cpu/tools.py``)
CALC_SCHEMA: dict[str, Any] = {
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


def calc_tool() -> Any:
    """The ``calc`` function as a veRL ``FunctionTool`` (the recipe's workers load the same
    tool from ``recipes/local_cpu/tools.py``, its ``function_tool_path``)."""
    from verl.tools.function_tool import FunctionTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    schema = OpenAIFunctionToolSchema.model_validate(CALC_SCHEMA)
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


def _task(rng: Any) -> tuple[int, str, int, int]:
    op = rng.choice(["add", "sub"])
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return a, op, b, a + b if op == "add" else a - b


def task_prompt(a: int, op: str, b: int, prompt: str = "agent") -> list[dict[str, str]]:
    """Chat messages of the question "what is ``a op b`` ?": ``prompt="agent"`` puts the
    :data:`AGENT_SYSTEM_PROMPT` and the :data:`FEW_SHOT` turns before it, ``"short"`` only
    :data:`SYSTEM_PROMPT`."""
    question = {"role": "user", "content": f"what is {a} {op} {b} ?"}
    if prompt == "agent":
        return [{"role": "system", "content": AGENT_SYSTEM_PROMPT}, *FEW_SHOT, question]
    if prompt == "short":
        return [{"role": "system", "content": SYSTEM_PROMPT}, question]
    raise ValueError(f"prompt: expected 'agent' or 'short', got {prompt!r}")


def make_tasks(
    n: int, seed: int = 0, prompt: str = "short", split: str = "train"
) -> list[dict[str, Any]]:
    """``n`` calculator tasks as rows of veRL's RLHF dataset (``prompt`` = chat messages, see
    :func:`task_prompt`; ``agent_name``, ``reward_model.ground_truth``, ``extra_info`` with
    the row's ``index`` and ``split``)."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, op, b, answer = _task(rng)
        rows.append(
            {
                "data_source": "harts_calc",
                "prompt": task_prompt(a, op, b, prompt),
                "agent_name": "harts_tool_agent",
                "ability": "calc",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"index": i, "split": split},
            }
        )
    return rows


def write_dataset(
    path: str, n: int, seed: int = 0, prompt: str = "short", split: str = "train"
) -> str:
    """Write :func:`make_tasks` rows to a parquet file at ``path``."""
    import pandas as pd

    pd.DataFrame(make_tasks(n, seed, prompt, split)).to_parquet(path)
    return path


def sft_examples(
    n: int, seed: int = 0, prompt: str = "agent", episodes: int = 1, tokenizer: Any = None
) -> list[tuple[list[int], list[int]]]:
    """``n`` supervised warm-start sequences: a task prompt (as the agent loop renders it)
    followed by the rollout a correct agent produces, ``<call> op a b <eos> <tool> r
    <assistant> answer r <eos>``; with ``episodes > 1`` further questions and their rollouts
    follow in the same dialogue (as the :data:`FEW_SHOT` turns do). Returns ``(token ids,
    loss mask)`` pairs; the mask is 1 on the tokens the model generates (calls and final
    answers), 0 on the prompt and on the tool's turns (as veRL's ``response_mask``)."""
    import random

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids: list[int] = []
        mask: list[int] = []
        for e in range(episodes):
            a, op, b, r = _task(rng)
            if e == 0:
                head = tok.apply_chat_template(
                    task_prompt(a, op, b, prompt), add_generation_prompt=True, tokenize=True
                )
                head = list(head if isinstance(head, list) else head["input_ids"])
            else:
                head = tok.convert_tokens_to_ids(
                    f"<user> what is {a} {op} {b} ? <assistant>".split()
                )
            parts = [
                (head, 0),
                (f"<call> {op} {a} {b} <eos>", 1),
                (f"<tool> {r} <assistant>", 0),
                (f"answer {r} <eos>", 1),
            ]
            for text, m in parts:
                t = text if isinstance(text, list) else tok.convert_tokens_to_ids(text.split())
                ids += t
                mask += [m] * len(t)
        out.append((ids, mask))
    return out


def _well_formed_call(words: list[str], k: int) -> bool:
    """Whether ``words[k]`` (``<call>``) starts ``<call> add|sub <int> <int>``."""
    args = words[k + 1 : k + 4]
    return (
        len(args) == 3
        and args[0] in ("add", "sub")
        and all(_operand(x) is not None for x in args[1:])
    )


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kw: Any
) -> float:
    """Checker reward: 1.0 when the response made a well-formed ``calc`` call (``<call>
    add|sub <int> <int>``), got a tool reply, and the final ``answer`` of its last assistant
    turn (after the last ``<tool>`` reply and the ``<assistant>`` that follows it) is
    ``answer <ground_truth>``; 0.1 for a well-formed call (any of them: a malformed call the
    model then fixes counts) without that; else 0. The tool's reply itself earns nothing (the
    agent has to report the result), nor does an answer without the tool (the prompt says to
    call it first), and the final answer counts, not the first: ``answer 11 answer 3`` says 3."""
    words = solution_str.split()
    calls = [k for k, w in enumerate(words) if w == "<call>" and _well_formed_call(words, k)]
    if not calls:
        return 0.0
    if "<tool>" in words:
        last_tool = len(words) - 1 - words[::-1].index("<tool>")
        # a well-formed call before the last tool reply (one after it got no reply; a call's
        # three words are no <tool>, so one that starts before it ends before it)
        replied = calls[0] < last_tool
        tail = words[last_tool + 1 :]
        tail = tail[tail.index("<assistant>") + 1 :] if "<assistant>" in tail else []
        said = [k for k, w in enumerate(tail) if w == "answer"]
        if replied and said and tail[said[-1] + 1 : said[-1] + 2] == [str(ground_truth)]:
            return 1.0
    return 0.1
