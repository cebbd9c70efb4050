"""SigLIP (``model_type``: ``siglip``, ``siglip_text_model``, ``siglip_vision_model``): CLIP's towers, scored with
a sigmoid.

Mirrors ``transformers.models.siglip.modeling_siglip`` (5.25). What differs from CLIP (families/clip.py):
- each layer registers ``layer_norm1 self_attn layer_norm2 mlp`` (the order ``named_parameters`` follows);
- the text tower attends bidirectionally under the padding mask (``create_bidirectional_mask``), pools the *last*
  position (padding or not, as transformers does) and projects it with its own ``head`` (``projection_size``);
- the vision tower has no class token, a biased patch convolution, no ``pre_layrnorm``, ``post_layernorm`` on every
  position, and pools with ``head``, a multihead attention probe (``SiglipMultiheadAttentionPoolingHead``:
  ``nn.MultiheadAttention`` from a learned ``probe``, then ``h + mlp(layernorm(h))``), unless ``vision_use_head``
  is false (then ``pooler_output`` is None);
- ``SiglipModel`` has no projections: its scores are ``cos * exp(logit_scale) + logit_bias`` (norms by
  ``Tensor.norm``), and its loss the pairwise sigmoid loss (``-logsigmoid(±logits)``, summed per text, then the mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.layers import PADDING, build_mask
from flodl_hf.core.outputs import BaseModelOutput
from flodl_hf.core.registry import Task, register, register_task
from flodl_hf.families.clip import (CLIPMLP, CLIPAttention, CLIPEncoder, CLIPEncoderLayer, CLIPTextModel,
                                    CLIPVisionEmbeddings, DualConfig, DualEncoder, TowerFamily, TowerModel)


@dataclass
class SiglipTextConfig(BaseConfig):
    model_type: ClassVar[str] = "siglip_text_model"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation}

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 64
    hidden_act: Activation = Activation.GELU_PYTORCH_TANH
    layer_norm_eps: float = 1e-6
    attention_dropout: float = 0.0
    pad_token_id: int | None = 1
    bos_token_id: int | None = 49406
    eos_token_id: int | None = 49407
    projection_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.projection_size is None:  # SiglipTextConfig.__post_init__
            self.projection_size = self.hidden_size


@dataclass
class SiglipVisionConfig(BaseConfig):
    model_type: ClassVar[str] = "siglip_vision_model"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation}

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: Activation = Activation.GELU_PYTORCH_TANH
    layer_norm_eps: float = 1e-6
    attention_dropout: float = 0.0
    vision_use_head: bool = True


@dataclass
class SiglipConfig(DualConfig):
    model_type: ClassVar[str] = "siglip"
    text_class: ClassVar[type[BaseConfig]] = SiglipTextConfig
    vision_class: ClassVar[type[BaseConfig]] = SiglipVisionConfig


class SiglipEncoderLayer(CLIPEncoderLayer):
    module_order = ("layer_norm1", "self_attn", "layer_norm2", "mlp")


class SiglipEncoder(CLIPEncoder):
    layer_class = SiglipEncoderLayer


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module


def _fan_in_std(tensor: torch.Tensor) -> float:
    return math.sqrt(1.0 / nn.init._calculate_fan_in_and_fan_out(tensor)[0])


@torch.no_grad()
def siglip_fresh_weights(tower: nn.Module) -> None:
    """``SiglipPreTrainedModel._init_weights`` over a tower, children before their parent (``smart_apply``), so a
    parent's rule wins: xavier-uniform attention and MLP weights, the MLP biases normal(1e-6), embeddings
    normal(1 / sqrt(width)), other linear and convolution weights LeCun's truncated normal; norms as built."""
    for module in _children_first(tower):
        if isinstance(module, SiglipVisionEmbeddings):
            module.position_embedding.weight.normal_(std=module.config.hidden_size ** -0.5)
        elif isinstance(module, nn.Embedding):  # default_flax_embed_init_
            module.weight.normal_(std=_fan_in_std(module.weight))
        elif isinstance(module, CLIPAttention):
            for proj in (module.q_proj, module.k_proj, module.v_proj, module.out_proj):
                nn.init.xavier_uniform_(proj.weight)
                proj.bias.zero_()
        elif isinstance(module, CLIPMLP):
            for fc in (module.fc1, module.fc2):
                nn.init.xavier_uniform_(fc.weight)
                fc.bias.normal_(std=1e-6)
        elif isinstance(module, SiglipMultiheadAttentionPoolingHead):
            nn.init.xavier_uniform_(module.probe)
            nn.init.xavier_uniform_(module.attention.in_proj_weight)
            module.attention.in_proj_bias.zero_()
        elif isinstance(module, (nn.Linear, nn.Conv2d)):  # lecun_normal_: transformers' trunc_normal_ cuts at +-2
            nn.init.trunc_normal_(module.weight, std=_fan_in_std(module.weight) / 0.87962566103423978, a=-2.0, b=2.0)
            if module.bias is not None:
                module.bias.zero_()


class SiglipTextModel(CLIPTextModel):
    """``SiglipTextModel``: bidirectional, the last position through ``head``."""

    task = "text_model"  # its own task: transformers has no Auto class for it
    encoder_class = SiglipEncoder

    def __init__(self, config: SiglipTextConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.head = nn.Linear(config.hidden_size, config.projection_size)

    def init_fresh_weights(self, std: float) -> None:
        siglip_fresh_weights(self)

    def mask(self, attention_mask: torch.Tensor | None, hidden: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        return build_mask(attention_mask, PADDING, self.config.attn_implementation, hidden.dtype, hidden.shape[1],
                          hidden.device), False

    def pool_tokens(self, last: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(last[:, -1, :])


class SiglipVisionEmbeddings(CLIPVisionEmbeddings):
    class_token = False
    patch_bias = True
    exact_size = False


class SiglipMultiheadAttentionPoolingHead(nn.Module):
    """Attention pooling: the learned ``probe`` attends over every position (``nn.MultiheadAttention``, as
    transformers runs it), then ``h + mlp(layernorm(h))``; the probe's row."""

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, config.hidden_size))
        self.attention = nn.MultiheadAttention(config.hidden_size, config.num_attention_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        probe = self.probe.repeat(hidden_state.shape[0], 1, 1)
        hidden_state = self.attention(probe, hidden_state, hidden_state)[0]
        hidden_state = hidden_state + self.mlp(self.layernorm(hidden_state))
        return hidden_state[:, 0]


class SiglipVisionModel(TowerModel):
    """``SiglipVisionModel``: the patches through the layers and ``post_layernorm``; pooled by ``head``."""

    input_names = ("pixel_values", "interpolate_pos_encoding")

    def __init__(self, config: SiglipVisionConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if config.vision_use_head:
            self.head = SiglipMultiheadAttentionPoolingHead(config)

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embedding

    def init_fresh_weights(self, std: float) -> None:
        siglip_fresh_weights(self)

    def forward(self, pixel_values: torch.Tensor | None = None,
                interpolate_pos_encoding: bool = False) -> BaseModelOutput:
        last = self.post_layernorm(self.encoder(self.embeddings(pixel_values, interpolate_pos_encoding), None))
        return BaseModelOutput(last_hidden_state=last,
                               pooler_output=self.head(last) if self.config.vision_use_head else None)


class SiglipModel(DualEncoder):
    """``SiglipModel``: ``logit_scale`` and ``logit_bias`` (one value each) on the towers' own pooled states."""

    text_model_class = SiglipTextModel
    vision_model_class = SiglipVisionModel

    def __init__(self, config: SiglipConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.logit_scale = nn.Parameter(torch.empty(1))  # fresh: zero, as transformers starts them
        self.logit_bias = nn.Parameter(torch.empty(1))

    @staticmethod
    def norm(features: torch.Tensor) -> torch.Tensor:
        return features.norm(p=2, dim=-1, keepdim=True)

    def scores(self, cosine: torch.Tensor) -> torch.Tensor:
        return cosine * self.logit_scale.exp() + self.logit_bias

    def loss(self, logits_per_text: torch.Tensor) -> torch.Tensor:
        """big_vision's sigmoid loss, as ``SiglipModel.forward`` writes it: +1 on the diagonal, -1 elsewhere."""
        eye = torch.eye(logits_per_text.size(0), device=logits_per_text.device)
        signs = -torch.ones_like(logits_per_text) + 2 * eye
        return (-torch.sum(F.logsigmoid(signs * logits_per_text), dim=-1)).mean()


# transformers has no Auto class for SigLIP's text tower: its class, named here, is the reference.
TEXT_MODEL = register_task(Task(
    "text_model", "TextModel", "SiglipTextModel", "", BaseModelOutput, None, None, None, core=False,
    classes=(("siglip_text_model", "SiglipTextModel"),)))


@register
class SiglipText(TowerFamily):
    model_type = "siglip_text_model"
    arch = "Siglip"
    prefix = "text_model"
    config_class = SiglipTextConfig
    backbone_class = SiglipTextModel
    tasks = (TEXT_MODEL.name,)
    modalities = ("text",)


@register
class SiglipVision(TowerFamily):
    model_type = "siglip_vision_model"
    arch = "SiglipVision"
    prefix = "vision_model"
    config_class = SiglipVisionConfig
    backbone_class = SiglipVisionModel
    modalities = ("image",)


@register
class Siglip(TowerFamily):
    model_type = "siglip"
    arch = "Siglip"
    prefix = "siglip"
    config_class = SiglipConfig
    backbone_class = SiglipModel
