"""``embed`` (sentence-transformers' pooling and normalisation) and ``rank`` (cosine order)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.tokenization import Tokenizer
from flodl_hf.tasks.runtime import (BATCH_SIZE, BatchSize, Loaded, Source, _MODEL_KEYS, _as_list, _check_texts,
                                    _check_top_k, _encode, _rows, _run, load)


# ---- the sentence-transformers layout: modules.json and the module folders ----------------------------
#
# sentence-transformers runs the modules modules.json lists, in order. We run the ones whose arithmetic
# we repeat with the same torch operations in the same order (so the result is bit-equal): the
# Transformer (our model, at the root), Pooling (every mode), Dense and Normalize. Any other module,
# option or value is a ConfigError naming the file and the field: never a silent, different vector.

POOLING_CONFIG = "1_Pooling/config.json"
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers < 5's boolean keys, in the order their modes are concatenated
_LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                        "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_POOLING_KEYS = {"embedding_dimension", "word_embedding_dimension", "pooling_mode", "include_prompt",
                 *_LEGACY_POOLING_KEYS}
_DENSE_KEYS = {"in_features", "out_features", "bias", "activation_function", "module_input_name",
               "module_output_name", "use_residual"}
_SENTENCE = "sentence_embedding"
_MODULE_CLASSES = ("Transformer", "Pooling", "Dense", "Normalize")


def _read_object(path: Path, name: str) -> dict:
    """A JSON object file of the layout; ConfigError naming ``name`` when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: cannot read {name} as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {name} must be a JSON object, found a {type(data).__name__}")
    return data


def _sentence_transformers_settings(root: Path | None) -> dict[str, Any]:
    """What sentence_bert_config.json says (max_seq_length, do_lower_case); the Transformer's other
    options must be the plain forward to last_hidden_state."""
    if root is None or not (root / "sentence_bert_config.json").is_file():
        return {}
    where = root / "sentence_bert_config.json"
    settings = _read_object(where, "sentence_bert_config.json")
    task = settings.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ConfigError(f"{where}: transformer_task={task!r}: embed runs the plain encoder "
                          "('feature-extraction') only")
    modality = settings.get("modality_config", {})
    text = modality.get("text", {}) if isinstance(modality, dict) else None
    if not isinstance(text, dict) or text.get("method", "forward") != "forward" \
            or text.get("method_output_name", "last_hidden_state") != "last_hidden_state":
        raise ConfigError(f"{where}: modality_config={settings.get('modality_config')!r}: embed reads the "
                          "encoder's last_hidden_state only (text: forward -> last_hidden_state)")
    if settings.get("module_output_name", "token_embeddings") != "token_embeddings":
        raise ConfigError(f"{where}: module_output_name={settings['module_output_name']!r}: expected "
                          "'token_embeddings'")
    return settings


def _check_prompt(root: Path | None) -> None:
    """sentence-transformers prepends a default prompt to every text; embed does not: refused."""
    where = None if root is None else root / "config_sentence_transformers.json"
    if where is None or not where.is_file():
        return
    config = _read_object(where, "config_sentence_transformers.json")
    name = config.get("default_prompt_name")
    if name is None:
        return
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or name not in prompts:
        raise ConfigError(f"{where}: default_prompt_name={name!r} is not one of its prompts")
    if prompts[name]:
        raise ConfigError(f"{where}: default_prompt_name={name!r} prepends the prompt {prompts[name]!r} to every "
                          "text, which embed does not do: prepend it yourself and use a copy without "
                          "default_prompt_name")


def _pooling_modes(config: dict, where: Path | str) -> tuple[str, ...]:
    """The modes of a Pooling config, read as sentence_transformers' Pooling reads them: ``pooling_mode``
    (a name, or a list of names concatenated in order), else the legacy ``pooling_mode_*`` booleans
    (several concatenated in their fixed order; none set: mean), else mean."""
    unknown = sorted(set(config) - _POOLING_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}: embed would not pool as "
                          "sentence-transformers does")
    include_prompt = config.get("include_prompt", True)
    if not isinstance(include_prompt, bool):  # without a prompt (embed adds none) either value pools alike
        raise ConfigError(f"{where}: include_prompt={include_prompt!r}: expected true or false")
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode) if isinstance(mode, (list, tuple)) else None
    else:
        legacy = [key for key in _LEGACY_POOLING_KEYS if key in config]
        for key in legacy:
            if not isinstance(config[key], bool):
                raise ConfigError(f"{where}: {key}={config[key]!r}: expected true or false")
        modes = tuple(m for k, m in _LEGACY_POOLING_KEYS.items() if config.get(k)) or ("mean",)
    if not modes or any(m not in POOLING_MODES for m in modes):
        raise ConfigError(f"{where}: pooling_mode={config.get('pooling_mode')!r}: expected one of "
                          f"{', '.join(POOLING_MODES)}, or a list of them")
    return modes


def _pool(tokens: torch.Tensor, attention_mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """sentence_transformers.models.Pooling's padded forward (6.3), op for op, on one batch."""
    output_vectors = []
    accumulation_dtype = torch.float32 if tokens.dtype in (torch.float16, torch.bfloat16) else tokens.dtype
    mean_sum = mean_mask = None
    for mode in modes:
        if mode == "cls":
            first_indices = attention_mask.to(torch.int).argmax(dim=1)
            gather_indices = first_indices.unsqueeze(-1).unsqueeze(1).expand(-1, 1, tokens.shape[-1])
            output_vectors.append(torch.gather(tokens, 1, gather_indices).squeeze(1))
        elif mode == "max":
            mask = attention_mask.unsqueeze(-1).expand_as(tokens).to(tokens.dtype)
            output_vectors.append(tokens.masked_fill(mask == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            if mean_sum is None:
                mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
                mean_sum = (tokens * mask).sum(dim=1, dtype=accumulation_dtype)
                mean_mask = torch.clamp(mask.sum(dim=1, dtype=accumulation_dtype), min=1e-9)
            denominator = mean_mask if mode == "mean" else torch.sqrt(mean_mask)
            output_vectors.append((mean_sum / denominator).to(tokens.dtype))
        elif mode == "weightedmean":
            mask = attention_mask.unsqueeze(-1).to(accumulation_dtype)
            weights = torch.arange(1, tokens.shape[1] + 1, dtype=accumulation_dtype).view(1, -1, 1)
            if attention_mask.numel():
                weights = weights - attention_mask.to(torch.int32).argmax(dim=1).view(-1, 1, 1)
            weighted_mask = mask * weights
            sum_embeddings = (tokens * weighted_mask).sum(dim=1)
            sum_mask = weighted_mask.sum(dim=1)
            output_vectors.append((sum_embeddings / torch.clamp(sum_mask, min=1e-9)).to(tokens.dtype))
        else:  # lasttoken
            seq_len, hidden_dim = tokens.shape[1], tokens.shape[2]
            values, indices = attention_mask.flip(1).max(1)
            indices = torch.where(values == 0, seq_len - 1, indices)
            gather_indices = (seq_len - indices - 1).unsqueeze(-1).unsqueeze(1).expand(-1, 1, hidden_dim)
            mask = attention_mask.unsqueeze(-1).expand_as(tokens).to(tokens.dtype)
            output_vectors.append(torch.gather(tokens * mask, 1, gather_indices).squeeze(dim=1))
    return torch.cat(output_vectors, dim=-1)


def _activation(name: object, where: Path) -> nn.Module:
    """The Dense activation sentence-transformers builds from its config: a torch.nn.Module class,
    constructed without arguments (the same module, so the same arithmetic)."""
    import importlib
    import inspect
    if not isinstance(name, str) or not name.startswith("torch.") or "." not in name:
        raise ConfigError(f"{where}: activation_function={name!r}: embed runs torch.nn activation modules only "
                          "(sentence-transformers would need trust_remote_code for this one)")
    module_path, class_name = name.rsplit(".", 1)
    try:
        found = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where}: activation_function={name!r} does not exist in this torch ({exc})") from exc
    if not (inspect.isclass(found) and issubclass(found, nn.Module)):
        raise ConfigError(f"{where}: activation_function={name!r} is not a torch.nn.Module class")
    try:
        return found()
    except TypeError as exc:
        raise ConfigError(f"{where}: activation_function={name!r} cannot be built without arguments ({exc})") from exc


def _dense(folder: Path, name: str) -> dict:
    """A sentence_transformers Dense module: its config and weights (cast to float32, as loading them into
    sentence-transformers' float32 nn.Linear does)."""
    from flodl_hf.core import io
    where = folder / "config.json"
    config = _read_object(where, f"{name}/config.json")
    unknown = sorted(set(config) - _DENSE_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown Dense field(s) {', '.join(unknown)}: refused rather than ignored")
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, _SENTENCE) not in (_SENTENCE, None):
            raise ConfigError(f"{where}: {key}={config[key]!r}: embed runs Dense on {_SENTENCE!r} only")
    for key in ("in_features", "out_features"):
        if not isinstance(config.get(key), int) or isinstance(config.get(key), bool) or config[key] < 1:
            raise ConfigError(f"{where}: {key}={config.get(key)!r}: expected a positive integer")
    for key, default in (("bias", True), ("use_residual", False)):
        if not isinstance(config.get(key, default), bool):
            raise ConfigError(f"{where}: {key}={config[key]!r}: expected true or false")
    activation = _activation(config.get("activation_function", "torch.nn.modules.activation.Tanh"), where)
    tensors = io.load_tensors(io.resolve(str(folder)))
    n_in, n_out, bias = config["in_features"], config["out_features"], config.get("bias", True)
    residual = config.get("use_residual", False)
    shapes = {"linear.weight": (n_out, n_in)}
    if bias:
        shapes["linear.bias"] = (n_out,)
    if residual and n_in != n_out:
        shapes["residual.weight"] = (n_out, n_in)
    for key, shape in shapes.items():
        if key not in tensors or tuple(tensors[key].shape) != shape:
            found = tuple(tensors[key].shape) if key in tensors else "nothing"
            raise ConfigError(f"{folder}: the Dense weights need {key} of shape {shape} (from {name}/config.json), "
                              f"found {found}")
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise ConfigError(f"{folder}: unexpected Dense weights {', '.join(extra)}")
    weights = {k: v.to(torch.float32) for k, v in tensors.items()}
    return {"kind": "Dense", "weight": weights["linear.weight"], "bias": weights.get("linear.bias"),
            "activation": activation, "residual": residual, "residual_weight": weights.get("residual.weight"),
            "in_features": n_in}


def _normalize_module(folder: Path, name: str) -> dict:
    where = folder / "config.json"
    if where.is_file():
        config = _read_object(where, f"{name}/config.json")
        for key in ("module_input_name", "module_output_name"):
            if config.get(key, _SENTENCE) not in (_SENTENCE, None):
                raise ConfigError(f"{where}: {key}={config[key]!r}: embed runs Normalize on {_SENTENCE!r} only")
    return {"kind": "Normalize"}


def _modules(root: Path | None) -> list[dict] | None:
    """The steps after the encoder, read from ``root``'s modules.json (None: no modules.json there).

    Each step: {"kind": "Pooling", "modes"}, {"kind": "Dense", ...} or {"kind": "Normalize"}."""
    from flodl_hf.core import source_files
    listed = None if root is None else root / source_files.MODULES_NAME
    if listed is None or not (listed.exists() or listed.is_symlink()):
        return None
    where = root / source_files.MODULES_NAME
    entries = source_files.read_modules(root)
    paths = [source_files.module_path(e, i, where) for i, e in enumerate(entries)]
    steps: list[dict] = []
    for index, (entry, rel) in enumerate(zip(entries, paths)):
        kind = str(entry.get("type", ""))
        name = kind.rpartition(".")[2]
        folder = root if rel is None else root / rel
        label = f"{where}: entry {index} (type {kind!r})"
        if not kind.startswith("sentence_transformers.") or name not in _MODULE_CLASSES:
            raise ConfigError(f"{label}: embed runs the sentence-transformers modules Transformer, Pooling, Dense "
                              "and Normalize only; this one would give a different vector")
        if name == "Transformer":
            if index != 0 or rel is not None:
                raise ConfigError(f"{label}: the Transformer must be the first module, at the model root "
                                  f"(path ''), found index {index} path {entry.get('path')!r}")
            continue
        if index == 0:
            raise ConfigError(f"{label}: the first module must be the Transformer")
        if name == "Pooling":
            if any(s["kind"] == "Pooling" for s in steps):
                raise ConfigError(f"{label}: a second Pooling module")
            steps.append({"kind": "Pooling",
                          "modes": _pooling_modes(_read_object(folder / "config.json", f"{rel}/config.json"),
                                                  folder / "config.json")})
            continue
        if not steps:
            raise ConfigError(f"{label}: {name} before the Pooling module: embed runs it on the sentence "
                              "embedding only")
        steps.append(_dense(folder, str(rel)) if name == "Dense" else _normalize_module(folder, str(rel)))
    if not entries or not any(s["kind"] == "Pooling" for s in steps):
        raise ConfigError(f"{where}: no Pooling module: sentence-transformers would give no sentence embedding")
    return steps


def _apply(step: dict, vector: torch.Tensor) -> torch.Tensor:
    """A Dense or Normalize module on one (1, dim) row, as sentence-transformers runs it."""
    if step["kind"] == "Normalize":
        return torch.nn.functional.normalize(vector, p=2, dim=-1)
    if vector.shape[-1] != step["in_features"]:
        raise ConfigError(f"Dense takes {step['in_features']} features (its config.json in_features), the "
                          f"sentence embedding before it has {vector.shape[-1]}")
    out = step["activation"](torch.nn.functional.linear(vector, step["weight"], step["bias"]))
    if step["residual"]:
        weight = step["residual_weight"]
        residual = vector if weight is None else torch.nn.functional.linear(vector, weight)
        out = out + residual
    return out


def _text_tower(texts: str | Sequence[str], loaded: Loaded, pooling: str | None, normalize: bool) -> torch.Tensor:
    """``embed`` on a CLIP or SigLIP model: ``get_text_features`` of the texts, tokenised as the zero-shot image
    pipeline tokenises them (``flodl_hf.tasks.image.embed_image_text``), so they sit in the images' space."""
    from flodl_hf.tasks.image import embed_image_text
    if pooling is not None:
        raise InputError(f"pooling={pooling!r}: a {type(loaded.model).__name__}'s text embedding is its text "
                         "tower's projected features, which pool as the model does (leave pooling out)")
    single = isinstance(texts, str)
    items = [texts] if single else _as_list(texts)
    _check_texts(items)
    vectors = embed_image_text(items, loaded.model, normalize=normalize, tokenizer=loaded.tokenizer)
    return vectors[0] if single else vectors


def embed(texts: str | Sequence[str], model: Source, pooling: str | None = None, normalize: bool = True,
          tokenizer: str | Path | Tokenizer | None = None, batch_size: BatchSize = BATCH_SIZE,
          precision: str = "exact") -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them for the same checkpoint.

    A sentence-transformers directory runs the modules its ``modules.json`` lists, in order: the
    Transformer (at the root), Pooling (any of its modes: cls, max, mean, mean_sqrt_len_tokens,
    weightedmean, lasttoken, or several concatenated), Dense and Normalize; any other module is a
    ConfigError. Without modules.json: ``1_Pooling/config.json``'s pooling if there is one, else mean.
    ``pooling``: one of those modes, in place of the checkpoint's. ``normalize``: unit length (L2) at
    the end (once: not again after a final Normalize module); False returns what the checkpoint's
    modules give, which is unit length where they end in Normalize, as sentence-transformers' encode
    does. The input limit is ``sentence_bert_config.json``'s ``max_seq_length`` when it has one.
    A CLIP or SigLIP model gives its text tower's projected features (``get_text_features``), which ``embed_image``
    matches on the image side. Returns a float tensor: (dim,) for one text, (n, dim) for a list.
    """
    if pooling is not None:
        pooling = pooling.lower() if isinstance(pooling, str) else pooling
        if pooling not in POOLING_MODES:
            raise InputError(f"pooling={pooling!r}: expected one of {', '.join(repr(m) for m in POOLING_MODES)}")
    root = None
    if not isinstance(model, nn.Module):
        from flodl_hf.tokenization import tokenizer_directory
        root = tokenizer_directory(model)
    steps = _modules(root)
    if steps is None:  # no modules.json: the Transformer, then the pooling that 1_Pooling/config.json names
        modes: tuple[str, ...] = ("mean",)
        if root is not None and (root / POOLING_CONFIG).is_file():
            modes = _pooling_modes(_read_object(root / POOLING_CONFIG, POOLING_CONFIG), root / POOLING_CONFIG)
        steps = [{"kind": "Pooling", "modes": modes}]
    if pooling is not None:
        steps = [{"kind": "Pooling", "modes": (pooling,)} if s["kind"] == "Pooling" else s for s in steps]
    settings = _sentence_transformers_settings(root)
    _check_prompt(root)
    loaded = load(model, "base", tokenizer, precision)
    if hasattr(loaded.model, "get_text_features"):  # CLIP, SigLIP: the text tower's projected features
        return _text_tower(texts, loaded, pooling, normalize)
    if settings.get("max_seq_length"):
        loaded = Loaded(loaded.model, loaded.tokenizer, min(loaded.max_length, int(settings["max_seq_length"])),
                        loaded.source, loaded.precision)
    single = isinstance(texts, str)
    items = [texts] if single else _as_list(texts)
    _check_texts(items)
    if settings.get("do_lower_case"):
        items = [t.lower() for t in items]
    if not items:  # an empty batch: an empty (0, dim) result, as sentence-transformers gives
        config = loaded.model.config
        width = getattr(config, "hidden_size", None) or getattr(config, "dim", 0)
        for step in steps:
            width = len(step["modes"]) * width if step["kind"] == "Pooling" else \
                step["weight"].shape[0] if step["kind"] == "Dense" else width
        return torch.empty((0, width), dtype=torch.float32)
    enc = _encode(loaded, items)
    rows = _rows(enc, _MODEL_KEYS)
    outputs = _run(loaded, rows, batch_size, {"last_hidden_state": True})
    vectors = []
    for row, out in zip(rows, outputs):
        # sentence-transformers' modules after the Transformer, on one (unpadded) row
        vector = None
        for step in steps:
            if step["kind"] == "Pooling":
                vector = _pool(out["last_hidden_state"][None], torch.tensor(row["attention_mask"])[None],
                               step["modes"])
            else:
                vector = _apply(step, vector)
        vectors.append(vector)
    result = torch.cat(vectors)
    if normalize and steps[-1]["kind"] != "Normalize":
        result = torch.nn.functional.normalize(result, p=2, dim=1)
    return result[0] if single else result


def rank(query: str, texts: Sequence[str], model: Source, top_k: int | None = None, **embed_options: Any) -> list[dict]:
    """Texts ranked by cosine similarity of their embeddings to ``query``: ``{index, text, score}``, best first."""
    texts = _as_list(texts)
    _check_texts([query], "query")
    _check_texts(texts)
    _check_top_k(top_k, allow_none=True)
    if not texts:
        raise InputError("rank: no texts to rank")
    vectors = embed([query, *texts], model, **{"normalize": True, **embed_options})
    vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
    scores = (vectors[1:] @ vectors[0]).tolist()
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    return [{"index": i, "text": texts[i], "score": scores[i]} for i in order[:top_k]]
