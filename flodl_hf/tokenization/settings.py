"""The tokenizer files' names and the settings transformers keeps beside a tokenizers backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"            # beside tokenizer_config.json; wins over its chat_template
CHAT_TEMPLATE_DIR = "additional_chat_templates"       # <name>.jinja: more named templates
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Every file of a tokenizer directory that we, or transformers where it builds the tokenizer, may read; each must
# stay inside the directory (loading._check_inside). Patterns are globs of the directory's own entries.
DIRECTORY_FILES = (TOKENIZER_CONFIG, TOKENIZER_FILE, SPECIAL_TOKENS_MAP, "added_tokens.json", "config.json",
                   CHAT_TEMPLATE_FILE, "chat_template.json", "vocab.txt", "vocab.json", "merges.txt", "tekken.json")
DIRECTORY_PATTERNS = ("*.model", "tokenizer*.json", "*.tiktoken")
VERY_LARGE_INTEGER = int(1e30)  # transformers' "no limit" model_max_length
LARGE_INTEGER = int(1e20)


# ---- what transformers keeps beside the backend ----------------------------------------------------

@dataclass
class TokenizerSettings:
    class_name: str
    special_tokens: dict[str, str | None]
    extra_special_tokens: list[str] = field(default_factory=list)
    model_max_length: int = VERY_LARGE_INTEGER
    model_input_names: list[str] = field(default_factory=lambda: ["input_ids", "token_type_ids", "attention_mask"])
    padding_side: str = "right"
    truncation_side: str = "right"
    clean_up_tokenization_spaces: bool = False
    split_special_tokens: bool = False
    pad_token_type_id: int = 0
    # Chat: the template (a string, or {name: template}), where it came from (for error messages), the
    # model-specific special tokens transformers also passes to templates (image_token...), response_template.
    chat_template: str | dict[str, str] | None = None
    chat_template_origin: str | dict[str, str] = ""  # per name for several templates
    model_specific_tokens: dict[str, str] = field(default_factory=dict)
    response_template: Any = None
    directory: str = ""  # the directory it was loaded from
