"""Qwen2 (``model_type: qwen2``): LLaMA with a bias on q, k and v (none on o_proj or the MLP), other
defaults, and optional sliding layers: with ``use_sliding_window``, the layers from ``max_window_layers``
on (or those ``layer_types`` names ``sliding_attention``) see a window of ``sliding_window`` tokens, as
Mistral's. Everything else is families/llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flodl_hf.core.registry import register

from .llama import FULL, SLIDING, Llama, LlamaConfig


@dataclass
class Qwen2Config(LlamaConfig):
    model_type: ClassVar[str] = "qwen2"
    returns_given_cache: ClassVar[bool] = False  # as its transformers *Model.forward

    vocab_size: int = 151936
    intermediate_size: int = 22016
    num_key_value_heads: int | None = 32
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    def biases(self) -> tuple[bool, bool, bool]:
        return True, False, False  # Qwen2Attention: q/k/v with bias, o_proj without; Qwen2MLP without

    def effective_window(self) -> int | None:
        """Qwen2Config.__post_init__: the window only with ``use_sliding_window``."""
        return self.sliding_window if self.use_sliding_window else None

    def layer_kinds(self) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        window = self.effective_window()
        return [SLIDING if window is not None and i >= self.max_window_layers else FULL
                for i in range(self.num_hidden_layers)]

    def window(self, kind: str) -> int | None:
        return self.effective_window() if kind == SLIDING else None


@register
class Qwen2(Llama):
    model_type = "qwen2"
    arch = "Qwen2"
    config_class = Qwen2Config
