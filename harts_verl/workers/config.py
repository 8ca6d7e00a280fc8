"""Actor and critic configs with a ``harts:`` section (``actor_rollout_ref.actor._target_``,
``critic._target_``).

Enable HARTS in a veRL PPO config::

    actor_rollout_ref.actor.strategy=harts_fsdp2
    +actor_rollout_ref.actor.harts.chunk_size=64     # optional: any key of HartsConfig
    critic.strategy=harts_fsdp2                      # optional: the critic too (PPO with GAE)

(``python -m harts_verl.main_ppo`` selects these classes for that strategy; with veRL's own
entry point add ``actor_rollout_ref.actor._target_=harts_verl.workers.config.
HartsFSDPActorConfig`` / ``critic._target_=harts_verl.workers.config.HartsFSDPCriticConfig``
to pass ``harts.*`` options.)

veRL's ``FSDP{Actor,Critic}Config.__post_init__`` copies ``strategy`` into the engine config; we
attach the validated :class:`HartsConfig` to the same engine config object (attribute
``harts``), which is how the engine receives it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl.base_config import BaseConfig  # loads our plugin (-> engine) if verl was not loaded
from verl.workers.config import FSDPActorConfig, FSDPCriticConfig

from harts_verl.ops.layout import check_chunk_size
from harts_verl.tree.microbatch import planner_options, validate_options
from harts_verl.workers import STRATEGY

logger = logging.getLogger(__name__)

__all__ = [
    "STRATEGY",
    "HartsConfig",
    "HartsFSDPActorConfig",
    "HartsFSDPCriticConfig",
    "harts_config_of",
]

# what harts.planner may set: the planner's own options and its seed; the engine decides
# allow_oversize itself (an oversize trajectory runs alone, never an error mid-training)
_PLANNER_KEYS = frozenset(planner_options()) - {"allow_oversize"} | {"seed"}


@dataclass
class HartsConfig(BaseConfig):
    """The ``harts:`` section.

    Attributes:
      enable: run the compact tree forward/backward (False: the stock fsdp2 path).
      chunk_size: linear-attention chunk size B (members start on multiples of B).
      capacity_tokens: compact rows per micro-batch; None = the batch's
        ``max_token_len_per_gpu`` (train: ``ppo_max_token_len_per_gpu``), or with
        ``use_dynamic_bsz`` false ``micro_batch_size_per_gpu`` × the batch's longest trajectory.
      min_compression: when the batch's realized compression over all DP ranks, Σ S / Σ C
        (each rank's C the compact rows its planned micro-batches run: a tree split into
        several pays its shared rows in each), is below this, the batch runs the stock path
        (metric ``harts/fallback`` = 1).
      audit_every: every N training calls of the engine (actor / critic updates: the calls
        whose metrics veRL's trainer logs, as ``actor/harts/audit`` / ``critic/harts/audit``),
        recompute the log-probs (the critic: values) of a sample of trajectories with the stock
        (expanded) path and report ``harts/audit`` (max abs difference; 0 = never).
      audit_trajectories: how many trajectories the audit samples.
      rows_per_chunk: rows per chunk of the compact log-prob/entropy kernel (memory bound).
      attention_key_rows: bound on the key rows a full-attention layer keeps for backward
        (each segment's whole root path: ``Σ Lk`` rows, which ``capacity_tokens`` does not
        bound; ≈ 9 × the compact rows on tau-like trees). Above it none are kept: the keys are
        gathered again in backward, in groups of at most this many rows (consecutive sequences
        for varlen kernels, member chunks of each bucket for SDPA; a segment whose own path is
        longer is a group alone), at the cost of one more attention forward. None = no bound
        (default).
      planner: options passed to ``plan_microbatches`` (``strategies``, ``improve``,
        ``balance``, ``work_slack``, ``restarts``, ``effort``, ``seed``, ``max_layers_work``,
        ``max_search_cells``).
      split_dependent_losses: where a loss that depends on the micro-batching (e.g. the
        ``geo_mean`` / ``clip_cov`` / ``kl_cov`` policy losses) is evaluated: ``stock`` (on
        veRL's own micro-batches, the stock engine's numbers; the tree micro-batches run one
        more forward without graph) or ``tree`` (on the tree micro-batches; a WARNING).
      stock_metrics: for every other loss, evaluate it once more, without autograd, on
        veRL's own micro-batches over the outputs the tree micro-batches computed, and report
        those losses and metrics: metrics that veRL averages per micro-batch
        (``actor/pg_clipfrac``, ``rollout_corr/*``, ``critic/vf_clipfrac``, …) are then the
        stock engine's (no extra forward; under Ulysses SP too). False reports the tree
        micro-batches' means.
    """

    enable: bool = True
    chunk_size: int = 64
    capacity_tokens: int | None = None
    min_compression: float = 1.0
    audit_every: int = 0
    audit_trajectories: int = 4
    rows_per_chunk: int = 4096
    attention_key_rows: int | None = None
    planner: dict[str, Any] = field(default_factory=dict)
    split_dependent_losses: str = "stock"
    stock_metrics: bool = True

    def __post_init__(self) -> None:
        def positive_int(
            name: str, value: Any, *, allow_zero: bool = False, most: int = 2**63 - 1
        ) -> None:
            ok = isinstance(value, int) and not isinstance(value, bool)
            if not ok or not (0 if allow_zero else 1) <= value <= most:
                what = "a non-negative int" if allow_zero else "a positive int"
                raise ValueError(f"harts.{name}: expected {what} <= {most}, got {value!r}")

        if not isinstance(self.enable, bool):
            raise ValueError(f"harts.enable: expected a bool, got {self.enable!r}")
        check_chunk_size(self.chunk_size, "harts.chunk_size")
        if self.capacity_tokens is not None:
            positive_int("capacity_tokens", self.capacity_tokens)
        positive_int("audit_every", self.audit_every, allow_zero=True)
        positive_int("audit_trajectories", self.audit_trajectories)
        positive_int("rows_per_chunk", self.rows_per_chunk, most=2**31)
        if self.attention_key_rows is not None:
            positive_int("attention_key_rows", self.attention_key_rows)
        mc = self.min_compression
        if isinstance(mc, bool) or not isinstance(mc, int | float) or not mc >= 0:
            raise ValueError(f"harts.min_compression: expected a number >= 0, got {mc!r}")
        if not isinstance(self.stock_metrics, bool):
            raise ValueError(f"harts.stock_metrics: expected a bool, got {self.stock_metrics!r}")
        if self.split_dependent_losses not in ("stock", "tree"):
            raise ValueError(
                "harts.split_dependent_losses: expected 'stock' or 'tree', got "
                f"{self.split_dependent_losses!r}"
            )
        if not isinstance(self.planner, Mapping):
            raise ValueError(
                f"harts.planner: expected a mapping, got {type(self.planner).__name__}"
            )
        for key in self.planner:
            if key not in _PLANNER_KEYS:
                raise ValueError(
                    f"harts.planner.{key}: unknown planner option (known: {sorted(_PLANNER_KEYS)})"
                )
        options = {str(k): v for k, v in self.planner.items()}
        seed = options.pop("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"harts.planner.seed: expected an int >= 0, got {seed!r}")
        try:
            validate_options(options)
        except (TypeError, ValueError) as exc:  # the planner names the option
            raise ValueError(f"harts.planner.{exc}") from None

    @classmethod
    def from_any(cls, value: Any) -> HartsConfig:
        """Build from a HartsConfig, a mapping (hydra/omegaconf) or None; unknown keys raise
        ValueError naming ``harts.<key>``."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"harts: expected a mapping, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        items = {str(k): v for k, v in value.items() if k != "_target_"}
        for key in items:
            if key not in known:
                raise ValueError(
                    f"harts.{key}: unknown key (known: {sorted(known - {'_target_'})})"
                )
        if isinstance(items.get("planner"), Mapping):
            items["planner"] = dict(items["planner"])
        elif items.get("planner", {}) is None:
            items["planner"] = {}
        return cls(**items)


def _attach_harts(cfg: Any, parent_post_init: Any) -> None:
    """Validate ``cfg.harts`` (:meth:`HartsConfig.from_any`), run veRL's ``__post_init__``
    (which copies ``strategy`` into the engine config), then attach the section to that engine
    config as ``harts``."""
    raw = cfg.harts
    object.__setattr__(cfg, "harts", HartsConfig.from_any(raw))
    # the keys the user set (a default-valued one too: `harts.enable=true` beside another
    # strategy does not turn HARTS on), else those that differ from the defaults
    given = (
        [str(k) for k in raw.keys() if k != "_target_"]
        if isinstance(raw, Mapping) and not isinstance(raw, HartsConfig)
        else [
            f.name
            for f in dataclasses.fields(HartsConfig)
            if getattr(cfg.harts, f.name) != getattr(HartsConfig(), f.name)
        ]
    )
    if cfg.strategy != STRATEGY and given:
        # the reference policy is an actor's concern (it takes the actor's section)
        ref = (
            ""
            if isinstance(cfg, FSDPCriticConfig)
            else f" (a reference policy on {STRATEGY} takes the actor's with harts_verl.main_ppo)"
        )
        logger.warning(
            "%s: strategy is %r, so its harts: settings (%s) are not used here%s; set "
            "strategy=%s to train over rollout trees",
            type(cfg).__name__,
            cfg.strategy,
            ", ".join(f"harts.{name}" for name in given),
            ref,
            STRATEGY,
        )
    parent_post_init()
    object.__setattr__(cfg.engine, "harts", cfg.harts)


@dataclass
class HartsFSDPActorConfig(FSDPActorConfig):
    """``FSDPActorConfig`` plus the ``harts:`` section; ``strategy`` defaults to
    ``harts_fsdp2``. The validated section is attached to the engine config as ``harts``."""

    strategy: str = STRATEGY
    harts: Any = field(default_factory=HartsConfig)

    def __post_init__(self) -> None:
        _attach_harts(self, super().__post_init__)


@dataclass
class HartsFSDPCriticConfig(FSDPCriticConfig):
    """``FSDPCriticConfig`` plus the ``harts:`` section (``critic.strategy=harts_fsdp2``: the
    critic's value-head engine runs tree micro-batches); ``strategy`` defaults to
    ``harts_fsdp2``. The validated section is attached to the engine config as ``harts``."""

    strategy: str = STRATEGY
    harts: Any = field(default_factory=HartsConfig)

    def __post_init__(self) -> None:
        _attach_harts(self, super().__post_init__)


def harts_config_of(engine_config: Any) -> HartsConfig:
    """The ``harts`` section attached to an engine config (defaults when absent, e.g. for a
    reference policy whose config class is veRL's own: with veRL's entry point;
    ``harts_verl.main_ppo`` gives it the actor's section)."""
    return HartsConfig.from_any(getattr(engine_config, "harts", None))
