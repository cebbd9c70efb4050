"""DINOv2 with registers (``model_type: dinov2_with_registers``): DINOv2 with ``num_register_tokens`` learned tokens
after the CLS token, put in after the positions (which they have none of); the positions are resized with
antialiasing, and the classifier's mean is over the patch tokens only (``modeling_dinov2_with_registers``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.modeling import HeadPart, positional_order
from flodl_hf.core.registry import register
from flodl_hf.core.vision_layers import resized_positions
from flodl_hf.families.dinov2 import ClsAndMeanClassifier, Dinov2, Dinov2Config, Dinov2Embeddings, Dinov2Model


@dataclass
class Dinov2WithRegistersConfig(Dinov2Config):
    model_type: ClassVar[str] = "dinov2_with_registers"

    patch_size: int | list[int] = 16
    num_register_tokens: int = 4


class Dinov2WithRegistersEmbeddings(Dinov2Embeddings):
    """The mask token always present (the checkpoints carry it), put in with ``torch.where``; the registers
    after the positions."""

    def __init__(self, config: Dinov2WithRegistersConfig, use_mask_token: bool | None = None) -> None:
        super().__init__(config)
        if self.mask_token is None:
            self.mask_token = nn.Parameter(torch.zeros(1, config.hidden_size))
        self.register_tokens = nn.Parameter(torch.zeros(1, config.num_register_tokens, config.hidden_size))

    def positions(self, height: int, width: int) -> torch.Tensor:
        return resized_positions(self.position_embeddings, 1, height, width, self.patch_embeddings.patch_size,
                                 in_float32=True, antialias=True)

    def forward(self, pixel_values: torch.Tensor, bool_masked_pos: torch.Tensor | None = None,
                interpolate_pos_encoding: bool = True) -> torch.Tensor:
        height, width = pixel_values.shape[2:]
        patches = self.patch_embeddings(pixel_values)
        if bool_masked_pos is not None:
            patches = torch.where(bool_masked_pos.unsqueeze(-1), self.mask_token.to(patches.dtype).unsqueeze(0),
                                  patches)
        embeddings = torch.cat((self.cls_token.expand(patches.shape[0], -1, -1), patches), dim=1)
        embeddings = embeddings + self.positions(height, width)
        registers = self.register_tokens.expand(embeddings.shape[0], -1, -1)
        return self.dropout(torch.cat((embeddings[:, :1], registers, embeddings[:, 1:]), dim=1))


@positional_order("pixel_values", "bool_masked_pos", "attention_mask")
class Dinov2WithRegistersModel(Dinov2Model):
    embeddings_class = Dinov2WithRegistersEmbeddings


@register
class Dinov2WithRegisters(Dinov2):
    model_type = "dinov2_with_registers"
    arch = "Dinov2WithRegisters"
    prefix = "dinov2_with_registers"
    config_class = Dinov2WithRegistersConfig
    backbone_class = Dinov2WithRegistersModel

    @classmethod
    def image_classification_head(cls, config: Dinov2WithRegistersConfig) -> HeadPart:
        return ClsAndMeanClassifier(config, 1 + config.num_register_tokens)
