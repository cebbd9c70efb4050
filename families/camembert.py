"""CamemBERT (``model_type: camembert``): RoBERTa under another name (and a smaller default vocabulary)."""

from dataclasses import dataclass
from typing import ClassVar

from flodl_hf.families.roberta import Roberta, RobertaConfig
from flodl_hf.core.registry import register


@dataclass
class CamembertConfig(RobertaConfig):
    model_type: ClassVar[str] = "camembert"

    vocab_size: int = 30522


@register
class Camembert(Roberta):
    model_type = "camembert"
    arch = "Camembert"
    config_class = CamembertConfig
    head_before_backbone = True  # CamembertFor*: the head is built before the backbone
