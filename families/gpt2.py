"""GPT-2 (``model_type: gpt2``: gpt2, distilgpt2, gpt2-medium...): LLaMA's decoder (families/llama.py: its masks,
KV cache, attention paths and heads) with learned absolute positions (``wpe``, added to ``wte``, then token types
through ``wte`` and ``drop``), no RoPE, LayerNorm (``ln_1``, ``ln_2``, ``ln_f``) and HF's ``Conv1D`` projections
(weights stored (in, out), ``torch.addmm``): q, k and v split from one ``c_attn``, ``c_proj`` with its residual
dropout, the ``c_fc`` / ``c_proj`` MLP with ``activation_function``. The backbone sits under ``transformer.``
(``h.N``); hub checkpoints store it without the prefix and may carry the old ``attn.bias`` / ``attn.masked_bias``
mask buffers, which are skipped as transformers skips them. ``add_cross_attention`` is refused. ``double_heads``
(``GPT2DoubleHeadsModel``) is a task this family adds: the tied LM head plus ``multiple_choice_head`` (the shared
``SequenceSummary``, its ``summary_*`` fields read from the config) on inputs (batch, choices, seq).

Mirrors ``transformers.models.gpt2.modeling_gpt2`` (5.24); config names as ``GPT2Config`` (``n_embd``, ``n_layer``,
``n_head``, ``n_positions``, ``n_inner``; the ``attribute_map`` names are read and answered too)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.heads import TokenClassifier
from flodl_hf.heads.causal_lm import ModelForCausalLM
from flodl_hf.heads.multiple_choice import SequenceSummary
from flodl_hf.core.layers import Conv1D, Draw, activation, record_attention
from flodl_hf.core.modeling import Backbone, HeadPart, TaskModel, record_last_hidden_state
from flodl_hf.core.outputs import (BaseModelOutputWithPast, CausalLMOutput, ModelOutput,
                                   QuestionAnsweringModelOutput, SequenceClassifierOutputWithPast,
                                   TokenClassifierOutput)
from flodl_hf.core.registry import register
from flodl_hf.core.registry import Task, register_task, register_task_model

from .llama import (DecoderForQuestionAnswering, DecoderForSequenceClassification, DecoderForTokenClassification, FULL,
                    Llama, LlamaAttention, LlamaModel, token_dropout)

# GPT2Config.attribute_map: the generic names, read from a config.json and answered as properties
SUMMARY_TYPES = ("cls_index", "first", "last", "mean")  # GPT2SequenceSummary's, but "attn" (not implemented there)
ATTRIBUTE_MAP = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
                 "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}


@dataclass
class GPT2StyleConfig(BaseConfig):
    """The config GPT-2 and GPT-J share: OpenAI's names (``n_embd``, ``n_layer``, ``n_head``, ``n_positions``,
    ``n_inner``; the generic ``attribute_map`` names read and answered), dropouts, LayerNorm epsilon, every layer
    full (no windows, no RoPE keys); checked at load, naming the model type and the field."""

    enum_fields: ClassVar[dict[str, type]] = {"activation_function": Activation}
    returns_given_cache: ClassVar[bool] = False  # as its transformers *Model.forward

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: Activation = Activation.GELU_NEW
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    use_cache: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GPT2StyleConfig":
        # PreTrainedConfig.__setattr__ through attribute_map: hidden_size=... sets n_embd (the model's own name wins)
        fields = dict(data)
        for generic, own in ATTRIBUTE_MAP.items():
            if generic in fields and own not in fields:
                fields[own] = fields[generic]
        config = super().from_dict(fields)
        config.raw = copy.deepcopy(dict(data))  # written back as it came
        return config

    # the generic names (attribute_map) and what LLaMA's shared parts read
    hidden_size = property(lambda self: self.n_embd)
    max_position_embeddings = property(lambda self: self.n_positions)
    num_attention_heads = property(lambda self: self.n_head)
    num_hidden_layers = property(lambda self: self.n_layer)
    kv_heads = num_attention_heads
    attention_head_dim = property(lambda self: self.n_embd // self.n_head)
    attention_dropout = property(lambda self: self.attn_pdrop)

    def layer_kinds(self) -> list[str]:
        return [FULL] * self.n_layer

    def window(self, kind: str) -> int | None:
        return None

    def rope_key(self, kind: str) -> str | None:
        return None


@dataclass
class GPT2Config(GPT2StyleConfig):
    model_type: ClassVar[str] = "gpt2"

    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    add_cross_attention: bool = False
    # GPT2DoubleHeadsModel's multiple_choice_head (GPT2SequenceSummary); summary_last_dropout is not a GPT2Config
    # field, read where a config.json has it, as transformers' hasattr does
    summary_type: str = "cls_index"
    summary_use_proj: bool = True
    summary_activation: str | None = None
    summary_proj_to_labels: bool = True
    summary_first_dropout: float = 0.1
    summary_last_dropout: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.summary_type not in SUMMARY_TYPES:
            raise ConfigError(f"config (gpt2): field summary_type={self.summary_type!r} is not supported "
                              f"(known: {', '.join(SUMMARY_TYPES)})")
        if self.summary_activation is not None:
            Activation.parse(self.summary_activation, "summary_activation")
        if self.add_cross_attention:
            raise ConfigError("config field add_cross_attention=true (GPT-2 as a decoder with cross-attention) "
                              "is not supported")


def residual_draw(config: GPT2Config) -> dict[str, Draw]:
    """GPT2PreTrainedModel._init_weights: the attention's and the MLP's ``c_proj`` (the residual branches) drawn at
    ``initializer_range / sqrt(2 n_layer)``."""
    return {"weight": Draw(config.initializer_range / math.sqrt(2 * config.n_layer))}


class GPT2Attention(LlamaAttention):
    """``c_attn`` split into q, k and v; no RoPE; ``c_proj`` then ``resid_dropout``; the scaling of
    ``scale_attn_weights`` / ``scale_attn_by_inverse_layer_idx``; on the eager path GPT-2's own recipe (softmax
    in the scores' dtype, or with ``reorder_and_upcast_attn`` the float32 ``baddbmm`` of
    ``_upcast_and_reordered_attn``)."""

    def __init__(self, config: GPT2Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        # GPT2Attention.__init__: the unified scaling
        self.scaling = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(layer_idx + 1)

    def make_projections(self, config: GPT2Config, heads: int, kv: int) -> None:
        self.c_attn = Conv1D(3 * config.n_embd, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, config.n_embd)
        self.c_proj.fresh_init = residual_draw(config)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def project_heads(self, hidden_states: torch.Tensor,
                      shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.c_attn(hidden_states).split(self.config.n_embd, dim=2)
        return q.view(shape), k.view(shape), v.view(shape)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.path(self.config) != "eager":
            return super().attend(q, k, v, mask)
        if self.config.reorder_and_upcast_attn:  # GPT2Attention._upcast_and_reordered_attn
            batch, heads, q_len, dk = q.shape
            k_len = k.shape[-2]
            weights = torch.empty(batch * heads, q_len, k_len, dtype=torch.float32, device=q.device)
            weights = torch.baddbmm(weights, q.reshape(-1, q_len, dk).float(),
                                    k.transpose(-1, -2).reshape(-1, dk, k_len).float(), beta=0, alpha=self.scaling)
            weights = weights.reshape(batch, heads, q_len, k_len)
        else:  # modeling_gpt2.eager_attention_forward
            weights = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        if mask is not None:
            weights = weights + mask
        weights = self.attn_dropout(F.softmax(weights, dim=-1).type(v.dtype))
        record_attention(weights)
        return torch.matmul(weights, v).transpose(1, 2).contiguous()

    def project_out(self, attn_output: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.c_proj(attn_output))


class GPT2MLP(nn.Module):
    def __init__(self, intermediate_size: int, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, intermediate_size)
        self.c_proj.fresh_init = residual_draw(config)
        self.act = activation(config.activation_function)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))


class GPT2Block(nn.Module):
    """GPT2Block: ``h + attn(ln_1(h))``, then ``h + mlp(ln_2(h))``, its parts handed in as LLaMA's layers'."""

    def __init__(self, config: GPT2Config, attn: nn.Module, mlp: nn.Module, norm_class: type[nn.Module]) -> None:
        super().__init__()
        self.ln_1 = norm_class(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = attn
        self.ln_2 = norm_class(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = mlp

    def forward(self, hidden_states: torch.Tensor, rope: None, mask: torch.Tensor | None, cache: Any) -> torch.Tensor:
        hidden_states = self.attn(self.ln_1(hidden_states), rope, mask, cache) + hidden_states
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(LlamaModel):
    """``wte``, ``wpe``, ``drop``, the blocks ``h``, ``ln_f``; LLaMA's forward, masks and cache."""

    exits_early = False  # its transformers forward runs every layer, whatever num_hidden_layers says
    attention_class = GPT2Attention
    layer_class = GPT2Block
    norm_class = nn.LayerNorm
    input_names = (*LlamaModel.input_names, "token_type_ids")

    def __init__(self, config: GPT2Config, add_pooling_layer: bool = False) -> None:
        Backbone.__init__(self, config)  # GPT2Model.__init__'s modules, in its order (not LLaMA's)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(self.layer_class(config, self.attention_class(config, i), self.make_mlp(config),
                                                self.norm_class) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    # LLaMA's encode runs self.layers and closes with self.norm
    layers = property(lambda self: self.h)
    norm = property(lambda self: self.ln_f)

    @classmethod
    def make_mlp(cls, config: GPT2Config) -> nn.Module:
        return GPT2MLP(config.n_inner if config.n_inner is not None else 4 * config.n_embd, config)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def position_table_size(self) -> int | None:
        return self.wpe.num_embeddings

    def rotary_embeddings(self, keys: list[str | None], position_ids: torch.Tensor,
                          hidden: torch.Tensor) -> dict[str | None, None]:
        return {None: None}

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # GPT2Model.forward: (wte + wpe) + wte(token types), then drop
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        hidden = inputs_embeds + self.wpe(position_ids).to(inputs_embeds.device)
        if token_type_ids is not None:
            hidden = hidden + self.wte(token_type_ids.view(-1, inputs_embeds.shape[1]))
        return self.drop(hidden)

    def forward(self, input_ids: torch.Tensor | None = None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                use_cache: bool | None = None, *,
                past_key_values: Any = None) -> "BaseModelOutputWithPastAndCrossAttentions":
        """GPT2Model.forward's positional order; LLaMA's forward."""
        no_cross_attention(encoder_hidden_states, encoder_attention_mask)
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                              token_type_ids=token_type_ids, past_key_values=past_key_values)
        return BaseModelOutputWithPastAndCrossAttentions(**vars(out))


# ---- the records and task models: transformers' GPT-2 classes' positional orders, LLaMA's heads ---------------

@dataclass
class BaseModelOutputWithPastAndCrossAttentions(BaseModelOutputWithPast):
    """GPT2Model's record: ``cross_attentions`` is ``()`` with ``output_attentions=True`` (no cross-attention layer),
    as the BERT lineage's."""

    cross_attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class CausalLMOutputWithCrossAttentions(CausalLMOutput):
    cross_attentions: tuple[torch.Tensor, ...] | None = None


def no_cross_attention(encoder_hidden_states: Any, encoder_attention_mask: Any) -> None:
    if encoder_hidden_states is not None or encoder_attention_mask is not None:
        raise InputError("encoder_hidden_states / encoder_attention_mask: GPT-2 with cross-attention "
                         "(add_cross_attention) is not supported")


class GPT2LMHeadModel(ModelForCausalLM):
    def forward(self, input_ids: torch.Tensor | None = None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, *, past_key_values: Any = None, cache_position: Any = None,
                shift_labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> CausalLMOutputWithCrossAttentions:
        no_cross_attention(encoder_hidden_states, encoder_attention_mask)
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                              logits_to_keep=logits_to_keep, token_type_ids=token_type_ids,
                              past_key_values=past_key_values, cache_position=cache_position,
                              shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
        return CausalLMOutputWithCrossAttentions(**vars(out))


class GPT2ForSequenceClassification(DecoderForSequenceClassification):
    def forward(self, input_ids: torch.Tensor | None = None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None, *, past_key_values: Any = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> SequenceClassifierOutputWithPast:
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                               token_type_ids=token_type_ids, past_key_values=past_key_values,
                               num_items_in_batch=num_items_in_batch)


class GPT2ForTokenClassification(DecoderForTokenClassification):
    def forward(self, input_ids: torch.Tensor | None = None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None, *, past_key_values: Any = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> TokenClassifierOutput:
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                               token_type_ids=token_type_ids, past_key_values=past_key_values,
                               num_items_in_batch=num_items_in_batch)


class GPT2ForQuestionAnswering(DecoderForQuestionAnswering):
    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, start_positions: torch.Tensor | None = None,
                end_positions: torch.Tensor | None = None, *, cache: Any = None, use_cache: bool | None = None,
                past_key_values: Any = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> QuestionAnsweringModelOutput:
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, start_positions=start_positions,
                               end_positions=end_positions, use_cache=use_cache, token_type_ids=token_type_ids,
                               past_key_values=past_key_values, num_items_in_batch=num_items_in_batch)


# ---- the double-heads task: GPT2DoubleHeadsModel ----------------------------------------------------------------

@dataclass
class DoubleHeadsModelOutput(ModelOutput):
    """``GPT2DoubleHeadsModelOutput``: the LM loss (``labels``), the choice loss (``mc_labels``), the LM logits
    (batch, choices, seq, vocab), one score per choice (batch, choices), the cache."""

    loss: torch.Tensor | None = None
    mc_loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    mc_logits: torch.Tensor | None = None
    cache: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class DoubleHeads(HeadPart):
    """Mounts ``lm_head`` (bias-free, tied to ``wte``) and ``multiple_choice_head`` (GPT2SequenceSummary, built
    after ``config.num_labels = 1``, as GPT2DoubleHeadsModel.__init__ sets it) at the root."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.multiple_choice_head = SequenceSummary(config, num_labels=1)

    def output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, hidden_states: torch.Tensor,
                mc_token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # GPT2DoubleHeadsModel.forward: lm_head, then the summary at mc_token_ids, squeezed
        return self.lm_head(hidden_states), self.multiple_choice_head(hidden_states, mc_token_ids).squeeze(-1)


def shifted_lm_loss(model: TaskModel, logits: torch.Tensor, labels: torch.Tensor,
                    num_items_in_batch: Any = None) -> torch.Tensor:
    """GPT2DoubleHeadsModel.forward's LM loss: CrossEntropyLoss (mean, -100 ignored) of ``logits[..., :-1, :]``
    against ``labels[..., 1:]`` (not ForCausalLMLoss: no padding, no float cast, no ``num_items_in_batch``)."""
    labels = labels.to(logits.device)
    shift_logits = logits[..., :-1, :].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), labels[..., 1:].contiguous().view(-1))


def _rows(t: torch.Tensor | None, keep: int) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1, *t.shape[t.dim() - keep:])


@register_task_model
class GPT2DoubleHeadsModel(TaskModel):
    """The LM and a multiple-choice score from one pass: the choices are flattened into the batch (as GPT2Model
    views its inputs), the last hidden state viewed back to (batch, choices, seq, hidden)."""

    task = "double_heads"

    def get_output_embeddings(self) -> nn.Module:
        return self.head.output_embeddings()

    def forward(self, input_ids: torch.Tensor | None = None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                mc_token_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                mc_labels: torch.Tensor | None = None, use_cache: bool | None = None, *,
                past_key_values: Any = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> DoubleHeadsModelOutput:
        """``num_items_in_batch`` is taken and ignored, as transformers' CrossEntropyLoss here ignores it."""
        shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        out = self.run_backbone(input_ids=_rows(input_ids, 1), attention_mask=_rows(attention_mask, 1),
                                token_type_ids=_rows(token_type_ids, 1), position_ids=_rows(position_ids, 1),
                                inputs_embeds=_rows(inputs_embeds, 2), cache=cache, past_key_values=past_key_values,
                                use_cache=use_cache)
        hidden = out.last_hidden_state
        hidden = hidden.view(-1, *shape[1:], hidden.shape[-1])  # GPT2Model.forward's output_shape
        record_last_hidden_state(hidden)  # output_hidden_states: transformers' last one is this view
        logits, mc_logits = self.head(hidden, mc_token_ids)
        mc_loss = loss = None
        if mc_labels is not None:  # CrossEntropyLoss over the choices
            mc_loss = F.cross_entropy(mc_logits.view(-1, mc_logits.size(-1)), mc_labels.view(-1))
        if labels is not None:
            loss = self.compute_loss(logits, labels=labels, num_items_in_batch=num_items_in_batch)
        return DoubleHeadsModelOutput(loss=loss, mc_loss=mc_loss, logits=logits, mc_logits=mc_logits,
                                      cache=out.cache)


# transformers has no Auto class for it: its own class is the reference (parity, export, verify)
DOUBLE_HEADS = register_task(Task(
    "double_heads", "DoubleHeadsModel", "GPT2DoubleHeadsModel", "", DoubleHeadsModelOutput, "double_heads_head",
    "flodl_hf.families.gpt2:GPT2DoubleHeadsModel", shifted_lm_loss, core=False,
    classes=(("gpt2", "GPT2DoubleHeadsModel"),)))


@register
class GPT2(Llama):
    model_type = "gpt2"
    arch = "GPT2"
    prefix = "transformer"
    config_class = GPT2Config
    backbone_class = GPT2Model
    # the old causal-mask buffers some checkpoints carry (transformers' _keys_to_ignore_on_load_unexpected)
    ignored_keys = (r"(^|\.)(attn|crossattention)\.(bias|masked_bias)$",)
    tasks = (*Llama.tasks, DOUBLE_HEADS.name)
    task_models = {"causal_lm": GPT2LMHeadModel, "seqcls": GPT2ForSequenceClassification,
                   "tokcls": GPT2ForTokenClassification, "qa": GPT2ForQuestionAnswering}
    # only GPT2LMHeadModel's loss is self.loss_function(..., **kwargs); its QA head computes its own
    num_items_tasks = frozenset({"causal_lm"})
    # transformers' class names where GPT-2's differ from arch + the task's suffix
    ARCHITECTURES: ClassVar[dict[str, str]] = {"causal_lm": "GPT2LMHeadModel"}

    @classmethod
    def architecture(cls, task: str) -> str:
        return cls.ARCHITECTURES.get(task) or super().architecture(task)

    @classmethod
    def max_sequence_length(cls, config: GPT2Config) -> int | None:
        return config.n_positions  # the wpe table

    @classmethod
    def double_heads_head(cls, config: GPT2Config) -> HeadPart:
        return DoubleHeads(config)

    @classmethod
    def token_head(cls, config: GPT2Config) -> HeadPart:
        # GPT2ForTokenClassification: classifier(dropout(h)), with a bias
        return TokenClassifier(config.n_embd, config.num_labels, token_dropout(config))
