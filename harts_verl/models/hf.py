"""The native hybrid model as a transformers model (``model_type = "harts_hybrid"``).

:class:`HartsHybridConfig` (a ``PreTrainedConfig`` holding every :class:`HybridConfig` field) and
:class:`HartsHybridForCausalLM` (a ``PreTrainedModel`` around :class:`HybridForCausalLM`,
parameters under ``model.``) are registered with ``AutoConfig`` / ``AutoModelForCausalLM`` when
this module is imported (and by the veRL plugin), so ``save_pretrained`` / ``from_pretrained`` and
veRL's FSDP engines, which load the actor through the Auto classes from ``model.path``, work; the
critic, which veRL loads with ``AutoModelForTokenClassification``, is
:class:`HartsHybridForTokenClassification` (the same backbone, a one-label ``score``).

``forward`` takes the calls veRL's engines make:

* trajectory-wise (stock ``fsdp2``): packed ``input_ids [1, T]`` with ``cu_seqlens`` (veRL
  passes it when ``forward`` declares it) or ``position_ids`` restarting at 0 per sequence
  (``use_remove_padding=True``), or padded ``input_ids [B, L]`` with ``attention_mask``; each
  sequence runs as its own chain (:meth:`RolloutForest.expanded`), so packing never mixes
  sequences; ``logits`` has the input's shape plus the vocabulary (zeros at padding);
* tree mode (``harts_fsdp2``): ``input_ids [1, C]`` = compact rows with ``harts_layout``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, TokenClassifierOutput

from harts_verl.models.config import HybridConfig
from harts_verl.models.hybrid import HybridForCausalLM
from harts_verl.ops.layout import TreeLayout
from harts_verl.tree import RolloutForest

__all__ = [
    "MODEL_TYPE",
    "HartsHybridConfig",
    "HartsHybridForCausalLM",
    "HartsHybridForTokenClassification",
    "attn_implementation_for",
    "load_causal_lm",
    "register_auto_classes",
]

MODEL_TYPE = "harts_hybrid"
_FIELDS = tuple(f.name for f in dataclasses.fields(HybridConfig))


class HartsHybridConfig(PreTrainedConfig):
    """transformers configuration of the native hybrid model: every :class:`HybridConfig` field
    (validated by it) plus the usual ``PreTrainedConfig`` keys.

    The mixer of each layer (``HybridConfig.layer_types``: kda, gdn, mla, gqa) is stored as
    ``mixer_types``; ``layer_types`` holds transformers' names (``linear_attention`` for kda/gdn,
    ``full_attention`` for mla/gqa), which transformers validates. A ``HybridConfig``-style
    ``layer_types`` of mixer names is accepted when ``mixer_types`` is absent."""

    model_type = MODEL_TYPE

    def __init__(self, **kwargs: Any) -> None:
        mixers = kwargs.pop("mixer_types", None)
        hf_types = None
        if mixers is not None:
            hf_types = kwargs.pop("layer_types", None)
            kwargs["layer_types"] = mixers
        try:
            hybrid = HybridConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in _FIELDS})
        except ValueError as e:
            msg = str(e)
            if mixers is not None and msg.startswith("layer_types"):
                msg = "mixer_types" + msg[len("layer_types") :]  # the name the caller used
            raise ValueError(msg) from None
        derived = _hf_layer_types(hybrid.layer_types)
        if hf_types is not None and list(hf_types) != derived:
            raise ValueError(
                f"layer_types: {list(hf_types)!r} does not match mixer_types "
                f"{hybrid.layer_types!r} (expected {derived!r})"
            )
        layers = kwargs.pop("num_hidden_layers", None)  # derived from the mixers
        if layers is not None and layers != hybrid.num_hidden_layers:
            raise ValueError(
                f"num_hidden_layers: {layers!r} does not match the {hybrid.num_hidden_layers} "
                "layers of mixer_types / layer_types"
            )
        super().__init__(**kwargs)
        for key, value in hybrid.to_dict().items():
            if key != "layer_types":
                setattr(self, key, value)
        self.mixer_types = list(hybrid.layer_types)
        self.layer_types = derived
        self.num_hidden_layers = hybrid.num_hidden_layers

    def to_hybrid_config(self) -> HybridConfig:
        d = {k: getattr(self, k) for k in _FIELDS if k != "layer_types"}
        return HybridConfig(layer_types=list(self.mixer_types), **d)

    @classmethod
    def from_hybrid_config(cls, config: HybridConfig, **kwargs: Any) -> HartsHybridConfig:
        """The transformers configuration of ``config``; keyword arguments override its fields
        (validated together with the rest) or set ``PreTrainedConfig`` keys."""
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config: expected a HybridConfig, got {type(config).__name__}")
        base = config.to_dict()
        if "mixer_types" in kwargs:  # replaces the mixers (``layer_types``) of ``config``
            base.pop("layer_types")
        return cls(**{**base, **kwargs})


class _HartsHybridPreTrainedModel(PreTrainedModel):
    """What the native model's transformers classes share: the backbone
    (:class:`HybridForCausalLM`, parameters under ``model.``), weight init, gradient
    checkpointing, source-checkpoint loading, and the final hidden states of both call kinds
    (see the module docstring)."""

    config_class = HartsHybridConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules: ClassVar[list[str]] = ["HybridDecoderLayer"]
    supports_gradient_checkpointing = True
    _supports_sdpa = True  # attention is the model's own (tree/varlen ops); any choice is accepted
    _supports_flash_attn = True
    supports_harts_layout = True  # the engine's tree call reaches ``forward`` directly
    supports_kv_cache = False  # no incremental decoding: samplers re-read the prefix

    def __init__(self, config: HartsHybridConfig) -> None:
        super().__init__(config)
        self.model = HybridForCausalLM(config.to_hybrid_config())

    @property
    def harts_native_model(self) -> HybridForCausalLM:
        return self.model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any):
        """transformers' ``from_pretrained``; a Kimi-Linear or Ling 3 model directory is also
        accepted and converted while loading
        (:func:`~harts_verl.models.checkpoints.load_from_source`): veRL then trains such a
        checkpoint in place, with ``hf_config_path`` naming a ``harts-verl convert
        --config-only`` directory."""
        from harts_verl.models import checkpoints

        path = pretrained_model_name_or_path
        if isinstance(path, str | os.PathLike) and checkpoints.source_format_of_dir(str(path)):
            return checkpoints.load_from_source(cls, str(path), **kwargs)
        return super().from_pretrained(path, *model_args, **kwargs)

    def _init_weights(self, module: torch.nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=std)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        self.model.embed_tokens = value

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(self.model.gradient_checkpointing)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        harts_layout: TreeLayout | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """The head's output (:meth:`_output`) of the final hidden states: the calls of the
        module docstring."""
        hidden, aux = self._hidden(
            input_ids, attention_mask, position_ids, cu_seqlens, harts_layout, labels
        )
        return self._output(hidden, aux)

    def _output(self, hidden: torch.Tensor, aux: torch.Tensor) -> Any:
        raise NotImplementedError

    def _hidden(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        harts_layout: TreeLayout | None,
        labels: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states in the input's shape plus ``D`` (``[1, C, D]`` of a tree
        call; zeros at padding) and the router auxiliary loss."""
        if input_ids is None:
            raise ValueError("input_ids: required (inputs_embeds is not supported)")
        if labels is not None:
            raise ValueError("labels: not supported; take log-probs from the returned logits")
        if harts_layout is not None:
            hidden, aux = self.model(input_ids.reshape(-1), harts_layout)
            return hidden[None], aux
        seqs, index = _trajectories(input_ids, attention_mask, position_ids, cu_seqlens)
        forest = RolloutForest.expanded(seqs)
        layout = TreeLayout(forest, chunk_size=self.config.chunk_size, device=input_ids.device)
        hidden, aux = self.model(layout.token_ids, layout)
        rows = np.concatenate([forest.rows_of(i) for i in range(len(seqs))])
        rows_t = torch.as_tensor(rows, dtype=torch.long, device=hidden.device)
        flat = hidden.index_select(0, rows_t)  # [tokens, D] in the input's (flattened) order
        out = flat.new_zeros(input_ids.numel(), flat.shape[-1])
        return out.index_copy(0, index, flat).reshape(*input_ids.shape, -1), aux


class HartsHybridForCausalLM(_HartsHybridPreTrainedModel):
    """transformers wrapper of :class:`HybridForCausalLM` (``self.model``); see the module
    docstring for the calls ``forward`` accepts."""

    # {target: source}, applied when ``config.tie_word_embeddings`` (the native model ties the
    # two already); save_pretrained stores the source only, from_pretrained re-ties.
    _tied_weights_keys: ClassVar[dict[str, str]] = {
        "model.lm_head.weight": "model.embed_tokens.weight"
    }

    def __init__(self, config: HartsHybridConfig) -> None:
        super().__init__(config)
        self.post_init()

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.model.lm_head

    def set_output_embeddings(self, value: torch.nn.Linear) -> None:
        self.model.lm_head = value

    def _output(self, hidden: torch.Tensor, aux: torch.Tensor) -> MoeCausalLMOutputWithPast:
        return MoeCausalLMOutputWithPast(logits=self.model.lm_head(hidden), aux_loss=aux)

    def __getattr__(self, name: str) -> Any:
        # peft's ``PeftModelForCausalLM``, which veRL wraps around the model for LoRA
        # (``lora_rank`` > 0), reads ``prepare_inputs_for_generation`` when it wraps the model
        # (without it veRL's LoRA build stopped at an ``AttributeError``). It is served per
        # instance: a class attribute of that name makes transformers' ``can_generate`` log a
        # WARNING on every build, save and load of a class not derived from GenerationMixin.
        if name == "prepare_inputs_for_generation":
            return self._prepare_inputs_for_generation
        return super().__getattr__(name)

    def _prepare_inputs_for_generation(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """A decoding step's inputs: the whole prefix (the model keeps no cache)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    # The wrapper's own forward, also under a second name: veRL's ``use_fused_kernels`` patch
    # replaces the class ``forward``, and the engine's tree calls install this one back.
    forward = harts_forward = _HartsHybridPreTrainedModel.forward


class HartsHybridForTokenClassification(_HartsHybridPreTrainedModel):
    """The native model as a token classifier (``AutoModelForTokenClassification``: what veRL
    loads as a critic, ``num_labels = 1``): the backbone of :class:`HartsHybridForCausalLM`
    without its LM head, then dropout and ``score`` (``nn.Linear(D, num_labels)``, with bias, as
    transformers' token classifiers have). Loaded from a causal-LM checkpoint (native or
    Kimi-Linear / Ling 3), the backbone takes its weights, the LM head's are not used and
    ``score`` starts from its init. ``forward`` takes the causal LM's calls; ``logits`` is
    ``[..., num_labels]`` (at padding: ``score`` of a zero hidden state, its bias)."""

    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [r"^model\.lm_head\."]

    def __init__(self, config: HartsHybridConfig) -> None:
        super().__init__(config)
        del self.model.lm_head  # (tied: the embedding stays the backbone's)
        dropout = getattr(config, "classifier_dropout", None)
        if dropout is None:
            dropout = getattr(config, "hidden_dropout", None)
        self.dropout = torch.nn.Dropout(0.1 if dropout is None else float(dropout))
        self.score = torch.nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def _output(self, hidden: torch.Tensor, aux: torch.Tensor) -> TokenClassifierOutput:
        return TokenClassifierOutput(logits=self.score(self.dropout(hidden)))


def _hf_layer_types(mixers: list[str]) -> list[str]:
    """transformers' layer type of each mixer (validated by ``PreTrainedConfig``)."""
    return ["linear_attention" if t in ("kda", "gdn") else "full_attention" for t in mixers]


def _trajectories(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[list[np.ndarray], torch.Tensor]:
    """The sequences of a trajectory-wise call and the flat input positions of their tokens:
    rows of ``input_ids [B, L]`` (their ``attention_mask`` tokens), or the packed sequences of
    one row (``cu_seqlens`` from 0 to L, else restarts of ``position_ids``). Every sequence
    starts at position 0 (no cache): ``position_ids`` must count 0, 1, … within each sequence.
    Raises ValueError naming the field otherwise (no token is dropped silently)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [B, L], got shape {tuple(input_ids.shape)}")
    ids = input_ids.detach().cpu().numpy().astype(np.int64, copy=False)
    b, length = ids.shape
    pos = None
    if position_ids is not None:
        pos = position_ids.detach().cpu().numpy().astype(np.int64)
        if pos.ndim == 3:  # multi-axis (e.g. M-RoPE) positions: the text axis
            pos = pos[0]
        if pos.shape != ids.shape:
            raise ValueError(f"position_ids: shape {pos.shape} != input_ids {ids.shape}")
    if attention_mask is not None:
        mask = attention_mask.detach().cpu().numpy().astype(bool)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask: shape {mask.shape} != input_ids {ids.shape}")
        seqs = [ids[r][mask[r]] for r in range(b)]
        flat = np.flatnonzero(mask.reshape(-1))
        if pos is not None:
            for r in range(b):
                _check_positions(pos[r][mask[r]], f"position_ids[{r}]")
    elif b == 1 and (cu_seqlens is not None or pos is not None):
        if cu_seqlens is not None:
            cu = cu_seqlens.detach().cpu().numpy().astype(np.int64).reshape(-1)
            if cu.shape[0] < 2 or cu[0] != 0 or cu[-1] != length or bool((np.diff(cu) < 0).any()):
                raise ValueError(
                    f"cu_seqlens: expected non-decreasing offsets from 0 to the {length} packed "
                    f"tokens, got {cu.tolist()}"
                )
        else:
            p = pos[0]
            cu = np.r_[np.flatnonzero(np.r_[True, p[1:] != p[:-1] + 1]), length]
        seqs = [ids[0, cu[i] : cu[i + 1]] for i in range(cu.shape[0] - 1) if cu[i + 1] > cu[i]]
        flat = np.arange(length)
        if pos is not None:
            for i in range(cu.shape[0] - 1):
                _check_positions(pos[0, cu[i] : cu[i + 1]], f"position_ids (sequence {i})")
    else:
        seqs = [ids[r] for r in range(b)]
        flat = np.arange(b * length)
        if pos is not None:
            for r in range(b):
                _check_positions(pos[r], f"position_ids[{r}]")
    if not seqs or any(s.shape[0] == 0 for s in seqs):
        raise ValueError("input_ids: every sequence needs at least one token")
    return seqs, torch.as_tensor(flat, dtype=torch.long, device=input_ids.device)


def _check_positions(pos: np.ndarray, name: str) -> None:
    """``pos`` must be 0, 1, …, n−1: each sequence is computed from its first token (there is no
    cache to continue); ValueError naming ``name`` otherwise."""
    if not np.array_equal(pos, np.arange(pos.shape[0])):
        raise ValueError(
            f"{name}: expected positions 0, 1, ..., {pos.shape[0] - 1} (every sequence starts at "
            f"its first token; no cache), got {pos[:8].tolist()}{' ...' if pos.shape[0] > 8 else ''}"
        )


def register_auto_classes() -> None:
    """Register ``harts_hybrid`` with ``AutoConfig``, ``AutoModelForCausalLM`` and
    ``AutoModelForTokenClassification`` (idempotent)."""
    AutoConfig.register(MODEL_TYPE, HartsHybridConfig, exist_ok=True)
    AutoModelForCausalLM.register(HartsHybridConfig, HartsHybridForCausalLM, exist_ok=True)
    AutoModelForTokenClassification.register(
        HartsHybridConfig, HartsHybridForTokenClassification, exist_ok=True
    )


def attn_implementation_for(config: Any) -> str:
    """``"sdpa"`` where the causal-LM class of ``config`` takes it and computes the same
    attention there, else ``"eager"``: gpt-oss (whose learned attention sinks HF runs in its
    eager attention only) and models that soft-cap attention logits (Gemma 2's
    ``attn_logit_softcapping``, which HF's sdpa path drops); ``"sdpa"`` for a config without a
    registered causal-LM class. Tree mode replaces either in its attention modules."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "eager"
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return "sdpa"
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"


def load_causal_lm(
    spec: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    eager_experts: bool = True,
) -> torch.nn.Module:
    """A causal LM from ``spec``: an HF model directory (its weights) or a ``config.json``
    (random weights after ``torch.manual_seed(seed)``), the native model included
    (``harts_hybrid``), Kimi-Linear (``kimi_linear``) and Ling 3 (``bailing_hybrid``),
    converted to the native model (:mod:`harts_verl.models.checkpoints`). sdpa attention (eager
    where the class has no sdpa: :func:`attn_implementation_for`); ``eager_experts``: MoE
    experts run transformers' eager implementation (float64-capable on any device). A model
    transformers maps only as image-text-to-text (Mistral 4) is loaded with that class, as
    veRL's engine does. Returned in ``dtype``, in eval mode. Raises ``ValueError`` naming
    ``spec`` when it is neither."""
    register_auto_classes()
    is_config = spec.endswith(".json")
    if is_config and not os.path.isfile(spec):
        raise ValueError(f"model: config file {spec!r} does not exist")
    if not is_config and not os.path.isdir(spec):
        raise ValueError(f"model: expected an HF model directory or a config.json, got {spec!r}")
    from harts_verl.models import checkpoints

    raw = checkpoints.source_config_of(spec)
    if raw is not None:  # Kimi-Linear / Ling 3: not in transformers 5.10
        if not is_config:
            return HartsHybridForCausalLM.from_pretrained(spec, dtype=dtype)
        torch.manual_seed(seed)
        cfg = checkpoints.harts_config_from_source(raw)
        return HartsHybridForCausalLM(cfg).to(dtype).eval()
    cfg = AutoConfig.from_pretrained(spec)  # a directory, or the named config file
    cfg._attn_implementation = attn_implementation_for(cfg)
    if eager_experts:
        for sub in (cfg, getattr(cfg, "text_config", None)):
            if sub is not None and hasattr(sub, "_experts_implementation"):
                sub._experts_implementation = "eager"
    auto = AutoModelForCausalLM
    if type(cfg) not in AutoModelForCausalLM._model_mapping.keys():
        from transformers import AutoModelForImageTextToText

        # a model transformers maps only as image-text-to-text (Mistral 4): that class, as
        # veRL's engine loads it (``get_hf_auto_model_class``)
        if type(cfg) in AutoModelForImageTextToText._model_mapping.keys():
            auto = AutoModelForImageTextToText
    torch.manual_seed(seed)  # a config's random weights (and anything else initialised)
    if is_config:
        model = auto.from_config(cfg)
    else:
        model, info = auto.from_pretrained(spec, config=cfg, output_loading_info=True)
        # transformers initialises a tensor the checkpoint lacks at random (a load report on
        # stderr, nothing more): that is not the user's model, so it is refused by name
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(
                f"model: {spec!r}: its checkpoint lacks {len(missing)} tensor(s) of the model "
                f"(transformers would initialise them at random): {', '.join(missing[:5])}{more}"
            )
    return model.to(dtype).eval()


register_auto_classes()
