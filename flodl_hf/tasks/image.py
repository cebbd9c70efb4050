"""The image one-liners: ``classify_image`` (transformers' image-classification pipeline output) and
``embed_image`` (image embeddings: CLIP's and SigLIP's image features, else the CLS token of the last layer, which
is DINOv2's ``pooler_output``)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from flodl_hf.core.errors import InputError
from flodl_hf.tasks.image_runtime import as_images, load_images, pixel_rows, run_images
from flodl_hf.tasks.runtime import BATCH_SIZE, BatchSize, Source, _check_top_k, _np_sigmoid, _np_softmax
from flodl_hf.vision import ImageProcessor

FUNCTIONS = ("sigmoid", "softmax", "none")


def _function(config: Any, function_to_apply: str | None) -> str:
    """``ImageClassificationPipeline.postprocess``'s rule: none for regression, sigmoid for multi-label or one
    label, else softmax; ``function_to_apply`` overrides it."""
    if function_to_apply is not None:
        function = str(function_to_apply).lower()
        if function not in FUNCTIONS:
            raise InputError(f"function_to_apply={function_to_apply!r}: expected 'sigmoid', 'softmax' or 'none'")
        return function
    problem = getattr(getattr(config, "problem_type", None), "value", getattr(config, "problem_type", None))
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification" or config.num_labels == 1:
        return "sigmoid"
    return "softmax"


def classify_image(images: Any, model: Source, top_k: int = 5, function_to_apply: str | None = None,
                   processor: str | Path | ImageProcessor | None = None, batch_size: BatchSize = BATCH_SIZE,
                   precision: str = "exact") -> list:
    """Classify images: what ``pipeline("image-classification")`` returns, the same labels in the same order.

    ``images``: a path, a PIL image, an array or tensor, or a list of them. Per image, the ``top_k`` best
    ``{"label", "score"}`` (at most the number of labels), sorted by score; a list of such lists for a list of
    images. Scores are the softmax, the sigmoid (multi-label, one label) or the raw logits (regression), unless
    ``function_to_apply`` says otherwise. Images run in batches (``batch_size``, as the text tasks), so scores may
    differ from the pipeline's (one image per pass) by ulps.
    """
    _check_top_k(top_k)
    loaded = load_images(model, "image_classification", processor, precision, "classify_image")
    items, single = as_images(images)
    if not items:
        return []
    config = loaded.model.config
    function = _function(config, function_to_apply)
    logits = run_images(loaded, pixel_rows(loaded, items), batch_size,
                        lambda m, pixels, plain: m(pixel_values=pixels, **plain).logits)
    keep = min(top_k, config.num_labels)
    results = []
    for row in logits:
        values = row.numpy()
        scores = _np_sigmoid(values) if function == "sigmoid" else _np_softmax(values) if function == "softmax" \
            else values
        ranked = sorted(({"label": config.id2label[i], "score": s.item()} for i, s in enumerate(scores)),
                        key=lambda x: x["score"], reverse=True)
        results.append(ranked[:keep])
    return results[0] if single else results


def _image_embedding(model: torch.nn.Module) -> Any:
    """How a model embeds an image: its ``get_image_features`` (CLIP, SigLIP), else the CLS token."""
    features = getattr(model, "get_image_features", None)
    if features is not None:
        def forward(m, pixels, plain):
            out = features(pixel_values=pixels)
            return out if isinstance(out, torch.Tensor) else out.pooler_output
        return forward
    return lambda m, pixels, plain: m(pixel_values=pixels, **plain).last_hidden_state[:, 0]


def embed_image(images: Any, model: Source, normalize: bool = False,
                processor: str | Path | ImageProcessor | None = None, batch_size: BatchSize = BATCH_SIZE,
                precision: str = "exact") -> torch.Tensor:
    """Image embeddings, one row per image: CLIP's and SigLIP's image features (``get_image_features``), else
    the CLS token of the last hidden state (DINOv2's ``pooler_output``, ViT's CLS before its pooler).
    ``normalize``: each row divided by its L2 norm (as CLIP's scores do)."""
    loaded = load_images(model, "base", processor, precision, "embed_image")
    items, _ = as_images(images)
    if not items:
        return torch.empty(0)
    rows = run_images(loaded, pixel_rows(loaded, items), batch_size, _image_embedding(loaded.model))
    out = torch.stack(rows)
    return out / out.norm(p=2, dim=-1, keepdim=True) if normalize else out


DEFAULT_IMAGE_TEMPLATE = "This is a photo of {}."


def _text_options(model: torch.nn.Module) -> tuple[bool, dict[str, Any]]:
    """(sigmoid scores?, the tokenizer's options), as the zero-shot image pipeline picks them: SigLIP's texts
    padded to 64 tokens and scored by a sigmoid, CLIP's padded together and scored by a softmax."""
    if "siglip" in str(model.config.model_type):
        return True, {"padding": "max_length", "max_length": 64, "truncation": True}
    return False, {"padding": True}


def zero_shot_image(images: Any, candidate_labels: list[str] | str, model: Source,
                    hypothesis_template: str = DEFAULT_IMAGE_TEMPLATE,
                    processor: str | Path | ImageProcessor | None = None, tokenizer: Any = None,
                    batch_size: BatchSize = BATCH_SIZE) -> list:
    """Score images against labels given now, with CLIP or SigLIP: what ``pipeline("zero-shot-image-
    classification")`` returns (per image, ``{"score", "label"}`` for every label, best first; a list of such
    lists for a list of images). Each label is put in ``hypothesis_template``; CLIP's scores are the softmax of
    ``logits_per_image`` over the labels, SigLIP's the sigmoid of each (its texts padded to 64 tokens, as there)."""
    from flodl_hf.tasks.runtime import load
    labels = [candidate_labels] if isinstance(candidate_labels, str) else list(candidate_labels or [])
    if not labels or not all(isinstance(label, str) and label for label in labels):
        raise InputError(f"candidate_labels={candidate_labels!r}: give one or more non-empty labels")
    if not isinstance(hypothesis_template, str) or "{}" not in hypothesis_template:
        raise InputError(f"hypothesis_template={hypothesis_template!r}: must hold '{{}}', where a label goes")
    loaded = load_images(model, "base", processor, "exact", "zero_shot_image")
    text_side = load(loaded.model if tokenizer is not None else model, "base", tokenizer, "exact", "zero_shot_image")
    sigmoid, options = _text_options(loaded.model)
    texts = text_side.tokenizer([hypothesis_template.format(label) for label in labels], return_tensors="pt",
                                **options)
    accepted = set(inspect.signature(loaded.model.forward).parameters)
    text_inputs = {k: texts[k] for k in texts.keys() if k in accepted and k != "pixel_values"}
    items, single = as_images(images)
    if not items:
        return []
    logits = run_images(loaded, pixel_rows(loaded, items), batch_size,
                        lambda m, pixels, plain: m(**text_inputs, pixel_values=pixels, **plain).logits_per_image)
    results = []
    for row in logits:
        scores = (torch.sigmoid(row) if sigmoid else row.softmax(dim=-1)).tolist()
        results.append([{"score": s, "label": label} for s, label in sorted(zip(scores, labels), key=lambda x: -x[0])])
    return results[0] if single else results



def embed_image_text(texts: list[str] | str, model: Source, normalize: bool = False, tokenizer: Any = None
                     ) -> torch.Tensor:
    """The text side of CLIP and SigLIP: ``get_text_features`` of each text, tokenised as the zero-shot pipeline
    tokenises (padded together; SigLIP's to 64 tokens). ``normalize``: each row divided by its L2 norm."""
    from flodl_hf.tasks.runtime import load
    items = [texts] if isinstance(texts, str) else list(texts)
    if not items or not all(isinstance(t, str) for t in items):
        raise InputError(f"texts={texts!r}: give one or more strings")
    loaded = load(model, "base", tokenizer, "exact", "embed_image_text")
    features = getattr(loaded.model, "get_text_features", None)
    if features is None:
        raise InputError(f"{loaded.source}: a {type(loaded.model).__name__} has no text features (CLIP or SigLIP "
                         "has)")
    _, options = _text_options(loaded.model)
    encoded = loaded.tokenizer(items, return_tensors="pt", **options)
    accepted = set(inspect.signature(features).parameters)
    with torch.inference_mode():
        out = features(**{k: encoded[k] for k in encoded.keys() if k in accepted})
    out = (out if isinstance(out, torch.Tensor) else out.pooler_output).float()
    return out / out.norm(p=2, dim=-1, keepdim=True) if normalize else out


def rank_images(text: str, images: Any, model: Source, top_k: int | None = None, **options: Any) -> list[dict]:
    """Images ranked by the cosine similarity of their features to ``text``'s (CLIP, SigLIP): ``{index, score}``,
    best first (``rank``'s shape, for images)."""
    if not isinstance(text, str) or not text:
        raise InputError(f"text={text!r}: give the text to rank the images against")
    if top_k is not None:
        _check_top_k(top_k)
    vectors = embed_image(images, model, normalize=True, **options)
    if not len(vectors):
        raise InputError("rank_images: no images to rank")
    query = embed_image_text(text, model, normalize=True)[0]
    scores = (vectors @ query).tolist()
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [{"index": i, "score": scores[i]} for i in order[:top_k]]
