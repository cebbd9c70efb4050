"""XLM-RoBERTa (``model_type: xlm-roberta``): RoBERTa under another name (and a smaller default vocabulary)."""

from dataclasses import dataclass
from typing import ClassVar

from flodl_hf.families.roberta import Roberta, RobertaConfig
from flodl_hf.core.registry import register


@dataclass
class XLMRobertaConfig(RobertaConfig):
    model_type: ClassVar[str] = "xlm-roberta"

    vocab_size: int = 30522


@register
class XLMRoberta(Roberta):
    model_type = "xlm-roberta"
    arch = "XLMRoberta"
    config_class = XLMRobertaConfig
    head_before_backbone = True  # XLMRobertaFor*: the head is built before the backbone
