"""ModernBERT (``model_type: modernbert``): pre-norm layers, fused QKV, GLU MLP, RoPE, sliding windows.

Mirrors ``transformers.models.modernbert.modeling_modernbert``:
- embeddings are ``tok_embeddings``, LayerNorm, dropout (no positions, no token types);
- each layer is pre-norm: ``h + attn(attn_norm(h))`` then ``h + mlp(mlp_norm(h))``, with layer 0's
  ``attn_norm`` the identity; ``final_norm`` closes the stack; LayerNorms have a bias only with
  ``norm_bias``, linears only with ``attention_bias`` / ``mlp_bias``;
- ``Wqkv`` is one fused projection; the MLP is a GLU: ``Wi`` splits into input and gate;
- RoPE on q and k, with ``rope_theta`` per layer kind (full or sliding attention);
- sliding layers attend to tokens within ``local_attention // 2`` positions either side, a per-layer
  MaskSpec; full layers to every real token.
The config is read in both spellings transformers reads: ``layer_types`` / ``rope_parameters``, and
the older ``global_attn_every_n_layers`` / ``global_rope_theta`` / ``local_rope_theta``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.layers import (PADDING, Draw, MaskSpec, LazyBuffers, activation, apply_rotary, attend,
                                  rope_cos_sin, rope_inverse_frequencies)
from flodl_hf.heads import (ModelForMaskedLM, ModelForMultipleChoice, ModelForQuestionAnswering,
                            ModelForSequenceClassification, ModelForTokenClassification)
from flodl_hf.core.modeling import Backbone, HeadPart, positional_order
from flodl_hf.core.outputs import MaskedLMOutput
from flodl_hf.core.registry import Family, register

FULL, SLIDING = "full_attention", "sliding_attention"
DEFAULT_THETA = {FULL: 160_000.0, SLIDING: 10_000.0}  # ModernBertConfig.default_theta
POOLINGS = ("cls", "mean")


@dataclass
class ModernBertConfig(BaseConfig):
    model_type: ClassVar[str] = "modernbert"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_activation": Activation, "classifier_activation": Activation}

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: Activation = Activation.GELU
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    norm_bias: bool = False
    pad_token_id: int | None = 50283
    attention_bias: bool = False
    attention_dropout: float = 0.0
    layer_types: list[str] | None = None
    rope_parameters: dict[str, Any] | None = None
    local_attention: int = 128
    embedding_dropout: float = 0.0
    mlp_bias: bool = False
    mlp_dropout: float = 0.0
    decoder_bias: bool = True
    classifier_pooling: str = "cls"
    classifier_dropout: float | None = 0.0
    classifier_bias: bool = False
    classifier_activation: Activation = Activation.GELU
    sparse_prediction: bool = False
    sparse_pred_ignore_index: int = -100
    initializer_cutoff_factor: float | None = 2.0
    # the older spelling (still on the hub): read when layer_types / rope_parameters lack them
    global_attn_every_n_layers: int | None = None
    global_rope_theta: float | None = None
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config: hidden_size={self.hidden_size} is not a multiple of "
                              f"num_attention_heads={self.num_attention_heads}")
        if self.classifier_pooling not in POOLINGS:
            raise ConfigError(f"config: classifier_pooling={self.classifier_pooling!r}: expected cls or mean")
        cutoff = self.initializer_cutoff_factor
        if cutoff is not None and (isinstance(cutoff, bool) or not isinstance(cutoff, (int, float))
                                   or not 0 < cutoff < math.inf):
            raise ConfigError(f"config: initializer_cutoff_factor={cutoff!r} must be a positive number or null")
        kinds = self.layer_kinds()
        if len(kinds) != self.num_hidden_layers or set(kinds) - {FULL, SLIDING}:
            raise ConfigError(f"config: layer_types={self.layer_types!r} must list {self.num_hidden_layers} "
                              f"entries of {FULL!r} or {SLIDING!r}")
        for kind in set(kinds):
            rope_type = ((self.rope_parameters or {}).get(kind) or {}).get("rope_type", "default")
            if rope_type != "default":
                raise ConfigError(f"config: rope_parameters[{kind!r}].rope_type={rope_type!r} is not supported "
                                  "(only 'default')")

    def fresh_draw(self, kind: str) -> dict[str, Draw]:
        """ModernBertPreTrainedModel._init_weights: a fresh weight drawn truncated at ``initializer_cutoff_factor``
        (3 when null) standard deviations, with the spread of its kind: "in" (``Wqkv``, ``Wi``, the embeddings)
        ``initializer_range``, "out" (``Wo``, the prediction head's ``dense``, the decoder) ``initializer_range /
        sqrt(2 num_hidden_layers)``, "final_out" (the classifiers) ``hidden_size ** -0.5``."""
        std = {"in": self.initializer_range, "out": self.initializer_range / math.sqrt(2.0 * self.num_hidden_layers),
               "final_out": self.hidden_size ** -0.5}[kind]
        cutoff = 3.0 if self.initializer_cutoff_factor is None else float(self.initializer_cutoff_factor)
        return {"weight": Draw(std, cutoff)}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def sliding_window(self) -> int:
        """Tokens either side a sliding layer sees: half of ``local_attention`` (ModernBertConfig.sliding_window)."""
        return self.local_attention // 2

    def layer_kinds(self) -> list[str]:
        """Each layer's attention kind (ModernBertConfig.__post_init__: full every n-th layer, n = 3 by default)."""
        if self.layer_types is not None:
            return list(self.layer_types)
        every = self.global_attn_every_n_layers or 3
        return [SLIDING if i % every else FULL for i in range(self.num_hidden_layers)]

    def rope_theta(self, kind: str) -> float:
        """``rope_parameters[kind].rope_theta``, else the older global/local field, else the default."""
        given = ((self.rope_parameters or {}).get(kind) or {}).get("rope_theta")
        if given is not None:
            return float(given)
        old = self.global_rope_theta if kind == FULL else self.local_rope_theta
        return float(old) if old is not None else DEFAULT_THETA[kind]


def _norm(config: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.tok_embeddings.fresh_init = config.fresh_draw("in")
        self.norm = _norm(config)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.tok_embeddings(input_ids)
        return self.drop(self.norm(inputs_embeds))


class ModernBertAttention(nn.Module):
    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.Wqkv.fresh_init, self.Wo.fresh_init = config.fresh_draw("in"), config.fresh_draw("out")
        self.out_drop = nn.Dropout(config.attention_dropout)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # ModernBertAttention.forward: view(B, S, 3, heads, d).unbind(-3), transpose, RoPE, attend, Wo
        qkv = self.Wqkv(hidden_states).view(*hidden_states.shape[:-1], 3, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=-3))
        q, k = apply_rotary(q, k, *rope)
        p = self.config.attention_dropout if self.training else 0.0
        out = attend(q, k, v, mask, self.config.attn_implementation, p, self.head_dim ** -0.5)
        return self.out_drop(self.Wo(out))


class ModernBertMLP(nn.Module):
    """GLU: ``Wo(drop(act(input) * gate))`` with ``input, gate = Wi(h).chunk(2)``."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.act = activation(config.hidden_activation)
        self.drop = nn.Dropout(config.mlp_dropout)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.Wi.fresh_init, self.Wo.fresh_init = config.fresh_draw("in"), config.fresh_draw("out")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # ModernBertMLP.forward
        inputs, gate = self.Wi(hidden_states).chunk(2, dim=-1)
        return self.Wo(self.drop(self.act(inputs) * gate))


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config: ModernBertConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if index == 0 else _norm(config)  # layer 0: the embeddings' norm suffices
        self.attn = ModernBertAttention(config)
        self.mlp_norm = _norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # ModernBertEncoderLayer.forward: pre-norm, residual after each sub-layer
        hidden_states = hidden_states + self.attn(self.attn_norm(hidden_states), mask, rope)
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))


# transformers' positional order: position_ids third (ModernBERT has no token types; one given by keyword is an
# InputError). Its question answering takes no inputs_embeds: ours takes them by keyword only.
ORDER = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")


@positional_order(*ORDER)
class ModernBertModel(Backbone):
    """``last_hidden_state`` after ``final_norm``; no pooler."""

    input_names = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")

    def __init__(self, config: ModernBertConfig, add_pooling_layer: bool = False) -> None:
        super().__init__(config)
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = _norm(config)
        self.inverse_frequencies = LazyBuffers(self._make_inverse_frequencies, config.layer_kinds())

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.tok_embeddings

    def mask_specs(self) -> list[MaskSpec]:
        window = MaskSpec("sliding", self.config.sliding_window)
        return [window if kind == SLIDING else PADDING for kind in self.config.layer_kinds()]

    def _make_inverse_frequencies(self, kind: str, device: torch.device | None) -> torch.Tensor:
        return rope_inverse_frequencies(self.config.rope_theta(kind), self.config.head_dim, device)

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.embeddings(input_ids, inputs_embeds)

    def encode(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        positions = position_ids
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        kinds = self.config.layer_kinds()
        # ModernBertRotaryEmbedding.forward: one (cos, sin) per layer kind, shared by its layers
        rope = {kind: rope_cos_sin(self.inverse_frequencies(kind, hidden.device), positions, hidden.dtype)
                for kind in set(kinds)}
        masks = self.layer_masks(attention_mask, hidden)
        for layer, kind, mask in zip(self.layers, kinds, masks, strict=True):
            hidden = layer(hidden, mask, rope[kind])
        return self.final_norm(hidden)


# ---- heads ------------------------------------------------------------------------------------------

class ModernBertPredictionHead(nn.Module):
    """``norm(act(dense(h)))`` with ``classifier_bias`` / ``classifier_activation``."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.dense.fresh_init = config.fresh_draw("out")
        self.act = activation(config.classifier_activation)
        self.norm = _norm(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(hidden_states)))  # ModernBertPredictionHead.forward


def _pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, pooling: str, choice: bool) -> torch.Tensor:
    if pooling == "mean":
        if attention_mask is None:
            attention_mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        # ModernBertForSequenceClassification.forward: (h * m).sum(1) / m.sum(1, keepdim=True)
        return (hidden * attention_mask.unsqueeze(-1)).sum(dim=1) / attention_mask.sum(dim=1, keepdim=True)
    if choice and attention_mask is not None:
        # ModernBertForMultipleChoice.forward: the first attended token of each row
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), attention_mask.argmax(dim=-1)]
    return hidden[:, 0]


class ModernBertClassifier(HeadPart):
    """Mounts ``head`` and ``classifier`` at the root: (pool), head, dropout, classifier.
    ``pooling`` None: per token (token classification, question answering)."""

    def __init__(self, config: ModernBertConfig, outputs: int, pooling: str | None, choice: bool = False) -> None:
        super().__init__()
        self.pooling, self.choice = pooling, choice
        self.head = ModernBertPredictionHead(config)
        self.drop = nn.Dropout(config.classifier_dropout or 0.0)
        self.classifier = nn.Linear(config.hidden_size, outputs)
        self.classifier.fresh_init = config.fresh_draw("final_out")

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.pooling is not None:
            hidden_states = _pool(hidden_states, attention_mask, self.pooling, self.choice)
        return self.classifier(self.drop(self.head(hidden_states)))


class ModernBertMLMHead(HeadPart):
    """Mounts ``head`` and ``decoder`` (tied to the embeddings; bias with ``decoder_bias``) at the root."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.head = ModernBertPredictionHead(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=config.decoder_bias)
        self.decoder.fresh_init = config.fresh_draw("out")  # tied: the embeddings' draw stands (layers.init_weights)

    def output_embeddings(self) -> nn.Module:
        return self.decoder

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder(self.head(hidden_states))


@positional_order(*ORDER, "labels")
class ModernBertForMaskedLM(ModelForMaskedLM):
    """The shared masked LM, plus ``sparse_prediction``: given labels, the head runs on the labelled tokens
    only and the logits are theirs, (N, vocab), as ModernBertForMaskedLM.forward does."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                num_items_in_batch: torch.Tensor | int | None = None) -> MaskedLMOutput:
        if not (self.config.sparse_prediction and labels is not None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                   position_ids=position_ids, inputs_embeds=inputs_embeds, labels=labels,
                                   num_items_in_batch=num_items_in_batch)
        out = self.run_backbone(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                position_ids=position_ids, inputs_embeds=inputs_embeds)
        labels = labels.view(-1)
        hidden = out.last_hidden_state.view(labels.shape[0], -1)
        keep = labels != self.config.sparse_pred_ignore_index
        logits = self.head(hidden[keep], None, None)
        loss = self.compute_loss(logits, labels=labels[keep], num_items_in_batch=num_items_in_batch)
        return MaskedLMOutput(loss=loss, logits=logits)


@positional_order(*ORDER, "labels")
class ModernBertForSequenceClassification(ModelForSequenceClassification):
    """The shared task model in transformers' positional order for ModernBERT's."""


@positional_order(*ORDER, "labels")
class ModernBertForTokenClassification(ModelForTokenClassification):
    """The shared task model in transformers' positional order for ModernBERT's."""


@positional_order("input_ids", "attention_mask", "position_ids", "start_positions", "end_positions")
class ModernBertForQuestionAnswering(ModelForQuestionAnswering):
    """The shared task model in transformers' positional order for ModernBERT's (which takes no inputs_embeds)."""


@positional_order(*ORDER, "labels")
class ModernBertForMultipleChoice(ModelForMultipleChoice):
    """The shared task model in transformers' positional order for ModernBERT's."""


@register
class ModernBert(Family):
    model_type = "modernbert"
    arch = "ModernBert"
    prefix = "model"
    config_class = ModernBertConfig
    backbone_class = ModernBertModel
    task_models = {"seqcls": ModernBertForSequenceClassification, "tokcls": ModernBertForTokenClassification,
                   "qa": ModernBertForQuestionAnswering, "mlm": ModernBertForMaskedLM,
                   "mc": ModernBertForMultipleChoice}
    float_position_ids = True  # RoPE: position_ids[..., None].float()
    # ModernBertForMaskedLM and ModernBertForQuestionAnswering hand num_items_in_batch to self.loss_function
    num_items_tasks = frozenset({"mlm", "qa"})

    @classmethod
    def max_sequence_length(cls, config: ModernBertConfig) -> int | None:
        # RoPE, no position table: transformers runs inputs past max_position_embeddings (the tokenizer's
        # model_max_length still caps the tasks' inputs, flodl_hf.tasks.runtime.max_input_length)
        return None

    @classmethod
    def sequence_head(cls, config: ModernBertConfig) -> HeadPart:
        return ModernBertClassifier(config, config.num_labels, config.classifier_pooling)

    @classmethod
    def multiple_choice_head(cls, config: ModernBertConfig) -> HeadPart:
        return ModernBertClassifier(config, 1, config.classifier_pooling, choice=True)

    @classmethod
    def token_head(cls, config: ModernBertConfig) -> HeadPart:
        return ModernBertClassifier(config, config.num_labels, None)

    @classmethod
    def span_head(cls, config: ModernBertConfig) -> HeadPart:
        return ModernBertClassifier(config, config.num_labels, None)

    @classmethod
    def lm_head(cls, config: ModernBertConfig) -> HeadPart:
        return ModernBertMLMHead(config)
