"""transformers' own Kimi-Linear and Ling 3 (>= 5.23) as oracles, run in a subprocess whose
``PYTHONPATH`` puts that transformers first (veRL pins transformers < 5.11, which has neither).
Imports torch and transformers only, never harts_verl.

``python _source_oracle.py build SPEC.json OUT`` builds a random float64 model of the config in
SPEC (``config``, with its ``model_type``: ``kimi_linear`` or ``bailing_hybrid``; ``seed``;
``sequences``: token lists), saves it with ``save_pretrained`` into ``OUT/checkpoint`` (the
source's own format), saves its in-memory state dict under transformers' names into
``OUT/inmemory``, and writes ``OUT/logits.pt`` (one ``[L, V]`` float64 tensor per sequence, each
sequence run alone).
``python _source_oracle.py logits SPEC.json CKPT OUT.pt`` loads CKPT with transformers and
writes its logits for SPEC's sequences.

Alignments, with transformers' numerics otherwise untouched:
* float32 islands (KDA, gates, router, gated norm) are lifted to float64 by giving the modeling
  module a ``torch`` whose ``float32`` is ``float64`` and making ``Tensor.float`` ``double`` (this
  process runs the oracle only), so the comparison can be exact;
* Kimi-Linear only: the latent-KV / latent-q RMSNorms get ``rms_norm_eps`` (Moonshot's model
  and vLLM use it; transformers hard-codes 1e-6).
"""

from __future__ import annotations

import json
import math
import os
import sys
import types

sys.modules["fla"] = None  # never route to Triton kernels on the CPU

import torch  # noqa: E402


def _lift_float32(module: types.ModuleType) -> None:
    torch.Tensor.float = torch.Tensor.double  # ``x.float()`` islands (gates, decay masks)
    proxy = types.ModuleType("torch_float64")
    proxy.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.float32 = proxy.float = torch.float64
    module.torch = proxy


_CLASSES = {
    "kimi_linear": ("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM"),
    "bailing_hybrid": ("bailing_hybrid", "BailingHybridConfig", "BailingHybridForCausalLM"),
}


def _classes(model_type: str):
    """(config class, causal-LM class) of ``model_type``, its float32 islands lifted."""
    import importlib

    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 23):
        raise SystemExit(f"transformers {transformers.__version__} is too old (need 5.23+)")
    name, cfg_cls, lm_cls = _CLASSES[model_type]
    mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    _lift_float32(mod)
    return getattr(mod, cfg_cls), getattr(mod, lm_cls)


def _align(model, eps: float) -> None:
    if model.config.model_type != "kimi_linear":
        return
    for m in model.modules():
        for name in ("kv_a_layernorm", "q_a_layernorm"):
            norm = getattr(m, name, None)
            if norm is not None:
                norm.variance_epsilon = eps


def _randomize(model, seed: int) -> None:
    """Every parameter and buffer random, norms near 1, KDA decays in their usual ranges."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        biases = [  # the routers' correction biases are buffers; rope tables are not weights
            (n, b)
            for n, b in model.named_buffers()
            if n.endswith(("correction_bias", "expert_bias"))
        ]
        for name, p in list(model.named_parameters()) + biases:
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g)
                p.copy_(dt.exp() + torch.log(-torch.expm1(-dt.exp())))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("e_score_correction_bias", "expert_bias")):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def _logits(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], dtype=torch.long)
            out.append(model(input_ids=ids).logits[0].to(torch.float64))
    return out


def build(spec_path: str, out: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    config = dict(spec["config"])
    config_cls, lm_cls = _classes(config.pop("model_type"))
    cfg = config_cls(**config)
    cfg._experts_implementation = "eager"
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec.get("seed", 0))
    model = lm_cls(cfg).double().eval()
    _randomize(model, spec.get("seed", 0))
    _align(model, cfg.rms_norm_eps)
    model.save_pretrained(os.path.join(out, "checkpoint"))
    from safetensors.torch import save_file

    inmem = os.path.join(out, "inmemory")
    os.makedirs(inmem, exist_ok=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(inmem, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "checkpoint", "config.json")) as f:
        saved = json.load(f)
    with open(os.path.join(inmem, "config.json"), "w") as f:
        json.dump(saved, f)
    torch.save(_logits(model, spec["sequences"]), os.path.join(out, "logits.pt"))


def logits(spec_path: str, ckpt: str, out: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    _, lm_cls = _classes(spec["config"]["model_type"])
    model = lm_cls.from_pretrained(
        ckpt, dtype=torch.float64, experts_implementation="eager", attn_implementation="eager"
    ).eval()
    # Fresh allocations, as the in-memory model of ``build`` has: safetensors maps each tensor
    # at its offset in the file, and BLAS results can depend on a buffer's alignment (seen on
    # AMD EPYC: 1e-15 between two loads of the same weights from differently laid out files).
    with torch.no_grad():
        for module in model.modules():
            for _name, p in module.named_parameters(recurse=False):
                p.data = p.data.clone()
            for name, b in module.named_buffers(recurse=False):
                if b is not None:
                    module._buffers[name] = b.clone()
    _align(model, model.config.rms_norm_eps)
    torch.save(_logits(model, spec["sequences"]), out)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"build": build, "logits": logits}[cmd](*args)
