"""SmolLM3 (``model_type: smollm3``): LLaMA (``attention_bias`` on q, k, v and o, ``mlp_bias`` on the MLP) with
NoPE layers and optional sliding layers.

Mirrors ``transformers.models.smollm3`` (5.25):
- NoPE: ``no_rope_layers`` holds one entry per layer (at least ``num_hidden_layers`` of them; a longer list is
  read up to the layer count), a true entry turns q and k with RoPE and a 0 leaves them unturned
  (``SmolLM3Attention.forward``: ``if self.use_rope``); without it, every ``no_rope_layer_interval``-th layer is
  NoPE (``SmolLM3Config.__post_init__``: ``int((i + 1) % interval != 0)``, Python's modulo, so a negative interval
  counts as transformers counts it; 0 is a ConfigError where transformers divides by zero);
- layer kinds: ``layer_types`` when given, else the NoPE layers slide when ``use_sliding_window`` and
  ``sliding_window`` are both set (the RoPE layers stay full). A sliding layer's mask and cache take
  ``sliding_window`` whatever ``use_sliding_window`` says (``create_sliding_window_causal_mask`` and
  ``DynamicCache(config=...)`` read the config's window; ``use_sliding_window`` only reaches flash attention's
  window, which neither path here runs); a sliding layer without a window is a ConfigError (transformers raises
  at the forward);
- other defaults (RoPE theta 2e6, tied embeddings, GQA 16:4, pad id 128004); the backbone returns the cache only
  with ``use_cache`` (``SmolLM3Model.forward``); heads as LLaMA's, QA under ``transformer``.
Everything else is families/llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flodl_hf.core.errors import ConfigError
from flodl_hf.core.registry import register

from .llama import FULL, SLIDING, Llama, LlamaAttention, LlamaConfig, LlamaModel


@dataclass
class SmolLM3Config(LlamaConfig):
    model_type: ClassVar[str] = "smollm3"
    default_theta: ClassVar[float] = 2_000_000.0  # SmolLM3Config.default_theta
    returns_given_cache: ClassVar[bool] = False  # as its transformers *Model.forward

    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    pad_token_id: int | None = 128004
    bos_token_id: int | None = 128000
    eos_token_id: int | list[int] | None = 128001
    tie_word_embeddings: bool = True
    use_sliding_window: bool = False
    sliding_window: int | None = None
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        # the RoPE layers first: layer_kinds() (checked by LlamaConfig) reads them
        self.rope_layers()
        super().__post_init__()  # a sliding layer without a window is refused there (check_layers)

    def rope_layers(self) -> list[bool]:
        """Whether each layer turns q and k with RoPE (False: a NoPE layer), as SmolLM3Config.__post_init__ and
        ``SmolLM3Attention.use_rope`` read them."""
        layers = self.num_hidden_layers
        if self.no_rope_layers is None:
            interval = self.no_rope_layer_interval
            if isinstance(interval, bool) or not isinstance(interval, int) or interval == 0:
                raise ConfigError(f"config field no_rope_layer_interval={interval!r}: expected a non-zero integer")
            return [(i + 1) % interval != 0 for i in range(layers)]
        given = self.no_rope_layers
        if (not isinstance(given, list) or len(given) < layers
                or any(isinstance(v, bool) or not isinstance(v, int) for v in given)):
            raise ConfigError(f"config field no_rope_layers={given!r}: expected a list of at least "
                              f"num_hidden_layers={layers} integers (1: RoPE, 0: NoPE)")
        return [bool(v) for v in given[:layers]]

    def layer_kinds(self) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        slides = self.use_sliding_window and self.sliding_window is not None
        return [SLIDING if slides and not rope else FULL for rope in self.rope_layers()]

    def window(self, kind: str) -> int | None:
        return self.sliding_window if kind == SLIDING else None


class SmolLM3Attention(LlamaAttention):
    def __init__(self, config: SmolLM3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.use_rope = config.rope_layers()[layer_idx]

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # SmolLM3Attention.forward: a NoPE layer attends with q and k as projected
        return super().rotate(q, k, cos, sin) if self.use_rope else (q, k)


class SmolLM3Model(LlamaModel):
    attention_class = SmolLM3Attention


@register
class SmolLM3(Llama):
    model_type = "smollm3"
    arch = "SmolLM3"
    config_class = SmolLM3Config
    backbone_class = SmolLM3Model
