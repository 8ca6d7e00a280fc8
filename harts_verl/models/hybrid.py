"""HybridForCausalLM: a native hybrid-attention (KDA / GDN / MLA / GQA) model with dense or
MoE FFNs that runs on compact rows in tree mode or on packed trajectories in expanded mode."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts_verl.models.config import HybridConfig
from harts_verl.models.layers import MoEFFN, RMSNorm, SwiGLU
from harts_verl.models.mixers import MIXER_CLASSES
from harts_verl.ops._dtypes import compute_dtype
from harts_verl.ops.layout import TreeLayout


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``, then ``x + ffn(norm(x))``."""

    def __init__(self, cfg: HybridConfig, index: int) -> None:
        super().__init__()
        self.mixer_type = cfg.layer_types[index]
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = MIXER_CLASSES[self.mixer_type](cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = index in cfg.moe_layers and cfg.num_experts > 0
        self.ffn = MoEFFN(cfg) if self.is_moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, layout: TreeLayout) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.mixer(self.input_norm(x), layout)
        h = self.post_norm(x)
        if self.is_moe:
            # multiplicities in the router's float32 (float64) math: bf16 holds integers only
            # to 256, so a row shared by more trajectories would be undercounted
            out, aux = self.ffn(h, layout.row_weights(compute_dtype(h.dtype)))
        else:
            out, aux = self.ffn(h), h.new_zeros(())
        return x + out, aux


class HybridForCausalLM(nn.Module):
    """Embeddings → hybrid decoder layers → final norm; ``lm_head`` gives logits.

    ``forward(input_ids [C], layout)`` returns the final hidden states ``[C, D]`` of the rows and
    the summed router auxiliary loss (weighted by row multiplicity, so it equals the
    trajectory-wise value). Log-probs are taken by the runtime with
    :func:`harts_verl.ops.logprobs.compact_log_probs` (O(C·V), never S×V).
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.gradient_checkpointing = False
        self._init_weights()

    @classmethod
    def from_config(cls, config: HybridConfig | dict[str, Any]) -> HybridForCausalLM:
        """The model of a :class:`HybridConfig` or its dict form (randomly initialized).
        Raises TypeError for anything else (a preset name: :func:`preset` first)."""
        if isinstance(config, dict):
            config = HybridConfig.from_dict(config)
        if not isinstance(config, HybridConfig):
            raise TypeError(
                f"config: expected a HybridConfig or a dict, got {type(config).__name__} "
                "(for a preset name use harts_verl.models.preset(name))"
            )
        return cls(config)

    def _init_weights(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)

    def forward(
        self, input_ids: torch.Tensor, layout: TreeLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(layout, TreeLayout):
            raise TypeError(
                f"layout: expected a TreeLayout (TreeLayout(forest, chunk_size=...)), got "
                f"{type(layout).__name__}"
            )
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 1:
            shape = tuple(input_ids.shape) if hasattr(input_ids, "shape") else type(input_ids)
            raise ValueError(f"input_ids: expected [C] row token ids, got {shape}")
        if input_ids.dtype.is_floating_point or input_ids.dtype in (torch.bool, torch.complex64):
            raise TypeError(f"input_ids: expected integer token ids, got {input_ids.dtype}")
        if input_ids.device.type == "cpu" and input_ids.numel():  # (no device sync elsewhere)
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(
                    f"input_ids: token id {lo if lo < 0 else hi} is outside the vocabulary "
                    f"(size {self.config.vocab_size})"
                )
        if input_ids.shape[0] != layout.num_rows:
            raise ValueError(f"input_ids: {input_ids.shape[0]} rows, layout has {layout.num_rows}")
        x = self.embed_tokens(input_ids)
        aux = x.new_zeros(())
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x, a = checkpoint(layer, x, layout, use_reentrant=False)
            else:
                x, a = layer(x, layout)
            aux = aux + a
        return self.norm(x), aux * self.config.router_aux_loss_coef
