"""Head shapes, each written once: the task models and the default head parts.

A task model is a backbone plus a HeadPart the family builds (``Family.sequence_head``
and friends). The defaults here serve the BERT lineage; a family overrides a
factory only where its head differs. Which task model runs which task is the task
registry's (``flodl_hf.core.registry``) and the family's (``Family.task_models``).
"""

from .image_classification import ClsTokenClassifier, ModelForImageClassification
from .masked_image_modeling import ModelForMaskedImageModeling, PixelDecoder
from .masked_lm import ModelForMaskedLM
from .multiple_choice import ModelForMultipleChoice
from .question_answering import ModelForQuestionAnswering, SpanClassifier
from .sequence_classification import ModelForSequenceClassification, PooledClassifier
from .token_classification import ModelForTokenClassification, TokenClassifier

__all__ = [
    "ClsTokenClassifier", "ModelForImageClassification", "ModelForMaskedImageModeling", "PixelDecoder",
    "ModelForMaskedLM", "ModelForMultipleChoice", "ModelForQuestionAnswering",
    "ModelForSequenceClassification", "ModelForTokenClassification", "PooledClassifier", "SpanClassifier",
    "TokenClassifier",
]
