"""``zero_shot``: transformers' zero-shot-classification pipeline output.

An NLI model (a sequence classifier whose ``label2id`` has an entailment label) scores each
(sequence, hypothesis) pair, the hypothesis being ``hypothesis_template`` filled with a candidate
label. The pipeline forwards the pairs one at a time; we forward all of them, every sequence with
every label, through the padding-free batch planner (``flodl_hf.tasks.batching``), then regroup them per
sequence and apply the pipeline's own numpy post-processing. With ``batch_size=1`` each pair runs
alone, as in the pipeline, and the output is equal to it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from flodl_hf.core.errors import InputError
from flodl_hf.tokenization import Tokenizer, check_text
from flodl_hf.tasks.runtime import (BATCH_SIZE, BatchSize, Source, _MODEL_KEYS, _as_list, _check_texts, _encode,
                                    _rows, _run, load)

DEFAULT_HYPOTHESIS_TEMPLATE = "This example is {}."


def _parse_labels(candidate_labels: Any) -> list:
    """ZeroShotClassificationArgumentHandler._parse_labels: a string is split on commas, parts stripped,
    empty parts dropped; a list is taken as it is."""
    if isinstance(candidate_labels, str):
        return [label.strip() for label in candidate_labels.split(",") if label.strip()]
    if candidate_labels is None or isinstance(candidate_labels, (bytes, dict)):
        raise InputError(f"candidate_labels={candidate_labels!r}: expected a list of labels or a comma-separated "
                         "string of them")
    return _as_list(candidate_labels, "candidate_labels")


def _hypotheses(labels: list, hypothesis_template: Any) -> list[str]:
    """Each label in the template, after the pipeline's check (ZeroShotClassificationArgumentHandler.__call__):
    a template that the first label leaves unchanged has no place for the labels."""
    if not labels:
        raise InputError("candidate_labels is empty: give at least one label (a list, or a comma-separated string)")
    if not isinstance(hypothesis_template, str):
        raise InputError(f"hypothesis_template={hypothesis_template!r}: expected a string with {{}} where the "
                         "label goes")
    try:
        hypotheses = [hypothesis_template.format(label) for label in labels]
    except (IndexError, KeyError, ValueError) as exc:  # {0} with {1}, {label}, a lone brace: str.format's errors
        raise InputError(f'hypothesis_template="{hypothesis_template}" cannot be formatted with a label '
                         f"({type(exc).__name__}: {exc}); write {{}} where the label goes") from None
    if hypotheses[0] == hypothesis_template:
        raise InputError(f'hypothesis_template="{hypothesis_template}" was not able to be formatted with the target '
                         "labels. Make sure the passed template includes formatting syntax such as {} where the "
                         "label should go.")
    for i, hypothesis in enumerate(hypotheses):
        check_text(hypothesis, f"the hypothesis of candidate_labels[{i}]")
    return hypotheses


def entailment_id(config: Any) -> int:
    """The id of the first label in ``label2id`` starting with "entail" (any case), else -1, with the
    pipeline's warning (ZeroShotClassificationPipeline.entailment_id; -1 reads the last logit)."""
    for label, ind in (config.label2id or {}).items():
        if str(label).lower().startswith("entail"):
            return int(ind)
    warnings.warn("Failed to determine 'entailment' label id from the label2id mapping in the model config. "
                  "Setting to -1. Define a descriptive label2id mapping in the model config to ensure correct "
                  f"outputs (label2id: {dict(config.label2id or {})}).", UserWarning, stacklevel=3)
    return -1


def _postprocess(sequence: str, labels: list, logits: np.ndarray, entail: int, multi_label: bool) -> dict:
    """ZeroShotClassificationPipeline.postprocess, operation for operation, on one sequence's
    ``(len(labels), num_labels)`` float32 logits (so the float results are the same bits)."""
    n = len(labels)
    reshaped_outputs = logits.reshape((1, n, -1))
    if multi_label or n == 1:
        # softmax over the entailment vs. contradiction dim for each label independently
        contradiction_id = -1 if entail == 0 else 0
        entail_contr_logits = reshaped_outputs[..., [contradiction_id, entail]]
        scores = np.exp(entail_contr_logits) / np.exp(entail_contr_logits).sum(-1, keepdims=True)
        scores = scores[..., 1]
    else:
        # softmax the "entailment" logits over all candidate labels (no max subtracted, as there)
        entail_logits = reshaped_outputs[..., entail]
        scores = np.exp(entail_logits) / np.exp(entail_logits).sum(-1, keepdims=True)
    top_inds = list(reversed(scores[0].argsort()))
    return {"sequence": sequence, "labels": [labels[i] for i in top_inds], "scores": scores[0, top_inds].tolist()}


def zero_shot(sequences: str | Sequence[str], candidate_labels: str | Sequence[str], model: Source,
              hypothesis_template: str = DEFAULT_HYPOTHESIS_TEMPLATE, multi_label: bool = False,
              tokenizer: str | Path | Tokenizer | None = None, batch_size: BatchSize = BATCH_SIZE,
              precision: str = "exact") -> dict | list[dict]:
    """Classify texts into labels chosen at call time, with an NLI model: transformers' zero-shot-classification
    output, ``{"sequence", "labels", "scores"}`` per text (a dict for one string, a list for a list), labels
    sorted by score.

    Each text is the premise, each label in ``hypothesis_template`` a hypothesis; a label's score is the
    softmax of the entailment logits across the labels, or with ``multi_label=True`` (or a single label) the
    softmax of entailment against contradiction for each label on its own. ``candidate_labels`` is a list or
    a comma-separated string. Long texts are cut, never the hypotheses (the pipeline's ``only_first``).
    """
    labels = _parse_labels(candidate_labels)
    hypotheses = _hypotheses(labels, hypothesis_template)
    single = isinstance(sequences, str)
    items = [sequences] if single else _as_list(sequences, "sequences")
    _check_texts(items, "sequences")
    for i, text in enumerate(items):
        if not text:  # the pipeline: "You must include at least one label and at least one sequence."
            raise InputError(f"sequences[{i}] is empty: give at least one character of text")
    loaded = load(model, "seqcls", tokenizer, precision, function="zero_shot")
    entail = entailment_id(loaded.model.config)
    if not items:
        return []
    n = len(labels)
    premises = [text for text in items for _ in range(n)]
    try:
        enc = _encode(loaded, premises, hypotheses * len(items), truncation="only_first")
    except InputError as exc:
        if "too short" not in str(exc):
            raise
        # Only the premise may be cut (the pipeline's only_first), and a hypothesis alone fills the model. The
        # pipeline then retries without truncation and fails in the model, or runs past the tokenizer's limit.
        raise InputError(f'hypothesis_template="{hypothesis_template}" with candidate_labels {labels}: a hypothesis '
                         f"leaves no room for the sequence within the model's maximum of {loaded.max_length} tokens; "
                         "shorten the template or the labels") from None
    outputs = _run(loaded, _rows(enc, _MODEL_KEYS), batch_size, {"logits": False})
    results = []
    for k, text in enumerate(items):
        logits = np.stack([out["logits"].numpy() for out in outputs[k * n:(k + 1) * n]])
        results.append(_postprocess(text, labels, logits, entail, multi_label))
    return results[0] if single else results
