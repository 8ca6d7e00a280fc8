"""``harts-verl check``: fidelity audit of tree vs expanded execution on your model and batch.

Inputs: ``--model`` an HF model directory (weights) or a ``config.json`` (random weights,
seeded) of any model that runs in tree mode — Qwen3-Next, the Qwen3.5 / Qwen3.5-MoE text models
(``qwen3_5_text``, ``qwen3_5_moe_text``) and their multi-modal wrappers (the text model is
audited), OLMo Hybrid (``olmo_hybrid``), the native model (``harts_hybrid``), the full-attention
causal LMs of ``FULL_ATTENTION_MODEL_TYPES`` (Qwen2 / Qwen3 / Llama / Mistral, Qwen2-MoE /
Qwen3-MoE / Mixtral, DeepSeek-V3, GLM-4-MoE); ``--batch`` a dump of trajectories: a ``RolloutForest.save`` file (``.npz``), or a ``torch.save`` file (``.pt``)
holding a list of token-id lists or a dict with ``input_ids`` (list, or a nested tensor as in a
veRL batch). Prints JSON: max |Δlogp| tree vs expanded (``max_abs_dlogp``) and tree vs the
model's own forward of each trajectory alone (``own_forward_max_abs_dlogp``: HF's code, no tree
machinery, the independent oracle), MeanCos of the final hidden states' logits, per decoder
layer the max |Δ| of its output with the first layer whose difference exceeds ``--tol`` (None
when all stay within), and the batch's analytic FLOP ratio expanded ÷ tree
(:mod:`harts_verl.runtime.flops`; None for a model without a FLOP model).

Run: ``python -m harts_verl.workers.check --model DIR --batch FILE`` (the ``harts-verl check``
subcommand calls :func:`main`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch

__all__ = ["add_arguments", "decoder_layers", "load_sequences", "main", "run_check"]


def load_sequences(path: str) -> list[list[int]]:
    """Trajectories of a batch dump (see module doc): a ``RolloutForest.save`` ``.npz``, or a
    ``torch.save`` file of a list of token-id lists / 1-D integer tensors, a nested (jagged)
    ``input_ids`` tensor, or a mapping (dict, TensorDict) with ``input_ids`` — nested, a list,
    or dense ``[B, L]`` with ``attention_mask`` (the masked-in tokens of each row). Raises
    ``ValueError`` naming the file and what is wrong (no trajectories, non-integer ids, a
    missing key, a dense batch without its mask)."""
    from harts_verl.tree import RolloutForest

    if path.endswith(".npz"):
        f = RolloutForest.load(path)
        seqs = [f.tokens_of(i).tolist() for i in range(f.num_trajectories)]
    else:
        obj = torch.load(path, map_location="cpu", weights_only=False)
        seqs = _sequences_of(obj, path)
    if not seqs:
        raise ValueError(f"{path}: the batch has no trajectories")
    return seqs


def _sequences_of(obj: Any, path: str) -> list[list[int]]:
    mask = None
    if hasattr(obj, "keys") and callable(obj.keys):  # dict, TensorDict
        keys = list(obj.keys())
        if "input_ids" not in keys:
            raise ValueError(f"{path}: no 'input_ids' in the saved mapping (keys: {keys})")
        mask = obj["attention_mask"] if "attention_mask" in keys else None
        obj = obj["input_ids"]
    if isinstance(obj, torch.Tensor) and obj.is_nested:
        obj = list(obj.unbind())
    elif isinstance(obj, torch.Tensor):
        if obj.dim() == 1:
            obj = [obj]
        elif obj.dim() == 2 and mask is not None:
            if tuple(mask.shape) != tuple(obj.shape):
                raise ValueError(
                    f"{path}: attention_mask {tuple(mask.shape)} does not match input_ids "
                    f"{tuple(obj.shape)}"
                )
            obj = [row[m.bool()] for row, m in zip(obj, mask)]
        else:
            raise ValueError(
                f"{path}: input_ids is a dense {tuple(obj.shape)} tensor without attention_mask "
                "(padding cannot be told from tokens); save a nested tensor or token lists"
            )
    if not isinstance(obj, list | tuple):
        raise ValueError(f"{path}: expected trajectories as a list, got {type(obj).__name__}")
    seqs = []
    for i, t in enumerate(obj):
        a = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise ValueError(
                f"{path}: trajectory {i}: expected a 1-D sequence of integer token ids, got "
                f"dtype {a.dtype} shape {a.shape}"
            )
        seqs.append(a.astype(np.int64).tolist())
    return seqs


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal LM (``model.layers``), of a multi-modal wrapper's text
    model (``model.language_model.layers``) or of the native model (its ``layers``, also under
    the HF wrapper's ``model``); empty when none is found."""
    from harts_verl.models.adapter import as_tree_model

    candidates = [model, getattr(model, "model", None)]
    inner = getattr(model, "model", None)
    candidates.append(getattr(inner, "language_model", None))
    try:
        candidates.append(as_tree_model(model))
    except TypeError:
        pass
    for c in candidates:
        if c is None:
            continue
        for owner in (c, getattr(c, "model", None), getattr(c, "base", None)):
            layers = getattr(owner, "layers", None)
            if isinstance(layers, torch.nn.ModuleList) and len(layers):
                return list(layers)
    return []


def _flop_ratio(model: Any, seqs: list[list[int]], chunk_size: int) -> float | None:
    """Analytic expanded ÷ tree forward FLOPs of the batch (None without a FLOP model)."""
    from harts_verl.ops.layout import TreeLayout
    from harts_verl.runtime.flops import ideal_flop_ratio, model_shape
    from harts_verl.tree import RolloutForest

    try:
        shape = model_shape(model.config)
    except (ValueError, AttributeError):
        return None
    forest = RolloutForest.from_sequences(seqs)
    replay = 0
    if shape.linear_per_token:
        layout = TreeLayout(forest, chunk_size=chunk_size, device="cpu")
        replay = int(layout.linear_plan.plan.replay_tokens)
    return float(ideal_flop_ratio(shape, forest, replay)["ideal_flop_ratio"])


def _layer_outputs(runner: Any, model: Any, seqs: list[list[int]]) -> list[list[torch.Tensor]]:
    """Per decoder layer, per trajectory: the layer's output rows ``[L_i, D]``."""
    from harts_verl.ops.layout import TreeLayout

    layers = decoder_layers(model)
    captured: list[torch.Tensor] = []
    hooks = [
        lyr.register_forward_hook(
            lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out)
        )
        for lyr in layers
    ]
    try:
        forest = runner.build_forest(seqs)
        layout = TreeLayout(forest, chunk_size=runner.chunk_size, device=runner.device)
        with torch.no_grad():
            runner.model(layout.token_ids, layout)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for h in captured:
        h2 = h[0] if h.dim() == 3 else h
        out.append([h2[torch.as_tensor(forest.rows_of(i))] for i in range(len(seqs))])
    return out


def _own_forward_log_probs(model: Any, seqs: list[list[int]]) -> list[torch.Tensor] | None:
    """Per trajectory, the model's own (non-tree) forward on that trajectory alone: log-probs of
    tokens 1.. ``[L_i - 1]`` in float64 (None for a model without an HF-style forward)."""
    if not callable(getattr(model, "forward", None)) or not hasattr(model, "config"):
        return None
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.as_tensor([s], dtype=torch.long, device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)[:-1]
            out.append(logp.gather(1, ids[0, 1:, None])[:, 0])
    return out


def run_check(
    model: Any, seqs: list[list[int]], *, chunk_size: int = 64, tol: float = 1e-5
) -> dict[str, Any]:
    """Tree vs expanded on one model and batch: the figures described in the module doc."""
    from harts_verl.runtime import ExpandedRunner, TreeRunner

    if not seqs:
        raise ValueError("seqs: the batch has no trajectories")

    tree = TreeRunner(model, chunk_size=chunk_size)
    exp = ExpandedRunner(model, chunk_size=chunk_size)
    lt, le = tree.log_probs(seqs), exp.log_probs(seqs)
    dlogp = max((float((a - b).abs().max()) for a, b in zip(lt, le) if a.numel()), default=0.0)
    ht, he = tree.hidden_states(seqs), exp.hidden_states(seqs)
    w = tree.model.lm_head.weight.detach()
    cos = torch.cat(
        [
            torch.nn.functional.cosine_similarity(
                a.double() @ w.double().T, b.double() @ w.double().T, dim=-1
            )
            for a, b in zip(ht, he)
        ]
    )
    per_layer = []
    if decoder_layers(model):
        lt_layers = _layer_outputs(tree, model, seqs)
        le_layers = _layer_outputs(exp, model, seqs)
        per_layer = [
            max(float((a.double() - b.double()).abs().max()) for a, b in zip(x, y))
            for x, y in zip(lt_layers, le_layers)
        ]
    first = next((k for k, d in enumerate(per_layer) if d > tol), None)
    own = _own_forward_log_probs(model, seqs)
    own_dlogp = (
        None
        if own is None
        else max(
            (float((a.double().cpu() - b.cpu()).abs().max()) for a, b in zip(lt, own) if a.numel()),
            default=0.0,
        )
    )
    return {
        "trajectories": len(seqs),
        "semantic_tokens": tree.last_stats.semantic_tokens,
        "compact_tokens": tree.last_stats.compact_tokens,
        "compression": tree.last_stats.compression,
        "max_abs_dlogp": dlogp,
        "own_forward_max_abs_dlogp": own_dlogp,
        "mean_cos": float(cos.mean()),
        "per_layer_max_abs_diff": per_layer,
        "first_divergent_layer": first,
        "tol": tol,
        "ideal_flop_ratio": _flop_ratio(model, seqs, chunk_size),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``check`` options (for ``harts-verl check``)."""
    p.add_argument("--model", required=True, help="HF model dir, or a config.json (random init)")
    p.add_argument("--batch", required=True, help="batch dump: forest .npz or torch .pt")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float64")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--tol", type=float, default=1e-5, help="per-layer divergence threshold")
    p.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the audit, print JSON."""
    p = argparse.ArgumentParser(prog="harts-verl check", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    """Run the audit for parsed ``check`` options and print JSON."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
    if args.dtype not in dtype:
        raise SystemExit(f"--dtype: expected one of {sorted(dtype)}, got {args.dtype!r}")
    from harts_verl.models.hf import load_causal_lm

    try:
        model = load_causal_lm(args.model, dtype=dtype[args.dtype], seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"--model: {e}") from None
    res = run_check(model, load_sequences(args.batch), chunk_size=args.chunk_size, tol=args.tol)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
