"""flodl-hf: HuggingFace checkpoints in small, exact, native PyTorch modules, and back out again."""

from flodl_hf.auto import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM,
                           AutoModelForMultipleChoice, AutoModelForPreTraining, AutoModelForQuestionAnswering,
                           AutoModelForSequenceClassification, AutoModelForTokenClassification, load_model)
from flodl_hf.core.errors import (CheckpointFormatError, ConfigError, FlodlHFError, InputError, SourceNotFoundError,
                                  UnsupportedModelError, WeightsMismatchError)

from flodl_hf.training.sync import DiLoCo, ElChe
from flodl_hf.generation.generate import generate
from flodl_hf.tasks import answer, classify, detect_replaced, embed, fill_mask, rank, tag, zero_shot
from flodl_hf.tokenization.tokenizer import AutoTokenizer, Tokenizer
from flodl_hf.training.trainer import Trainer

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
