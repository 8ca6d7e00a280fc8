"""Plugin registration, ``harts:`` config validation, hydra composition, tree-aware DP split."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("verl")


def test_entry_point_registers_engine_in_a_fresh_process():
    from importlib.metadata import entry_points

    eps = [
        ep for ep in entry_points(group="verl.plugins") if ep.value == "harts_verl.workers.plugin"
    ]
    assert eps, "entry point missing: reinstall the package (pip install -e .)"
    code = (
        "import sys; sys.modules['fla'] = None; import verl; "
        "from verl.workers.engine import EngineRegistry as R; "
        "e = R._engines['language_model']['harts_fsdp2']; print(sorted(e))"
    )
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['cpu', 'cuda']"


def test_registration_failure_is_logged_at_warning(monkeypatch, caplog):
    from harts_verl.workers import plugin

    monkeypatch.setitem(sys.modules, "harts_verl.workers.engine", None)
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    with caplog.at_level(logging.WARNING, logger="harts_verl.workers.plugin"):
        assert plugin.register() is False
    assert any(
        "harts_fsdp2" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records
    )


def test_harts_section_validation():
    from harts_verl.workers.config import HartsConfig

    cfg = HartsConfig.from_any({"chunk_size": 32, "planner": {"work_slack": 0.1}})
    assert cfg.chunk_size == 32 and cfg.planner == {"work_slack": 0.1}
    assert HartsConfig.from_any({"planner": {"max_search_cells": 10}}).planner == {
        "max_search_cells": 10
    }
    # every option the planner takes is settable, but allow_oversize: the engine decides that
    from harts_verl.tree.microbatch import planner_options

    assert "max_layers_work" in planner_options()
    assert HartsConfig.from_any({"attention_key_rows": 65536}).attention_key_rows == 65536
    assert HartsConfig.from_any({}).attention_key_rows is None
    assert HartsConfig.from_any({"planner": {"max_layers_work": 10}}).planner == {
        "max_layers_work": 10
    }
    for bad, key in [
        ({"chunk_size": 0}, "harts.chunk_size"),
        ({"chunk_size": 4097}, r"harts.chunk_size: expected an int in \[1, 4096\]"),
        ({"capacity_tokens": -5}, "harts.capacity_tokens"),
        ({"min_compression": -1}, "harts.min_compression"),
        ({"audit_every": 1.5}, "harts.audit_every"),
        ({"chunk": 8}, "harts.chunk"),
        ({"planner": {"bogus": 1}}, "harts.planner.bogus"),
        ({"planner": "abc"}, "harts.planner"),
        ({"planner": {"work_slack": -5}}, "harts.planner.work_slack"),
        ({"planner": {"effort": "lots"}}, "harts.planner.effort"),
        ({"planner": {"strategies": 5}}, "harts.planner.strategies"),
        ({"planner": {"strategies": ["tree", "bogus"]}}, "harts.planner.strategies"),
        ({"planner": {"restarts": -1}}, "harts.planner.restarts"),
        ({"planner": {"max_search_cells": -1}}, "harts.planner.max_search_cells"),
        ({"planner": {"max_layers_work": -1}}, "harts.planner.max_layers_work"),
        ({"planner": {"allow_oversize": False}}, "harts.planner.allow_oversize"),
        ({"planner": {"improve": "yes"}}, "harts.planner.improve"),
        ({"planner": {"seed": 1.9}}, "harts.planner.seed"),
        ({"planner": {"seed": None}}, "harts.planner.seed"),
        ({"enable": "yes"}, "harts.enable"),
        ({"capacity_tokens": 2**63}, "harts.capacity_tokens"),  # past the planner's int64
        ({"rows_per_chunk": 2**54}, "harts.rows_per_chunk"),  # it failed in the first step
        ({"attention_key_rows": 0}, "harts.attention_key_rows"),
        ({"attention_key_rows": True}, "harts.attention_key_rows"),
        ({"attention_key_rows": "4096"}, "harts.attention_key_rows"),
        ({"planner": {"strategies": {"tree": 1}}}, "harts.planner.strategies"),  # a mapping
    ]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            HartsConfig.from_any(bad)


def test_hydra_compose_resolves_to_harts_engine_and_config(monkeypatch):
    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    from harts_verl.workers.config import HartsConfig, HartsFSDPActorConfig
    from harts_verl.workers.engine import HartsFSDPEngine

    overrides = [
        "actor_rollout_ref.actor.strategy=harts_fsdp2",
        "actor_rollout_ref.actor._target_=harts_verl.workers.config.HartsFSDPActorConfig",
        "+actor_rollout_ref.actor.harts.chunk_size=32",
        "+actor_rollout_ref.actor.harts.min_compression=1.2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.n=4",
    ]
    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, HartsFSDPActorConfig)
    assert isinstance(actor.harts, HartsConfig)
    assert actor.harts.chunk_size == 32 and actor.harts.min_compression == 1.2
    assert actor.engine.strategy == "harts_fsdp2"
    assert actor.engine.harts is actor.harts  # how the engine receives the section
    for device in ("cuda", "cpu"):
        monkeypatch.setenv("VERL_ENGINE_DEVICE", device)
        cls = EngineRegistry.get_engine_cls("language_model", actor.engine.strategy)
        assert cls is HartsFSDPEngine
    bad = [*overrides, "+actor_rollout_ref.actor.harts.chunk_sise=8"]
    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=bad)
    with pytest.raises(Exception, match=r"harts\.chunk_sise"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_importing_config_first_registers_the_engine():
    """A process whose first import is the config module (``import verl`` inside it loads our
    plugin, which imports the engine) still registers ``harts_fsdp2``."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['fla'] = None\n"
        "from harts_verl.workers.config import HartsFSDPActorConfig\n"
        "from harts_verl.workers import plugin\n"
        "from verl.workers.engine import EngineRegistry\n"
        "assert plugin.REGISTERED['harts_fsdp2'], plugin.REGISTERED\n"
        "assert 'harts_fsdp2' in EngineRegistry._engines['language_model']\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "could not register" not in out.stderr


def test_strategy_alone_enables_harts_through_main_ppo(caplog):
    """``harts_verl.main_ppo``: ``strategy=harts_fsdp2`` is the one flag; ``harts.*`` options
    need no ``_target_`` override; other strategies and explicit classes are left alone."""
    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass

    from harts_verl.workers.config import HartsFSDPActorConfig
    from harts_verl.workers.trainer import apply_harts_actor_config

    def composed(*overrides: str):
        batch = ["actor_rollout_ref.actor.ppo_mini_batch_size=8"]
        batch += ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.rollout.n=4"]
        with initialize_config_module("verl.trainer.config", version_base=None):
            return compose("ppo_trainer", overrides=[*overrides, *batch])

    cfg = composed(
        "actor_rollout_ref.actor.strategy=harts_fsdp2",
        "+actor_rollout_ref.actor.harts.chunk_size=16",
    )
    assert apply_harts_actor_config(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, HartsFSDPActorConfig) and actor.harts.chunk_size == 16
    assert not apply_harts_actor_config(cfg)  # idempotent
    stock = composed("actor_rollout_ref.actor.strategy=fsdp2")
    assert not apply_harts_actor_config(stock)
    assert stock.actor_rollout_ref.actor._target_ == "verl.workers.config.FSDPActorConfig"
    # harts options with another strategy: accepted, and a WARNING says they are not used
    mixed = composed(
        "actor_rollout_ref.actor.strategy=fsdp2", "+actor_rollout_ref.actor.harts.chunk_size=16"
    )
    assert apply_harts_actor_config(mixed)
    with caplog.at_level("WARNING", logger="harts_verl.workers.config"):
        actor = omega_conf_to_dataclass(mixed.actor_rollout_ref.actor)
    assert actor.strategy == "fsdp2"
    assert "harts: settings (harts.chunk_size) are not used here" in caplog.text
    assert "set strategy=harts_fsdp2" in caplog.text
    custom = composed(
        "actor_rollout_ref.actor.strategy=harts_fsdp2", "actor_rollout_ref.actor._target_=my.Cls"
    )
    assert not apply_harts_actor_config(custom)
    assert custom.actor_rollout_ref.actor._target_ == "my.Cls"
    # Megatron's config class: veRL would build its Megatron engine and HARTS would be off
    with initialize_config_module("verl.trainer.config", version_base=None):
        mega = compose(
            "ppo_megatron_trainer", overrides=["actor_rollout_ref.actor.strategy=harts_fsdp2"]
        )
    with pytest.raises(ValueError, match=r"actor\.strategy=harts_fsdp2 needs veRL's FSDP engine"):
        apply_harts_actor_config(mega)
    # harts options beside Megatron's strategy and class: not used, dropped with a WARNING
    # (veRL's Megatron class failed on the unknown key without naming the strategy)
    with initialize_config_module("verl.trainer.config", version_base=None):
        mega = compose(
            "ppo_megatron_trainer", overrides=["+actor_rollout_ref.actor.harts.chunk_size=16"]
        )
    caplog.clear()
    with caplog.at_level("WARNING", logger="harts_verl.workers.trainer"):
        assert apply_harts_actor_config(mega)
    assert "harts" not in mega.actor_rollout_ref.actor
    assert "harts: settings are not used (dropped)" in caplog.text
    assert "McoreActorConfig" in mega.actor_rollout_ref.actor._target_


def _ref_dataclass(cfg):
    """The reference policy's config dataclass, built as veRL's ``ActorRolloutRefWorker``
    builds it (its ``log_prob_*`` keys renamed first)."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass

    ref = cfg.actor_rollout_ref.ref
    with open_dict(ref):
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    return omega_conf_to_dataclass(ref)


def test_reference_policy_takes_the_actor_harts_section(caplog):
    """``harts_verl.main_ppo``: a reference policy on the tree engine runs with the actor's
    ``harts:`` values (its own ``+actor_rollout_ref.ref.harts.*`` keys win, the planner's options
    merged key by key); a stock reference (``ref.strategy=fsdp2``) is left alone."""
    from hydra import compose, initialize_config_module

    from harts_verl.workers.config import HartsConfig, HartsFSDPActorConfig
    from harts_verl.workers.trainer import apply_harts_actor_config, apply_harts_ref_config

    def composed(*overrides: str):
        batch = ["actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4"]
        batch += ["actor_rollout_ref.actor.use_dynamic_bsz=true"]
        batch += ["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true"]
        with initialize_config_module("verl.trainer.config", version_base=None):
            cfg = compose("ppo_trainer", overrides=[*overrides, *batch])
        apply_harts_actor_config(cfg)
        return cfg

    actor_opts = [
        "actor_rollout_ref.actor.strategy=harts_fsdp2",
        "+actor_rollout_ref.actor.harts.chunk_size=16",
        "+actor_rollout_ref.actor.harts.min_compression=1.5",
        "+actor_rollout_ref.actor.harts.planner.restarts=3",
        "+actor_rollout_ref.actor.harts.planner.seed=7",
    ]
    cfg = composed(*actor_opts)
    assert apply_harts_ref_config(cfg)
    assert not apply_harts_ref_config(cfg)  # idempotent
    ref = _ref_dataclass(cfg)
    assert isinstance(ref, HartsFSDPActorConfig) and ref.engine.strategy == "harts_fsdp2"
    assert ref.engine.harts == ref.harts
    assert (ref.harts.chunk_size, ref.harts.min_compression) == (16, 1.5)
    assert ref.harts.planner == {"restarts": 3, "seed": 7}
    # the reference's own keys win; the planner's options merge key by key
    own = [
        "+actor_rollout_ref.ref.harts.min_compression=2.0",
        "+actor_rollout_ref.ref.harts.planner.seed=1",
    ]
    cfg = composed(*actor_opts, *own)
    assert apply_harts_ref_config(cfg)
    ref = _ref_dataclass(cfg)
    assert (ref.harts.chunk_size, ref.harts.min_compression) == (16, 2.0)
    assert ref.harts.planner == {"restarts": 3, "seed": 1}
    # the actor's harts.enable=false makes the reference stock too
    cfg = composed(*actor_opts, "+actor_rollout_ref.actor.harts.enable=false")
    assert apply_harts_ref_config(cfg) and _ref_dataclass(cfg).harts.enable is False
    # the strategy alone: the class, default values
    cfg = composed("actor_rollout_ref.actor.strategy=harts_fsdp2")
    assert apply_harts_ref_config(cfg)
    assert _ref_dataclass(cfg).harts == HartsConfig()
    # a stock reference: untouched, the actor's options are not copied
    cfg = composed(*actor_opts, "actor_rollout_ref.ref.strategy=fsdp2")
    assert not apply_harts_ref_config(cfg)
    assert cfg.actor_rollout_ref.ref._target_ == "verl.workers.config.FSDPActorConfig"
    assert "harts" not in cfg.actor_rollout_ref.ref
    # a bad key in the reference's own section is named, at startup too (veRL's
    # validate_config builds the actor's and the critic's classes, not the reference's)
    from harts_verl.workers.trainer import check_ref_harts

    cfg = composed(*actor_opts, "+actor_rollout_ref.ref.harts.chunk=3")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.ref\.harts\.chunk: unknown key"):
        apply_harts_ref_config(cfg)
    for where in ("ref", "actor"):  # each named by the section that holds it
        cfg = composed(*actor_opts, f"++actor_rollout_ref.{where}.harts.chunk_size=0")
        with pytest.raises(ValueError, match=rf"^actor_rollout_ref\.{where}\.harts\.chunk_size"):
            apply_harts_ref_config(cfg)
    # without an actor section to inherit, the reference's own is checked at startup
    cfg = composed("+actor_rollout_ref.ref.harts.chunk_size=0")
    apply_harts_ref_config(cfg)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.ref\.harts\.chunk_size"):
        check_ref_harts(cfg)
    check_ref_harts(composed(*actor_opts))  # a good one passes
    # a planner that is no mapping is named (it was OmegaConf's merge error)
    cfg = composed(*actor_opts, "+actor_rollout_ref.ref.harts.planner=[1]")
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.ref\.harts\.planner: expected"):
        apply_harts_ref_config(cfg)
    # an explicitly chosen other class is left alone
    cfg = composed(*actor_opts, "actor_rollout_ref.ref._target_=my.Cls")
    assert not apply_harts_ref_config(cfg) and "harts" not in cfg.actor_rollout_ref.ref


def test_critic_strategy_selects_the_harts_critic_config(tmp_path, caplog):
    """``critic.strategy=harts_fsdp2``: ``HartsFSDPCriticConfig`` with its ``harts:`` section on
    the engine config; a stock critic strategy is left alone."""
    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass

    from harts_verl.workers import testing
    from harts_verl.workers.config import HartsFSDPCriticConfig
    from harts_verl.workers.trainer import apply_harts_critic_config

    path = testing.save_tiny_model("qwen2", str(tmp_path / "critic"), seed=0)

    def composed(*overrides: str):
        batch = ["critic.ppo_mini_batch_size=8", "critic.use_dynamic_bsz=true"]
        batch += ["actor_rollout_ref.rollout.n=4", f"critic.model.path={path}"]
        batch += ["+critic.model.load_tokenizer=false"]
        with initialize_config_module("verl.trainer.config", version_base=None):
            return compose("ppo_trainer", overrides=[*overrides, *batch])

    cfg = composed("critic.strategy=harts_fsdp2", "+critic.harts.chunk_size=16")
    assert apply_harts_critic_config(cfg)
    critic = omega_conf_to_dataclass(cfg.critic)
    assert isinstance(critic, HartsFSDPCriticConfig) and critic.harts.chunk_size == 16
    assert critic.engine.harts.chunk_size == 16 and critic.engine.strategy == "harts_fsdp2"
    assert not apply_harts_critic_config(cfg)  # idempotent
    stock = composed("critic.strategy=fsdp2")
    assert not apply_harts_critic_config(stock)
    assert stock.critic._target_ == "verl.workers.config.FSDPCriticConfig"
    # harts options on a stock critic: accepted, and a WARNING says they are not used
    mixed = composed("critic.strategy=fsdp2", "+critic.harts.chunk_size=16")
    assert apply_harts_critic_config(mixed)
    with caplog.at_level("WARNING", logger="harts_verl.workers.config"):
        critic = omega_conf_to_dataclass(mixed.critic)
    assert critic.strategy == "fsdp2" and critic.engine.strategy == "fsdp2"
    assert "strategy is 'fsdp2', so its harts: settings (harts.chunk_size) are not used" in (
        caplog.text
    )
    with pytest.raises(Exception, match=r"harts\.chunk: unknown key"):  # hydra wraps it
        bad = composed("critic.strategy=harts_fsdp2", "+critic.harts.chunk=16")
        apply_harts_critic_config(bad)
        omega_conf_to_dataclass(bad.critic)


def test_tree_balanced_partition_keeps_trees_and_balances_work():
    from harts_verl.tree import RolloutForest
    from harts_verl.tree.microbatch import compact_work
    from harts_verl.workers.balance import tree_balanced_partition
    from harts_verl.workers.trainer import harts_balance_batch

    rng = np.random.default_rng(0)
    seqs, tree_of = [], []
    for t, (n, plen) in enumerate([(4, 60), (4, 10), (4, 30), (4, 20)]):
        p = [t + 1, *rng.integers(0, 50, plen).tolist()]
        for _ in range(n):
            seqs.append(p + rng.integers(0, 50, int(rng.integers(2, 9))).tolist())
            tree_of.append(t)
    parts = tree_balanced_partition(seqs, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(seqs)))
    assert all(len(p) == 8 for p in parts)
    for p in parts:  # no tree is split
        trees = {tree_of[i] for i in p}
        assert all(sum(tree_of[i] == t for i in p) == 4 for t in trees)
    forest = RolloutForest.from_sequences(seqs)
    work = [compact_work(forest, p) for p in parts]
    assert max(work) - min(work) <= 40  # {60,20} vs {10,30}-sized trees
    order, metrics = harts_balance_batch(seqs, 2)
    assert order == [i for p in parts for i in p] and metrics["harts/dp_compression"] > 1
    # a tree bigger than one rank's share is cut (at its lowest LCP), sizes stay equal
    big = [[1, 2, 3, k] for k in range(6)] + [[9, k] for k in range(2)]
    parts = tree_balanced_partition(big, 2)
    assert sorted(len(p) for p in parts) == [4, 4]
    with pytest.raises(ValueError, match="dp_size"):
        tree_balanced_partition(seqs, 3)


def test_harts_section_with_another_strategy_is_named_in_a_warning(caplog):
    """A ``harts:`` section whose strategy is not ``harts_fsdp2`` is not used: a WARNING names
    its changed settings and the strategy to set (defaults alone stay quiet)."""
    import dataclasses

    from harts_verl.workers import testing
    from harts_verl.workers.config import HartsFSDPActorConfig

    base = testing.actor_config(strategy="fsdp2")
    kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    kw.pop("engine", None)
    with caplog.at_level("WARNING", logger="harts_verl.workers.config"):
        HartsFSDPActorConfig(**kw, harts={"chunk_size": 8, "min_compression": 1.5})
        HartsFSDPActorConfig(**{**kw, "strategy": "harts_fsdp2"}, harts={"chunk_size": 8})
        HartsFSDPActorConfig(**kw)
        # a key set to its default is named too: harts.enable=true does not turn HARTS on
        HartsFSDPActorConfig(**kw, harts={"enable": True})
    msgs = [r.getMessage() for r in caplog.records if r.name == "harts_verl.workers.config"]
    assert len(msgs) == 2, msgs
    assert "'fsdp2'" in msgs[0] and "harts.chunk_size, harts.min_compression" in msgs[0]
    assert "strategy=harts_fsdp2" in msgs[0]
    assert "(harts.enable) are not used" in msgs[1]
    assert "reference policy" in msgs[0]  # an actor's concern: a critic's WARNING leaves it out
    from harts_verl.workers.config import HartsFSDPCriticConfig

    critic = testing.critic_config(strategy="fsdp2")
    kw = {f.name: getattr(critic, f.name) for f in dataclasses.fields(critic) if f.init}
    kw.pop("engine", None)
    caplog.clear()
    with caplog.at_level("WARNING", logger="harts_verl.workers.config"):
        HartsFSDPCriticConfig(**kw, harts={"chunk_size": 8})
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "harts_verl.workers.config"]
    assert "HartsFSDPCriticConfig: strategy is 'fsdp2'" in msg and "(harts.chunk_size)" in msg
    assert "reference policy" not in msg


def test_cpu_platform_installed_after_import_verl():
    """``install_cpu_platform()`` after ``import verl`` (the plugin had imported veRL's FSDP
    engine under the auto-detected platform): the engine module's import-time ``device_name``
    (its Ulysses device mesh) is ``cpu`` too; installed before, the platform is built once."""
    code = (
        "import os, sys; sys.modules['fla'] = None; os.environ.pop('VERL_PLATFORM', None)\n"
        "import verl\n"
        "from verl.workers.engine.fsdp import transformer_impl as t\n"
        "from harts_verl.workers.cpu_platform import install_cpu_platform\n"
        "install_cpu_platform(); install_cpu_platform()\n"
        "assert t.device_name == 'cpu', t.device_name\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    code = (
        "import sys; sys.modules['fla'] = None\n"
        "from harts_verl.workers.cpu_platform import install_cpu_platform\n"
        "install_cpu_platform()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Replacing already-initialised platform" not in out.stderr
