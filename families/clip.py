"""CLIP (``model_type``: ``clip``, ``clip_text_model``, ``clip_vision_model``): two towers and their projections.

Mirrors ``transformers.models.clip.modeling_clip`` (5.25). What each model type is:
- ``clip_text_model``: ``CLIPTextModel`` (token + position embeddings, pre-norm layers under a causal mask,
  ``final_layer_norm``, pooled at the EOS token) and ``CLIPTextModelWithProjection`` (``text_projection`` on the
  pooled state); the text tower's files may hold its keys under ``text_model.`` (the family's prefix);
- ``clip_vision_model``: ``CLIPVisionModel`` (a class token and patches, ``pre_layrnorm``, the layers, the class
  token through ``post_layernorm``) and ``CLIPVisionModelWithProjection`` (``visual_projection``);
- ``clip``: ``CLIPModel``, both towers, their projections, the cosine scores times ``exp(logit_scale)`` and the
  contrastive loss (``return_loss=True``).

Each layer is ``h + self_attn(layer_norm1(h))``, then ``h + mlp(layer_norm2(h))``; the text tower's mask is
``masking_utils.create_causal_mask``'s (``flodl_hf.core.decoder.causal_mask``: None and ``is_causal`` on sdpa when
nothing is padded). SigLIP (families/siglip.py) reuses these parts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.decoder import causal_mask, grouped_attend
from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.core.layers import Draw, MaskSpec, attend, split_heads
from flodl_hf.core.modeling import PLAIN_RECORD, Backbone, HeadPart, TaskModel, forward_options
from flodl_hf.core.losses import image_classification_loss
from flodl_hf.core.outputs import BaseModelOutput, ImageClassifierOutput, ModelOutput
from flodl_hf.core.registry import Family, Task, register, register_task, register_task_model
from flodl_hf.core.vision_layers import VisionMLP, check_pixel_values, resized_positions

CAUSAL = MaskSpec("causal")


def drawn(module: nn.Module, std: float, name: str = "weight") -> nn.Module:
    """``module`` with its fresh ``name`` drawn normal(0, ``std``), as ``CLIPPreTrainedModel._init_weights`` draws it
    (``layers.fresh_rule`` reads ``fresh_init``)."""
    module.fresh_init = {**getattr(module, "fresh_init", {}), name: Draw(std)}
    return module


def factor(config: BaseConfig) -> float:
    return getattr(config, "initializer_factor", 1.0)


# ---- configs ------------------------------------------------------------------------------------------------

@dataclass
class CLIPTextConfig(BaseConfig):
    model_type: ClassVar[str] = "clip_text_model"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation}

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: Activation = Activation.QUICK_GELU
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    initializer_factor: float = 1.0
    pad_token_id: int | None = 1
    bos_token_id: int | None = 49406
    eos_token_id: int | None = 49407

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class CLIPVisionConfig(BaseConfig):
    model_type: ClassVar[str] = "clip_vision_model"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation}

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: Activation = Activation.QUICK_GELU
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    initializer_factor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.patch_size > self.image_size:
            raise ConfigError(f"config: patch_size={self.patch_size} is larger than image_size={self.image_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class DualConfig(BaseConfig):
    """A config holding a ``text_config`` and a ``vision_config`` (dicts, as config.json writes them); each is read
    into its tower's config class at load (``text``, ``vision``), a bad field named under its sub-config."""

    text_class: ClassVar[type[BaseConfig]]
    vision_class: ClassVar[type[BaseConfig]]

    text_config: dict | None = None
    vision_config: dict | None = None
    initializer_factor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, cls in (("text_config", self.text_class), ("vision_config", self.vision_class)):
            data = getattr(self, name)
            if data is not None and not isinstance(data, dict):
                raise ConfigError(f"config: field {name} is a {type(data).__name__}, expected an object")
            try:
                sub = cls.from_dict({k: v for k, v in (data or {}).items() if k != "model_type"})
            except ConfigError as exc:
                raise ConfigError(f"config: {name}: {exc}") from None
            setattr(self, name.removesuffix("_config"), sub)


@dataclass
class CLIPConfig(DualConfig):
    model_type: ClassVar[str] = "clip"
    text_class: ClassVar[type[BaseConfig]] = CLIPTextConfig
    vision_class: ClassVar[type[BaseConfig]] = CLIPVisionConfig

    projection_dim: int = 512
    logit_scale_init_value: float = 2.6592


# ---- output records -------------------------------------------------------------------------------------------

@dataclass
class CLIPTextModelOutput(ModelOutput):
    text_embeds: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class CLIPVisionModelOutput(ModelOutput):
    image_embeds: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class CLIPOutput(ModelOutput):
    """transformers' ``CLIPOutput`` (and ``SiglipOutput``): the towers' records nested, as tuples in ``to_tuple``."""

    loss: torch.Tensor | None = None
    logits_per_image: torch.Tensor | None = None
    logits_per_text: torch.Tensor | None = None
    text_embeds: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    text_model_output: BaseModelOutput | None = None
    vision_model_output: BaseModelOutput | None = None

    def to_tuple(self) -> tuple:
        return tuple(v.to_tuple() if isinstance(v, ModelOutput) else v for v in self.values())


# ---- the layers, shared by both towers --------------------------------------------------------------------------

class CLIPAttention(nn.Module):
    """``k_proj v_proj q_proj out_proj`` (transformers' order); scale ``head_dim ** -0.5``. A causal tower attends as
    the decoders do (``grouped_attend``: ``is_causal`` on sdpa when no mask is built); the others as the encoders."""

    def __init__(self, config: CLIPTextConfig | CLIPVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        width, f = config.hidden_size, factor(config)
        in_std = width ** -0.5 * (2 * config.num_hidden_layers) ** -0.5 * f
        self.k_proj = drawn(nn.Linear(width, width), in_std)
        self.v_proj = drawn(nn.Linear(width, width), in_std)
        self.q_proj = drawn(nn.Linear(width, width), in_std)
        self.out_proj = drawn(nn.Linear(width, width), width ** -0.5 * f)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        q = split_heads(self.q_proj(hidden_states), self.head_dim)
        k = split_heads(self.k_proj(hidden_states), self.head_dim)
        v = split_heads(self.v_proj(hidden_states), self.head_dim)
        p = self.config.attention_dropout if self.training else 0.0
        impl, scale = self.config.attn_implementation, self.head_dim ** -0.5
        if causal:
            out = grouped_attend(q, k, v, mask, impl, 1, scale, p)
            out = out.reshape(*hidden_states.shape[:-1], -1)
        else:
            out = attend(q, k, v, mask, impl, p, scale)
        return self.out_proj(out)


class CLIPMLP(VisionMLP):
    """``fc2(act(fc1(x)))``, drawn fresh as CLIP draws it."""

    def __init__(self, config: CLIPTextConfig | CLIPVisionConfig) -> None:
        super().__init__(config)
        width, f = config.hidden_size, factor(config)
        drawn(self.fc1, (2 * width) ** -0.5 * f)
        drawn(self.fc2, width ** -0.5 * (2 * config.num_hidden_layers) ** -0.5 * f)


class CLIPEncoderLayer(nn.Module):
    """``h + self_attn(layer_norm1(h))``, then ``h + mlp(layer_norm2(h))``; the children registered in
    ``module_order`` (transformers' order, which ``named_parameters`` follows: SigLIP's differs)."""

    module_order: ClassVar[tuple[str, ...]] = ("self_attn", "layer_norm1", "mlp", "layer_norm2")

    def __init__(self, config: CLIPTextConfig | CLIPVisionConfig) -> None:
        super().__init__()
        make = {"self_attn": lambda: CLIPAttention(config), "mlp": lambda: CLIPMLP(config),
                "layer_norm1": lambda: nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps),
                "layer_norm2": lambda: nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)}
        for name in self.module_order:
            self.add_module(name, make[name]())

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states), mask, causal)
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class CLIPEncoder(nn.Module):
    layer_class: ClassVar[type[nn.Module]] = CLIPEncoderLayer

    def __init__(self, config: CLIPTextConfig | CLIPVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(self.layer_class(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, causal)
        return hidden_states


# ---- the text tower ---------------------------------------------------------------------------------------------

class CLIPTextEmbeddings(nn.Module):
    """``token_embedding(ids) + position_embedding(positions)``."""

    def __init__(self, config: CLIPTextConfig) -> None:
        super().__init__()
        std = 0.02 * factor(config)  # transformers' constant, not initializer_range
        self.token_embedding = drawn(nn.Embedding(config.vocab_size, config.hidden_size), std)
        self.position_embedding = drawn(nn.Embedding(config.max_position_embeddings, config.hidden_size), std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device)[None, :]
        return self.token_embedding(input_ids) + self.position_embedding(position_ids)


class TowerModel(Backbone):
    """A tower (text or vision): ``embeddings``, ``encoder``, its norms. The record is ``last_hidden_state`` and
    ``pooler_output``; ``hidden_states`` (``output_hidden_states=True``) are each layer's input and output, the last
    not tied to ``last_hidden_state`` (transformers' ``capture_outputs(tie_last_hidden_states=False)``)."""

    ties_last_hidden_state: ClassVar[bool] = False
    takes_text: ClassVar[bool] = False  # a text tower: position_ids index its position table

    def position_table_size(self) -> int | None:
        """The text tower's position rows, which ``position_ids`` must index (the check of every backbone)."""
        return self.embeddings.position_embedding.num_embeddings if self.takes_text else None


class CLIPTextModel(TowerModel):
    """``CLIPTextModel``: the causal text tower, pooled at the EOS token."""

    input_names = ("input_ids", "attention_mask", "position_ids")
    takes_text = True
    embeddings_class: ClassVar[type[nn.Module]] = CLIPTextEmbeddings
    encoder_class: ClassVar[type[nn.Module]] = CLIPEncoder

    def __init__(self, config: CLIPTextConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        self.encoder = self.encoder_class(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.token_embedding

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> BaseModelOutput:
        if input_ids is None:
            raise InputError(f"{type(self).__name__}: input_ids is required")
        hidden = self.embeddings(input_ids, position_ids)
        hidden = self.encoder(hidden, *self.mask(attention_mask, hidden))
        last = self.final_layer_norm(hidden)
        return BaseModelOutput(last_hidden_state=last, pooler_output=self.pool_tokens(last, input_ids))

    def mask(self, attention_mask: torch.Tensor | None, hidden: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """The layers' mask and whether they attend causally: ``create_causal_mask``'s."""
        batch, length = hidden.shape[:2]
        return causal_mask(CAUSAL, attention_mask, batch, length, self.config.attn_implementation, hidden.dtype,
                           hidden.device), True

    def pool_tokens(self, last: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The EOS token's state (``CLIPTextModel.forward``): with the legacy ``eos_token_id == 2`` the highest id of
        each row (its argmax), otherwise the first position holding ``eos_token_id``."""
        eos = self.config.eos_token_id
        ids = input_ids.to(dtype=torch.int, device=last.device)
        if eos == 2:
            index = ids.argmax(dim=-1)
        elif eos is None:
            raise ConfigError("config: eos_token_id is null; CLIP's text tower pools at the EOS token")
        else:
            index = (ids == eos).int().argmax(dim=-1)
        return last[torch.arange(last.shape[0], device=last.device), index]


# ---- the vision tower -------------------------------------------------------------------------------------------

def check_pixels(pixel_values: object, config: CLIPVisionConfig, interpolate: bool, positions: int,
                 exact_size: bool) -> tuple[int, int]:
    """(height, width) of checked pixels (``vision_layers.check_pixel_values``), or an InputError naming
    ``pixel_values``. Unless ``interpolate``: CLIP takes the config's image size only (``exact_size``, as transformers
    checks it), SigLIP any size giving its number of patches (``positions``), as transformers runs it."""
    size, patch = config.image_size, config.patch_size
    check_pixel_values(pixel_values, config.num_channels, (size, size) if exact_size and not interpolate else None)
    height, width = pixel_values.shape[-2:]
    if height < patch or width < patch:
        raise InputError(f"pixel_values are {height}x{width} pixels: smaller than one {patch}-pixel patch")
    if not interpolate and (height // patch) * (width // patch) != positions:
        raise InputError(f"pixel_values are {height}x{width} pixels, {(height // patch) * (width // patch)} "
                         f"patches; the model's position table holds {positions}: resize the images, or pass "
                         "interpolate_pos_encoding=True")
    return height, width


class CLIPVisionEmbeddings(nn.Module):
    """``cat(class_embedding, patches) + position_embedding``; the patches a convolution of stride ``patch_size``."""

    class_token: ClassVar[bool] = True
    patch_bias: ClassVar[bool] = False
    exact_size: ClassVar[bool] = True  # transformers' CLIP refuses other sizes; SigLIP's takes any of as many patches

    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.config = config
        std = config.initializer_range * factor(config)
        if self.class_token:
            self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
            drawn(self, config.hidden_size ** -0.5 * factor(config), "class_embedding")
        self.patch_embedding = drawn(nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                               stride=config.patch_size, bias=self.patch_bias), std)
        self.num_positions = (config.image_size // config.patch_size) ** 2 + int(self.class_token)
        self.position_embedding = drawn(nn.Embedding(self.num_positions, config.hidden_size), std)

    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        height, width = check_pixels(pixel_values, self.config, interpolate_pos_encoding,
                                     self.num_positions - int(self.class_token), self.exact_size)
        patches = self.patch_embedding(pixel_values.to(dtype=self.patch_embedding.weight.dtype))
        embeddings = patches.flatten(2).transpose(1, 2)
        if self.class_token:
            embeddings = torch.cat([self.class_embedding.expand(pixel_values.shape[0], 1, -1), embeddings], dim=1)
        return embeddings + self.positions(embeddings, height, width, interpolate_pos_encoding)

    def positions(self, embeddings: torch.Tensor, height: int, width: int, interpolate: bool) -> torch.Tensor:
        ids = torch.arange(self.num_positions, device=embeddings.device)[None, :]
        if not interpolate or (embeddings.shape[1] == self.num_positions and height == width):
            return self.position_embedding(ids)
        patch = self.config.patch_size
        return resized_positions(self.position_embedding.weight.unsqueeze(0), int(self.class_token), height, width,
                                 (patch, patch))


class CLIPVisionModel(TowerModel):
    """``CLIPVisionModel``: ``pre_layrnorm`` before the layers; the pooled state is the class token after
    ``post_layernorm``."""

    input_names = ("pixel_values", "interpolate_pos_encoding")

    def __init__(self, config: CLIPVisionConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embedding

    def forward(self, pixel_values: torch.Tensor | None = None,
                interpolate_pos_encoding: bool = False) -> BaseModelOutput:
        hidden = self.pre_layrnorm(self.embeddings(pixel_values, interpolate_pos_encoding))
        last = self.encoder(hidden, None)
        return BaseModelOutput(last_hidden_state=last, pooler_output=self.post_layernorm(last[:, 0, :]))


# ---- the towers with a projection -------------------------------------------------------------------------------

class Projection(HeadPart):
    """One bias-free linear layer on the tower's pooled state, mounted under transformers' name."""

    def __init__(self, name: str, config: CLIPTextConfig | CLIPVisionConfig) -> None:
        super().__init__()
        self.name = name
        width = config.hidden_size
        self.add_module(name, drawn(nn.Linear(width, config.projection_dim, bias=False),
                                    width ** -0.5 * factor(config)))

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return getattr(self, self.name)(pooler_output)


@register_task_model
class CLIPTextModelWithProjection(TaskModel):
    """``text_embeds = text_projection(pooled)``, with the tower's ``last_hidden_state``."""

    task = "text_projection"

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> CLIPTextModelOutput:
        out = self.run_backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return CLIPTextModelOutput(text_embeds=self.head(out.last_hidden_state, out.pooler_output),
                                   last_hidden_state=out.last_hidden_state)


@register_task_model
class CLIPVisionModelWithProjection(TaskModel):
    """``image_embeds = visual_projection(pooled)``, with the tower's ``last_hidden_state``."""

    task = "vision_projection"

    def forward(self, pixel_values: torch.Tensor | None = None,
                interpolate_pos_encoding: bool = False) -> CLIPVisionModelOutput:
        out = self.run_backbone(pixel_values=pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
        return CLIPVisionModelOutput(image_embeds=self.head(out.last_hidden_state, out.pooler_output),
                                     last_hidden_state=out.last_hidden_state)


TEXT_PROJECTION = register_task(Task(
    "text_projection", "ModelWithProjection", "CLIPTextModelWithProjection", "", CLIPTextModelOutput,
    "projection_head", "flodl_hf.families.clip:CLIPTextModelWithProjection", None, core=False,
    classes=(("clip_text_model", "CLIPTextModelWithProjection"),)))
VISION_PROJECTION = register_task(Task(
    "vision_projection", "ModelWithProjection", "CLIPVisionModelWithProjection", "", CLIPVisionModelOutput,
    "projection_head", "flodl_hf.families.clip:CLIPVisionModelWithProjection", None, core=False,
    classes=(("clip_vision_model", "CLIPVisionModelWithProjection"),)))


# ---- the two towers together -------------------------------------------------------------------------------------

def _tower_options(options: dict[str, Any]) -> dict[str, Any]:
    """The forward keywords a dual model hands each tower (transformers records hidden states and attentions in
    the towers' records, none at the top)."""
    hidden, attentions, _ = forward_options(**options)
    return {**PLAIN_RECORD, "output_hidden_states": hidden, "output_attentions": attentions}


def contrastive_loss(logits: torch.Tensor) -> torch.Tensor:
    """``modeling_clip.contrastive_loss``: cross-entropy against the diagonal."""
    return F.cross_entropy(logits, torch.arange(len(logits), device=logits.device))


class DualEncoder(Backbone):
    """Both towers, as ``CLIPModel`` and ``SiglipModel``: ``text_model``, ``vision_model``, and what sits on their
    pooled states. ``get_text_features`` / ``get_image_features`` return the tower's record with the features as
    ``pooler_output`` (transformers 5's); ``forward`` scores every text against every image."""

    input_names = ("input_ids", "pixel_values", "attention_mask", "position_ids", "return_loss",
                   "interpolate_pos_encoding")
    validates_inputs = False  # each tower checks its own inputs
    text_model_class: ClassVar[type[Backbone]] = CLIPTextModel
    vision_model_class: ClassVar[type[Backbone]] = CLIPVisionModel

    def __init__(self, config: DualConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.text_model = self.text_model_class(config.text)
        self.vision_model = self.vision_model_class(config.vision)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' forward keywords reach the towers; ``return_dict=False`` gives nested tuples."""
        options = {k: kwargs.pop(k) for k in ("output_hidden_states", "output_attentions", "return_dict",
                                              "head_mask") if k in kwargs}
        out = nn.Module.__call__(self, *args, **kwargs, _options=options)
        return out.to_tuple() if options.get("return_dict", self.config.raw.get("return_dict")) is False else out

    def _sync(self) -> None:
        for tower in (self.text_model, self.vision_model):  # one attention path for the whole model
            tower.config.attn_implementation = self.config.attn_implementation

    def get_input_embeddings(self) -> nn.Embedding:
        return self.text_model.get_input_embeddings()

    def num_layers(self) -> int:
        return self.config.text.num_hidden_layers

    def text_tower(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, options: dict | None = None) -> BaseModelOutput:
        self._sync()
        return self.text_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **_tower_options(options or {}))

    def vision_tower(self, pixel_values: torch.Tensor | None, interpolate_pos_encoding: bool = False,
                     options: dict | None = None) -> BaseModelOutput:
        self._sync()
        return self.vision_model(pixel_values=pixel_values, interpolate_pos_encoding=interpolate_pos_encoding,
                                 **_tower_options(options or {}))

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          position_ids: torch.Tensor | None = None, **options: Any) -> BaseModelOutput:
        out = self.text_tower(input_ids, attention_mask, position_ids, options)
        return dataclasses.replace(out, pooler_output=self.text_features(out.pooler_output))

    def get_image_features(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False,
                           **options: Any) -> BaseModelOutput:
        out = self.vision_tower(pixel_values, interpolate_pos_encoding, options)
        return dataclasses.replace(out, pooler_output=self.image_features(out.pooler_output))

    def text_features(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled

    def image_features(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled

    def forward(self, input_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                return_loss: bool | None = None, interpolate_pos_encoding: bool = False,
                _options: dict | None = None) -> CLIPOutput:
        vision = self.get_image_features(pixel_values, interpolate_pos_encoding, **(_options or {}))
        text = self.get_text_features(input_ids, attention_mask, position_ids, **(_options or {}))
        image_embeds = vision.pooler_output / self.norm(vision.pooler_output)
        text_embeds = text.pooler_output / self.norm(text.pooler_output)
        logits_per_text = self.scores(torch.matmul(text_embeds, image_embeds.t()))
        if return_loss and logits_per_text.shape[0] != logits_per_text.shape[1]:
            raise InputError(f"return_loss=True pairs text i with image i: got {logits_per_text.shape[0]} texts "
                             f"(input_ids) and {logits_per_text.shape[1]} images (pixel_values)")
        return CLIPOutput(loss=self.loss(logits_per_text) if return_loss else None,
                          logits_per_image=logits_per_text.t(), logits_per_text=logits_per_text,
                          text_embeds=text_embeds, image_embeds=image_embeds, text_model_output=text,
                          vision_model_output=vision)

    @staticmethod
    def norm(features: torch.Tensor) -> torch.Tensor:
        """``modeling_clip._get_vector_norm``: ``pow(sum(pow(x, 2)), 0.5)`` over the last dimension."""
        return torch.pow(torch.sum(torch.pow(features, 2), dim=-1, keepdim=True), 0.5)

    def scores(self, cosine: torch.Tensor) -> torch.Tensor:
        return cosine * self.logit_scale.exp()

    def loss(self, logits_per_text: torch.Tensor) -> torch.Tensor:
        """``image_text_contrastive_loss``: the mean of the caption and image cross-entropies."""
        return (contrastive_loss(logits_per_text) + contrastive_loss(logits_per_text.t())) / 2.0


class CLIPModel(DualEncoder):
    """``CLIPModel``: ``visual_projection`` and ``text_projection`` (bias-free) on the pooled states, cosine scores
    times ``exp(logit_scale)``."""

    def __init__(self, config: CLIPConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        f = config.initializer_factor
        self.visual_projection = drawn(nn.Linear(config.vision.hidden_size, config.projection_dim, bias=False),
                                       config.vision.hidden_size ** -0.5 * f)
        self.text_projection = drawn(nn.Linear(config.text.hidden_size, config.projection_dim, bias=False),
                                     config.text.hidden_size ** -0.5 * f)
        self.logit_scale = nn.Parameter(torch.tensor(config.logit_scale_init_value))

    @torch.no_grad()
    def init_fresh_weights(self, std: float) -> None:
        """A fresh ``logit_scale`` is ``logit_scale_init_value``, as the constructor sets it."""
        self.logit_scale.fill_(self.config.logit_scale_init_value)

    def text_features(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.text_projection(pooled)

    def image_features(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.visual_projection(pooled)


class CLIPForImageClassification(Backbone):
    """``CLIPForImageClassification``: the vision tower alone and ``classifier`` on the mean of its patch tokens
    (after the class token); transformers' ForImageClassification loss with ``labels``."""

    task = "image_classification"
    input_names = ("pixel_values", "labels", "interpolate_pos_encoding")
    validates_inputs = False  # the tower checks its pixels
    ties_last_hidden_state = False
    vision_model_class: ClassVar[type[Backbone]] = CLIPVisionModel
    first_token: ClassVar[int] = 1  # SigLIP's has no class token: the mean of every position

    def __init__(self, config: DualConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.vision_model = self.vision_model_class(config.vision)
        width = config.vision.hidden_size
        self.classifier = drawn(nn.Linear(width, config.num_labels), width ** -0.5 * config.initializer_factor)

    def get_input_embeddings(self) -> nn.Module:
        return self.vision_model.get_input_embeddings()

    def forward(self, pixel_values: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                interpolate_pos_encoding: bool = False, *,
                num_items_in_batch: torch.Tensor | int | None = None) -> ImageClassifierOutput:
        self.vision_model.config.attn_implementation = self.config.attn_implementation
        last = self.vision_model(pixel_values=pixel_values, interpolate_pos_encoding=interpolate_pos_encoding,
                                 **PLAIN_RECORD).last_hidden_state
        logits = self.classifier(torch.mean(last[:, self.first_token:, :], dim=1))
        loss = None if labels is None else image_classification_loss(self, logits, labels, num_items_in_batch)
        return ImageClassifierOutput(loss=loss, logits=logits)


# ---- the families ------------------------------------------------------------------------------------------------

class TowerFamily(Family):
    """What CLIP's and SigLIP's model types share: no BERT heads, and inputs of their own (``example_inputs``)."""

    tasks = ("base",)
    modalities: ClassVar[tuple[str, ...]] = ("text", "image")

    @classmethod
    def example_inputs(cls, config: BaseConfig, task: str, lengths: tuple[int, ...] = (13, 8),
                       seed: int = 0) -> dict[str, torch.Tensor]:
        """A batch for parity checks: texts of ``lengths`` tokens padded at the end, each ending with the EOS token
        where the vocabulary holds it (the token CLIP pools), and one image of the model's size per text (images
        only for image classification)."""
        gen = torch.Generator().manual_seed(seed)
        batch: dict[str, torch.Tensor] = {}
        modalities = ("image",) if task == "image_classification" else cls.modalities
        if "text" in modalities:
            text = getattr(config, "text", config)
            pad = text.pad_token_id if text.pad_token_id is not None else 0
            ids = torch.randint(0, text.vocab_size, (len(lengths), max(lengths)), generator=gen)
            ids = torch.where((ids == pad) | (ids == text.eos_token_id), (ids + 1) % text.vocab_size, ids)
            mask = (torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]).long()
            if text.eos_token_id is not None and text.eos_token_id < text.vocab_size:
                ids[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = text.eos_token_id
            batch.update(input_ids=ids.masked_fill(mask == 0, pad), attention_mask=mask)
        if "image" in modalities:
            vision = getattr(config, "vision", config)
            batch["pixel_values"] = torch.randn(len(lengths), vision.num_channels, vision.image_size,
                                                vision.image_size, generator=gen)
        return batch

    @classmethod
    def projection_head(cls, config: BaseConfig) -> HeadPart:
        raise NotImplementedError


@register
class CLIPText(TowerFamily):
    model_type = "clip_text_model"
    arch = "CLIPText"
    prefix = "text_model"
    config_class = CLIPTextConfig
    backbone_class = CLIPTextModel
    tasks = ("base", TEXT_PROJECTION.name)
    modalities = ("text",)

    @classmethod
    def projection_head(cls, config: CLIPTextConfig) -> HeadPart:
        return Projection("text_projection", config)


@register
class CLIPVision(TowerFamily):
    model_type = "clip_vision_model"
    arch = "CLIPVision"
    prefix = "vision_model"
    config_class = CLIPVisionConfig
    backbone_class = CLIPVisionModel
    tasks = ("base", VISION_PROJECTION.name)
    modalities = ("image",)

    @classmethod
    def projection_head(cls, config: CLIPVisionConfig) -> HeadPart:
        return Projection("visual_projection", config)


@register
class CLIP(TowerFamily):
    model_type = "clip"
    arch = "CLIP"
    prefix = "clip"
    config_class = CLIPConfig
    backbone_class = CLIPModel
    tasks = ("base", "image_classification")
    task_models = {"image_classification": CLIPForImageClassification}
