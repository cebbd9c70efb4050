"""ELECTRA (``model_type: electra``): BERT's encoder behind embeddings of width ``embedding_size``.

Mirrors ``transformers.models.electra.modeling_electra``. What differs from BERT:
- the embeddings live in ``embedding_size`` and ``embeddings_project`` maps them to
  ``hidden_size`` when the two differ (``ElectraModel.forward``); there is no pooler;
- ``pretraining`` is the replaced-token discriminator (``ElectraForPreTraining``), a task
  this family adds to the registry: ``discriminator_predictions`` gives one logit per token,
  and the loss is BCE over the tokens the attention mask marks active;
- the masked LM is the generator: ``generator_predictions`` (H -> E, GELU, LayerNorm) and
  ``generator_lm_head`` (E -> vocabulary, tied to the word embeddings);
- sequence classification is RoBERTa's head with GELU instead of tanh; multiple choice
  runs ``sequence_summary`` (``ElectraSequenceSummary``) before its classifier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import Activation
from flodl_hf.core.errors import ConfigError
from flodl_hf.families.bert import Bert, BertConfig, BertEmbeddings, BertModel
from flodl_hf.families.roberta import RobertaClassificationHead, RobertaSequenceHead
from flodl_hf.heads.multiple_choice import SequenceSummary
from flodl_hf.core.layers import activation
from flodl_hf.core.modeling import HeadPart, TaskModel, mount_last
from flodl_hf.core.outputs import ModelOutput
from flodl_hf.core.registry import register
from flodl_hf.core.registry import Task, register_task, register_task_model

SUMMARY_TYPES = ("first", "last", "mean", "cls_index")


@dataclass
class ElectraConfig(BertConfig):
    model_type: ClassVar[str] = "electra"

    embedding_size: int = 128
    hidden_size: int = 256
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    summary_type: str = "first"
    summary_use_proj: bool = True
    summary_activation: str | None = "gelu"
    summary_last_dropout: float = 0.1
    # Not in transformers' ElectraConfig; its SequenceSummary reads them when a config.json has them.
    summary_first_dropout: float = 0.0
    summary_proj_to_labels: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.summary_type not in SUMMARY_TYPES:
            raise ConfigError(f"config: summary_type={self.summary_type!r} is not supported "
                              f"(known: {', '.join(SUMMARY_TYPES)})")
        if self.summary_activation is not None:
            Activation.parse(self.summary_activation, "summary_activation")


class ElectraEmbeddings(BertEmbeddings):
    def __init__(self, config: ElectraConfig) -> None:
        super().__init__(config, width=config.embedding_size)


class ElectraModel(BertModel):
    """BERT's encoder; the embeddings are projected to hidden_size when their width differs."""

    embeddings_class = ElectraEmbeddings

    def __init__(self, config: ElectraConfig, add_pooling_layer: bool = False) -> None:
        super().__init__(config, add_pooling_layer=False)  # ELECTRA has no pooler
        if config.embedding_size != config.hidden_size:
            self.embeddings_project = nn.Linear(config.embedding_size, config.hidden_size)
            mount_last(self, "encoder")  # transformers' order: embeddings, embeddings_project, encoder

    def embed(self, **inputs: torch.Tensor | None) -> torch.Tensor:
        hidden = super().embed(**inputs)
        if hasattr(self, "embeddings_project"):  # ElectraModel.forward: project after the embeddings' LayerNorm
            hidden = self.embeddings_project(hidden)
        return hidden


# ---- heads ------------------------------------------------------------------------------------------

class ElectraClassificationHead(RobertaClassificationHead):
    """RoBERTa's ``classifier.dense/out_proj`` with GELU (``ElectraClassificationHead``)."""

    activation = staticmethod(F.gelu)


class ElectraSequenceHead(RobertaSequenceHead):
    head_class = ElectraClassificationHead


class ElectraChoiceHead(HeadPart):
    """Mounts ``sequence_summary`` and ``classifier`` (hidden -> 1) at the root."""

    def __init__(self, config: ElectraConfig) -> None:
        super().__init__()
        self.sequence_summary = SequenceSummary(config, config.num_labels)  # ElectraSequenceSummary
        self.classifier = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # ElectraForMultipleChoice.forward: sequence_summary, then classifier
        return self.classifier(self.sequence_summary(hidden_states))


class ElectraGeneratorPredictions(nn.Module):
    """dense (H -> E), GELU (always), LayerNorm(E): ElectraGeneratorPredictions.forward's order."""

    def __init__(self, config: ElectraConfig) -> None:
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.dense = nn.Linear(config.hidden_size, config.embedding_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(hidden_states)))


class ElectraGeneratorHead(HeadPart):
    """The generator: mounts ``generator_predictions`` and ``generator_lm_head`` (tied) at the root."""

    def __init__(self, config: ElectraConfig) -> None:
        super().__init__()
        self.generator_predictions = ElectraGeneratorPredictions(config)
        self.generator_lm_head = nn.Linear(config.embedding_size, config.vocab_size)

    def output_embeddings(self) -> nn.Module:
        return self.generator_lm_head

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # ElectraForMaskedLM.forward: generator_predictions, then generator_lm_head
        return self.generator_lm_head(self.generator_predictions(hidden_states))


class ElectraDiscriminatorPredictions(nn.Module):
    """dense, ``hidden_act``, ``dense_prediction`` (H -> 1), squeezed to one logit per token
    (ElectraDiscriminatorPredictions.forward)."""

    def __init__(self, config: ElectraConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = activation(config.hidden_act)
        self.dense_prediction = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dense_prediction(self.activation(self.dense(hidden_states))).squeeze(-1)


class ElectraDiscriminatorHead(HeadPart):
    def __init__(self, config: ElectraConfig) -> None:
        super().__init__()
        self.discriminator_predictions = ElectraDiscriminatorPredictions(config)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.discriminator_predictions(hidden_states)


# ---- the pretraining task ---------------------------------------------------------------------------

@dataclass
class PreTrainingOutput(ModelOutput):
    """``ElectraForPreTrainingOutput``: one replaced-token logit per token, (B, S)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


def replaced_token_loss(model: TaskModel, logits: torch.Tensor, labels: torch.Tensor,
                        attention_mask: torch.Tensor | None = None, num_items_in_batch: Any = None) -> torch.Tensor:
    """BCE with logits over the active tokens (``attention_mask == 1``), as ElectraForPreTraining.forward
    (whose ``BCEWithLogitsLoss`` ignores ``num_items_in_batch``, as this does)."""
    length = logits.shape[1]
    labels = labels.to(logits.device)
    if attention_mask is not None:
        active = attention_mask.view(-1, length) == 1
        return F.binary_cross_entropy_with_logits(logits.view(-1, length)[active], labels[active].float())
    return F.binary_cross_entropy_with_logits(logits.view(-1, length), labels.float())


@register_task_model
class ElectraForPreTraining(TaskModel):
    """The discriminator: is each token the original (0) or a generator's replacement (1)?"""

    task = "pretraining"

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                num_items_in_batch: torch.Tensor | int | None = None) -> PreTrainingOutput:
        out = self.run_backbone(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                position_ids=position_ids, inputs_embeds=inputs_embeds)
        logits = self.head(out.last_hidden_state, None, attention_mask)
        loss = None
        if labels is not None:
            loss = self.compute_loss(logits, labels=labels, attention_mask=attention_mask,
                                     num_items_in_batch=num_items_in_batch)
        return PreTrainingOutput(loss=loss, logits=logits)


PRETRAINING = register_task(Task(
    "pretraining", "ForPreTraining", "AutoModelForPreTraining", "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
    PreTrainingOutput, "discriminator_head", "flodl_hf.families.electra:ElectraForPreTraining",
    replaced_token_loss, core=False))


@register
class Electra(Bert):
    model_type = "electra"
    arch = "Electra"
    prefix = "electra"
    config_class = ElectraConfig
    backbone_class = ElectraModel
    tasks = (*Bert.tasks, PRETRAINING.name)
    task_models = {}  # not BERT's masked LM: transformers' ELECTRA takes labels sixth, as the shared head

    @classmethod
    def sequence_head(cls, config: ElectraConfig) -> HeadPart:
        return ElectraSequenceHead(config, cls.classifier_dropout(config))

    @classmethod
    def multiple_choice_head(cls, config: ElectraConfig) -> HeadPart:
        return ElectraChoiceHead(config)

    @classmethod
    def lm_head(cls, config: ElectraConfig) -> HeadPart:
        return ElectraGeneratorHead(config)

    @classmethod
    def discriminator_head(cls, config: ElectraConfig) -> HeadPart:
        return ElectraDiscriminatorHead(config)
