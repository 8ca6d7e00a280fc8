"""Run HF transformers hybrids in tree mode on their own weights.

Only the token mixers become tree-aware: the instance ``forward`` of each GatedDeltaNet and
gated attention module of Qwen3-Next / Qwen3.5 / Qwen3.5-MoE (and of the plain attention of
Qwen2 / Qwen3 / Llama) is wrapped so that, when a ``harts_layout`` keyword is passed, it runs the
tree ops (short conv over each row's path, chunkwise gated delta rule over the planned rounds,
tree attention); without it the original forward runs untouched. Embeddings, norms, MoE, rotary
tables and the LM head are HF's own code on the ``[1, C, D]`` compact batch. Parameter names and
the state dict are unchanged.

The hybrid text models' own ``forward`` (``Qwen3NextModel``, ``Qwen3_5TextModel``,
``Qwen3_5MoeTextModel``) is wrapped too, only so that a tree call never builds HF's ``[C, C]``
causal mask: tree attention takes its ancestor structure from the layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts_verl.ops.layout import TreeLayout

_PATCHED = "_harts_original_forward"

# Set while a tree-mode forward runs: a patched mixer reached without ``harts_layout`` inside it
# means some wrapper on the way dropped the keyword (it would silently run the trajectory-wise
# code on compact rows), so it raises instead.
_IN_TREE_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "harts_tree_call", default=False
)


@contextlib.contextmanager
def tree_call() -> Iterator[None]:
    """Mark a tree-mode forward (see :func:`patch_tree_mixers`)."""
    token = _IN_TREE_CALL.set(True)
    try:
        yield
    finally:
        _IN_TREE_CALL.reset(token)


def _original(module: nn.Module):
    if _IN_TREE_CALL.get():
        raise RuntimeError(
            f"{type(module).__name__}: called without harts_layout inside a tree-mode forward "
            "(a wrapper between the model and this module dropped the keyword)"
        )
    return getattr(module, _PATCHED)


# HF hybrids (GatedDeltaNet + gated full attention): Qwen3-Next and Qwen3.5 (dense / MoE; the
# text-only CausalLM and the multi-modal wrappers, whose text model runs in tree mode).
GATED_HYBRID_MODEL_TYPES = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)
_GDN_CLASSES = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
_GATED_ATTENTION_CLASSES = ("Qwen3NextAttention", "Qwen3_5Attention", "Qwen3_5MoeAttention")
_HYBRID_TEXT_MODEL_CLASSES = ("Qwen3NextModel", "Qwen3_5TextModel", "Qwen3_5MoeTextModel")
_ROUTER_CLASSES = ("Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter")

# Plain full-attention HF causal LMs whose attention modules :func:`_full_attn_tree_forward`
# reproduces (q/k/v projections, optional per-head q/k norm, RoPE, o_proj).
FULL_ATTENTION_MODEL_TYPES = ("qwen2", "qwen3", "llama")
_FULL_ATTENTION_CLASSES = ("Qwen2Attention", "Qwen3Attention", "LlamaAttention")

# Model types that run in tree mode (``harts_hybrid``: the native model through its HF wrapper).
TREE_MODEL_TYPES = GATED_HYBRID_MODEL_TYPES + FULL_ATTENTION_MODEL_TYPES + ("harts_hybrid",)


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _is_hf_class(mod: nn.Module, names: tuple[str, ...]) -> bool:
    cls = type(mod)
    return cls.__name__ in names and cls.__module__.startswith("transformers.")


def _is_gated_hybrid(model: nn.Module) -> bool:
    return _model_type(model) in GATED_HYBRID_MODEL_TYPES


def as_tree_model(model: nn.Module) -> nn.Module:
    """Return a module with the tree interface ``forward(input_ids [C], layout) -> (hidden [C, D],
    aux_loss)`` and an ``lm_head``: the native model as is, HF Qwen3-Next through
    :class:`HybridTreeModel`, Qwen2/Qwen3/Llama through :class:`HFCausalTreeModel`."""
    from harts_verl.models.hybrid import HybridForCausalLM

    if isinstance(model, HybridForCausalLM | HybridTreeModel | HFCausalTreeModel):
        return model
    native = getattr(model, "harts_native_model", None)  # HartsHybridForCausalLM (HF wrapper)
    if isinstance(native, HybridForCausalLM):
        return native
    if _is_gated_hybrid(model):
        return HybridTreeModel(model)
    if _model_type(model) in FULL_ATTENTION_MODEL_TYPES:
        return HFCausalTreeModel(model)
    raise TypeError(
        f"model: {type(model).__name__} is not supported in tree mode "
        "(supported: HybridForCausalLM, transformers Qwen3-Next / Qwen3.5 / Qwen3.5-MoE, "
        "Qwen2/Qwen3/Llama ForCausalLM)"
    )


def _gdn_tree_forward(
    self,
    hidden_states: torch.Tensor,
    *args: Any,
    harts_layout: TreeLayout | None = None,
    **kwargs: Any,
):
    if harts_layout is None:
        return _original(self)(hidden_states, *args, **kwargs)
    layout = harts_layout
    c = hidden_states.shape[1]
    if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: head-interleaved fused projections
        qkvz = self.in_proj_qkvz(hidden_states)
        ba = self.in_proj_ba(hidden_states)
        query, key, value, z, b, a = self.fix_query_key_value_ordering(qkvz, ba)
        mixed = torch.cat([x.reshape(c, -1) for x in (query, key, value)], dim=-1)
    else:  # Qwen3.5 (dense and MoE): separate q|k|v, z, b, a projections
        mixed = self.in_proj_qkv(hidden_states)[0]
        z = self.in_proj_z(hidden_states)
        b = self.in_proj_b(hidden_states)
        a = self.in_proj_a(hidden_states)
    mixed = layout.short_conv(
        mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation="silu"
    )
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(c, self.num_k_heads, self.head_k_dim)
    k = k.reshape(c, self.num_k_heads, self.head_k_dim)
    v = v.reshape(c, self.num_v_heads, self.head_v_dim)
    beta = b.sigmoid()[0]
    # The HF module's gate formula, computed in at least float32 (float64 stays float64).
    ct = torch.promote_types(a.dtype, torch.float32)
    g = (-self.A_log.to(ct).exp() * F.softplus(a.to(ct) + self.dt_bias.to(ct)))[0]
    o = layout.linear_attention(q, k, v, g, beta, use_qk_l2norm=True)
    o = o.to(hidden_states.dtype)
    o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(o.reshape(1, c, -1))


def _attn_tree_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    *args: Any,
    harts_layout: TreeLayout | None = None,
    **kwargs: Any,
):
    if harts_layout is None:
        return _original(self)(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    apply_rotary_pos_emb = sys.modules[type(self).__module__].apply_rotary_pos_emb
    c = hidden_states.shape[1]
    q, gate = torch.chunk(self.q_proj(hidden_states).view(1, c, -1, self.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(1, c, -1)
    q = self.q_norm(q).transpose(1, 2)
    k = self.k_norm(self.k_proj(hidden_states).view(1, c, -1, self.head_dim)).transpose(1, 2)
    v = self.v_proj(hidden_states).view(1, c, -1, self.head_dim)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = harts_layout.attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0], scale=self.scaling)
    o = o.reshape(1, c, -1) * torch.sigmoid(gate)
    return self.o_proj(o), None


def _full_attn_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Tree mode of a Qwen2/Qwen3/Llama attention module: the module's own projections,
    q/k norms and RoPE on the compact rows, softmax attention over each row's ancestors."""
    if harts_layout is None:
        return _original(self)(*args, **kwargs)
    names = ("hidden_states", "position_embeddings")
    vals = list(args[:2]) + [kwargs.get(n) for n in names[len(args[:2]) :]]
    hidden_states, position_embeddings = vals
    if getattr(self, "sliding_window", None):
        raise NotImplementedError(
            f"{type(self).__name__}: sliding-window attention is not supported in tree mode"
        )
    rope = sys.modules[type(self).__module__].apply_rotary_pos_emb
    c = hidden_states.shape[1]
    q = self.q_proj(hidden_states).view(1, c, -1, self.head_dim)
    k = self.k_proj(hidden_states).view(1, c, -1, self.head_dim)
    v = self.v_proj(hidden_states).view(1, c, -1, self.head_dim)
    if getattr(self, "q_norm", None) is not None:
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    o = harts_layout.attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0], scale=self.scaling)
    return self.o_proj(o.reshape(1, c, -1)), None


# A 1-element 4D boolean tensor: HF's ``create_causal_mask`` returns a 4D mask as is, and
# ``_update_linear_attn_mask`` maps an all-ones mask to None. Tree-mode mixers ignore masks.
def _no_mask(device: torch.device) -> torch.Tensor:
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def _hybrid_text_model_tree_forward(
    self, *args: Any, harts_layout: TreeLayout | None = None, **kwargs
):
    """Tree mode of a hybrid text model's ``forward``: HF's own code with ``harts_layout``
    forwarded to the layers and a 1-element mask in place of the ``[C, C]`` causal mask that HF
    would otherwise build from the (non-monotone) row depths."""
    if harts_layout is None:
        return getattr(self, _PATCHED)(*args, **kwargs)
    if len(args) > 1 or kwargs.get("attention_mask") is not None:
        raise ValueError("harts_layout: tree mode takes no attention_mask")
    kwargs["attention_mask"] = _no_mask(harts_layout.token_ids.device)
    return getattr(self, _PATCHED)(*args, harts_layout=harts_layout, **kwargs)


def patch_tree_mixers(model: nn.Module) -> int:
    """Make every supported token mixer of an HF model tree-aware (idempotent): the instance
    ``forward`` runs the tree ops when called with ``harts_layout=...`` and the original code
    otherwise. Returns the number of tree-capable modules (0: nothing in ``model`` is supported;
    the native model's HF wrapper counts as one)."""
    if getattr(model, "supports_harts_layout", False):
        return 1
    n = 0
    for mod in model.modules():
        if _is_hf_class(mod, _GDN_CLASSES):
            _patch(mod, _gdn_tree_forward)
        elif _is_hf_class(mod, _GATED_ATTENTION_CLASSES):
            _patch(mod, _attn_tree_forward)
        elif _is_hf_class(mod, _FULL_ATTENTION_CLASSES):
            _patch(mod, _full_attn_tree_forward)
        elif _is_hf_class(mod, _HYBRID_TEXT_MODEL_CLASSES):
            _patch(mod, _hybrid_text_model_tree_forward)
            continue
        else:
            continue
        n += 1
    return n


def _patch(module: nn.Module, fn) -> None:
    if not hasattr(module, _PATCHED):
        setattr(module, _PATCHED, module.forward)
        module.forward = types.MethodType(fn, module)


def _text_model(hf_model: nn.Module) -> nn.Module:
    """The decoder stack of an HF causal LM (``model``; ``model.language_model`` for the
    multi-modal Qwen3.5 wrappers)."""
    base = hf_model.model
    return getattr(base, "language_model", base)


def _tree_decoder_forward(
    tree_model: nn.Module, base: nn.Module, input_ids: torch.Tensor, layout: TreeLayout
) -> torch.Tensor:
    """The decoder stack ``base`` (HF text model) in tree mode: embeddings → the first
    ``config.num_hidden_layers`` layers with ``position_ids`` = row depth (activation
    checkpointing when ``tree_model.gradient_checkpointing`` and grad is on) → final norm.
    input_ids ``[C]`` → hidden ``[C, D]``."""
    pos = layout.position_ids[None]
    h = base.embed_tokens(input_ids[None])
    pe = base.rotary_emb(h, pos)
    with tree_call():
        for layer in base.layers[: tree_model.config.num_hidden_layers]:
            if tree_model.gradient_checkpointing and torch.is_grad_enabled():
                h = checkpoint(
                    lambda x, lyr=layer: lyr(
                        x, position_embeddings=pe, position_ids=pos, harts_layout=layout
                    ),
                    h,
                    use_reentrant=False,
                )
            else:
                h = layer(h, position_embeddings=pe, position_ids=pos, harts_layout=layout)
    return base.norm(h)[0]


class HybridTreeModel(nn.Module):
    """Tree-mode view of a transformers Qwen3-Next / Qwen3.5 / Qwen3.5-MoE causal LM (weights
    shared, not copied)."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.base = _text_model(hf_model)
        self.config = self.base.config
        self.gradient_checkpointing = False
        if patch_tree_mixers(hf_model) == 0:
            raise TypeError(f"model: {type(hf_model).__name__} has no supported token mixer")
        self._routers = [m for m in hf_model.modules() if _is_hf_class(m, _ROUTER_CLASSES)]

    @property
    def lm_head(self) -> nn.Linear:
        return self.hf.lm_head

    def _aux_loss(self, logits: list[torch.Tensor], layout: TreeLayout) -> torch.Tensor:
        from harts_verl.ops.moe import load_balancing_loss, softmax_topk_route

        cfg = self.config
        cat = torch.cat(logits, dim=0)
        norm = getattr(cfg, "norm_topk_prob", True)  # Qwen3.5-MoE always normalizes
        route = softmax_topk_route(cat, cfg.num_experts_per_tok, norm_topk_prob=norm)
        w = layout.row_weights(route.probs.dtype).repeat(len(logits))
        loss = load_balancing_loss(
            route.probs, route.experts, cfg.num_experts, cfg.num_experts_per_tok, weights=w
        )
        return loss * cfg.router_aux_loss_coef

    def forward(
        self, input_ids: torch.Tensor, layout: TreeLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids ``[C]`` → (final hidden ``[C, D]``, router aux loss weighted by
        multiplicity when ``config.output_router_logits`` else 0)."""
        captured: list[torch.Tensor] = []
        want_aux = bool(getattr(self.config, "output_router_logits", False)) and self._routers
        hooks = (
            [
                r.register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
                for r in self._routers
            ]
            if want_aux
            else []
        )
        try:
            h = _tree_decoder_forward(self, self.base, input_ids, layout)
        finally:
            for hk in hooks:
                hk.remove()
        aux = self._aux_loss(captured, layout) if captured else h.new_zeros(())
        return h, aux


class HFCausalTreeModel(nn.Module):
    """Tree-mode view of a plain full-attention HF causal LM (Qwen2, Qwen3, Llama): embeddings
    → decoder layers with ``position_ids`` = row depth and tree attention → final norm."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        self.gradient_checkpointing = False
        if patch_tree_mixers(hf_model) == 0:
            raise TypeError(f"model: {type(hf_model).__name__} has no supported attention module")

    @property
    def lm_head(self) -> nn.Linear:
        return self.hf.lm_head

    def forward(
        self, input_ids: torch.Tensor, layout: TreeLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids ``[C]`` → (final hidden ``[C, D]``, zero aux loss)."""
        h = _tree_decoder_forward(self, self.hf.model, input_ids, layout)
        return h, h.new_zeros(())
