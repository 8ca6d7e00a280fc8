"""Turn recorder: wraps a veRL LLM server client and records every ``generate`` call as a turn.

veRL's ``ToolAgentLoop`` calls ``server_manager.generate(request_id, prompt_ids=<whole context>,
sampling_params=...)`` once per assistant turn, token in / token out. :class:`RecordingServerClient`
forwards each call unchanged and records, per request id, the tokens the call adds to its parent
turn's context (a turn's ``token_ids``: the new prompt tokens (tool responses, user messages)
followed by the generated response); full contexts are rebuilt along the parent links on demand,
so memory stays O(unique tokens) however many turns a request has. A call that
adds no tokens (no new prompt tokens and an empty generation, e.g. an aborted request) is not a
turn and is not recorded, so every turn and every metadata span holds at least one token.

Parent links: a turn's parent is the deepest earlier turn of its request (or of the request it was
forked from, see :meth:`TurnRecorder.fork`) whose full context (prompt + response) is a token
prefix of the new prompt. In the usual case that is the previous turn. When an agent rewrites its
history (context management: summarising, dropping old tool output) the previous context is no
longer a prefix; the new turn then hangs below the deepest ancestor that still is a prefix (or
becomes a new root), i.e. it becomes a **sibling** of the rewritten branch, never an error.
Where the new prompt still matches the start of the first turn that is no longer a prefix (a
chat template that drops a response's last tokens before the tool output, as veRL's GLM token
builder does with its message-start tokens, or a summary that keeps part of a turn), that
matched part is recorded as a turn of its own (a copy with a fresh id, below the same parent)
and the new turn hangs below it: a request whose every turn is trimmed so keeps O(its tokens),
not a new root holding the whole context at every turn.

Tree metadata for one trajectory (:func:`tree_metadata`) is a JSON string stored in the agent
loop output's ``extra_fields["harts_tree"]``: the chain of turns that spells the trajectory's
token ids, as ``[turn_id, parent_turn_id, start, end]`` spans into ``prompt_ids + response_ids``.
Turns shared by fork branches carry the same ids; the engine checks a batch's metadata against
its tokens (:func:`forest_from_metadata`), a diagnostic of the recorder: the forest, the trie of
the trajectories, is the same either way.

This module imports neither torch nor veRL (the recorder only needs the ``generate`` contract).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

import numpy as np

from harts_verl.tree import RolloutForest
from harts_verl.tree._checks import is_int as _is_index
from harts_verl.tree.forest import Turn, as_trajectory_array

__all__ = [
    "TREE_KEY",
    "RecordedTurn",
    "RecordingServerClient",
    "TurnRecorder",
    "forest_from_metadata",
    "parse_tree_metadata",
    "tree_metadata",
]

TREE_KEY = "harts_tree"
"""Key of the tree metadata in an agent loop output's ``extra_fields``."""

_METADATA_VERSION = 1


@dataclass(eq=False)
class RecordedTurn:
    """One ``generate`` call. Stores only what the turn adds to its parent's context:
    ``tokens`` (int64, ``end - start`` ≥ 1 of them: the new prompt tokens, then the
    ``num_response`` generated ones), so a request's memory is O(its unique tokens), not
    O(turns × context). ``context`` (= ``prompt_ids + response_ids``, the full token context
    after the turn) and the other list views are rebuilt on demand along the parent links."""

    turn_id: str
    parent_turn_id: str | None
    request_id: str
    tokens: np.ndarray
    start: int
    num_response: int
    log_probs: list[float] | None = None
    rewrite: bool = False
    parent: RecordedTurn | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        """Length of the full context after this turn."""
        return self.start + int(self.tokens.shape[0])

    def context_array(self) -> np.ndarray:
        """The full context after this turn (int64 ``[end]``)."""
        parts: list[np.ndarray] = []
        t: RecordedTurn | None = self
        while t is not None:
            parts.append(t.tokens)
            t = t.parent
        return np.concatenate(parts[::-1]) if len(parts) > 1 else self.tokens.copy()

    @property
    def context(self) -> list[int]:
        """Prompt followed by the generated response."""
        return self.context_array().tolist()

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt the call was given."""
        return self.context_array()[: self.end - self.num_response].tolist()

    @property
    def response_ids(self) -> list[int]:
        """The generated tokens."""
        return self.tokens[self.tokens.shape[0] - self.num_response :].tolist()

    @property
    def token_ids(self) -> list[int]:
        """Tokens this turn adds to its parent's context."""
        return self.tokens.tolist()

    def as_turn(self) -> Turn:
        """The :class:`~harts_verl.tree.forest.Turn` record of this turn."""
        return Turn(self.turn_id, self.parent_turn_id, self.tokens)


def _token_array(values: Any, name: str) -> np.ndarray:
    """``values`` as a 1-D int64 array; ``TypeError`` naming ``name`` for non-integer ids."""
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise TypeError(
            f"{name}: expected a flat sequence of integer token ids, got dtype {arr.dtype} with "
            f"shape {arr.shape}"
        )
    return arr.astype(np.int64, copy=False)


def _deepest_prefix(chain: list[RecordedTurn], seq: np.ndarray) -> int:
    """Index in ``chain`` (root first, each turn the parent of the next) of the deepest turn
    whose context is a prefix of ``seq``; -1 when none is. A turn's context is a prefix iff its
    own tokens and every ancestor's match ``seq`` at their spans (one comparison per turn)."""
    n = seq.shape[0]
    k = -1
    for j, t in enumerate(chain):
        if t.end > n or not np.array_equal(seq[t.start : t.end], t.tokens):
            break
        k = j
    return k


@dataclass
class TurnRecorder:
    """Per-request chains of recorded turns (thread/async safe for appends).

    ``heads[request_id]`` is the id of the last turn of a request; a request's ancestor chain is
    followed through parent links, so a forked request (:meth:`fork`) sees its parent's turns.

    Turn ids are ``"{prefix}:{request_id}#{n}"`` (tail spans ``"...#tail{len}"``) with ``prefix``
    a random 128-bit hex string per recorder, so ids are unique across recorders even when
    their request ids coincide (veRL's ``rollout.full_determinism`` gives every sample the
    request id ``det-0``, and each agent loop has its own recorder): a batch's metadata never
    joins turns of different agent loops. Ids are names only (never parsed); determinism of a
    rollout does not depend on them.
    """

    turns: dict[str, RecordedTurn] = field(default_factory=dict)
    heads: dict[str, str | None] = field(default_factory=dict)
    rewrites: int = 0
    prefix: str = field(default_factory=lambda: uuid4().hex)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _counter: Any = field(default_factory=itertools.count, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise TypeError(f"prefix: expected a non-empty string, got {self.prefix!r}")

    # ------------------------------------------------------------------ recording
    def chain(self, request_id: str) -> list[RecordedTurn]:
        """The request's turns from the root to its head (forked-from turns included)."""
        out: list[RecordedTurn] = []
        tid = self.heads.get(request_id)
        while tid is not None:
            t = self.turns[tid]
            out.append(t)
            tid = t.parent_turn_id
        return out[::-1]

    def record(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        log_probs: Sequence[float] | None = None,
    ) -> RecordedTurn | None:
        """Record one generate call of ``request_id`` and return its turn.

        A call that adds no tokens to its parent's context (no new prompt tokens and an empty
        generation, e.g. an aborted request) is not a turn: nothing is recorded and None is
        returned. The request's head moves to the parent, the turn whose context the call
        ended with (so a rewrite back to an earlier context still counts in ``rewrites``)."""
        prompt = _token_array(prompt_ids, "prompt_ids")
        response = _token_array(response_ids, "response_ids")
        with self._lock:
            chain = self.chain(request_id)
            k = _deepest_prefix(chain, prompt)
            parent = chain[k] if k >= 0 else None
            rewrite = bool(chain) and parent is not chain[-1]
            if rewrite:
                self.rewrites += 1
                parent = self._matched_part(request_id, chain[k + 1], prompt) or parent
            start = parent.end if parent is not None else 0
            if prompt.shape[0] + response.shape[0] == start:  # adds no tokens: not a turn
                self.heads[request_id] = parent.turn_id if parent is not None else None
                return None
            turn = RecordedTurn(
                turn_id=f"{self.prefix}:{request_id}#{next(self._counter)}",
                parent_turn_id=parent.turn_id if parent is not None else None,
                request_id=request_id,
                tokens=np.concatenate([prompt[start:], response]),
                start=start,
                num_response=int(response.shape[0]),
                log_probs=list(log_probs) if log_probs is not None else None,
                rewrite=rewrite,
                parent=parent,
            )
            self.turns[turn.turn_id] = turn
            self.heads[request_id] = turn.turn_id
            return turn

    def _matched_part(
        self, request_id: str, turn: RecordedTurn, prompt: np.ndarray
    ) -> RecordedTurn | None:
        """The leading tokens of ``turn`` (not a prefix of ``prompt`` as a whole) that
        ``prompt`` matches, recorded as a turn below ``turn``'s parent; None if it matches none
        of them. Its response part (and log-probs) is what it keeps of ``turn``'s response."""
        ours = prompt[turn.start : turn.end]
        diff = np.flatnonzero(ours != turn.tokens[: ours.shape[0]])
        m = int(diff[0]) if diff.size else int(ours.shape[0])
        if m == 0:
            return None
        num_prompt = int(turn.tokens.shape[0]) - turn.num_response
        num_response = max(m - num_prompt, 0)
        part = RecordedTurn(
            turn_id=f"{self.prefix}:{request_id}#{next(self._counter)}",
            parent_turn_id=turn.parent_turn_id,
            request_id=request_id,
            tokens=turn.tokens[:m].copy(),
            start=turn.start,
            num_response=num_response,
            log_probs=None if turn.log_probs is None else turn.log_probs[:num_response],
            parent=turn.parent,
        )
        self.turns[part.turn_id] = part
        return part

    def fork(self, parent_request_id: str, child_request_id: str) -> None:
        """Start ``child_request_id`` at the current head of ``parent_request_id``: the child's
        next turn links below the parent's turns (shared prefix, recorded once)."""
        with self._lock:
            self.heads[child_request_id] = self.heads.get(parent_request_id)

    # ------------------------------------------------------------------ views
    def turn_records(self) -> list[Turn]:
        """All recorded turns as :class:`Turn` records (recording order, parents first)."""
        return [t.as_turn() for t in self.turns.values()]

    def forest(self) -> RolloutForest:
        """The forest of every recorded turn: one trajectory per leaf turn."""
        return RolloutForest.from_turns(self.turn_records())

    def leaf_contexts(self) -> list[list[int]]:
        """Full contexts of the leaf turns (the trajectories of :meth:`forest`), same order."""
        has_child = {t.parent_turn_id for t in self.turns.values()}
        return [t.context for t in self.turns.values() if t.turn_id not in has_child]

    def spans(self, request_id: str, sequence: Sequence[int]) -> list[list[Any]]:
        """``[turn_id, parent_turn_id, start, end]`` spans covering ``sequence`` (a trajectory of
        ``request_id``, e.g. ``prompt_ids + response_ids`` of its agent loop output).

        The request's chain is matched against ``sequence``: the deepest turn whose context is a
        prefix of it and its ancestors become spans; a remainder (tokens added after the last
        generate call, or a truncated last turn) becomes one extra span with a fresh id
        (``{prefix}:{request_id}#tail{len(sequence)}``).
        """
        seq = _token_array(sequence, "sequence")
        chain = self.chain(request_id)
        path = chain[: _deepest_prefix(chain, seq) + 1]
        spans: list[list[Any]] = [[t.turn_id, t.parent_turn_id, t.start, t.end] for t in path]
        end = spans[-1][3] if spans else 0
        if end < seq.shape[0]:
            parent = spans[-1][0] if spans else None
            tail = f"{self.prefix}:{request_id}#tail{seq.shape[0]}"
            spans.append([tail, parent, end, int(seq.shape[0])])
        return spans


class RecordingServerClient:
    """Drop-in wrapper of a veRL server client (``LLMServerClient`` or anything with its
    ``generate(request_id, *, prompt_ids, sampling_params, **kw) -> TokenOutput`` contract) that
    records each call in a :class:`TurnRecorder`. Other attributes are forwarded."""

    def __init__(self, inner: Any, recorder: TurnRecorder | None = None) -> None:
        self._inner = inner
        self.recorder = recorder if recorder is not None else TurnRecorder()

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kw: Any
    ) -> Any:
        """Forward to the wrapped client, then record (prompt, response) as a turn."""
        out = await self._inner.generate(
            request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kw
        )
        self.recorder.record(request_id, prompt_ids, out.token_ids, getattr(out, "log_probs", None))
        return out

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # not set yet (copy / unpickling build the object bare)
            raise AttributeError(name)
        return getattr(self._inner, name)


# ---------------------------------------------------------------------- metadata
def tree_metadata(spans: list[list[Any]], **extra: Any) -> str:
    """Encode a trajectory's turn spans (and ``extra`` JSON fields) as the ``harts_tree`` string.
    A string survives veRL's TensorDict/TransferQueue conversions unchanged. ``extra`` must not
    use the reserved keys ``v`` and ``turns`` (``ValueError``)."""
    reserved = sorted({"v", "turns"} & extra.keys())
    if reserved:
        raise ValueError(f"tree_metadata: extra field(s) {reserved} are reserved (v, turns)")
    return json.dumps({"v": _METADATA_VERSION, "turns": spans, **extra}, separators=(",", ":"))


def _decode_tree_metadata(value: Any) -> tuple[dict[str, Any] | None, str]:
    """``(meta, "")`` for a usable ``harts_tree`` value, else ``(None, what is wrong)``."""
    if value is None:
        return None, "no tree metadata"
    if isinstance(value, dict):
        meta = value
    else:
        try:
            meta = json.loads(value)
        except (TypeError, ValueError):
            return None, f"tree metadata is not a JSON string or object ({type(value).__name__})"
    if not isinstance(meta, dict):
        return None, f"tree metadata: expected a JSON object, got {type(meta).__name__}"
    version = meta.get("v", _METADATA_VERSION)
    if type(version) is not int or version != _METADATA_VERSION:
        return (
            None,
            f"tree metadata: unsupported version {version!r} (expected {_METADATA_VERSION})",
        )
    turns = meta.get("turns")
    if not isinstance(turns, list) or not turns:
        return None, "tree metadata: expected a non-empty 'turns' list"
    return meta, ""


def parse_tree_metadata(value: Any) -> dict[str, Any] | None:
    """Decode a ``harts_tree`` value (JSON string or dict); None when absent/invalid (not an
    object, another version, no non-empty ``turns`` list). Spans are checked by
    :func:`forest_from_metadata`."""
    return _decode_tree_metadata(value)[0]


def _check_span(span: Any) -> tuple[str, str | None, int, int] | str:
    """A span as ``(turn_id, parent_turn_id, start, end)``, or what is wrong with it."""
    if not isinstance(span, list | tuple) or len(span) != 4:
        got = f"{len(span)} items" if isinstance(span, list | tuple) else type(span).__name__
        return f"expected a [turn_id, parent_turn_id, start, end] list, got {got}"
    tid, parent, start, end = span
    if not isinstance(tid, str):
        return f"turn_id: expected a string, got {type(tid).__name__}"
    if parent is not None and not isinstance(parent, str):
        return f"parent_turn_id: expected a string or null, got {type(parent).__name__}"
    for name, v in (("start", start), ("end", end)):
        if not _is_index(v):
            return f"{name}: expected an integer token index, got {v!r}"
    return tid, parent, int(start), int(end)


def forest_from_metadata(
    sequences: Sequence[Any], metadata: Sequence[Any]
) -> tuple[RolloutForest | None, str]:
    """The forest of a batch whose tree metadata agrees with its tokens, trajectories in batch
    order (the trie of ``sequences``: what the metadata's turns spell).

    ``sequences[i]``: token ids of trajectory i (prompt + response); ``metadata[i]``: its
    ``harts_tree`` value. Returns ``(forest, "")`` or ``(None, reason)`` when the metadata is
    missing, malformed (a span that is not ``[turn_id: str, parent_turn_id: str | null,
    start: int, end: int]``), inconsistent with the tokens (a shared turn id spelling different
    tokens, spans not chaining over the trajectory), or ambiguous — the caller then detects
    prefixes from the tokens. The reason names the trajectory and, for a bad span, its index.
    Raises ``ValueError`` when ``metadata`` does not have one value per sequence, and naming
    ``sequences[i]`` when its token ids are not a non-empty flat list of integers >= 0 that
    fit in int64 (as :meth:`RolloutForest.from_sequences`: no float, bool or wrapped id).
    """
    seqs = [as_trajectory_array(s, i) for i, s in enumerate(sequences)]
    metadata = list(metadata)
    if len(metadata) != len(seqs):
        raise ValueError(
            f"metadata: expected one value per sequence ({len(seqs)}), got {len(metadata)}"
        )
    turns: dict[str, Turn] = {}
    end_of: list[str] = []
    for i, (seq, raw) in enumerate(zip(seqs, metadata, strict=True)):
        meta, why = _decode_tree_metadata(raw)
        if meta is None:
            return None, f"trajectory {i}: {why}"
        pos = 0
        prev: str | None = None
        n = seq.shape[0]
        for k, span in enumerate(meta["turns"]):
            checked = _check_span(span)
            if isinstance(checked, str):
                return None, f"trajectory {i}: turns[{k}]: {checked}"
            tid, parent, start, end = checked
            if start != pos or not start < end <= n:
                return None, (
                    f"trajectory {i}: turns[{k}]: span [{start}, {end}) does not continue at "
                    f"token {pos} inside its {n} tokens (spans must chain, each >= 1 token)"
                )
            if parent != prev:
                return None, (
                    f"trajectory {i}: turns[{k}]: parent_turn_id {parent!r} is not the previous "
                    f"span's turn {prev!r}"
                )
            tokens = seq[start:end]
            known = turns.get(tid)
            if known is None:
                turns[tid] = Turn(tid, parent, tokens)
            elif known.parent_turn_id != parent or not np.array_equal(known.token_ids, tokens):
                return None, f"trajectory {i}: turn {tid!r} differs from an earlier trajectory's"
            pos, prev = end, tid
        if pos != n:
            return None, f"trajectory {i}: spans cover {pos} of {n} tokens"
        end_of.append(prev)  # type: ignore[arg-type]
    if len(set(end_of)) != len(end_of):
        return None, "two trajectories end at the same turn"
    # The metadata agrees with the tokens: its forest is the trie of the trajectories, which
    # from_sequences builds in batch order (from_turns over the recorded turns, reordered by
    # subset, gives the same forest in twice the time: 0.67 s vs 0.28 s at 6.8M tokens).
    return RolloutForest.from_sequences(seqs), ""
