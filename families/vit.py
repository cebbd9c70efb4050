"""ViT (``model_type: vit``): patches of ``patch_size`` pixels, a CLS token, learned positions, pre-LN layers.

Module names are transformers 5's (``vit.layers.N.attention.q_proj``, ``mlp.fc1``); the files keep the older tree
(``vit.encoder.layer.N.attention.attention.query``, ``intermediate.dense``), which ``save_pretrained`` writes back:
``Vit.file_layout`` declares the renames of transformers' conversion mapping ("ViTModel"). The op order is
``transformers.models.vit.modeling_vit`` (flodl_hf.core.vision_layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.keys import FileLayout
from flodl_hf.core.modeling import positional_order
from flodl_hf.core.registry import Family, register
from flodl_hf.core.vision_layers import (PatchEmbeddings, PreNormLayer, VisionBackbone, VisionPooler, drawn_tokens,
                                         masked_patches, pair, resized_positions)
from flodl_hf.heads import ModelForImageClassification, ModelForMaskedImageModeling

# transformers' conversion mapping for ViTModel (and DeiTModel, which it maps to it): (file, module) fragments
VIT_RENAMES = (
    ("encoder.layer", "layers"),
    ("attention.attention.query", "attention.q_proj"),
    ("attention.attention.key", "attention.k_proj"),
    ("attention.attention.value", "attention.v_proj"),
    ("attention.output.dense", "attention.o_proj"),
    ("intermediate.dense", "mlp.fc1"),
    ("output.dense", "mlp.fc2"),
)

@dataclass
class ViTConfig(BaseConfig):
    model_type: ClassVar[str] = "vit"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation, "pooler_act": Activation}

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: Activation = Activation.GELU
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    layer_norm_eps: float = 1e-12
    image_size: int | list[int] = 224
    patch_size: int | list[int] = 16
    num_channels: int = 3
    qkv_bias: bool = True
    encoder_stride: int = 16
    pooler_output_size: int | None = None
    pooler_act: Activation = Activation.TANH

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config: hidden_size={self.hidden_size} is not a multiple of "
                              f"num_attention_heads={self.num_attention_heads}")
        image, patch = pair(self.image_size, "image_size"), pair(self.patch_size, "patch_size")
        if image[0] % patch[0] or image[1] % patch[1]:
            raise ConfigError(f"config: image_size={self.image_size} is not a whole number of "
                              f"patch_size={self.patch_size} patches")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

class ViTEmbeddings(nn.Module):
    """CLS token, patches (the masked ones replaced by ``mask_token``), then the positions, resized with
    ``interpolate_pos_encoding`` (ViTEmbeddings)."""

    special_tokens: ClassVar[int] = 1

    def __init__(self, config: ViTConfig, use_mask_token: bool = False) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size)) if use_mask_token else None
        self.patch_embeddings = PatchEmbeddings(config)
        self.position_embeddings = nn.Parameter(
            torch.zeros(1, self.patch_embeddings.num_patches + self.special_tokens, config.hidden_size))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.fresh_init = self.fresh_tokens(config)

    def fresh_tokens(self, config: ViTConfig) -> dict:
        """How a fresh model starts the tokens and positions (``layers.fresh_rule``; the mask token at zero)."""
        return drawn_tokens(config)

    def leading(self, batch: int) -> list[torch.Tensor]:
        """The tokens before the patches."""
        return [self.cls_token.expand(batch, -1, -1)]

    def forward(self, pixel_values: torch.Tensor, bool_masked_pos: torch.Tensor | None = None,
                interpolate_pos_encoding: bool = False) -> torch.Tensor:
        height, width = pixel_values.shape[2:]
        patches = masked_patches(self.patch_embeddings(pixel_values), bool_masked_pos, self.mask_token)
        embeddings = torch.cat((*self.leading(patches.shape[0]), patches), dim=1)
        if interpolate_pos_encoding:
            embeddings = embeddings + resized_positions(self.position_embeddings, self.special_tokens, height, width,
                                                        self.patch_embeddings.patch_size)
        else:
            embeddings = embeddings + self.position_embeddings
        return self.dropout(embeddings)

@positional_order("pixel_values", "bool_masked_pos", "interpolate_pos_encoding", "attention_mask")
class ViTModel(VisionBackbone):
    """The bare encoder: ``last_hidden_state`` (after the final LayerNorm) and, with the pooler, ``pooler_output``."""

    embeddings_class: ClassVar[type[nn.Module]] = ViTEmbeddings

    def __init__(self, config: ViTConfig, add_pooling_layer: bool = True, use_mask_token: bool = False) -> None:
        super().__init__(config)
        self.embeddings = self.embeddings_class(config, use_mask_token=use_mask_token)
        self.layers = nn.ModuleList(PreNormLayer(config) for _ in range(config.num_hidden_layers))
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.pooler = VisionPooler(config) if add_pooling_layer else None

@positional_order("pixel_values", "labels", "interpolate_pos_encoding", "attention_mask")
class ViTForImageClassification(ModelForImageClassification):
    """transformers' positional order (``labels`` second)."""

@positional_order("pixel_values", "bool_masked_pos", "interpolate_pos_encoding", "attention_mask")
class ViTForMaskedImageModeling(ModelForMaskedImageModeling):
    """transformers' positional order."""

@register
class Vit(Family):
    model_type = "vit"
    arch = "ViT"
    prefix = "vit"
    config_class = ViTConfig
    backbone_class = ViTModel
    tasks = ("base", "image_classification", "masked_image_modeling")
    task_models = {"image_classification": ViTForImageClassification,
                   "masked_image_modeling": ViTForMaskedImageModeling}
    file_layout = FileLayout(renames=VIT_RENAMES)
    num_items_tasks = frozenset({"image_classification"})
    special_tokens: ClassVar[int] = 1  # the tokens before the patches (the CLS token)
