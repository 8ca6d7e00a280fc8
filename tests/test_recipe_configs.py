"""The SWE-bench and τ³-Bench recipe configs compose with veRL's ``ppo_trainer`` (hydra) and
resolve to what their comments claim; their tool/agent-loop files load; ``prepare.py`` writes
readable parquet; ``run.sh`` refuses to start without a model path. No GPU, Ray or network."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("verl")

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    ("swebench", "fsdp2"): "swebench_fsdp2",
    ("swebench", "megatron"): "swebench_megatron",
    ("tau3bench", "fsdp2"): "tau3bench_fsdp2",
    ("tau3bench", "megatron"): "tau3bench_megatron",
}


def _compose(recipe: str, name: str, overrides: list[str] | None = None):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "recipes" / recipe), version_base=None):
        return compose(
            name, overrides=["actor_rollout_ref.model.path=/models/x", *(overrides or [])]
        )


@pytest.mark.parametrize(("recipe", "variant"), sorted(RECIPES))
def test_recipe_config_composes_and_resolves(recipe, variant):
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from harts_verl.workers.rollout.fork import fork_spec_of

    cfg = _compose(recipe, RECIPES[recipe, variant])
    OmegaConf.resolve(cfg)  # every interpolation resolves
    aro = cfg.actor_rollout_ref
    # rollout: vLLM, async, TP 2 -> 4 replicas on 8 GPUs, multi-turn with the recipe's tools
    rollout = omega_conf_to_dataclass(aro.rollout)
    assert rollout.name == "vllm" and rollout.mode == "async"
    assert rollout.tensor_model_parallel_size == 2
    assert rollout.multi_turn.enable and rollout.multi_turn.format == "hermes"
    assert (ROOT / rollout.multi_turn.tool_config_path).is_file()
    loop = "harts_tool_agent" if recipe == "swebench" else "harts_tau_agent"
    assert rollout.agent.default_agent_loop == loop
    assert (
        rollout.agent.agent_loop_manager_class
        == "harts_verl.workers.rollout.fork.HartsAgentLoopManager"
    )
    if recipe == "tau3bench":
        assert (ROOT / rollout.agent.agent_loop_config_path).is_file()
    # fork sampling on, leaf budget == rollout.n (GRPO group size)
    spec = fork_spec_of(cfg)
    assert spec is not None and spec.budget == rollout.n == 4 and spec.turns[0] == 0
    assert cfg.algorithm.adv_estimator == "grpo"
    # GPU counts (8 per node, 1 node; the scaling comments say how to reach 64)
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.trainer.nnodes == 1 and cfg.trainer.use_v1
    assert (ROOT / cfg.reward.custom_reward_function.path).is_file()
    assert cfg.data.max_response_length == rollout.response_length
    if variant == "fsdp2":
        from harts_verl.workers.config import HartsFSDPActorConfig

        actor = omega_conf_to_dataclass(aro.actor)
        assert isinstance(actor, HartsFSDPActorConfig)
        assert actor.strategy == "harts_fsdp2" and actor.engine.strategy == "harts_fsdp2"
        assert actor.harts.enable and actor.harts.chunk_size == 64
        assert actor.harts.capacity_tokens == actor.ppo_max_token_len_per_gpu
        assert actor.use_dynamic_bsz
    else:  # veRL's Megatron engine; HARTS training is off (no harts section, stock strategy)
        assert cfg.model_engine == "megatron"
        assert aro.actor.strategy == "megatron"
        assert aro.actor._target_ == "verl.workers.config.McoreActorConfig"
        assert "harts" not in aro.actor
        assert aro.actor.megatron.tensor_model_parallel_size == 2
        assert aro.actor.megatron._target_ == "verl.workers.config.McoreEngineConfig"


def test_scaling_overrides_for_64_gpus():
    """The 64-GPU overrides in the comments compose (8 nodes; vLLM TP 4; bigger budgets)."""
    from verl.utils.config import omega_conf_to_dataclass

    cfg = _compose(
        "swebench",
        "swebench_fsdp2",
        [
            "trainer.nnodes=8",
            "data.train_batch_size=256",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256",
            "actor_rollout_ref.rollout.agent.num_workers=64",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=131072",
            "actor_rollout_ref.actor.harts.capacity_tokens=131072",
        ],
    )
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert (
        actor.harts.capacity_tokens == 131072
        and cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 64
    )
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout).tensor_model_parallel_size == 4


def test_tool_configs_instantiate():
    from verl.tools.tool_registry import initialize_tools_from_config

    for path, names in [
        (ROOT / "recipes/swebench/tools.yaml", ["bash", "str_replace_editor", "submit"]),
        (ROOT / "recipes/swebench/tools_fixture.yaml", ["bash", "str_replace_editor", "submit"]),
        (
            ROOT / "recipes/tau3bench/tools_retail_mini.yaml",
            [
                "find_user_id_by_email",
                "get_order_details",
                "cancel_pending_order",
                "modify_pending_order_address",
            ],
        ),
    ]:
        tools = initialize_tools_from_config(str(path))
        assert [t.name for t in tools] == names, path
    # the docker variant only needs docker when a trajectory starts its sandbox
    assert (
        initialize_tools_from_config(str(ROOT / "recipes/swebench/tools.yaml"))[0].cfg.sandbox
        == "docker"
    )


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_recipe_{path.parent.name}_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prepare_scripts_write_rows(tmp_path):
    import pandas as pd
    import yaml

    swe_prep = _load(ROOT / "recipes/swebench/prepare.py")
    out = swe_prep.prepare(str(tmp_path / "swe"), swe_prep.swe.fixture_instances())
    df = pd.read_parquet(out["train"])
    assert out["n_train"] == len(df) == 1 and df.iloc[0]["agent_name"] == "harts_tool_agent"
    tau_prep = _load(ROOT / "recipes/tau3bench/prepare.py")
    out = tau_prep.prepare(str(tmp_path / "tau"))
    assert len(pd.read_parquet(out["train"])) == out["n_train"] == 3
    with open(out["tools"]) as f:
        written = yaml.safe_load(f)
    with open(ROOT / "recipes/tau3bench/tools_retail_mini.yaml") as f:
        assert written == yaml.safe_load(f)  # the bundled file is what prepare writes
    with pytest.raises(ValueError, match="val_domain"):
        tau_prep.prepare(str(tmp_path / "tau2"), val_domain="tau2:airline")
    # task splits are τ²'s; the fixture domain has none (named, not silently all tasks)
    with pytest.raises(ValueError, match="split: domain retail_mini has no task splits"):
        tau_prep.prepare(str(tmp_path / "tau3"), split="train")
    with pytest.raises(ValueError, match=r"^val_split: domain retail_mini has no task splits"):
        tau_prep.prepare(str(tmp_path / "tau3"), val_split="test")
    for mod in ("swebench", "tau3bench"):
        reward = _load(ROOT / f"recipes/{mod}/reward.py")
        assert callable(reward.compute_score)


def test_tau_prepare_leaves_out_tasks_the_reward_cannot_score(tmp_path, monkeypatch, capsys):
    """A task whose ``reward_basis`` has neither DB nor COMMUNICATE (τ² telecom's kind) is left
    out and named; a reference call the domain refuses is named once (the task is kept: the
    call is skipped when scored, as τ² does); a split left with no task is an error."""
    import shutil

    import pandas as pd

    tau_prep = _load(ROOT / "recipes/tau3bench/prepare.py")
    tau = tau_prep.tau
    src = Path(tau.FIXTURES) / tau.FIXTURE_DOMAIN
    shutil.copytree(src, tmp_path / "dom")
    tasks = json.loads((tmp_path / "dom" / "tasks.json").read_text())
    tasks[0] = {**tasks[0], "reward_basis": ["ENV_ASSERTION"]}
    tasks[1] = {**tasks[1], "actions": [{"name": "cancel_pendng_order", "arguments": {}}]}
    (tmp_path / "dom" / "tasks.json").write_text(json.dumps(tasks))
    dom = tau.FixtureDomain(str(tmp_path / "dom"))
    monkeypatch.setattr(tau, "get_domain", lambda name: dom)
    out = tau_prep.prepare(str(tmp_path / "out"), tau.FIXTURE_DOMAIN)
    kept = [t["task_id"] for t in tasks[1:]]
    train = pd.read_parquet(out["train"])
    assert out["n_train"] == out["n_val"] == 2
    assert [r["tau_task_id"] for r in train["extra_info"]] == kept
    err = capsys.readouterr().err
    # train and validation both take all tasks here: each task is checked and named once
    assert err.count("task(s) left out, their reward_basis has no component") == 1
    assert tasks[0]["task_id"] in err
    assert err.count(f"task {tasks[1]['task_id']!r}: reference actions[0]") == 1
    tasks[1] = {**tasks[1], "reward_basis": ["NL_ASSERTION"]}
    tasks[2] = {**tasks[2], "reward_basis": ["ACTION"]}
    (tmp_path / "dom" / "tasks.json").write_text(json.dumps(tasks))
    dom = tau.FixtureDomain(str(tmp_path / "dom"))
    with pytest.raises(ValueError, match="split: no scorable tasks of dom"):
        tau_prep.prepare(str(tmp_path / "out2"), tau.FIXTURE_DOMAIN)


@pytest.mark.parametrize("recipe", ["swebench", "tau3bench"])
def test_run_sh_needs_model_path(recipe):
    script = ROOT / "recipes" / recipe / "run.sh"
    env = {k: v for k, v in os.environ.items() if k != "MODEL_PATH"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "MODEL_PATH" in out.stderr
    out = subprocess.run(
        ["bash", str(script)],
        env={**env, "MODEL_PATH": "/m", "VARIANT": "deepspeed"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "VARIANT" in out.stderr


@pytest.mark.parametrize("recipe", ["swebench", "tau3bench"])
def test_run_sh_trains_a_kimi_linear_checkpoint_in_place(recipe, tmp_path):
    """With a Kimi-Linear checkpoint as MODEL_PATH, run.sh writes its harts_hybrid config once
    (``convert --config-only``) and passes it as ``hf_config_path`` (the rollout serves the
    checkpoint); other models get no such override. ``PY`` is a stand-in that prints the
    trainer's arguments instead of starting it."""
    import json
    import sys

    from harts_verl.models import kimi_linear
    from harts_verl.models.config import preset

    ckpt = tmp_path / "kimi"
    ckpt.mkdir()
    cfg = kimi_linear.kimi_linear_config_from_hybrid(preset("kimi_tiny"))
    (ckpt / "config.json").write_text(json.dumps(cfg))
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.parquet", "val.parquet", "tools.yaml"):
        (data / name).write_text("")
    fake = tmp_path / "py"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = -m ] && [ "$2" = harts_verl.main_ppo ]; then printf "%s\\n" "$@"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "DATA_DIR": str(data), "MODEL_PATH": str(ckpt)}
    script = str(ROOT / "recipes" / recipe / "run.sh")
    out = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    args = out.stdout.splitlines()
    assert f"actor_rollout_ref.model.hf_config_path={data / 'harts_config'}" in args
    assert "actor_rollout_ref.model.trust_remote_code=true" in args
    assert f"actor_rollout_ref.model.path={ckpt}" in args
    written = json.loads((data / "harts_config" / "config.json").read_text())
    assert written["model_type"] == "harts_hybrid"
    assert written["harts_source_config"]["model_type"] == "kimi_linear"
    other = subprocess.run(
        ["bash", script],
        env={**env, "MODEL_PATH": str(tmp_path)},  # no config.json: not a source checkpoint
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == 0, other.stderr
    assert not any("hf_config_path" in a for a in other.stdout.splitlines())
