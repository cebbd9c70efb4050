"""flodl-hf: HuggingFace checkpoints in small, exact, native PyTorch modules, and back out again."""

from .auto import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    load_model,
)
from .errors import (
    CheckpointFormatError,
    ConfigError,
    FlodlHFError,
    InputError,
    SourceNotFoundError,
    UnsupportedModelError,
    WeightsMismatchError,
)

from .distributed import DiLoCo, ElChe
from .generate import generate
from .tasks import answer, classify, detect_replaced, embed, fill_mask, rank, tag, zero_shot
from .tokenizer import AutoTokenizer, Tokenizer
from .trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForMultipleChoice", "AutoModelForPreTraining",
    "AutoModelForQuestionAnswering",
    "AutoModelForSequenceClassification", "AutoModelForTokenClassification", "load_model",
    "CheckpointFormatError", "ConfigError", "FlodlHFError", "InputError", "SourceNotFoundError",
    "UnsupportedModelError", "WeightsMismatchError",
    "Trainer", "ElChe", "DiLoCo",
    "AutoTokenizer", "Tokenizer", "answer", "classify", "detect_replaced", "embed", "fill_mask", "generate", "rank",
    "tag", "zero_shot",
]
