"""Helpers to drive the env adapters through veRL's agent-loop tool-call path without a model
(used by the tests; handy for checking a new tool set by hand):

* :func:`byte_tokenizer`: a byte-level tokenizer (every text round-trips, no hub access) with a
  plain chat template;
* :class:`ScriptedServer`: veRL's ``generate(request_id, *, prompt_ids, sampling_params)``
  contract, answering with texts from a script function;
* :func:`make_loop`: an agent loop (``HartsToolAgentLoop`` or a subclass) over that server with
  the hermes tool-call format and the given tools.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ScriptedServer", "byte_tokenizer", "hermes_call", "make_loop"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over the 256 byte symbols plus ``<|eos|>``/``<|pad|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", pad_token="<|pad|>")
    fast.add_special_tokens({"eos_token": "<|eos|>", "pad_token": "<|pad|>"})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """A hermes-format tool call (what veRL's ``hermes`` parser extracts)."""
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class _Out:
    """The fields of veRL's ``TokenOutput`` that agent loops read."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.log_probs = None
        self.num_preempted = None
        self.routed_experts = None
        self.stop_reason = "completed"
        self.extra_fields: dict = {}


class ScriptedServer:
    """``generate`` answers ``script(request_id, turn, prompt_text)`` (turn = 0-based number of
    this request's earlier calls, forked requests inherit their parent's count through the
    prompt: the count is of ``<|assistant|>`` markers in the prompt)."""

    def __init__(self, tokenizer: Any, script: Callable[[str, int, str], str]) -> None:
        self.tok, self.script = tokenizer, script
        self.calls: list[tuple[str, int]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: Any, **kw: Any
    ) -> _Out:
        text = self.tok.decode(prompt_ids)
        turn = text.count("<|assistant|>") - 1
        self.calls.append((request_id, turn))
        reply = self.script(request_id, turn, text)
        ids = [*self.tok.encode(reply, add_special_tokens=False), self.tok.eos_token_id]
        return _Out(ids)


def make_loop(
    cls: type,
    server: ScriptedServer,
    tools: list[Any],
    response_length: int = 4096,
    prompt_length: int = 4096,
    max_turns: int = 8,
    **kwargs: Any,
) -> Any:
    """An agent loop of class ``cls`` over ``server`` with ``tools`` (hermes format). Build it
    inside the event loop that runs it (veRL captures the running loop)."""
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": prompt_length,
                    "response_length": response_length,
                    "full_determinism": False,
                    "multi_turn": {
                        "max_user_turns": max_turns,
                        "max_assistant_turns": max_turns,
                        "max_parallel_calls": 1,
                        "max_tool_response_length": 4000,
                        "tool_response_truncate_side": "middle",
                        "format": "hermes",
                    },
                }
            },
            "data": {},
        }
    )
    return cls(
        trainer_config=DictConfigWrap(cfg),
        server_manager=server,
        tokenizer=server.tok,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(cfg.data),
        hf_model_type=None,
        tools=ToolListWrap(tools),
        **kwargs,
    )
