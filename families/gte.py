"""GTE (``model_type: gte``: Alibaba's "new" architecture, gte-multilingual-base, gte-base-en-v1.5): Nomic BERT's
layers with biases, and RoBERTa's masked-LM head.

Mirrors ``transformers.models.gte.modeling_gte`` (5.25), JinaEmbeddingsV3's parts as Nomic BERT's
(families/nomic_bert.py), where they differ:
- ``q_proj k_proj v_proj o_proj`` carry biases; the MLP's ``down_proj`` does too, and the gated product is dropped
  out before it: ``down_proj(dropout(act(gate_proj(h)) * up_proj(h)))`` (GteMLP, ``hidden_act`` gelu by default);
- ``type_vocab_size`` 0 builds no token-type embedding, and token types are then ignored (GteEmbeddings);
- ``head_dim`` is no config field: one in config.json is read (GteAttention's ``getattr``), else hidden / heads;
- RoPE's default theta is 160000;
- the masked-LM head is ``lm_head``: dense, GELU, ``layer_norm``, ``decoder`` with its own bias (RoBERTa's head
  without ``lm_head.bias``), the decoder's weight tied to the embeddings.

Files are in the original layout (``conversion_mapping.py``'s ``gte`` entry): ``encoder.layer``, ``attention.o_proj``,
``attn_ln``, ``mlp_ln``, ``lm_head.norm``, the fused ``attention.qkv_proj`` (weight and bias) and
``mlp.up_gate_proj`` (up first), and a leading ``new.`` (the remote-code checkpoints' prefix) dropped on load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation
from flodl_hf.core.decoder import SwiGLU
from flodl_hf.families.nomic_bert import NomicBert, NomicBertConfig, NomicBertModel
from flodl_hf.families.roberta import RobertaLMHead, RobertaMLMHead
from flodl_hf.core.keys import FileLayout
from flodl_hf.core.layers import activation
from flodl_hf.core.modeling import HeadPart
from flodl_hf.core.registry import register


@dataclass
class GteConfig(NomicBertConfig):
    model_type: ClassVar[str] = "gte"
    default_theta: ClassVar[float] = 160_000.0  # GteConfig.default_theta
    sets_head_dim: ClassVar[bool] = False
    token_types_optional: ClassVar[bool] = True

    vocab_size: int = 250048
    hidden_act: Activation = Activation.GELU
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 8192
    type_vocab_size: int = 1
    pad_token_id: int | None = 1

    def biases(self) -> tuple[bool, bool, bool]:
        """(q/k/v, o_proj, MLP) biases: on the attention (GteAttention); the MLP's are GteMLP's own."""
        return True, True, False


class GteMLP(SwiGLU):
    """``down_proj(dropout(act(gate_proj(x)) * up_proj(x)))``, ``down_proj`` with a bias (GteMLP)."""

    def __init__(self, config: GteConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, activation(config.hidden_act))
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)  # keeps its place
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


class GteModel(NomicBertModel):
    @classmethod
    def make_mlp(cls, config: GteConfig) -> nn.Module:
        return GteMLP(config)


class GteLMHead(RobertaLMHead):
    """RoBERTa's ``decoder(layer_norm(gelu(dense(h))))`` without ``lm_head.bias``: the decoder holds its bias."""

    def __init__(self, config: GteConfig) -> None:
        super().__init__(config)
        del self.bias


class GteMLMHead(RobertaMLMHead):
    """Mounts ``lm_head.*`` at the root of the masked-LM model."""

    def __init__(self, config: GteConfig) -> None:
        HeadPart.__init__(self)
        self.lm_head = GteLMHead(config)


@register
class Gte(NomicBert):
    model_type = "gte"
    arch = "Gte"
    prefix = "gte"
    config_class = GteConfig
    backbone_class = GteModel
    file_layout = FileLayout(
        renames=(("encoder.layer", "layers"), ("attention.o_proj", "self_attn.o_proj"),
                 ("attn_ln", "post_attention_layernorm"), ("mlp_ln", "post_mlp_layernorm"),
                 ("lm_head.norm", "lm_head.layer_norm")),
        fused=(("attention.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
               ("mlp.up_gate_proj", ("mlp.up_proj", "mlp.gate_proj"))),
        strip_prefix="new")

    @classmethod
    def lm_head(cls, config: GteConfig) -> HeadPart:
        return GteMLMHead(config)
