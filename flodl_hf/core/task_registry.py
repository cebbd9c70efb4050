"""The task registry: every task a model can be built for, declared once.

A task is its name (as the CLI and the Auto classes spell it), transformers' class-name
suffix (``ForMaskedLM``), transformers' Auto class and Auto mapping (for parity, export and
the verify matrix), our output record, its loss, and the default task model with the
``Family`` factory that builds its head part. Everything that lists tasks reads this table:
the registry's architecture names, ``auto``, ``parity``, ``export``, ``verify``, the CLI's
``--head`` choices and the parity tests.

The six core tasks are registered here. A family may add its own (ELECTRA's
``pretraining``) with :func:`register_task` and list it in ``Family.tasks``; such a task
belongs to the families that declare it (``core=False``), so the verify matrix only asks
those families for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from flodl_hf.core.errors import UnsupportedModelError
from flodl_hf.core.outputs import (BaseModelOutput, MaskedLMOutput, ModelOutput, MultipleChoiceModelOutput,
                                   QuestionAnsweringModelOutput, SequenceClassifierOutput, TokenClassifierOutput)

if TYPE_CHECKING:
    from flodl_hf.core.modeling import PreTrainedModel

# loss(model, logits, num_items_in_batch=None, **labels) -> scalar; the labels are the task model's keyword
# arguments. Every loss takes num_items_in_batch (transformers' gradient-accumulation count) and honours it only
# where the model's family lists the task in ``num_items_tasks`` (``counted_items``); elsewhere it is ignored,
# as transformers ignores it there.
Loss = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Task:
    """One task: names on both sides, output record, loss, and the default model that runs it."""

    name: str                      # "mlm": the CLI's and our Auto classes' spelling
    suffix: str                    # "ForMaskedLM": arch + suffix is transformers' class name
    auto_class: str                # "AutoModelForMaskedLM": transformers' Auto class (parity reference)
    hf_mapping: str                # transformers.models.auto.modeling_auto mapping of model_type -> class
    output: type[ModelOutput]
    head_factory: str | None       # the Family classmethod that builds the head part (None: bare backbone)
    model: str | None = None       # "package.module:Class" of the default task model (None: the backbone)
    loss: Loss | None = None
    core: bool = True              # False: added by a family; only families declaring it have the cell
    # (model_type, class name) pairs for a task transformers has no Auto mapping for (GPT2DoubleHeadsModel)
    classes: tuple[tuple[str, str], ...] = ()

    def model_class(self) -> type["PreTrainedModel"]:
        """The default task model (imported lazily: the heads import the model contract)."""
        if self.model is None:
            raise UnsupportedModelError(f"task {self.name!r} runs the family's backbone, not a task model")
        module, _, name = self.model.partition(":")
        return getattr(importlib.import_module(module), name)


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Add a task (a family adding its own calls this at import). Re-registering the same task is a no-op."""
    known = _TASKS.get(task.name)
    if known is not None and known != task:
        raise ValueError(f"task {task.name!r} is already registered differently")
    _TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    _ensure_families()
    try:
        return _TASKS[name]
    except KeyError:
        raise UnsupportedModelError(f"task {name!r} is not known; known tasks: {', '.join(task_names())}") from None


def task_names(core_only: bool = False) -> tuple[str, ...]:
    """Every registered task name (core first, then those families added), or the core ones only."""
    _ensure_families()
    return tuple(t.name for t in _TASKS.values() if t.core or not core_only)


def tasks() -> tuple[Task, ...]:
    _ensure_families()
    return tuple(_TASKS.values())


def _ensure_families() -> None:
    from flodl_hf.core.registry import _ensure_loaded  # families register their own tasks when imported
    _ensure_loaded()


# ---- losses, as transformers computes them ----------------------------------------------------------

def counted_items(model: Any, num_items_in_batch: Any) -> Any:
    """``num_items_in_batch`` where transformers' model of this family and task hands it to its loss, else None.

    transformers' task heads all take ``num_items_in_batch`` (through ``**kwargs``, for gradient accumulation);
    only those whose loss is ``self.loss_function(..., **kwargs)`` read it, and there the loss is the sum over
    the batch divided by it (``transformers.loss.loss_utils.fixed_cross_entropy``). Which heads those are
    differs per family (ModernBERT's masked LM and QA, the decoders' QA and causal LM; no BERT-lineage head),
    so the family says so once, in ``Family.num_items_tasks``; every other head accepts it and ignores it."""
    if num_items_in_batch is None:
        return None
    return num_items_in_batch if model.task in model.family.num_items_tasks else None


def fixed_cross_entropy(source: torch.Tensor, target: torch.Tensor, num_items_in_batch: Any = None,
                        ignore_index: int = -100) -> torch.Tensor:
    """transformers.loss.loss_utils.fixed_cross_entropy: the mean, or the sum divided by ``num_items_in_batch``."""
    if num_items_in_batch is None:
        return F.cross_entropy(source, target, ignore_index=ignore_index)
    loss = F.cross_entropy(source, target, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def token_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Cross entropy over every token, label -100 ignored (masked LM, token classification); where the family
    counts items (``counted_items``), transformers' ForMaskedLMLoss: float logits, sum / num_items_in_batch."""
    counted = counted_items(model, num_items_in_batch)
    if counted is None:
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.to(logits.device).view(-1))
    logits = logits.float()
    return fixed_cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1).to(logits.device), counted)


def choice_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Cross entropy over the choices; ``num_items_in_batch`` is ignored (every family's transformers head does)."""
    return F.cross_entropy(logits, labels.to(logits.device))


def sequence_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor,
                  num_items_in_batch: Any = None) -> torch.Tensor:
    """The family's rule (transformers' shared one unless the family has its own, as DeBERTa does);
    ``num_items_in_batch`` is ignored, as every family's transformers head ignores it (the decoders' generic
    head calls ``loss_function`` without it)."""
    return model.family.sequence_loss(logits, labels.to(logits.device), model.config)


def span_loss(model: Any, logits: tuple[torch.Tensor, torch.Tensor], start_positions: torch.Tensor,
              end_positions: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Mean of start and end cross entropies; positions outside the sequence are clamped to an ignored index.
    Where the family counts items (``counted_items``), each is the sum / num_items_in_batch, as
    ForQuestionAnsweringLoss."""
    start_logits, end_logits = logits
    if start_positions.dim() > 1:
        start_positions = start_positions.squeeze(-1)
    if end_positions.dim() > 1:
        end_positions = end_positions.squeeze(-1)
    ignored = start_logits.size(1)
    start_positions = start_positions.to(start_logits.device).clamp(0, ignored)
    end_positions = end_positions.to(end_logits.device).clamp(0, ignored)
    counted = counted_items(model, num_items_in_batch)
    return (fixed_cross_entropy(start_logits, start_positions, counted, ignore_index=ignored)
            + fixed_cross_entropy(end_logits, end_positions, counted, ignore_index=ignored)) / 2


_HEADS = "flodl_hf.heads"
for _task in (
    Task("base", "Model", "AutoModel", "MODEL_MAPPING_NAMES", BaseModelOutput, None),
    Task("seqcls", "ForSequenceClassification", "AutoModelForSequenceClassification",
         "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", SequenceClassifierOutput, "sequence_head",
         f"{_HEADS}.sequence_classification:ModelForSequenceClassification", sequence_loss),
    Task("tokcls", "ForTokenClassification", "AutoModelForTokenClassification",
         "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", TokenClassifierOutput, "token_head",
         f"{_HEADS}.token_classification:ModelForTokenClassification", token_loss),
    Task("qa", "ForQuestionAnswering", "AutoModelForQuestionAnswering",
         "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", QuestionAnsweringModelOutput, "span_head",
         f"{_HEADS}.question_answering:ModelForQuestionAnswering", span_loss),
    Task("mlm", "ForMaskedLM", "AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", MaskedLMOutput,
         "lm_head", f"{_HEADS}.masked_lm:ModelForMaskedLM", token_loss),
    Task("mc", "ForMultipleChoice", "AutoModelForMultipleChoice", "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
         MultipleChoiceModelOutput, "multiple_choice_head",
         f"{_HEADS}.multiple_choice:ModelForMultipleChoice", choice_loss),
):
    register_task(_task)

CORE_TASKS = tuple(_TASKS)


def hf_mapping(task: str) -> dict[str, str]:
    """transformers' model_type -> class name mapping for ``task`` ({} where transformers has none)."""
    from transformers.models.auto import modeling_auto
    spec = get_task(task)
    return dict(spec.classes) if spec.classes else getattr(modeling_auto, spec.hf_mapping, {})


class TaskField(Mapping):
    """A read-only view ``task name -> one field of its Task`` over the live registry (for code that
    wants a table, such as ``parity.REFERENCE_CLASSES``)."""

    def __init__(self, field: str) -> None:
        self._field = field

    def __getitem__(self, name: str) -> Any:
        if name not in task_names():
            raise KeyError(name)
        return getattr(get_task(name), self._field)

    def __iter__(self):
        return iter(task_names())

    def __len__(self) -> int:
        return len(task_names())
