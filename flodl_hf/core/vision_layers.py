"""The vision transformers' shared parts: pixel inputs checked, patch embeddings, position tables resized to another
image size, the pre-LN encoder layer, and ``VisionBackbone``, a backbone whose input is ``pixel_values``.

Names and op order follow transformers' ViT (``transformers.models.vit.modeling_vit``, 5.25): the patches are a
``Conv2d`` of stride and kernel ``patch_size``, flattened and transposed; the attention is ``q_proj k_proj v_proj``
and ``o_proj`` over (B, heads, S, head_dim) views through ``layers.attend``; a layer is
``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``. A family with another layer (DINOv2's layer scale and
SwiGLU, CLIP's names) keeps these parts and changes what differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import BaseConfig
from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.core.layers import Draw, activation, attend, split_heads
from flodl_hf.core.modeling import Backbone
from flodl_hf.core.outputs import BaseModelOutput


def pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    """``image_size`` / ``patch_size`` as (height, width), as transformers reads an int or a pair; ConfigError
    naming the field for anything else."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return int(value[0]), int(value[1])
    raise ConfigError(f"config field {name}={value!r}: expected a positive integer or a pair of them")


def check_pixel_values(pixel_values: object, channels: int, size: tuple[int, int] | None) -> None:
    """InputError naming ``pixel_values`` for what the patch projection would fail on (or run wrong on): not a
    tensor, not (batch, channels, height, width), not floating point, another channel count, or (``size`` given:
    the model's table is not interpolated) another image size."""
    if not isinstance(pixel_values, torch.Tensor):
        raise InputError(f"pixel_values is a {type(pixel_values).__name__}: expected a (batch, channels, height, "
                         "width) tensor (the image processor's pixel_values)")
    if pixel_values.dim() != 4:
        raise InputError(f"pixel_values has shape {tuple(pixel_values.shape)}: expected (batch, channels, height, "
                         "width)")
    if not pixel_values.is_floating_point():
        raise InputError(f"pixel_values has dtype {pixel_values.dtype}: expected floating-point pixel values "
                         "(rescaled and normalised by the image processor)")
    if pixel_values.shape[1] != channels:
        raise InputError(f"pixel_values has {pixel_values.shape[1]} channels, the model takes {channels} "
                         "(config num_channels)")
    if size is not None and tuple(pixel_values.shape[2:]) != size:
        raise InputError(f"pixel_values are {pixel_values.shape[2]}x{pixel_values.shape[3]} pixels, the model's "
                         f"position table is for {size[0]}x{size[1]} (config image_size): resize the images, or "
                         "pass interpolate_pos_encoding=True")


class PatchEmbeddings(nn.Module):
    """``projection(pixels).flatten(2).transpose(1, 2)``: one token per patch (ViTPatchEmbeddings)."""

    def __init__(self, config: BaseConfig) -> None:
        super().__init__()
        self.image_size = pair(config.image_size, "image_size")
        self.patch_size = pair(config.patch_size, "patch_size")
        self.num_patches = (self.image_size[1] // self.patch_size[1]) * (self.image_size[0] // self.patch_size[0])
        self.projection = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=self.patch_size,
                                    stride=self.patch_size)
        self.projection.fresh_init = {"weight": "normal"}  # transformers' _init_weights draws a Conv2d's weight

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.projection(pixel_values).flatten(2).transpose(1, 2)


def drawn_tokens(config: BaseConfig) -> dict[str, Draw]:
    """``fresh_init`` of the CLS token and position table as ViT's and DINOv2's ``_init_weights`` start them:
    ``trunc_normal_(std=initializer_range)``, cut at -2 and 2."""
    std = config.initializer_range
    return {"cls_token": Draw(std, 2 / std), "position_embeddings": Draw(std, 2 / std)}


def resized_positions(table: torch.Tensor, special: int, height: int, width: int, patch: tuple[int, int],
                      in_float32: bool = False, antialias: bool = False) -> torch.Tensor:
    """The position table (1, special + n, H) for an image of ``height`` x ``width``: the ``special`` leading rows
    as they are, the patch rows as a square grid resized by bicubic interpolation (align_corners False) to the
    image's grid, as ``ViTEmbeddings.interpolate_pos_encoding`` (DeiT: two leading rows; DINOv2: computed in
    float32, ``in_float32``; DINOv2 with registers: ``antialias`` too). The table itself where the grid and the
    image are the same and square."""
    positions = table.shape[1] - special
    if (height // patch[0]) * (width // patch[1]) == positions and height == width:
        return table
    leading, grid = table[:, :special], table[:, special:]
    dim = table.shape[-1]
    side = int(positions ** 0.5)  # transformers' torch_int(num_positions ** 0.5)
    grid = grid.reshape(1, side, side, dim).permute(0, 3, 1, 2)
    dtype = grid.dtype
    grid = F.interpolate(grid.to(torch.float32) if in_float32 else grid, size=(height // patch[0], width // patch[1]),
                         mode="bicubic", align_corners=False, antialias=antialias)
    if in_float32:
        grid = grid.to(dtype=dtype)
    grid = grid.permute(0, 2, 3, 1).view(1, -1, dim)
    return torch.cat((leading, grid), dim=1)


def masked_patches(patches: torch.Tensor, bool_masked_pos: torch.Tensor | None, mask_token: torch.Tensor | None,
                   where: str = "bool_masked_pos") -> torch.Tensor:
    """Patches with the masked ones replaced by the mask token: ``patches * (1 - m) + token * m``, as
    ViTEmbeddings; InputError naming ``bool_masked_pos`` when its shape is not (batch, patches) or the model has
    no mask token."""
    if bool_masked_pos is None:
        return patches
    if mask_token is None:
        raise InputError(f"{where}: this model has no mask token (transformers builds it for masked image modeling "
                         "only); pass no bool_masked_pos")
    if not isinstance(bool_masked_pos, torch.Tensor) or tuple(bool_masked_pos.shape) != tuple(patches.shape[:2]):
        shape = tuple(bool_masked_pos.shape) if isinstance(bool_masked_pos, torch.Tensor) else type(bool_masked_pos)
        raise InputError(f"{where} has shape {shape}: expected (batch, patches) {tuple(patches.shape[:2])}")
    batch, length = patches.shape[:2]
    tokens = mask_token.expand(batch, length, -1)
    mask = bool_masked_pos.unsqueeze(-1).type_as(tokens)
    return patches * (1.0 - mask) + tokens * mask


class VisionAttention(nn.Module):
    """``q_proj k_proj v_proj`` into heads, ``layers.attend`` at ``head_dim ** -0.5``, then the output projection
    (``o_proj``; CLIP names it ``out_proj``: ``out_name``)."""

    def __init__(self, config: BaseConfig, out_name: str = "o_proj") -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        width = self.head_dim * config.num_attention_heads
        bias = getattr(config, "qkv_bias", True)
        self.q_proj = nn.Linear(config.hidden_size, width, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, width, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, width, bias=bias)
        self.out_name = out_name
        setattr(self, out_name, nn.Linear(width, config.hidden_size))
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q = split_heads(self.q_proj(hidden_states), self.head_dim)
        k = split_heads(self.k_proj(hidden_states), self.head_dim)
        v = split_heads(self.v_proj(hidden_states), self.head_dim)
        out = attend(q, k, v, mask, self.config.attn_implementation, self.dropout_p if self.training else 0.0,
                     self.head_dim ** -0.5)
        return getattr(self, self.out_name)(out)


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))`` (ViTMLP, CLIPMLP; DINOv2's at ``hidden * mlp_ratio``)."""

    def __init__(self, config: BaseConfig, inner: int | None = None) -> None:
        super().__init__()
        inner = inner or config.intermediate_size
        self.activation_fn = activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, inner)
        self.fc2 = nn.Linear(inner, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


class PreNormLayer(nn.Module):
    """ViTLayer: ``x + dropout(attention(layernorm_before(x)))``, then ``x + dropout(mlp(layernorm_after(x)))``
    (the branch first, the residual second, as transformers adds them)."""

    def __init__(self, config: BaseConfig) -> None:
        super().__init__()
        self.attention = VisionAttention(config)
        self.layernorm_before = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layernorm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        hidden_states = self.dropout(self.attention(self.layernorm_before(hidden_states), mask)) + hidden_states
        return self.dropout(self.mlp(self.layernorm_after(hidden_states))) + hidden_states


class VisionBackbone(Backbone):
    """A backbone whose input is ``pixel_values`` (batch, channels, height, width): ``embed`` makes the tokens
    (patches, the special tokens, positions), ``encode`` runs the layers, then the final norm and ``pool``.

    ``input_names`` are transformers' forward inputs for the model of the same name: ``pixel_values``,
    ``bool_masked_pos`` (masked image modeling), ``interpolate_pos_encoding`` (where the family has the switch),
    and ``attention_mask`` (over the tokens, rarely given; a padding mask as the text encoders build it).
    ``interpolates`` says whether the position table is resized whatever the switch says (DINOv2)."""

    input_names: ClassVar[tuple[str, ...]] = ("pixel_values", "bool_masked_pos", "interpolate_pos_encoding",
                                              "attention_mask")
    interpolates: ClassVar[bool] = False
    # transformers' vision models record hidden_states with tie_last_hidden_states=False: the last one is the last
    # layer's output, before the final norm
    ties_last_hidden_state: ClassVar[bool] = False

    def get_input_embeddings(self) -> nn.Module:
        """The patch embeddings (transformers' ``_input_embed_layer``)."""
        return self.embeddings.patch_embeddings

    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def check_pixels(self, pixel_values: object, interpolate_pos_encoding: bool | None) -> torch.Tensor:
        """The checked pixels in the patch projection's dtype (transformers casts them so)."""
        patches = self.embeddings.patch_embeddings
        size = None if (interpolate_pos_encoding or self.interpolates) else patches.image_size
        check_pixel_values(pixel_values, self.config.num_channels, size)
        return pixel_values.to(patches.projection.weight.dtype)

    def embed_pixels(self, pixel_values: torch.Tensor, bool_masked_pos: torch.Tensor | None,
                     interpolate_pos_encoding: bool) -> torch.Tensor:
        """The first hidden states (the family's embeddings module)."""
        return self.embeddings(pixel_values, bool_masked_pos=bool_masked_pos,
                               interpolate_pos_encoding=interpolate_pos_encoding)

    def run_layers(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Each layer with its mask (None without an attention mask, as transformers' bidirectional mask)."""
        for layer, mask in zip(self.layer_list(), self.layer_masks(attention_mask, hidden), strict=True):
            hidden = layer(hidden, mask)
        return hidden

    def layer_list(self) -> nn.ModuleList:
        return self.layers

    def pool(self, hidden: torch.Tensor) -> torch.Tensor | None:
        pooler = getattr(self, "pooler", None)
        return pooler(hidden) if pooler is not None else None

    def forward(self, pixel_values: torch.Tensor | None = None, bool_masked_pos: torch.Tensor | None = None,
                interpolate_pos_encoding: bool | None = None,
                attention_mask: torch.Tensor | None = None) -> BaseModelOutput:
        pixels = self.check_pixels(pixel_values, interpolate_pos_encoding)
        hidden = self.embed_pixels(pixels, bool_masked_pos, bool(interpolate_pos_encoding))
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
            raise InputError(f"attention_mask has shape {tuple(attention_mask.shape)}: expected (batch, tokens) "
                             f"{tuple(hidden.shape[:2])} (the special tokens and the patches)")
        hidden = self.layernorm(self.run_layers(hidden, attention_mask))
        return self.output_record(last_hidden_state=hidden, pooler_output=self.pool(hidden))


class VisionPooler(nn.Module):
    """``act(dense(h[:, 0]))`` (ViTPooler: ``pooler_output_size`` wide, ``pooler_act``)."""

    def __init__(self, config: BaseConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.pooler_output_size or config.hidden_size)
        self.activation = activation(config.pooler_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))
