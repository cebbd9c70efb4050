"""OLMo 3 (``model_type: olmo3``): OLMo 2 (post-norm layers, q/k RMSNorms over the whole projections, float32
cos and sin) with sliding and full layers and a RoPE per layer kind.

Mirrors ``transformers.models.olmo3`` (5.25):
- layer kinds: ``layer_types`` when given, else three sliding layers to one full (``Olmo3Config.__post_init__``:
  layer ``i`` is full when ``(i + 1) % 4 == 0``); sliding layers see a window of ``sliding_window`` tokens (mask and
  cache as Mistral's). ``Olmo3Model.forward`` builds the sliding mask for every config, and
  ``create_sliding_window_causal_mask`` raises without a window, so a null ``sliding_window`` is a ConfigError;
- RoPE per layer kind (``Olmo3RotaryEmbedding``, ``Olmo3Config.convert_rope_params_to_dict``):
  ``rope_parameters`` holds one dict per layer kind (a missing one is default RoPE); the older ``rope_scaling``
  updates the full layers' dict only; a theta missing in a dict is the top-level ``rope_theta`` for the full layers
  and the default (500000) for the sliding ones (transformers pops ``rope_theta`` for the full layers, so the
  sliding layers' lookup finds it gone). A flat ``rope_parameters`` (not keyed by layer kind) is a ConfigError:
  transformers would keep the per-kind defaults and ignore it;
- the backbone returns a given cache whatever ``use_cache`` says (``Olmo3Model.forward`` returns ``cache``), as
  OLMo 2's; heads: causal_lm and seqcls (transformers has no other).
Everything else is families/olmo2.py and families/llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flodl_hf.core.decoder import Rope
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.registry import register

from .llama import FULL, SLIDING
from .gemma3_text import rope_per_kind
from .olmo2 import Olmo2, Olmo2Config, Olmo2Model


@dataclass
class Olmo3Config(Olmo2Config):
    model_type: ClassVar[str] = "olmo3"
    default_theta: ClassVar[float] = 500_000.0  # Olmo3Config.default_theta, for both layer kinds

    sliding_window: int | None = 4096
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is None:
            raise ConfigError("config field sliding_window=None: transformers' Olmo3Model builds a sliding mask "
                              "for every config and create_sliding_window_causal_mask raises without one")
        super().__post_init__()  # checks layer_types and the full layers' RoPE (rope() with no key)
        self.rope(SLIDING)

    def layer_kinds(self) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        return [SLIDING if (i + 1) % 4 else FULL for i in range(self.num_hidden_layers)]

    def window(self, kind: str) -> int | None:
        return self.sliding_window if kind == SLIDING else None

    def rope_key(self, kind: str) -> str | None:
        return kind

    def rope(self, key: str | None = None) -> Rope:
        # Olmo3Config.convert_rope_params_to_dict, as Gemma 3's: a missing theta is rope_theta on the full layers
        # only (it is popped before the sliding layers read it), else the default
        return rope_per_kind(self, key, lambda kind: self.rope_theta if kind == FULL and self.rope_theta is not None
                             else self.default_theta)


class Olmo3Model(Olmo2Model):
    pass  # the layer kinds' masks, caches and RoPEs come from the config's layer_kinds / window / rope_key


@register
class Olmo3(Olmo2):
    model_type = "olmo3"
    arch = "Olmo3"
    config_class = Olmo3Config
    backbone_class = Olmo3Model
