"""The ``harts_fsdp2`` engine: veRL's FSDP2 LM-head engine with compact tree micro-batches.

What changes against the stock engine (everything else is inherited):

* ``forward_backward_batch``: the local batch's trajectories (nested ``input_ids``) become a
  :class:`~harts_verl.tree.RolloutForest`; micro-batches are planned by compact work
  (``plan_microbatches``, capacity = ``harts.capacity_tokens``, else the batch's
  ``max_token_len_per_gpu``, or with ``use_dynamic_bsz`` false ``micro_batch_size_per_gpu`` ×
  the longest trajectory); every DP rank runs the same number of micro-batches (an
  all-reduce MAX of the local counts; a rank with fewer splits its heaviest micro-batches at
  the cut that best halves their work, or runs zero-loss dummy forwards when nothing can be
  split), so FSDP collectives and the gradient-sync micro-batch stay aligned; outputs are
  restored to the batch order.
* Ulysses sequence parallelism (``ulysses_sequence_parallel_size`` = sp > 1): instead of
  slicing every sequence over the SP ranks, the SP ranks of a DP group share its tree
  micro-batches (the count rounded up to a multiple of sp; equal counts per rank, heaviest
  first to the least-loaded rank: :func:`sp_assignment`), each micro-batch whole on one rank with
  veRL's Ulysses hooks off; its loss is scaled by sp for backward (FSDP averages gradients over
  DP × SP ranks, as veRL's Ulysses gather does), and every SP rank returns the whole batch's
  outputs (an exact sum of each rank's share) and metrics; with ``stock_metrics`` or a
  split-dependent loss every SP rank evaluates the loss on veRL's own micro-batches over those
  outputs, as stock SP does. The token budget is one rank's:
  ``max_token_len_per_gpu``, or a stock micro-batch over sp; a batch with a trajectory longer
  than that takes the stock Ulysses path.
* ``forward_step`` of a micro-batch: one forward of the FSDP root module on the compact rows
  (``input_ids`` = row tokens, ``position_ids`` = row depths, ``harts_layout`` reaching the
  patched token mixers), with the LM head replaced for that call by
  :func:`~harts_verl.ops.logprobs.compact_log_probs` (vocabulary work once per row). The result
  is veRL's contract: nested per-trajectory ``log_probs`` (and ``entropy``) shifted by one —
  position t holds log p(x[t+1] | x[≤t]) — so ``ppo_loss`` and every policy-loss mode run
  unchanged, with veRL's global token counts (trajectory-wise meaning).

With ``calculate_sum_pi_squared`` (veRL's optimal-token-baseline estimators, set by its legacy
trainer) the output also holds ``sum_pi_squared`` (Σ_v p_v² per position, same layout).

Position L−1 (no next token) holds 0 for log-probs, entropy and Σp². The stock engine's
log-prob there depends on packing (it rolls the packed ids: the log-prob of the *next*
sequence's first token); its entropy and Σp² there describe the distribution after the last
token. veRL's RL losses never read position L−1 (``no_padding_2_padding`` slices
``[prompt_len − 1, L − 1)``); its ``sft_loss`` rolls the packed ``loss_mask`` by one, so it
weights position L−1 by the *next* trajectory's ``loss_mask[0]`` (usually 0, a prompt token):
where that is 1, stock adds a cross-sequence log-prob that tree mode (0 there) leaves out.

:class:`HartsFSDPValueEngine` is the critic's counterpart (values of every position, see there).

Fallback (stock path, metric ``harts/fallback`` = 1): harts disabled, a model without tree
support, dropout in training, a batch that carries multi-modal inputs
(vision embeddings and 3-D mrope positions have no tree form; text-only batches of the same
multi-modal model run in tree mode), under Ulysses SP a trajectory longer than one rank's token
budget, fused kernels (or a logit-transforming forward) on a model without HF's ``model`` /
``lm_head`` parts, top-k
distillation, training with router jitter, dynamic RoPE beyond its original context, or a
realized compression (Σ over DP ranks of S / Σ of the compact rows each rank's micro-batches
run: a tree that veRL's balancing split across ranks, or that the token budget splits into
several micro-batches, pays its shared rows in each part) below ``harts.min_compression``
(unless veRL's micro-batching refuses the batch: the stock path would stop there). The
decision is taken jointly by all DP ranks;
each reason is logged at WARNING the first time it occurs.
Every micro-batch of a fallback batch runs veRL's own ``forward_step``.
"""

from __future__ import annotations

import copy
import inspect
import logging
import time
import types
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.utils.py_functional import append_to_dict
from verl.utils.seqlen_balancing import restore_dynamic_batch
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import (
    FSDPEngineWithLMHead,
    FSDPEngineWithValueHead,
)
from verl.workers.engine.utils import detach_tree

from harts_verl.models import checkpoints
from harts_verl.models.adapter import (
    CONV_HYBRID_MODEL_TYPES,
    HYBRID_MODEL_TYPES,
    LIGHTNING_HYBRID_MODEL_TYPES,
    MAMBA1_HYBRID_MODEL_TYPES,
    MAMBA2_HYBRID_MODEL_TYPES,
    MASKED_TREE_MODEL_TYPES,
    RECURRENT_GEMMA_MODEL_TYPES,
    SSM_MODEL_TYPES,
    TREE_MODEL_TYPES,
    length_dependent_rope,
    logit_transform_of,
    patch_tree_mixers,
    tree_call,
    tree_mode_attention_mask,
)
from harts_verl.ops._index import concat_ranges
from harts_verl.ops.layout import TreeLayout
from harts_verl.ops.logprobs import (
    LogitTransform,
    check_temperatures,
    compact_log_probs,
    select_temperatures,
)
from harts_verl.ops.tree_attention import attention_key_rows
from harts_verl.tree import RolloutForest
from harts_verl.tree._checks import finite_float
from harts_verl.workers import STRATEGY
from harts_verl.workers.positions import first_misplaced, token_rows, token_sequences

if TYPE_CHECKING:
    from harts_verl.workers.config import HartsConfig

__all__ = ["HartsFSDPEngine", "HartsFSDPValueEngine", "forest_of_batch"]

logger = logging.getLogger(__name__)

_HEAD_FN = "_harts_head_fn"
# No model type is sent to the stock path wholesale. The multi-modal Qwen3.5 wrappers
# (``qwen3_5``, ``qwen3_5_moe``), whose decoder-layer forward veRL replaces by one that drops
# extra keywords on the way to the GatedDeltaNet, run text-only batches in tree mode: the adapter
# wraps those layers so the mixer takes the layout from the enclosing tree call (also when
# activation checkpointing re-runs a layer during backward). What still needs the stock path is
# decided per batch: vision inputs (``multi_modal_inputs``), see ``_local_fallback_reasons``.
_HEAD_ORIG = "_harts_original_forward"


def _lm_head_forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    fn = getattr(self, _HEAD_FN, None)
    if fn is None:
        return getattr(self, _HEAD_ORIG)(hidden_states, *args, **kwargs)
    return fn(hidden_states, self.weight, getattr(self, "bias", None))


def _find_lm_head(module: torch.nn.Module) -> torch.nn.Module | None:
    getter = getattr(module, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, torch.nn.Linear) else None


class _MicroBatchSelect:
    """``tu.index_select_tensor_dict(data, sel)`` for the many micro-batches of one batch, each
    nested tensor unbound once: veRL's function unbinds the whole batch on every call (N views
    per nested key per micro-batch, O(N·K) a step: 6.3 s for 512 trajectories, 8 nested keys,
    142 micro-batches; 79 s for 2048 and 579). The same TensorDict otherwise (same keys, dense
    tensors and non-tensor data indexed the same way)."""

    def __init__(self, data: TensorDict) -> None:
        self._data = data
        self._unbound: dict[Any, tuple[torch.Tensor, ...]] = {}

    def __call__(self, sel: list[int]) -> TensorDict:
        indices = torch.tensor(sel)
        out: dict[Any, Any] = {}
        for key, tensor in self._data.items():
            if isinstance(tensor, torch.Tensor) and tensor.is_nested:
                parts = self._unbound.get(key)
                if parts is None:
                    parts = self._unbound[key] = tensor.unbind()
                out[key] = tu.nested_tensor_from_tensor_list(
                    [parts[i] for i in sel],
                    ragged_idx=getattr(tensor, "_ragged_idx", tensor.dim() - 1),
                )
            elif isinstance(tensor, torch.Tensor) or tensor.shape:
                out[key] = tensor[indices]
            else:
                out[key] = tensor
        return TensorDict(source=out, batch_size=indices.shape[0])


def _keep_outputs(
    kept: dict[str, list[torch.Tensor | None]],
    outputs: dict[str, torch.Tensor],
    sel: list[int],
    n: int,
) -> None:
    """Store each of ``outputs``' per-trajectory tensors (nested, in ``sel`` order), detached,
    at its trajectory's index of ``kept[key]`` (a list of ``n``)."""
    for key, nested in outputs.items():
        column = kept.setdefault(key, [None] * n)
        for i, t in zip(sel, nested.unbind()):
            column[i] = t.detach()


def _kept_len(columns: dict[str, list[torch.Tensor | None]], i: int) -> int:
    """The length of trajectory ``i``'s kept outputs (the same in every column)."""
    return int(next(iter(columns.values()))[i].shape[0])


def _checked_scalar_loss(loss: Any) -> torch.Tensor:
    """``loss`` as a one-element tensor; TypeError naming what the loss function returned."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            "loss_function: expected a one-element tensor as the loss, got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
        )
    return loss.reshape(())


def _tree_metadata(data: TensorDict) -> list[Any] | None:
    """Per-trajectory ``extra_fields["harts_tree"]`` values recorded by ``harts_tool_agent``
    (None when the batch has no ``extra_fields`` or a trajectory lacks the key)."""
    from harts_verl.workers.rollout.recorder import TREE_KEY

    if "extra_fields" not in data.keys():
        return None
    try:
        raw = data["extra_fields"]
        items = raw.tolist() if hasattr(raw, "tolist") else list(raw)
    except Exception:  # an unexpected container: detect prefixes from the tokens
        return None
    out = []
    for item in items:
        item = getattr(item, "data", item)
        if not isinstance(item, dict) or TREE_KEY not in item:
            return None
        out.append(item[TREE_KEY])
    return out if len(out) == len(data) else None


_metadata_warned = False  # the unusable-metadata WARNING was given in this process


def forest_of_batch(data: TensorDict) -> RolloutForest:
    """The rollout forest of a batch's trajectories (``input_ids``), in batch order.

    The trie of the token sequences (sorting + adjacent common prefixes). The turn metadata that
    ``harts_tool_agent`` records in ``extra_fields`` is checked against the tokens when every
    trajectory has it (the same forest: its turns spell the trajectories);
    ``forest.harts_source`` is ``"metadata"`` when it agrees, else ``"tokens"`` (one WARNING per
    process naming the first disagreement)."""
    from harts_verl.workers.rollout.recorder import forest_from_metadata

    seqs = token_sequences(data["input_ids"])
    meta = _tree_metadata(data)
    if meta is not None:
        forest, why = forest_from_metadata(seqs, meta)
        if forest is not None:
            forest.harts_source = "metadata"
            return forest
        # Same numbers either way; one WARNING per process (veRL's padding samples copy sample
        # 0's metadata, which then disagrees with their tokens on every step).
        global _metadata_warned
        log = logger.debug if _metadata_warned else logger.warning
        _metadata_warned = True
        log("harts_fsdp2: tree metadata not used (%s); detecting prefixes", why)
    forest = RolloutForest.from_sequences(seqs)
    forest.harts_source = "tokens"
    return forest


# Model types whose stock forward runs veRL's packed sequences (remove-padding path) as one:
# HF's Mamba-2 / Mamba-1 mixers (hybrids and pure SSMs), LFM2's short convolutions, MiniMax's
# lightning attention and RecurrentGemma's convolutions take no ``position_ids`` (one recurrence /
# convolution through the packed row), and transformers 5.10's gpt-oss builds its eager / sdpa masks without them (see
# :meth:`HartsFSDPEngine._packed_reference_leaks`).
_PADDED_STOCK_TYPES = (
    *MAMBA2_HYBRID_MODEL_TYPES,
    *MAMBA1_HYBRID_MODEL_TYPES,
    *SSM_MODEL_TYPES,
    *CONV_HYBRID_MODEL_TYPES,
    *LIGHTNING_HYBRID_MODEL_TYPES,
    *RECURRENT_GEMMA_MODEL_TYPES,
    "gpt_oss",
)

# What HF's stock forward can leave out of a model's attention (:meth:`_attention_term_dropped`).
_SINKS_DROPPED = "attention sinks"
_SOFTCAP_DROPPED = "attention logit soft-cap (attn_logit_softcapping)"


def _check_attention_heads(config: Any) -> None:
    """Raise ``ValueError`` for a model without attention heads (the pure state-space models:
    ``config.num_attention_heads`` absent from the config and its text config): veRL's FSDP
    engine reads them while it builds the module (``apply_monkey_patch``) and cannot build such a
    model; tree mode runs it outside veRL (``TreeRunner``, ``harts-verl bench`` / ``check``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(hasattr(c, "num_attention_heads") for c in (config, text)):
        return
    model_type = getattr(config, "model_type", None)
    raise ValueError(
        f"model_type {model_type!r}: veRL's FSDP engine cannot build a model without attention "
        "heads (its apply_monkey_patch reads config.num_attention_heads); HARTS tree mode runs "
        "it outside veRL (TreeRunner, harts-verl bench / check)"
    )


def _batch_temperature(micro_batch: TensorDict) -> float | np.ndarray:
    """The batch's sampling temperature (1.0 when absent): one float, or, when samples carry
    different ones (veRL's per-sample temperatures), a float64 array with one per sample in
    batch order. Raises ``ValueError`` naming ``temperature`` for a non-numeric, non-finite or
    non-positive value."""
    t = micro_batch["temperature"] if "temperature" in micro_batch.keys() else 1.0
    t = tu.unwrap_non_tensor_data(t) if not isinstance(t, torch.Tensor | float | int) else t
    if isinstance(t, torch.Tensor):
        if t.numel() == 0:
            return 1.0
        t = t.reshape(-1) if t.numel() > 1 else t.reshape(())  # veRL's [bsz] (or one value)
    return check_temperatures(t, len(micro_batch))


def _has_multi_modal(data: TensorDict) -> bool:
    """True when ``multi_modal_inputs`` holds any input (veRL's agent loop adds the key with
    empty dicts/None for text-only samples)."""
    if "multi_modal_inputs" not in data.keys():
        return False
    value = data["multi_modal_inputs"]
    items = value.tolist() if hasattr(value, "tolist") else value
    items = tu.unwrap_non_tensor_data(items) if not isinstance(items, list | tuple) else items
    if not isinstance(items, list | tuple):
        items = [items]
    return any(bool(x) for x in items if not isinstance(x, torch.Tensor)) or any(
        isinstance(x, torch.Tensor) and x.numel() > 0 for x in items
    )


def _position_ids_reason(data: TensorDict) -> str | None:
    """Why the batch's ``position_ids`` (if any) rule out tree mode, or None: tree mode places
    every row at its depth, so each trajectory's positions (every row of 3-D / mrope ones)
    must be ``0 .. L-1`` — what veRL builds from the attention mask — and packed, restarting or
    shifted positions, or a layout this cannot read, run on the stock path, which feeds them
    to the model."""
    if "position_ids" not in data.keys():
        return None
    raw = data["position_ids"]
    ids = data["input_ids"]
    if ids.is_nested:
        offsets = ids.offsets().to(device=raw.device, dtype=torch.int64)
    else:
        offsets = torch.arange(ids.shape[0] + 1, device=raw.device) * ids.shape[1]
    total = int(offsets[-1])
    rows = token_rows(raw, total)  # compared where it lies
    if rows is None:
        return (
            f"position_ids of shape {tuple(raw.shape)} do not hold one position (per row) for "
            f"each of the {total} input_ids tokens; tree mode places rows at their depths"
        )
    found = first_misplaced(rows, offsets)
    if found is None:
        return None
    i, j, got = found
    return (
        f"position_ids of trajectory {i} are not 0..{int(offsets[i + 1] - offsets[i]) - 1} "
        f"(token {j} is at {got[0] if len(got) == 1 else got}): tree mode places every row at "
        "its depth, so packed, restarting or shifted positions run on the stock path"
    )


def _loss_config(loss_function: Any) -> Any:
    """The ``config`` argument bound in the loss ``loss_function`` (a ``functools.partial`` of
    veRL's ``ppo_loss`` / ``value_loss``, by keyword or by position), or None."""
    keywords = getattr(loss_function, "keywords", None) or {}
    if "config" in keywords:
        return keywords["config"]
    func, args = getattr(loss_function, "func", None), getattr(loss_function, "args", ())
    if func is None or not args:
        return None
    try:
        bound = inspect.signature(func).bind_partial(*args)
    except (TypeError, ValueError):  # no signature, or arguments it does not take
        return None
    return bound.arguments.get("config")


def stock_strategy_loss(loss_function: Any) -> Any:
    """``loss_function`` as veRL's stock FSDP2 engine would receive it: a ``functools.partial``
    bound to a ``config`` whose ``strategy`` is ``harts_fsdp2`` is rebound to a shallow copy
    with ``strategy="fsdp2"`` (veRL's top-k distillation loss branches on the literal FSDP
    names and refused ours); anything else is returned as it is."""
    keywords = getattr(loss_function, "keywords", None) or {}
    config = keywords.get("config")
    if not isinstance(loss_function, partial) or getattr(config, "strategy", None) != STRATEGY:
        return loss_function
    stock = copy.copy(config)
    object.__setattr__(stock, "strategy", "fsdp2")
    return partial(loss_function.func, *loss_function.args, **{**keywords, "config": stock})


# veRL 0.9.1's own policy losses (``core_algos.POLICY_LOSS_REGISTRY`` as veRL ships it). Any
# other ``loss_mode`` is one a user registered (``register_policy_loss``): whether it depends on
# the micro-batching (e.g. a mean over each micro-batch's tokens) cannot be told.
_VERL_POLICY_LOSSES = frozenset(
    {
        *("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov"),
        *("geo_mean", "dro", "cispo", "bypass_mode"),
    }
)


def split_dependent_loss(loss_function: Any) -> str | None:
    """Why the loss ``loss_function`` (veRL's ``partial(ppo_loss, config=…)``, or the critic's
    ``value_loss``) depends on
    how a batch is cut into micro-batches, or None when it does not (or cannot be told). A
    policy loss that is not one of veRL's own (a user-registered ``loss_mode``) is taken to
    depend on it: evaluated on veRL's micro-batches it gives the stock numbers either way.

    Such losses give different numbers under any other micro-batching, the stock engine's own
    dynamic batching included; tree micro-batches are formed by compact work, so they differ
    from stock fsdp2 there (see docs/verl.md)."""
    config = _loss_config(loss_function)
    if config is None:
        return None
    out = []
    if (
        getattr(config, "loss_agg_mode", None) == "seq-mean-token-sum-norm"
        and getattr(config, "loss_scale_factor", 0) is None
    ):
        out.append(
            "loss_agg_mode 'seq-mean-token-sum-norm' without loss_scale_factor divides by each "
            "micro-batch's padded response width (set loss_scale_factor, e.g. to the "
            "maximum response length)"
        )
    policy_loss = getattr(config, "policy_loss", None)
    mode = _config_get(policy_loss, "loss_mode")
    if mode in ("clip_cov", "kl_cov"):
        out.append(
            f"policy loss {mode!r} selects tokens by covariance statistics of each micro-batch"
        )
    elif mode == "geo_mean":
        out.append("policy loss 'geo_mean' averages its sequence losses over each micro-batch")
    elif _batch_normalized_is(policy_loss):
        out.append(
            "policy loss 'bypass_mode' with rollout_correction.rollout_is_batch_normalize "
            "rescales the importance weights to mean 1 within each micro-batch"
        )
    elif isinstance(mode, str) and not _verl_policy_loss(mode):
        out.append(
            f"policy loss {mode!r} is not one of veRL's own, so it may depend on the "
            "micro-batching (e.g. a mean over each micro-batch's tokens)"
        )
    return "; ".join(out) or None


def _verl_policy_loss(mode: str) -> bool:
    """Whether ``loss_mode`` ``mode`` names one of veRL's own policy losses and is still
    registered to veRL's function: ``register_policy_loss`` lets a user register a function
    under one of veRL's names too (it replaces veRL's), and that one is the user's."""
    if mode not in _VERL_POLICY_LOSSES:
        return False
    from verl.trainer.ppo import core_algos

    registered = core_algos.POLICY_LOSS_REGISTRY.get(mode)
    return registered is None or getattr(registered, "__module__", None) == core_algos.__name__


def _batch_normalized_is(policy_loss: Any) -> bool:
    """Whether the policy-loss config is veRL's ``bypass_mode`` with importance weights
    (``rollout_correction.rollout_is``) that are batch-normalized
    (``rollout_is_batch_normalize``): a world-wide mean in every loss call."""
    if _config_get(policy_loss, "loss_mode") != "bypass_mode":
        return False
    correction = _config_get(policy_loss, "rollout_correction")
    return bool(
        _config_get(correction, "rollout_is_batch_normalize")
        and _config_get(correction, "rollout_is")
    )


def loss_collectives(loss_function: Any) -> int:
    """How many world-wide ``distributed_masked_mean`` calls one call of ``loss_function`` makes:
    1 for veRL's ``bypass_mode`` with ``rollout_correction.rollout_is_batch_normalize`` (its
    importance-weight mean), else 0. A dummy micro-batch, which runs no loss, makes as many
    empty ones (:func:`_empty_distributed_mean`), so that every rank's collectives match."""
    config = _loss_config(loss_function)
    return int(_batch_normalized_is(getattr(config, "policy_loss", None)))


def _empty_distributed_mean(device: Any) -> None:
    """veRL's ``distributed_masked_mean`` over no elements (adds 0 to the global sum and to the
    global count); nothing outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from verl.utils.torch_functional import distributed_masked_mean

    zero = torch.zeros(1, dtype=torch.float32, device=device)
    distributed_masked_mean(zero, zero)


def _config_get(config: Any, key: str) -> Any:
    """``config[key]`` of a veRL dataclass config, an omegaconf / dict section, or None."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return config.get(key)
    getter = getattr(config, "get", None)
    if callable(getter):
        try:
            return getter(key, None)
        except TypeError:
            pass
    return getattr(config, key, None)


def _fla_importable() -> bool:
    """Whether fla (the linear-attention kernels HF's hybrids use for packed sequences) imports
    in this process."""
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


def _dropout_reason(module: torch.nn.Module) -> str | None:
    """Why training ``module`` in tree mode would not be trajectory-wise (dropout draws one mask
    per row, which a shared row would share across its trajectories), or None."""
    ps = sorted({float(m.p) for m in module.modules() if isinstance(m, torch.nn.Dropout) and m.p})
    config = getattr(module, "config", None)
    configs = [c for c in (config, getattr(config, "text_config", None)) if c is not None]
    parts = [f"dropout p = {', '.join(map(str, ps))}"] if ps else []
    # functional dropout that HF draws from config values (Seed-OSS: residual_dropout)
    for key in ("attention_dropout", "residual_dropout", "hidden_dropout"):
        p = max((float(getattr(c, key, 0.0) or 0.0) for c in configs), default=0.0)
        parts += [f"{key} = {p}"] if p > 0 else []
    if not parts:
        return None
    return f"{' and '.join(parts)} in training (a shared row would share its dropout mask)"


def _causal_lm_of(module: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside ``module``: a peft (LoRA) wrapper's base model, else ``module``."""
    get = getattr(module, "get_base_model", None)
    return get() if callable(get) else module


def _plain_forward_of(lm: torch.nn.Module) -> Any:
    """The forward a tree call installs on ``lm`` when veRL's fused-kernel patch replaced its
    class ``forward``: the native wrapper's own (``harts_forward``), else HF's backbone-then-head
    order (:func:`_causal_lm_forward`) for a causal LM with a ``model`` backbone and an
    ``lm_head``; None for anything else."""
    own = getattr(type(lm), "harts_forward", None)
    if own is not None:
        return own
    if isinstance(getattr(lm, "model", None), torch.nn.Module) and isinstance(
        getattr(lm, "lm_head", None), torch.nn.Module
    ):
        return _causal_lm_forward
    return None


def _causal_lm_forward(self, *args: Any, output_router_logits: Any = None, **kwargs: Any) -> Any:
    """HF's causal-LM forward without labels: the backbone, then the LM head on every
    position. Installed on the instance for a tree call when veRL's fused-kernel patch has
    replaced the class ``forward`` (its fused head takes each row's *next row* as the label,
    which is not the next token of every trajectory through a fork). Returns HF's output type:
    FSDP2 registers its pre-backward hooks through the output's tensors (pytree)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if output_router_logits is not None:  # MoE: HF's forward hands it to the backbone
        kwargs["output_router_logits"] = output_router_logits
    hidden = self.model(*args, **kwargs)[0]
    return CausalLMOutputWithPast(logits=self.lm_head(hidden))


def _split_by_work(forest: RolloutForest, group: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Cut ``group`` (≥ 2 trajectories) in two consecutive leaf-order ranges: the cut minimising
    the larger half's compact work, then the common prefix at the cut, then its position.
    Returns ``[(work, trajectories), (work, trajectories)]`` (work = compact rows)."""
    sub = forest.subset(group)
    order = np.asarray(sub.leaf_order, np.int64)
    lens = np.asarray(sub.lengths, np.int64)[order]
    adj = np.asarray(sub.adjacent_lcp, np.int64)
    cl = np.cumsum(lens)
    ca = np.concatenate([[0], np.cumsum(adj)])
    j = np.arange(1, order.shape[0])
    left = cl[j - 1] - ca[j - 1]
    right = (cl[-1] - cl[j - 1]) - (ca[-1] - ca[j])
    k = int(np.lexsort((j, adj, np.maximum(left, right)))[0])
    cut = int(j[k])
    return [(int(left[k]), group[order[:cut]]), (int(right[k]), group[order[cut:]])]


def sp_assignment(works: list[int], sp: int) -> np.ndarray:
    """The Ulysses SP rank (``[0, sp)``) of each micro-batch of compact work ``works`` (a
    count divisible by ``sp``): every rank gets the same number of micro-batches; heaviest
    first, each to the least-loaded rank with room left (ties: the lower rank). Deterministic,
    so every SP rank computes the same assignment."""
    n = len(works)
    if sp < 1 or n % sp:
        raise ValueError(f"works: {n} micro-batches do not divide among {sp} SP ranks")
    quota = n // sp
    owner = np.zeros(n, dtype=np.int64)
    load = np.zeros(sp, dtype=np.int64)
    count = np.zeros(sp, dtype=np.int64)
    for k in sorted(range(n), key=lambda k: (-int(works[k]), k)):  # one step per micro-batch
        room = np.flatnonzero(count < quota)
        r = int(room[np.argmin(load[room])])
        owner[k] = r
        load[r] += int(works[k])
        count[r] += 1
    return owner


def _cpu_objects(obj: Any) -> Any:
    """``obj`` with every tensor detached and moved to the CPU (safe to pickle across ranks)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu_objects(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_objects(v) for v in obj)
    return obj


@EngineRegistry.register(model_type="language_model", backend=STRATEGY, device=["cuda", "cpu"])
class HartsFSDPEngine(FSDPEngineWithLMHead):
    """veRL FSDP2 engine running each micro-batch as its token trie (see module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config) -> None:
        from harts_verl.workers.config import harts_config_of  # not at import: see STRATEGY

        self.harts: HartsConfig = harts_config_of(engine_config)
        # FSDP build code branches on the literal strategy name: the engine's own copy says
        # fsdp2, the caller's config keeps naming this engine (a second build from it, e.g. a
        # ref model's, is a tree engine too)
        if getattr(engine_config, "strategy", None) in (STRATEGY, None):
            engine_config = copy.copy(engine_config)
            object.__setattr__(engine_config, "strategy", "fsdp2")
        if engine_config.strategy != "fsdp2":
            raise ValueError(
                f"strategy: {STRATEGY} runs on FSDP2, got engine strategy {engine_config.strategy!r}"
            )
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self._tree_supported = False
        self._model_type: str | None = None
        self._rope_limit: tuple[str, int] | None = None
        self._dropout: str | bool | None = False  # False: not computed yet (_dropout_of_module)
        self._lm_head: torch.nn.Module | None = None
        # what the causal LM's own forward does to the LM head's logits (the tree head applies it)
        self._logit_transform = LogitTransform()
        self._calls = 0  # engine calls (forward_backward_batch)
        self._train_calls = 0  # of them, training calls (the audit counts these)
        self._stock_batch = False  # inside a fallback batch: forward_step is veRL's
        self._fallback_logged: set[str] = set()  # fallback reasons already logged
        self._oversize_warned = False  # a micro-batch over the token budget was named
        self._no_cut_reason = ""  # why veRL's own micro-batching refused the last batch

    # ------------------------------------------------------------------ model build
    # which model output the audit compares, and whether positions are shifted by one
    _audit_key, _audit_shifted = "log_probs", True
    _uses_temperature = True

    def _tree_head(self, module: torch.nn.Module) -> bool:
        """Prepare the output head of ``module`` for tree calls; False when it has none that
        tree mode can drive. Here: the LM head (``get_output_embeddings``, an ``nn.Linear``)
        gets a switchable forward that the compact log-prob kernel replaces during a call."""
        head = _find_lm_head(module)
        if head is None:
            return False
        if not hasattr(head, _HEAD_ORIG):
            setattr(head, _HEAD_ORIG, head.forward)
            head.forward = types.MethodType(_lm_head_forward, head)
        self._lm_head = head
        return True

    def _build_module(self):
        _check_attention_heads(self.model_config.hf_config)
        module = super()._build_module()
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        # Only the model types whose tree mode is checked against their own forward (those
        # `harts-verl check` takes): a wrapper of another type around a supported attention
        # class (e.g. a llava over Llama) would patch, but its forward is not known to match.
        self._tree_supported = (
            model_type in TREE_MODEL_TYPES
            and self._tree_head(module)
            and patch_tree_mixers(module) > 0
        )
        if not self._tree_supported:
            logger.warning(
                "harts_fsdp2: model type %r has no tree-mode support; every batch takes the "
                "stock fsdp2 path (supported: %s)",
                model_type,
                ", ".join(TREE_MODEL_TYPES),
            )
        self._model_type = model_type
        self._rope_limit = length_dependent_rope(module)  # dynamic / longrope scaling
        if self._tree_supported and self._lm_head is not None:
            self._logit_transform = logit_transform_of(_causal_lm_of(module))
        if self._fused_forward(module) and not self._logit_transform.is_identity:
            logger.warning(
                "harts_fsdp2: %s with use_fused_kernels: veRL's fused forward computes log-probs "
                "from hidden @ lm_head / temperature and leaves out the model's own logit "
                "transform (%s), which tree mode, HF and the rollout apply; stock (fallback) "
                "batches and the audit's reference will differ: turn use_fused_kernels off for "
                "consistent numbers",
                model_type,
                self._logit_transform,
            )
        if self._packed_reference_leaks() and self._sp_size() > 1:
            logger.warning(
                "harts_fsdp2: %s with ulysses_sequence_parallel_size = %d: tree batches are "
                "exact, but stock (fallback) micro-batches take veRL's packed, sliced path, in "
                "which this model's forward runs the packed sequences as one: keep harts.min_compression low and trajectories within the "
                "token budget so that no batch falls back, or train without sequence parallelism",
                model_type,
                self._sp_size(),
            )
        dropped = self._attention_term_dropped(module)
        if dropped == _SOFTCAP_DROPPED:
            logger.warning(
                "harts_fsdp2: %s with attn_implementation %r: transformers' sdpa drops its %s; "
                "tree mode applies it, and stock (fallback) batches run eager attention instead",
                model_type,
                module.config._attn_implementation,
                dropped,
            )
        elif dropped:
            logger.warning(
                "harts_fsdp2: %s with attn_implementation %r: transformers' kernel drops its %s, "
                "so veRL's stock forward (fallback batches) runs without them, while tree mode "
                "applies them; use attn_implementation=eager (or a kernel that takes them) for "
                "consistent numbers",
                model_type,
                module.config._attn_implementation,
                dropped,
            )
        return module

    # ------------------------------------------------------------------ weight export
    def get_per_tensor_param(self, *args: Any, **kwargs: Any):
        """veRL's weight export to the rollout server. A ``harts_hybrid`` converted from
        Kimi-Linear or Ling 3 (``harts_source_config``) exports the source's tensor names and
        layouts (one tensor per expert, ...), so vLLM / SGLang serving the source checkpoint
        load them; LoRA adapters of such a model are exported only merged
        (``lora.merge=true``)."""
        params, peft = super().get_per_tensor_param(*args, **kwargs)
        source = checkpoints.source_architecture(self.model_config.hf_config)
        if source is None:
            return params, peft
        fmt, arch = source
        if peft is not None:
            raise ValueError(
                f"lora: a harts_hybrid converted from {fmt.display} exports weights in its "
                "names, which unmerged LoRA adapters do not have; set "
                "actor_rollout_ref.model.lora.merge=true"
            )
        # contiguous: veRL's bucketed senders flatten each tensor with view(-1)
        return (
            (source_name, source_tensor.contiguous())
            for name, tensor in params
            for source_name, source_tensor in checkpoints.source_tensors_from_hybrid(
                fmt, name, tensor, arch
            )
        ), peft

    def get_per_tensor_param_shard(self, **kwargs: Any):
        source = checkpoints.source_architecture(self.model_config.hf_config)
        if source is not None:
            raise ValueError(
                f"checkpoint engine: sharded / delta weight export of a harts_hybrid converted "
                f"from {source[0].display} is not supported (it exports full tensors in the "
                "source's names); use the default full-tensor weight sync"
            )
        return super().get_per_tensor_param_shard(**kwargs)

    def _dropout_of_module(self) -> str | None:
        """:func:`_dropout_reason` of the module as it trains (computed once, on first use:
        veRL wraps LoRA adapters, whose dropout counts too, only after ``_build_module``)."""
        if self._dropout is False:
            self._dropout = _dropout_reason(self.module)
        return self._dropout

    # ------------------------------------------------------------------ helpers
    def _head_reason(self) -> str | None:
        """Why the output head a tree call would reach is not the one the compact log-prob
        kernel replaces (a LoRA adapter or peft's ``modules_to_save`` copy wrapping the LM
        head), or None."""
        if self._lm_head is None:  # no LM head to replace (the critic's value head)
            return None
        getter = getattr(_causal_lm_of(self.module), "get_output_embeddings", None)
        current = getter() if callable(getter) else None
        if current is self._lm_head:
            return None
        return (
            f"the LM head is wrapped ({type(current).__name__}: a LoRA adapter or peft's "
            "modules_to_save on lm_head), so the compact log-prob kernel cannot replace it"
        )

    def _vocab_size(self) -> int | None:
        """Ids the model can embed (and, with an LM head, predict): the smaller of the input
        embedding's and the LM head's rows; None when the model exposes neither."""
        lm = _causal_lm_of(self.module)
        getter = getattr(lm, "get_input_embeddings", None)
        emb = getter() if callable(getter) else None
        sizes = [int(emb.num_embeddings)] if isinstance(emb, torch.nn.Embedding) else []
        if self._lm_head is not None:
            sizes.append(int(self._lm_head.out_features))
        return min(sizes) if sizes else None

    def _fused_forward(self, module: torch.nn.Module | None = None) -> bool:
        """Whether veRL's fused-kernel patch replaced the ``forward`` of ``module`` (default: the
        engine's; ``use_fused_kernels`` with a ``fused_kernel_options.impl_backend``)."""
        module = self.module if module is None else module
        return getattr(module, "_verl_fused_kernels_backend", None) is not None

    def _needs_plain_forward(self) -> bool:
        """Whether a tree call must bypass the causal LM's own ``forward``: veRL's fused forward
        replaced it, or it transforms the LM head's output (Gemma's soft-cap, Granite's and
        Cohere's scaling), which in a tree call is the compact head's log-probs (the transform
        is applied inside the head instead)."""
        return self._fused_forward() or not self._logit_transform.is_identity

    @contextmanager
    def _plain_causal_forward(self) -> Iterator[None]:
        """HF's backbone-then-head forward on the root module for one tree call where
        :meth:`_needs_plain_forward` (instead of veRL's fused forward or a forward that would
        transform the compact head's output, see :func:`_causal_lm_forward`); the FSDP root hooks
        still run."""
        lm = _causal_lm_of(self.module)
        plain = _plain_forward_of(lm)
        if not self._needs_plain_forward() or plain is None:
            yield
            return
        had = "forward" in lm.__dict__
        prev = lm.__dict__.get("forward")
        lm.forward = types.MethodType(plain, lm)
        try:
            yield
        finally:
            if had:
                lm.forward = prev
            else:
                del lm.forward

    def _sp_size(self) -> int:
        """Ulysses sequence-parallel size (1 without SP)."""
        return int(getattr(self, "ulysses_sequence_parallel_size", 1) or 1)

    @contextmanager
    def _without_ulysses(self) -> Iterator[None]:
        """veRL's Ulysses machinery off (no input slicing, no all-to-all, no output gather):
        tree micro-batches run whole on one SP rank. Restores the group and flag on exit."""
        from verl.utils.ulysses import (
            get_ulysses_sequence_parallel_group,
            set_ulysses_sequence_parallel_group,
        )

        prev_group = get_ulysses_sequence_parallel_group()
        prev_flag = getattr(self, "use_ulysses_sp", False)
        set_ulysses_sequence_parallel_group(None)
        self.use_ulysses_sp = False
        try:
            yield
        finally:
            set_ulysses_sequence_parallel_group(prev_group)
            self.use_ulysses_sp = prev_flag

    def _sp_sum(self, stats: dict[str, int]) -> dict[str, int]:
        """``stats`` summed over the Ulysses SP group (each SP rank runs its share of the tree
        micro-batches)."""
        keys = sorted(stats)
        t = torch.tensor([stats[k] for k in keys], dtype=torch.int64, device=get_device_id())
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.ulysses_parallel_group)
        return {k: int(v) for k, v in zip(keys, t.tolist())}

    def _dp_all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=get_device_id())
        group = self.get_data_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=op, group=group)
        return t.tolist()

    def _capacity(self, data: TensorDict, longest: int) -> int:
        """Compact rows per micro-batch: ``harts.capacity_tokens``; else, with fixed-size
        micro-batches (``use_dynamic_bsz`` false), the most tokens a stock micro-batch of this
        batch can hold on one rank (``micro_batch_size_per_gpu`` × the longest trajectory,
        ``longest`` tokens, over the Ulysses SP size), so memory stays within the stock
        engine's; else ``max_token_len_per_gpu`` (16384 when the batch and the engine config
        give none; ValueError naming it unless a positive int). Under Ulysses SP this is one
        rank's budget: a tree micro-batch runs whole on one SP rank."""
        if self.harts.capacity_tokens is not None:
            return int(self.harts.capacity_tokens)
        if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            mbs = tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None)
            if mbs:
                # under Ulysses SP a stock micro-batch is sliced over the SP ranks
                return max(-(-int(mbs) * int(longest) // self._sp_size()), 1)
        cap = tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=None)
        if cap is None:
            cap = getattr(self.engine_config, "max_token_len_per_gpu", None)
        if cap is None:
            return 16384
        budget = finite_float(cap)  # None for a bool, a non-number or an int past float
        if budget is None or not budget >= 1 or not budget.is_integer():
            raise ValueError(
                f"max_token_len_per_gpu: expected a positive token budget, got {cap!r} (set "
                "ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu, or "
                "harts.capacity_tokens)"
            )
        return int(cap)

    def _plan(
        self, forest: RolloutForest, capacity: int
    ) -> tuple[list[tuple[int, np.ndarray]], float]:
        """The planner's micro-batches of the local batch as ``(compact work, trajectories)``,
        and the planning time (ms)."""
        from harts_verl.tree.microbatch import plan_microbatches

        opts = dict(self.harts.planner)
        seed = int(opts.pop("seed", 0))
        t0 = time.perf_counter()
        plan = plan_microbatches(
            forest, capacity_tokens=capacity, dp_size=1, seed=seed, allow_oversize=True, **opts
        )
        groups = [
            (int(mb.compact_tokens), np.asarray(mb.trajectories, np.int64))
            for mb in plan.microbatches
            if len(mb.trajectories)
        ]
        return groups, (time.perf_counter() - t0) * 1e3

    def _note_oversize(
        self, forest: RolloutForest, groups: list[tuple[int, np.ndarray]], capacity: int
    ) -> int:
        """The number of planned micro-batches whose compact work exceeds ``capacity``: each
        holds copies of one trajectory longer than the budget, which runs whole (nothing is
        truncated). The stock engine refuses such a batch, so the first one is named in a
        WARNING (the metric ``harts/oversize_microbatches`` counts them in every call)."""
        over = [w for w, _ in groups if w > capacity]
        if over and not self._oversize_warned:
            self._oversize_warned = True
            logger.warning(
                "harts_fsdp2: %d micro-batch(es) exceed the token budget of %d rows: the "
                "longest trajectory has %d tokens and runs whole in one micro-batch (the stock "
                "engine refuses such a batch: 'max_token_len must be greater than the sequence "
                "length'); raise max_token_len_per_gpu or harts.capacity_tokens to bound "
                "memory (metric harts/oversize_microbatches)",
                len(over),
                capacity,
                int(forest.lengths.max()),
            )
        return len(over)

    @staticmethod
    def _equalize(
        forest: RolloutForest, groups: list[tuple[int, np.ndarray]], target: int
    ) -> list[tuple[int, np.ndarray | None]]:
        """``target`` micro-batches ``(work, trajectories)`` from the planned ``groups`` (same form;
        ``target`` = the largest count
        over the DP ranks, so every rank runs the same number and FSDP collectives stay
        aligned): the micro-batch with the most compact work is split in two at the leaf-order
        cut that best halves its work (ties: the cut with the shortest common prefix, i.e. the
        least duplicated work) until there are ``target``; when only single-trajectory
        micro-batches are left, ``(0, None)`` pads (a zero-loss dummy forward). Real
        micro-batches are ordered by decreasing work (the same slot order on every rank),
        dummies last."""
        items = list(groups)
        n_dummy = 0
        while len(items) + n_dummy < target:
            cand = [k for k, (_, g) in enumerate(items) if g.shape[0] >= 2]
            if not cand:
                n_dummy = target - len(items)
                break
            j = max(cand, key=lambda k: (items[k][0], -k))
            items[j : j + 1] = _split_by_work(forest, items[j][1])
        order = sorted(range(len(items)), key=lambda k: (-items[k][0], k))
        return [items[k] for k in order] + [(0, None)] * n_dummy

    # ------------------------------------------------------------------ batch
    def _local_fallback_reasons(
        self, data: TensorDict, longest: int, forward_only: bool
    ) -> dict[str, str]:
        """Why this rank's batch (whose longest trajectory has ``longest`` tokens) cannot run in
        tree mode, as ``{key: explanation}`` (empty: it can)."""
        reasons: dict[str, str] = {}
        if not self.harts.enable:
            reasons["disabled"] = "harts.enable is false"
        if not self._tree_supported:
            reasons["model"] = f"model type {self._model_type!r} has no tree-mode support"
        sp = self._sp_size()
        budget = self._capacity(data, longest) if sp > 1 else None
        if budget is not None and longest > budget:
            reasons["sequence_parallel"] = (
                f"ulysses_sequence_parallel_size = {sp} and a trajectory of {longest} tokens "
                f"exceeds one rank's token budget ({budget}): tree mode "
                "shares the trees among the SP ranks, each trajectory whole on one rank; longer "
                "ones need Ulysses' slicing"
            )
        if not forward_only and self._dropout_of_module():
            reasons["dropout"] = self._dropout_of_module()
        if _has_multi_modal(data):
            reasons["multi_modal"] = (
                "the batch carries multi-modal inputs (multi_modal_inputs: pixel values / "
                "vision embeddings and 3-D mrope positions have no tree form; text-only batches "
                "of this model run in tree mode)"
            )
        positions = _position_ids_reason(data)
        if positions is not None:
            reasons["position_ids"] = positions
        if self._needs_plain_forward() and _plain_forward_of(_causal_lm_of(self.module)) is None:
            fused = self._fused_forward()
            why = (
                "use_fused_kernels is set: veRL's fused forward computes log-probs itself"
                if fused
                else "which transforms the LM head's logits"
            )
            reasons["fused" if fused else "logit_transform"] = (
                f"the model has no `model` backbone and `lm_head` to run without its own forward "
                f"({why})"
            )
        head = self._head_reason()
        if head is not None:
            reasons["lm_head"] = head
        distill = [
            k
            for k in ("distillation_use_topk", "distillation_only")
            if tu.get_non_tensor_data(data=data, key=k, default=False)
        ]
        if distill:
            reasons["distillation"] = (
                f"{' and '.join(distill)} set (top-k distillation reads each trajectory's full "
                "logits through veRL's logits processor)"
            )
        jitter = getattr(getattr(self.module, "config", None), "router_jitter_noise", 0.0)
        if jitter and not forward_only:
            reasons["router_jitter"] = (
                f"router_jitter_noise = {jitter} draws noise per token in training: shared rows "
                "would share it across trajectories"
            )
        rope = self._rope_limit
        if rope is not None and longest > rope[1]:
            reasons["rope"] = (
                f"rope_type {rope[0]!r} picks its frequencies from the sequence length: tree mode "
                f"is exact up to {rope[1]} tokens per trajectory, this batch has {longest}"
            )
        return reasons

    def _log_fallback(self, reasons: dict[str, str]) -> None:
        """WARNING the first time each fallback reason occurs (keyed by reason)."""
        new = {k: v for k, v in reasons.items() if k not in self._fallback_logged}
        if new:
            self._fallback_logged.update(new)
            logger.warning(
                "harts_fsdp2: stock fsdp2 path (harts/fallback = 1): %s (each reason is logged "
                "once)",
                "; ".join(new.values()),
            )

    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False):
        self._calls += 1
        if not forward_only:  # the calls whose metrics veRL's trainer logs (updates)
            self._train_calls += 1
        n = len(data)
        temperature = _batch_temperature(data) if self._uses_temperature else 1.0
        forest = forest_of_batch(data) if n else None
        vocab = self._vocab_size()
        if forest is not None and vocab is not None:  # a clear error, not the embedding's
            forest.check_vocabulary(vocab)  # IndexError deep inside (stock's)
        s = forest.num_semantic_tokens if forest is not None else 0
        c = forest.num_compact_tokens if forest is not None else 0
        longest = int(forest.lengths.max()) if forest is not None else 0
        reasons = self._local_fallback_reasons(data, longest, forward_only)
        if forest is None:  # nothing to plan: stock's handling of an empty batch
            reasons["empty"] = "this rank's batch is empty"
        planned = None
        if forest is not None and not reasons:
            capacity = self._capacity(data, longest)
            planned = (capacity, *self._plan(forest, capacity))
        # (it resets _no_cut_reason: a peer's refusal leaves it empty here)
        cut_ok = self._stock_cut_possible(data)
        # All ranks take the same path (FSDP collectives must stay aligned): tree mode on all,
        # veRL's own cut on all, and the largest micro-batch count.
        ok_min, cut_min, neg_count = self._dp_all_reduce(
            [0.0 if reasons else 1.0, float(cut_ok), -float(len(planned[1]) if planned else 0)],
            op=dist.ReduceOp.MIN,
        )
        if ok_min < 1 and not reasons:
            reasons["peer"] = "another data-parallel rank's batch cannot run in tree mode"
        equalized = None
        if not reasons:
            # The compact rows the micro-batches will run: a tree that the token budget or the
            # DP count equalization splits pays its shared rows in each part (an over-size
            # trajectory runs alone).
            sp = self._sp_size()
            target = -(-int(-neg_count) // sp) * sp  # Ulysses SP: the SP ranks share them
            equalized = self._equalize(forest, planned[1], target)
            c = sum(w for w, g in equalized if g is not None)
        s_all, c_all = self._dp_all_reduce([s, c])
        compression = s_all / c_all if c_all else 1.0
        if compression < self.harts.min_compression:
            if cut_min >= 1:
                reasons["compression"] = (
                    f"compression {compression:.3f} < harts.min_compression "
                    f"{self.harts.min_compression:.3f}"
                )
            elif "compression_waived" not in self._fallback_logged:
                # the stock path would stop at veRL's refusal: tree mode runs the batch
                self._fallback_logged.add("compression_waived")
                logger.warning(
                    "harts_fsdp2: compression %.3f < harts.min_compression %.3f, but the stock "
                    "path cannot run this batch (%s): it runs in tree mode (logged once)",
                    compression,
                    self.harts.min_compression,
                    self._no_cut_reason or "veRL's micro-batching refuses it on another rank",
                )
        if reasons:
            self._log_fallback(reasons)
            # veRL's batch loop calls ``self.forward_step``: make it the stock one.
            self._stock_batch = True
            try:
                with self._stock_attention():
                    out = super().forward_backward_batch(
                        data, loss_function, forward_only=forward_only
                    )
            finally:
                self._stock_batch = False
            out.setdefault("metrics", {})
            for k, v in {"fallback": 1.0, "compression": compression}.items():
                out["metrics"][f"harts/{k}"] = [v]
            return out
        stock_split = stock_metrics = False
        if loss_function is not None:
            why = split_dependent_loss(loss_function)
            # Metrics as the stock engine reports them (a loss that does not depend on the
            # micro-batching runs again, without autograd, on veRL's own micro-batches).
            stock_metrics = why is None and self.harts.stock_metrics
            stock_split = why is not None and self._can_split_like_stock()
            if stock_split and "stock_split" not in self._fallback_logged:
                self._fallback_logged.add("stock_split")
                logger.info(
                    "harts_fsdp2: the loss depends on how the batch is cut into micro-batches "
                    "(%s); it is evaluated on veRL's own micro-batches, after one more forward "
                    "without graph (harts/stock_split_loss = 1; harts.split_dependent_losses="
                    "tree skips it where the loss does not in fact depend on the cut; logged "
                    "once)",
                    why,
                )
            if (
                why is not None
                and not stock_split
                and "split_dependent" not in self._fallback_logged
            ):
                self._fallback_logged.add("split_dependent")
                logger.warning(
                    "harts_fsdp2: the loss depends on how the batch is cut into "
                    "micro-batches (%s); it is evaluated on tree micro-batches "
                    "(harts.split_dependent_losses=tree), so its values differ from stock "
                    "fsdp2's micro-batching (logged once)",
                    why,
                )
        return self._tree_forward_backward_batch(
            data,
            loss_function,
            forward_only,
            forest,
            temperature,
            s_all,
            (*planned, equalized),
            stock_split=stock_split,
            stock_metrics=stock_metrics,
            stock_cut=cut_min >= 1 and loss_function is not None,
        )

    def _can_split_like_stock(self) -> bool:
        """Whether a loss that depends on the micro-batching is evaluated on veRL's own
        micro-batches (``harts.split_dependent_losses`` = ``stock``)."""
        return self.harts.split_dependent_losses == "stock"

    def _tree_forward_backward_batch(
        self,
        data: TensorDict,
        loss_function,
        forward_only: bool,
        forest: RolloutForest,
        temperature: float | np.ndarray,
        semantic_all: float,
        planned: tuple[int, list[tuple[int, np.ndarray]], float, list],
        *,
        stock_split: bool = False,
        stock_metrics: bool = False,
        stock_cut: bool = False,
    ):
        """One batch in tree mode: ``planned`` = ``(capacity, micro-batches, planning ms)`` of
        :meth:`_plan` and the micro-batches of :meth:`_equalize`; ``semantic_all`` the semantic
        tokens over the DP ranks (the metric ``harts/compression`` is it over the compact rows
        run on the DP ranks). ``stock_split``: the loss runs on veRL's own micro-batches
        (:meth:`_stock_split_forward_backward`). ``stock_metrics``: the loss runs on the tree
        micro-batches for the gradient, then again without autograd on veRL's own
        micro-batches over the kept outputs, whose losses and metrics are reported (the
        stock engine's values). Both need ``stock_cut`` (all DP ranks passed
        :meth:`_stock_cut_possible`) and veRL's cut itself (:meth:`_stock_cut`); without them
        the loss runs on the tree micro-batches and says so (metric ``harts/stock_metrics``)."""
        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        return_model_output = tu.get_non_tensor_data(
            data=data, key="return_model_output", default=False
        )
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        group = self.get_data_parallel_group()
        dist.all_reduce(batch_num_tokens, op=dist.ReduceOp.SUM, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())

        capacity, groups, planning_ms, equalized = planned
        oversize = self._note_oversize(forest, groups, capacity)
        cut = None
        if stock_split or stock_metrics:
            cut = self._stock_cut(data) if stock_cut else None
            if cut is None:
                self._log_no_stock_cut(stock_split, self._no_cut_reason)
                stock_split = stock_metrics = False
        sp = self._sp_size()
        groups_eq = [g for _, g in equalized]
        mine = groups_eq
        if sp > 1:
            owner = sp_assignment([w for w, _ in equalized], sp)
            rank = self.ulysses_device_mesh["sp"].get_local_rank()
            mine = [g for g, r in zip(groups_eq, owner) if r == rank]

        ctx = torch.no_grad() if forward_only else nullcontext()
        scaler = getattr(self, "scaler", None)
        output_lst: list[dict] = []
        indices: list[list[int]] = []
        stats = {"compact_tokens": 0, "replay_tokens": 0, "rounds": 0, "attention_key_rows": 0}
        shortest = [int(np.argmin(forest.lengths))]  # what a dummy micro-batch runs
        kept: dict[str, list[torch.Tensor | None]] = {}
        if stock_split:
            output_lst, indices, stats = self._stock_split_forward_backward(
                data,
                loss_function,
                forest,
                temperature,
                mine,
                return_model_output,
                forward_only,
                cut,
            )
            mine = []  # done: every micro-batch ran twice (see the method)
        select = _MicroBatchSelect(data)
        for k, idx in enumerate(mine):
            dummy = idx is None
            sel = shortest if dummy else idx.tolist()
            micro_batch = select(sel)
            sync_ctx = (
                nullcontext()
                if forward_only
                else self._gradient_sync_context(is_last_micro_batch=k == len(mine) - 1)
            )
            with (
                ctx,
                sync_ctx,
                self._without_ulysses(),
                torch.profiler.record_function(f"harts_micro_batch{k}"),
            ):
                loss, meta, mb_stats = self._tree_forward_step(
                    micro_batch,
                    loss_function=loss_function,
                    forward_only=forward_only,
                    temperature=select_temperatures(temperature, sel),
                    dummy=dummy,
                )
                if not forward_only:
                    # Under SP each micro-batch runs on one SP rank only, and FSDP averages
                    # gradients over DP x SP ranks (veRL's Ulysses gather scales by SP too).
                    loss_bw = loss * sp if sp > 1 else loss
                    if scaler is not None:
                        scaler.scale(loss_bw).backward()
                    else:
                        loss_bw.backward()
            if dummy:
                continue
            if stock_metrics and sp == 1:
                _keep_outputs(kept, meta["model_output"], sel, len(data))
            if not forward_only and not return_model_output and not (stock_metrics and sp > 1):
                meta.pop("model_output", None)
            for key in stats:
                stats[key] += mb_stats[key]
            output_lst.append(meta)
            indices.append(sel)

        if sp > 1 and not stock_split:
            # every SP rank gets every trajectory's outputs; with stock_metrics they are kept
            # for the replay on veRL's micro-batches (which every SP rank runs, as stock does)
            out, stats = self._sp_merge(
                output_lst, indices, stats, forest, with_losses=not stock_metrics
            )
            if stock_metrics:
                kept = {key: list(nt.unbind()) for key, nt in out["model_output"].items()}
                if not forward_only and not return_model_output:
                    out["model_output"] = {}
        else:
            out = self._postprocess(output_lst, indices)
        if stock_metrics:
            replayed, _ = self._stock_cut_losses(
                cut, loss_function, kept, with_grad=False, with_outputs=False
            )
            out["loss"] = [o["loss"] for o in replayed]
            out["metrics"] = {}
            for o in replayed:
                append_to_dict(out["metrics"], o["metrics"])
        metrics = out["metrics"]
        if not forward_only:
            self._pad_dp_metrics(metrics)
        run = self._dp_all_reduce([float(stats["compact_tokens"])])[0]
        metrics["harts/compression"] = [semantic_all / run if run else 1.0]
        metrics["harts/compact_tokens"] = [float(stats["compact_tokens"])]
        metrics["harts/replay_tokens"] = [float(stats["replay_tokens"])]
        # Σ Lk / C of this rank's micro-batches: a full-attention layer gathers (and without
        # harts.attention_key_rows keeps for backward) this many key rows per compact row
        metrics["harts/attention_key_rows_ratio"] = [
            stats["attention_key_rows"] / stats["compact_tokens"]
            if stats["compact_tokens"]
            else 0.0
        ]
        metrics["harts/rounds"] = [float(stats["rounds"])]
        metrics["harts/microbatches"] = [float(len(groups_eq))]
        metrics["harts/dummy_microbatches"] = [float(sum(g is None for g in groups_eq))]
        metrics["harts/planning_ms"] = [planning_ms]
        metrics["harts/oversize_microbatches"] = [float(oversize)]
        metrics["harts/fallback"] = [0.0]
        if not forward_only or loss_function is not None:
            metrics["harts/stock_split_loss"] = [float(stock_split)]
        if loss_function is not None:
            metrics["harts/stock_metrics"] = [float(stock_split or stock_metrics)]
        every = self.harts.audit_every
        if every and not forward_only and self._train_calls % every == 0:
            with self._without_ulysses():  # the stock reference runs whole trajectories too
                audit = self._audit(data, out.get("model_output", {}), temperature)
            metrics["harts/audit"] = [audit]
        return out

    def _stock_split_forward_backward(
        self,
        data: TensorDict,
        loss_function,
        forest: RolloutForest,
        temperature: float | np.ndarray,
        groups: list[np.ndarray | None],
        return_model_output: bool,
        forward_only: bool,
        cut: tuple[list[TensorDict], list[list[int]]],
    ) -> tuple[list[dict], list[list[int]], dict[str, int]]:
        """Training step of a loss that depends on the micro-batching, with the stock engine's
        numbers: (1) every tree micro-batch of ``groups`` (None: a dummy) runs without graph
        and keeps its trajectories' model outputs; (2) ``loss_function`` runs on veRL's own
        micro-batches of ``data`` (``prepare_micro_batches``, as the stock engine cuts them)
        over those outputs, giving each micro-batch's loss, metrics and the loss gradient with
        respect to every output; (3) every tree micro-batch runs again with graph and
        back-propagates Σ output · gradient. The parameter gradients are the stock ones (the
        loss is a function of the outputs only); the cost is one more forward without graph.
        ``forward_only``: steps (1) and (2) without gradients (the stock loss values and
        metrics of an evaluation call). ``cut``: veRL's micro-batches (:meth:`_stock_cut`).
        Returns the per-micro-batch outputs (``loss``, ``metrics``, ``model_output`` when
        ``return_model_output`` or ``forward_only``), their trajectory indices and the tree
        statistics."""
        n = len(data)
        device = get_device_id()
        shortest = [int(np.argmin(forest.lengths))]
        stats = {"compact_tokens": 0, "replay_tokens": 0, "rounds": 0, "attention_key_rows": 0}
        kept: dict[str, list[torch.Tensor | None]] = {}
        shares: list[tuple[dict[str, torch.Tensor], list[int]]] = []
        select = _MicroBatchSelect(data)
        for k, idx in enumerate(groups):  # (1) outputs without graph
            sel = shortest if idx is None else idx.tolist()
            micro_batch = select(sel)
            with (
                torch.no_grad(),
                self._without_ulysses(),
                torch.profiler.record_function(f"harts_outputs{k}"),
            ):
                outputs, _, mb_stats = self._tree_micro_batch_outputs(
                    micro_batch, select_temperatures(temperature, sel)
                )
            if idx is None:
                continue
            for key in stats:
                stats[key] += mb_stats[key]
            shares.append((outputs, sel))
        sp = self._sp_size()
        if sp > 1:  # every SP rank evaluates the loss over every trajectory, as stock SP does
            restored = self._sp_restore(shares, forest)
            kept = {key: list(nt.unbind()) for key, nt in restored.items()}
            stats = self._sp_sum(stats)
        else:
            for outputs, sel in shares:
                _keep_outputs(kept, outputs, sel, n)

        output_lst, grads = self._stock_cut_losses(  # (2) the loss, stock-cut
            cut,
            loss_function,
            kept,
            with_grad=not forward_only,
            with_outputs=return_model_output or forward_only,
        )
        if forward_only:
            return output_lst, cut[1], stats

        scaler = getattr(self, "scaler", None)
        for k, idx in enumerate(groups):  # (3) graph, backward of <outputs, loss gradient>
            sel = shortest if idx is None else idx.tolist()
            micro_batch = select(sel)
            sync_ctx = self._gradient_sync_context(is_last_micro_batch=k == len(groups) - 1)
            with (
                sync_ctx,
                self._without_ulysses(),
                torch.profiler.record_function(f"harts_micro_batch{k}"),
            ):
                outputs, anchor, _ = self._tree_micro_batch_outputs(
                    micro_batch, select_temperatures(temperature, sel)
                )
                total = anchor.sum() * 0.0
                for key, nested in outputs.items():
                    if idx is None or all(grads[key][i] is None for i in sel):
                        continue
                    g = torch.cat(
                        [
                            grads[key][i]
                            if grads[key][i] is not None
                            else torch.zeros(_kept_len(kept, i), device=device)
                            for i in sel
                        ]
                    )
                    values = nested.values()
                    total = total + (values * g.to(values.dtype)).sum()
                if sp > 1:  # FSDP averages over DP x SP ranks; each trajectory runs on one
                    total = total * sp
                if scaler is not None:
                    scaler.scale(total).backward()
                else:
                    total.backward()
        return output_lst, cut[1], stats

    def _stock_cut_possible(self, data: TensorDict) -> bool:
        """Whether veRL's ``prepare_micro_batches`` passes its rank-local checks on ``data``
        (its checks agreed over the DP ranks raise alike on every rank: :meth:`_stock_cut`
        catches those): with dynamic batching a token budget of at least the longest
        trajectory (the padded width of a dense batch) and a batch size divisible by
        ``force_group_size``; with fixed-size micro-batches a batch size divisible by
        ``force_group_size`` × ``micro_batch_size_per_gpu``. Otherwise
        ``self._no_cut_reason`` says why."""
        self._no_cut_reason = ""
        get = partial(tu.get_non_tensor_data, data=data)
        n, group = len(data), int(get(key="force_group_size", default=1) or 1)
        if get(key="use_dynamic_bsz", default=True):
            budget = get(key="max_token_len_per_gpu", default=None)
            ids = data["input_ids"]
            if ids.is_nested:
                width = int(ids.offsets().diff().max()) if n else 0
            else:
                width = int(data["attention_mask"].shape[-1])
            if budget is None:
                self._no_cut_reason = "the batch has no max_token_len_per_gpu"
            elif width > budget * self._sp_size():
                self._no_cut_reason = (
                    f"max_token_len_per_gpu {budget} < the longest trajectory ({width} tokens)"
                )
            elif n % group:
                self._no_cut_reason = (
                    f"{n} trajectories do not divide into force_group_size {group}"
                )
            return not self._no_cut_reason
        mbs = get(key="micro_batch_size_per_gpu", default=None)
        if not mbs or n % (group * int(mbs)):
            self._no_cut_reason = (
                f"{n} trajectories do not divide into micro_batch_size_per_gpu {mbs}"
                + (f" × force_group_size {group}" if group > 1 else "")
            )
            return False
        return True

    def _stock_cut(self, data: TensorDict) -> tuple[list[TensorDict], list[list[int]]] | None:
        """veRL's own micro-batches of ``data`` and their trajectory indices, cut as the stock
        engine cuts them (``prepare_micro_batches``, equal counts on the DP ranks; call it on
        every DP rank, after :meth:`_stock_cut_possible` held on all). None where veRL refuses
        the cut with a ValueError, which its DP-agreed checks raise on every rank alike
        (``self._no_cut_reason`` then holds it)."""
        from verl.workers.engine.utils import prepare_micro_batches

        try:
            micro_batches, batch_idx = prepare_micro_batches(
                data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True
            )
        except ValueError as exc:
            self._no_cut_reason = str(exc)
            return None
        if batch_idx is None:  # fixed-size micro-batches: consecutive chunks
            ends = np.cumsum([len(mb) for mb in micro_batches])
            batch_idx = [list(range(e - len(mb), e)) for mb, e in zip(micro_batches, ends)]
        return list(micro_batches), [[int(i) for i in b] for b in batch_idx]

    def _log_no_stock_cut(self, stock_split: bool, reason: str) -> None:
        """WARNING, once per kind, that veRL's micro-batching refuses this batch (``reason``),
        so the loss (``stock_split``: a loss that depends on the micro-batching) and its
        metrics are evaluated on the tree micro-batches."""
        key = "no_stock_cut_split" if stock_split else "no_stock_cut"
        if key in self._fallback_logged:
            return
        self._fallback_logged.add(key)
        logger.warning(
            "harts_fsdp2: veRL's own micro-batching refuses this batch (%s; the stock engine "
            "would stop here), so %s on the tree micro-batches (harts/stock_metrics = 0; "
            "logged once)",
            reason or "refused on another data-parallel rank",
            "the loss, which depends on the micro-batching, and its metrics are evaluated"
            if stock_split
            else "its metrics are taken",
        )

    def _stock_cut_losses(
        self,
        cut: tuple[list[TensorDict], list[list[int]]],
        loss_function,
        kept: dict[str, list[torch.Tensor | None]],
        *,
        with_grad: bool,
        with_outputs: bool,
    ) -> tuple[list[dict], dict[str, list[torch.Tensor | None]]]:
        """``loss_function`` on veRL's own micro-batches ``cut`` (:meth:`_stock_cut`) over
        ``kept`` (per model-output key, every trajectory's detached output in batch order):
        each micro-batch's ``loss`` and ``metrics`` (and ``model_output`` with
        ``with_outputs``), and with ``with_grad`` the loss gradient with respect to every kept
        output (None where the loss does not use it; without ``with_grad`` the loss runs
        without autograd and every gradient is None)."""
        micro_batches, batch_idx = cut
        n = len(next(iter(kept.values()))) if kept else 0
        device = get_device_id()
        grads: dict[str, list[torch.Tensor | None]] = {key: [None] * n for key in kept}
        output_lst: list[dict] = []
        for micro_batch, idx in zip(micro_batches, batch_idx):
            micro_batch = micro_batch.to(device)
            lengths = torch.tensor([0] + [_kept_len(kept, i) for i in idx], device=device)
            offsets = torch.cumsum(lengths, 0)
            leaves = {
                key: torch.cat([col[i] for i in idx]).requires_grad_(with_grad)
                for key, col in kept.items()
            }
            model_output = {
                key: torch.nested.nested_tensor_from_jagged(leaf, offsets)
                for key, leaf in leaves.items()
            }
            grad_ctx = nullcontext() if with_grad else torch.no_grad()
            with grad_ctx, self._autocast():
                loss, metrics = loss_function(
                    model_output=model_output,
                    data=micro_batch,
                    dp_group=self.get_data_parallel_group(),
                )
            loss = _checked_scalar_loss(loss)
            if loss.requires_grad:
                keys = list(leaves)
                got = torch.autograd.grad(loss, [leaves[k] for k in keys], allow_unused=True)
                for key, g in zip(keys, got):
                    if g is None:
                        continue
                    for i, part in zip(idx, g.split(lengths[1:].tolist())):
                        grads[key][i] = part
            meta = {"loss": float(loss.detach().item()), "metrics": metrics}
            if with_outputs:
                meta["model_output"] = detach_tree(model_output)
            output_lst.append(meta)
        return output_lst, grads

    def _sp_merge(
        self,
        output_lst: list[dict],
        indices: list[list[int]],
        stats: dict[str, int],
        forest: RolloutForest,
        with_losses: bool = True,
    ) -> tuple[dict, dict[str, int]]:
        """Under Ulysses SP: the whole batch's output on every SP rank from each rank's share of
        the micro-batches: model outputs (:meth:`_sp_restore`), then losses and metrics in
        SP-rank order (empty without ``with_losses``: the caller evaluates them itself), and
        the summed ``stats``."""
        group = self.ulysses_parallel_group
        local = {
            "loss": [o["loss"] for o in output_lst if "loss" in o] if with_losses else [],
            "metrics": [_cpu_objects(o.get("metrics", {})) for o in output_lst]
            if with_losses
            else [],
            "stats": stats,
        }
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        losses = [x for g in gathered for x in g["loss"]]
        metrics: dict = {}
        for g in gathered:
            for m in g["metrics"]:
                append_to_dict(metrics, m)
        merged_stats = {k: sum(int(g["stats"][k]) for g in gathered) for k in stats}
        shares = [
            (o["model_output"], sel) for o, sel in zip(output_lst, indices) if "model_output" in o
        ]
        restored = self._sp_restore(shares, forest)
        return {"model_output": restored, "loss": losses, "metrics": metrics}, merged_stats

    def _sp_restore(
        self, shares: list[tuple[dict[str, torch.Tensor], list[int]]], forest: RolloutForest
    ) -> dict[str, torch.Tensor]:
        """Under Ulysses SP: every trajectory's model outputs (per key, nested in batch order)
        on every SP rank, from this rank's ``shares`` (per micro-batch: its outputs, nested in
        ``sel`` order, and ``sel``). Every trajectory is computed on exactly one SP rank; the
        others add zeros, so the sum is exact. Call it on every SP rank."""
        group = self.ulysses_parallel_group
        mine = sorted({(k, str(v.dtype)) for outputs, _ in shares for k, v in outputs.items()})
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        keys = sorted({tuple(k) for g in gathered for k in g})
        device = get_device_id()
        offsets = np.asarray(forest.row_offsets, np.int64)
        s = int(offsets[-1])
        restored = {}
        for key, dtype in keys:
            flat = torch.zeros(s, dtype=getattr(torch, dtype.split(".")[-1]), device=device)
            vals = [(outputs[key], sel) for outputs, sel in shares if key in outputs]
            if vals:
                sel = np.concatenate([np.asarray(x, np.int64) for _, x in vals])
                ranges = concat_ranges(offsets[sel], offsets[sel + 1] - offsets[sel])
                pos = torch.from_numpy(ranges).to(device)
                src = torch.cat([v.values() for v, _ in vals]).to(flat.dtype)
                flat = flat.index_put((pos,), src)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            restored[key] = torch.nested.nested_tensor_from_jagged(
                flat, torch.from_numpy(offsets).to(device)
            )
        return restored

    def _pad_dp_metrics(self, metrics: dict) -> None:
        """Give every ``Metric`` of ``metrics`` the same number of values on all DP ranks, as
        veRL's ``Metric.aggregate_dp`` requires (the stock engine runs equal micro-batch counts
        with one value each; a dummy micro-batch reports none). Filled values leave each rank's
        aggregate unchanged: 0 for SUM (a dummy's loss is 0), the rank's own mean / min / max
        for MEAN / MIN / MAX (the other ranks' mean of those when the rank has no value)."""
        from verl.utils.metric.utils import AggregationType, Metric

        group = self.get_data_parallel_group()
        if not dist.is_initialized() or dist.get_world_size(group) <= 1:
            return
        fill = {
            AggregationType.SUM: lambda v: 0.0,
            AggregationType.MEAN: lambda v: float(np.mean(v)),
            AggregationType.MIN: lambda v: float(np.min(v)),
            AggregationType.MAX: lambda v: float(np.max(v)),
        }
        mine = {
            k: (
                len(m.values),
                m.aggregation.value,
                fill[m.aggregation](m.values) if m.values else None,
            )
            for k, m in metrics.items()
            if isinstance(m, Metric)
        }
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        for key in sorted({k for g in gathered for k in g}):
            entries = [g[key] for g in gathered if key in g]
            count, agg = max(e[0] for e in entries), AggregationType(entries[0][1])
            metric = metrics.get(key)
            if metric is None:
                metric = metrics[key] = Metric(aggregation=agg)
            if len(metric.values) >= count:
                continue
            value = 0.0 if agg == AggregationType.SUM else mine.get(key, (0, 0, None))[2]
            if value is None:
                value = float(np.mean([e[2] for e in entries if e[2] is not None]))
            metric.extend([value] * (count - len(metric.values)))

    @staticmethod
    def _postprocess(output_lst: list[dict], indices: list[list[int]]) -> dict:
        """Concatenate micro-batch outputs and restore the batch order (as
        ``postprocess_batch_func`` does for dynamic batching)."""
        model_output: dict[str, list] = {}
        losses, metrics = [], {}
        for o in output_lst:
            for key, val in o.get("model_output", {}).items():
                model_output.setdefault(key, []).append(val)
            if "loss" in o:
                losses.append(o["loss"])
            if "metrics" in o:
                append_to_dict(metrics, o["metrics"])
        restored = {}
        for key, vals in model_output.items():
            tensors = [t for nt in vals for t in nt.unbind()]
            nested = torch.nested.as_nested_tensor(tensors, layout=torch.jagged)
            restored[key] = restore_dynamic_batch(nested, indices)
        return {"model_output": restored, "loss": losses, "metrics": metrics}

    # ------------------------------------------------------------------ micro-batch
    def _run_tree_model(self, layout: TreeLayout, device: torch.device) -> Any:
        """One forward of the FSDP root module on the compact rows of ``layout`` (row tokens,
        row depths as positions, the layout reaching the patched token mixers)."""
        kwargs: dict[str, Any] = {}
        if self._model_type in MASKED_TREE_MODEL_TYPES:
            kwargs["attention_mask"] = tree_mode_attention_mask(device)
        if hasattr(getattr(self.module, "config", None), "output_router_logits"):
            # HF's load-balancing loss would read the tree-mode mask as a padding mask; veRL's
            # losses do not use it.
            kwargs["output_router_logits"] = False
        with tree_call(), self._plain_causal_forward():
            return self.module(
                input_ids=layout.token_ids[None],
                position_ids=layout.position_ids[None],
                use_cache=False,
                harts_layout=layout,
                **kwargs,
            )

    def _tree_outputs(
        self,
        micro_batch: TensorDict,
        forest: RolloutForest,
        layout: TreeLayout,
        temperature: float | np.ndarray,
        device: torch.device,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """veRL's model output of a tree micro-batch (nested per trajectory, batch order) and
        one tensor of the graph (a dummy micro-batch's zero loss hangs on it). Here: shifted
        ``log_probs`` (+ ``entropy``, ``sum_pi_squared`` on request) through the compact LM
        head; 0 at position L−1."""
        with_entropy = bool(
            tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        )
        with_sq = bool(
            tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False)
        )
        rows_per_chunk = self.harts.rows_per_chunk

        def head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
            res = compact_log_probs(
                hidden[0] if hidden.dim() == 3 else hidden,
                weight,
                forest,
                lm_head_bias=bias,
                logit_transform=self._logit_transform,
                temperature=temperature,
                with_entropy=with_entropy,
                with_sum_pi_squared=with_sq,
                rows_per_chunk=rows_per_chunk,
                output="flat",
            )
            cols = [res.log_probs[None]] + ([res.entropy[None]] if with_entropy else [])
            cols += [res.sum_pi_squared[None]] if with_sq else []
            return torch.stack(cols, dim=-1)  # [1, S - N, 1 to 3], not a view (FSDP2 hooks)

        head_mod = self._lm_head
        setattr(head_mod, _HEAD_FN, head)
        try:
            raw = self._run_tree_model(layout, device)
        finally:
            setattr(head_mod, _HEAD_FN, None)
        s = forest.num_semantic_tokens
        want = (1, s - forest.num_trajectories, 1 + with_entropy + with_sq)
        if raw.logits is None or tuple(raw.logits.shape) != want:
            got = None if raw.logits is None else tuple(raw.logits.shape)
            raise RuntimeError(
                f"harts_fsdp2: the tree call returned logits of shape {got}, expected {want} "
                "from the compact log-prob head (something replaced the LM head or the model's "
                "forward after the engine was built)"
            )
        flat = raw.logits[0]  # [S - N, 1 to 3]: log-probs, [entropy], [Σp²]
        keep = np.ones(s, dtype=bool)
        keep[forest.row_offsets[1:] - 1] = False
        pos = torch.from_numpy(np.flatnonzero(keep)).to(device)
        offsets = torch.from_numpy(forest.row_offsets).to(device)

        def nested(col: torch.Tensor) -> torch.Tensor:
            full = torch.zeros(s, dtype=col.dtype, device=device).index_put((pos,), col)
            return torch.nested.nested_tensor_from_jagged(full, offsets)

        model_output = {"log_probs": nested(flat[:, 0])}
        if with_entropy:
            model_output["entropy"] = nested(flat[:, 1])
        if with_sq:
            model_output["sum_pi_squared"] = nested(flat[:, -1])
        return model_output, flat

    def _tree_forward_step(
        self,
        micro_batch: TensorDict,
        *,
        loss_function,
        forward_only: bool,
        temperature: float | np.ndarray,
        dummy: bool = False,
    ) -> tuple[torch.Tensor, dict, dict]:
        micro_batch = micro_batch.to(get_device_id())
        device = micro_batch["input_ids"].values().device
        with self._autocast():
            model_output, anchor, stats = self._tree_micro_batch_outputs(micro_batch, temperature)
            if dummy:
                # A loss that all-reduces in every call makes the same collectives here, with
                # nothing to add (the ranks' call counts must match).
                for _ in range(loss_collectives(loss_function)):
                    _empty_distributed_mean(device)
                loss = anchor.sum() * 0.0
                metrics: dict = {}
            elif loss_function is not None:
                loss, metrics = loss_function(
                    model_output=model_output,
                    data=micro_batch,
                    dp_group=self.get_data_parallel_group(),
                )
            else:
                assert forward_only, "forward_only must be True when loss_function is None"
                loss = torch.tensor(1.0, device=device)
                metrics = {}
        meta = {
            "model_output": detach_tree(model_output),
            "loss": float(loss.detach().item()),
            "metrics": metrics,
        }
        return loss, meta, stats

    def _autocast(self) -> AbstractContextManager[Any]:
        """The stock engine's autocast (none when its parameter dtype is float32)."""
        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        if autocast_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=get_device_name(), dtype=autocast_dtype)

    def _tree_micro_batch_outputs(
        self, micro_batch: TensorDict, temperature: float | np.ndarray
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, int]]:
        """One tree forward of ``micro_batch`` (moved to the device, under the stock autocast):
        veRL's model output (nested per trajectory, batch order), one tensor of the graph, and
        the micro-batch's ``compact_tokens`` / ``replay_tokens`` / ``rounds``."""
        # the forest from the ids where they are (on the host in veRL: no device round trip)
        forest = RolloutForest.from_sequences(token_sequences(micro_batch["input_ids"]))
        micro_batch = micro_batch.to(get_device_id())
        device = micro_batch["input_ids"].values().device
        layout = TreeLayout(
            forest,
            chunk_size=self.harts.chunk_size,
            device=device,
            attention_key_rows=self.harts.attention_key_rows,
        )
        with self._autocast():
            model_output, anchor = self._tree_outputs(
                micro_batch, forest, layout, temperature, device
            )
        stats = {
            "compact_tokens": forest.num_compact_tokens,
            "replay_tokens": 0,
            "rounds": 0,
            # rows a full-attention layer gathers as keys (Σ over segments of their root path)
            "attention_key_rows": attention_key_rows(forest),
        }
        if "linear_plan" in layout.__dict__:
            stats["replay_tokens"] = int(layout.linear_plan.plan.replay_tokens)
            # the rounds that ran: a kernel that returns final states only (fla) runs the
            # plan split at its saved boundaries, with more rounds than planned
            stats["rounds"] = layout.linear_plan.num_rounds
        return model_output, anchor, stats

    def forward_step(self, micro_batch: TensorDict, loss_function, forward_only):
        """One micro-batch in tree mode; veRL's stock step inside a fallback batch, and for a
        micro-batch that cannot run in tree mode (see ``_local_fallback_reasons``)."""
        temperature = _batch_temperature(micro_batch) if self._uses_temperature else 1.0
        if self._stock_batch or self._sp_size() > 1:
            # (under Ulysses SP a lone tree micro-batch would run on every SP rank)
            return self._stock_forward_step(micro_batch, loss_function, forward_only)
        longest = max((len(t) for t in token_sequences(micro_batch["input_ids"])), default=0)
        if self._local_fallback_reasons(micro_batch, longest, forward_only):
            return self._stock_forward_step(micro_batch, loss_function, forward_only)
        loss, meta, _ = self._tree_forward_step(
            micro_batch,
            loss_function=loss_function,
            forward_only=forward_only,
            temperature=temperature,
        )
        return loss, meta

    def _stock_forward_step(self, micro_batch: TensorDict, loss_function, forward_only):
        """veRL's stock step for one micro-batch, with :meth:`_stock_attention`; for a model
        whose stock forward runs packed sequences as one (:meth:`_packed_reference_leaks`) on
        padded rows (a copy of the micro-batch with ``use_remove_padding=False``; not under Ulysses SP,
        which needs packing: the build warns), so a fallback batch computes each trajectory on
        its own, as tree mode and the rollout do. The padded path holds ``[B, L_max, V]`` logits
        where the packed one holds ``[tokens, V]``."""
        if self._packed_reference_leaks() and self._sp_size() == 1:
            if "padded_stock" not in self._fallback_logged:
                self._fallback_logged.add("padded_stock")
                logger.warning(
                    "harts: stock (fallback) micro-batches of model type %r run veRL's padded "
                    "path (logits [batch, longest, vocab]): its stock forward would run packed "
                    "sequences as one",
                    self._model_type,
                )
            micro_batch = tu.index_select_tensor_dict(micro_batch, list(range(len(micro_batch))))
            tu.assign_non_tensor(micro_batch, use_remove_padding=False)
        with self._stock_attention():
            return super().forward_step(
                micro_batch, stock_strategy_loss(loss_function), forward_only
            )

    # ------------------------------------------------------------------ audit
    def _packed_reference_leaks(self) -> bool:
        """Whether the stock forward of packed sequences mixes them (the audit's reference and
        stock micro-batches then run padded rows): HF's torch fallback for linear attention
        carries state across packed sequences (hybrids without fla), and so do the model types of
        :data:`_PADDED_STOCK_TYPES` (Mamba-2 / Mamba-1, short-conv and lightning mixers without
        ``position_ids``; gpt-oss's masks)."""
        if self._model_type in HYBRID_MODEL_TYPES and not _fla_importable():
            return True
        return self._model_type in _PADDED_STOCK_TYPES

    def _attention_term_dropped(self, module: torch.nn.Module | None = None) -> str | None:
        """What HF's stock forward of this model leaves out of its attention with the configured
        implementation (tree mode always applies it), or None: gpt-oss's attention sinks on a
        flash-attention implementation (transformers passes ``s_aux`` only to kernels that take
        it); an attention logit soft-cap (Gemma 2's ``attn_logit_softcapping``) on sdpa, whose
        transformers path ignores ``softcap``."""
        module = self.module if module is None else module
        config = getattr(module, "config", None)
        impl = str(getattr(config, "_attn_implementation", ""))
        if getattr(config, "model_type", None) == "gpt_oss" and impl.startswith("flash"):
            return _SINKS_DROPPED
        if getattr(config, "attn_logit_softcapping", None) is not None and impl == "sdpa":
            return _SOFTCAP_DROPPED
        return None

    def _stock_attention(self) -> AbstractContextManager[None]:
        """The attention a stock (fallback) batch runs: HF's eager attention where the configured
        sdpa drops Gemma 2's attention soft-cap (eager takes packed sequences, so the batch
        computes the model tree mode and the rollout compute); the configured one otherwise
        (gpt-oss's eager masks ignore packed positions: its sink warning stands)."""
        return self._eager_attention(terms=(_SOFTCAP_DROPPED,))

    @contextmanager
    def _eager_attention(
        self, terms: tuple[str, ...] = (_SINKS_DROPPED, _SOFTCAP_DROPPED)
    ) -> Iterator[None]:
        """HF's eager attention (which applies gpt-oss's sinks and Gemma 2's attention soft-cap)
        for the duration of a stock forward, where :meth:`_attention_term_dropped` names one of
        ``terms``; a no-op otherwise."""
        config = getattr(self.module, "config", None)
        if self._attention_term_dropped() not in terms or config is None:
            yield
            return
        saved = config._attn_implementation_internal
        config._attn_implementation_internal = "eager"
        try:
            yield
        finally:
            config._attn_implementation_internal = saved

    def _audit_unfused(self, sub: TensorDict) -> bool:
        """Whether the audit's stock reference of ``sub`` runs without veRL's fused forward
        (``use_fused_kernels`` off, HF's backbone-then-head forward or the native wrapper's
        own, :meth:`_plain_causal_forward`): where that fused forward cannot run what tree mode
        runs — per-sample temperatures (veRL asserts a scalar) or the native model (veRL's
        fused forward passes its backbone keywords it does not take) — rather than stopping
        the training step."""
        if not self._fused_forward():
            return False
        temperature = sub["temperature"] if "temperature" in sub.keys() else None
        own = getattr(type(_causal_lm_of(self.module)), "harts_forward", None) is not None
        return isinstance(temperature, torch.Tensor) or own

    def _audit(
        self, data: TensorDict, model_output: dict, temperature: float | np.ndarray
    ) -> float:
        """max |Δ| of the audited output (log-probs; values for the critic) between the tree
        result and the stock (expanded) forward on the first ``harts.audit_trajectories``
        trajectories of the local batch (positions 0..L−2 for shifted outputs, else all). Where
        the stock forward mixes packed sequences (:meth:`_packed_reference_leaks`) it runs
        padded rows, and eager attention where the configured one drops attention sinks or a
        soft-cap (:meth:`_eager_attention`)."""
        n = min(self.harts.audit_trajectories, len(data))
        sub = tu.index_select_tensor_dict(data, list(range(n)))
        if self._packed_reference_leaks():
            tu.assign_non_tensor(sub, use_remove_padding=False)
        unfused = self._audit_unfused(sub)
        if unfused:
            tu.assign_non_tensor(sub, use_fused_kernels=False)
        plain = self._plain_causal_forward() if unfused else nullcontext()
        with torch.no_grad(), self._eager_attention(), plain:
            _, ref = FSDPEngineWithLMHead.forward_step(
                self, sub, loss_function=None, forward_only=True
            )
        key, cut = self._audit_key, (1 if self._audit_shifted else 0)
        ref_out = ref["model_output"][key].unbind()
        tree_out = model_output.get(key)
        if tree_out is None:  # training without return_model_output: recompute the tree side
            with torch.no_grad():
                _, meta, _ = self._tree_forward_step(
                    sub,
                    loss_function=None,
                    forward_only=True,
                    temperature=select_temperatures(temperature, list(range(n))),
                )
            tree = meta["model_output"][key].unbind()
        else:
            tree = tree_out.unbind()[:n]
        diff = 0.0
        for a, b in zip(tree, ref_out):
            m = a.shape[0] - cut
            if m > 0:
                diff = max(diff, float((a[:m].float() - b[:m].float()).abs().max()))
        return diff


@EngineRegistry.register(model_type="value_model", backend=STRATEGY, device=["cuda", "cpu"])
class HartsFSDPValueEngine(HartsFSDPEngine, FSDPEngineWithValueHead):
    """The critic (``critic.strategy=harts_fsdp2``): veRL's FSDP2 value-head engine with tree
    micro-batches. The backbone runs once per compact row; the value head (a token
    classifier's ``score``, ``num_labels = 1``) maps each row's hidden state to its value, and
    every semantic position (i, t) takes the value of its row: ``values`` nested per
    trajectory, all L positions, as the stock engine returns them. Everything else (planning,
    equal micro-batch counts across ranks, fallbacks, audit of ``values``) is the actor
    engine's."""

    _audit_key, _audit_shifted = "values", False
    _uses_temperature = False

    def _tree_head(self, module: torch.nn.Module) -> bool:
        """A token classifier with a one-label head runs as is; trl's ``v_head`` wrapper has
        no tree mode."""
        if hasattr(module, "v_head"):
            return False
        return int(getattr(getattr(module, "config", None), "num_labels", 1)) == 1

    def _tree_outputs(
        self,
        micro_batch: TensorDict,
        forest: RolloutForest,
        layout: TreeLayout,
        temperature: float | np.ndarray,
        device: torch.device,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        raw = self._run_tree_model(layout, device)
        rows = raw.logits[0]  # [C, 1]: one value per compact row
        rows = rows[..., 0] if rows.dim() == 2 else rows
        values = rows[torch.from_numpy(forest.semantic_rows).to(device)]
        offsets = torch.from_numpy(forest.row_offsets).to(device)
        return {"values": torch.nested.nested_tensor_from_jagged(values, offsets)}, rows
