"""``Tokenizer.save_pretrained``: the files transformers 5's ``TokenizersBackend.save_pretrained`` writes.

Written from ``tokenization_utils_base.py`` (5.25: ``save_pretrained``, ``save_chat_templates``) and
``tokenization_utils_tokenizers.py`` (``_save_pretrained``): ``tokenizer_config.json`` (the options the tokenizer was
loaded with, its current special tokens, sides and length, its class; sorted keys, indent 2, UTF-8), the chat
template as ``chat_template.jinja`` (and ``additional_chat_templates/<name>.jinja``), and ``tokenizer.json``, the
backend itself, added tokens included. One addition: ``padding_side`` and ``truncation_side`` are written when they
are not ``"right"`` (transformers 5.25 writes them only when the loaded config had them, so ``tok.padding_side =
"left"`` is lost on its reload; here both readers get it back).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flodl_hf.core import io
from flodl_hf.core.errors import InputError, OutputExistsError, push_to_hub_refused
from flodl_hf.tokenization.recipes import RECIPES
from flodl_hf.tokenization.settings import (CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, SPECIAL_TOKEN_NAMES,
                                            TOKENIZER_CONFIG, TOKENIZER_FILE)

if TYPE_CHECKING:
    from flodl_hf.tokenization.tokenizer import Tokenizer

# The settings a saved tokenizer_config.json takes from the tokenizer as it is now (transformers' getattr), where
# the loaded config had the key; model_max_length always.
_CURRENT = ("model_max_length", "padding_side", "truncation_side", "clean_up_tokenization_spaces",
            "split_special_tokens", "model_input_names")
# Keys transformers takes out of what it writes: the vocabulary files, the added tokens (tokenizer.json holds them),
# where the tokenizer came from, and load-time choices.
_DROPPED = ("add_bos_token", "add_eos_token", "vocab_file", "merges_file", "tokenizer_file", "added_tokens_decoder",
            "additional_special_tokens", "name_or_path", "special_tokens_map_file", "device_map",
            "slow_tokenizer_class", "files_loaded", "chat_template")

# The __init__ defaults of the recipe classes that tokenize nothing, so no recipe holds them (transformers 5.25).
_MORE_DEFAULTS = {"RobertaTokenizer": {"errors": "replace"}, "DebertaTokenizer": {"errors": "replace"},
                  "AlbertTokenizer": {"trim_offsets": True}}


def init_kwargs(directory: Path | None, class_name: str, options: dict[str, Any]) -> dict[str, Any]:
    """What transformers keeps as ``tokenizer.init_kwargs``: the class's options at their defaults (for a class we
    build from its recipe), overlaid by tokenizer_config.json's keys and the from_pretrained options."""
    recipe = RECIPES.get(class_name)
    kept = {k: v for k, v in recipe.defaults.items() if k not in SPECIAL_TOKEN_NAMES} if recipe is not None else {}
    kept.update(_MORE_DEFAULTS.get(class_name, {}))
    kept["backend"] = "tokenizers"
    path = directory / TOKENIZER_CONFIG if directory is not None else None
    if path is not None and path.is_file():
        kept.update(io.read_json(path, TOKENIZER_CONFIG))
    kept.update(options)
    return copy.deepcopy(kept)


def _chat_files(template: Any, prefix: str) -> dict[str, str]:
    """File name (relative) -> template text, as save_chat_templates lays them out; a name that would leave
    ``additional_chat_templates/`` is an InputError before anything is written."""
    if isinstance(template, str):
        return {prefix + CHAT_TEMPLATE_FILE: template}
    files = {}
    for name, text in (template or {}).items():
        if name == "default":
            files[prefix + CHAT_TEMPLATE_FILE] = text
            continue
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
                or os.sep in name:
            raise InputError(f"tokenizer.save_pretrained: chat template name {name!r} is not a file name; "
                             "nothing was written")
        files[f"{prefix}{CHAT_TEMPLATE_DIR}/{name}.jinja"] = text
    return files


def tokenizer_config(tok: "Tokenizer", save_jinja_files: bool = True) -> dict[str, Any]:
    """The tokenizer_config.json object ``save_pretrained`` writes (the chat template in it only with
    ``save_jinja_files=False``, transformers' legacy layout)."""
    settings = tok.settings
    loaded = dict(tok.init_kwargs)
    config = {k: v for k, v in loaded.items() if k not in _DROPPED}
    for key in _CURRENT:
        if key in loaded or key == "model_max_length" or (key.endswith("_side") and getattr(settings, key) != "right"):
            config[key] = copy.deepcopy(getattr(settings, key))
    for name in SPECIAL_TOKEN_NAMES:  # the current tokens (None where the loaded config named one since unset)
        if name in loaded or settings.special_tokens.get(name) is not None:
            config[name] = settings.special_tokens.get(name)
    config.update(settings.model_specific_tokens)
    if settings.extra_special_tokens or "extra_special_tokens" in loaded:
        config["extra_special_tokens"] = list(settings.extra_special_tokens)
    template = settings.chat_template
    if not save_jinja_files and template is not None:
        config["chat_template"] = ([{"name": k, "template": v} for k, v in template.items()]
                                   if isinstance(template, dict) else template)
    if settings.response_template is not None:
        config["response_template"] = settings.response_template
    config["tokenizer_class"] = settings.class_name
    return config


def save_pretrained(tok: "Tokenizer", save_directory: str | os.PathLike, legacy_format: bool | None = None,
                    filename_prefix: str | None = None, push_to_hub: bool = False,
                    save_jinja_files: bool = True) -> tuple[str, ...]:
    """Write tokenizer_config.json, the chat template files and tokenizer.json into ``save_directory`` (made if
    missing); returns their paths, in transformers' order. ``legacy_format`` is taken and unused, as there."""
    if push_to_hub:
        raise push_to_hub_refused("tokenizer")
    directory = Path(save_directory)
    if directory.is_file():
        raise OutputExistsError(f"tokenizer.save_pretrained: {directory} is a file; pass a directory")
    prefix = f"{filename_prefix}-" if filename_prefix else ""
    config = tokenizer_config(tok, save_jinja_files)
    chat = _chat_files(tok.settings.chat_template, prefix) if save_jinja_files else {}
    text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / (prefix + TOKENIZER_CONFIG)]
    written[0].write_text(text, encoding="utf-8")
    for name, template in chat.items():
        path = directory / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(template, encoding="utf-8")
        written.append(path)
    written.append(directory / (prefix + TOKENIZER_FILE))
    tok.backend_tokenizer.save(str(written[-1]))
    return tuple(str(p) for p in written)
