"""LLaMA (``model_type: llama``): a pre-norm causal decoder with RMSNorm, RoPE, grouped-query attention,
the SwiGLU MLP and a KV cache.

Mirrors ``transformers.models.llama.modeling_llama`` (5.24):
- ``embed_tokens``; each layer is ``h + self_attn(input_layernorm(h))`` then
  ``h + mlp(post_attention_layernorm(h))``; ``norm`` closes the stack;
- ``q_proj k_proj v_proj o_proj`` (bias with ``attention_bias``), ``num_key_value_heads`` <= heads,
  ``head_dim`` given or ``hidden / heads``; ``gate_proj up_proj down_proj`` (bias with ``mlp_bias``);
- RoPE, ``default`` or ``llama3``, read from ``rope_parameters`` or the older ``rope_scaling`` + ``rope_theta``;
- causal masks per layer (``MaskSpec("causal", window)``), a KV cache as ``DynamicCache`` keeps it;
  ``use_cache`` defaults to the config's, as transformers' (so a plain forward runs through the cache too);
- heads: ``lm_head`` (causal_lm, tied with ``tie_word_embeddings``), ``score`` on the last non-pad token
  (seqcls), ``score`` per token (tokcls), ``qa_outputs`` with the backbone under ``transformer`` (qa).
Mistral and Qwen2 (families/mistral.py, families/qwen2.py) are this file with other defaults, biases
and windows; Qwen3, Phi3, Gemma, Gemma2, Gemma3, GPT-2, OLMo 2 and Granite replace parts through the backbone's
hooks (``attention_class`` with its ``make_projections`` / ``project``, ``rotate``, ``attend``, ``project_out``,
``scaling`` / ``softcap`` and ``paths``, ``layer_class``, ``make_mlp``, ``norm_class``, ``embedding_class``, ``embed``
(handed the positions and token types), ``default_positions`` (OPT: counted along the mask),
``rotary_embeddings`` (None: no RoPE) / ``rotary``) and the config's
(``biases``, ``layer_kinds``, ``window``, ``rotary_dim``, ``rope_types``, ``rope_key`` / ``rope(key)``: a RoPE per
layer kind); the heads read the family's ``head_width`` (OPT: the projected width).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from flodl_hf.core.checkpointing import drops_cache
from flodl_hf.core.config import Activation, BaseConfig
# SLIDING is imported from here by the families, with FULL
from flodl_hf.core.decoder import (FULL, ROPE_TYPES, SLIDING, KVCache, Rope, RMSNorm, SwiGLU,  # noqa: F401
                                   apply_rotary_pos_emb, as_cache, causal_mask, check_layers, grouped_attend,
                                   rotary_cos_sin)
from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.heads import (ModelForQuestionAnswering, ModelForSequenceClassification, ModelForTokenClassification,
                            SpanClassifier)
from flodl_hf.heads.causal_lm import LMHead
from flodl_hf.core.layers import MaskSpec, LazyBuffers, activation
from flodl_hf.core.modeling import Backbone, HeadPart, TaskModel, check_forward_inputs
from flodl_hf.core.outputs import (BaseModelOutputWithPast, QuestionAnsweringModelOutput,
                                   SequenceClassifierOutputWithPast, TokenClassifierOutput)
from flodl_hf.core.registry import Family, register



@dataclass
class LlamaConfig(BaseConfig):
    model_type: ClassVar[str] = "llama"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation}
    default_theta: ClassVar[float] = 10_000.0
    rope_types: ClassVar[tuple[str, ...]] = ROPE_TYPES  # the RoPE types the family takes (Rope.resolve)
    # whether the backbone returns a cache it was given when use_cache is False (LlamaModel.forward returns
    # past_key_values whatever use_cache says; Mistral's, Qwen2's, Gemma's ... return it only with use_cache)
    returns_given_cache: ClassVar[bool] = True

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: Activation = Activation.SILU
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: dict[str, Any] | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    # the older spelling, read when rope_parameters is absent (transformers writes rope_parameters)
    rope_scaling: dict[str, Any] | None = None
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # the fields against the config table (flodl_hf.core.validate)
        check_layers(self)  # each layer's kind, window and RoPE as they will be built, against the same table

    # derived, not written back (a Qwen2 config.json has no head_dim, and its export must not gain one)
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def norm_eps(self) -> float:
        """The layer and final norms' epsilon: ``rms_norm_eps`` (StarCoder2: ``norm_epsilon``; StableLM:
        ``layer_norm_eps``)."""
        return self.rms_norm_eps

    @property
    def rotary_dim(self) -> int:
        """The head dimensions RoPE turns: all of them (Phi3: ``partial_rotary_factor`` of them)."""
        return self.attention_head_dim

    def rope(self, key: str | None = None) -> Rope:
        """The RoPE of ``rope_key`` ``key``: one for every layer here (Gemma3: one per layer kind)."""
        return Rope.resolve(self.rope_parameters, self.rope_scaling, self.rope_theta, self.default_theta,
                            self.max_position_embeddings, self.raw.get("original_max_position_embeddings"),
                            self.rope_types)

    def biases(self) -> tuple[bool, bool, bool]:
        """(q/k/v, o_proj, MLP) biases: ``attention_bias`` and ``mlp_bias`` for LLaMA."""
        return self.attention_bias, self.attention_bias, self.mlp_bias

    def layer_kinds(self) -> list[str]:
        """Each layer's attention kind: full everywhere for LLaMA."""
        return [FULL] * self.num_hidden_layers

    def window(self, kind: str) -> int | None:
        """The sliding window of a layer kind (None: full causal attention)."""
        return None

    def rope_key(self, kind: str) -> str | None:
        """Which RoPE a layer kind turns with (``rope(key)``): None, the one RoPE, for every kind here; Gemma3
        keys it by kind (a local and a global theta)."""
        return None


class LlamaAttention(nn.Module):
    """LlamaAttention: ``q_proj k_proj v_proj o_proj``, RoPE, the cache, grouped attention. A family changes the
    projections through two hooks: ``make_projections`` (the modules: Phi3's fused ``qkv_proj``) and ``project``
    (q, k, v per head before the transpose); ``qk_norm`` (Qwen3's and Gemma3's ``q_norm``/``k_norm`` over each
    head of q and k, in ``project``), ``scaling`` and ``softcap`` (Gemma2's ``query_pre_attn_scalar`` and
    ``attn_logit_softcapping``) are attributes a subclass sets."""

    softcap: float | None = None  # tanh softcapping of the scores (eager only), None: none
    # a norm class over each head of q and k (q_norm, k_norm, built after the projections as transformers'),
    # applied to q and k per head before the transpose and RoPE; None: none
    qk_norm: ClassVar[type[nn.Module] | None] = None
    paths: ClassVar[tuple[str, ...]] = ("sdpa", "eager")  # its attention paths (a family's attn_implementations)

    @classmethod
    def path(cls, config: LlamaConfig) -> str:
        """The configured path where this attention has it, else its own first (Gemma2, eager only, asked for
        sdpa runs eager, as the one-path encoders do); the masks are built for the same path."""
        impl = config.attn_implementation
        return impl if impl in cls.paths else cls.paths[0]

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.attention_head_dim
        self.groups = config.num_attention_heads // config.kv_heads
        self.scaling = self.head_dim ** -0.5
        self.make_projections(config, config.num_attention_heads * self.head_dim, config.kv_heads * self.head_dim)
        if self.qk_norm is not None:
            self.q_norm = self.qk_norm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = self.qk_norm(self.head_dim, eps=config.rms_norm_eps)

    def make_projections(self, config: LlamaConfig, heads: int, kv: int) -> None:
        qkv_bias, o_bias, _ = config.biases()
        self.q_proj = nn.Linear(config.hidden_size, heads, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv, bias=qkv_bias)
        self.o_proj = nn.Linear(heads, config.hidden_size, bias=o_bias)

    def project(self, hidden_states: torch.Tensor,
                shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v viewed as ``shape`` (B, S, heads, head_dim), not yet transposed; q and k normed per head
        with ``qk_norm`` (Qwen3Attention.forward: ``q_norm(q_proj(h).view(shape))``)."""
        q, k, v = self.project_heads(hidden_states, shape)
        if self.qk_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def project_heads(self, hidden_states: torch.Tensor,
                      shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections viewed per head (Phi-3 slices its fused ``qkv_proj`` here)."""
        return (self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape),
                self.v_proj(hidden_states).view(shape))

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        # LlamaAttention.forward: view + transpose, RoPE, cache update, attention, reshape, o_proj
        input_shape = hidden_states.shape[:-1]
        q, k, v = (t.transpose(1, 2) for t in self.project(hidden_states, (*input_shape, -1, self.head_dim)))
        if rope is not None:  # None: the positions are in the embeddings (GPT-2's wpe)
            q, k = self.rotate(q, k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        return self.project_out(self.attend(q, k, v, mask).reshape(*input_shape, -1).contiguous())

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q and k (OLMo 2 casts the results back to their dtypes)."""
        return apply_rotary_pos_emb(q, k, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The attention of q (B, heads, q, d) over k, v, as (B, q, heads, d) (GPT-2 has its own eager recipe)."""
        p = self.config.attention_dropout if self.training else 0.0
        return grouped_attend(q, k, v, mask, self.path(self.config), self.groups, self.scaling, p, self.softcap)

    def project_out(self, attn_output: torch.Tensor) -> torch.Tensor:
        """The output projection (GPT-2: ``c_proj`` then its residual dropout)."""
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm layer, given its parts (the backbone's ``attention_class``, ``make_mlp``, ``norm_class``)."""

    def __init__(self, config: LlamaConfig, self_attn: nn.Module, mlp: nn.Module, norm_class: type[nn.Module]) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm_class(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = norm_class(config.hidden_size, eps=config.norm_eps)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        # LlamaDecoderLayer.forward: residual + attn(norm(h)), residual + mlp(norm(h))
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), rope, mask, cache)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(Backbone):
    """``last_hidden_state`` after ``norm``, and the KV cache (``cache``) when ``use_cache``. The parts a family
    replaces are class attributes (``embedding_class``, ``attention_class``, ``layer_class``, ``norm_class``) and
    ``make_mlp``."""

    embedding_class: ClassVar[type[nn.Embedding]] = nn.Embedding
    attention_class: ClassVar[type[nn.Module]] = LlamaAttention
    layer_class: ClassVar[type[nn.Module]] = LlamaDecoderLayer
    norm_class: ClassVar[type[nn.Module]] = RMSNorm

    input_names = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "cache", "use_cache",
                   "past_key_values")
    # checked in forward instead: with a cache the mask covers the past tokens too, not only the input's
    validates_inputs = False
    # transformers' forward runs ``self.layers[: config.num_hidden_layers]``, so assisted decoding's early exit
    # (``assistant_early_exit=k``, which lowers that count while the model drafts) runs the first k layers; a family
    # whose forward runs every layer whatever the count says sets it False (transformers' early exit fails there on
    # a cache of fewer layers: refused, flodl_hf.generation.generate)
    exits_early: ClassVar[bool] = True

    def __init__(self, config: LlamaConfig, add_pooling_layer: bool = False) -> None:
        super().__init__(config)
        self.embed_tokens = self.embedding_class(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(self.layer_class(config, self.attention_class(config, i), self.layer_mlp(config, i),
                                                     self.norm_class) for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, eps=config.norm_eps)
        self.inverse_frequencies = LazyBuffers(self._make_inverse_frequencies, self.rope_keys())

    @classmethod
    def layer_mlp(cls, config: LlamaConfig, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s MLP: ``make_mlp``'s in every layer (Qwen2-MoE: sparse or dense by layer)."""
        return cls.make_mlp(config)

    @classmethod
    def make_mlp(cls, config: LlamaConfig) -> nn.Module:
        return SwiGLU(config.hidden_size, config.intermediate_size, activation(config.hidden_act),
                      bias=config.biases()[2])

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def mask_specs(self) -> list[MaskSpec]:
        return [MaskSpec("causal", self.config.window(kind)) for kind in self.config.layer_kinds()]

    def cache_windows(self) -> list[int | None]:
        """Each layer's window, as ``DynamicCache(config=...)`` lays its layers out."""
        return [spec.window for spec in self.mask_specs()]

    def new_cache(self) -> KVCache:
        return KVCache(self.cache_windows())

    def rope_keys(self) -> list[str | None]:
        """Each layer's RoPE key (``config.rope_key``): [None, None, ...] when one RoPE serves every layer."""
        return [self.config.rope_key(kind) for kind in self.config.layer_kinds()]

    def _make_inverse_frequencies(self, key: str | None, device: torch.device | None) -> torch.Tensor:
        return self.config.rope(key).inverse_frequencies(self.config.rotary_dim, device)

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds

    def encode(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + past).unsqueeze(0)
        impl = self.attention_class.path(self.config)
        specs = self.mask_specs()
        masks: dict[MaskSpec, torch.Tensor | None] = {}
        for spec in dict.fromkeys(specs):
            # create_causal_mask sizes against the first full layer, the sliding one against the first sliding
            layer = specs.index(spec)
            masks[spec] = causal_mask(spec, attention_mask, hidden.shape[0], hidden.shape[1], impl, hidden.dtype,
                                      hidden.device, cache, layer)
        keys = self.rope_keys()
        ropes = self.rotary_embeddings(keys, position_ids, hidden)
        count = self.__dict__.get("exit_after") if self.exits_early else None  # assisted decoding's early exit
        layers = self.layers if count is None else list(self.layers)[:count]
        for layer, spec, key in zip(layers, specs[:count], keys[:count], strict=True):
            if not self.drops_layer():
                hidden = layer(hidden, ropes[key], masks[spec], cache)
        return self.norm(hidden)

    def drops_layer(self) -> bool:
        """Whether the next layer is skipped (LayerDrop, drawn before each layer outside it, so a skipped layer
        records no hidden state, as transformers' hooks record none): never, but for OPT's ``layerdrop``."""
        return False

    def rotary_embeddings(self, keys: list[str | None], position_ids: torch.Tensor,
                          hidden: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """(cos, sin) per RoPE key, handed to each layer's attention (None there: no RoPE, GPT-2)."""
        return {key: self.rotary(key, position_ids, hidden) for key in dict.fromkeys(keys)}

    def rotary(self, key: str | None, position_ids: torch.Tensor,
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of RoPE ``key``, as LlamaRotaryEmbedding.forward, in the hidden states' dtype."""
        inv_freq, scaling = self.rope_frequencies(key, position_ids, hidden.device)
        return rotary_cos_sin(inv_freq, position_ids, hidden.dtype, scaling)

    def rope_frequencies(self, key: str | None, position_ids: torch.Tensor,
                         device: torch.device) -> tuple[torch.Tensor, float]:
        """The inverse frequencies RoPE ``key`` turns with in this forward, and what scales cos and sin, as
        ``dynamic_rope_update`` leaves them before LlamaRotaryEmbedding.forward:
        - longrope (a family whose ``rope_types`` take it: Phi3): the long frequencies when ``max(position_ids) + 1``
          passes original_max_position_embeddings, the short ones otherwise (``longrope_frequency_update``: the long
          ones land in the short ones' buffer, so they take its dtype);
        - dynamic: frequencies recomputed when a forward is longer than any before it (and kept for shorter ones),
          back to the first ones when a forward is shorter than max_position_embeddings again
          (``dynamic_frequency_update``: state that lives with the model, across forwards and generate calls)."""
        inv_freq = self.inverse_frequencies(key, device)
        rope = self.config.rope(key)
        if rope.rope_type == "longrope":
            long = rope.inverse_frequencies(self.config.rotary_dim, device, long=True)
            seq_len = torch.max(position_ids) + 1
            inv_freq = torch.where(seq_len > rope.original_max_position_embeddings, long.to(inv_freq.dtype),
                                   inv_freq.to(device))
        elif rope.rope_type == "dynamic":
            inv_freq = self._dynamic_frequencies(key, rope, position_ids, inv_freq, device)
        return inv_freq, rope.attention_scaling

    def _dynamic_frequencies(self, key: str | None, rope: Rope, position_ids: torch.Tensor,
                             start: torch.Tensor, device: torch.device) -> torch.Tensor:
        state = self.__dict__.setdefault("_dynamic_rope", {})  # key -> (longest length seen, its frequencies)
        original = rope.original_max_position_embeddings
        cached, inv_freq = state.get(key, (original, start))
        seq_len = torch.max(position_ids) + 1
        if seq_len > cached:  # growth
            inv_freq = rope.inverse_frequencies(self.config.rotary_dim, device, seq_len=seq_len)
            state[key] = (seq_len, inv_freq)
        if seq_len < original and cached > original:  # reset
            state[key] = (original, start)
            inv_freq = start
        return inv_freq

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None, *,
                token_type_ids: torch.Tensor | None = None, past_key_values: Any = None) -> BaseModelOutputWithPast:
        """LlamaModel.forward's positional order (input_ids, attention_mask, position_ids, cache, inputs_embeds,
        use_cache); the rest by keyword: ``token_type_ids`` (refused: a decoder has none) and
        ``past_key_values`` (the cache's name before transformers 5.24)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if token_type_ids is not None and "token_type_ids" not in self.input_names:
            raise InputError(f"{type(self).__name__} has no token types: pass no token_type_ids")
        use_cache = drops_cache(self, self.config.use_cache if use_cache is None else use_cache)  # checkpointing
        if self.config.returns_given_cache and (cache is not None or past_key_values is not None):
            use_cache = True  # a given cache is updated and returned (config.returns_given_cache)
        cache = as_cache(cache, self.cache_windows(), past_key_values)
        self._check_inputs(input_ids, attention_mask, inputs_embeds, cache)
        if use_cache and cache is None:
            cache = self.new_cache()
        if position_ids is None:  # LlamaModel.forward: the cache's length on, before this step updates it
            inputs = input_ids if input_ids is not None else inputs_embeds
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = self.default_positions(inputs, attention_mask, past)
        hidden = self.embed(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                            inputs_embeds=inputs_embeds)
        hidden = self.encode(hidden, attention_mask, position_ids, cache)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=cache if use_cache else None)

    def default_positions(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None,
                          past: int) -> torch.Tensor:
        """The positions of a step given none: the cache's length on (OPT: counted along the attention mask)."""
        return (torch.arange(inputs.shape[1], device=inputs.device) + past).unsqueeze(0)

    def _check_inputs(self, input_ids: Any, attention_mask: Any, inputs_embeds: Any, cache: KVCache | None) -> None:
        """The shared input checks on this step's tokens; the mask must cover the cached tokens and these."""
        past = cache.get_seq_length() if cache is not None else 0
        step_mask = attention_mask
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            inputs = input_ids if isinstance(input_ids, torch.Tensor) else inputs_embeds
            if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2:
                if attention_mask.shape[-1] != past + inputs.shape[1]:
                    raise InputError(f"attention_mask has {attention_mask.shape[-1]} columns: expected the "
                                     f"{past} cached tokens plus the {inputs.shape[1]} given ({past + inputs.shape[1]})")
                step_mask = attention_mask[:, past:]
        check_forward_inputs(self, input_ids, step_mask, None, inputs_embeds)


# ---- task models and heads ---------------------------------------------------------------------------

class ScoreHead(HeadPart):
    """``score(dropout(h))`` per token: the generic sequence (no bias, no dropout) and token heads."""

    def __init__(self, hidden_size: int, num_labels: int, bias: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(hidden_size, num_labels, bias=bias)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.score(self.dropout(hidden_states))


def last_token_index(input_ids: torch.Tensor | None, pad_token_id: int | None, batch: int,
                     device: torch.device) -> torch.Tensor | int:
    """GenericForSequenceClassification's pick: the last token that is not the pad id (right or left padding),
    -1 without a pad id (one row only) or from embeddings."""
    if pad_token_id is None:
        if batch != 1:
            raise InputError("a batch of more than one row needs pad_token_id in the config to find each row's "
                             "last token")
        return -1
    if input_ids is None:
        return -1
    non_pad = (input_ids != pad_token_id).to(device, torch.int32)
    indices = torch.arange(input_ids.shape[-1], device=device, dtype=torch.int32)
    return (indices * non_pad).argmax(-1)


def check_heads_from_hidden(data: dict, config: Any, family: str) -> None:
    """For a family whose heads are always hidden_size // num_attention_heads (GPT-NeoX, StableLM): a config.json
    ``head_dim`` that differs is a ConfigError (transformers' rotary module would read it, its attention not)."""
    head_dim = data.get("head_dim")
    if head_dim is not None and head_dim != config.attention_head_dim:
        raise ConfigError(f"config field head_dim={head_dim!r}: {family}'s heads are hidden_size // "
                          f"num_attention_heads = {config.attention_head_dim}")


def token_dropout(config: Any) -> float:
    """GenericForTokenClassification's (and GPT2ForTokenClassification's) dropout: classifier_dropout, else
    hidden_dropout, else 0.1."""
    dropout = config.raw.get("classifier_dropout")
    if dropout is None:
        dropout = config.raw.get("hidden_dropout")
    return 0.1 if dropout is None else dropout


class DecoderForSequenceClassification(ModelForSequenceClassification):
    """The score head on every token, then each row's last non-pad token (transformers' generic head).
    Positional order and keywords as GenericForSequenceClassification.forward; the cache after the step is
    returned with ``use_cache`` (the config's by default)."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, *, token_type_ids: torch.Tensor | None = None,
                past_key_values: Any = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> SequenceClassifierOutputWithPast:
        out = self.run_backbone(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                position_ids=position_ids, inputs_embeds=inputs_embeds,
                                cache=cache, past_key_values=past_key_values, use_cache=use_cache)
        logits = self.head(out.last_hidden_state, None, attention_mask)
        batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        last = last_token_index(input_ids, self.config.pad_token_id, batch, logits.device)
        pooled = logits[torch.arange(batch, device=logits.device), last]
        loss = None
        if labels is not None:
            loss = self.compute_loss(pooled, labels=labels, num_items_in_batch=num_items_in_batch)
        return SequenceClassifierOutputWithPast(loss=loss, logits=pooled, cache=out.cache)


class DecoderForTokenClassification(ModelForTokenClassification):
    """``score(dropout(h))`` per token, as GenericForTokenClassification.forward: its positional order, and a
    ``cache`` read and updated in place (a step on a cache) but not returned, as transformers' record has none."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, *, token_type_ids: torch.Tensor | None = None,
                past_key_values: Any = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> TokenClassifierOutput:
        logits, loss = self.logits_and_loss(labels, num_items_in_batch, input_ids=input_ids,
                                            attention_mask=attention_mask, token_type_ids=token_type_ids,
                                            position_ids=position_ids, inputs_embeds=inputs_embeds, cache=cache,
                                            past_key_values=past_key_values, use_cache=use_cache)
        return TokenClassifierOutput(loss=loss, logits=logits)


class DecoderForQuestionAnswering(ModelForQuestionAnswering):
    """``qa_outputs`` per token, as GenericForQuestionAnswering.forward: its positional order (no ``use_cache``
    there: it is a keyword, handed to the backbone as transformers' ``**kwargs`` are), a ``cache`` read and
    updated in place but not returned."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, start_positions: torch.Tensor | None = None,
                end_positions: torch.Tensor | None = None, *, use_cache: bool | None = None,
                token_type_ids: torch.Tensor | None = None, past_key_values: Any = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> QuestionAnsweringModelOutput:
        out = self.run_backbone(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                position_ids=position_ids, inputs_embeds=inputs_embeds,
                                cache=cache, past_key_values=past_key_values, use_cache=use_cache)
        return self.spans(out, attention_mask, start_positions, end_positions, num_items_in_batch)


class LlamaForQuestionAnswering(DecoderForQuestionAnswering):
    backbone_prefix = "transformer"  # LlamaForQuestionAnswering.base_model_prefix, kept by transformers for BC


# transformers' Generic*ForX heads, which every decoder family runs (a family derived from LLaMA inherits them
# in its task_models and replaces one by naming it there)
DECODER_TASK_MODELS: dict[str, type[TaskModel]] = {
    "seqcls": DecoderForSequenceClassification, "tokcls": DecoderForTokenClassification,
    "qa": DecoderForQuestionAnswering}


@register
class Llama(Family):
    model_type = "llama"
    arch = "Llama"
    prefix = "model"
    config_class = LlamaConfig
    backbone_class = LlamaModel
    tasks = ("base", "causal_lm", "seqcls", "tokcls", "qa")
    task_models = {**DECODER_TASK_MODELS, "qa": LlamaForQuestionAnswering}
    # the heads whose transformers loss reads num_items_in_batch (self.loss_function(..., **kwargs)): QA and the
    # causal LM; the generic sequence and token classifiers call theirs without it (losses.counted_items)
    num_items_tasks = frozenset({"qa", "causal_lm"})

    @classmethod
    def max_sequence_length(cls, config: LlamaConfig) -> int | None:
        return None  # RoPE has no position table to run past; transformers does not cut at max_position_embeddings

    @classmethod
    def head_width(cls, config: LlamaConfig) -> int:
        """The width of the backbone's output, which the heads below read: ``hidden_size`` (OPT: projected)."""
        return config.hidden_size

    @classmethod
    def causal_lm_head(cls, config: LlamaConfig) -> HeadPart:
        return LMHead(cls.head_width(config), config.vocab_size)

    @classmethod
    def sequence_head(cls, config: LlamaConfig) -> HeadPart:
        return ScoreHead(cls.head_width(config), config.num_labels, bias=False)

    @classmethod
    def token_head(cls, config: LlamaConfig) -> HeadPart:
        # GenericForTokenClassification: bias unless told
        return ScoreHead(cls.head_width(config), config.num_labels,
                         bias=config.raw.get("token_classification_bias", True), dropout=token_dropout(config))

    @classmethod
    def span_head(cls, config: LlamaConfig) -> HeadPart:
        return SpanClassifier(cls.head_width(config), 2)
