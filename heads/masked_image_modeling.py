"""Masked image modeling (SimMIM, ``ViTForMaskedImageModeling``): the patch tokens -> the image's pixels.

The backbone is built with its mask token (``bool_masked_pos`` replaces those patches by it); the decoder is a
1x1 convolution to ``encoder_stride ** 2 * num_channels`` maps and a pixel shuffle, on the patch tokens laid out
as their grid (the family's ``special_tokens`` leading tokens dropped). The loss is SimMIM's L1 over the masked
pixels (``losses.masked_image_loss``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from flodl_hf.core.errors import InputError
from flodl_hf.core.modeling import HeadPart, TaskModel
from flodl_hf.core.outputs import MaskedImageModelingOutput
from flodl_hf.core.registry import register_task_model


class PixelDecoder(HeadPart):
    """``decoder(grid(h[:, special:]))``: ``decoder`` is ``Sequential(Conv2d(hidden, stride² · channels, 1),
    PixelShuffle(stride))``, as transformers names it (``decoder.0``)."""

    backbone_options = {"use_mask_token": True}

    def __init__(self, config, special: int) -> None:
        super().__init__()
        self.special = special
        stride = config.encoder_stride
        self.decoder = nn.Sequential(nn.Conv2d(config.hidden_size, stride ** 2 * config.num_channels, kernel_size=1),
                                     nn.PixelShuffle(stride))
        self.decoder[0].fresh_init = {"weight": "normal"}  # transformers' _init_weights draws a Conv2d's weight

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        patches = hidden_states[:, self.special:]
        batch, length, channels = patches.shape
        side = math.floor(length ** 0.5)
        return self.decoder(patches.permute(0, 2, 1).reshape(batch, channels, side, side))


@register_task_model
class ModelForMaskedImageModeling(TaskModel):
    task = "masked_image_modeling"

    @classmethod
    def default_head(cls, family, config) -> HeadPart:
        """The SimMIM decoder after the family's special tokens (ViT: the CLS token; DeiT: CLS and distillation)."""
        return PixelDecoder(config, family.special_tokens)

    def forward(self, pixel_values: torch.Tensor | None = None, bool_masked_pos: torch.Tensor | None = None,
                interpolate_pos_encoding: bool | None = None, attention_mask: torch.Tensor | None = None, *,
                num_items_in_batch: torch.Tensor | int | None = None) -> MaskedImageModelingOutput:
        """``reconstruction``; with ``bool_masked_pos``, the L1 loss over the masked patches (which needs
        ``patch_size == encoder_stride``, as transformers checks)."""
        config = self.config
        if bool_masked_pos is not None and config.patch_size != config.encoder_stride:
            raise InputError(f"bool_masked_pos: patch_size ({config.patch_size}) must equal encoder_stride "
                             f"({config.encoder_stride}) for the rebuilt image to have the input's size")
        out = self.run_backbone(pixel_values=pixel_values, bool_masked_pos=bool_masked_pos,
                                interpolate_pos_encoding=interpolate_pos_encoding, attention_mask=attention_mask)
        reconstruction = self.head(out.last_hidden_state, None, attention_mask)
        loss = None
        if bool_masked_pos is not None:
            loss = self.compute_loss(reconstruction, pixel_values=pixel_values, bool_masked_pos=bool_masked_pos,
                                     num_items_in_batch=num_items_in_batch)
        return MaskedImageModelingOutput(loss=loss, reconstruction=reconstruction)
