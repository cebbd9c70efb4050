"""Mistral (``model_type: mistral``): LLaMA with no biases, other defaults, and a sliding window on every
layer when ``sliding_window`` is set (``create_sliding_window_causal_mask``: each query sees itself and the
``sliding_window - 1`` tokens before it; the cache keeps ``sliding_window - 1`` tokens per layer, as
``DynamicSlidingWindowLayer``). Everything else is families/llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flodl_hf.core.registry import register

from .llama import DecoderForQuestionAnswering, Llama, LlamaConfig


@dataclass
class MistralConfig(LlamaConfig):
    model_type: ClassVar[str] = "mistral"
    returns_given_cache: ClassVar[bool] = False  # as its transformers *Model.forward

    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = 4096

    def biases(self) -> tuple[bool, bool, bool]:
        return False, False, False  # MistralAttention / MistralMLP: bias=False whatever the config says

    def window(self, kind: str) -> int | None:
        return self.sliding_window


@register
class Mistral(Llama):
    model_type = "mistral"
    arch = "Mistral"
    config_class = MistralConfig
    # MistralForQuestionAnswering keeps its backbone under "model": the generic QA task model
    task_models = {**Llama.task_models, "qa": DecoderForQuestionAnswering}
