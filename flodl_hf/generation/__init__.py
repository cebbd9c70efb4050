"""Text generation with a decoder and its KV cache, as transformers' ``generate``: ``generate_ids`` (greedy, sampled,
beams, prompt lookup, assisted decoding), the settings it runs with, the records it returns, and the
``GenerationMixin`` a causal LM task model inherits. The one-liner over texts is ``flodl_hf.tasks.generate``.

Modules: ``settings`` (generation_config.json and the merged settings), ``processors`` (logits processors and
stopping criteria), ``decoding`` (the model's side of the loop, its caches), ``beam``, ``lookup`` and ``assisted``
(the decoding modes besides sampling), ``generate`` (``generate_ids``), ``mixin``.
"""

from __future__ import annotations

from flodl_hf.generation.generate import generate_ids
from flodl_hf.generation.mixin import GenerationMixin
from flodl_hf.generation.settings import (GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput, GenerationSettings,
                                          generation_settings, model_generation_config, read_generation_config)

__all__ = [
    "GenerateBeamDecoderOnlyOutput", "GenerateDecoderOnlyOutput", "GenerationMixin", "GenerationSettings",
    "generate_ids", "generation_settings", "model_generation_config", "read_generation_config",
]
