"""Reading a tokenizer directory into a tokenizers backend and its TokenizerSettings, as transformers 5 does.

Where tokenizer.json holds the model of a class we have a recipe for (``flodl_hf.tokenization.recipes``), the
backend is rebuilt from that recipe and tokenizer_config.json's options; anything else is converted by
transformers itself. Also: where the tokenizer lives (``tokenizer_directory``), which class transformers would
pick (``class_name_for``), the chat template files, and the checks that refuse a bad file at load.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import os
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from flodl_hf.core import io
from flodl_hf.core.errors import CheckpointFormatError, ConfigError, FlodlHFError, InputError, SourceNotFoundError
from flodl_hf.core.source_files import allowed_roots, inside
from flodl_hf.tokenization.chat import _chat_template_value, _read_template_file
from flodl_hf.tokenization.recipes import RECIPES, Recipe
from flodl_hf.tokenization.settings import (CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, DIRECTORY_FILES, DIRECTORY_PATTERNS,
                                            SPECIAL_TOKEN_NAMES, SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, TOKENIZER_FILE,
                                            VERY_LARGE_INTEGER, TokenizerSettings)

# The tokenizer class transformers picks from config.json's model_type when tokenizer_config.json names none
# (transformers.models.auto.tokenization_auto.TOKENIZER_MAPPING_NAMES, for our families).
CLASS_FOR_MODEL_TYPE = {
    "bert": "BertTokenizer",
    "distilbert": "BertTokenizer",
    "electra": "BertTokenizer",
    "roberta": "RobertaTokenizer",
    "camembert": "CamembertTokenizer",
    "xlm-roberta": "XLMRobertaTokenizer",
    "roberta-prelayernorm": "RobertaTokenizer",
    "xlm-roberta-xl": "TokenizersBackend",  # as AutoTokenizer maps it in 5.25 (tokenizer.json as written)
    "nomic_bert": "BertTokenizer",
    "gte": "XLMRobertaTokenizer",
    "albert": "AlbertTokenizer",
    "deberta-v2": "DebertaV2Tokenizer",
    "deberta": "DebertaTokenizer",
    "mpnet": "MPNetTokenizer",
    "llama": "LlamaTokenizer",
    "mistral": "LlamaTokenizer",
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "phi3": "TokenizersBackend",
    "gemma": "GemmaTokenizer",
    "gemma2": "GemmaTokenizer",
    "gemma3_text": "GemmaTokenizer",
    "olmo2": "TokenizersBackend",
    "olmo3": "TokenizersBackend",
    "ministral": "TokenizersBackend",
    "granite": "TokenizersBackend",
    "mixtral": "TokenizersBackend",
    "qwen2_moe": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer",
    "olmoe": "GPTNeoXTokenizer",  # as AutoTokenizer maps olmoe: byte-level BPE, no recipe: transformers builds it
    "stablelm": "TokenizersBackend",
    "starcoder2": "GPT2Tokenizer",  # byte-level BPE, no recipe: transformers builds it
    "gpt2": "GPT2Tokenizer",  # byte-level BPE, no recipe: transformers builds it (its post-processor from add_bos_token)
    "gpt_neox": "GPTNeoXTokenizer",  # byte-level BPE (tokenizer.json), no recipe: transformers builds it
    "gptj": "GPT2Tokenizer",  # as AutoTokenizer maps gptj: GPT-2's byte-level BPE
    "opt": "GPT2Tokenizer",  # as AutoTokenizer maps opt: GPT-2's byte-level BPE
    "phi": "GPT2Tokenizer",  # as AutoTokenizer maps phi: GPT-2's byte-level BPE
    "olmo": "GPTNeoXTokenizer",  # as AutoTokenizer maps olmo: byte-level BPE, no recipe: transformers builds it
    "cohere": "CohereTokenizer",  # byte-level BPE (tokenizer.json), no recipe: transformers builds it
}


# ---- chat templates ------------------------------------------------------------------------------
# Written from transformers 5.24's tokenization_utils_base.py (_from_pretrained's template files).

def _chat_settings(root: Path, file_config: dict, options: dict) -> dict[str, Any]:
    """The chat fields of TokenizerSettings as transformers' from_pretrained fills them: tokenizer_config.json's
    chat_template, replaced by chat_template.jinja (and additional_chat_templates/*.jinja) where present, replaced
    by a chat_template option; the model-specific special tokens (any other *_token string, and an
    extra_special_tokens object)."""
    where = f"{root / TOKENIZER_CONFIG}: chat_template"
    template = _chat_template_value(file_config.get("chat_template"), where, ConfigError)
    origin: str | dict[str, str] = {n: f"{where} ({n!r})" for n in template} if isinstance(template, dict) else where
    files: dict[str, str] = {}
    origins: dict[str, str] = {}
    if (root / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = _read_template_file(root / CHAT_TEMPLATE_FILE)
        origins["default"] = str(root / CHAT_TEMPLATE_FILE)
    if (root / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((root / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            name = path.name.removesuffix(".jinja")
            files[name] = _read_template_file(path)
            origins[name] = str(path)
    if list(files) == ["default"]:
        template, origin = files["default"], origins["default"]
    elif files:
        template, origin = files, origins
    if "chat_template" in options:
        where = "from_pretrained option chat_template"
        template = _chat_template_value(options["chat_template"], where, InputError)
        origin = {n: f"{where} ({n!r})" for n in template} if isinstance(template, dict) else where
    config = {**file_config, **options}
    specific = {k: v for k, v in config.items()
                if k.endswith("_token") and k not in SPECIAL_TOKEN_NAMES and isinstance(v, str)}
    if isinstance(config.get("extra_special_tokens"), dict):
        for key, value in config["extra_special_tokens"].items():
            text = _token_text(value)
            if isinstance(text, str):
                specific[key] = text
    return {"chat_template": template, "chat_template_origin": origin, "model_specific_tokens": specific,
            "response_template": config.get("response_template"), "directory": str(root)}


# ---- loading -----------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    """A tokenizer-side JSON object (io.read_json's checks), or {} where the file does not exist."""
    return io.read_json(path, path.name) if path.exists() or path.is_dir() else {}


def _token_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _added_token(value: Any, special: bool = True) -> AddedToken:
    if isinstance(value, dict):
        props = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in value}
        return AddedToken(value["content"], **props)
    return AddedToken(str(value), special=special)


def tokenizer_directory(source: str | os.PathLike, revision: str | None = None) -> Path:
    """The local directory holding a tokenizer: a directory, a file in one, or a model source (samples/, hub)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    return io.resolve(source, revision).root


def _check_inside(root: Path) -> None:
    """Refuse a tokenizer directory where a file read from it (settings.DIRECTORY_FILES and DIRECTORY_PATTERNS,
    additional_chat_templates/ and its templates) is a symlink out of it, or is reached through a linked folder that
    leaves it, as the weights loader refuses one (flodl_hf.core.source_files); transformers follows such a link.
    A link inside the directory, or from a hub snapshot into its cache's blobs/, is followed. Also refused: such a
    file that is a FIFO, socket or device (reading one would block, or never end)."""
    roots = allowed_roots(root)
    templates = root / CHAT_TEMPLATE_DIR
    paths = [*(root / name for name in DIRECTORY_FILES), *sorted(p for g in DIRECTORY_PATTERNS for p in root.glob(g))]
    for path in [*paths, templates]:
        _check_member(root, roots, path)
    if templates.is_dir():  # inside the directory, as just checked
        for path in sorted(templates.glob("*.jinja")):
            _check_member(root, roots, path)


def _check_member(root: Path, roots: list[Path], path: Path) -> None:
    if not (path.exists() or path.is_symlink()):
        return
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise CheckpointFormatError(f"{path}: cannot be resolved ({exc}): refused") from None
    if not inside(real, roots):
        how = f"is a symlink to {real}" if path.is_symlink() else f"resolves to {real} (through a linked folder)"
        raise CheckpointFormatError(f"{path}: {how}, outside the tokenizer directory {root}: refused, nothing "
                                    "outside it is read (copy the file in, or remove the link)")
    if real.exists() and not (real.is_file() or real.is_dir()):
        raise CheckpointFormatError(f"{path}: is not a regular file (a FIFO, socket or device): refused")


def class_name_for(root: Path, config: dict | None = None) -> str | None:
    """The tokenizer class transformers would pick for this directory (None: unknown)."""
    _check_inside(root)
    tok_config = _read_json(root / TOKENIZER_CONFIG) if config is None else config
    name = tok_config.get("tokenizer_class")
    model_config = _read_json(root / "config.json")
    if not name:
        name = model_config.get("tokenizer_class") or CLASS_FOR_MODEL_TYPE.get(model_config.get("model_type", ""))
    return name.removesuffix("Fast") if name else None


def read_tokenizer(source: str | os.PathLike, revision: str | None,
                   options: dict[str, Any]) -> tuple[BackendTokenizer, TokenizerSettings]:
    """The backend and settings of the tokenizer of ``source``, for ``AutoTokenizer.from_pretrained``;
    ``options`` override tokenizer_config.json, as in transformers."""
    root = tokenizer_directory(source, revision)
    _check_inside(root)
    file_config = _read_json(root / TOKENIZER_CONFIG)
    chat = _chat_settings(root, file_config, options)
    backend, settings = _load(root, source, {**file_config, **options}, options)
    for key, value in chat.items():
        setattr(settings, key, value)
    return backend, settings


def _load(root: Path, source: str | os.PathLike, tok_config: dict,
          options: dict) -> tuple[BackendTokenizer, TokenizerSettings]:
    """Build the backend from its class's recipe where tokenizer.json holds that recipe's model, else let
    transformers convert the directory."""
    _check_tokenizer_config(root, tok_config, options)
    class_name = class_name_for(root, tok_config)
    recipe = RECIPES.get(class_name or "")
    _check_switches(root, tok_config, options, recipe)
    tokenizer_json = root / TOKENIZER_FILE
    data = _read_json(tokenizer_json) if tokenizer_json.exists() else None
    if data is not None and not isinstance(data.get("model"), dict):
        raise ConfigError(f"{tokenizer_json}: not a tokenizers file: 'model' is "
                          f"{type(data.get('model')).__name__}, expected an object with a 'type'")
    if recipe is not None and data is not None and data["model"].get("type") == recipe.model_type:
        try:
            return _from_recipe(root, data, tok_config, class_name, recipe)
        except Exception as exc:  # noqa: BLE001 - tokenizers and our recipes raise many kinds on a bad file
            if isinstance(exc, FlodlHFError):
                raise
            raise ConfigError(f"{tokenizer_json}: cannot build the {class_name} tokenizer from it "
                              f"({type(exc).__name__}: {exc})") from exc
    _check_vocab_txt(root)
    return _from_transformers(root, str(source), options)


def _setting(root: Path, options: dict, key: str) -> str:
    """Where a tokenizer_config.json setting came from, for an error message."""
    return f"from_pretrained option {key}" if key in options else f"{root / TOKENIZER_CONFIG}: {key}"


def _check_special_token(value: Any, where: str) -> None:
    """A special token is a string, an AddedToken-style object with a string 'content', or null."""
    if value is None or isinstance(value, str):
        return
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return
    raise ConfigError(f"{where} is {value!r} ({type(value).__name__}): expected a token string or an "
                      "AddedToken object with a string 'content'")


def _is_max_length(value: Any) -> bool:
    """model_max_length as transformers writes it: a non-negative int, or an integral float (old files wrote
    the 'no limit' value 1e30 as a float)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, float) and math.isfinite(value) and value.is_integer() and value >= 0


def _check_switches(root: Path, tok_config: dict, options: dict, recipe: Recipe | None) -> None:
    """tokenizer_config.json's switches are true or false: bool("false") is True, so a string would turn one
    on unseen. Decoding and splitting in every class; a recipe's own options (do_lower_case, add_prefix_space...)
    where we build the tokenizer from its recipe (other classes, such as LLaMA's null add_prefix_space, are
    transformers' to read). Null is allowed where transformers takes it: BertTokenizer's strip_accents (follow
    do_lower_case) and clean_up_tokenization_spaces (off)."""
    switches = {"clean_up_tokenization_spaces": True, "split_special_tokens": False}
    if recipe is not None:
        switches.update({k: v is None for k, v in recipe.defaults.items() if isinstance(v, bool) or v is None})
    for key, nullable in switches.items():
        value = tok_config.get(key)
        if key in tok_config and not isinstance(value, bool) and not (value is None and nullable):
            raise ConfigError(f"{_setting(root, options, key)} is {value!r} ({type(value).__name__}): expected "
                              "true or false" + (" (or null)" if nullable else ""))


def _check_tokenizer_config(root: Path, tok_config: dict, options: dict) -> None:
    """Refuse at load the tokenizer_config.json values (or from_pretrained options) that would otherwise fail
    only when encoding, or be blamed on another file: sides, model_max_length, input names, special tokens."""
    for key in ("padding_side", "truncation_side"):
        if key in tok_config and tok_config[key] not in ("left", "right"):
            value = tok_config[key]
            raise ConfigError(f"{_setting(root, options, key)} is {value!r} ({type(value).__name__}): "
                              "expected 'left' or 'right'")
    for key in ("model_max_length", "max_len"):
        value = tok_config.get(key)
        if value is not None and not _is_max_length(value):
            raise ConfigError(f"{_setting(root, options, key)} is {value!r} ({type(value).__name__}): "
                              "expected a non-negative integer (the most tokens the model takes)")
    names = tok_config.get("model_input_names")
    if names is not None and not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        raise ConfigError(f"{_setting(root, options, 'model_input_names')} is {names!r}: expected a list of "
                          "input names such as [\"input_ids\", \"attention_mask\"]")
    for name in SPECIAL_TOKEN_NAMES:
        if name in tok_config:
            _check_special_token(tok_config[name], _setting(root, options, name))
    for key in ("extra_special_tokens", "additional_special_tokens"):
        if isinstance(tok_config.get(key), list):
            for i, value in enumerate(tok_config[key]):
                _check_special_token(value, f"{_setting(root, options, key)}[{i}]")


def _special_tokens(root: Path, tok_config: dict, defaults: dict) -> tuple[dict[str, Any], list[Any]]:
    """Named special tokens as transformers resolves them: tokenizer_config.json, then (legacy, when it has
    no added_tokens_decoder) special_tokens_map.json over it, then the class defaults."""
    values = {name: tok_config[name] for name in SPECIAL_TOKEN_NAMES if name in tok_config}
    extras = tok_config.get("extra_special_tokens") or tok_config.get("additional_special_tokens") or []
    if "added_tokens_decoder" not in tok_config:
        for name, value in _read_json(root / SPECIAL_TOKENS_MAP).items():
            if name in SPECIAL_TOKEN_NAMES:
                _check_special_token(value, f"{root / SPECIAL_TOKENS_MAP}: {name}")
                values[name] = value
            elif name in ("additional_special_tokens", "extra_special_tokens") and isinstance(value, list):
                for i, token in enumerate(value):
                    _check_special_token(token, f"{root / SPECIAL_TOKENS_MAP}: {name}[{i}]")
                extras = list(extras) + [v for v in value if v not in extras]
    for name in SPECIAL_TOKEN_NAMES:
        if name not in values and name in defaults:
            values[name] = defaults[name]
    return values, list(extras) if isinstance(extras, list) else []


def _charsmap(data: dict) -> bytes | None:
    """The SentencePiece precompiled charsmap in tokenizer.json's normaliser, as transformers extracts it."""
    section = data.get("normalizer") or {}
    steps = section.get("normalizers", []) if section.get("type") == "Sequence" else [section]
    for step in steps:
        if step.get("type") == "Precompiled" and "precompiled_charsmap" in step:
            return base64.b64decode(step["precompiled_charsmap"])
    return None


def _from_recipe(root: Path, data: dict, tok_config: dict, class_name: str,
                 recipe: Recipe) -> tuple[BackendTokenizer, TokenizerSettings]:
    specials, extras = _special_tokens(root, tok_config, recipe.defaults)
    options = {**recipe.defaults, **{k: v for k, v in tok_config.items() if k in recipe.defaults},
               **{k: _token_text(v) for k, v in specials.items()}}
    options["_spm_precompiled_charsmap"] = _charsmap(data)
    if recipe.model_type == "WordPiece":
        _check_wordpiece_unk(root / TOKENIZER_FILE, data["model"].get("vocab"), options.get("unk_token"))

    # The added tokens transformers puts on its fresh backend: tokenizer_config.json's added_tokens_decoder,
    # or (legacy) tokenizer.json's own list; then every special token not among them yet.
    if "added_tokens_decoder" in tok_config:
        listed = sorted(((int(i), t) for i, t in tok_config["added_tokens_decoder"].items()), key=lambda p: p[0])
        added = [_added_token(t) for _, t in listed]
    else:
        added = [_added_token({k: v for k, v in t.items() if k != "id"}) for t in data.get("added_tokens", [])]
    present = {t.content for t in added}
    for value in [*specials.values(), *extras]:
        text = _token_text(value)
        if text is not None and text not in present:
            added.append(_added_token(value) if isinstance(value, dict) else AddedToken(text, special=True))
            present.add(text)

    file_post_processor = data.get("post_processor")
    rebuilt = dict(data, added_tokens=[], normalizer=None, pre_tokenizer=None, post_processor=None, decoder=None,
                   truncation=None, padding=None, model=recipe.model(data["model"], options))
    backend = BackendTokenizer.from_str(json.dumps(rebuilt))
    backend.add_tokens(added)

    def token_id(token: str) -> int | None:
        index = backend.token_to_id(token)
        return backend.token_to_id(options["unk_token"]) if index is None and options.get("unk_token") else index

    recipe.pipeline(backend, options, token_id)
    if recipe.file_post_processor_wins and file_post_processor is not None:
        backend.post_processor = BackendTokenizer.from_str(
            json.dumps({**rebuilt, "post_processor": file_post_processor})).post_processor
    settings = TokenizerSettings(
        class_name=class_name,
        special_tokens={name: _token_text(specials.get(name)) for name in SPECIAL_TOKEN_NAMES},
        extra_special_tokens=[_token_text(t) for t in extras],
        model_max_length=int(tok_config.get("model_max_length") or tok_config.get("max_len") or VERY_LARGE_INTEGER),
        model_input_names=list(tok_config.get("model_input_names") or recipe.model_input_names),
        padding_side=tok_config.get("padding_side", "right"),
        truncation_side=tok_config.get("truncation_side", "right"),
        clean_up_tokenization_spaces=bool(tok_config.get("clean_up_tokenization_spaces", False)),
        split_special_tokens=bool(tok_config.get("split_special_tokens", False)),
    )
    return backend, settings


def _check_wordpiece_unk(path: Path, vocab: Any, unk: str | None, section: str = "model.vocab") -> None:
    """WordPiece maps every word it cannot split to its unk_token, which must be in the model's own vocabulary
    (an added token does not count): without it, encoding such a word fails, so refuse the file at load."""
    if not isinstance(vocab, dict):
        return  # not a WordPiece vocabulary at all: building the model names the problem
    if unk is None:
        raise ConfigError(f"{path}: unk_token is null, but a WordPiece model needs one (set unk_token in "
                          f"{TOKENIZER_CONFIG} to a token of the vocabulary)")
    if unk not in vocab:
        raise ConfigError(f"{path}: the model's vocab lacks its unk_token {unk!r}, so any unknown word would fail "
                          f"to encode: add {unk!r} to {section} or set unk_token in {TOKENIZER_CONFIG} to a "
                          "token the vocab has")


VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "*.model")


def _check_vocab_txt(root: Path) -> None:
    """A WordPiece ``vocab.txt`` must be UTF-8 text with at least one token: an empty one would give a
    tokenizer mapping everything to [UNK], a binary one garbage."""
    path = root / "vocab.txt"
    if not path.exists() or (root / TOKENIZER_FILE).is_file():
        return
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a vocabulary file")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text, so not a vocabulary ({exc})") from exc
    if "\x00" in text:
        raise ConfigError(f"{path}: holds NUL bytes: a binary file, not a vocabulary")
    if not any(line.strip() for line in text.splitlines()):
        raise ConfigError(f"{path}: is empty: a vocabulary needs at least one token")


def _from_transformers(root: Path, source: str, options: dict) -> tuple[BackendTokenizer, TokenizerSettings]:
    """Let transformers convert the directory (vocab.txt, SentencePiece models, unknown classes)."""
    if not any(any(root.glob(pattern)) for pattern in VOCABULARY_FILES):
        # transformers would quietly build a tokenizer with a five-token vocabulary here.
        raise SourceNotFoundError(f"{source}: no usable tokenizer: none of {', '.join(VOCABULARY_FILES)} is in {root}")
    import transformers
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        reference = transformers.AutoTokenizer.from_pretrained(str(root), **options)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise SourceNotFoundError(
            f"{source}: no usable tokenizer (expected tokenizer.json, vocab.txt, vocab.json + merges.txt or a "
            f"SentencePiece model, with tokenizer_config.json or config.json naming the class): {exc}") from exc
    finally:
        transformers.logging.set_verbosity(verbosity)
    backend = getattr(reference, "backend_tokenizer", None)
    if backend is None:
        raise SourceNotFoundError(f"{source}: transformers built a {type(reference).__name__}, which has no "
                                  "tokenizers backend to drive")
    if type(backend.model).__name__ == "WordPiece":
        vocab_file = root / "vocab.txt"
        _check_wordpiece_unk(vocab_file if vocab_file.is_file() else root, backend.get_vocab(with_added_tokens=False),
                             backend.model.unk_token, "the vocabulary")
    return copy.deepcopy(backend), reference_settings(reference)


def reference_settings(reference: Any) -> TokenizerSettings:
    """The settings transformers keeps beside the backend of its tokenizer ``reference`` (one it built itself:
    a converted directory, or a GGUF file's embedded tokenizer)."""
    return TokenizerSettings(
        class_name=type(reference).__name__,
        special_tokens={name: _token_text(getattr(reference, name, None)) for name in SPECIAL_TOKEN_NAMES},
        extra_special_tokens=[str(t) for t in getattr(reference, "extra_special_tokens", None) or []
                              if isinstance(t, (str, AddedToken))],
        model_max_length=int(reference.model_max_length),
        model_input_names=list(reference.model_input_names),
        padding_side=reference.padding_side,
        truncation_side=reference.truncation_side,
        clean_up_tokenization_spaces=bool(reference.clean_up_tokenization_spaces),
        split_special_tokens=bool(getattr(reference, "split_special_tokens", False)),
        pad_token_type_id=int(getattr(reference, "pad_token_type_id", 0)),
    )

