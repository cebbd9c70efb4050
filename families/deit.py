"""DeiT (``model_type: deit``): ViT with a distillation token after the CLS token (two leading tokens, two
leading position rows), and ``DeiTForImageClassificationWithTeacher``: a classifier on each of the two tokens,
the logits their mean (``modeling_deit``). Files and modules are named as ViT's (the same conversion mapping)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.modeling import HeadPart, TaskModel, positional_order
from flodl_hf.core.outputs import ModelOutput
from flodl_hf.core.registry import Task, register, register_task, register_task_model
from flodl_hf.families.vit import (ViTConfig, ViTEmbeddings, ViTForImageClassification, ViTForMaskedImageModeling,
                                   ViTModel, Vit)


@dataclass
class DeiTConfig(ViTConfig):
    model_type: ClassVar[str] = "deit"


class DeiTEmbeddings(ViTEmbeddings):
    """ViT's, with ``distillation_token`` after the CLS token (registered after the positions, as transformers)."""

    special_tokens: ClassVar[int] = 2

    def __init__(self, config: DeiTConfig, use_mask_token: bool = False) -> None:
        super().__init__(config, use_mask_token)
        self.distillation_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))

    def fresh_tokens(self, config: DeiTConfig) -> dict:
        """Every token and the positions at zero (DeiT's _init_weights zeroes them after ViT's draws)."""
        return {}

    def leading(self, batch: int) -> list[torch.Tensor]:
        return [self.cls_token.expand(batch, -1, -1), self.distillation_token.expand(batch, -1, -1)]


@positional_order("pixel_values", "bool_masked_pos", "interpolate_pos_encoding", "attention_mask")
class DeiTModel(ViTModel):
    embeddings_class = DeiTEmbeddings


@dataclass
class DeiTForImageClassificationWithTeacherOutput(ModelOutput):
    logits: torch.Tensor | None = None
    cls_logits: torch.Tensor | None = None
    distillation_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class TeacherHeads(HeadPart):
    """``cls_classifier(h[:, 0])`` and ``distillation_classifier(h[:, 1])``."""

    def __init__(self, config: DeiTConfig) -> None:
        super().__init__()
        self.cls_classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.distillation_classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cls_classifier(hidden_states[:, 0, :]), self.distillation_classifier(hidden_states[:, 1, :])


@register_task_model
class DeiTForImageClassificationWithTeacher(TaskModel):
    """Inference only, as transformers' (no labels): ``logits`` is ``(cls_logits + distillation_logits) / 2``."""

    task = "image_classification_teacher"

    def forward(self, pixel_values: torch.Tensor | None = None, interpolate_pos_encoding: bool = False,
                attention_mask: torch.Tensor | None = None) -> DeiTForImageClassificationWithTeacherOutput:
        out = self.run_backbone(pixel_values=pixel_values, interpolate_pos_encoding=interpolate_pos_encoding,
                                attention_mask=attention_mask)
        cls_logits, distillation_logits = self.head(out.last_hidden_state, None, attention_mask)
        return DeiTForImageClassificationWithTeacherOutput(logits=(cls_logits + distillation_logits) / 2,
                                                           cls_logits=cls_logits,
                                                           distillation_logits=distillation_logits)


TEACHER = register_task(Task(
    "image_classification_teacher", "ForImageClassificationWithTeacher", "DeiTForImageClassificationWithTeacher", "",
    DeiTForImageClassificationWithTeacherOutput, "teacher_head",
    "flodl_hf.families.deit:DeiTForImageClassificationWithTeacher", None, core=False,
    classes=(("deit", "DeiTForImageClassificationWithTeacher"),)))


@register
class DeiT(Vit):
    model_type = "deit"
    arch = "DeiT"
    prefix = "deit"
    config_class = DeiTConfig
    backbone_class = DeiTModel
    tasks = ("base", "image_classification", "image_classification_teacher", "masked_image_modeling")
    task_models = {"image_classification": ViTForImageClassification,
                   "masked_image_modeling": ViTForMaskedImageModeling}
    special_tokens: ClassVar[int] = 2  # the CLS and distillation tokens

    @classmethod
    def task_for(cls, task: str, config: DeiTConfig) -> str:
        """A checkpoint saved as DeiTForImageClassificationWithTeacher runs as it under image_classification, as
        transformers' AutoModelForImageClassification picks it by ``architectures``."""
        teacher = (config.architectures or [None])[0] == cls.architecture(TEACHER.name)
        return TEACHER.name if task == "image_classification" and teacher else task

    @classmethod
    def teacher_head(cls, config: DeiTConfig) -> HeadPart:
        return TeacherHeads(config)
