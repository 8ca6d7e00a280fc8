"""End to end: 2 online GRPO steps of the local CPU recipe (``recipes/local_cpu/run.sh``).

Runs ``python -m harts_verl.main_ppo`` (harts_fsdp2 engine, CPU platform shim, ``harts_hf``
rollout server, ``harts_tool_agent``, tiny Qwen3-Next) in a subprocess in its own session with a
hard timeout, then checks the console metrics (finite loss, ``harts/compression`` > 2 from the
shared agent prompt, HARTS path taken, multi-turn tool use by the SFT warm-started model) and
that the saved step-2 weights differ from the initial ones; then one PPO step with a GAE critic
that runs ``harts_fsdp2`` too. Every process of a run's session (driver, Ray GCS/raylet, Ray
workers) is killed by PID afterwards.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "recipes" / "local_cpu" / "run.sh"
TIMEOUT_S = 290

pytest.importorskip("verl")
pytest.importorskip("transfer_queue", reason="needs the 'rollout' extra (TransferQueue)")
pytest.importorskip("ray")


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid:  # field 6 of stat: session id
            pids.append(int(entry))
    return pids


def _kill_session(sid: int) -> None:
    """SIGTERM, then SIGKILL, every process of session ``sid`` (the run and its Ray cluster)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _session_pids(sid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _session_pids(sid):
            time.sleep(0.5)


def _summary_module():
    """``recipes/local_cpu/summary.py`` (the recipe's own log parser; not a package)."""
    path = Path(__file__).resolve().parents[1] / "recipes" / "local_cpu" / "summary.py"
    spec = importlib.util.spec_from_file_location("harts_local_cpu_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """``prepare.py``'s output (SFT warm-started model, train/val parquet), written once and
    shared by this module's runs (``HARTS_LOCAL_INPUTS``), as ``make demo`` does."""
    path = tmp_path_factory.mktemp("local_cpu_inputs")
    proc = subprocess.run(
        [sys.executable, str(RUN.parent / "prepare.py"), str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert (path / "model").is_dir() and (path / "train.parquet").is_file(), proc.stdout
    return path


def _run_recipe(work: Path, inputs: Path, steps: int, *overrides: str) -> str:
    """``recipes/local_cpu/run.sh steps overrides…`` on the prepared ``inputs`` in its own
    session (killed afterwards); fails the test on a timeout or a non-zero exit. Returns the
    console output."""
    env = dict(
        os.environ, HARTS_LOCAL_DIR=str(work), HARTS_LOCAL_INPUTS=str(inputs), PY=sys.executable
    )
    env.pop("RAY_ADDRESS", None)  # always a fresh local cluster of our own
    proc = subprocess.Popen(
        ["bash", str(RUN), str(steps), *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            out, _ = proc.communicate()
            pytest.fail(f"local CPU recipe timed out after {TIMEOUT_S}s:\n{out[-6000:]}")
    finally:
        _kill_session(proc.pid)
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="uses /proc to clean up the Ray cluster")
def test_local_cpu_recipe_two_steps(tmp_path, inputs):
    work = tmp_path / "w"
    out = _run_recipe(
        work,
        inputs,
        2,
        "trainer.save_freq=2",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]",
        f"trainer.rollout_data_dir={work / 'rollouts'}",
    )
    # the workers called the calc tool: no "Unknown function 'calc'" reply (decoded without
    # its <unk>s: "<tool> function <assistant>"), and calc's replies (a number or "error")
    import json
    import re

    dumped = [
        json.loads(line)
        for f in sorted((work / "rollouts").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    outputs = [" ".join(d["output"].split()) for d in dumped]
    assert dumped and not any("<tool> function <assistant>" in o for o in outputs), outputs[:4]
    assert any(re.search(r"<tool> (-?\d+|error) <assistant>", o) for o in outputs), outputs[:4]
    steps = _summary_module().parse_lines(out.splitlines())
    assert sorted(steps) == [1, 2], out[-6000:]
    for step, metrics in steps.items():
        loss = metrics["actor/loss"]
        assert math.isfinite(loss), (step, metrics)
        assert "actor/harts/compression" in metrics, metrics
        # the 288-token agent prompt is shared by every trajectory of the batch
        assert metrics["actor/harts/compression"] > 2.0, metrics
        # the warm-started model calls the tool: multi-turn trajectories (1 + assistant + tool)
        assert metrics["num_turns/max"] >= 4, metrics
        assert metrics["actor/harts/fallback"] == 0.0, metrics  # the tree path ran
        assert "harts/dp_compression" in metrics
        assert math.isfinite(metrics["critic/score/mean"])
    before = _load_weights(inputs / "model")
    after = _load_weights(work / "ckpt" / "global_step_2" / "actor" / "huggingface")
    assert before and set(before) == set(after)
    changed = [k for k in before if not bool((before[k] == after[k].to(before[k].dtype)).all())]
    assert changed, "no parameter changed after 2 steps"


@pytest.mark.skipif(sys.platform != "linux", reason="uses /proc to clean up the Ray cluster")
def test_local_cpu_recipe_ppo_with_tree_critic(tmp_path, inputs):
    """PPO with GAE: the critic (a token classifier on the same backbone) also runs
    ``harts_fsdp2`` (values and its update in tree mode); with a KL loss, the reference policy
    runs the tree engine with the actor's ``harts:`` values (``harts_verl.main_ppo``), on the
    CPU too (veRL shards it with a CPU offload policy). With ``fork.budget=3`` beside
    ``rollout.n=4`` each prompt gives 3 trajectories, so veRL's upsampler fills the 12 to its
    multiple (``ppo_mini_batch_size × rollout.n`` = 16) with 4 ``is_padding`` samples, which
    both tree engines run too."""
    work = tmp_path / "w"
    out = _run_recipe(
        work,
        inputs,
        1,
        "harts_rollout.fork.budget=3",
        "algorithm.adv_estimator=gae",
        "critic.strategy=harts_fsdp2",
        f"critic.model.path={inputs / 'model'}",
        "+critic.model.override_config={attn_implementation: sdpa}",
        "critic.fsdp.model_dtype=fp32",
        "critic.optim.lr=1e-3",
        "+critic.harts={chunk_size: 8}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
    )
    assert "Upsampled batch from 12 to 16 with 4 synthetic padding samples" in out, out[-6000:]
    steps = _summary_module().parse_lines(out.splitlines())
    assert sorted(steps) == [1], out[-6000:]
    m = steps[1]
    # one rank, one mini-batch: the engine ran the balancer's cell (the padding included)
    assert m["actor/harts/compact_tokens"] == m["harts/dp_max_work"] == m["harts/dp_min_work"], m
    assert m["harts/dp_padding_samples"] == 4.0, m  # the upsampler's tags reached the balancer
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "actor/loss"):
        assert math.isfinite(m[key]), (key, m)
    assert m["critic/harts/fallback"] == 0.0 and m["actor/harts/fallback"] == 0.0, m
    assert "the critic's DP size is unknown" not in out  # veRL's critic mesh was read
    assert m["critic/harts/compression"] > 2.0, m  # the shared agent prompt, computed once
    # one mini-batch, the first step: the actor is the reference, so the KL is its log-prob
    # difference (a stock reference on the CPU, HF's packed GatedDeltaNet fallback, gives ~6e-5)
    assert abs(m["actor/kl_loss"]) < 1e-6, m


def test_calculator_answers_only_in_vocabulary_numbers():
    """The demo's calculator tool answers what the word-level vocabulary can say; a result
    without a word (it would be tokenized as ``<unk>``) or a bad call is ``error``."""
    from harts_verl.workers.rollout import local_task as lt

    tok = lt.build_tokenizer()
    assert lt.calc("add", 9, 9) == "18" and lt.calc("sub", 0, 9) == "-9"
    for call in (("add", 18, 18), ("sub", -9, 9), ("mul", 2, 3), ("add", "x", 1)):
        assert lt.calc(*call) == "error"
    # operands other than ints are errors (2.9 was truncated to 2, True read as 1)
    for call in (
        ("add", 2.9, 1),
        ("add", True, 1),
        ("add", "1.5", 1),
        ("add", None, 1),
        ("add", "+-3", 1),  # int() raised on these: an error, not a crash
        ("add", "²", 1),
    ):
        assert lt.calc(*call) == "error"
    assert lt.calc("add", 2.0, "3") == "5"
    for a in range(10):
        for b in range(10):
            for op in ("add", "sub"):
                out = lt.calc(op, a, b)
                assert out != "error" and tok.unk_token_id not in tok.encode(out)


def test_recipe_workers_load_the_calc_tool():
    """``run.sh`` gives veRL the recipe's tool file (``function_tool_path``): the workers load
    ``calc`` and answer a call with its result (with none loaded, every call was answered
    "Unknown function 'calc'", tokenized as ``<unk>``)."""
    import asyncio

    from verl.tools.tool_registry import load_all_tools

    tools_py = ROOT / "recipes" / "local_cpu" / "tools.py"
    assert f'function_tool_path="$HERE/{tools_py.name}"' in RUN.read_text()
    tools = load_all_tools(tool_config_path=None, function_tool_path=str(tools_py))
    assert [t.name for t in tools] == ["calc"]
    (tool,) = tools
    from harts_verl.workers.rollout import local_task as lt

    assert tool.tool_schema.model_dump() == lt.calc_tool().tool_schema.model_dump()
    assert asyncio.run(tool.call({"op": "add", "a": 4, "b": 7})) == "11"


def test_calc_reward_rules():
    """1.0 only for a right final answer after a well-formed call and its tool reply; 0.1 for a
    well-formed call (any one: a fixed malformed call counts); the final answer counts (the
    first one did: ``answer 11 answer 3`` scored 1.0 for 11), and an answer without the tool
    scores nothing (it scored 1.0)."""
    from harts_verl.workers.rollout.local_task import compute_score

    def score(text: str) -> float:
        return compute_score("harts_calc", text, "11")

    ok = "<call> add 4 7 <eos> <tool> 11 <assistant> answer 11 <eos>"
    assert score(ok) == 1.0
    assert score("<call> add 4 7 <eos> <tool> 11 <assistant> answer 3 answer 11 <eos>") == 1.0
    assert score("<call> add 4 7 <eos> <tool> 11 <assistant> answer 11 answer 3 <eos>") == 0.1
    assert score("answer 11 <eos>") == 0.0  # no tool call
    assert score("<call> add <eos> <tool> error <assistant> answer 11 <eos>") == 0.0  # malformed
    fixed = "<call> mul 4 7 <eos> <tool> error <assistant> <call> add 4 7 <eos> <tool> 11 "
    assert score(fixed + "<assistant> answer 11 <eos>") == 1.0
    assert score(fixed + "<assistant> answer 9 <eos>") == 0.1
    assert score("<call> add 4 7 <eos>") == 0.1  # cut off before the reply
    assert score("answer 11 <call> add 4 7 <eos> <tool> 11 <assistant>") == 0.1
    # the only well-formed call comes after the last reply (never run: the turn limit): a guess
    guess = "<call> mul 4 7 <eos> <tool> error <assistant> <call> add 4 7 answer 11 <eos>"
    assert score(guess) == 0.1
