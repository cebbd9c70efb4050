"""A tokenizer out to GGUF metadata, as llama.cpp's converter writes it (``tokenizer.ggml.*``): the model kind, the
tokens in id order, their types, the merges (or SentencePiece scores), the special ids, the BOS/EOS flags, the
pre-tokeniser name and the chat template.

A byte-level BPE (GPT-2, Qwen, SmolLM, StarCoder...) is written as ``gpt2``; a SentencePiece BPE (LLaMA 2, Mistral,
Gemma, Phi-3) as ``llama``. The pre-tokeniser name is the one transformers' GGUF reader maps back to the same split
pattern, so the file's tokenizer gives the source's ids (checked by verify-export).
"""

from __future__ import annotations

import json
import os
from typing import Any

from flodl_hf.core.errors import ConfigError

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def _merges(model: dict[str, Any]) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _split_name(pre: dict[str, Any] | None) -> str:
    """The pre-tokeniser name whose split pattern transformers' GGUF reader rebuilds, for the source's Split
    regex ("default": GPT-2's own, which its byte-level tokenizer applies when the name is unknown)."""
    pattern = None
    for step in (pre or {}).get("pretokenizers", [pre] if pre else []):
        if step and step.get("type") == "Split":
            pattern = (step.get("pattern") or {}).get("Regex")
            break
    if pattern is None:
        return "default"
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # pragma: no cover - transformers before its GGUF tokenizer table
        return "default"
    return next((name for name, split in GGUF_PRE_TOKENIZER_SPLITS.items() if split == pattern), "default")


def vocab_metadata(source: str | os.PathLike, config: Any) -> dict[str, tuple[str, Any]]:
    """``tokenizer.*`` metadata of the tokenizer of ``source``: key -> (gguf value kind, value)."""
    from flodl_hf.tokenization import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # noqa: BLE001 - a GGUF carries its tokenizer: without one there is nothing to write
        raise ConfigError(f"{source}: no tokenizer to embed in the GGUF ({type(exc).__name__}: {exc}); pass "
                          "tokenizer= (--tokenizer) a directory that has one") from None
    data = json.loads(tok.backend_tokenizer.to_str())
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(f"{source}: a {model.get('type')} tokenizer; GGUF export writes BPE tokenizers "
                          "(byte-level or SentencePiece)")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    for content, token in added.items():
        vocab[content] = token["id"]
    size = max(vocab.values()) + 1
    width = max(size, int(getattr(config, "vocab_size", size) or size))
    tokens = [f"[PAD{i}]" for i in range(width)]
    types = [USER_DEFINED] * width
    for text, index in vocab.items():
        tokens[index] = text
        types[index] = NORMAL
    for content, token in added.items():
        types[token["id"]] = CONTROL if token.get("special") else USER_DEFINED
    byte_level = "ByteLevel" in json.dumps(data.get("pre_tokenizer")) or "ByteLevel" in json.dumps(data.get("decoder"))
    out: dict[str, tuple[str, Any]] = {"tokenizer.ggml.model": ("string", "gpt2" if byte_level else "llama"),
                                       "tokenizer.ggml.tokens": ("array", tokens)}
    if byte_level:
        out["tokenizer.ggml.pre"] = ("string", _split_name(data.get("pre_tokenizer")))
    else:
        for index, text in enumerate(tokens):
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                types[index] = BYTE
        if model.get("unk_token") in vocab:
            types[vocab[model["unk_token"]]] = UNKNOWN
        out["tokenizer.ggml.scores"] = ("array", [-float(i) for i in range(width)])
        out["tokenizer.ggml.add_space_prefix"] = ("bool", "Prepend" in json.dumps(data.get("normalizer"))
                                                  or "prepend_scheme" in json.dumps(data.get("pre_tokenizer")))
    out["tokenizer.ggml.token_type"] = ("array", types)
    out["tokenizer.ggml.merges"] = ("array", _merges(model))
    for name, key in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        text = tok.settings.special_tokens.get(key)
        if text is not None and text in vocab:
            out[f"tokenizer.ggml.{name}_token_id"] = ("uint32", vocab[text])
    ids = tok("a", return_tensors=None)["input_ids"]
    bos = tok.settings.special_tokens.get("bos_token")
    eos = tok.settings.special_tokens.get("eos_token")
    out["tokenizer.ggml.add_bos_token"] = ("bool", bool(ids) and bos in vocab and ids[0] == vocab[bos])
    out["tokenizer.ggml.add_eos_token"] = ("bool", bool(ids) and eos in vocab and ids[-1] == vocab[eos])
    template = tok.settings.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if isinstance(template, str):
        out["tokenizer.chat_template"] = ("string", template)
    return out
