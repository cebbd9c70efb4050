"""Output records with transformers' field names (``last_hidden_state``, ``logits``, ...).

Each record ends, as transformers' do, with ``hidden_states`` and ``attentions``: None unless the call asked
for them (``output_hidden_states=True``, ``output_attentions=True``), and None fields are skipped by
``keys()`` and ``to_tuple()``, so a plain call's tuple is unchanged. The backbones whose transformers model can
also be built as a decoder with cross-attention (BERT, RoBERTa and its aliases, ELECTRA) end theirs with
``cross_attentions`` as well (:class:`BaseModelOutputWithPoolingAndCrossAttentions`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator

import torch


class ModelOutput:
    """Attribute, key and index access, as transformers' ModelOutput offers; None fields are skipped."""

    @property
    def past_key_values(self) -> Any:
        """transformers' older name of ``cache`` (renamed in transformers 5.24, which keeps this alias)."""
        if "cache" not in {f.name for f in fields(self)}:
            raise AttributeError(f"{type(self).__name__} has no past_key_values (no cache field)")
        return self.cache

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((k, getattr(self, k)) for k in self.keys())

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, k) for k in self.keys())

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """``dict.get``, as transformers' ModelOutput (an OrderedDict) has it: a None field counts as absent."""
        return getattr(self, key) if key in self.keys() else default

    def values(self) -> Iterator[Any]:
        return (getattr(self, k) for k in self.keys())

    def __contains__(self, key: str) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())


@dataclass
class BaseModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class BaseModelOutputWithPoolingAndCrossAttentions(BaseModelOutput):
    """transformers' record of the BERT-lineage backbones (``_can_record_outputs`` names a cross-attention module):
    ``cross_attentions`` is recorded whenever ``attentions`` are, and an encoder's layers have none, so it is
    ``()`` with ``output_attentions=True`` and None otherwise."""

    cross_attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class SequenceClassifierOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class TokenClassifierOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class MaskedLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class MultipleChoiceModelOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class QuestionAnsweringModelOutput(ModelOutput):
    loss: torch.Tensor | None = None
    start_logits: torch.Tensor | None = None
    end_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class BaseModelOutputWithPast(ModelOutput):
    """A decoder backbone's output: ``cache`` is the KV cache after this step (None without one);
    transformers' order: the cache before ``hidden_states``."""

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor | None = None
    cache: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class CausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class SequenceClassifierOutputWithPast(ModelOutput):
    """A decoder's sequence classification: the KV cache after the step, when ``use_cache``, before
    ``hidden_states`` as transformers orders it."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class ImageClassifierOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class MaskedImageModelingOutput(ModelOutput):
    """The pixels rebuilt from the patches (``reconstruction``: (batch, channels, height, width)); ``loss`` with
    ``bool_masked_pos``."""

    loss: torch.Tensor | None = None
    reconstruction: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
