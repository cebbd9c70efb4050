"""GPT-J (``model_type: gptj``: EleutherAI/gpt-j-6b): LLaMA's decoder (families/llama.py: its masks, KV cache,
attention paths and heads) with GPT-J's parts: ``wte`` (token types, when given, through ``wte`` too) and ``drop``;
bias-free ``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj`` with ``resid_dropout``; RoPE on the first
``rotary_dim`` dimensions of each head in GPT-J's interleaved form (``rotate_every_two``, sin and cos read from the
float32 ``create_sinusoidal_positions`` table, theta 10000, and doubled with ``repeat_interleave``), turned on the
(B, S, heads, d) views before the transpose, as transformers; on the eager path q and k upcast to float32 for the
scores; the parallel residual ``attn(ln_1(x)) + mlp(ln_1(x)) + x`` (one LayerNorm); the biased ``fc_in`` /
``fc_out`` MLP with ``activation_function`` and its dropout; ``ln_f``. The backbone sits under ``transformer.``
(``h.N``); the LM head ``lm_head`` has a bias and is untied by default. Old checkpoints' ``attn.bias`` /
``attn.masked_bias`` buffers are skipped, as transformers skips them.

Mirrors ``transformers.models.gptj.modeling_gptj`` (5.24): GPTJModel, GPTJForCausalLM, GPTJForSequenceClassification
and GPTJForQuestionAnswering (transformers has no token classifier for GPT-J). Config names as ``GPTJConfig``
(``n_embd``, ``n_layer``, ``n_head``, ``n_positions``, ``n_inner``, ``rotary_dim``; the ``attribute_map`` names too).
A ``rotary_dim`` transformers refuses (not an int: GPTJConfig is strict) or could not run (odd, under 2, wider than
a head) is refused at load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.errors import ConfigError
from flodl_hf.heads.causal_lm import LMHead, ModelForCausalLM
from flodl_hf.core.layers import LazyBuffers, activation, record_attention
from flodl_hf.core.modeling import Backbone, HeadPart
from flodl_hf.core.outputs import BaseModelOutputWithPast, CausalLMOutput
from flodl_hf.core.registry import register

from .gpt2 import GPT2, GPT2StyleConfig
from .llama import Llama, LlamaAttention, LlamaModel


@dataclass
class GPTJConfig(GPT2StyleConfig):
    model_type: ClassVar[str] = "gptj"
    returns_given_cache: ClassVar[bool] = True  # as its transformers *Model.forward

    vocab_size: int = 50400
    n_positions: int = 2048
    n_embd: int = 4096
    n_layer: int = 28
    n_head: int = 16
    resid_pdrop: float = 0.0
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    tie_word_embeddings: bool = False
    rotary_dim: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        # GPTJConfig's strict int; the table's doubled halves must match the turned slice of each head (GPTJAttention
        # broadcasts them against it): anything else fails in transformers
        rotary, head_dim = self.rotary_dim, self.n_embd // self.n_head
        if isinstance(rotary, bool) or not isinstance(rotary, int) or rotary < 2 or rotary % 2 or rotary > head_dim:
            raise ConfigError(f"config (gptj): field rotary_dim={rotary!r} must be an even number of dimensions "
                              f"from 2 to the head size {head_dim}")


def create_sinusoidal_positions(num_pos: int, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """modeling_gptj.create_sinusoidal_positions: [sin | cos] of ``position * inv_freq`` per position, float32."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device) / dim))
    sinusoid_inp = torch.arange(num_pos, dtype=torch.int64, device=device).float()[:, None] * inv_freq
    return torch.cat((torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)), dim=1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(tensor: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """modeling_gptj.apply_rotary_pos_emb on (B, S, heads, d): sin and cos doubled with repeat_interleave."""
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


class GPTJAttention(LlamaAttention):
    """``k_proj v_proj q_proj out_proj`` (no biases, in transformers' order), ``resid_dropout``; GPT-J's RoPE on the
    untransposed views; GPT-J's eager recipe (float32 scores, softmax cast to v's dtype, then dropout)."""

    def make_projections(self, config: GPTJConfig, heads: int, kv: int) -> None:
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # GPTJAttention.forward turns the (B, S, heads, d) views, then transposes: undo LLaMA's transpose (the same
        # strides as the views), turn the first rotary_dim dimensions and pass the rest, transpose back
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        rotary = self.config.rotary_dim
        k_rot, k_pass = k[:, :, :, :rotary], k[:, :, :, rotary:]
        q_rot, q_pass = q[:, :, :, :rotary], q[:, :, :, rotary:]
        k = torch.cat([apply_rotary_pos_emb(k_rot, sin, cos), k_pass], dim=-1)
        q = torch.cat([apply_rotary_pos_emb(q_rot, sin, cos), q_pass], dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.path(self.config) != "eager":
            return super().attend(q, k, v, mask)
        # modeling_gptj.eager_attention_forward
        weights = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(2, 3)) * self.scaling
        if mask is not None:
            weights = weights + mask
        weights = F.softmax(weights, dim=-1).to(v.dtype)
        weights = F.dropout(weights, p=self.config.attn_pdrop if self.training else 0.0, training=self.training)
        record_attention(weights)
        return torch.matmul(weights, v).transpose(1, 2).contiguous()

    def project_out(self, attn_output: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.out_proj(attn_output))


class GPTJMLP(nn.Module):
    def __init__(self, intermediate_size: int, config: GPTJConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, intermediate_size)
        self.fc_out = nn.Linear(intermediate_size, config.n_embd)
        self.act = activation(config.activation_function)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(hidden_states))))


class GPTJBlock(nn.Module):
    """GPTJBlock: ``ln_1`` once, attention and MLP both on it, ``(attn + mlp) + x`` in transformers' order."""

    def __init__(self, config: GPTJConfig, attn: nn.Module, mlp: nn.Module, norm_class: type[nn.Module]) -> None:
        super().__init__()
        self.ln_1 = norm_class(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = attn
        self.mlp = mlp

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: Any) -> torch.Tensor:
        normed = self.ln_1(hidden_states)
        attn_output = self.attn(normed, rope, mask, cache)
        return attn_output + self.mlp(normed) + hidden_states


class GPTJModel(LlamaModel):
    """``wte``, ``drop``, the blocks ``h``, ``ln_f`` and the sinusoid table (``embed_positions``, non-persistent in
    transformers: a LazyBuffers here, rounded by casts as that buffer); LLaMA's forward, masks and cache."""

    exits_early = False  # its transformers forward runs every layer, whatever num_hidden_layers says
    attention_class = GPTJAttention
    layer_class = GPTJBlock
    norm_class = nn.LayerNorm
    input_names = (*LlamaModel.input_names, "token_type_ids")

    def __init__(self, config: GPTJConfig, add_pooling_layer: bool = False) -> None:
        Backbone.__init__(self, config)  # GPTJModel.__init__'s modules, in its order
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(self.layer_class(config, self.attention_class(config, i), self.make_mlp(config),
                                                self.norm_class) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.embed_positions = LazyBuffers(self._make_embed_positions)

    # LLaMA's encode runs self.layers and closes with self.norm
    layers = property(lambda self: self.h)
    norm = property(lambda self: self.ln_f)

    def _make_embed_positions(self, key: None, device: torch.device | None) -> torch.Tensor:
        return create_sinusoidal_positions(self.config.n_positions, self.config.rotary_dim, device)

    @classmethod
    def make_mlp(cls, config: GPTJConfig) -> nn.Module:
        return GPTJMLP(config.n_inner if config.n_inner is not None else 4 * config.n_embd, config)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def position_table_size(self) -> int | None:
        return self.config.n_positions  # embed_positions' rows

    def rotary(self, key: str | None, position_ids: torch.Tensor,
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GPTJRotaryEmbedding.forward: the table's rows at the positions, in the hidden dtype, split into sin and
        cos (handed on as (cos, sin), LLaMA's order)."""
        sincos = self.embed_positions(None, hidden.device)[position_ids].to(hidden.dtype)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        return cos, sin

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # GPTJModel.forward: wte, + wte(token types), drop
        hidden = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        if token_type_ids is not None:
            hidden = hidden + self.wte(token_type_ids.view(-1, hidden.shape[1]))
        return self.drop(hidden)

    def forward(self, input_ids: torch.Tensor | None = None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                use_cache: bool | None = None, *, past_key_values: Any = None) -> BaseModelOutputWithPast:
        """GPTJModel.forward's positional order; LLaMA's forward."""
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                               token_type_ids=token_type_ids, past_key_values=past_key_values)


class GPTJLMHead(LMHead):
    """GPTJForCausalLM's ``lm_head``: with a bias (tied, only its weight follows ``wte``)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        HeadPart.__init__(self)
        self.lm_head = nn.Linear(hidden_size, vocab_size)


class GPTJForCausalLM(ModelForCausalLM):
    def forward(self, input_ids: torch.Tensor | None = None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, *, past_key_values: Any = None, cache_position: Any = None,
                shift_labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> CausalLMOutput:
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                               logits_to_keep=logits_to_keep, token_type_ids=token_type_ids,
                               past_key_values=past_key_values, cache_position=cache_position,
                               shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)


@register
class GPTJ(Llama):
    model_type = "gptj"
    arch = "GPTJ"
    prefix = "transformer"
    config_class = GPTJConfig
    backbone_class = GPTJModel
    ignored_keys = GPT2.ignored_keys  # the same old attn.bias / attn.masked_bias buffers
    tasks = ("base", "causal_lm", "seqcls", "qa")  # transformers has no GPTJForTokenClassification
    # GenericForSequenceClassification / GenericForQuestionAnswering, as LLaMA's (the QA backbone under
    # transformer, which is GPT-J's prefix anyway)
    task_models = {**{t: m for t, m in Llama.task_models.items() if t in ("seqcls", "qa")},
                   "causal_lm": GPTJForCausalLM}

    @classmethod
    def max_sequence_length(cls, config: GPTJConfig) -> int | None:
        return config.n_positions  # the sinusoid table's rows: transformers' index runs out past them

    @classmethod
    def causal_lm_head(cls, config: GPTJConfig) -> HeadPart:
        return GPTJLMHead(config.n_embd, config.vocab_size)
