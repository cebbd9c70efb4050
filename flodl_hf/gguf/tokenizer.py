"""A GGUF file's embedded tokenizer (``tokenizer.ggml.*``) and chat template, for
``AutoTokenizer.from_pretrained(source, gguf_file=...)``.

transformers converts the embedded vocabulary itself (its GGUF tokenizer converters), as flodl-hf lets it convert a
directory that holds no tokenizer.json (flodl_hf.tokenization.loading): so the ids cannot differ from its. We check the
file first (gguf's reader, typed errors: no tokens, a token list of another length than the token types...), take
transformers' backend and settings, and the chat template from ``tokenizer.chat_template``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from flodl_hf.core.errors import CheckpointFormatError, ConfigError
from flodl_hf.gguf.loading import gguf_path
from flodl_hf.gguf.reader import GGUFFile, open_gguf
from flodl_hf.tokenization.loading import reference_settings

# tokenizer.ggml.model values transformers' GGUF converters know (GGUF_TO_FAST_CONVERTERS)
MODELS = ("llama", "gpt2", "t5", "bert")


def check_tokenizer(file: GGUFFile) -> None:
    """The embedded tokenizer is there and whole: a model name, a non-empty token list, per-token arrays of its
    length."""
    where = f"{file.path}: metadata field"
    model = file.get("tokenizer.ggml.model")
    if model is None:
        raise ConfigError(f"{where} tokenizer.ggml.model is missing: the file embeds no tokenizer")
    tokens = file.metadata.count("tokenizer.ggml.tokens")
    if not tokens:
        raise ConfigError(f"{where} tokenizer.ggml.tokens is {'missing' if tokens is None else 'empty'}: a "
                          "tokenizer needs at least one token")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        count = file.metadata.count(key)
        if key in file.metadata and count != tokens:
            raise CheckpointFormatError(f"{where} {key} has {count or 1} entries for {tokens} tokens")
    for key in ("bos", "eos", "unknown", "padding"):
        value = file.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and not (isinstance(value, int) and 0 <= value < tokens):
            raise CheckpointFormatError(f"{where} tokenizer.ggml.{key}_token_id is {value}, outside the "
                                        f"{tokens} tokens")


def read_gguf_tokenizer(source: str | os.PathLike | None, gguf_file: str | os.PathLike,
                        options: dict[str, Any]) -> tuple[Any, Any]:
    """The backend and settings of the tokenizer embedded in the GGUF file (core's ``slots.READ_GGUF_TOKENIZER``)."""
    path = gguf_path(source, gguf_file)
    file = open_gguf(path)
    check_tokenizer(file)
    import transformers
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **options)
    except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise ConfigError(f"{path}: transformers cannot build the embedded tokenizer (tokenizer.ggml.model "
                          f"{file.get('tokenizer.ggml.model')!r}): {type(exc).__name__}: {exc}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    settings = reference_settings(reference)
    template = options.get("chat_template", getattr(reference, "chat_template", None))
    settings.chat_template = template
    settings.chat_template_origin = ("from_pretrained option chat_template" if "chat_template" in options
                                     else f"{path}: metadata field tokenizer.chat_template")
    settings.directory = ""
    return copy.deepcopy(reference.backend_tokenizer), settings
