"""``harts-verl check``: fidelity audit of tree vs expanded execution on your model and batch.

Inputs: ``--model`` an HF model directory (weights) or a ``config.json`` (random weights,
seeded) of any model that runs in tree mode — Qwen3-Next, the Qwen3.5 / Qwen3.5-MoE text models
(``qwen3_5_text``, ``qwen3_5_moe_text``) and their multi-modal wrappers (the text model is
audited), OLMo Hybrid (``olmo_hybrid``), the native model (``harts_hybrid``), the full-attention
causal LMs of ``FULL_ATTENTION_MODEL_TYPES`` (Qwen2 / Qwen3 / Llama / Mistral, Qwen2-MoE /
Qwen3-MoE / Mixtral, DeepSeek-V3, GLM-4-MoE, OLMo 2 / OLMo 3, Phi-3, Seed-OSS, GLM-4,
Gemma 3, gpt-oss, ...), the Mamba-2 hybrids (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1) and the
short-conv hybrids (LFM2, LFM2-MoE); ``--batch`` a dump of trajectories: a ``RolloutForest.save``
file (``.npz``, told by its content whatever its name), or a ``torch.save`` file (``.pt``)
holding a list of token-id lists or a dict with ``input_ids`` (list, or a nested tensor as in a
veRL batch; every trajectory is audited at positions 0..L-1, and a dump whose ``position_ids``
differ gets a note on stderr), or a JSON / JSON Lines token file (``.json`` / ``.jsonl``: a
list of token ids per trajectory, or objects with ``input_ids``;
:mod:`harts_verl.tree.token_files`). Prints JSON: max |Δlogp| tree vs expanded (``max_abs_dlogp``) and tree vs the
model's own forward of each trajectory alone (``own_forward_max_abs_dlogp``: for an HF model
its own code, no tree machinery, the independent oracle; both null when no trajectory has two
tokens, so no log-prob was compared; ``own_forward_independent`` false for the native model,
Kimi-Linear and Ling 3, whose own forward runs this package's ops one trajectory at a time, so
a fault shared by those ops is not seen there), MeanCos of the final hidden states' logits
(float64, 4096 rows at a time), per decoder
layer the max |Δ| of its output with the first layer whose difference exceeds ``--tol`` (None
when all stay within), and the batch's analytic FLOP ratio expanded ÷ tree
(:mod:`harts_verl.runtime.flops`; None for a model without a FLOP model). A difference that is
not finite (NaN: a path produced NaN) is printed as null and named in ``non_finite``. With
``--fail-above X`` the result has a verdict, ``agree``: nothing non-finite, both log-prob
differences at most X and no layer above ``--tol``.

Exit status: 0, the audit ran (and, with ``--fail-above``, agreed); 3, it found a non-finite
difference or (``--fail-above``) a disagreement, the JSON printed all the same; 2, a bad input
(below); 1, an internal error.

Run: ``harts-verl check --model DIR --batch FILE`` or ``python -m harts_verl.workers.check
--model DIR --batch FILE``. Inputs are checked before the audit runs (:func:`load_inputs`: option
values, the model's type before its weights are built, the batch file and its token ids against
the model's vocabulary); a bad one ends the command with one line ``harts-verl check: --flag:
what is wrong`` on stderr and exit status 2 (``HARTS_VERL_DEBUG=1`` re-raises it with its
traceback). Errors of the audit itself are not input errors and keep their traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pickle
import re
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from harts_verl.ops.layout import check_chunk_size
from harts_verl.ops.logprobs import mean_logit_cosine
from harts_verl.tree._checks import (
    INT64_MAX,
    SEED_MAX,
    check_input_file,
    check_int,
    exact_integers,
    finite_float,
    finite_float_arg,
    int_arg,
    int_outside_int64,
)
from harts_verl.tree.token_files import (
    is_token_file,
    read_token_lists,
    trajectory_arrays,
    trajectory_lines,
)
from harts_verl.workers.positions import first_misplaced, token_rows


def _library_errors(*names: str) -> tuple[type[BaseException], ...]:
    """The exception classes ``module:Class`` of ``names`` that can be imported."""
    import importlib

    out = []
    for name in names:
        mod, _, cls = name.partition(":")
        try:
            out.append(getattr(importlib.import_module(mod), cls))
        except (ImportError, AttributeError):
            pass
    return tuple(out)


def _one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (library messages span several)."""
    return " ".join(str(exc).split())


# What reading a user's config raises: transformers 5 validates config fields and architecture
# checks through huggingface_hub's strict dataclasses, whose errors are plain Exceptions.
_HUB_ERRORS = _library_errors("huggingface_hub.errors:StrictDataclassError")
_CONFIG_ERRORS = (OSError, ValueError, KeyError, TypeError, *_HUB_ERRORS)
# What loading its weights raises besides: an unreadable safetensors file, weights whose shapes
# do not fit the config (transformers' RuntimeError).
_WEIGHT_ERRORS = (RuntimeError, *_library_errors("safetensors:SafetensorError"))

__all__ = [
    "INPUT_ERRORS",
    "add_arguments",
    "decoder_layers",
    "load_inputs",
    "load_sequences",
    "load_tree_model",
    "main",
    "run_check",
    "tree_model_config",
]

# Exceptions that mean "this input is bad" while options, models and batches are read (never
# caught around the audit itself, whose errors are bugs and keep their traceback).
INPUT_ERRORS = (ValueError, TypeError, OSError, pickle.UnpicklingError, EOFError)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def load_sequences(path: str) -> list[list[int]]:
    """Trajectories of a batch dump (see module doc): a token file (``.json`` / ``.jsonl``:
    :mod:`harts_verl.tree.token_files`), a ``RolloutForest.save`` ``.npz``, or a
    ``torch.save`` file of a list of token-id lists / 1-D integer tensors, a nested (jagged)
    ``input_ids`` tensor, or a mapping (dict, TensorDict) with ``input_ids`` — nested, a list,
    or dense ``[B, L]`` with ``attention_mask`` (the masked-in tokens of each row, one run of
    1s padded on the left / right: a 0 between 1s is refused; a list of
    rows with ``attention_mask`` is read as that dense batch) — or a veRL
    ``DataProto`` (its tensor batch, read as such a mapping). Raises
    ``ValueError`` naming the file and what is wrong (no trajectories, non-integer ids, a
    missing key, a dense batch without its mask), when the file does not exist or is a
    directory, and when it is neither a forest file nor readable by ``torch.load`` (a
    truncated or foreign file: the reader's message is included)."""
    from harts_verl.tree.inspect import load_forest

    if is_token_file(path):
        return [a.tolist() for a in read_token_lists(path)]
    names = _zip_names(path)  # read once: a forest archive or a torch.save zip, told apart
    pickled = names is not None and any(n.endswith(".pkl") for n in names)
    forest_file = names is not None and "format_version.npy" in names and not pickled
    if forest_file or (path.endswith(".npz") and not pickled):
        f = load_forest(path)
        seqs = [f.tokens_of(i).tolist() for i in range(f.num_trajectories)]
    else:
        check_input_file(path, "a batch file (.pt or .npz)")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except OSError:  # cannot be read (permissions, ...): named as it is
            raise
        except Exception as exc:  # a pickle can fail in any way (a missing module or class,
            # a failing __reduce__, ...): the file is not a batch we can read
            raise ValueError(
                f"{path}: not a torch.save file or a forest .npz ({type(exc).__name__}: {exc})"
            ) from exc
        seqs = _sequences_of(obj, path)
    if not seqs:
        raise ValueError(f"{path}: the batch has no trajectories")
    return seqs


def load_trajectory_arrays(path: str) -> list[np.ndarray]:
    """The trajectories of a batch file (:func:`load_sequences`' formats) as 1-D int64 arrays,
    each validated as :meth:`RolloutForest.from_sequences` validates it (a bad one named
    ``path: trajectory i``); a token file is read straight into its arrays."""
    if is_token_file(path):
        return read_token_lists(path)
    return trajectory_arrays(load_sequences(path), path)


def _zip_names(path: str) -> list[str] | None:
    """The member names of the zip archive at ``path``, or None when it is none. A
    ``RolloutForest.save`` archive (an ``.npz`` under any name) holds the forest's
    ``format_version.npy`` and no pickle, which a ``torch.save`` zip has (a ``torch.save``
    file named ``.npz`` is read as one)."""
    import zipfile

    try:
        if not os.path.isfile(path) or not zipfile.is_zipfile(path):
            return None
        with zipfile.ZipFile(path) as z:
            return z.namelist()
    except (OSError, zipfile.BadZipFile):
        return None


def _positions_note(positions: Any, mask: Any, seqs: list[list[int]], path: str) -> str | None:
    """A note when a dump's ``position_ids`` (nested ``[B, j]`` / ``[B, k, j]`` / ``[B, j, k]``,
    told apart by which dimension holds the tokens, dense ``[B, L]`` / ``[B, k, L]`` read
    through ``attention_mask``, a list of per-trajectory ``[L]`` / ``[k, L]``, or one
    trajectory's ``[L]``) are not ``0..L-1`` in some trajectory, or None (also for a layout it
    cannot read: the note is no check of the dump)."""
    try:
        return _positions_mismatch(positions, mask, seqs, path)
    except Exception:  # a malformed dump: its input_ids were read, there is nothing to note
        return None


def _positions_mismatch(positions: Any, mask: Any, seqs: list[list[int]], path: str) -> str | None:
    if isinstance(positions, torch.Tensor) and not positions.is_nested and positions.dim() == 1:
        positions = [positions]  # one trajectory's (as a 1-D input_ids is one trajectory)
        if isinstance(mask, torch.Tensor) and mask.dim() == 1:
            mask = mask[None]
    if isinstance(positions, list | tuple):  # per trajectory: [L] or [k, L] (padded with a mask)
        if len(positions) != len(seqs):
            return None
        found = None
        for i, p in enumerate(positions):
            t = torch.as_tensor(p)
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                t = t[..., mask[i].bool()]
            if not bool((t == torch.arange(len(seqs[i]))).all()):
                found = (i,)
                break
    else:
        if not isinstance(positions, torch.Tensor):
            return None
        lengths = torch.tensor([0] + [len(s) for s in seqs])
        offsets = lengths.cumsum(0)
        if positions.is_nested:
            rows = token_rows(positions, int(offsets[-1]))
        elif mask is not None and isinstance(mask, torch.Tensor) and positions.dim() in (2, 3):
            kept = [p[..., m.bool()] for p, m in zip(positions, mask)]  # [n] or [k, n] each
            rows = torch.cat([p.reshape(-1, p.shape[-1]) for p in kept], dim=-1)
        else:
            return None
        found = first_misplaced(rows, offsets) if rows is not None else None
    if found is None:
        return None
    i, n = found[0], len(seqs[found[0]])
    return (
        f"harts-verl check: note: {path}: position_ids of trajectory {i} are not 0..{n - 1}: "
        "the audit runs every trajectory at positions 0..L-1, as tree mode does (the "
        "harts_fsdp2 engine runs such a batch on the stock path, with its position_ids)"
    )


def _check_readable(t: Any, path: str, name: str) -> None:
    """ValueError naming ``name`` when ``t`` is a tensor whose values cannot be read as a
    batch's: a meta tensor (no data) or a sparse / other non-dense layout (a nested tensor is
    read); torch's own errors for them came from deep inside (exit status 1, a traceback)."""
    if not isinstance(t, torch.Tensor):
        return
    if t.device.type == "meta":
        raise ValueError(f"{path}: {name}: a meta tensor holds no data")
    if t.layout != torch.strided and not t.is_nested:
        raise ValueError(f"{path}: {name}: expected a dense or nested tensor, got {t.layout}")


def _sequences_of(obj: Any, path: str) -> list[list[int]]:
    mask = positions = None
    if hasattr(obj, "batch") and hasattr(obj, "non_tensor_batch"):  # a veRL DataProto
        if obj.batch is None:
            raise ValueError(f"{path}: the saved DataProto has no tensor batch")
        obj = obj.batch
    if hasattr(obj, "keys") and callable(obj.keys):  # dict, TensorDict
        keys = list(obj.keys())
        if "input_ids" not in keys:
            raise ValueError(f"{path}: no 'input_ids' in the saved mapping (keys: {keys})")
        mask = obj["attention_mask"] if "attention_mask" in keys else None
        positions = obj["position_ids"] if "position_ids" in keys else None
        obj = obj["input_ids"]
        _check_readable(mask, path, "attention_mask")
        if mask is not None and isinstance(obj, list | tuple):  # rows of one padded width
            for i, r in enumerate(obj):
                _check_readable(r, path, f"input_ids row {i}")
            rows = [r.tolist() if hasattr(r, "tolist") else r for r in obj]
            if not all(isinstance(r, list | tuple) for r in rows):
                raise ValueError(f"{path}: input_ids: expected rows of token ids")
            widths = sorted({len(r) for r in rows})
            if len(widths) > 1:
                raise ValueError(
                    f"{path}: attention_mask given with input_ids rows of different widths "
                    f"({widths}): expected a padded [B, L] batch"
                )
            try:
                obj = torch.tensor(rows) if rows else torch.zeros(0, 0, dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(
                    f"{path}: input_ids: expected rows of integer token ids (ragged nesting or "
                    "non-numbers found)"
                ) from None
            if isinstance(mask, list | tuple):  # its rows as the ids' rows
                try:
                    mask = torch.tensor([m.tolist() if hasattr(m, "tolist") else m for m in mask])
                except (TypeError, ValueError, RuntimeError):
                    raise ValueError(
                        f"{path}: attention_mask: expected rows of 0 / 1 values as wide as the "
                        "input_ids rows"
                    ) from None
    _check_readable(obj, path, "input_ids")
    if isinstance(obj, torch.Tensor) and obj.is_nested:
        obj = list(obj.unbind())
    elif isinstance(obj, torch.Tensor):
        if obj.dim() not in (1, 2):
            raise ValueError(
                f"{path}: input_ids: expected a 1-D trajectory or a 2-D [B, L] batch, got a "
                f"{obj.dim()}-D {tuple(obj.shape)} tensor"
            )
        if obj.dim() == 1 and mask is None:
            obj = [obj]
        elif mask is not None:
            if obj.dim() == 1:  # one trajectory with its mask: a [1, L] batch
                obj = obj[None]
                if isinstance(mask, torch.Tensor) and mask.dim() == 1:
                    mask = mask[None]
            if not isinstance(mask, torch.Tensor):
                raise ValueError(
                    f"{path}: attention_mask: expected a tensor, got {type(mask).__name__}"
                )
            if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError(f"{path}: attention_mask: expected only 0 / 1 values")
            if tuple(mask.shape) != tuple(obj.shape):
                raise ValueError(
                    f"{path}: attention_mask {tuple(mask.shape)} does not match input_ids "
                    f"{tuple(obj.shape)}"
                )
            # a row's tokens are one run (padding on the left / right, as veRL pads): a 0
            # between 1s would join the tokens on its two sides into one trajectory
            keep = mask.bool()
            after_first = keep.long().cummax(dim=1).values.bool()
            before_last = keep.flip(1).long().cummax(dim=1).values.flip(1).bool()
            gap = after_first & before_last & ~keep
            if bool(gap.any()):
                r, c = (int(x) for x in gap.nonzero()[0])
                raise ValueError(
                    f"{path}: attention_mask row {r}: a gap (0 at position {c} between 1s): "
                    "expected each row's tokens in one run, padded on the left / right only "
                    "(the tokens on both sides would be joined into one trajectory)"
                )
            obj = [row[m] for row, m in zip(obj, keep)]
        else:
            raise ValueError(
                f"{path}: input_ids is a dense {tuple(obj.shape)} tensor without attention_mask "
                "(padding cannot be told from tokens); save a nested tensor or token lists"
            )
    if not isinstance(obj, list | tuple):
        raise ValueError(f"{path}: expected trajectories as a list, got {type(obj).__name__}")
    seqs = []
    for i, t in enumerate(obj):
        _check_readable(t, path, f"trajectory {i}")
        try:
            a = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
        except ValueError:  # numpy's ragged nesting error
            raise ValueError(
                f"{path}: trajectory {i}: expected a flat sequence of integer token ids, got "
                "ragged nesting"
            ) from None
        except TypeError as exc:  # a dtype numpy has no match for (bfloat16, float8, ...)
            what = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else str(exc)
            raise ValueError(
                f"{path}: trajectory {i}: expected a 1-D sequence of integer token ids, got {what}"
            ) from None
        if a.ndim == 1 and a.dtype.kind in "fO" and isinstance(t, list | tuple) and t:
            # integers numpy could not hold together (past int64; uint64 with signed: float64);
            # an empty trajectory is named as such by the runner
            big = int_outside_int64(t)
            if big is not None:
                raise ValueError(
                    f"{path}: trajectory {i}: token id {big} is beyond int64 (outside any "
                    "vocabulary)"
                )
            exact = exact_integers(t)  # exactly, where every item is an integer
            if exact is not None:
                a = exact
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise ValueError(
                f"{path}: trajectory {i}: expected a 1-D sequence of integer token ids, got "
                f"dtype {a.dtype} shape {a.shape}"
            )
        if a.size and a.dtype.kind == "u" and int(a.max()) > INT64_MAX:
            raise ValueError(
                f"{path}: trajectory {i}: token id {int(a.max())} is beyond int64 (outside "
                "any vocabulary)"
            )
        seqs.append(a.astype(np.int64).tolist())
    note = _positions_note(positions, mask, seqs, path)
    if note is not None:
        print(note, file=sys.stderr)
    return seqs


def _max_abs_diff(pairs: Any) -> float | None:
    """The largest ``|a - b|`` over tensor pairs (float64, on the CPU; empty pairs skipped),
    NaN if any difference is NaN (Python's ``max`` drops a NaN that is not first: a NaN
    trajectory read as agreement); None when there is nothing to compare."""
    diffs = [
        float((a.double().cpu() - b.double().cpu()).abs().max()) for a, b in pairs if a.numel()
    ]
    return float(np.max(diffs)) if diffs else None


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


def _flop_ratio(
    model: Any, seqs: list[list[int]], chunk_size: int, windows: list[int | None] | None = None
) -> float | None:
    """Analytic expanded ÷ tree forward FLOPs of the batch (None without a FLOP model);
    ``windows``: each softmax-attention layer's sliding window (see ``ideal_flop_ratio``)."""
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
    return float(ideal_flop_ratio(shape, forest, replay, chunk_size, windows)["ideal_flop_ratio"])


_ROWS = 4096  # rows per float64 chunk of the audit's comparisons (bounded memory)


def _rows_max_abs_diff(
    a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor, ib: torch.Tensor
) -> float:
    """``max |a[ia] - b[ib]|`` in float64, :data:`_ROWS` rows at a time (NaN if any is NaN)."""
    out = torch.zeros((), dtype=torch.float64)
    for k in range(0, int(ia.shape[0]), _ROWS):
        d = (a[ia[k : k + _ROWS]].double() - b[ib[k : k + _ROWS]].double()).abs().max().cpu()
        out = d if torch.isnan(d) else torch.maximum(out, d)
        if torch.isnan(out):
            break
    return float(out)


def _layer_max_abs_diffs(tree: Any, exp: Any, model: Any, seqs: list[list[int]]) -> list[float]:
    """Per decoder layer, the max |Δ| of its output rows, tree vs expanded, over every semantic
    position. The tree's outputs (compact rows) are kept; the expanded run's are compared as
    each layer produces them and dropped (memory: layers × C × D, not 4 × layers × S × D)."""
    from harts_verl.ops.layout import TreeLayout

    layers = decoder_layers(model)

    def run(runner: Any, forest: Any, on_output: Any) -> None:
        hooks = [
            lyr.register_forward_hook(
                lambda _m, _i, out, k=k: on_output(k, out[0] if isinstance(out, tuple) else out)
            )
            for k, lyr in enumerate(layers)
        ]
        try:
            layout = TreeLayout(forest, chunk_size=runner.chunk_size, device=runner.device)
            with torch.no_grad():
                runner.model(layout.token_ids, layout)
        finally:
            for h in hooks:
                h.remove()

    kept: dict[int, torch.Tensor] = {}
    forest, forest_exp = tree.build_forest(seqs), exp.build_forest(seqs)
    run(tree, forest, lambda k, h: kept.__setitem__(k, (h[0] if h.dim() == 3 else h).detach()))
    sem = torch.as_tensor(np.asarray(forest.semantic_rows, dtype=np.int64))
    sem_exp = torch.as_tensor(np.asarray(forest_exp.semantic_rows, dtype=np.int64))
    diffs: dict[int, float] = {}

    def compare(k: int, h: torch.Tensor) -> None:  # semantic position by semantic position
        h2 = h[0] if h.dim() == 3 else h
        diffs[k] = _rows_max_abs_diff(kept[k], sem.to(kept[k].device), h2, sem_exp.to(h2.device))
        kept.pop(k)

    run(exp, forest_exp, compare)
    return [diffs[k] for k in range(len(layers)) if k in diffs]


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


def _runs_harts_ops(model: Any) -> bool:
    """Whether the model's own forward runs this package's ops (the native ``harts_hybrid``,
    Kimi-Linear / Ling 3 converted to it: one trajectory at a time through the tree layout),
    so it is no independent oracle of them, unlike an HF model's own code."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", None) == "harts_hybrid"


def _check_tol(tol: Any, name: str = "tol") -> float:
    """``tol`` as a float; ValueError naming ``name`` unless it is a finite real number >= 0."""
    f = finite_float(tol)
    if f is None or f < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {tol!r}")
    return f


def run_check(
    model: Any,
    seqs: list[list[int]],
    *,
    chunk_size: int = 64,
    tol: float = 1e-5,
    fail_above: float | None = None,
) -> dict[str, Any]:
    """Tree vs expanded on one model and batch: the figures described in the module doc
    (``agree`` and ``fail_above`` only with a ``fail_above``).

    Raises ``ValueError`` naming ``seqs`` for an empty batch, ``tol`` / ``fail_above`` unless
    it is a finite number >= 0, and the runners' errors for ``chunk_size`` and token ids
    outside the model's vocabulary (all before any forward runs)."""
    from harts_verl.ops.layout import layer_windows, recording_attention_windows
    from harts_verl.runtime import ExpandedRunner, TreeRunner

    if not seqs:
        raise ValueError("seqs: the batch has no trajectories")
    tol = _check_tol(tol)
    if fail_above is not None:
        fail_above = _check_tol(fail_above, "fail_above")

    tree = TreeRunner(model, chunk_size=chunk_size)
    exp = ExpandedRunner(model, chunk_size=chunk_size)
    with recording_attention_windows() as window_log:  # the windows each layer applies
        lt = tree.log_probs(seqs)
    le = exp.log_probs(seqs)
    dlogp = _max_abs_diff(zip(lt, le))
    ht, he = tree.hidden_states(seqs), exp.hidden_states(seqs)
    mean_cos = mean_logit_cosine(ht, he, tree.model.lm_head.weight, rows_per_chunk=_ROWS)
    del ht, he
    per_layer = _layer_max_abs_diffs(tree, exp, model, seqs) if decoder_layers(model) else []
    # NaN is divergent too (`d > tol` is False for it)
    first = next((k for k, d in enumerate(per_layer) if d is not None and not d <= tol), None)
    own = _own_forward_log_probs(model, seqs)
    own_dlogp = None if own is None else _max_abs_diff(zip(lt, own))
    figures = {
        "max_abs_dlogp": dlogp,
        "own_forward_max_abs_dlogp": own_dlogp,
        "mean_cos": mean_cos,
        **{f"per_layer_max_abs_diff[{k}]": d for k, d in enumerate(per_layer)},
    }
    non_finite = [k for k, v in figures.items() if v is not None and not np.isfinite(v)]

    def shown(v: float | None) -> float | None:  # strict JSON: a NaN is null (and named)
        return v if v is None or np.isfinite(v) else None

    res = {
        "trajectories": len(seqs),
        "semantic_tokens": tree.last_stats.semantic_tokens,
        "compact_tokens": tree.last_stats.compact_tokens,
        "compression": round(tree.last_stats.compression, 4),  # as inspect and bench print it
        "max_abs_dlogp": shown(dlogp),
        "own_forward_max_abs_dlogp": shown(own_dlogp),
        "own_forward_independent": own is not None and not _runs_harts_ops(model),
        "mean_cos": shown(mean_cos),
        "per_layer_max_abs_diff": [shown(d) for d in per_layer],
        "first_divergent_layer": first,
        "tol": tol,
        "non_finite": non_finite,
        "ideal_flop_ratio": _flop_ratio(model, seqs, chunk_size, layer_windows(window_log)),
    }
    if fail_above is not None:
        res["fail_above"] = fail_above
        res["agree"] = (
            not non_finite
            and first is None
            and all(d is None or d <= fail_above for d in (dlogp, own_dlogp))
        )
    return res


def audit_status(res: dict[str, Any]) -> int:
    """The exit status of an audit result: 3 when it found a non-finite difference or (with
    ``fail_above``) a disagreement, else 0."""
    return 3 if res["non_finite"] or res.get("agree") is False else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``check`` options (for ``harts-verl check``); malformed values are argparse errors."""
    p.add_argument("--model", required=True, help="HF model dir, or a config.json (random init)")
    p.add_argument(
        "--batch",
        required=True,
        help="batch dump: forest .npz, torch .pt, or token file .json / .jsonl",
    )
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--chunk-size", type=int_arg(1), default=64)
    p.add_argument(
        "--tol",
        type=finite_float_arg(0, inclusive=True),
        default=1e-5,
        help="per-layer divergence threshold (finite, >= 0)",
    )
    p.add_argument(
        "--fail-above",
        type=finite_float_arg(0, inclusive=True),
        default=None,
        help="verdict: exit status 3 unless both max |Δlogp| (vs expanded, vs the model's own "
        "forward) are at most this and no layer exceeds --tol (e.g. 1e-4 in float32)",
    )
    p.add_argument("--seed", type=int_arg(0), default=0, help="random init of a config")


def tree_model_config(spec: str) -> Any:
    """The HF config of the model ``spec`` names (an HF model directory or a ``config.json``;
    Kimi-Linear and Ling 3 give their ``harts_hybrid`` conversion), read without building the
    model, after checking that its type runs in tree mode
    (``harts_verl.models.adapter.TREE_MODEL_TYPES``).

    Raises ``ValueError`` starting with ``model:`` when ``spec`` does not exist, is neither a
    directory nor a ``.json`` file, has no readable config (invalid JSON, no ``model_type``, an
    unknown type) or names a model type without a tree mode, or a logit transform field
    (``harts_verl.models.adapter.config_logit_transform``) with an unusable value."""
    from transformers import AutoConfig

    from harts_verl.models import checkpoints
    from harts_verl.models.adapter import TREE_MODEL_TYPES, config_logit_transform
    from harts_verl.models.hf import register_auto_classes

    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise ValueError(f"model: config file {spec!r} does not exist")
    elif not os.path.isdir(spec):
        raise ValueError(f"model: expected an HF model directory or a config.json, got {spec!r}")
    elif not os.path.isfile(os.path.join(spec, "config.json")):
        raise ValueError(f"model: {spec!r} has no config.json")
    register_auto_classes()
    file = spec if spec.endswith(".json") else os.path.join(spec, "config.json")
    try:
        with open(file) as f:
            top = json.load(f)
    except OSError as exc:
        raise ValueError(f"model: cannot read {file!r}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"model: {file!r} is not a valid JSON file ({exc})") from None
    if not isinstance(top, dict):
        raise ValueError(f"model: {file!r} holds a JSON {type(top).__name__}, not an object")
    raw = checkpoints.source_config_of(spec)
    try:
        if raw is not None:  # Kimi-Linear, Ling 3: their harts_hybrid conversion
            cfg = checkpoints.harts_config_from_source(raw)
        else:
            cfg = AutoConfig.from_pretrained(spec)
    except _CONFIG_ERRORS as exc:
        msg = _one_line(exc)
        raise ValueError(f"model: cannot read the config of {spec!r}: {msg}") from exc
    model_type = getattr(cfg, "model_type", None)
    if model_type not in TREE_MODEL_TYPES:
        raise ValueError(
            f"model: {spec!r} is a {model_type!r} model, which has no tree mode "
            f"(supported: {', '.join(TREE_MODEL_TYPES)})"
        )
    try:
        config_logit_transform(cfg)
    except ValueError as exc:
        raise ValueError(f"model: {spec!r}: {exc}") from exc
    _check_sizes(cfg, spec)
    return cfg


_POSITIVE_SIZES = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads")


def _check_sizes(cfg: Any, spec: str) -> None:
    """ValueError naming ``spec`` and the field when a size of the (text) config is an int
    below 1, or its query heads are not a multiple of its key/value heads (every GQA model
    shares each key/value head among a whole number of query heads)."""
    for sub in (cfg, getattr(cfg, "text_config", None)):
        if sub is None:
            continue
        for name in _POSITIVE_SIZES:
            v = getattr(sub, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v < 1:
                raise ValueError(f"model: {spec!r}: {name} must be >= 1, got {v}")
        heads = getattr(sub, "num_attention_heads", None)
        kv = getattr(sub, "num_key_value_heads", None)
        if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
            raise ValueError(
                f"model: {spec!r}: num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {kv}"
            )


def load_tree_model(
    spec: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, eager_experts: bool = True
) -> torch.nn.Module:
    """:func:`harts_verl.models.hf.load_causal_lm` of ``spec`` after :func:`tree_model_config`
    (an unsupported model is refused before anything is built). Raises ``ValueError`` starting
    with ``model:`` for a bad spec, a directory without weights, a config its model class
    rejects (the class's message is included), or weights that cannot be read or do not fit
    the config."""
    from harts_verl.models.hf import load_causal_lm

    tree_model_config(spec)
    try:
        with _held_transformers_warnings():
            return load_causal_lm(spec, dtype=dtype, seed=seed, eager_experts=eager_experts)
    except OSError as exc:  # e.g. a directory without weights
        hint = " (pass its config.json for random weights)" if os.path.isdir(spec) else ""
        raise ValueError(f"model: {exc}{hint}") from exc
    except (ValueError, TypeError, KeyError, ArithmeticError, *_HUB_ERRORS) as exc:
        msg = _one_line(exc)
        if isinstance(exc, ArithmeticError):  # e.g. a size of 0 the class divides by
            msg = f"building the model from its config failed ({type(exc).__name__}: {msg})"
        if isinstance(exc, KeyError):  # e.g. an unknown hidden_act: the bare key says little
            msg = f"building the model failed on the unknown key / value {msg} of its config"
        raise ValueError(msg if msg.startswith("model:") else f"model: {spec!r}: {msg}") from exc
    except _WEIGHT_ERRORS as exc:
        msg = _one_line(exc)
        if "ignore_mismatched_sizes" in msg:
            msg = "its weights do not fit its config (some tensor shapes differ)"
        raise ValueError(f"model: {spec!r}: cannot load its weights: {msg}") from exc


@contextlib.contextmanager
def _held_transformers_warnings() -> Iterator[None]:
    """transformers' log records (its weight-loading report among them) are held while the
    block runs and passed on to its own handlers only when the block succeeds: a load that
    fails says so in the one line of the error it raises, not after a multi-line table."""
    root = logging.getLogger("transformers")
    held: list[logging.LogRecord] = []

    class _Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    handlers, root.handlers = root.handlers, [_Hold()]
    try:
        yield
    finally:
        root.handlers = handlers
    for record in held:  # only reached on success
        root.handle(record)


def smoke_forward(model: torch.nn.Module, spec: str) -> None:
    """The model's own forward on two tokens (ids 0 and 1), before any audit. ``ValueError``
    naming ``spec`` with the error when it fails: a config its class accepts but cannot run
    (top-k above the expert count, an odd RoPE head dim, groups that do not divide the experts,
    ...) fails there, not in the middle of the audit with a traceback."""
    if not callable(getattr(model, "forward", None)):
        return
    try:
        device = next(model.parameters()).device
        vocab = int(getattr(model.get_output_embeddings(), "weight", torch.empty(2, 1)).shape[0])
        ids = torch.tensor([[0, min(1, vocab - 1)]], device=device)
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except Exception as exc:  # any failure of the model's own code
        raise ValueError(
            f"model: {spec!r}: the model's own forward fails on a 2-token input (a config its "
            f"class accepts but cannot run?): {type(exc).__name__}: {_one_line(exc)}"
        ) from exc


def _flag(exc: BaseException, flag: str, field: str) -> ValueError:
    """``exc`` as a ValueError naming ``flag`` (its leading ``field:`` replaced by it)."""
    msg = str(exc) or type(exc).__name__
    if msg.startswith(field + ":"):
        msg = msg[len(field) + 1 :].lstrip()
    return ValueError(f"{flag}: {msg}")


def load_inputs(args: argparse.Namespace) -> tuple[torch.nn.Module, list[list[int]]]:
    """The model and batch of parsed ``check`` options, every input checked before the audit:
    ``--dtype``, ``--tol``, ``--chunk-size`` and ``--seed`` values, the model's config
    (:func:`tree_model_config`) and the batch file (:func:`load_sequences`) before any weights
    are loaded (:func:`load_tree_model`), then the batch's token ids against the model's
    vocabulary and its trajectory lengths against a length-dependent RoPE's exact range. Raises ``ValueError`` whose message starts with the flag at
    fault (``--model: ...``, ``--batch: ...``), so it is one command-line line as it stands."""
    from harts_verl.models.adapter import check_rope_lengths
    from harts_verl.runtime import TreeRunner
    from harts_verl.tree import RolloutForest

    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype: expected one of {sorted(DTYPES)}, got {args.dtype!r}")
    try:
        _check_tol(args.tol)
    except ValueError as exc:
        raise _flag(exc, "--tol", "tol") from exc
    if getattr(args, "fail_above", None) is not None:
        try:
            _check_tol(args.fail_above, "fail_above")
        except ValueError as exc:
            raise _flag(exc, "--fail-above", "fail_above") from exc
    check_chunk_size(args.chunk_size, "--chunk-size")
    check_int("--seed", args.seed, 0, SEED_MAX)

    def batch_error(exc: Exception) -> ValueError:
        # the forest's and runner's "sequences[i]: ..." (their argument) as the file's
        # "trajectory i: ...", as load_sequences names them; a JSON Lines file's as its line
        msg = re.sub(r"^sequences\[(\d+)\]:", r"trajectory \1:", str(exc))
        found = re.match(r"trajectory (\d+):", msg)
        if found and is_token_file(args.batch):
            lines = trajectory_lines(args.batch)
            if lines is not None and int(found[1]) < len(lines):
                msg = f"line {lines[int(found[1])]} (trajectory {found[1]}):{msg[found.end() :]}"
        return ValueError(
            f"--batch: {msg}" if msg.startswith(args.batch) else f"--batch: {args.batch}: {msg}"
        )

    # the config, then the batch file, before any weights are loaded (a bad batch costs nothing)
    try:
        tree_model_config(args.model)
    except INPUT_ERRORS as exc:
        raise _flag(exc, "--model", "model") from exc
    try:
        seqs = load_sequences(args.batch)
        RolloutForest.from_sequences(seqs)  # every trajectory well-formed (ids >= 0, non-empty)
    except INPUT_ERRORS as exc:
        raise batch_error(exc) from exc
    try:
        model = load_tree_model(args.model, dtype=DTYPES[args.dtype], seed=args.seed)
        smoke_forward(model, args.model)
    except INPUT_ERRORS as exc:
        raise _flag(exc, "--model", "model") from exc
    try:
        runner = TreeRunner(model, chunk_size=args.chunk_size)  # a model it can run
    except INPUT_ERRORS as exc:
        raise _flag(exc, "--model", "model") from exc
    try:
        runner.build_forest(seqs)  # ids in vocabulary
    except (*INPUT_ERRORS, NotImplementedError) as exc:
        raise batch_error(exc) from exc
    # dynamic / longrope scaling: tree mode is exact only below the original context (the
    # longest trajectory named, as batch_error names it: by its line in a JSON Lines file)
    longest = max(range(len(seqs)), key=lambda i: len(seqs[i]))
    try:
        check_rope_lengths(model, len(seqs[longest]))
    except (*INPUT_ERRORS, NotImplementedError) as exc:
        raise batch_error(ValueError(f"trajectory {longest}: {exc}")) from exc
    return model, seqs


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the audit, print JSON; exit status 2 with one line on stderr for a
    bad input (``HARTS_VERL_DEBUG=1``: re-raised with its traceback), as ``harts-verl check``."""
    p = argparse.ArgumentParser(prog="harts-verl check", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        model, seqs = load_inputs(args)
    except INPUT_ERRORS as exc:
        if os.environ.get("HARTS_VERL_DEBUG", "") not in ("", "0"):
            raise
        print(f"harts-verl check: {exc}", file=sys.stderr)
        return 2
    return _audit(model, seqs, args)


def audit(model: torch.nn.Module, seqs: list[list[int]], args: argparse.Namespace) -> dict:
    """:func:`run_check` with the parsed ``check`` options (its exit status:
    :func:`audit_status`)."""
    return run_check(
        model, seqs, chunk_size=args.chunk_size, tol=args.tol, fail_above=args.fail_above
    )


def _audit(model: torch.nn.Module, seqs: list[list[int]], args: argparse.Namespace) -> int:
    from harts_verl.tree.inspect import json_text

    res = audit(model, seqs, args)
    print(json_text(res))
    return audit_status(res)


def run_args(args: argparse.Namespace) -> int:
    """Run the audit for parsed ``check`` options and print JSON. Input errors propagate as the
    ValueError of :func:`load_inputs` (``harts-verl check`` and :func:`main` turn them into one
    line and exit status 2)."""
    model, seqs = load_inputs(args)
    return _audit(model, seqs, args)


if __name__ == "__main__":
    sys.exit(main())
