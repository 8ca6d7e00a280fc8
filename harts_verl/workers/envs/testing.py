"""Helpers to drive the env adapters through veRL's agent-loop tool-call path without a model
(used by the tests; handy for checking a new tool set by hand):

* :func:`byte_tokenizer`: a byte-level tokenizer (every text round-trips, no hub access) with a
  plain chat template;
* :class:`TokenOut`: the fields of veRL's ``TokenOutput`` that agent loops read (what a fake
  server's ``generate`` returns);
* :class:`ScriptedServer`: veRL's ``generate(request_id, *, prompt_ids, sampling_params)``
  contract, answering with texts from a script function;
* :func:`loop_config`: the trainer config an agent loop reads (rollout lengths, multi-turn);
* :func:`make_loop`: an agent loop (``HartsToolAgentLoop`` or a subclass) over that server with
  the hermes tool-call format (or a given config) and the given tools.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "ScriptedServer",
    "TokenOut",
    "byte_tokenizer",
    "hermes_call",
    "loop_config",
    "make_loop",
]

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


class TokenOut:
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
    ) -> TokenOut:
        text = self.tok.decode(prompt_ids)
        turn = text.count("<|assistant|>") - 1
        self.calls.append((request_id, turn))
        reply = self.script(request_id, turn, text)
        ids = [*self.tok.encode(reply, add_special_tokens=False), self.tok.eos_token_id]
        return TokenOut(ids)


def loop_config(
    *,
    prompt_length: int = 4096,
    response_length: int = 4096,
    max_turns: int = 8,
    tool_format: str = "hermes",
    max_tool_response_length: int = 4000,
    tool_response_truncate_side: str = "middle",
    **rollout: Any,
) -> Any:
    """The ``DictConfig`` an agent loop reads: ``actor_rollout_ref.rollout`` lengths, extra
    rollout keys ``rollout`` (e.g. ``n``) and its ``multi_turn`` settings (one tool call per turn,
    ``max_turns`` user and assistant turns), and an empty ``data``."""
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    **rollout,
                    "prompt_length": prompt_length,
                    "response_length": response_length,
                    "full_determinism": False,
                    "multi_turn": {
                        "max_user_turns": max_turns,
                        "max_assistant_turns": max_turns,
                        "max_parallel_calls": 1,
                        "max_tool_response_length": max_tool_response_length,
                        "tool_response_truncate_side": tool_response_truncate_side,
                        "format": tool_format,
                    },
                }
            },
            "data": {},
        }
    )


def make_loop(
    cls: type,
    server: Any,
    tools: list[Any],
    response_length: int = 4096,
    prompt_length: int = 4096,
    max_turns: int = 8,
    *,
    config: Any = None,
    tokenizer: Any = None,
    hf_model_type: str | None = None,
    **kwargs: Any,
) -> Any:
    """An agent loop of class ``cls`` over ``server`` with ``tools``: the config is ``config``
    (from :func:`loop_config`) or, when None, the hermes format with the given lengths; the
    tokenizer is ``tokenizer`` or the server's ``tok``; ``hf_model_type`` picks veRL's
    continuous-token builder (e.g. ``gpt_oss``). Build it inside the event loop that runs it
    (veRL captures the running loop)."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

    if config is None:
        config = loop_config(
            prompt_length=prompt_length, response_length=response_length, max_turns=max_turns
        )
    return cls(
        trainer_config=DictConfigWrap(config),
        server_manager=server,
        tokenizer=server.tok if tokenizer is None else tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(config.data),
        hf_model_type=hf_model_type,
        tools=ToolListWrap(tools),
        **kwargs,
    )
