"""CPU rollout server ``harts_hf``: veRL's token-in/token-out server contract on plain HF
``generate`` (tiny models, tests and the local CPU recipe; GPU recipes use vLLM).

Three pieces, registered where veRL looks for them (:func:`register`):

* :class:`HFGenerationServer` — the server (a Ray actor started by the replica): holds an HF
  causal LM on CPU, answers ``generate(prompt_ids, sampling_params, request_id, ...)`` with a
  ``TokenOutput`` (sampled tokens and their log-probs), and takes new weights with
  :meth:`~HFGenerationServer.load_weights`. Sleep/wake/cache calls are no-ops.
* :class:`HFReplica` — ``RolloutReplica`` for ``RolloutReplicaRegistry`` (name ``harts_hf``):
  launches one server actor per replica (no GPU resources).
* :class:`HFServerAdapter` — ``BaseRollout`` for ``_ROLLOUT_REGISTRY[("harts_hf", "async")]``:
  lives in the hybrid actor worker; ``update_weights`` gathers the full tensors (FSDP2 shards
  are gathered with ``full_tensor``) and ships them to the replica's server.

Select it with ``actor_rollout_ref.rollout.name=harts_hf`` (tensor parallel size 1).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import reprlib
import threading
import time
from typing import Any

import numpy as np
import torch

from harts_verl.tree._checks import exact_integers, finite_float, int_outside_int64
from harts_verl.tree._checks import is_int as _is_int

__all__ = [
    "NAME",
    "HFGenerationServer",
    "max_new_tokens",
    "register",
    "request_seed",
    "sample_tokens",
]

logger = logging.getLogger(__name__)

NAME = "harts_hf"


def sample_tokens(
    model: torch.nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    stop_token_ids: list[int] | None = None,
    seed: int | None = None,
) -> tuple[list[int], list[float]]:
    """Autoregressive sampling with the model's KV cache (a model whose ``supports_kv_cache`` is
    False, the native ``harts_hybrid``, or whose output has no ``past_key_values`` re-reads its
    whole prefix at each step); returns (token ids, log-probs of the sampled tokens under the
    temperature-scaled, top-k / top-p filtered distribution). temperature 0 = greedy."""
    stops = set(stop_token_ids or [])
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    cached = getattr(model, "supports_kv_cache", True)
    out_ids: list[int] = []
    out_lp: list[float] = []
    past = None
    with torch.no_grad():
        for _ in range(max(0, max_new_tokens)):
            if cached:
                res = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = getattr(res, "past_key_values", None)
                # a model that returns no cache (RecurrentGemma, Mamba keep their state in
                # other fields): re-read the whole prefix from the next step on
                cached = past is not None
            else:
                res = model(input_ids=torch.tensor([prompt_ids + out_ids], dtype=torch.long))
            logits = res.logits[0, -1].float()
            if temperature and temperature > 0:
                logits = logits / temperature
                if top_k and top_k > 0:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                logp = torch.log_softmax(logits, -1)
                if top_p < 1.0:
                    sorted_lp, order = torch.sort(logp, descending=True)
                    keep = torch.cumsum(sorted_lp.exp(), -1) - sorted_lp.exp() < top_p
                    keep[0] = True  # the most likely token always stays (vLLM's rule)
                    mask = torch.full_like(logp, float("-inf"))
                    mask[order[keep]] = 0.0
                    logp = torch.log_softmax(logp + mask, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
            else:
                logp = torch.log_softmax(logits, -1)
                tok = int(torch.argmax(logp))
            out_ids.append(tok)
            out_lp.append(float(logp[tok]))
            if tok in stops:
                break
            ids = torch.tensor([[tok]], dtype=torch.long)
    return out_ids, out_lp


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _load_target(
    params: dict[str, torch.Tensor], name: str, t: torch.Tensor
) -> torch.Tensor | None:
    """The parameter (or the slice of a packed expert parameter) that tensor ``name`` of shape
    ``t.shape`` loads into, or None."""
    key = name if name in params else name.removeprefix("_fsdp_wrapped_module.")
    if key in params and params[key].shape == t.shape:
        return params[key]
    m = _EXPERT.fullmatch(key)
    if m is None:
        return None
    base, j, kind = m.group(1), int(m.group(2)), m.group(3)
    packed = params.get(f"{base}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}")
    if packed is None or packed.dim() != 3 or j >= packed.shape[0]:
        return None
    if kind == "down_proj":
        view = packed[j]
    else:  # gate rows first, then up rows (veRL's unfuse_moe_params splits them so)
        f = packed.shape[1] // 2
        view = packed[j, :f] if kind == "gate_proj" else packed[j, f:]
    return view if view.shape == t.shape else None


def request_seed(request_id: str, prompt_length: int, seed: Any = None) -> int:
    """The sampling seed of one ``generate`` call: ``seed`` (``sampling_params["seed"]``) when
    given, else derived from the request id and the prompt length with SHA-256 (a pure function
    of its inputs: the same request samples the same tokens in every process, unlike Python's
    salted ``hash``; turns of one request differ by their prompt length). Result in
    ``[0, 2**63)``. ``TypeError`` naming ``sampling_params.seed`` for a non-integer seed,
    ``ValueError`` for a negative one."""
    if seed is not None:
        if not _is_int(seed):
            raise TypeError(f"sampling_params.seed: expected an int, got {seed!r}")
        if int(seed) < 0 or int(seed) >= 2**63:
            raise ValueError(f"sampling_params.seed: expected an int in [0, 2**63), got {seed!r}")
        return int(seed)
    digest = hashlib.sha256(f"{request_id}\x00{int(prompt_length)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def token_id_list(values: Any, name: str, vocab_size: int | None) -> list[int]:
    """``values`` (a flat sequence of integers, e.g. ``prompt_ids``) as a list of ints, each in
    ``[0, vocab_size)`` (any int >= 0 when ``vocab_size`` is None). ``TypeError`` /
    ``ValueError`` naming ``name`` and the first bad value otherwise (vLLM refuses ids outside
    the vocabulary; the model would fail with an unnamed ``IndexError``)."""
    if isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
        raise TypeError(f"{name}: expected a list of token ids, got {values!r}")
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError):  # a ragged nesting
        arr = None
    if arr is not None and arr.ndim == 0:  # a 0-d tensor / array: one number, no list
        raise TypeError(f"{name}: expected a list of token ids, got {values!r}")
    if arr is not None and arr.ndim == 1 and arr.dtype.kind in "fO":
        # integers numpy could not hold together: past int64 (outside any vocabulary), or
        # numpy uint64 beside signed scalars (promoted to float64: read exactly)
        wide = int_outside_int64(values)
        if wide is not None:
            at = list(values).index(wide)
            raise ValueError(f"{name}[{at}]: token id {wide} is outside the vocabulary")
        exact = exact_integers(values)
        if exact is not None:
            arr = exact
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        at = next((i for i, v in enumerate(values) if not _is_int(v)), 0)
        raise TypeError(
            f"{name}: expected a flat list of int token ids, got {reprlib.repr(values[at])} "
            f"at index {at}"
        )
    if arr.size:
        outside = (arr < 0) if vocab_size is None else (arr < 0) | (arr >= vocab_size)
        if outside.any():
            at = int(np.argmax(outside))
            limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(
                f"{name}[{at}]: token id {int(arr[at])} is outside the vocabulary {limit}"
            )
    return [int(v) for v in arr.tolist()]


# vLLM sampling parameters this server does not apply, with the value at which they do nothing
_NEUTRAL = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "n": 1,
}
# ... and those it does not apply that do nothing when None or empty
_NEUTRAL_EMPTY = ("stop", "logit_bias", "bad_words", "allowed_token_ids", "logits_processors")
# ... and those it does not apply that do nothing when None (vLLM's structured outputs, prompt
# log-probs, thinking budget, repetition detection, forced decoding; older vLLM's names too)
_NEUTRAL_NONE = (
    "structured_outputs",
    "guided_decoding",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "prompt_logprob_token_ids",
    "prompt_logprob_start",
    "logprob_token_ids",
    "thinking_token_budget",
    "repetition_detection",
    "trace_decode_token_ids",
    "best_of",
)
# what the server reads (sampling, length, stops, seed, log-probs) ...
_APPLIED = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "seed",
    "logprobs",
)
# ... and vLLM's parameters of text output, streaming, caching or plugins: no effect on token ids
_INERT = (
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "output_kind",
    "stream_interval",
    "skip_clone",
    "flat_logprobs",
    "skip_reading_prefix_cache",
    "routed_experts_prompt_start",
    "extra_args",
)
_KNOWN = frozenset(_APPLIED + _INERT + _NEUTRAL_NONE + _NEUTRAL_EMPTY + tuple(_NEUTRAL))
# vLLM raises a temperature in (0, 1e-2) to 1e-2 (its ``_MAX_TEMP``: smaller ones overflow the
# scaled logits); 0 alone is greedy
_MIN_TEMPERATURE = 1e-2


def sampling_options(sampling_params: dict[str, Any]) -> tuple[float, int, float]:
    """``(temperature, top_k, top_p)`` of a request as vLLM reads them: ``temperature``
    (default 1.0) a finite number >= 0 (0: greedy; one in (0, 0.01) is raised to 0.01),
    ``top_k`` an int (0, -1 or None: off; below -1 refused), ``top_p`` in (0, 1] (None: 1.0).
    ``ValueError`` / ``TypeError`` naming ``sampling_params.<key>`` otherwise, and for a
    parameter this server does not apply (a penalty, ``min_p``, ``min_tokens``, ``n`` other
    than 1, a non-empty ``stop`` / ``logit_bias`` / ``bad_words`` / ``allowed_token_ids``, a
    ``structured_outputs`` / ``prompt_logprobs`` / ``truncate_prompt_tokens`` ... other than
    None), which it would otherwise ignore, and for a key that is no vLLM sampling parameter
    (vLLM's ``SamplingParams`` refuses it too; a misspelt key was silently ignored). vLLM's
    text-output and streaming options (``skip_special_tokens``, ``output_kind``, ...) and
    ``extra_args`` are accepted: they change no token id."""
    import numbers

    unknown = sorted(str(k) for k in sampling_params if k not in _KNOWN)
    if unknown:
        raise ValueError(
            f"sampling_params.{unknown[0]}: not a sampling parameter the {NAME} CPU rollout "
            f"server knows (vLLM's SamplingParams fields; unknown: {unknown})"
        )

    def number(key: str, default: float) -> float:
        v = sampling_params.get(key, default)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"sampling_params.{key}: expected a number, got {v!r}")
        f = finite_float(v)  # an int past float's range is None too, not an OverflowError
        if f is None:
            raise ValueError(f"sampling_params.{key}: expected a finite number, got {v!r}")
        return f

    temperature = number("temperature", 1.0)
    if temperature < 0:
        raise ValueError(f"sampling_params.temperature: expected >= 0, got {temperature!r}")
    top_p = number("top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ValueError(f"sampling_params.top_p: expected a number in (0, 1], got {top_p!r}")
    top_k = sampling_params.get("top_k")
    if top_k is None:
        top_k = -1
    elif not _is_int(top_k):
        raise TypeError(f"sampling_params.top_k: expected an int, got {top_k!r}")
    elif int(top_k) < -1:
        raise ValueError(f"sampling_params.top_k: expected -1, 0 (off) or >= 1, got {top_k!r}")
    for key, neutral in _NEUTRAL.items():
        if number(key, neutral) != neutral:
            raise ValueError(
                f"sampling_params.{key}: {sampling_params[key]!r} is not supported by the "
                f"{NAME} CPU rollout server (only {neutral})"
            )
    for key in _NEUTRAL_EMPTY:
        value = sampling_params.get(key)
        if value is not None and not isinstance(value, str | list | tuple | dict):
            raise TypeError(f"sampling_params.{key}: expected a list, dict or None, got {value!r}")
        if value is not None and (isinstance(value, str) or len(value) > 0):
            raise ValueError(
                f"sampling_params.{key}: {value!r} is not supported by the {NAME} CPU rollout "
                "server (only None or empty)"
            )
    for key in _NEUTRAL_NONE:
        if sampling_params.get(key) is not None:
            raise ValueError(
                f"sampling_params.{key}: {sampling_params[key]!r} is not supported by the {NAME} "
                "CPU rollout server (only None)"
            )
    if 0 < temperature < _MIN_TEMPERATURE:
        temperature = _MIN_TEMPERATURE
    return temperature, int(top_k) if int(top_k) > 0 else -1, top_p


def max_new_tokens(
    sampling_params: dict[str, Any],
    prompt_length: int,
    *,
    max_model_len: int,
    config_prompt_length: int,
    response_length: int,
) -> int:
    """How many tokens one ``generate`` call may sample, as veRL's vLLM server decides it.

    ``room = max_model_len - prompt_length`` (``max_model_len`` defaults to the rollout's
    ``prompt_length + response_length``); a prompt with ``room < 1`` is a ``ValueError``. The
    request's ``max_tokens`` (or ``max_new_tokens``; ``None`` = absent) defaults to
    ``min(response_length, config_prompt_length + response_length - prompt_length)`` and is
    clamped to ``[1, room]``: an explicit ``max_tokens <= 0`` samples one token (vLLM rejects
    ``max_tokens < 1``, veRL clamps it to 1), never the whole context. ``TypeError`` naming
    ``sampling_params.max_tokens`` for a non-integer value."""
    room = int(max_model_len) - int(prompt_length)
    if room < 1:
        raise ValueError(
            f"prompt_ids: {prompt_length} tokens leave no room to generate within "
            f"max_model_len={max_model_len} (need at least 1 token of headroom)"
        )
    key = "max_tokens" if sampling_params.get("max_tokens") is not None else "max_new_tokens"
    requested = sampling_params.get(key)
    if requested is None:
        requested = min(
            int(response_length), int(config_prompt_length) + int(response_length) - prompt_length
        )
    elif not _is_int(requested):
        raise TypeError(f"sampling_params.{key}: expected an int, got {requested!r}")
    return max(1, min(int(requested), room))


def _tokenizer_eos(path: str) -> int | None:
    """The eos id of the tokenizer saved at ``path`` (None when there is none)."""
    import os

    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=True).eos_token_id
    except (OSError, ValueError):
        return None


def _id_list(value: Any) -> list[int]:
    """An eos setting (None, an int, or a list of ints, as configs write it) as a list."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _generation_eos(path: str, hf_cfg: Any) -> list[int]:
    """The eos ids of the model's generation config (``generation_config.json``, else the model
    config's ``eos_token_id``): vLLM stops at all of them besides the tokenizer's eos."""
    import os

    if os.path.isfile(os.path.join(path, "generation_config.json")):
        try:
            from transformers import GenerationConfig

            return _id_list(GenerationConfig.from_pretrained(path).eos_token_id)
        except (OSError, ValueError):
            pass
    return _id_list(getattr(hf_cfg, "eos_token_id", None))


class HFGenerationServer:
    """Token-in/token-out generation server on an HF model (CPU, fp32)."""

    def __init__(
        self,
        config: Any,
        model_config: Any,
        replica_rank: int = 0,
        **_: Any,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from harts_verl.models import checkpoints
        from harts_verl.models.hf import HartsHybridForCausalLM, attn_implementation_for

        self.config = config
        self.model_config = model_config
        self.replica_rank = replica_rank
        path = getattr(model_config, "local_path", None) or model_config.path
        if checkpoints.source_format_of_dir(path) is not None:  # Kimi-Linear / Ling 3
            self.model = HartsHybridForCausalLM.from_pretrained(path, dtype=torch.float32)
            hf_cfg = self.model.config
        else:
            hf_cfg = AutoConfig.from_pretrained(path, trust_remote_code=True)
            hf_cfg._attn_implementation = attn_implementation_for(hf_cfg)  # gpt-oss: eager
            auto = AutoModelForCausalLM
            if type(hf_cfg) not in AutoModelForCausalLM._model_mapping.keys():
                from verl.utils.model import get_hf_auto_model_class

                auto = get_hf_auto_model_class(hf_cfg)  # the class veRL's engine loads
            self.model = auto.from_pretrained(
                path, config=hf_cfg, torch_dtype=torch.float32, trust_remote_code=True
            ).eval()
        tok = getattr(model_config, "tokenizer", None)
        tok_eos = getattr(tok, "eos_token_id", None) if tok is not None else None
        if tok_eos is None:  # the replica's model config may carry no tokenizer
            tok_eos = _tokenizer_eos(getattr(model_config, "tokenizer_path", None) or path)
        # as vLLM: the tokenizer's eos and every eos id of the generation config (Llama 3 /
        # GLM-4 list several); unless ignore_eos
        gen_eos = _generation_eos(path, hf_cfg)
        self.eos_token_ids = tuple(dict.fromkeys(_id_list(tok_eos) + gen_eos))
        self.max_model_len = int(
            getattr(config, "max_model_len", None)
            or (config.prompt_length + config.response_length)
        )
        self.global_steps: int | None = None
        self.weight_version = 0
        self._lock = None
        # held while a sample runs (in the executor) and while weights are copied: a weight
        # update never lands inside a generation (one output, one policy, one global step)
        self._weights_lock = threading.Lock()

    @property
    def eos_token_id(self) -> int | None:
        """The first of :attr:`eos_token_ids` (the tokenizer's eos when it has one)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int | None:
        """Rows of the model's input embedding (the ids a prompt may hold); None if unknown."""
        get = getattr(self.model, "get_input_embeddings", None)
        emb = get() if callable(get) else None
        rows = getattr(emb, "num_embeddings", None)
        if rows is None:
            rows = getattr(getattr(self.model, "config", None), "vocab_size", None)
        return int(rows) if _is_int(rows) else None

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        **_: Any,
    ) -> Any:
        """veRL's server ``generate``: returns a ``TokenOutput`` with token ids and log-probs.

        Length: :func:`max_new_tokens` (vLLM's rule: default ``min(response_length, what the
        rollout lengths leave)``, clamped to ``[1, room]``). Sampling is seeded by
        :func:`request_seed`: ``sampling_params["seed"]`` when given, else a stable hash of
        ``(request_id, len(prompt_ids))``, so the same call samples the same tokens in any
        process (same weights, CPU fp32)."""
        import asyncio

        from verl.workers.rollout.replica import TokenOutput

        if self._lock is None:
            self._lock = asyncio.Lock()
        sp = dict(sampling_params or {})
        prompt_ids = token_id_list(prompt_ids, "prompt_ids", self.vocab_size)
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids: empty prompt (at least one token is needed)")
        temperature, top_k, top_p = sampling_options(sp)
        max_new = max_new_tokens(
            sp,
            len(prompt_ids),
            max_model_len=self.max_model_len,
            config_prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
        )
        stops = sp.get("stop_token_ids")
        stops = token_id_list(
            [] if stops is None else stops, "sampling_params.stop_token_ids", None
        )
        ignore_eos = sp.get("ignore_eos")
        if ignore_eos is None:  # as veRL's vLLM server: the rollout config's is the default
            ignore_eos = getattr(self.config, "ignore_eos", False)
        if not ignore_eos:
            stops.extend(self.eos_token_ids)
        seed = request_seed(request_id, len(prompt_ids), sp.get("seed"))
        async with self._lock:  # one generation at a time per server (CPU)

            def run() -> tuple[list[int], list[float], int | None]:
                with self._weights_lock:
                    ids, lps = sample_tokens(
                        self.model,
                        list(prompt_ids),
                        max_new_tokens=max_new,
                        temperature=temperature,
                        top_k=top_k,
                        top_p=top_p,
                        stop_token_ids=stops,
                        seed=seed,
                    )
                    return ids, lps, self.global_steps  # the step of the weights it sampled

            ids, lps, steps = await asyncio.get_running_loop().run_in_executor(None, run)
        extra = {"global_steps": steps} if steps is not None else {}
        return TokenOutput(
            token_ids=ids,
            # vLLM: None (or veRL's False) none; 0 the sampled tokens' (k > 0 adds top-k
            # candidates, which TokenOutput does not carry)
            log_probs=None if sp.get("logprobs") is None or sp.get("logprobs") is False else lps,
            stop_reason="completed",
            num_preempted=0,
            extra_fields=extra,
        )

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy full tensors (HF parameter names) into the model; returns the count loaded.
        Per-expert tensors (``...experts.{j}.gate_proj / up_proj / down_proj.weight``, as veRL's
        ``unfuse_moe_params`` sends them for vLLM) go into transformers' packed
        ``experts.gate_up_proj`` / ``down_proj``. A ``harts_hybrid`` converted from Kimi-Linear
        / Ling 3 receives the whole model in the source's names (what the engine exports) and
        converts it back. ``ValueError`` naming
        the tensors that match no parameter or buffer by name and shape (nothing is loaded
        then): a rollout silently keeping old weights would sample off-policy."""
        from harts_verl.models import checkpoints

        named = list(named_tensors)
        source = checkpoints.source_architecture(getattr(self.model, "config", None))
        if source is not None:
            fmt, arch = source
            native = checkpoints.hybrid_state_dict_from_source(fmt, dict(named), arch)
            named = [("model." + k, v) for k, v in native.items()]
        # every name of a tied parameter (veRL sends ``lm_head.weight`` of a tied model too)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        pairs, unmatched = [], []
        for name, t in named:
            target = _load_target(params, name, t)
            if target is not None:
                pairs.append((target, t))
            else:
                unmatched.append(f"{name} {tuple(t.shape)}")
        if unmatched:
            raise ValueError(
                f"load_weights: {len(unmatched)} tensors match no parameter of the rollout "
                f"model by name and shape, e.g. {unmatched[:3]}"
            )
        with self._weights_lock, torch.no_grad():  # waits for a running sample
            for param, t in pairs:
                param.copy_(t.to(param.dtype))
            self.weight_version += 1
        return len(pairs)

    def set_global_steps(self, global_steps: int) -> None:
        """Remember the trainer step (reported in ``TokenOutput.extra_fields``)."""
        with self._weights_lock:
            self.global_steps = global_steps

    # ------------------------------------------------------------------ no-op controls
    def get_server_address(self) -> tuple[str, int]:
        """There is no HTTP endpoint; token-in/token-out goes through the actor handle."""
        return "127.0.0.1", 0

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """No-op (CPU, nothing to offload)."""

    async def sleep(self) -> None:
        """No-op."""

    async def clear_kv_cache(self) -> None:
        """No-op (no persistent cache between requests)."""

    async def release_kv_cache(self) -> None:
        """No-op."""

    async def resume_kv_cache(self) -> None:
        """No-op."""

    async def wait_for_requests_to_drain(self) -> None:
        """No-op."""

    async def abort_all_requests(self, **_: Any) -> dict[str, Any]:
        """Nothing to abort between calls."""
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, **_: Any) -> dict[str, Any]:
        """Nothing to abort between calls."""
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        """No-op."""

    async def resume_engine_generation(self) -> None:
        """No-op."""

    async def open_submission_gate(self) -> None:
        """No-op."""

    async def start_profile(self, **_: Any) -> None:
        """No-op."""

    async def stop_profile(self) -> None:
        """No-op."""


def _server_name(replica_rank: int, role: str = "") -> str:
    """The server actor's name: the policy's (``role`` "", which the hybrid worker's adapter looks
    up) or a ``"reward"`` / ``"teacher"`` replica's, as veRL names its own servers, so replicas of
    different roles never share a name."""
    return f"{NAME}_server_{role + '_' if role else ''}{replica_rank}"


@functools.cache
def _replica_cls() -> type:
    import ray
    from verl.workers.rollout.replica import RolloutReplica

    class HFReplica(RolloutReplica):
        """One :class:`HFGenerationServer` actor per replica (CPU only)."""

        async def launch_servers(self) -> None:
            server_cls = ray.remote(HFGenerationServer)
            server = server_cls.options(
                name=_server_name(self.replica_rank, self._role()) + self.name_suffix,
                num_cpus=0,
                max_concurrency=self.max_concurrency,
            ).remote(
                config=self.config, model_config=self.model_config, replica_rank=self.replica_rank
            )
            self.servers = [server]
            self._server_handle = server
            host, port = await server.get_server_address.remote()
            self._server_address = f"{host}:{port}"

        def _role(self) -> str:
            if self.is_reward_model:
                return "reward"
            return "teacher" if self.is_teacher_model else ""

        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def sleep(self) -> None:
            return None

        async def wake_up(self) -> None:
            return None

        async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
            return {"aborted_count": 0, "request_ids": [], "server_results": []}

        async def resume_generation(self) -> None:
            return None

    return HFReplica


@functools.cache
def _adapter_cls() -> type:
    import ray
    from verl.workers.rollout.base import BaseRollout

    class HFServerAdapter(BaseRollout):
        """Hybrid-worker side of ``harts_hf``: forwards weight updates to the server actor."""

        def __init__(
            self,
            config: Any,
            model_config: Any,
            device_mesh: Any,
            replica_rank: int = -1,
            **_: Any,
        ) -> None:
            super().__init__(config, model_config, device_mesh)
            import os

            rank = int(os.environ.get("RANK", "0"))
            self.replica_rank = rank if replica_rank == -1 else replica_rank
            self.server_handle = None

        def _server(self) -> Any:
            if self.server_handle is None:
                try:
                    self.server_handle = ray.get_actor(_server_name(self.replica_rank))
                except ValueError:
                    return None
            return self.server_handle

        async def resume(self, tags: list[str]) -> None:
            return None

        async def release(self) -> None:
            return None

        @torch.no_grad()
        async def update_weights(
            self,
            weights: Any,
            global_steps: int | None = None,
            wire_format: str = "named_tensors",
            **kwargs: Any,
        ) -> None:
            if wire_format != "named_tensors":  # veRL's delta checkpoint engine: vLLM only
                raise ValueError(
                    f"wire_format: harts_hf takes 'named_tensors' (full tensors), got "
                    f"{wire_format!r}: use a checkpoint engine that sends full tensors"
                )
            t0 = time.time()
            full = []
            for name, t in weights:
                if hasattr(t, "full_tensor"):
                    t = t.full_tensor()
                full.append((name, t.detach().to("cpu").clone()))
            server = self._server()
            if server is None:  # not a rank that owns a server
                return
            await server.load_weights.remote(full)
            if global_steps is not None:
                await server.set_global_steps.remote(global_steps)
            logger.info("harts_hf: update_weights %d tensors in %.2fs", len(full), time.time() - t0)

    return HFServerAdapter


def __getattr__(name: str) -> Any:
    """``HFServerAdapter`` / ``HFReplica`` resolve lazily (they subclass veRL classes)."""
    if name == "HFServerAdapter":
        return _adapter_cls()
    if name == "HFReplica":
        return _replica_cls()
    raise AttributeError(name)


def register() -> None:
    """Register ``harts_hf`` in veRL's ``_ROLLOUT_REGISTRY`` (server adapter, async mode) and
    ``RolloutReplicaRegistry`` (idempotent)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.HFServerAdapter"
    RolloutReplicaRegistry.register(NAME, _replica_cls)
