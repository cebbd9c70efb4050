"""Gemma 3, text only (``model_type: gemma3_text``: ``Gemma3TextModel``, ``Gemma3ForCausalLM``,
``Gemma3TextForSequenceClassification``): Gemma 2's layer (four norms, ``query_pre_attn_scalar``, final logit
softcapping when set) with a ``(1 + weight)`` RMSNorm over each head of q and k (``q_norm``, ``k_norm``) before
RoPE, two RoPEs (full layers: ``rope_parameters["full_attention"]``, theta 1e6 by default; sliding layers:
``rope_parameters["sliding_attention"]``, theta 1e4; the older ``rope_theta``, ``rope_local_base_freq`` and
``rope_scaling`` spellings read as transformers reads them; ``linear`` scaling taken), five sliding layers to one
full by default (``layer_types``, else ``sliding_window_pattern``), and both attention paths. As in transformers
5.24, ``attn_logit_softcapping`` is not applied (``Gemma3Attention`` does not hand it to the attention). The
multimodal ``gemma3`` (vision tower) is another model_type and is not registered here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar


from flodl_hf.core.decoder import Rope
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.registry import register

from .gemma import GemmaRMSNorm
from .gemma2 import Gemma2, Gemma2Attention, Gemma2Config, Gemma2Model
from .llama import FULL, SLIDING, LlamaAttention, LlamaConfig


def rope_per_kind(config: Any, key: str | None, theta: Callable[[str], float]) -> Rope:
    """A RoPE per layer kind from ``rope_parameters`` keyed by kind (Gemma 3's and OLMo 3's
    ``convert_rope_params_to_dict``): a missing kind is default RoPE, ``rope_scaling`` updates the full layers'
    dict, a theta missing there is ``theta(kind)``. transformers' ``_compute_yarn_parameters`` reads ``truncate``
    from ``config.rope_parameters`` itself, which holds only the kinds' dicts: a nested truncate is never read, and
    yarn truncates. A flat or malformed dict is a ConfigError naming the field."""
    kind = key or FULL
    given = config.rope_parameters
    if given is not None and not (isinstance(given, dict) and set(given) <= {FULL, SLIDING}):
        raise ConfigError(f"config field rope_parameters={given!r}: expected one object per layer type "
                          f"({FULL}, {SLIDING})")
    params: Any = (given or {}).get(kind) or {"rope_type": "default"}
    if not isinstance(params, dict):
        raise ConfigError(f"config field rope_parameters.{kind}={params!r}: expected an object")
    params = dict(params)
    if kind == FULL and config.rope_scaling is not None:
        if not isinstance(config.rope_scaling, dict):
            raise ConfigError(f"config field rope_scaling={config.rope_scaling!r}: expected an object")
        params.update(config.rope_scaling)
    params.setdefault("rope_theta", theta(kind))
    params.pop("truncate", None)
    return Rope.resolve(params, None, None, config.default_theta, config.max_position_embeddings,
                        config.raw.get("original_max_position_embeddings"), config.rope_types)


@dataclass
class Gemma3TextConfig(Gemma2Config):
    model_type: ClassVar[str] = "gemma3_text"
    default_theta: ClassVar[float] = 1_000_000.0  # Gemma3TextConfig.default_theta["global"]
    default_local_theta: ClassVar[float] = 10_000.0  # and ["local"]

    vocab_size: int = 262_208
    max_position_embeddings: int = 131_072
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool | None = False
    rope_local_base_freq: float | None = None  # the older spelling of the sliding layers' theta
    sliding_window_pattern: int | None = None  # the older spelling of layer_types (6 when neither is given)

    def __post_init__(self) -> None:
        super().__post_init__()  # checks the full layers' RoPE (rope() with no key)
        self.rope(SLIDING)

    def layer_kinds(self) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        # Gemma3TextConfig.__post_init__: every sliding_window_pattern-th layer is full (the older int field)
        pattern = 6 if self.sliding_window_pattern is None else self.sliding_window_pattern  # > 0: the config table
        return [SLIDING if (i + 1) % pattern else FULL for i in range(self.num_hidden_layers)]

    def rope_key(self, kind: str) -> str | None:
        return kind

    def rope(self, key: str | None = None) -> Rope:
        """Gemma3TextConfig.convert_rope_params_to_dict: a dict per layer type (a missing one is default RoPE);
        ``rope_scaling`` updates the full layers' dict; a theta missing there is ``rope_theta`` (full) or
        ``rope_local_base_freq`` (sliding), else the defaults."""
        return rope_per_kind(self, key, self._kind_theta)

    def _kind_theta(self, kind: str) -> float:
        if kind == FULL:
            return self.default_theta if self.rope_theta is None else self.rope_theta
        return self.default_local_theta if self.rope_local_base_freq is None else self.rope_local_base_freq


class Gemma3Attention(Gemma2Attention):
    paths = LlamaAttention.paths  # Gemma3PreTrainedModel._supports_sdpa = True

    # Gemma3Attention.forward: q_norm and k_norm over each head, before RoPE (per row of head_dim, so the same bits
    # before or after transformers' transpose)
    qk_norm = GemmaRMSNorm

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.softcap = None  # Gemma3Attention.forward hands no softcap to the attention, whatever the config says


class Gemma3TextModel(Gemma2Model):
    attention_class = Gemma3Attention


@register
class Gemma3Text(Gemma2):
    model_type = "gemma3_text"
    arch = "Gemma3Text"
    config_class = Gemma3TextConfig
    backbone_class = Gemma3TextModel
    attn_implementations = Gemma3Attention.paths
    tasks = ("base", "causal_lm", "seqcls")  # Gemma3TextModel, Gemma3ForCausalLM, Gemma3TextForSequenceClassification

    @classmethod
    def architecture(cls, task: str) -> str:
        return "Gemma3ForCausalLM" if task == "causal_lm" else super().architecture(task)
