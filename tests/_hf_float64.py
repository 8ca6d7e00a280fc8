"""Lift the float32 islands of HF's hybrids (Qwen3-Next / Qwen3.5 / Qwen3.5-MoE, OLMo Hybrid)
to float64.

HF computes these models' RMSNorms, gated norm and router softmax in float32 even in a float64
model, so their gradients carry float32 rounding whatever the batching. To test the tree
machinery at float64 precision these islands compute in the input dtype (same formulas); the
unmodified models are tested against HF's own forward separately.

Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's GatedDeltaNets cast ``A_log`` and ``a`` to float32 for
the gate and run HF's torch fallback delta rule with a float32 decay mask: their forwards
(no-cache path) are transcribed too, gate in at least float32, kernel lifted as OLMo's below. veRL's monkey patch
(``qwen3_5_gated_delta_net_forward``) computes the same without packing (``cu_seqlens=None``); it
is replaced by this one when lifted after veRL's patch.

OLMo Hybrid has more islands on HF's per-trajectory path: its rotary table is float32, its
GatedDeltaNet casts ``A_log`` and ``a`` to float32 for the gate, and the torch fallback delta rule
runs in float32. They are lifted too: the rotary table in the input dtype, and the GatedDeltaNet
forward (no-cache path, the one a training forward takes) transcribed from HF's with the gate in
at least float32 and HF's torch chunk kernel transcribed in at least float32 (both unchanged in
float32 models). The tree path never runs HF's GatedDeltaNet forward.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

_MODULES = {
    "transformers.models.qwen3_next.modeling_qwen3_next": "Qwen3Next",
    "transformers.models.qwen3_5.modeling_qwen3_5": "Qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": "Qwen3_5Moe",
}
_OLMO_HYBRID = "transformers.models.olmo_hybrid.modeling_olmo_hybrid"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rms(self, x):
    h = x if x.dtype == torch.float64 else x.float()
    return (self._norm(h) * (1.0 + self.weight.to(h.dtype))).type_as(x)


def _rms_gated(self, hidden_states, gate=None):
    dt = hidden_states.dtype
    h = hidden_states if dt == torch.float64 else hidden_states.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    h = (self.weight * h.to(dt)) * torch.nn.functional.silu(gate.to(h.dtype))
    return h.to(dt)


def _router(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(x, self.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Qwen3.5-MoE always normalizes
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), idx


def _olmo_rms(self, hidden_states):
    h = hidden_states.to(_compute_dtype(hidden_states.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight * h).to(hidden_states.dtype)


@torch.no_grad()
def _olmo_rotary(self, x, position_ids):
    dt = _compute_dtype(x.dtype)
    inv = self.inv_freq[None, :, None].to(dt).expand(position_ids.shape[0], -1, 1).to(x.device)
    freqs = (inv @ position_ids[:, None, :].to(dt)).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, use_qk_l2norm=True):
    """HF's ``torch_chunk_gated_delta_rule`` (no initial / final state) in at least float32:
    q/k ``[B, T, H, K]``, v ``[B, T, H, V]``, g/beta ``[B, T, H]`` → ``[B, T, H, V]``."""
    initial_dtype = query.dtype
    dt = _compute_dtype(initial_dtype)
    if use_qk_l2norm:
        query, key = _l2norm(query), _l2norm(key)
    query, key, value, beta, g = [
        x.transpose(1, 2).contiguous().to(dt) for x in (query, key, value, beta, g)
    ]
    batch_size, num_heads, sequence_length, k_head_dim = key.shape
    v_head_dim = value.shape[-1]
    pad = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    total = sequence_length + pad
    query = query * (1 / (query.shape[-1] ** 0.5))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, value, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
        for x in (query, key, value, k_beta, v_beta)
    ]
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk_size)
    dev = query.device
    mask = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=dev), diagonal=0)
    g = g.cumsum(dim=-1)
    decay_mask = (g.unsqueeze(-1) - g.unsqueeze(-2)).tril().exp().to(dt).tril()
    attn = -((k_beta @ key.transpose(-1, -2)) * decay_mask).masked_fill(mask, 0)
    for i in range(1, chunk_size):
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    attn = attn + torch.eye(chunk_size, dtype=attn.dtype, device=dev)
    value = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp().unsqueeze(-1))
    state = value.new_zeros(batch_size, num_heads, k_head_dim, v_head_dim)
    out = torch.zeros_like(value)
    for i in range(total // chunk_size):
        q_i, k_i, v_i = query[:, :, i], key[:, :, i], value[:, :, i]
        attn = q_i @ k_i.transpose(-1, -2) * decay_mask[:, :, i]  # decay_mask is lower-triangular
        v_new = v_i - k_cumdecay[:, :, i] @ state
        out[:, :, i] = (q_i * g[:, :, i, :, None].exp()) @ state + attn @ v_new
        state = (
            state * g[:, :, i, -1, None, None].exp()
            + (k_i * (g[:, :, i, -1, None] - g[:, :, i]).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :sequence_length]
    return out.transpose(1, 2).contiguous().to(initial_dtype)


def _olmo_gdn(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """HF's ``OlmoHybridGatedDeltaNet.forward`` without a cache, gate and kernel lifted."""
    if cache_params is not None:
        raise NotImplementedError("the lifted OLMo Hybrid GatedDeltaNet keeps no cache")
    hf = importlib.import_module(_OLMO_HYBRID)
    hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
    batch_size, seq_len, _ = hidden_states.shape
    q = self.q_conv1d(self.q_proj(hidden_states))[0].view(batch_size, seq_len, -1, self.head_k_dim)
    k = self.k_conv1d(self.k_proj(hidden_states))[0].view(batch_size, seq_len, -1, self.head_k_dim)
    v = self.v_conv1d(self.v_proj(hidden_states))[0].view(batch_size, seq_len, -1, self.head_v_dim)
    if self.num_v_heads > self.num_k_heads:
        ratio = self.num_v_heads // self.num_k_heads
        q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    beta = self.b_proj(hidden_states).sigmoid()
    if self.allow_neg_eigval:
        beta = beta * 2.0
    a = self.a_proj(hidden_states)
    dt = _compute_dtype(a.dtype)
    g = -self.A_log.to(dt).exp() * F.softplus(a.to(dt) + self.dt_bias.to(dt))
    out = _chunk_gated_delta_rule(q, k, v, g, beta)
    gate = self.g_proj(hidden_states)
    out = self.o_norm(out.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim))
    return self.o_proj(out.reshape(batch_size, seq_len, -1))


_PACKED_KEYS = ("cu_seqlens", "cu_seqlens_cpu", "cu_seq_lens_q", "seq_idx")


def _unpacked_input(self, name, hidden_states, cache_params, attention_mask, kwargs):
    """``hidden_states`` with padding zeroed (HF's ``apply_mask_to_padding_states``) after
    refusing a cache or packed sequences (``NotImplementedError`` naming the model ``name``)."""
    if cache_params is not None:
        raise NotImplementedError(f"the lifted {name} GatedDeltaNet keeps no cache")
    packed = [k for k in _PACKED_KEYS if kwargs.get(k) is not None]
    if packed:
        raise NotImplementedError(f"{packed[0]}: the lifted {name} GatedDeltaNet runs no packing")
    hf = importlib.import_module(type(self).__module__)
    return hf.apply_mask_to_padding_states(hidden_states, attention_mask)


def _lifted_gdn_core(self, mixed, z, b, a):
    """The part HF's Qwen3-Next / Qwen3.5 GatedDeltaNet forwards share, from the pre-conv
    ``mixed`` q/k/v ``[B, C, T]``, output gate ``z`` and the ``b`` / ``a`` projections: conv +
    SiLU, heads, gate in at least float32, lifted kernel, gated norm, output projection."""
    batch_size, _, seq_len = mixed.shape
    mixed = F.silu(self.conv1d(mixed)[:, :, :seq_len]).transpose(1, 2)
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(batch_size, seq_len, -1, self.head_k_dim)
    k = k.reshape(batch_size, seq_len, -1, self.head_k_dim)
    v = v.reshape(batch_size, seq_len, -1, self.head_v_dim)
    beta = b.sigmoid()
    dt = _compute_dtype(a.dtype)
    g = -self.A_log.to(dt).exp() * F.softplus(a.to(dt) + self.dt_bias.to(dt))
    if self.num_v_heads // self.num_k_heads > 1:
        ratio = self.num_v_heads // self.num_k_heads
        q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    out = _chunk_gated_delta_rule(q, k, v, g, beta)
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch_size, seq_len, -1))


def _qwen3_5_gdn(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """HF's ``Qwen3_5GatedDeltaNet.forward`` (also Qwen3.5-MoE's) without a cache or packing,
    gate and kernel lifted. Accepts veRL's ``cu_seqlens`` / ``cu_seqlens_cpu`` keywords when
    None; raises ``NotImplementedError`` for a cache or packed sequences."""
    h = _unpacked_input(self, "Qwen3.5", hidden_states, cache_params, attention_mask, kwargs)
    mixed = self.in_proj_qkv(h).transpose(1, 2)
    return _lifted_gdn_core(self, mixed, self.in_proj_z(h), self.in_proj_b(h), self.in_proj_a(h))


def _qwen3_next_gdn(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """HF's ``Qwen3NextGatedDeltaNet.forward`` without a cache or packing (interleaved
    ``in_proj_qkvz`` / ``in_proj_ba`` projections), gate and kernel lifted as in
    :func:`_qwen3_5_gdn`."""
    h = _unpacked_input(self, "Qwen3-Next", hidden_states, cache_params, attention_mask, kwargs)
    batch_size, seq_len, _ = h.shape
    q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(h), self.in_proj_ba(h))
    q, k, v = (x.reshape(batch_size, seq_len, -1) for x in (q, k, v))
    return _lifted_gdn_core(self, torch.cat((q, k, v), dim=-1).transpose(1, 2), z, b, a)


def lift_float32_islands(monkeypatch) -> None:
    """Patch (through pytest's ``monkeypatch``) every hybrid family's norms, router and
    GatedDeltaNet forward, and OLMo Hybrid's rotary table and GatedDeltaNet forward (see the
    module doc)."""
    for name, prefix in _MODULES.items():
        m = importlib.import_module(name)
        monkeypatch.setattr(getattr(m, f"{prefix}RMSNorm"), "forward", _rms)
        monkeypatch.setattr(getattr(m, f"{prefix}RMSNormGated"), "forward", _rms_gated)
        router = getattr(m, f"{prefix}TopKRouter", None)
        if router is not None:
            monkeypatch.setattr(router, "forward", _router)
        gdn = _qwen3_next_gdn if prefix == "Qwen3Next" else _qwen3_5_gdn
        monkeypatch.setattr(getattr(m, f"{prefix}GatedDeltaNet"), "forward", gdn)
    m = importlib.import_module(_OLMO_HYBRID)
    monkeypatch.setattr(m.OlmoHybridRMSNorm, "forward", _olmo_rms)
    monkeypatch.setattr(m.OlmoHybridRMSNormGated, "forward", _rms_gated)
    monkeypatch.setattr(m.OlmoHybridRotaryEmbedding, "forward", _olmo_rotary)
    monkeypatch.setattr(m.OlmoHybridGatedDeltaNet, "forward", _olmo_gdn)


# The full-attention families (``harts_verl.models.adapter.FULL_ATTENTION_MODEL_TYPES``, each in
# ``transformers.models.<module>.modeling_<module>``): their RMSNorms (``weight *
# x.to(float32)-normalised``, Gemma's ``(1 + weight) * …``; q/k norms, GLM-4's and OLMo's post
# norms and MLA's low-rank norms included) and routers (softmax
# top-k: Qwen2-MoE / Qwen3-MoE / Mixtral; DeepSeek-V3 / GLM-4-MoE's router logits) compute in
# float32. gpt-oss's router (biased logits, top-k, softmax over the chosen) and its sink
# attention compute in the input dtype: only its RMSNorms are lifted. Gemma 2's eager attention
# (soft-capped scores) takes its softmax in float32: lifted. Rotary tables are float32
# too, but the same for every path (they depend on the position only) and carry no gradient, so
# they stay.
_INPUT_DTYPE_ROUTERS = ("GptOssTopKRouter",)


def _llama_rms(self, hidden_states):
    h = hidden_states.to(_compute_dtype(hidden_states.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(hidden_states.dtype)


def _gemma_rms(self, x):
    """Gemma's RMSNorm: ``(1 + weight)`` times the normalised input, the product cast back."""
    h = x.to(_compute_dtype(x.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    return (h * (1.0 + self.weight.to(h.dtype))).type_as(x)


def _sigmoid_router_logits(self, hidden_states):
    x = hidden_states.view(-1, self.config.hidden_size)
    dt = _compute_dtype(x.dtype)
    return F.linear(x.to(dt), self.weight.to(dt))


def _softcap_eager_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs
):
    """HF Gemma 2's ``eager_attention_forward`` (scores · scaling, soft-cap, additive mask,
    softmax, · v) with the softmax in the input dtype instead of float32."""
    from transformers.models.gemma2.modeling_gemma2 import repeat_kv

    scaling = module.head_dim**-0.5 if scaling is None else scaling
    k = repeat_kv(key, module.num_key_value_groups)
    v = repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, k.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1, dtype=_compute_dtype(query.dtype)).to(query.dtype)
    w = F.dropout(w, p=dropout, training=module.training)
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


# Eager attention functions with a float32 softmax (the oracle of families run eager).
_EAGER_SOFTCAP_MODULES = ("gemma2",)
# Cohere's LayerNorms (hidden and per-head q/k) and its interleaved RoPE compute in float32.
_COHERE_MODULES = ("cohere", "cohere2", "cohere2_moe")


# ERNIE 4.5's interleaved (GLM-style) RoPE computes in float32.
_ERNIE_MODULES = ("ernie4_5", "ernie4_5_moe")


def _ernie_rotary(m):
    """ERNIE 4.5's ``apply_rotary_pos_emb`` (the first half of the table, each frequency
    repeated twice; ``m.rotate_half``) in the input dtype instead of float32."""

    def apply(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1).to(q.dtype)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1).to(q.dtype)
        return q * cos + m.rotate_half(q) * sin, k * cos + m.rotate_half(k) * sin

    return apply


def _cohere_layer_norm(self, hidden_states):
    """Cohere's LayerNorm (mean-centred, weight only) in the compute dtype."""
    h = hidden_states.to(_compute_dtype(hidden_states.dtype))
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(var + self.variance_epsilon)
    return (self.weight.to(h.dtype) * h).to(hidden_states.dtype)


def _cohere_rotary(m):
    """Cohere's ``apply_rotary_pos_emb`` (interleaved halves: ``m.rotate_half``) in the input
    dtype instead of float32."""

    def apply(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        q_embed = q * cos.to(q.dtype) + m.rotate_half(q) * sin.to(q.dtype)
        k_embed = k * cos.to(k.dtype) + m.rotate_half(k) * sin.to(k.dtype)
        return q_embed, k_embed

    return apply


def _granite_gating(self, hidden_states):
    """Granite-MoE's ``TopKGating`` (top-k of the router logits, softmax over the chosen, tokens
    sorted by expert) with the logits in the compute dtype instead of float32."""
    logits = self.layer(hidden_states).to(_compute_dtype(hidden_states.dtype))
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    zeros = torch.zeros(
        [top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype, device=logits.device
    )
    expert_size = zeros.scatter(1, top_k_indices, 1).long().sum(0).tolist()
    _, index_sorted_experts = top_k_indices.flatten().sort(0)
    batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
    batch_gates = top_k_gates.flatten()[index_sorted_experts]
    return index_sorted_experts, batch_index, batch_gates, expert_size, logits


def _sigmoid_bias_router(self, hidden_states, e_score_correction_bias):
    """MiniMax-M2's router (sigmoid scores, top-k of scores + correction bias, weights
    renormalised over the chosen) with the sigmoid in the compute dtype instead of float32."""
    h = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(h.to(self.weight.dtype), self.weight)
    w = torch.sigmoid(logits.to(_compute_dtype(logits.dtype)))
    _, idx = torch.topk(w + e_score_correction_bias, self.top_k, dim=-1, sorted=False)
    top = w.gather(1, idx)
    return logits, top / top.sum(dim=-1, keepdim=True), idx


def _ernie_moe_router(self, hidden_states):
    """ERNIE 4.5 MoE's router (softmax scores, top-k of scores + ``moe_statics`` bias, the
    unbiased scores renormalised with a floor) with logits and softmax in the compute dtype
    instead of float32."""
    dt = _compute_dtype(hidden_states.dtype)
    logits = F.linear(hidden_states.to(dt), self.weight.to(dt))
    w = F.softmax(logits, dim=1)
    _, idx = torch.topk(self.moe_statics(w), self.top_k, dim=-1)
    w = torch.gather(w, -1, idx)
    w = w / torch.clamp(w.sum(-1, keepdim=True), min=self.norm_min)
    return logits, idx, w.to(hidden_states.dtype)


def _cohere_moe_router(self, hidden_states):
    """Cohere 2 MoE's router (top-k of the logits, softmax over the chosen, or their sigmoid,
    renormalised with ``norm_topk_prob``) with the softmax in the compute dtype."""
    logits = F.linear(hidden_states, self.weight)
    scores, idx = torch.topk(logits, self.top_k, dim=-1)
    if self.expert_selection_fn == "softmax":
        scores = F.softmax(scores, dim=1, dtype=_compute_dtype(scores.dtype))
    else:
        scores = torch.sigmoid(scores)
        if self.norm_topk_prob:
            scores = scores / scores.sum(-1, keepdim=True)
    return logits, scores.to(hidden_states.dtype), idx


def _longcat_router(self, hidden_states):
    """LongCat-Flash's router (softmax over routed and zero-computation experts, top-k of the
    scores + correction bias, unbiased scores times ``routed_scaling_factor``) with logits and
    softmax in the compute dtype instead of float32."""
    h = hidden_states.view(-1, self.config.hidden_size)
    dt = _compute_dtype(h.dtype)
    logits = F.linear(h.to(dt), self.classifier.weight.to(dt))
    scores = logits.softmax(dim=-1)
    idx = self.get_topk_indices(scores)
    return (scores.gather(1, idx) * self.routed_scaling_factor).to(logits.dtype), idx


def _hunyuan_route(self, router_logits):
    """Hunyuan-MoE's routing (softmax, top-k, renormalised) in the logits' compute dtype."""
    w = F.softmax(router_logits, dim=1, dtype=_compute_dtype(router_logits.dtype))
    w, idx = torch.topk(w, self.top_k, dim=-1)
    return idx, (w / w.sum(dim=-1, keepdim=True)).to(router_logits.dtype)


# Routers with their own lifted forward (by class name).
_OWN_ROUTERS = {
    "MiniMaxM2TopKRouter": _sigmoid_bias_router,
    "Ernie4_5_MoeTopKRouter": _ernie_moe_router,
    "Cohere2MoeTopKRouter": _cohere_moe_router,
    "LongcatFlashTopkRouter": _longcat_router,
}


def _jamba_route(self, hidden_states, router_logits):
    """Jamba's routing (softmax, top-k, no renormalisation) in the logits' dtype (HF: float32)."""
    weights = torch.softmax(router_logits, dim=-1)
    top_k_weights, top_k_index = torch.topk(weights, self.top_k, dim=-1)
    return top_k_index, top_k_weights.to(hidden_states.dtype)


# MoE blocks whose routing runs in their own method (class name → method, lifted version).
_OWN_ROUTING_METHODS = {
    "HunYuanMoEV1Moe": ("route_tokens_to_experts", _hunyuan_route),
    "JambaSparseMoeBlock": ("route_tokens_to_experts", _jamba_route),
}


def lift_full_attention_islands(monkeypatch) -> None:
    """Patch (through pytest's ``monkeypatch``) the RMSNorms and routers of every full-attention
    family to compute in the input dtype (same formulas; unchanged in float32 models)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from harts_verl.models.adapter import FULL_ATTENTION_MODEL_TYPES

    for model_type in FULL_ATTENTION_MODEL_TYPES:
        short = model_type_to_module_name(model_type)  # gemma3_text: gemma3
        m = importlib.import_module(f"transformers.models.{short}.modeling_{short}")
        rms = _gemma_rms if short.startswith("gemma") else _llama_rms
        for name, obj in vars(m).items():
            if not isinstance(obj, type) or obj.__module__ != m.__name__:
                continue
            if name in _OWN_ROUTING_METHODS:
                monkeypatch.setattr(obj, *_OWN_ROUTING_METHODS[name])
            elif name in _OWN_ROUTERS:
                monkeypatch.setattr(obj, "forward", _OWN_ROUTERS[name])
            elif name.endswith("RMSNorm"):
                monkeypatch.setattr(obj, "forward", rms)
            elif name.endswith("TopKRouter") and name not in _INPUT_DTYPE_ROUTERS:
                monkeypatch.setattr(obj, "forward", _router)
            elif name.endswith("TopkRouter"):
                monkeypatch.setattr(obj, "forward", _sigmoid_router_logits)
            elif name.endswith("TopKGating"):  # Granite-MoE
                monkeypatch.setattr(obj, "forward", _granite_gating)
        if short in _EAGER_SOFTCAP_MODULES:
            monkeypatch.setattr(m, "eager_attention_forward", _softcap_eager_attention)
        if short in _ERNIE_MODULES:
            monkeypatch.setattr(m, "apply_rotary_pos_emb", _ernie_rotary(m))
        if short in _COHERE_MODULES:
            for name, obj in vars(m).items():
                if isinstance(obj, type) and name.endswith("LayerNorm"):
                    monkeypatch.setattr(obj, "forward", _cohere_layer_norm)
            monkeypatch.setattr(m, "apply_rotary_pos_emb", _cohere_rotary(m))


def spread_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw every parameter of ``model`` from N(0, 0.2²) (norm weights 1 ± 0.2), a larger
    spread than HF's 0.02 init so attention weighs in the output; in place, returns ``model``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model


def spread_state_space_params(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw the state-space parameters of ``model`` in their own ranges (after
    :func:`spread_weights`): ``A_log`` in [-1, 1) so that decays ``exp(-dt · A)`` span well below
    1, ``dt_bias`` in [-1.5, 0.5) (softplus⁻¹ of about 0.1..1), ``D`` around 1; in place,
    returns ``model``."""
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) * 2.0 - 1.0)
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) * 2.0 - 1.5)
            elif name.endswith(".D"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def hf_log_probs(model: torch.nn.Module, seqs: list[list[int]]) -> list[torch.Tensor]:
    """HF's own per-trajectory forward of ``model`` (``model(input_ids=ids[None])``, no cache):
    ``log p(x[t+1] | x[≤t])`` of each trajectory, in the logits' dtype (the oracle the tree
    log-probs are compared with)."""
    lps = []
    for s in seqs:
        ids = torch.tensor([s])
        logits = model(input_ids=ids, use_cache=False).logits[0]
        lps.append(torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return lps


# The float32 islands of the recurrent hybrids: HF's Mamba-2 torch path casts x, B, C and A_log
# with ``.float()`` (the Mamba-1 scans too), its gated RMSNorms (full width for Granite 4.0-H /
# Bamba, per group for Nemotron-H) and RMSNorms (LFM2's, MiniMax's, Jamba's, Falcon-Mamba's
# weightless ones too) compute in
# float32, Granite's and MiniMax's router logits are ``.float()``, Jamba's routing softmax is
# float32, Nemotron-H's router matmul and its causal LM's logits are float32.
_RECURRENT_HYBRID_MODULES = (
    *("granitemoehybrid", "bamba", "nemotron_h", "falcon_h1", "lfm2", "lfm2_moe", "minimax"),
    *("jamba", "mamba", "falcon_mamba", "mamba2", "zamba2"),
)


def _weightless_rms(hidden_states, variance_epsilon=1e-6):
    """Falcon-Mamba's ``rms_forward`` (an RMSNorm without weight) in the compute dtype."""
    h = hidden_states.to(_compute_dtype(hidden_states.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + variance_epsilon)
    return h.to(hidden_states.dtype)


def lift_lightning_decay_tables(model: torch.nn.Module) -> torch.nn.Module:
    """Recompute the decay tables of ``model``'s MiniMax lightning-attention mixers
    (``query_decay``, ``key_decay``, ``diagonal_decay``: float32 exps of the slopes, made at
    init) in the dtype of their ``slope_rate`` buffer, from that buffer (HF's own
    ``decay_factors``); in place, returns ``model``."""
    for mod in model.modules():
        if type(mod).__name__ == "MiniMaxLightningAttention":
            tables = mod.decay_factors(mod.slope_rate)
            for name, t in zip(("query_decay", "key_decay", "diagonal_decay"), tables):
                setattr(mod, name, t)
    return model


def _gated_group_rms(self, hidden_states, gate=None):
    """HF's gated RMSNorm of the Mamba-2 mixers in the compute dtype: ``x · silu(gate)``
    normalised per group (``self.group_size`` wide, or ``self.n_groups`` groups: Nemotron-H,
    Falcon-H1; the whole width without either) times the weight; Falcon-H1's
    ``norm_before_gate`` applies the gate after the norm."""
    dt = hidden_states.dtype
    h = hidden_states.to(_compute_dtype(dt))
    gate_after = gate is not None and getattr(self, "norm_before_gate", False)
    if gate is not None and not gate_after:
        h = h * F.silu(gate.to(h.dtype))
    width = getattr(self, "group_size", None) or h.shape[-1] // getattr(self, "n_groups", 1)
    hg = h.view(*h.shape[:-1], -1, width)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    h = self.weight * hg.view(h.shape)
    if gate_after:
        h = h * F.silu(gate.to(h.dtype))
    return h.to(dt)


def _float_keeping_float64(self, *args, **kwargs):
    """``Tensor.float()`` that leaves float64 tensors as they are."""
    return self if self.dtype == torch.float64 else self.to(torch.float32, *args, **kwargs)


def _rg_scan_lifted(original):
    """RecurrentGemma's ``RecurrentGemmaRglru._rnn_scan`` accumulating in the compute dtype
    (HF: float32 whatever the input)."""

    def scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=None):
        acc = _compute_dtype(hidden_states.dtype)
        return original(self, hidden_states, recurrent_gate, reset, recurrent_states, acc)

    return scan


def lift_recurrent_hybrid_islands(monkeypatch) -> None:
    """Patch (through pytest's ``monkeypatch``) the float32 islands of the recurrent hybrids
    (:data:`_RECURRENT_HYBRID_MODULES`) to compute in the input dtype: ``Tensor.float()``
    keeps float64 (HF's Mamba-2 torch path, the router logits and Nemotron-H's logits cast
    with it, RecurrentGemma's RMSNorms; unchanged for other dtypes), the (gated) RMSNorms,
    routers and rotary tables in the compute dtype, RecurrentGemma's RG-LRU scan accumulating
    in it. Same formulas, HF's own SSD and scan code."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma
    from transformers.models.zamba2 import modeling_zamba2

    monkeypatch.setattr(torch.Tensor, "float", _float_keeping_float64)
    monkeypatch.setattr(modeling_zamba2.Zamba2RMSNormGated, "forward", _gated_group_rms)
    rglru = modeling_recurrent_gemma.RecurrentGemmaRglru
    monkeypatch.setattr(rglru, "_rnn_scan", _rg_scan_lifted(rglru._rnn_scan))
    rotary = modeling_recurrent_gemma.RecurrentGemmaRotaryEmbedding
    monkeypatch.setattr(rotary, "forward", _olmo_rotary)
    for short in _RECURRENT_HYBRID_MODULES:
        m = importlib.import_module(f"transformers.models.{short}.modeling_{short}")
        for name, obj in vars(m).items():
            if not isinstance(obj, type) or obj.__module__ != m.__name__:
                continue
            if name.endswith("RMSNormGated"):
                monkeypatch.setattr(obj, "forward", _gated_group_rms)
            elif name.endswith("RMSNorm"):
                monkeypatch.setattr(obj, "forward", _llama_rms)
            elif name.endswith("TopkRouter"):  # Nemotron-H
                monkeypatch.setattr(obj, "forward", _sigmoid_router_logits)
            elif name.endswith("TopKGating"):  # Granite 4.0-H
                monkeypatch.setattr(obj, "forward", _granite_gating)
            elif name in _OWN_ROUTING_METHODS:  # Jamba
                monkeypatch.setattr(obj, *_OWN_ROUTING_METHODS[name])
            elif name.endswith("RotaryEmbedding"):  # a float64 table (default RoPE)
                monkeypatch.setattr(obj, "forward", _olmo_rotary)
        if hasattr(m, "rms_forward"):  # Falcon-Mamba
            monkeypatch.setattr(m, "rms_forward", _weightless_rms)


def trajectory_loss(lps: list[torch.Tensor | None]) -> torch.Tensor:
    """A loss that weighs each trajectory's log-probs differently (linear and quadratic terms),
    so a gradient reaching the wrong trajectory's rows shows; ``None`` entries (trajectories of
    another micro-batch, in a separable loss's calls) are left out."""
    w = torch.linspace(-1.0, 1.0, len(lps), dtype=torch.float64)
    terms = [(lp * w[i]).sum() + 0.1 * (lp**2).sum() for i, lp in enumerate(lps) if lp is not None]
    return sum(terms) / 10.0


def assert_log_probs_equal_hf(
    model: torch.nn.Module, seqs: list[list[int]], capacity_tokens: int = 48
) -> None:
    """Tree log-probs and entropies of ``model`` (``TreeRunner`` with ``capacity_tokens``: rows
    shared inside each of several microbatches) equal HF's own per-trajectory forward to 1e-10."""
    from harts_verl.runtime import TreeRunner

    runner = TreeRunner(model, capacity_tokens=capacity_tokens)
    with torch.no_grad():
        lps, ents = runner.log_probs(seqs, with_entropy=True)
        for s, lp, ent in zip(seqs, lps, ents):
            ids = torch.tensor([s])
            logp = torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)[:-1]
            torch.testing.assert_close(
                lp, logp.gather(1, ids[0, 1:, None])[:, 0], rtol=0, atol=1e-10
            )
            torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1), rtol=0, atol=1e-10)
    assert runner.last_stats.compact_tokens < sum(len(s) for s in seqs)
    assert runner.last_stats.microbatches > 1


def assert_router_aux_loss_equals_hf_padded(model: torch.nn.Module, seqs: list[list[int]]) -> None:
    """``model`` (``output_router_logits`` on): its tree-mode load-balancing loss (rows weighted
    by multiplicity) equals HF's over the padded batch of all trajectories (padding masked)
    times ``router_aux_loss_coef``, to HF's float32 expert-mask averaging (1e-6 relative)."""
    from harts_verl.models.adapter import as_tree_model
    from harts_verl.ops.layout import TreeLayout
    from harts_verl.tree import RolloutForest

    layout = TreeLayout(RolloutForest.from_sequences(seqs))
    with torch.no_grad():
        _, aux = as_tree_model(model)(layout.token_ids, layout)
        n = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (n - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
        ref = model(ids, attention_mask=mask, use_cache=False).aux_loss
    assert aux.item() > 0
    torch.testing.assert_close(aux, ref * model.config.router_aux_loss_coef, rtol=1e-6, atol=0)


def assert_gradients_equal_hf(model: torch.nn.Module, seqs: list[list[int]]) -> set[str]:
    """The tree loss (:func:`trajectory_loss`) and every parameter gradient of ``model`` equal
    those of HF's per-trajectory forward/backward (loss ≤ 1e-10, each gradient ≤ 1e-9 relative
    to its scale); returns the names of the parameters with a gradient."""
    from harts_verl.runtime import TreeRunner

    def grads() -> dict[str, torch.Tensor]:
        return {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }

    model.zero_grad(set_to_none=True)
    out = TreeRunner(model).forward_backward(seqs, trajectory_loss)
    tree = grads()
    model.zero_grad(set_to_none=True)
    ref_loss = trajectory_loss(hf_log_probs(model, seqs))
    ref_loss.backward()
    ref = grads()
    assert abs(out["loss"] - ref_loss.item()) <= 1e-10 * max(1.0, abs(ref_loss.item()))
    assert tree.keys() == ref.keys() and ref
    for name, g in ref.items():
        scale = g.abs().max().item()
        err = (tree[name] - g).abs().max().item()
        assert err <= 1e-9 * max(scale, 1e-30), f"{name}: {err} vs scale {scale}"
    return set(ref)


def assert_float32_log_probs_close_to_hf(model: torch.nn.Module, seqs: list[list[int]]) -> None:
    """Tree log-probs of a float32 ``model`` vs HF's per-trajectory forward, within float32
    rounding (5e-5)."""
    from harts_verl.runtime import TreeRunner

    with torch.no_grad():
        lps = TreeRunner(model).log_probs(seqs)
        for lp, ref in zip(lps, hf_log_probs(model, seqs)):
            torch.testing.assert_close(lp.double(), ref.double(), rtol=0, atol=5e-5)
