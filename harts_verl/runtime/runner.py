"""TreeRunner and ExpandedRunner: per-trajectory log-probs and forward/backward of an RL loss.

Both runners share one code path; they differ only in the layout of a microbatch:
``TreeRunner`` runs the token trie (each unique token once, in DFS preorder), ``ExpandedRunner``
runs the trajectory-wise layout (trajectories packed varlen into microbatches of the same
capacity, no padding) with the same ops and kernels. That makes the baseline honest and the
comparison exact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from harts_verl.ops.layout import TreeLayout, check_chunk_size
from harts_verl.ops.logprobs import (
    check_temperature_floor,
    check_temperatures,
    compact_log_probs,
    select_temperatures,
)
from harts_verl.tree import RolloutForest
from harts_verl.tree._checks import holds_bool

LossFn = Callable[[list[torch.Tensor]], torch.Tensor]
logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one call measured: sizes, microbatches, timing (seconds)."""

    semantic_tokens: int = 0
    compact_tokens: int = 0
    microbatches: int = 0
    planning_seconds: float = 0.0
    compute_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # the partition used: one int64 array of trajectory indices per microbatch
    partition: list[np.ndarray] = field(default_factory=list)
    # trajectories longer than capacity_tokens (each ran in a microbatch of its own, whole)
    oversize_trajectories: int = 0

    @property
    def compression(self) -> float:
        return self.semantic_tokens / self.compact_tokens if self.compact_tokens else 1.0


def _positive_int(name: str, value: Any, alternative: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name}: expected a positive int{alternative}, got {value!r}")
    return int(value)


def _backward(total: torch.Tensor) -> None:
    """Backward of a step's loss; a loss that does not depend on the parameters (e.g. a
    constant) leaves every gradient untouched instead of failing."""
    if total.requires_grad:
        total.backward()


def _step_stats(
    forest: RolloutForest,
    compact: int,
    groups: list[np.ndarray],
    t0: float,
    t1: float,
    capacity: int | None,
) -> StepStats:
    """The :class:`StepStats` of a call that planned ``groups`` between ``t0`` and ``t1`` and
    computed until now, with ``capacity`` (None: unbounded) for its oversize count."""
    return StepStats(
        forest.num_semantic_tokens,
        compact,
        len(groups),
        t1 - t0,
        time.perf_counter() - t1,
        partition=[np.asarray(g, dtype=np.int64) for g in groups],
        oversize_trajectories=_oversize_count(forest, capacity),
    )


def _oversize_count(forest: RolloutForest, capacity: int | None) -> int:
    """Trajectories of ``forest`` longer than ``capacity`` tokens (0 without a capacity)."""
    if capacity is None or forest.num_trajectories == 0:
        return 0
    return int((np.asarray(forest.lengths) > capacity).sum())


def _checked_partition(microbatches: Any, n: int) -> list[np.ndarray]:
    """``microbatches`` as int64 arrays after checking that they partition ``range(n)`` (each
    trajectory in exactly one, none empty); ValueError naming ``microbatches`` otherwise."""
    try:
        microbatches = list(microbatches)
        groups = [np.asarray(g) for g in microbatches]
    except TypeError as exc:
        raise ValueError(f"microbatches: expected lists of trajectory indices ({exc})") from exc
    for k, g in enumerate(groups):
        if g.ndim == 1 and g.size == 0:
            raise ValueError(
                f"microbatches[{k}]: expected a non-empty list of trajectory indices, got an "
                "empty one"
            )
        if holds_bool(microbatches[k]):  # numpy reads [0, True] as the indices [0, 1]
            raise ValueError(f"microbatches[{k}]: expected trajectory indices, got a bool")
        if g.ndim != 1 or g.dtype.kind not in "iu":
            raise ValueError(
                f"microbatches[{k}]: expected a non-empty list of trajectory indices, got "
                f"dtype {g.dtype} shape {g.shape}"
            )
    flat = np.concatenate(groups).astype(np.int64) if groups else np.zeros(0, np.int64)
    counts = np.bincount(flat[(flat >= 0) & (flat < n)], minlength=n)
    if flat.size != n or (flat < 0).any() or (flat >= n).any() or (counts != 1).any():
        raise ValueError(
            f"microbatches: expected each of the {n} trajectories in exactly one microbatch, got "
            f"{flat.size} entries (missing {int((counts == 0).sum())}, repeated "
            f"{int((counts > 1).sum())}, out of range {int(((flat < 0) | (flat >= n)).sum())})"
        )
    return [g.astype(np.int64) for g in groups]


def _checked_loss(loss: Any, *, constant_ok: bool = False) -> torch.Tensor:
    """``loss_fn``'s result as a 0-d tensor: a one-element tensor, or with ``constant_ok`` a
    plain real number (a separable loss's ``sum()`` over no trajectory of a microbatch: it adds
    its value and no gradient); TypeError for anything else."""
    number = isinstance(loss, int | float | np.integer | np.floating)
    if constant_ok and number and not isinstance(loss, bool | np.bool_):
        try:
            return torch.tensor(float(loss), dtype=torch.float64)
        except OverflowError:  # an int past float's range
            raise TypeError(
                f"loss_fn: expected a finite number, got an int of {loss.bit_length()} bits"
            ) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise TypeError(f"loss_fn: expected a scalar tensor, got {got}")
    return loss.reshape(())


class _Runner:
    tree_mode: bool = True

    def __init__(
        self,
        model: nn.Module,
        *,
        chunk_size: int = 64,
        capacity_tokens: int | None = None,
        recompute: bool = False,
        rows_per_chunk: int = 4096,
        device: torch.device | str | None = None,
        warn_oversize: bool = True,
        linear_backend: Any = "auto",
        attention_backend: Any = "auto",
        planner_options: dict[str, Any] | None = None,
        attention_key_rows: int | None = None,
    ) -> None:
        from harts_verl.models.adapter import as_tree_model
        from harts_verl.tree.microbatch import check_plan_arguments

        self.model = as_tree_model(model)
        self.chunk_size = check_chunk_size(chunk_size)
        self.capacity_tokens = (
            None
            if capacity_tokens is None
            else _positive_int("capacity_tokens", capacity_tokens, " or None")
        )
        self.recompute = bool(recompute)
        self.rows_per_chunk = _positive_int("rows_per_chunk", rows_per_chunk)
        # Options of plan_microbatches in tree mode (e.g. ``max_search_cells``, ``improve``):
        # its search can cost more than the compute it saves on large batches.
        if planner_options is not None and not isinstance(planner_options, dict):
            raise TypeError(
                f"planner_options: expected a dict or None, got {type(planner_options).__name__}"
            )
        self.planner_options = dict(planner_options or {})
        if "capacity_tokens" in self.planner_options or "allow_oversize" in self.planner_options:
            raise ValueError("planner_options: capacity_tokens / allow_oversize are the runner's")
        check_plan_arguments(capacity_tokens=self.capacity_tokens or 1, **self.planner_options)
        if device is None:
            device = next(self.model.parameters()).device
        self.device = torch.device(device)
        self.last_stats = StepStats()
        # Kernel backends of every layout this runner builds (a name or a kernel object; see
        # harts_verl.ops.backends): "auto" picks by device.
        self.linear_backend = linear_backend
        self.attention_backend = attention_backend
        # Bound on the key rows an attention layer keeps for backward (TreeLayout); None = none.
        self.attention_key_rows = (
            None
            if attention_key_rows is None
            else _positive_int("attention_key_rows", attention_key_rows, " or None")
        )
        # The oversize WARNING is logged once per runner (never with ``warn_oversize=False``:
        # a caller that reports it itself).
        self._oversize_warned = not warn_oversize
        self._head()  # a wrapped LM head is refused at construction (and at every call)

    def _head(self) -> nn.Linear:
        """The model's LM head, which the compact log-prob head computes from its weight and
        bias; TypeError naming the wrapper when it is not a plain ``nn.Linear`` (a peft LoRA
        adapter or ``modules_to_save`` copy on ``lm_head``: its weight alone is not what the
        wrapped module computes)."""
        head = self.model.lm_head
        if not isinstance(head, nn.Linear):
            raise TypeError(
                f"lm_head: expected a plain torch.nn.Linear, got {type(head).__module__}."
                f"{type(head).__name__} (a LoRA adapter or wrapper on the LM head): tree mode "
                "computes log-probs from the head's weight; merge the adapter or leave lm_head "
                "out of the adapter's target modules"
            )
        return head

    def _check_trainable(self) -> None:
        """RuntimeError when :meth:`forward_backward` could not produce a gradient: autograd
        disabled (``torch.no_grad()`` / ``torch.inference_mode()``) or no parameter of the model
        requiring one (a silent no-op otherwise)."""
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "forward_backward: gradients are disabled (called under torch.no_grad() or "
                "torch.inference_mode()); use log_probs for a forward pass"
            )
        if not any(p.requires_grad for p in self.model.parameters()):
            raise RuntimeError(
                "forward_backward: no parameter of the model requires a gradient (all frozen)"
            )

    # ------------------------------------------------------------ layout
    def build_forest(self, sequences: Sequence[Any]) -> RolloutForest:
        """The layout forest of ``sequences``: the trie (tree) or one chain each (expanded).

        Raises ValueError naming the trajectory when a token id is outside the model's
        vocabulary (the embedding would fail with an IndexError deep inside)."""
        if self.tree_mode:
            forest = RolloutForest.from_sequences(sequences)
        else:
            forest = RolloutForest.expanded(sequences)
        forest.check_vocabulary(self._vocab_size())
        return forest

    def _vocab_size(self) -> int:
        """Ids the model can embed and predict: the smaller of the LM head's rows and the input
        embedding's rows (when the model exposes one)."""
        vocab = int(self._head().weight.shape[0])
        emb = getattr(self.model, "embed_tokens", None)
        if emb is None:
            get = getattr(getattr(self.model, "hf", None), "get_input_embeddings", None)
            emb = get() if callable(get) else None
        if isinstance(emb, nn.Embedding):
            vocab = min(vocab, int(emb.num_embeddings))
        return vocab

    def plan(self, forest: RolloutForest) -> list[np.ndarray]:
        """Trajectory index sets, one per microbatch (all trajectories if no capacity): the
        planner's (:func:`~harts_verl.tree.microbatch.plan_microbatches`) in tree mode; in
        expanded mode as dynamic batching packs them
        (:func:`~harts_verl.tree.microbatch.token_balanced_microbatches`: each within the
        capacity, balanced where that fits, no more of them than veRL's
        ``rearrange_micro_batches`` makes). A trajectory longer than ``capacity_tokens`` is
        never cut: it runs whole in a microbatch of its own (in tree mode with its identical
        copies); a WARNING is logged once per runner (unless it was built with
        ``warn_oversize=False``) and :attr:`StepStats.oversize_trajectories` counts them."""
        if self.capacity_tokens is None:
            return [np.arange(forest.num_trajectories, dtype=np.int64)]
        from harts_verl.tree.microbatch import plan_microbatches, token_balanced_microbatches

        over = _oversize_count(forest, self.capacity_tokens)
        if over and not self._oversize_warned:
            self._oversize_warned = True
            logger.warning(
                "%d trajectories are longer than capacity_tokens=%d (the longest: %d tokens): "
                "each runs whole in a microbatch of its own, above the capacity "
                "(last_stats.oversize_trajectories counts them per call)",
                over,
                self.capacity_tokens,
                int(np.asarray(forest.lengths).max()),
            )
        if not self.tree_mode:  # the trajectory-wise baseline packs as veRL does
            return token_balanced_microbatches(forest.lengths, self.capacity_tokens)
        plan = plan_microbatches(
            forest,
            capacity_tokens=self.capacity_tokens,
            allow_oversize=True,
            **self.planner_options,
        )
        return [mb.trajectories for mb in plan.microbatches if len(mb.trajectories)]

    def _layout(self, forest: RolloutForest) -> TreeLayout:
        return TreeLayout(
            forest,
            chunk_size=self.chunk_size,
            device=self.device,
            linear_backend=self.linear_backend,
            attention_backend=self.attention_backend,
            attention_key_rows=self.attention_key_rows,
        )

    def _sub_forest(self, forest: RolloutForest, idx: np.ndarray) -> RolloutForest:
        if idx.shape[0] == forest.num_trajectories and np.array_equal(idx, np.arange(idx.shape[0])):
            return forest
        if self.tree_mode:
            return forest.subset(idx)
        return RolloutForest.expanded([forest.tokens_of(int(i)) for i in idx])

    def _forward_mb(
        self, forest: RolloutForest, temperature: float | np.ndarray, with_entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, torch.Tensor]:
        layout = self._layout(forest)
        # The runner's ``recompute`` for this forward; the model's own setting is restored after
        # it (checkpointed layers keep what they need for their recomputation in backward).
        saved = getattr(self.model, "gradient_checkpointing", False)
        self.model.gradient_checkpointing = self.recompute
        try:
            hidden, aux = self.model(layout.token_ids, layout)
        finally:
            self.model.gradient_checkpointing = saved
        head = self._head()
        res = compact_log_probs(
            hidden,
            head.weight,
            forest,
            lm_head_bias=head.bias,
            logit_transform=getattr(self.model, "logit_transform", None),
            temperature=temperature,
            with_entropy=with_entropy,
            rows_per_chunk=self.rows_per_chunk,
        )
        return res.log_probs, res.entropy, aux

    # ------------------------------------------------------------ public API
    def log_probs(
        self,
        sequences: Sequence[Any],
        temperature: float | Sequence[float] | np.ndarray | torch.Tensor = 1.0,
        with_entropy: bool = False,
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per trajectory a tensor of length L−1: ``log p(x[t+1] | x[≤t])`` (no gradient).
        With ``with_entropy`` also the predictive entropies at the same positions. An empty
        batch gives empty lists. ``temperature``: one, or one per trajectory."""
        t0 = time.perf_counter()
        forest = self.build_forest(sequences)
        temperature = check_temperatures(temperature, forest.num_trajectories)  # also when empty
        check_temperature_floor(temperature, self._head().weight.dtype)
        groups = self.plan(forest) if forest.num_trajectories else []
        t1 = time.perf_counter()
        out: list[torch.Tensor | None] = [None] * forest.num_trajectories
        ent: list[torch.Tensor | None] = [None] * forest.num_trajectories
        compact = 0
        with torch.no_grad():
            for idx in groups:
                sub = self._sub_forest(forest, idx)
                compact += sub.num_compact_tokens
                lp, en, _ = self._forward_mb(
                    sub, select_temperatures(temperature, idx), with_entropy
                )
                for j, i in enumerate(idx.tolist()):
                    out[i] = lp[j]
                    if with_entropy:
                        ent[i] = en[j]
        self.last_stats = _step_stats(forest, compact, groups, t0, t1, self.capacity_tokens)
        if with_entropy:
            return out, ent  # type: ignore[return-value]
        return out  # type: ignore[return-value]

    def hidden_states(self, sequences: Sequence[Any]) -> list[torch.Tensor]:
        """Final hidden states per trajectory (``[L_i, D]``, no gradient), restored from rows."""
        forest = self.build_forest(sequences)
        out: list[torch.Tensor | None] = [None] * forest.num_trajectories
        with torch.no_grad():
            for idx in self.plan(forest) if forest.num_trajectories else []:
                sub = self._sub_forest(forest, idx)
                layout = self._layout(sub)
                hidden, _ = self.model(layout.token_ids, layout)
                for j, i in enumerate(idx.tolist()):
                    out[i] = hidden.index_select(
                        0, torch.as_tensor(sub.rows_of(j), device=hidden.device)
                    )
        return out  # type: ignore[return-value]

    def forward_backward(
        self,
        sequences: Sequence[Any],
        loss_fn: LossFn,
        *,
        temperature: float | Sequence[float] | np.ndarray | torch.Tensor = 1.0,
        include_aux_loss: bool = True,
        separable: bool = False,
        microbatches: Sequence[Sequence[int]] | None = None,
    ) -> dict[str, float]:
        """Run forward and backward of ``loss_fn(per-trajectory log-probs)``; gradients
        accumulate into the model's parameters.

        One microbatch: a single forward/backward. Several microbatches: the loss may couple
        trajectories across microbatches, so the log-probs of all microbatches are first computed
        without graph, ``loss_fn`` is back-propagated to them (and to whatever else it reaches:
        a learned baseline or a parameter penalty gets the same gradient as with one
        microbatch), and each microbatch is then re-run with graph and back-propagated with its
        trajectories' gradients (exact: the loss gradient is linear in the per-trajectory
        log-prob gradients). The router auxiliary loss
        of each microbatch enters with weight (its semantic tokens / all semantic tokens): like
        HF's and veRL's per-micro-batch load-balancing loss it depends on how the batch is cut,
        so a tree and an expanded run agree on it (and on the gradients it contributes) for the
        same partition. ``microbatches`` (lists of trajectory indices, each trajectory in
        exactly one) imposes a partition instead of planning one, e.g. the ``partition`` in
        another runner's :attr:`last_stats`.

        ``separable=True`` declares the loss a sum of per-trajectory terms (e.g. a token sum with
        a fixed normalizer, as veRL's ``ppo_loss`` with global token counts): each microbatch then
        runs forward/backward once, and ``loss_fn`` gets a list in which the trajectories of
        other microbatches are ``None``; the returned loss is the sum over microbatches.

        Returns ``loss``, ``aux_loss`` (the router auxiliary loss added to the objective; 0 with
        ``include_aux_loss=False``) and ``microbatches``. Raises ValueError for an empty batch
        or a ``microbatches`` that is not a partition of the trajectories, TypeError when
        ``loss_fn`` does not return a one-element tensor (with ``separable=True`` a plain number
        is taken as a constant: e.g. ``sum()`` over none of a microbatch's trajectories, no
        gradient), and RuntimeError (before any work)
        when autograd is disabled or no parameter requires a gradient.
        """
        t0 = time.perf_counter()
        self._check_trainable()
        forest = self.build_forest(sequences)
        temperature = check_temperatures(temperature, forest.num_trajectories)
        check_temperature_floor(temperature, self._head().weight.dtype)
        if forest.num_trajectories == 0:
            raise ValueError("sequences: no trajectories to train on (an empty batch)")
        if microbatches is None:
            groups = self.plan(forest)
        else:
            groups = _checked_partition(microbatches, forest.num_trajectories)
        t1 = time.perf_counter()
        n = forest.num_trajectories
        s_total = max(forest.num_semantic_tokens, 1)
        compact = 0
        aux_total = 0.0
        if separable and len(groups) > 1:
            loss_value = 0.0
            for idx in groups:
                sub = self._sub_forest(forest, idx)
                compact += sub.num_compact_tokens
                lp, _, aux = self._forward_mb(sub, select_temperatures(temperature, idx), False)
                part: list[torch.Tensor | None] = [None] * n
                for j, i in enumerate(idx.tolist()):
                    part[i] = lp[j]
                loss = _checked_loss(loss_fn(part), constant_ok=True)  # type: ignore[arg-type]
                total = loss
                if include_aux_loss:
                    w = sub.num_semantic_tokens / s_total
                    total = total + aux * w
                    aux_total += float(aux.detach()) * w
                _backward(total)
                loss_value += float(loss.detach())
        elif len(groups) == 1:
            sub = self._sub_forest(forest, groups[0])
            compact = sub.num_compact_tokens
            lp, _, aux = self._forward_mb(sub, select_temperatures(temperature, groups[0]), False)
            ordered: list[torch.Tensor | None] = [None] * n
            for j, i in enumerate(groups[0].tolist()):
                ordered[i] = lp[j]
            loss = _checked_loss(loss_fn(ordered), constant_ok=separable)  # type: ignore[arg-type]
            total = loss + aux if include_aux_loss else loss
            _backward(total)
            loss_value = float(loss.detach())
            aux_total = float(aux.detach()) if include_aux_loss else 0.0
        else:
            detached: list[torch.Tensor | None] = [None] * n
            with torch.no_grad():
                for idx in groups:
                    lp, _, _ = self._forward_mb(
                        self._sub_forest(forest, idx), select_temperatures(temperature, idx), False
                    )
                    for j, i in enumerate(idx.tolist()):
                        detached[i] = lp[j].detach().requires_grad_(True)
            # loss_fn gets a copy: a loss that rewrites or reorders its list must not change
            # which leaf each trajectory's gradient is taken from.
            leaves = tuple(detached)
            loss = _checked_loss(loss_fn(list(leaves)))  # type: ignore[arg-type]
            # A full backward (not autograd.grad w.r.t. the leaves alone): the loss's terms that
            # do not come from the log-probs (a learned baseline, a penalty on the parameters)
            # get their gradients as with one microbatch; the leaves' grads are then pushed back
            # through each microbatch. A leaf the loss does not use keeps grad None.
            _backward(loss)
            grads = tuple(None if leaf is None else leaf.grad for leaf in leaves)
            for idx in groups:
                sub = self._sub_forest(forest, idx)
                compact += sub.num_compact_tokens
                lp, _, aux = self._forward_mb(sub, select_temperatures(temperature, idx), False)
                terms = [
                    (lp[j] * grads[i]).sum()
                    for j, i in enumerate(idx.tolist())
                    if grads[i] is not None
                ]
                total = torch.stack(terms).sum() if terms else lp[0].sum() * 0
                if include_aux_loss:
                    w = sub.num_semantic_tokens / s_total
                    total = total + aux * w
                    aux_total += float(aux.detach()) * w
                _backward(total)
            loss_value = float(loss.detach())
        self.last_stats = _step_stats(forest, compact, groups, t0, t1, self.capacity_tokens)
        return {"loss": loss_value, "aux_loss": aux_total, "microbatches": float(len(groups))}


class TreeRunner(_Runner):
    """Runs each microbatch as its token trie: every unique token once (HARTS)."""

    tree_mode = True


class ExpandedRunner(_Runner):
    """The trajectory-wise baseline: same ops, same capacity, trajectories packed varlen."""

    tree_mode = False
