"""DINOv2 (``model_type: dinov2``): ViT's tokens with layer scale, an optional SwiGLU MLP, stochastic depth, and
positions always resized to the image (patch 14; 518 pixels for the released checkpoints).

Module names are transformers 5's (``dinov2.encoder.layer.N.attention.q_proj``, ``mlp.gate_proj``); the files keep
``attention.attention.query`` and the fused SwiGLU ``mlp.weights_in`` / ``weights_out``, which ``Dinov2.file_layout``
maps both ways (transformers' conversion mapping, "Dinov2Model"). Op order: ``modeling_dinov2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.keys import FileLayout
from flodl_hf.core.modeling import HeadPart, positional_order
from flodl_hf.core.registry import Family, register
from flodl_hf.core.vision_layers import (PatchEmbeddings, VisionAttention, VisionBackbone, VisionMLP, drawn_tokens,
                                         masked_patches, pair, resized_positions)
from flodl_hf.heads import ModelForImageClassification

DINOV2_LAYOUT = FileLayout(
    renames=(("attention.attention.query", "attention.q_proj"), ("attention.attention.key", "attention.k_proj"),
             ("attention.attention.value", "attention.v_proj"), ("attention.output.dense", "attention.o_proj"),
             ("mlp.weights_out", "mlp.down_proj")),
    fused=(("mlp.weights_in", ("mlp.gate_proj", "mlp.up_proj")),))


@dataclass
class Dinov2Config(BaseConfig):
    model_type: ClassVar[str] = "dinov2"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation}

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    mlp_ratio: float = 4
    hidden_act: Activation = Activation.GELU
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    layer_norm_eps: float = 1e-6
    image_size: int | list[int] = 224
    patch_size: int | list[int] = 14
    num_channels: int = 3
    qkv_bias: bool = True
    layerscale_value: float = 1.0
    drop_path_rate: float = 0.0
    use_swiglu_ffn: bool = False
    use_mask_token: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config: hidden_size={self.hidden_size} is not a multiple of "
                              f"num_attention_heads={self.num_attention_heads}")
        pair(self.image_size, "image_size"), pair(self.patch_size, "patch_size")
        if not 0.0 <= self.drop_path_rate < 1.0:
            raise ConfigError(f"config field drop_path_rate={self.drop_path_rate}: expected a value in [0, 1)")

    @property
    def mlp_width(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


class Dinov2Embeddings(nn.Module):
    """CLS token, patches (masked ones replaced by a (1, hidden) ``mask_token``), positions resized to the image in
    float32 (Dinov2Embeddings)."""

    def __init__(self, config: Dinov2Config, use_mask_token: bool | None = None) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.mask_token = nn.Parameter(torch.zeros(1, config.hidden_size)) if config.use_mask_token else None
        self.patch_embeddings = PatchEmbeddings(config)
        self.position_embeddings = nn.Parameter(torch.zeros(1, self.patch_embeddings.num_patches + 1,
                                                            config.hidden_size))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.fresh_init = drawn_tokens(config)

    def positions(self, height: int, width: int) -> torch.Tensor:
        return resized_positions(self.position_embeddings, 1, height, width, self.patch_embeddings.patch_size,
                                 in_float32=True)

    def forward(self, pixel_values: torch.Tensor, bool_masked_pos: torch.Tensor | None = None,
                interpolate_pos_encoding: bool = True) -> torch.Tensor:
        height, width = pixel_values.shape[2:]
        patches = masked_patches(self.patch_embeddings(pixel_values), bool_masked_pos, self.mask_token)
        embeddings = torch.cat((self.cls_token.expand(patches.shape[0], -1, -1), patches), dim=1)
        return self.dropout(embeddings + self.positions(height, width))


class LayerScale(nn.Module):
    """``h * lambda1`` (Dinov2LayerScale)."""

    def __init__(self, config: Dinov2Config) -> None:
        super().__init__()
        self.lambda1 = nn.Parameter(config.layerscale_value * torch.ones(config.hidden_size))

        self.value = config.layerscale_value

    def init_fresh_weights(self, std: float) -> None:
        """A fresh model starts at ``layerscale_value`` (Dinov2PreTrainedModel._init_weights)."""
        self.lambda1.data.fill_(self.value)

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        return hidden_state * self.lambda1


class DropPath(nn.Module):
    """Stochastic depth per sample in training (Dinov2DropPath: ``h / keep * floor(rand + keep)``)."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return hidden_states
        keep = 1 - self.drop_prob
        shape = (hidden_states.shape[0],) + (1,) * (hidden_states.ndim - 1)
        draw = torch.floor(torch.rand(shape, dtype=hidden_states.dtype, device=hidden_states.device) + keep)
        return hidden_states.div(keep) * draw


class SwiGLUFFN(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` at two thirds of the MLP width rounded up to 8
    (Dinov2SwiGLUFFN; the files fuse gate and up as ``weights_in``)."""

    def __init__(self, config: Dinov2Config) -> None:
        super().__init__()
        width = (int(config.mlp_width * 2 / 3) + 7) // 8 * 8
        self.gate_proj = nn.Linear(config.hidden_size, width)
        self.up_proj = nn.Linear(config.hidden_size, width)
        self.down_proj = nn.Linear(width, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Dinov2Layer(nn.Module):
    """``x + drop_path(layer_scale1(attention(norm1(x))))``, then the same with ``norm2``, the MLP and
    ``layer_scale2`` (Dinov2Layer)."""

    def __init__(self, config: Dinov2Config) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = VisionAttention(config)
        self.layer_scale1 = LayerScale(config)
        self.drop_path = DropPath(config.drop_path_rate) if config.drop_path_rate > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SwiGLUFFN(config) if config.use_swiglu_ffn else VisionMLP(config, config.mlp_width)
        self.layer_scale2 = LayerScale(config)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        hidden_states = self.drop_path(self.layer_scale1(self.attention(self.norm1(hidden_states), mask))) \
            + hidden_states
        return self.drop_path(self.layer_scale2(self.mlp(self.norm2(hidden_states)))) + hidden_states


class Dinov2Encoder(nn.Module):
    def __init__(self, config: Dinov2Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Dinov2Layer(config) for _ in range(config.num_hidden_layers))


@positional_order("pixel_values", "bool_masked_pos", "attention_mask")
class Dinov2Model(VisionBackbone):
    """The bare encoder: ``last_hidden_state`` after the final LayerNorm; ``pooler_output`` is its CLS token."""

    input_names = ("pixel_values", "bool_masked_pos", "attention_mask")
    interpolates = True
    embeddings_class: ClassVar[type[nn.Module]] = Dinov2Embeddings

    def __init__(self, config: Dinov2Config, add_pooling_layer: bool = True, use_mask_token: bool = False) -> None:
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        self.encoder = Dinov2Encoder(config)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def layer_list(self) -> nn.ModuleList:
        return self.encoder.layer

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, 0, :]


class ClsAndMeanClassifier(HeadPart):
    """``classifier(cat(h[:, 0], h[:, first:].mean(1)))``: the CLS token beside the mean of the patch tokens
    (``first``: 1, or 1 + the register tokens)."""

    def __init__(self, config: Dinov2Config, first: int = 1) -> None:
        super().__init__()
        self.first = first
        self.classifier = nn.Linear(config.hidden_size * 2, config.num_labels)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        cls_token = hidden_states[:, 0]
        return self.classifier(torch.cat([cls_token, hidden_states[:, self.first:].mean(dim=1)], dim=1))


@positional_order("pixel_values", "labels", "attention_mask")
class Dinov2ForImageClassification(ModelForImageClassification):
    """transformers' positional order (no ``interpolate_pos_encoding``: DINOv2 always resizes)."""


@register
class Dinov2(Family):
    model_type = "dinov2"
    arch = "Dinov2"
    prefix = "dinov2"
    config_class = Dinov2Config
    backbone_class = Dinov2Model
    tasks = ("base", "image_classification")
    task_models = {"image_classification": Dinov2ForImageClassification}
    file_layout = DINOV2_LAYOUT
    num_items_tasks = frozenset({"image_classification"})
    special_tokens: ClassVar[int] = 1

    @classmethod
    def image_classification_head(cls, config: Dinov2Config) -> HeadPart:
        return ClsAndMeanClassifier(config, cls.special_tokens)
