"""RoBERTa (``model_type: roberta``): BERT with other position ids and other heads.

Mirrors ``transformers.models.roberta.modeling_roberta``: positions count non-pad
tokens from ``padding_idx + 1``; sequence classification is ``classifier.dense`` +
tanh + ``classifier.out_proj`` on the first token (no pooler); the masked-LM head
is ``lm_head`` with GELU whatever ``hidden_act`` says. CamemBERT and XLM-RoBERTa
register this family under their own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.families.bert import Bert, BertConfig, BertEmbeddings, BertForMaskedLM, BertModel
from flodl_hf.heads import ModelForMultipleChoice
from flodl_hf.core.modeling import HeadPart, mount_last, positional_order
from flodl_hf.core.registry import register


@dataclass
class RobertaConfig(BertConfig):
    model_type: ClassVar[str] = "roberta"

    vocab_size: int = 50265
    pad_token_id: int | None = 1


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, config: RobertaConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                padding_idx=config.pad_token_id)
        mount_last(self, "position_embeddings")  # transformers registers it last (after LayerNorm)

    def position_ids(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor) -> torch.Tensor:
        pad = self.padding_idx
        if input_ids is None:
            # create_position_ids_from_inputs_embeds: padding is unknown, so sequential from pad + 1
            length = inputs_embeds.shape[1]
            positions = torch.arange(pad + 1, length + pad + 1, dtype=torch.long, device=inputs_embeds.device)
            return positions.unsqueeze(0).expand(inputs_embeds.shape[:-1])
        # create_position_ids_from_input_ids: pad tokens keep padding_idx, the others count from pad + 1
        mask = input_ids.ne(pad).int()
        return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + pad


class RobertaModel(BertModel):
    embeddings_class = RobertaEmbeddings


class RobertaClassificationHead(nn.Module):
    """``out_proj(dropout(tanh(dense(dropout(h[:, 0])))))``; ELECTRA's differs only in ``activation``."""

    activation = staticmethod(torch.tanh)

    def __init__(self, config: RobertaConfig, dropout: float) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.dropout(hidden_states[:, 0, :])
        x = self.activation(self.dense(x))
        return self.out_proj(self.dropout(x))


class RobertaSequenceHead(HeadPart):
    """Mounts ``classifier.{dense,out_proj}`` at the root of the sequence-classification model."""

    head_class: ClassVar[type[nn.Module]] = RobertaClassificationHead

    def __init__(self, config: RobertaConfig, dropout: float) -> None:
        super().__init__()
        self.classifier = self.head_class(config, dropout)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.classifier(hidden_states)


class RobertaLMHead(nn.Module):
    """dense, GELU (always: HF calls ``gelu`` directly), ``layer_norm``, ``decoder``."""

    def __init__(self, config: RobertaConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        # HF ties decoder.bias to lm_head.bias only with tie_word_embeddings; untied, lm_head.bias is
        # a separate tensor that the forward never reads (and the file holds both).
        self.bias = self.decoder.bias if config.tie_word_embeddings else nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(F.gelu(self.dense(hidden_states))))


class RobertaMLMHead(HeadPart):
    """Mounts ``lm_head.*`` at the root of the masked-LM model."""

    def __init__(self, config: RobertaConfig) -> None:
        super().__init__()
        self.lm_head = RobertaLMHead(config)

    def output_embeddings(self) -> nn.Module:
        return self.lm_head.decoder

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden_states)


@positional_order("input_ids", "token_type_ids", "attention_mask", "labels", "position_ids", "inputs_embeds")
class RobertaForMultipleChoice(ModelForMultipleChoice):
    """The shared multiple-choice model in transformers' positional order for RoBERTa's (and CamemBERT's and
    XLM-R's): token types second, labels fourth."""


@register
class Roberta(Bert):
    model_type = "roberta"
    arch = "Roberta"
    prefix = "roberta"
    config_class = RobertaConfig
    backbone_class = RobertaModel
    task_models = {"mlm": BertForMaskedLM, "mc": RobertaForMultipleChoice}

    @classmethod
    def max_sequence_length(cls, config: RobertaConfig) -> int:
        # positions count from pad_token_id + 1, so the table holds that many fewer tokens
        return config.max_position_embeddings - config.pad_token_id - 1

    @classmethod
    def sequence_head(cls, config: RobertaConfig) -> HeadPart:
        return RobertaSequenceHead(config, cls.classifier_dropout(config))

    @classmethod
    def multiple_choice_head(cls, config: RobertaConfig) -> HeadPart:
        from flodl_hf.heads import PooledClassifier
        # RobertaForMultipleChoice drops out with hidden_dropout_prob, ignoring classifier_dropout.
        return PooledClassifier(config.hidden_size, 1, config.hidden_dropout_prob)

    @classmethod
    def lm_head(cls, config: RobertaConfig) -> HeadPart:
        return RobertaMLMHead(config)
