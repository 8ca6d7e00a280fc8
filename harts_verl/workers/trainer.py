"""Tree-aware DP for veRL's V1 trainers: a subclass of the chosen trainer + TaskRunner + ``main``.

``python -m harts_verl.main_ppo <hydra overrides>`` runs veRL's PPO entry point with three
changes, all active only when ``actor_rollout_ref.actor.strategy=harts_fsdp2`` or a trained
critic has ``critic.strategy=harts_fsdp2``:

* the actor config class becomes ``HartsFSDPActorConfig`` (:func:`apply_harts_actor_config`),
  so the strategy is the one flag that enables HARTS and ``+actor_rollout_ref.actor.harts.*``
  options are accepted; likewise ``HartsFSDPCriticConfig`` for ``critic.strategy=harts_fsdp2``
  (:func:`apply_harts_critic_config`, the critic's value-head engine in tree mode), and a
  reference policy that runs the tree engine gets the actor's ``harts:`` values, overridable by
  ``+actor_rollout_ref.ref.harts.*`` (:func:`apply_harts_ref_config`);
* ``_balance_batch`` reorders the batch with :func:`~harts_verl.workers.balance.
  tree_balanced_partition` (trees stay on one DP rank and in one mini-batch, compact work
  balanced per mini-batch and per rank; veRL's dispatcher then hands each rank one consecutive
  equal chunk, which the worker cuts into consecutive mini-batches; the cells follow the
  mini-batches of every section that runs trees, :func:`num_mini_batches_of`), instead of
  veRL's sequence-length Karmarkar-Karp (its upsampler's padding samples, tagged
  ``is_padding``, placed one by one: :func:`padding_of`); metrics ``harts/dp_max_work``,
  ``harts/dp_min_work``, ``harts/dp_minibatch_imbalance``, ``harts/dp_compression``,
  ``harts/dp_padding_samples``, ``harts/dp_padding_only_cells``. The engine then makes the number
  of micro-batches equal on every rank (:mod:`harts_verl.workers.engine`);
* the trainer class is chosen by our TaskRunner: veRL's class for ``trainer.v1.trainer_mode``
  (``sync``, ``colocate_async``, ``separate_async``) with that ``_balance_batch``
  (:func:`trainer_class`); the mode itself is unchanged (veRL compares it to its literals).

veRL's V1 trainer imports ``transfer_queue`` (extra ``verl[verl-core]``) at module level, so
the trainer class is built lazily (:func:`trainer_class`); the balancing step
(:func:`harts_balance_batch`) is a plain function, testable without a cluster.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import verl  # noqa: F401  # first: verl loads our plugin (engine -> config) before config below

from harts_verl.workers.balance import padding_only_cells, tree_balanced_cells
from harts_verl.workers.config import STRATEGY
from harts_verl.workers.positions import token_sequences
from harts_verl.workers.rollout.fork import check_fork_manager

__all__ = [
    "apply_harts_actor_config",
    "apply_harts_critic_config",
    "apply_harts_ref_config",
    "check_ref_harts",
    "harts_balance_batch",
    "is_harts_config",
    "main",
    "num_mini_batches_of",
    "task_runner_class",
    "trainer_class",
]


def _runs_trees(section: Any) -> bool:
    """True when a worker section (the actor's, the critic's) has the ``harts_fsdp2`` strategy
    and does not turn the tree path off (``harts.enable: false`` is the stock fsdp2 path,
    balancing included)."""
    if section is None or not hasattr(section, "get") or section.get("strategy") != STRATEGY:
        return False
    harts = section.get("harts")
    return not (hasattr(harts, "get") and harts.get("enable", True) is False)


def _critic_runs_trees(config: Any) -> bool:
    """True when the PPO config trains a critic (veRL's ``need_critic``) that runs trees
    (:func:`_runs_trees`)."""
    critic = config.get("critic") if hasattr(config, "get") else None
    if not _runs_trees(critic):
        return False
    enable = critic.get("enable")
    if enable is not None:
        return bool(enable)
    try:  # veRL's rule: a critic when the advantage estimator is GAE (a str or its enum)
        adv = config.algorithm.adv_estimator
    except AttributeError:
        return False
    return getattr(adv, "value", adv) == "gae"


def is_harts_config(config: Any) -> bool:
    """True when the PPO config runs trees (the ``harts_fsdp2`` strategy without
    ``harts.enable: false``) in the actor, or in a critic it trains (a PPO run whose critic
    alone runs trees): the trainer then keeps trees on one DP rank and balances compact work.
    False otherwise: veRL's own balancing, as with the stock strategy."""
    try:
        if _runs_trees(config.actor_rollout_ref.actor):
            return True
    except AttributeError:
        pass
    return _critic_runs_trees(config)


_VERL_FSDP_ACTOR = "verl.workers.config.FSDPActorConfig"
_HARTS_ACTOR = "harts_verl.workers.config.HartsFSDPActorConfig"
_VERL_FSDP_CRITIC = "verl.workers.config.FSDPCriticConfig"
_HARTS_CRITIC = "harts_verl.workers.config.HartsFSDPCriticConfig"


def _check_fsdp_class(target: Any, fsdp: str, section: str) -> None:
    """ValueError naming ``section`` when ``strategy=harts_fsdp2`` sits in a config whose class
    (``_target_``) is not veRL's FSDP one (or a subclass): with Megatron's class veRL builds its
    Megatron engine by the engine config's own strategy, and HARTS would silently be off."""
    if target is None or target == fsdp:
        return
    from hydra.utils import get_class

    try:
        ok = issubclass(get_class(str(target)), get_class(fsdp))
    except Exception:  # an unimportable class: veRL names it itself
        return
    if not ok:
        raise ValueError(
            f"{section}.strategy={STRATEGY} needs veRL's FSDP engine (model_engine=dp, the "
            f"ppo_trainer config), but the section's config class is {target} (e.g. Megatron's): "
            "HARTS would not run; use the FSDP trainer config or another strategy"
        )


def _has_harts_field(target: Any) -> bool:
    """Whether the config class ``target`` (a ``_target_`` string) takes a ``harts`` field
    (True when it cannot be imported: veRL names that itself)."""
    import dataclasses

    from hydra.utils import get_class

    try:
        cls = get_class(str(target))
    except Exception:
        return True
    if not dataclasses.is_dataclass(cls):
        return True
    return "harts" in {f.name for f in dataclasses.fields(cls)}


def _select_harts_class(section: Any, verl_cls: str, harts_cls: str, name: str) -> bool:
    """Set ``section._target_`` from veRL's FSDP config class ``verl_cls`` to ``harts_cls``
    when the section's strategy is ``harts_fsdp2`` or it has ``harts:`` options (after
    :func:`_check_fsdp_class` for the strategy); any other class is left alone. Returns
    whether the section was changed."""
    from omegaconf import open_dict

    harts_strategy = section.get("strategy") == STRATEGY
    if not harts_strategy and "harts" not in section:
        return False
    if harts_strategy:
        _check_fsdp_class(section.get("_target_"), verl_cls, name)
    elif section.get("_target_") != verl_cls and not _has_harts_field(section.get("_target_")):
        # another engine's class (Megatron's) would fail on the unknown key without naming
        # the strategy: the options are not used there, as beside another FSDP strategy
        logging.getLogger(__name__).warning(
            "%s: strategy is %r with config class %s, so its harts: settings are not used "
            "(dropped); set strategy=%s on veRL's FSDP config to train over rollout trees",
            name,
            section.get("strategy"),
            section.get("_target_"),
            STRATEGY,
        )
        with open_dict(section):
            del section["harts"]
        return True
    if section.get("_target_") != verl_cls:
        return False
    with open_dict(section):
        section["_target_"] = harts_cls
    return True


def apply_harts_actor_config(config: Any) -> bool:
    """With ``actor.strategy=harts_fsdp2`` and veRL's default actor config class, select
    :class:`~harts_verl.workers.config.HartsFSDPActorConfig` (``actor._target_``) so that the
    ``harts:`` options (``+actor_rollout_ref.actor.harts.*``) are accepted and validated: the
    strategy is then the one flag that enables HARTS. So also with another strategy whose
    section has ``harts:`` options: the class then says in a WARNING that they are not used
    (veRL's class would fail on the unknown key without naming the strategy). An explicitly
    chosen other class is left alone. Returns whether the config was changed."""
    try:
        actor = config.actor_rollout_ref.actor
    except AttributeError:
        return False
    return _select_harts_class(actor, _VERL_FSDP_ACTOR, _HARTS_ACTOR, "actor_rollout_ref.actor")


def apply_harts_critic_config(config: Any) -> bool:
    """With ``critic.strategy=harts_fsdp2`` and veRL's default critic config class, select
    :class:`~harts_verl.workers.config.HartsFSDPCriticConfig` (``critic._target_``), so that
    ``+critic.harts.*`` options are accepted and validated; so also with another strategy and
    ``harts:`` options (a WARNING that they are not used, as for the actor). Returns whether
    the config was changed."""
    critic = config.get("critic") if hasattr(config, "get") else None
    if critic is None:
        return False
    return _select_harts_class(critic, _VERL_FSDP_CRITIC, _HARTS_CRITIC, "critic")


def apply_harts_ref_config(config: Any) -> bool:
    """With ``actor_rollout_ref.ref.strategy=harts_fsdp2`` (veRL's default: the actor's
    strategy) and veRL's default config class, select
    :class:`~harts_verl.workers.config.HartsFSDPActorConfig` for the reference policy and give
    it the actor's ``harts:`` section, with ``+actor_rollout_ref.ref.harts.*`` keys taking
    precedence (the planner's options merged key by key): the reference's log-probs then run
    with the settings the actor's own log-probs run with (``enable``, ``chunk_size``,
    ``min_compression``, ``capacity_tokens``, ...). ``harts:`` options on a reference with
    another strategy select the class too (a WARNING says they are not used); an explicitly
    chosen other class is left alone, as are its options. Returns whether the config was
    changed. ``ValueError`` naming ``actor_rollout_ref.actor.harts.<key>`` or
    ``actor_rollout_ref.ref.harts.<key>`` for a bad value in the section that holds it."""
    from omegaconf import OmegaConf, open_dict

    try:
        rollout_ref = config.actor_rollout_ref
        ref = rollout_ref.get("ref")
    except AttributeError:
        return False
    if ref is None:
        return False
    changed = _select_harts_class(ref, _VERL_FSDP_ACTOR, _HARTS_ACTOR, "actor_rollout_ref.ref")
    if ref.get("strategy") != STRATEGY or ref.get("_target_") != _HARTS_ACTOR:
        return changed
    actor = rollout_ref.get("actor")
    inherited = actor.get("harts") if actor is not None else None
    if inherited is None:
        return changed

    def plain(node: Any) -> Any:
        if node is None:
            return {}
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

    base, own = plain(inherited), plain(ref.get("harts"))
    if not isinstance(base, dict) or not isinstance(own, dict):
        return changed  # not a mapping: HartsConfig names the section when it is built
    from harts_verl.workers.config import HartsConfig

    for name, section in (("actor_rollout_ref.actor", base), ("actor_rollout_ref.ref", own)):
        # each section named by its own key before they merge (a bad actor value was
        # reported under the reference's key, which the user never set; a planner that is no
        # mapping made OmegaConf's merge fail)
        try:
            HartsConfig.from_any(section)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}.{exc}") from None
    merged = OmegaConf.to_container(OmegaConf.merge(base, own), resolve=True)
    if own == merged:
        return changed
    with open_dict(ref):
        ref["harts"] = merged
    return True


def check_ref_harts(config: Any) -> None:
    """Validate the reference policy's ``harts:`` section at startup (veRL's
    ``validate_config`` builds the actor's and the critic's config classes, not the
    reference's, which would otherwise fail only when its worker builds it): ValueError naming
    ``actor_rollout_ref.ref.harts.<key>``."""
    from omegaconf import OmegaConf

    from harts_verl.workers.config import HartsConfig

    try:
        section = config.actor_rollout_ref.get("ref")
    except AttributeError:
        return
    harts = section.get("harts") if section is not None else None
    if harts is None:
        return
    value = OmegaConf.to_container(harts, resolve=True) if OmegaConf.is_config(harts) else harts
    try:
        HartsConfig.from_any(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"actor_rollout_ref.ref.{exc}") from None


def harts_balance_batch(
    sequences: list[Any],
    dp_size: int,
    num_mini_batches: int = 1,
    padding: list[bool] | None = None,
) -> tuple[list[int], dict[str, float]]:
    """The batch order for ``dp_size`` ranks (concatenated equal parts, each the concatenation of
    ``num_mini_batches`` equal mini-batches) and its metrics: ``harts/dp_max_work`` /
    ``harts/dp_min_work`` (a rank's compact work summed over its mini-batches),
    ``harts/dp_minibatch_imbalance`` (the largest ``(max − mean) / max`` of the ranks' work
    within one mini-batch), ``harts/dp_compression`` (semantic tokens ÷ Σ cell work).
    ``padding``: which sequences are veRL's padding samples (see
    :func:`~harts_verl.workers.balance.tree_balanced_partition`; they count in the works and
    the compression, and ``harts/dp_padding_samples`` counts them; ``harts/dp_padding_only_cells``
    counts the cells, a rank's mini-batch each, that hold padding only: no loss token there, so
    veRL's DP mean of per-rank metrics is diluted; nonzero only when the real trajectories are
    fewer than the cells)."""
    import numpy as np

    from harts_verl.tree import RolloutForest

    forest = RolloutForest.from_sequences(sequences)
    parts, grid = tree_balanced_cells(forest, dp_size, num_mini_batches, padding)
    cell = grid.astype(np.float64)  # [mini-batch, rank]
    peak = cell.max(axis=1)
    imb = np.where(peak > 0, (peak - cell.mean(axis=1)) / np.maximum(peak, 1), 0.0)
    rank_work = cell.sum(axis=0)
    metrics = {
        "harts/dp_max_work": float(rank_work.max()),
        "harts/dp_min_work": float(rank_work.min()),
        "harts/dp_minibatch_imbalance": float(imb.max(initial=0.0)),
        "harts/dp_compression": forest.num_semantic_tokens / max(float(cell.sum()), 1.0),
    }
    if padding is not None:
        metrics["harts/dp_padding_samples"] = float(sum(bool(p) for p in padding))
        metrics["harts/dp_padding_only_cells"] = float(
            padding_only_cells(parts, num_mini_batches, padding)
        )
    return [j for p in parts for j in p], metrics


def _section_mini_batches(
    config: Any, batch_size: int, actor_updates: bool
) -> list[tuple[bool, int]] | None:
    """``(is the critic, mini-batches per batch)`` of each section whose mini-batches the cells
    must keep: the actor's (veRL cuts each rank's chunk into ``batch_size / (ppo_mini_batch_size
    × rollout.n)`` consecutive pieces) when it runs trees (:func:`_runs_trees`) and
    ``actor_updates`` (false during the critic's warm-up, ``trainer.critic_warmup``, when veRL
    updates the critic alone), the trained critic's when it does, the actor's when neither
    does. None when a section shuffles its mini-batches (the cells would not survive), its
    global mini-batch does not divide ``batch_size``, or the config lacks the sizes."""
    try:
        rollout_ref = config.actor_rollout_ref
        n = int(rollout_ref.rollout.n)
        actor = rollout_ref.actor
    except (AttributeError, TypeError, ValueError):
        return None
    sections = [(False, actor)] if _runs_trees(actor) and actor_updates else []
    if _critic_runs_trees(config):
        sections.append((True, config.critic))
    out = []
    for is_critic, section in sections or [(False, actor)]:
        try:
            global_mini = int(section.ppo_mini_batch_size) * n
            shuffle = bool(section.get("shuffle", False))
        except (AttributeError, TypeError, ValueError):
            return None
        if shuffle or global_mini <= 0 or batch_size % global_mini:
            return None
        out.append((is_critic, max(batch_size // global_mini, 1)))
    return out


def num_mini_batches_of(config: Any, batch_size: int, actor_updates: bool = True) -> int:
    """How many cells each rank's chunk of a ``batch_size`` batch is cut into so that every
    mini-batch of a section that runs trees is whole cells (:func:`_section_mini_batches`; both
    actor and critic: the least common multiple of their counts); 1 when the sections' cells
    would not survive."""
    import math

    counts = _section_mini_batches(config, batch_size, actor_updates)
    return math.lcm(*(c for _, c in counts)) if counts else 1


def balance_grid(
    config: Any,
    batch_size: int,
    actor_dp: int,
    critic_dp: int | None = None,
    actor_updates: bool = True,
) -> tuple[int, int]:
    """``(dp_size, num_mini_batches)`` for :func:`harts_balance_batch` so that every DP chunk
    and every mini-batch of each worker group that gets the batch is whole cells: the actor's
    ``actor_dp`` chunks (veRL's dispatcher), and, when a trained critic runs trees, the
    critic's ``critic_dp`` chunks (its own data-parallel size: another Ulysses SP size than the
    actor's gives another one) with their mini-batches (:func:`_section_mini_batches`).
    ``dp_size`` is the least common multiple of the DP sizes (an actor rank's chunk is then
    ``dp_size / actor_dp`` whole balanced parts), ``num_mini_batches`` the cells per part."""
    import math

    dps = [int(actor_dp)]
    if critic_dp and _critic_runs_trees(config):
        dps.append(int(critic_dp))
    dp = math.lcm(*dps)
    if batch_size % dp:
        return int(actor_dp), 1
    counts = _section_mini_batches(config, batch_size, actor_updates)
    if counts is None:
        return dp, 1  # the mini-batches do not keep cells: the chunks only
    # cells per batch each worker group's units need (its chunks x its mini-batches)
    units = [dp] + [
        int(critic_dp or actor_dp) * c if crit else int(actor_dp) * c for crit, c in counts
    ]
    cells = math.lcm(*units)
    if batch_size % cells:
        return dp, 1
    return dp, cells // dp


def padding_of(batch: Any, n: int) -> list[bool] | None:
    """Which of the ``n`` samples of ``batch`` are veRL's padding samples (its upsampler's
    ``is_padding`` tag), or None when the batch has no tags for all of them."""
    tags = getattr(batch, "tags", None)
    if tags is None or len(tags) != n:
        return None
    return [bool(t.get("is_padding", False)) if isinstance(t, dict) else False for t in tags]


def seqlen_metrics(
    batch: Any, sequences: list[Any], order: list[int], dp_size: int, prefix: str
) -> dict[str, float]:
    """veRL's ``log_seqlen_unbalance`` metrics (``{prefix}/min``, ``max``, ``minmax_diff``,
    ``balanced_min``, ``balanced_max``, ``mean``) for the batch order ``order`` cut into
    ``dp_size`` equal rank parts: the lengths are the batch tags' ``seq_len`` (what the stock
    trainer logs), else the sequences' lengths. ``batch`` (its tags), ``sequences`` and
    ``order``'s indices are in the batch's order before ``order`` is applied."""
    from verl.utils.seqlen_balancing import log_seqlen_unbalance

    tags = getattr(batch, "tags", None)
    if tags is not None and len(tags) == len(sequences) and all("seq_len" in t for t in tags):
        lengths = [int(t["seq_len"]) for t in tags]
    else:
        lengths = [len(s) for s in sequences]
    if not lengths or dp_size <= 0:
        return {}
    per = len(order) // dp_size
    parts = [order[r * per : (r + 1) * per] for r in range(dp_size)]
    return dict(log_seqlen_unbalance(seqlen_list=lengths, partitions=parts, prefix=prefix))


@functools.cache
def trainer_class(mode: str = "sync") -> type:
    """veRL's V1 trainer registered as ``mode`` (``trainer.v1.trainer_mode``: ``sync``,
    ``colocate_async``, ``separate_async``, …) with tree-aware ``_balance_batch``, named
    ``Harts`` + its class name (built on first use; veRL's ValueError for an unknown mode)."""
    import transfer_queue as tq
    from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
    from verl.trainer.ppo.v1 import get_trainer_cls

    base = get_trainer_cls(mode)

    class HartsTrainer(base):
        """Keeps rollout trees on one DP rank and balances compact work (see module doc)."""

        def _balance_batch(
            self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False
        ):
            if not is_harts_config(self.config):
                return super()._balance_batch(batch, metrics, logging_prefix, keep_minibatch)
            wg = self.actor_rollout_wg
            if "actor" not in wg._dispatch_info:
                wg._dispatch_info["actor"] = wg._query_dispatch_info("actor")
            dp_size = max(wg._dispatch_info["actor"]) + 1
            critic_dp = None
            cwg = getattr(self, "critic_wg", None)
            if cwg is not None and _critic_runs_trees(self.config):
                # the critic's own DP size (its Ulysses SP size may differ from the actor's);
                # a worker group without veRL's "train" mesh keeps the actor's cells
                try:
                    if "train" not in cwg._dispatch_info:
                        cwg._dispatch_info["train"] = cwg._query_dispatch_info("train")
                    critic_dp = max(cwg._dispatch_info["train"]) + 1
                except Exception as exc:  # veRL's dispatch internals vary by release
                    logging.getLogger(__name__).warning(
                        "harts: the critic's DP size is unknown (%s: %s); balancing for the "
                        "actor's %d ranks",
                        type(exc).__name__,
                        exc,
                        dp_size,
                    )
            multiple = self._get_required_batch_multiple(dp_size)
            batch = upsample_batch_to_divisible_size(batch, multiple, self.tokenizer.eos_token_id)
            data = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"]
            )
            seqs = token_sequences(data["input_ids"])  # numpy views, no per-token ints
            try:
                warmup = int(self.config.trainer.critic_warmup or 0)
            except (AttributeError, TypeError, ValueError):
                warmup = 0
            # the actor's mini-batches count once it updates, as veRL's step decides
            actor_updates = warmup <= getattr(self, "global_steps", 0)
            parts, nm = balance_grid(self.config, len(seqs), dp_size, critic_dp, actor_updates)
            order, stats = harts_balance_batch(seqs, parts, nm, padding_of(batch, len(seqs)))
            # veRL's own per-rank token metrics ({prefix}/min, max, balanced_min, ...), of the
            # same lengths (the tags' seq_len, as stock) and the ranks' parts of our order; read
            # before the reorder, which moves the tags too (``order`` indexes the batch as it was)
            metrics.update(seqlen_metrics(batch, seqs, order, dp_size, logging_prefix))
            batch.reorder(order)
            metrics.update(stats)
            return batch

    HartsTrainer.__name__ = HartsTrainer.__qualname__ = f"Harts{base.__name__}"
    return HartsTrainer


@functools.cache
def task_runner_class() -> Any:
    """A Ray TaskRunner that runs :func:`trainer_class` (veRL's ``TaskRunnerV1`` otherwise)."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.main_ppo import TaskRunnerV1

    base = TaskRunnerV1.__ray_metadata__.modified_class

    class HartsTaskRunner(base):
        def run(self, config):
            import transfer_queue as tq
            from verl.trainer.ppo.v1 import get_trainer_cls
            from verl.utils.logging_utils import configure_verl_logging

            configure_verl_logging()
            mode = config.trainer.v1.trainer_mode
            cls = trainer_class(mode) if is_harts_config(config) else get_trainer_cls(mode)
            config.transfer_queue.enable = True
            OmegaConf.resolve(config)
            self.config = config
            tq.init(config.transfer_queue)
            ok = False
            try:
                self.trainer = cls(config=config)
                self.trainer.init()
                self.init_agent_loop_manager()
                self.trainer.fit(self.agent_loop_manager)
                ok = True
            finally:
                try:
                    tracking = getattr(self.trainer, "logger", None)
                    if tracking is not None:
                        tracking.finish(exit_code=0 if ok else 1)
                finally:
                    tq.close()

    return ray.remote(HartsTaskRunner)


def main() -> None:
    """``python -m harts_verl.main_ppo``: veRL's hydra PPO entry point with our TaskRunner."""
    import hydra
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    @hydra.main(
        config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None
    )
    def _main(config) -> None:
        apply_harts_actor_config(config)
        apply_harts_critic_config(config)
        apply_harts_ref_config(config)
        check_ref_harts(config)
        check_fork_manager(config)
        auto_set_device(config)
        validate_config(
            config=config,
            use_reference_policy=need_reference_policy(config),
            use_critic=need_critic(config),
        )
        if not config.trainer.use_v1:
            raise ValueError("trainer.use_v1: harts_verl.main_ppo needs the V1 trainer (true)")
        run_ppo(config, task_runner_class=task_runner_class())

    _main()
