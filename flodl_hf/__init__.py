"""flodl-hf: HuggingFace checkpoints in small, exact, native PyTorch modules, and back out again.

The package is layered by capability (docs/design.md): ``core`` -> ``tokenization`` -> ``generation`` -> ``lora`` ->
``heads``, ``families`` -> ``auto`` -> ``tasks`` -> ``roundtrip`` | ``training`` -> ``commands``. This file is the
facade above all of them: the top-level names load on first use (PEP 562), so ``import flodl_hf`` imports no
layer, and it fills core's slots (``flodl_hf.core.slots``) with thin functions that import the layer they need
when first called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flodl_hf.core import slots as _slots
from flodl_hf.core.version import __version__ as __version__

# name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(("AutoModelForImageClassification", "AutoModelForMaskedImageModeling"), "flodl_hf.auto"),
    **dict.fromkeys(("AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM",
                     "AutoModelForMultipleChoice", "AutoModelForPreTraining", "AutoModelForQuestionAnswering",
                     "AutoModelForSequenceClassification", "AutoModelForTokenClassification", "load_model"),
                    "flodl_hf.auto"),
    **dict.fromkeys(("CheckpointFormatError", "ConfigError", "FlodlHFError", "InputError", "SourceNotFoundError",
                     "UnsupportedModelError", "WeightsMismatchError"), "flodl_hf.core.errors"),
    "Trainer": "flodl_hf.training.trainer",
    "ElChe": "flodl_hf.training.sync",
    "DiLoCo": "flodl_hf.training.sync",
    "AutoTokenizer": "flodl_hf.tokenization",
    "AutoImageProcessor": "flodl_hf.vision",
    "Tokenizer": "flodl_hf.tokenization",
    "generate": "flodl_hf.tasks.generate",
    **dict.fromkeys(("classify_image", "embed_image", "embed_image_text", "rank_images", "zero_shot_image"),
                    "flodl_hf.tasks.image"),
    **dict.fromkeys(("answer", "classify", "detect_replaced", "embed", "fill_mask", "rank", "tag", "zero_shot"),
                    "flodl_hf.tasks"),
}

__all__ = [
    "AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForMultipleChoice",
    "AutoModelForPreTraining", "AutoModelForQuestionAnswering", "AutoModelForImageClassification",
    "AutoModelForMaskedImageModeling",
    "AutoModelForSequenceClassification", "AutoModelForTokenClassification", "load_model",
    "CheckpointFormatError", "ConfigError", "FlodlHFError", "InputError", "SourceNotFoundError",
    "UnsupportedModelError", "WeightsMismatchError",
    "Trainer", "ElChe", "DiLoCo",
    "AutoTokenizer", "Tokenizer", "AutoImageProcessor", "answer", "classify", "detect_replaced", "embed", "fill_mask",
    "generate", "rank", "tag", "zero_shot", "classify_image", "embed_image", "embed_image_text", "rank_images",
    "zero_shot_image",
]


def __getattr__(name: str) -> Any:
    """A top-level name, imported from its module on first use and kept (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flodl_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# ---- core's slots, filled by the facade: each imports its layer on first call ---------------------------------

def _load_model(cls: type, source: Any, model_args: tuple, kwargs: dict[str, Any]) -> Any:
    from flodl_hf.auto import model_from_pretrained
    return model_from_pretrained(cls, source, model_args, kwargs)


def _load_config(source: Any, revision: str | None = None, gguf_file: Any = None) -> Any:
    from flodl_hf.auto import AutoConfig
    return AutoConfig.from_pretrained(source, revision=revision, gguf_file=gguf_file)


def _import_families() -> None:
    import flodl_hf.families  # noqa: F401  (importing it registers every family)


def _read_gguf_tokenizer(source: Any, gguf_file: Any, options: dict[str, Any]) -> Any:
    from flodl_hf.gguf.tokenizer import read_gguf_tokenizer
    return read_gguf_tokenizer(source, gguf_file, options)


_slots.LOAD_MODEL.fill(_load_model)
_slots.LOAD_CONFIG.fill(_load_config)
_slots.IMPORT_FAMILIES.fill(_import_families)
_slots.READ_GGUF_TOKENIZER.fill(_read_gguf_tokenizer)

if TYPE_CHECKING:  # the names, for type checkers and editors
    from flodl_hf.auto import AutoModelForImageClassification, AutoModelForMaskedImageModeling
    from flodl_hf.auto import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM,
                               AutoModelForMultipleChoice, AutoModelForPreTraining, AutoModelForQuestionAnswering,
                               AutoModelForSequenceClassification, AutoModelForTokenClassification, load_model)
    from flodl_hf.core.errors import (CheckpointFormatError, ConfigError, FlodlHFError, InputError,
                                      SourceNotFoundError, UnsupportedModelError, WeightsMismatchError)
    from flodl_hf.tasks import answer, classify, detect_replaced, embed, fill_mask, generate, rank, tag, zero_shot
    from flodl_hf.tasks.image import classify_image, embed_image, embed_image_text, rank_images, zero_shot_image
    from flodl_hf.tokenization import AutoTokenizer, Tokenizer
    from flodl_hf.vision import AutoImageProcessor
    from flodl_hf.training.sync import DiLoCo, ElChe
    from flodl_hf.training.trainer import Trainer
