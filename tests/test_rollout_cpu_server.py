"""CPU rollout server ``harts_hf``: real sampling with a tiny model, TokenOutput contract,
weight loading, and registration where veRL looks for rollout replicas and server adapters."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from harts_verl.workers import testing
    from harts_verl.workers.rollout.cpu_server import HFGenerationServer

    path = testing.save_tiny_model("qwen2", str(tmp_path_factory.mktemp("m") / "qwen2"), seed=1)
    cfg = SimpleNamespace(max_model_len=None, prompt_length=16, response_length=16)
    return HFGenerationServer(cfg, SimpleNamespace(path=path, tokenizer=None))


def _gen(server, prompt, **sp):
    return asyncio.new_event_loop().run_until_complete(
        server.generate(prompt_ids=prompt, sampling_params=sp, request_id="r")
    )


def test_generate_contract_and_logprobs(server):
    from verl.workers.rollout.replica import TokenOutput

    out = _gen(server, [1, 2, 3], temperature=1.0, max_tokens=6, logprobs=True)
    assert isinstance(out, TokenOutput)
    assert len(out.token_ids) == 6 and len(out.log_probs) == 6
    # log-probs are those of the sampled tokens under the model
    with torch.no_grad():
        logits = server.model(torch.tensor([[1, 2, 3, *out.token_ids]])).logits[0]
    ref = torch.log_softmax(logits.float(), -1)[2:-1].gather(
        1, torch.tensor(out.token_ids)[:, None]
    )
    assert torch.allclose(ref[:, 0], torch.tensor(out.log_probs), atol=1e-4)
    # vLLM's logprobs=0 is the sampled tokens' log-probs (it was read as none); None / False: none
    for k, want in ((0, 6), (1, 6), (None, None), (False, None)):
        got = _gen(server, [1, 2, 3], temperature=1.0, max_tokens=6, logprobs=k).log_probs
        assert (None if got is None else len(got)) == want, k
    # greedy is deterministic; the context limit caps the length; stop tokens stop
    g1 = _gen(server, [1, 2, 3], temperature=0, max_tokens=5)
    assert g1.token_ids == _gen(server, [1, 2, 3], temperature=0, max_tokens=5).token_ids
    assert len(_gen(server, list(range(30)), temperature=0).token_ids) == 2
    stop = _gen(server, [1, 2, 3], temperature=0, max_tokens=5, stop_token_ids=[g1.token_ids[0]])
    assert stop.token_ids == g1.token_ids[:1]


def test_load_weights_changes_generation(server):
    before = _gen(server, [4, 5], temperature=0, max_tokens=4).token_ids
    named = [(n, torch.zeros_like(p)) for n, p in server.model.named_parameters() if "lm_head" in n]
    assert server.load_weights(named) == len(named) == 1
    after = _gen(server, [4, 5], temperature=0, max_tokens=4).token_ids
    assert after == [0, 0, 0, 0] and server.weight_version == 1
    assert before is not None


def test_registered_in_verl():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplica, get_rollout_replica_class

    from harts_verl.workers import plugin

    assert plugin.register_rollout() and plugin.REGISTERED["harts_hf"]
    assert issubclass(get_rollout_replica_class("harts_hf"), RolloutReplica)
    assert get_rollout_class("harts_hf", "async").__name__ == "HFServerAdapter"


def test_server_names_differ_by_role():
    """A reward or teacher replica's server never takes the policy server's name (the one the
    hybrid worker's adapter looks up), as veRL names its own servers."""
    from harts_verl.workers.rollout.cpu_server import _replica_cls, _server_name

    replica = _replica_cls()
    names = set()
    for reward, teacher in ((False, False), (True, False), (False, True)):
        r = object.__new__(replica)
        r.replica_rank, r.is_reward_model, r.is_teacher_model = 0, reward, teacher
        names.add(_server_name(0, r._role()))
    assert len(names) == 3 and _server_name(0) in names


def test_eos_from_saved_tokenizer(tmp_path):
    """A model config without eos and a model_config without a tokenizer (as the replica
    passes it): the server stops at the eos of the tokenizer saved with the model."""
    from harts_verl.workers import testing
    from harts_verl.workers.rollout import local_task
    from harts_verl.workers.rollout.cpu_server import HFGenerationServer

    path = testing.save_tiny_model("qwen2", str(tmp_path / "m"), seed=1)
    local_task.build_tokenizer(path)
    cfg = SimpleNamespace(max_model_len=None, prompt_length=16, response_length=16)
    srv = HFGenerationServer(cfg, SimpleNamespace(path=path))
    assert srv.eos_token_id == local_task.VOCAB.index("<eos>")


def _spy_stop_tokens(monkeypatch) -> list[list[int]]:
    """The stop token ids of every ``sample_tokens`` call the CPU server makes, appended."""
    from harts_verl.workers.rollout import cpu_server

    seen: list[list[int]] = []
    real = cpu_server.sample_tokens

    def spy(*args, **kwargs):
        seen.append(list(kwargs["stop_token_ids"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_server, "sample_tokens", spy)
    return seen


def test_every_eos_id_of_the_model_stops(tmp_path, monkeypatch):
    """Configs list several eos ids (Llama 3, GLM-4): the server stops at each (as vLLM does,
    with the tokenizer's eos); ``int()`` of the list used to fail every generate call."""
    import asyncio
    import json
    import os

    from harts_verl.workers import testing
    from harts_verl.workers.rollout.cpu_server import HFGenerationServer

    path = testing.save_tiny_model("llama", str(tmp_path / "m"), seed=1)
    for name in ("generation_config.json",):  # the model config's list is what vLLM reads then
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = [5, 7]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    seen = _spy_stop_tokens(monkeypatch)
    cfg_ns = SimpleNamespace(max_model_len=None, prompt_length=16, response_length=8)
    srv = HFGenerationServer(cfg_ns, SimpleNamespace(path=path, tokenizer=None))
    assert srv.eos_token_ids == (5, 7)
    out = asyncio.run(srv.generate([1, 2, 3], {"stop_token_ids": [9]}, "r"))
    assert seen == [[9, 5, 7]] and all(t not in (5, 7) for t in out.token_ids[:-1])
    asyncio.run(srv.generate([1, 2, 3], {"ignore_eos": True}, "r"))
    assert seen[-1] == []
    # a tokenizer's eos comes first, the generation config's others follow (no repeats)
    tok = SimpleNamespace(eos_token_id=7)
    srv = HFGenerationServer(cfg_ns, SimpleNamespace(path=path, tokenizer=tok))
    assert srv.eos_token_id == 7 and srv.eos_token_ids == (7, 5)


def test_rollout_config_ignore_eos_is_the_default(tmp_path, monkeypatch):
    """``actor_rollout_ref.rollout.ignore_eos`` (veRL's rollout config): veRL's vLLM server
    takes it as the request's default (``setdefault("ignore_eos", config.ignore_eos)``); veRL's
    agent loops send no ``ignore_eos`` key. The server ignored the config and stopped at eos."""
    import asyncio

    from harts_verl.workers import testing
    from harts_verl.workers.rollout.cpu_server import HFGenerationServer

    path = testing.save_tiny_model("qwen2", str(tmp_path / "m"), seed=1)
    seen = _spy_stop_tokens(monkeypatch)
    tok = SimpleNamespace(eos_token_id=7)
    for ignore, sp, stops in (
        (True, {}, []),
        (True, {"ignore_eos": False}, [7]),  # the request's own value wins
        (True, {"ignore_eos": None}, []),  # None: the config's
        (False, {}, [7]),
        (None, {"ignore_eos": True}, []),
    ):
        cfg = SimpleNamespace(max_model_len=None, prompt_length=16, response_length=8)
        if ignore is not None:
            cfg.ignore_eos = ignore
        srv = HFGenerationServer(cfg, SimpleNamespace(path=path, tokenizer=tok))
        asyncio.run(srv.generate([1, 2, 3], dict(sp), "r"))
        assert seen[-1] == stops, (ignore, sp)


# ---------------------------------------------------------------------- seeds and lengths
def test_request_seed_is_a_stable_pure_function():
    """Python's ``hash`` of a str is salted per process; the seed must not be."""
    from harts_verl.workers.rollout.cpu_server import request_seed

    assert request_seed("det-0", 3) == 1838102988540427636  # sha256, fixed forever
    assert request_seed("det-0", 3) == request_seed("det-0", 3)
    assert request_seed("det-0", 4) != request_seed("det-0", 3)  # turns of one request differ
    assert request_seed("det-1", 3) != request_seed("det-0", 3)
    assert 0 <= request_seed("x" * 1000, 10**6) < 2**63
    # sampling_params["seed"] wins when given (numpy ints too)
    assert request_seed("det-0", 3, seed=7) == request_seed("other", 9, seed=np_int(7)) == 7
    with pytest.raises(TypeError, match=r"sampling_params\.seed: expected an int, got 1\.5"):
        request_seed("r", 1, seed=1.5)
    with pytest.raises(TypeError, match=r"sampling_params\.seed"):
        request_seed("r", 1, seed=True)
    with pytest.raises(ValueError, match=r"sampling_params\.seed: expected an int in"):
        request_seed("r", 1, seed=-1)


def np_int(v):
    import numpy as np

    return np.int64(v)


_SEED_SCRIPT = """
import asyncio, sys
from types import SimpleNamespace
from harts_verl.workers.rollout.cpu_server import HFGenerationServer
cfg = SimpleNamespace(max_model_len=None, prompt_length=16, response_length=16)
srv = HFGenerationServer(cfg, SimpleNamespace(path=sys.argv[1], tokenizer=None))
out = asyncio.new_event_loop().run_until_complete(srv.generate(
    prompt_ids=[1, 2, 3], sampling_params={"temperature": 1.0, "max_tokens": 8},
    request_id="det-0"))
print("TOKENS", out.token_ids)
"""


def test_sampling_is_reproducible_across_processes(tmp_path):
    """Same request id and prompt, two processes with different str-hash salts: same tokens."""
    import os
    import subprocess
    import sys

    from harts_verl.workers import testing

    path = testing.save_tiny_model("qwen2", str(tmp_path / "m"), seed=1)
    outs = []
    for salt in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": salt, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(
            [sys.executable, "-c", _SEED_SCRIPT, path],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        outs.append([ln for ln in res.stdout.splitlines() if ln.startswith("TOKENS")])
    assert len(outs[0]) == 1 and outs[0] == outs[1], outs


def _gen_id(server, prompt, request_id, **sp):
    return asyncio.new_event_loop().run_until_complete(
        server.generate(prompt_ids=prompt, sampling_params=sp, request_id=request_id)
    )


def test_sampling_params_seed_is_honoured(server):
    a = _gen_id(server, [1, 2, 3], "a", temperature=1.0, max_tokens=8, seed=11).token_ids
    b = _gen_id(server, [1, 2, 3], "b", temperature=1.0, max_tokens=8, seed=11).token_ids
    c = _gen_id(server, [1, 2, 3], "a", temperature=1.0, max_tokens=8, seed=12).token_ids
    assert a == b and a != c


def test_max_new_tokens_rule():
    """vLLM's rule in veRL's server: default min(response_length, lengths left), clamp to
    [1, room]; an explicit 0 is one token, never the whole context."""
    from harts_verl.workers.rollout.cpu_server import max_new_tokens

    def n(sp, prompt, max_model_len=32):
        return max_new_tokens(
            sp, prompt, max_model_len=max_model_len, config_prompt_length=16, response_length=16
        )

    assert n({}, 3) == 16  # not the 29 tokens of room
    assert n({"max_tokens": None}, 3) == 16
    assert n({}, 20) == 12 and n({}, 31) == 1
    assert n({"max_tokens": 0}, 3) == 1 and n({"max_tokens": -4}, 3) == 1
    assert n({"max_tokens": 5}, 3) == 5 and n({"max_new_tokens": 5}, 3) == 5
    assert n({"max_tokens": 100}, 3) == 29  # never past the room
    assert n({"max_tokens": np_int(100)}, 30) == 2
    # a larger max_model_len raises the cap, not the default
    assert n({}, 3, max_model_len=64) == 16 and n({"max_tokens": 100}, 3, max_model_len=64) == 61
    assert n({}, 40, max_model_len=64) == 1
    with pytest.raises(TypeError, match=r"sampling_params\.max_tokens: expected an int, got 2\.5"):
        n({"max_tokens": 2.5}, 3)
    with pytest.raises(TypeError, match=r"sampling_params\.max_new_tokens"):
        n({"max_new_tokens": "8"}, 3)
    with pytest.raises(ValueError, match=r"prompt_ids: 32 tokens leave no room"):
        n({}, 32)


def test_generation_length_on_the_server(server):
    sp = {"temperature": 1.0, "ignore_eos": True}
    assert len(_gen(server, [1, 2, 3], max_tokens=0, **sp).token_ids) == 1
    assert len(_gen(server, [1, 2, 3], **sp).token_ids) == 16
    assert len(_gen(server, [1, 2, 3], max_tokens=100, **sp).token_ids) == 29


def test_load_weights_refuses_unknown_tensors(server):
    """A tensor that matches no parameter by name and shape is an error, not a silent skip (a
    rollout keeping old weights would sample off-policy); nothing is loaded then."""
    before = dict(server.model.state_dict())
    name = next(n for n, _ in server.model.named_parameters())
    bad = [(name, torch.ones_like(before[name])), ("no.such.weight", torch.zeros(2))]
    with pytest.raises(ValueError, match=r"1 tensors match no parameter.*no\.such\.weight"):
        server.load_weights(bad)
    assert torch.equal(server.model.state_dict()[name], before[name])
    wrong_shape = [(name, torch.zeros(3))]
    with pytest.raises(ValueError, match="match no parameter"):
        server.load_weights(wrong_shape)


def test_load_weights_of_a_tied_model(tmp_path):
    """A model with tied input/output embeddings (Qwen2.5-0.5B style): veRL's sync sends its
    ``state_dict()``, ``lm_head.weight`` included; every tensor loads (no refusal)."""
    from harts_verl.workers import testing
    from harts_verl.workers.rollout.cpu_server import HFGenerationServer

    model = testing.tiny_hf_model("qwen2", seed=1, vocab_size=64)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(str(tmp_path / "tied"))
    srv = HFGenerationServer(
        SimpleNamespace(max_model_len=None, prompt_length=16, response_length=16),
        SimpleNamespace(path=str(tmp_path / "tied"), tokenizer=None),
    )
    assert srv.model.lm_head.weight is srv.model.model.embed_tokens.weight
    actor = testing.tiny_hf_model("qwen2", seed=2, vocab_size=64)
    actor.config.tie_word_embeddings = True
    actor.tie_weights()
    sd = actor.state_dict()
    assert "lm_head.weight" in sd
    assert srv.load_weights(list(sd.items())) == len(sd)
    for k, v in sd.items():
        assert torch.equal(srv.model.state_dict()[k], v), k


def test_serves_a_kimi_linear_checkpoint(tmp_path):
    """A Kimi-Linear checkpoint is served as its harts_hybrid conversion: sampling re-reads the
    prefix (no KV cache) and equals step-by-step full forwards; the weight sync arrives in
    Kimi-Linear's names (what the engine exports for such a model) and is converted back."""
    from safetensors.torch import save_file

    from harts_verl.models import checkpoints, kimi_linear
    from harts_verl.models.config import preset
    from harts_verl.models.hybrid import HybridForCausalLM
    from harts_verl.workers.rollout.cpu_server import HFGenerationServer

    cfg = preset("kimi_tiny", vocab_size=64)
    torch.manual_seed(0)
    native = HybridForCausalLM(cfg)
    ckpt = tmp_path / "kimi"
    ckpt.mkdir()
    weights = checkpoints.source_state_dict_from_hybrid(
        kimi_linear.FORMAT, native.state_dict(), cfg
    )
    save_file({k: v.contiguous() for k, v in weights.items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(kimi_linear.kimi_linear_config_from_hybrid(cfg)))
    srv = HFGenerationServer(
        SimpleNamespace(max_model_len=None, prompt_length=16, response_length=16),
        SimpleNamespace(path=str(ckpt), tokenizer=None),
    )
    out = _gen(srv, [1, 2, 3], temperature=0, max_tokens=5)
    ids = [1, 2, 3]
    with torch.no_grad():
        for _ in range(5):
            ids.append(int(srv.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert out.token_ids == ids[3:]
    torch.manual_seed(1)
    other = HybridForCausalLM(cfg)
    sync = checkpoints.source_state_dict_from_hybrid(kimi_linear.FORMAT, other.state_dict(), cfg)
    assert srv.load_weights(list(sync.items())) == len(other.state_dict())
    for k, v in other.state_dict().items():
        assert torch.equal(srv.model.model.state_dict()[k], v), k


def test_load_weights_repacks_per_expert_tensors(tmp_path):
    """veRL's weight sync unpacks transformers' packed experts into vLLM's per-expert names
    (``unfuse_moe_params``); the CPU server packs them back (they were dropped before)."""
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    from harts_verl.workers import testing
    from harts_verl.workers.rollout.cpu_server import HFGenerationServer

    path = testing.save_tiny_model("qwen3_moe", str(tmp_path / "moe"), seed=1)
    srv = HFGenerationServer(
        SimpleNamespace(max_model_len=None, prompt_length=16, response_length=16),
        SimpleNamespace(path=path, tokenizer=None),
    )
    other = testing.tiny_hf_model("qwen3_moe", seed=2)
    sent = list(unfuse_moe_params(other.state_dict().items(), "qwen3_moe"))
    assert any(".experts.0.gate_proj.weight" in n for n, _ in sent)
    assert srv.load_weights(sent) == len(sent)
    mine = srv.model.state_dict()
    for k, v in other.state_dict().items():
        assert torch.equal(mine[k], v), k


@pytest.mark.parametrize("kind", ["recurrent_gemma", "mamba", "mistral4"])
def test_serves_models_without_a_kv_cache_output_or_a_causal_lm_mapping(tmp_path, kind):
    """RecurrentGemma / Mamba return no ``past_key_values`` (the server re-reads the prefix: it
    used to raise AttributeError on the first call); transformers maps Mistral 4 only as an
    image-text-to-text model (loaded with the class veRL's engine takes). Greedy equals argmax
    decoding by full forwards, and the log-probs are the model's."""
    from harts_verl.workers import testing
    from harts_verl.workers.rollout.cpu_server import HFGenerationServer

    path = testing.save_tiny_model(kind, str(tmp_path / kind), seed=3)
    cfg = SimpleNamespace(max_model_len=None, prompt_length=16, response_length=6)
    srv = HFGenerationServer(cfg, SimpleNamespace(path=path, tokenizer=None))
    out = asyncio.run(
        srv.generate([1, 2, 3], {"temperature": 0, "logprobs": True, "ignore_eos": True}, "r")
    )
    assert len(out.token_ids) == 6
    ids = [1, 2, 3]
    with torch.no_grad():
        for tok, lp in zip(out.token_ids, out.log_probs):
            logp = torch.log_softmax(srv.model(torch.tensor([ids])).logits[0, -1].float(), -1)
            assert tok == int(logp.argmax()) and abs(float(logp[tok]) - lp) <= 1e-4
            ids.append(tok)


def test_bad_requests_are_named(server):
    """An empty prompt, sampling values vLLM refuses, and penalties this server does not apply
    are errors naming the field (they failed inside the model, or were silently ignored)."""
    with pytest.raises(ValueError, match="prompt_ids: empty prompt"):
        _gen(server, [], temperature=0)
    for sp, err, msg in [
        ({"top_p": 0.0}, ValueError, "sampling_params.top_p"),
        ({"top_p": 1.5}, ValueError, "sampling_params.top_p"),
        ({"temperature": -1.0}, ValueError, "sampling_params.temperature"),
        ({"temperature": float("nan")}, ValueError, "sampling_params.temperature"),
        ({"temperature": 10**400}, ValueError, "sampling_params.temperature"),  # no Overflow
        ({"temperature": "1"}, TypeError, "sampling_params.temperature"),
        ({"top_k": 2.5}, TypeError, "sampling_params.top_k"),
        ({"repetition_penalty": 5.0}, ValueError, "repetition_penalty: 5.0 is not supported"),
        ({"presence_penalty": 0.5}, ValueError, "presence_penalty"),
        ({"min_p": 0.1}, ValueError, "min_p"),
        ({"top_k": -5}, ValueError, "sampling_params.top_k: expected -1, 0"),
        ({"min_tokens": 3}, ValueError, "sampling_params.min_tokens: 3 is not supported"),
        ({"n": 2}, ValueError, "sampling_params.n"),
        ({"logit_bias": {5: -100.0}}, ValueError, "sampling_params.logit_bias"),
        ({"stop": ["</tool>"]}, ValueError, "sampling_params.stop"),
        ({"stop": "x"}, ValueError, "sampling_params.stop"),
        ({"bad_words": 3}, TypeError, "sampling_params.bad_words"),
        ({"stop_token_ids": 5}, TypeError, "sampling_params.stop_token_ids"),
        ({"stop_token_ids": [2.5]}, TypeError, "sampling_params.stop_token_ids"),
        # vLLM parameters this server does not apply, other than None (they were ignored)
        ({"structured_outputs": {"json": {}}}, ValueError, "sampling_params.structured_outputs"),
        ({"truncate_prompt_tokens": 8}, ValueError, "sampling_params.truncate_prompt_tokens: 8"),
        ({"prompt_logprobs": 0}, ValueError, "sampling_params.prompt_logprobs: 0 is not"),
        ({"thinking_token_budget": 4}, ValueError, "sampling_params.thinking_token_budget"),
        ({"logits_processors": [print]}, ValueError, "sampling_params.logits_processors"),
        # no vLLM sampling parameter at all (a misspelt key was silently ignored)
        ({"temprature": 0.0}, ValueError, "sampling_params.temprature: not a sampling param"),
        ({"top_p": 0.5, "max_token": 3}, ValueError, r"sampling_params.max_token: .*\['max_"),
    ]:
        with pytest.raises(err, match=msg):
            _gen(server, [1, 2], **sp)
    # token ids outside the model's vocabulary (the embedding raised an unnamed IndexError)
    vocab = server.vocab_size
    for prompt, err, msg in [
        ([1, vocab], ValueError, rf"prompt_ids\[1\]: token id {vocab} is outside .*\[0, {vocab}\)"),
        ([-1], ValueError, r"prompt_ids\[0\]: token id -1"),
        ([1, 2.0], TypeError, "prompt_ids: expected a flat list of int token ids, got 2.0"),
        ([[1, 2]], TypeError, "prompt_ids"),
        ("12", TypeError, "prompt_ids"),
        (torch.tensor(5), TypeError, "prompt_ids: expected a list of token ids"),
        ([1, 2**70], ValueError, r"prompt_ids\[1\]: token id 1180591620717411303424 is outside"),
    ]:
        with pytest.raises(err, match=msg):
            _gen(server, prompt, temperature=0)
    # numpy's uint64 beside signed ints (numpy promotes them to float64) is read exactly (it
    # raised StopIteration)
    import numpy as np

    mixed = _gen(server, [np.uint64(1), 2], temperature=0, max_tokens=2)
    assert mixed.token_ids == _gen(server, [1, 2], temperature=0, max_tokens=2).token_ids
    # neutral values of the parameters the server does not apply are accepted
    sp = {"stop": None, "logit_bias": {}, "min_tokens": 0, "n": 1, "bad_words": []}
    assert len(_gen(server, [1, 2], max_tokens=2, temperature=0, **sp).token_ids) == 2
    sp = {"structured_outputs": None, "prompt_logprobs": None, "logits_processors": []}
    assert len(_gen(server, [1, 2], max_tokens=2, temperature=0, **sp).token_ids) == 2
    # vLLM's text-output options and extra_args change no token id: accepted, same tokens
    plain = _gen(server, [1, 2], max_tokens=3, temperature=0).token_ids
    sp = {"skip_special_tokens": False, "include_stop_str_in_output": True, "extra_args": {}}
    assert _gen(server, [1, 2], max_tokens=3, temperature=0, **sp).token_ids == plain
    # veRL's own request: neutral values, None for unset ones
    sp = {"temperature": None, "top_p": None, "top_k": None, "repetition_penalty": 1.0}
    assert len(_gen(server, [1, 2], max_tokens=2, **sp).token_ids) == 2
    # numbers of other real types (numpy's float32 is no Python float)
    sp = {"temperature": np.float32(0.7), "top_p": np.float32(0.9), "top_k": np.int64(5)}
    assert len(_gen(server, [1, 2], max_tokens=2, **sp).token_ids) == 2


def test_tiny_temperature_is_raised_and_tiny_top_p_keeps_the_top_token(tmp_path):
    """As vLLM: a temperature in (0, 0.01) samples at 0.01 (1e-45 crashed in multinomial, 1e-6
    returned log-probs of 0.0), 0 alone is greedy; a top_p that rounds to 0 in float32 keeps
    the most likely token (it masked every token and crashed)."""
    from harts_verl.workers import testing
    from harts_verl.workers.rollout.cpu_server import HFGenerationServer, sampling_options

    for t in (1e-45, 1e-6, 0.005):
        assert sampling_options({"temperature": t})[0] == 0.01
    assert sampling_options({"temperature": 0})[0] == 0.0
    assert sampling_options({"temperature": 0.02})[0] == 0.02
    path = testing.save_tiny_model("qwen2", str(tmp_path / "qwen2"), seed=1)  # untied top tokens
    cfg = SimpleNamespace(max_model_len=None, prompt_length=16, response_length=16)
    server = HFGenerationServer(cfg, SimpleNamespace(path=path, tokenizer=None))
    at_min = _gen(server, [1, 2, 3], temperature=0.01, max_tokens=4, logprobs=True, seed=3)
    for t in (1e-6, 1e-45):
        out = _gen(server, [1, 2, 3], temperature=t, max_tokens=4, logprobs=True, seed=3)
        assert out.token_ids == at_min.token_ids and out.log_probs == at_min.log_probs
    greedy = _gen(server, [1, 2, 3], temperature=0, max_tokens=4, logprobs=True)
    assert min(greedy.log_probs) < -1e-3  # raw log-probs: a real distribution, not a one-hot
    tiny_p = _gen(server, [1, 2, 3], temperature=1.0, top_p=1e-46, max_tokens=4, logprobs=True)
    assert tiny_p.token_ids == greedy.token_ids
    assert tiny_p.log_probs == [0.0] * len(greedy.token_ids)


def test_weight_update_waits_for_a_running_generation(tmp_path):
    """A weight update (veRL's async trainer modes sync weights while a request may run) waits
    for the running sample: one output, one policy, tagged with that policy's global step (it
    landed mid-generation: the old weights' tokens, then the new ones', tagged with the new
    step)."""
    import threading

    from harts_verl.workers import testing
    from harts_verl.workers.rollout.cpu_server import HFGenerationServer

    path = testing.save_tiny_model("qwen2", str(tmp_path / "q"), seed=1)
    cfg = SimpleNamespace(max_model_len=None, prompt_length=16, response_length=40)
    server = HFGenerationServer(cfg, SimpleNamespace(path=path, tokenizer=None))
    server.eos_token_ids = ()  # no early stop
    server.set_global_steps(1)
    sp = {"temperature": 0, "max_tokens": 30}
    ref = _gen(server, [1, 2, 3], **sp)
    started = threading.Event()

    def slow(module, args, kwargs=None):
        started.set()
        started.wait()
        threading.Event().wait(0.005)  # a slow step: the update arrives mid-generation

    server.model.register_forward_pre_hook(slow)

    async def run():
        started.clear()
        task = asyncio.ensure_future(
            server.generate(prompt_ids=[1, 2, 3], sampling_params=sp, request_id="r")
        )
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        named = [
            (n, torch.zeros_like(p)) for n, p in server.model.named_parameters() if "lm_head" in n
        ]
        server.load_weights(named)  # the trainer's sync call
        server.set_global_steps(2)
        return await task

    out = asyncio.new_event_loop().run_until_complete(run())
    assert out.token_ids == ref.token_ids and out.extra_fields == {"global_steps": 1}
    after = _gen(server, [1, 2, 3], **sp)
    assert set(after.token_ids) == {0} and after.extra_fields == {"global_steps": 2}


def test_adapter_refuses_a_delta_wire_format():
    """veRL's delta checkpoint engine sends ``wire_format="delta_flush"`` (vLLM only): the
    adapter names it (it read the stream as full tensors, an unclear AttributeError)."""
    from harts_verl.workers.rollout import cpu_server

    update = cpu_server.HFServerAdapter.update_weights
    with pytest.raises(ValueError, match="wire_format: harts_hf takes 'named_tensors'"):
        asyncio.new_event_loop().run_until_complete(
            update(SimpleNamespace(), iter(()), wire_format="delta_flush")
        )
