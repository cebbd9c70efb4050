"""Ministral (``model_type: ministral``): Mistral's config (no biases anywhere: ``MinistralAttention`` builds q, k,
v and o without one, ``MinistralMLP`` is Qwen2's) with layer kinds: ``layer_types`` when given, else every layer
sliding when ``sliding_window`` is set (``MinistralConfig.__post_init__``), each sliding layer's mask and cache
those of a window of ``sliding_window`` tokens, the full ones causal.

Two configs transformers 5.25 cannot run: a null ``sliding_window`` is a ConfigError naming the field
(``MinistralModel.forward`` builds the sliding mask for every config, and ``create_sliding_window_causal_mask``
raises without a window); no ``head_dim`` (``MinistralAttention`` reads ``config.head_dim``, None unless given,
and fails with a TypeError; the hub's Ministral configs give it) runs heads of ``hidden_size //
num_attention_heads``, as Mistral's would, so that the defaults build (there is no transformers output to differ
from). The backbone returns the cache only with
``use_cache``; the QA head keeps its backbone under ``transformer`` (``MinistralForQuestionAnswering``), as
LLaMA's. Everything else is families/mistral.py and families/llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flodl_hf.core.errors import ConfigError
from flodl_hf.core.registry import register

from .llama import FULL, SLIDING, Llama
from .mistral import Mistral, MistralConfig


@dataclass
class MinistralConfig(MistralConfig):
    model_type: ClassVar[str] = "ministral"

    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is None:
            raise ConfigError("config field sliding_window=None: transformers' MinistralModel builds a sliding "
                              "mask for every config and create_sliding_window_causal_mask raises without one")
        super().__post_init__()

    def layer_kinds(self) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        return [SLIDING if self.sliding_window is not None else FULL] * self.num_hidden_layers

    def window(self, kind: str) -> int | None:
        return self.sliding_window if kind == SLIDING else None


@register
class Ministral(Mistral):
    model_type = "ministral"
    arch = "Ministral"
    config_class = MinistralConfig
    task_models = Llama.task_models  # MinistralForQuestionAnswering.base_model_prefix = "transformer"
