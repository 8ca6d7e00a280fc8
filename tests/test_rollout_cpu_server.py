"""CPU rollout server ``harts_hf``: real sampling with a tiny model, TokenOutput contract,
weight loading, and registration where veRL looks for rollout replicas and server adapters."""

from __future__ import annotations

import asyncio
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
