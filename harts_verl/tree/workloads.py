"""Seeded synthetic rollout trees shaped like agentic RL batches (numpy only, no torch).

Every generator returns a :class:`Workload`: one batch both as flat trajectories (``sequences``,
for :meth:`RolloutForest.from_sequences`) and as a turn tree with parent links (``turns``, for
:meth:`RolloutForest.from_turns`). Both give the same forest with the same trajectory order: the
order in which the trajectories' end turns appear in ``turns``.

How a batch grows (a Python loop per *turn*; all token ids come from one vectorized draw at the
end, so ``swe_like(scale=16)``, 17M tokens, takes ≈ 0.3 s):

* **Groups.** Root prompts (SWE issue, τ task), each a GRPO group, are added until the batch holds
  at least ``scale × 1M`` semantic tokens. A group is indivisible, so the batch overshoots by less
  than one group: an SWE group holds ≈ 2–5M tokens and a τ group ≈ 0.6–2M (reaching the target
  compression with realistic lengths takes that many branches), so every scale below that yields
  one group: the same first group for a given seed. With ``num_systems > 0`` a
  system-prompt turn (``system_tokens``) is shared by every group of its domain (groups are dealt
  round-robin over ``num_systems`` domains); the group's ``prompt_tokens`` turn hangs below it.
* **Group samples.** ``group_size`` independent samples start below the group prompt.
* **Steps.** A sample runs ``steps`` steps. A step is an assistant turn (``assistant_tokens``,
  with probability ``thinking_prob`` preceded by a ``thinking_tokens`` block in the same turn)
  followed by an environment turn: a user message (probability ``user_prob``, ``user_tokens``)
  or a tool observation (lognormal with ``observation_median`` and ``observation_p95``, clipped at
  ``observation_max``). The last step ends on its assistant turn.
* **Path cap.** Group ``g`` gets cap ``path_caps[g % len(path_caps)]``. A trajectory stops when a
  turn would exceed the cap; that turn is truncated to end exactly at the cap (never empty).
* **Context-management rewrites.** When a path reaches ``rewrite_at × cap`` (0: never), or with
  probability ``rewrite_prob`` after any step, the history is rewritten: observations outside the
  first ``keep_head`` and the last ``keep_tail`` turns after the prompt become a
  ``placeholder_tokens`` marker and old thinking blocks are dropped. The history so far ends as a
  trajectory; the rewritten history is a *new sibling subtree* from its first changed turn, and
  the sample continues from its end (at most ``max_rewrites`` times per path, ``keep_tail``
  steps apart).
* **Turn-level forks** (Tree-GRPO / ARPO style). After a group's samples, fork events run
  round-robin over its samples: pick a random branch of the sample, fork it after the
  environment turn (from step ``fork_min_step`` on) nearest below ``(1 - tail) ×`` its length,
  into ``fork_k`` continuations (``fork_k - 1`` new branches that share the history and run their
  own remaining steps, lognormally jittered). Tail fractions follow a golden-ratio sequence on
  ``(0, 2·fork_tail)`` (evenly spread, mean ``fork_tail``). With ``prefix_end_prob`` the history up
  to the fork is also emitted as a trajectory (a trajectory that is a prefix of others). Fork
  events stop once the batch's S / C reaches ``target_compression`` (0: no target), or when each
  sample has ``max_forks`` new branches.

Ranges ``(lo, hi)`` of token and step counts are clipped lognormals with median ``sqrt(lo·hi)``
and ``lo``/``hi`` at ±2σ; prompt lengths and group sizes are uniform integers in ``[lo, hi]``.

Guarantees:

* Deterministic for a ``seed`` (only ``numpy.random.default_rng(seed)`` is used); different seeds
  give different batches.
* Token ids are uniform in ``[0, vocab_size)``. Sibling turns (and root turns) always differ in
  their first token (ValueError if ``vocab_size`` is too small for that), so the token trie is
  exactly the turn tree: sharing comes only from the turn structure, and the forest's compact
  tokens C equal :attr:`Workload.num_turn_tokens`.
* Every turn is non-empty; ``turn_id`` is the position in ``turns`` and parents come before their
  children; every trajectory is at most its group's path cap; no two trajectories are equal.
* Defaults are calibrated (``tests/test_workloads.py``): ``swe_like`` S / C ≈ 5.6 and
  ``tau_like`` ≈ 9.4 at every scale ≥ 0.05: the fork target makes every batch land at the target
  or up to ≈ 0.2 above it (5.60–5.76 and 9.40–9.63 over 40 seeds); ``grpo_flat`` ≈ 1.7 (one level:
  prompt → n single-turn responses).
* Tiny mode, for tests: at ``scale < 0.05`` the defaults shrink with ``f = scale / 0.05``: turn
  lengths by ``f``, prompts and path caps by ``f^1.5``, step counts, group sizes, fork budgets
  and kept turns by ``sqrt(f)`` (each with a small minimum), keeping the tree shape (group
  samples, forks, rewrites, occasional prefix trajectories); ``swe_like(scale=0.001)`` has a few
  hundred to a few thousand tokens. Compression is lower there (small fork budgets).
  Overrides are always taken literally; path caps not overridden are derived from the final
  prompt lengths (overrides included).
* Bad arguments (``scale <= 0`` or above ``MAX_SCALE`` = 256, negative ``seed``, unknown or
  ill-typed override) raise ValueError naming the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harts_verl.tree._checks import finite_float
from harts_verl.tree._checks import is_int as _is_int
from harts_verl.tree.forest import RolloutForest, Turn

__all__ = [
    "MAX_SCALE",
    "TOKENS_PER_SCALE",
    "WORKLOADS",
    "Workload",
    "grpo_flat",
    "swe_like",
    "tau_like",
]

TOKENS_PER_SCALE = 1_000_000
TINY_SCALE = 0.05
# The largest scale: ≈ 256M semantic tokens (2 GiB of int64 token ids, a minute to generate),
# far beyond one training step; larger values are refused up front, not left to run out of memory.
MAX_SCALE = 256

# Turn kinds.
_SYSTEM, _PROMPT, _ASSISTANT, _OBSERVATION, _USER, _PLACEHOLDER = range(6)
_ENV_KINDS = (_OBSERVATION, _USER, _PLACEHOLDER)
_GOLDEN = 0.6180339887498949
_Z95 = 1.6448536269514722


@dataclass
class Workload:
    """A synthetic batch.

    ``sequences[i]`` (1-D int64) is trajectory ``i``; ``group_ids[i]`` (int64) its root prompt /
    GRPO group; ``turns`` the same trajectories as a turn tree (``turn_id`` = index in the list,
    parents before children, trajectory ``i`` ends at the ``i``-th turn that is a leaf or marked
    ``is_trajectory_end``); ``params`` the resolved generator parameters plus ``scale``, ``seed``
    and ``length_factor`` (the tiny-mode factor, 1.0 otherwise); ``stats`` counts the shape
    features: ``groups``, ``samples``, ``fork_events``, ``fork_branches`` (new branches),
    ``prefix_ends``, ``rewrites``, ``capped`` (trajectories ending at their path cap).
    """

    name: str
    sequences: list[np.ndarray]
    group_ids: np.ndarray
    turns: list[Turn]
    params: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def num_semantic_tokens(self) -> int:
        """S: total length of all trajectories."""
        return int(sum(s.shape[0] for s in self.sequences))

    @property
    def num_trajectories(self) -> int:
        return len(self.sequences)

    @property
    def num_turn_tokens(self) -> int:
        """Total length of ``turns``: equals the forest's compact tokens C."""
        return int(sum(t.token_ids.shape[0] for t in self.turns))

    @property
    def compression(self) -> float:
        """S / C, computed from the turns (equals ``self.forest().compression``)."""
        return self.num_semantic_tokens / max(1, self.num_turn_tokens)

    def forest(self) -> RolloutForest:
        """``RolloutForest.from_sequences(sequences, group_ids=group_ids)``."""
        return RolloutForest.from_sequences(self.sequences, group_ids=self.group_ids)


# ---------------------------------------------------------------------------- parameters

_RANGE_KEYS = frozenset(
    {
        "prompt_tokens",
        "system_tokens",
        "group_size",
        "steps",
        "assistant_tokens",
        "thinking_tokens",
        "user_tokens",
        "fork_k",
    }
)
_PROB_KEYS = frozenset({"thinking_prob", "user_prob", "prefix_end_prob", "rewrite_prob"})
_INT_KEYS = frozenset(
    {
        "vocab_size",
        "num_systems",
        "observation_median",
        "observation_p95",
        "observation_max",
        "max_forks",
        "fork_min_step",
        "keep_head",
        "keep_tail",
        "placeholder_tokens",
        "max_rewrites",
    }
)
# Tiny mode: per-turn token lengths shrink by f (value: minimum) ...
_TINY_TURN = {
    "assistant_tokens": 1,
    "thinking_tokens": 1,
    "user_tokens": 1,
    "observation_median": 2,
    "observation_p95": 3,
    "observation_max": 4,
    "placeholder_tokens": 1,
}
# ... prompt lengths by f^1.5 (caps too, see _shrink) ...
_TINY_PATH = {"prompt_tokens": 4, "system_tokens": 4}
# ... and counts by sqrt(f).
_TINY_COUNT = {"steps": 2, "group_size": 2, "max_forks": 2, "keep_head": 0, "keep_tail": 1}

_BASE: dict[str, Any] = {
    "vocab_size": 32000,
    "num_systems": 0,
    "system_tokens": (0, 0),
    "prompt_tokens": (3000, 6000),
    "group_size": (4, 8),
    "steps": (12, 200),
    "assistant_tokens": (50, 800),
    "thinking_prob": 0.0,
    "thinking_tokens": (1000, 4000),
    "observation_median": 300,
    "observation_p95": 4000,
    "observation_max": 16000,
    "user_prob": 0.0,
    "user_tokens": (20, 200),
    "path_caps": (32768, 65536, 131072),
    "target_compression": 0.0,
    "max_forks": 0,
    "fork_k": (2, 2),
    "fork_tail": 0.5,
    "fork_min_step": 1,
    "prefix_end_prob": 0.0,
    "rewrite_at": 0.0,
    "rewrite_prob": 0.0,
    "max_rewrites": 0,
    "keep_head": 2,
    "keep_tail": 6,
    "placeholder_tokens": 12,
}

_SWE: dict[str, Any] = {
    **_BASE,
    "target_compression": 5.6,
    "max_forks": 24,
    "fork_k": (2, 3),
    "fork_tail": 0.03,
    "fork_min_step": 3,
    "prefix_end_prob": 0.1,
    "rewrite_at": 0.75,
    "max_rewrites": 1,
}

_TAU: dict[str, Any] = {
    **_BASE,
    "num_systems": 3,
    "system_tokens": (4600, 5000),
    "prompt_tokens": (100, 400),
    "group_size": (6, 12),
    "steps": (4, 40),
    "assistant_tokens": (30, 400),
    "thinking_prob": 0.3,
    "thinking_tokens": (100, 800),
    "observation_median": 150,
    "observation_p95": 1200,
    "observation_max": 4000,
    "user_prob": 0.4,
    "user_tokens": (15, 150),
    "path_caps": (32768,),
    "target_compression": 9.4,
    "max_forks": 32,
    "fork_k": (2, 4),
    "fork_tail": 0.03,
    "fork_min_step": 1,
    "prefix_end_prob": 0.1,
    "rewrite_prob": 0.02,
    "max_rewrites": 1,
    "keep_tail": 4,
}

_FLAT: dict[str, Any] = {
    **_BASE,
    "prompt_tokens": (200, 2000),
    "group_size": (8, 8),
    "steps": (1, 1),
    "assistant_tokens": (200, 4000),
    "path_caps": (32768,),
}


def _is_real(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)


# the largest count a workload parameter may hold (tokens, turns, samples: arrays of that many
# elements are built; past it an int overflowed float math or int64 with a bare traceback)
_MAX_COUNT = 2**31 - 1
_COUNT_KEYS = _INT_KEYS - {"vocab_size", "observation_median", "observation_p95", "observation_max"}


def _check_params(p: dict[str, Any]) -> None:
    """Raise ValueError naming the first bad parameter."""
    for key, v in p.items():
        if key in _RANGE_KEYS:
            if not (
                isinstance(v, tuple) and len(v) == 2 and all(map(_is_int, v)) and 0 <= v[0] <= v[1]
            ):
                raise ValueError(
                    f"{key}: expected a (lo, hi) pair of ints with 0 <= lo <= hi, got {v!r}"
                )
            if v[1] > _MAX_COUNT:
                raise ValueError(f"{key}: expected bounds <= 2**31 - 1, got {v!r}")
        elif key in _PROB_KEYS:
            if not (_is_real(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"{key}: expected a probability in [0, 1], got {v!r}")
        elif key in _INT_KEYS:
            if not (_is_int(v) and v >= 0):
                raise ValueError(f"{key}: expected a non-negative int, got {v!r}")
            # vocab_size is an id bound (below); observation sizes are drawn clipped in log space
            if key in _COUNT_KEYS and v > _MAX_COUNT:
                raise ValueError(f"{key}: expected an int <= 2**31 - 1, got {v!r}")
        elif key == "path_caps":
            if not (
                isinstance(v, tuple) and v and all(_is_int(x) and 0 < x <= _MAX_COUNT for x in v)
            ):
                raise ValueError(
                    f"path_caps: expected a non-empty tuple of positive ints <= 2**31 - 1, "
                    f"got {v!r}"
                )
        elif key == "rewrite_at":
            if not (_is_real(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"rewrite_at: expected a fraction in [0, 1] (0: off), got {v!r}")
        elif key == "fork_tail":
            if not (_is_real(v) and 0.0 < v <= 0.5):
                raise ValueError(f"fork_tail: expected a fraction in (0, 0.5], got {v!r}")
        elif key == "target_compression":
            finite = _is_int(v) or (_is_real(v) and math.isfinite(v))  # a big int: no float
            if not (finite and (v == 0 or v >= 1)):
                raise ValueError(
                    f"target_compression: expected 0 (off) or a finite number >= 1, got {v!r}"
                )
    if not 2 <= p["vocab_size"] <= 2**63 - 1:  # token ids are int64
        raise ValueError(f"vocab_size: expected an int in [2, 2**63 - 1], got {p['vocab_size']}")
    for key in ("prompt_tokens", "group_size", "steps", "assistant_tokens"):
        if p[key][0] < 1:
            raise ValueError(f"{key}: lower bound must be >= 1, got {p[key]!r}")
    if p["fork_k"][0] < 2:
        raise ValueError(f"fork_k: a fork has at least 2 continuations, got {p['fork_k']!r}")
    if p["num_systems"] > 0 and p["system_tokens"][0] < 1:
        raise ValueError(
            f"system_tokens: lower bound must be >= 1 with num_systems > 0, got {p['system_tokens']!r}"
        )
    if p["thinking_prob"] > 0 and p["thinking_tokens"][0] < 1:
        raise ValueError(f"thinking_tokens: lower bound must be >= 1, got {p['thinking_tokens']!r}")
    if p["user_prob"] > 0 and p["user_tokens"][0] < 1:
        raise ValueError(f"user_tokens: lower bound must be >= 1, got {p['user_tokens']!r}")
    if p["observation_median"] < 1:
        raise ValueError(f"observation_median: expected >= 1, got {p['observation_median']}")
    if not p["observation_median"] <= p["observation_p95"] <= p["observation_max"]:
        raise ValueError(
            "observation_p95: need observation_median <= observation_p95 <= observation_max, got "
            f"{p['observation_median']}, {p['observation_p95']}, {p['observation_max']}"
        )
    if p["placeholder_tokens"] < 1:
        raise ValueError(f"placeholder_tokens: expected >= 1, got {p['placeholder_tokens']}")
    head = _head_tokens(p)
    if min(p["path_caps"]) <= head:
        raise ValueError(
            f"path_caps: every cap must exceed the longest prompt ({head} tokens), got {p['path_caps']!r}"
        )


def _head_tokens(p: dict[str, Any]) -> int:
    """Longest possible prompt (system + group prompt)."""
    return p["prompt_tokens"][1] + (p["system_tokens"][1] if p["num_systems"] > 0 else 0)


def _shrink(p: dict[str, Any], f: float) -> dict[str, Any]:
    """Tiny mode: turn lengths × f, prompts × f^1.5, counts × sqrt(f) (with minimums); path caps
    are set by :func:`_shrink_caps` once overrides are known."""
    q = dict(p)

    def sh(v: Any, lo: int, g: float) -> Any:
        if isinstance(v, tuple):
            return tuple(sh(x, lo, g) for x in v)
        # a minimum never raises a value configured below it (grpo_flat's one step stays one)
        return v if v == 0 else max(min(lo, v), round(v * g))

    for keys, g in ((_TINY_TURN, f), (_TINY_PATH, f**1.5), (_TINY_COUNT, math.sqrt(f))):
        for key, lo in keys.items():
            q[key] = sh(p[key], lo, g)
    return q


def _shrink_caps(caps: tuple[int, ...], p: dict[str, Any], f: float) -> tuple[int, ...]:
    """Tiny-mode path caps: ``caps`` × f^1.5, each above the longest head (prompt and first
    turns) of the final parameters ``p``, overrides included."""
    head = _head_tokens(p)
    return tuple(max(head + 8, round(c * f**1.5)) for c in caps)


def _resolve(
    name: str, defaults: dict[str, Any], scale: Any, seed: Any, overrides: dict[str, Any]
) -> dict[str, Any]:
    """Validate arguments and return the parameters of one run."""
    if finite_float(scale) is None or scale <= 0:
        raise ValueError(f"scale: expected a finite number > 0, got {scale!r}")
    if scale > MAX_SCALE:
        raise ValueError(
            f"scale: at most {MAX_SCALE} (≈ {MAX_SCALE}M semantic tokens, several GiB of token "
            f"ids), got {scale!r}"
        )
    scale = float(scale)
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(
            f"{unknown[0]}: unknown parameter of {name} (known: {', '.join(sorted(defaults))})"
        )
    factor = min(1.0, scale / TINY_SCALE)
    p = _shrink(defaults, factor) if factor < 1.0 else dict(defaults)
    for k, v in overrides.items():
        p[k] = tuple(v) if isinstance(v, list) else v
    if factor < 1.0 and "path_caps" not in overrides:
        p["path_caps"] = _shrink_caps(defaults["path_caps"], p, factor)
    _check_params(p)
    p.update(scale=scale, seed=int(seed), length_factor=factor)
    return p


# ---------------------------------------------------------------------------- growth


def _ranged(rng: np.random.Generator, lo: int, hi: int) -> int:
    """Clipped lognormal with median sqrt(lo·hi) and lo / hi at ±2σ."""
    if hi <= lo:
        return lo
    v = math.exp(rng.normal(0.5 * math.log(lo * hi), math.log(hi / lo) / 4.0))
    return int(min(hi, max(lo, round(v))))


class _Builder:
    """Turn records (struct of lists) plus running S and C; tokens come at the end."""

    def __init__(self, p: dict[str, Any], rng: np.random.Generator) -> None:
        self.p = p
        self.rng = rng
        self.parent: list[int] = []
        self.kind: list[int] = []
        self.length: list[int] = []
        self.think: list[int] = []  # thinking tokens at the start of an assistant turn
        self.src: list[int] = []  # -1 fresh tokens, -2 placeholder, else the turn it copies
        self.src_offset: list[int] = []
        self.end: list[bool] = []
        self.group: list[int] = []
        self.step: list[int] = []  # steps done on the path up to and including the turn
        self.rewrites: list[int] = []  # rewrites on the path up to the turn
        self.last_rewrite: list[int] = []  # step of the last rewrite on the path
        self.semantic = 0  # S of the trajectories ended so far
        self.compact = 0  # C: the trie is the turn tree
        self.stats = dict.fromkeys(
            (
                "groups",
                "samples",
                "fork_events",
                "fork_branches",
                "prefix_ends",
                "rewrites",
                "capped",
            ),
            0,
        )
        self.obs_mu = math.log(p["observation_median"])
        self.obs_sigma = math.log(p["observation_p95"] / p["observation_median"]) / _Z95

    def add(
        self,
        parent: int,
        kind: int,
        length: int,
        group: int,
        *,
        think: int = 0,
        src: int = -1,
        offset: int = 0,
    ) -> int:
        self.parent.append(parent)
        self.kind.append(kind)
        self.length.append(length)
        self.think.append(think)
        self.src.append(src)
        self.src_offset.append(offset)
        self.end.append(False)
        self.group.append(group)
        self.step.append(0)
        self.rewrites.append(0)
        self.last_rewrite.append(-(10**9))
        self.compact += length
        return len(self.parent) - 1

    def mark_end(self, t: int, path_len: int) -> None:
        """Make turn ``t`` (whose path has ``path_len`` tokens) a trajectory end, once."""
        if not self.end[t]:
            self.end[t] = True
            self.semantic += path_len

    def assistant_turn(self) -> tuple[int, int]:
        """(length, thinking tokens at its start)."""
        p, rng = self.p, self.rng
        n = _ranged(rng, *p["assistant_tokens"])
        if p["thinking_prob"] > 0 and rng.random() < p["thinking_prob"]:
            think = _ranged(rng, *p["thinking_tokens"])
            return n + think, think
        return n, 0

    def env_turn(self) -> tuple[int, int]:
        """(kind, length) of a user message or a tool observation."""
        p, rng = self.p, self.rng
        if p["user_prob"] > 0 and rng.random() < p["user_prob"]:
            return _USER, _ranged(rng, *p["user_tokens"])
        # clipped in log space: a huge observation_max must not overflow exp()
        log_v = min(rng.normal(self.obs_mu, self.obs_sigma), math.log(p["observation_max"]))
        return _OBSERVATION, int(min(p["observation_max"], max(1, round(math.exp(log_v)))))


@dataclass
class _Branch:
    path: list[int]  # turn indices from the root
    cum: list[int]  # cum[j]: tokens of the path up to and including path[j]
    step: int  # steps done
    target: int  # steps of this episode
    rewrites: int = 0
    last_rewrite: int = -(10**9)


def _run_branch(b: _Builder, br: _Branch, cap: int, group: int, protect: int) -> None:
    """Grow ``br`` step by step until its episode ends or its path reaches ``cap``."""
    p, rng = b.p, b.rng

    def emit(kind: int, length: int, think: int = 0) -> bool:
        """Append a turn, truncated to the cap; False once the path is at the cap."""
        room = cap - br.cum[-1]
        if length >= room:
            length = room
            think = min(think, length)
        t = b.add(br.path[-1], kind, length, group, think=think)
        b.step[t] = br.step + (kind == _ASSISTANT)
        b.rewrites[t] = br.rewrites
        b.last_rewrite[t] = br.last_rewrite
        br.path.append(t)
        br.cum.append(br.cum[-1] + length)
        return br.cum[-1] < cap

    while True:
        length, think = b.assistant_turn()
        if not emit(_ASSISTANT, length, think):
            break
        br.step += 1
        if br.step >= br.target:
            break
        if not emit(*b.env_turn()):
            break
        if (
            br.rewrites < p["max_rewrites"]
            and br.step - br.last_rewrite >= p["keep_tail"]
            and (
                (p["rewrite_at"] > 0 and br.cum[-1] >= p["rewrite_at"] * cap)
                or (p["rewrite_prob"] > 0 and rng.random() < p["rewrite_prob"])
            )
        ):
            _rewrite(b, br, protect, group)
    b.stats["capped"] += br.cum[-1] == cap
    b.mark_end(br.path[-1], br.cum[-1])


def _rewrite(b: _Builder, br: _Branch, protect: int, group: int) -> None:
    """Mask old observations and drop old thinking on ``br``'s history. If anything changes, the
    old history ends as a trajectory and ``br`` moves to a new sibling chain that starts at the
    first changed turn (unchanged turns after it are copied)."""
    p = b.p
    ph = p["placeholder_tokens"]
    n = len(br.path)
    stop = n - p["keep_tail"]

    def masks(t: int) -> bool:
        return b.kind[t] == _OBSERVATION and b.length[t] > ph

    def drops_thinking(t: int) -> bool:
        return b.kind[t] == _ASSISTANT and 0 < b.think[t] < b.length[t]

    first = next(
        (j for j in range(protect, stop) if masks(br.path[j]) or drops_thinking(br.path[j])), -1
    )
    if first < 0:
        return
    b.mark_end(br.path[-1], br.cum[-1])
    b.stats["rewrites"] += 1
    br.rewrites += 1
    br.last_rewrite = br.step
    path = br.path[:first]
    cum = br.cum[:first]
    for j in range(first, n):
        t = br.path[j]
        k = b.kind[t]
        if j < stop and masks(t):
            nt = b.add(path[-1], _PLACEHOLDER, ph, group, src=-2)
        elif j < stop and drops_thinking(t):
            nt = b.add(path[-1], k, b.length[t] - b.think[t], group, src=t, offset=b.think[t])
        else:
            nt = b.add(path[-1], k, b.length[t], group, think=b.think[t], src=t)
        b.step[nt] = b.step[t]
        b.rewrites[nt] = br.rewrites
        b.last_rewrite[nt] = br.last_rewrite
        path.append(nt)
        cum.append(cum[-1] + b.length[nt])
    br.path = path
    br.cum = cum


def _fork_node(b: _Builder, br: _Branch, depth: float, cap: int) -> int:
    """Index on ``br.path`` of the last fork-eligible turn (an environment turn from step
    ``fork_min_step`` on, below the cap) at or before ``depth`` tokens; else the earliest
    eligible one; -1 if there is none."""
    min_step = b.p["fork_min_step"]
    found = -1
    for j in range(len(br.path) - 1, -1, -1):
        t = br.path[j]
        if b.kind[t] in _ENV_KINDS and b.step[t] >= min_step and br.cum[j] < cap:
            found = j
            if br.cum[j] <= depth:
                break
    return found


def _grow_group(b: _Builder, parent: int, group: int, cap: int, head: list[int]) -> None:
    """One group below ``parent`` (-1: a root): prompt turn, samples, then fork events."""
    p, rng = b.p, b.rng
    prompt = b.add(
        parent, _PROMPT, int(rng.integers(p["prompt_tokens"][0], p["prompt_tokens"][1] + 1)), group
    )
    path0 = [*head, prompt]
    cum0 = np.cumsum([b.length[t] for t in path0]).tolist()
    protect = len(path0) + p["keep_head"]
    n = int(rng.integers(p["group_size"][0], p["group_size"][1] + 1))
    samples: list[list[_Branch]] = []
    for _ in range(n):
        main = _Branch(list(path0), list(cum0), 0, _ranged(rng, *p["steps"]))
        _run_branch(b, main, cap, group, protect)
        samples.append([main])
    b.stats["groups"] += 1
    b.stats["samples"] += n

    target = p["target_compression"]
    budget = [p["max_forks"]] * n
    phase = rng.random()
    event = 0
    while any(budget) and not (target > 0 and b.semantic >= target * b.compact):
        s = event % n
        event += 1
        if budget[s] == 0:
            continue
        size = min(int(rng.integers(p["fork_k"][0], p["fork_k"][1] + 1)) - 1, budget[s])
        budget[s] -= size
        tail = 2.0 * p["fork_tail"] * ((phase + event * _GOLDEN) % 1.0)
        branches = samples[s]
        par = branches[int(rng.integers(len(branches)))]
        j = _fork_node(b, par, par.cum[-1] * (1.0 - tail), cap)
        if j < 0:
            continue
        node = par.path[j]
        b.stats["fork_events"] += 1
        b.stats["fork_branches"] += size
        if p["prefix_end_prob"] > 0 and rng.random() < p["prefix_end_prob"] and not b.end[node]:
            b.mark_end(node, par.cum[j])
            b.stats["prefix_ends"] += 1
        step = b.step[node]
        remaining = max(1, par.target - step)
        for _ in range(size):
            own = max(1, round(remaining * math.exp(rng.normal(0.0, 0.3))))
            child = _Branch(
                par.path[: j + 1],
                par.cum[: j + 1],
                step,
                min(p["steps"][1], step + own),
                b.rewrites[node],
                b.last_rewrite[node],
            )
            _run_branch(b, child, cap, group, protect)
            branches.append(child)


def _generate(name: str, p: dict[str, Any]) -> Workload:
    rng = np.random.default_rng(p["seed"])
    b = _Builder(p, rng)
    systems: list[int] = []
    group = 0
    while b.semantic < p["scale"] * TOKENS_PER_SCALE:
        head: list[int] = []
        parent = -1
        if p["num_systems"] > 0:
            d = group % p["num_systems"]
            if d == len(systems):
                lo, hi = p["system_tokens"]
                systems.append(b.add(-1, _SYSTEM, int(rng.integers(lo, hi + 1)), group))
            head = [systems[d]]
            parent = systems[d]
        _grow_group(b, parent, group, int(p["path_caps"][group % len(p["path_caps"])]), head)
        group += 1
    return _materialize(name, b, p, rng)


def _materialize(name: str, b: _Builder, p: dict[str, Any], rng: np.random.Generator) -> Workload:
    """Draw all fresh tokens at once, copy rewritten turns, make siblings differ in their first
    token, and assemble trajectories in the order of their end turns."""
    n = len(b.parent)
    vocab = p["vocab_size"]
    lengths = np.asarray(b.length, dtype=np.int64)
    fresh_len = np.where(np.asarray(b.src, dtype=np.int64) == -1, lengths, 0)
    offsets = (np.cumsum(fresh_len) - fresh_len).tolist()
    pool = rng.integers(0, vocab, size=int(fresh_len.sum()), dtype=np.int64)
    placeholder = rng.integers(0, vocab, size=p["placeholder_tokens"], dtype=np.int64)
    tokens: list[np.ndarray] = []
    first_tokens: dict[int, set[int]] = {}
    for t in range(n):
        s = b.src[t]
        if s == -1:
            arr = pool[offsets[t] : offsets[t] + b.length[t]]
        elif s == -2:
            arr = placeholder[: b.length[t]].copy()
        else:
            o = b.src_offset[t]
            arr = tokens[s][o : o + b.length[t]].copy()
        used = first_tokens.setdefault(b.parent[t], set())
        if int(arr[0]) in used:
            if len(used) >= vocab:
                raise ValueError(
                    f"vocab_size: {vocab} ids cannot give {len(used) + 1} sibling turns distinct first tokens"
                )
            arr = arr.copy()
            while int(arr[0]) in used:
                arr[0] = rng.integers(0, vocab)
        used.add(int(arr[0]))
        tokens.append(arr)

    parent = np.asarray(b.parent, dtype=np.int64)
    has_child = np.zeros(n, dtype=bool)
    has_child[parent[parent >= 0]] = True
    ends = np.flatnonzero(np.asarray(b.end, dtype=bool) | ~has_child)
    sequences: list[np.ndarray] = []
    for e in ends.tolist():
        chain = []
        t = e
        while t >= 0:
            chain.append(tokens[t])
            t = b.parent[t]
        sequences.append(np.concatenate(chain[::-1]))
    group_ids = np.asarray(b.group, dtype=np.int64)[ends]
    turns = [
        Turn(t, None if b.parent[t] < 0 else b.parent[t], tokens[t], b.end[t]) for t in range(n)
    ]
    return Workload(name, sequences, group_ids, turns, p, dict(b.stats))


# ---------------------------------------------------------------------------- generators


def swe_like(scale: float = 1.0, seed: int = 0, **overrides: Any) -> Workload:
    """SWE-bench-like agent trees; S / C ≈ 5.6.

    Defaults: issue prompt 3–6K tokens (no shared system turn), 4–8 samples per issue, 12–200
    steps (median ≈ 49), assistant 50–800 tokens, observations lognormal (median 300, p95 4K,
    max 16K), path caps 32K / 64K / 128K dealt round-robin over groups, one context-management
    rewrite at 75 % of the cap (observations masked by a 12-token placeholder outside the first 2
    and last 6 turns), forks into 2–3 continuations from step 3 on with tails ≈ 3 % of the path
    (≤ 24 new branches per sample), 10 % of forks also emit the prefix trajectory, and fork
    events until S / C ≥ 5.6. Any key of the module docstring can be overridden.
    """
    return _generate("swe_like", _resolve("swe_like", _SWE, scale, seed, overrides))


def tau_like(scale: float = 1.0, seed: int = 0, **overrides: Any) -> Workload:
    """τ-bench-like conversation trees; S / C ≈ 9.4.

    Defaults: 3 domains, each a 4.6–5.0K-token system prompt shared by all its tasks; task
    prompt 100–400 tokens; 6–12 samples per task; 4–40 steps (median ≈ 13); assistant 30–400
    tokens with a 100–800-token thinking block 30 % of the time; environment turns are user
    messages (40 %, 15–150 tokens) or tool outputs (median 150, p95 1.2K, max 4K); 32K cap; with
    probability 2 % per step one thinking-drop / observation-mask rewrite; forks into 2–4
    continuations with tails ≈ 3 % (≤ 32 new branches per sample), 10 % of forks also emit the
    prefix trajectory, fork events until S / C ≥ 9.4.
    """
    return _generate("tau_like", _resolve("tau_like", _TAU, scale, seed, overrides))


def grpo_flat(scale: float = 1.0, seed: int = 0, **overrides: Any) -> Workload:
    """Flat GRPO: one level, a 200–2000-token prompt → 8 independent single-turn responses of
    200–4000 tokens (no forks, no rewrites); S / C ≈ 1.7."""
    return _generate("grpo_flat", _resolve("grpo_flat", _FLAT, scale, seed, overrides))


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "swe_like": swe_like,
    "tau_like": tau_like,
    "grpo_flat": grpo_flat,
}
