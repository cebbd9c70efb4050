"""The Tokenizer: a ``tokenizers.Tokenizer`` plus its TokenizerSettings, called as transformers calls its own.

``Tokenizer.__call__`` drives the backend exactly as transformers' ``TokenizersBackend`` does (padding,
truncation, pairs, overflowing windows, offsets); ``apply_chat_template`` renders chats as transformers 5.24.
``AutoTokenizer.from_pretrained`` builds one from what ``flodl_hf.tokenization.loading`` reads.
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from tokenizers import AddedToken, Encoding
from tokenizers import Tokenizer as BackendTokenizer

from flodl_hf.core import slots
from flodl_hf.core.errors import ConfigError, InputError, push_to_hub_refused
from flodl_hf.tokenization.chat import _chat_template_value, _conversations, _named_origin, render_chat
from flodl_hf.tokenization import padding as collation
from flodl_hf.tokenization import saving
from flodl_hf.tokenization.padding import as_tensor
from flodl_hf.tokenization.loading import read_tokenizer
from flodl_hf.tokenization.settings import (CHAT_TEMPLATE_FILE, LARGE_INTEGER, SPECIAL_TOKEN_NAMES, TOKENIZER_CONFIG,
                                            TokenizerSettings)


class BatchEncoding(dict):
    """transformers' BatchEncoding, as far as we use it: a dict of fields plus the backend encodings."""

    def __init__(self, data: dict[str, Any], encodings: list[Encoding] | None = None) -> None:
        super().__init__(data)
        self.encodings = encodings or []

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def word_ids(self, batch_index: int = 0) -> list[int | None]:
        return self.encodings[batch_index].word_ids

    def sequence_ids(self, batch_index: int = 0) -> list[int | None]:
        return self.encodings[batch_index].sequence_ids

    def tokens(self, batch_index: int = 0) -> list[str]:
        return self.encodings[batch_index].tokens

    def to(self, device: str | torch.device) -> "BatchEncoding":
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.to(device)
        return self


class Tokenizer:
    """A ``tokenizers.Tokenizer`` driven with transformers' call semantics.

    ``tokenizer(text, text_pair=None, padding=False, truncation=None, max_length=None, ...)`` returns
    ``input_ids``, ``token_type_ids`` (where ``model_input_names`` has them), ``attention_mask`` and,
    on request, ``offset_mapping``, ``special_tokens_mask``, overflowing windows.
    """

    def __init__(self, backend: BackendTokenizer, settings: TokenizerSettings, name_or_path: str = "") -> None:
        self.backend_tokenizer = backend
        self.settings = settings
        self.name_or_path = name_or_path
        self.init_kwargs: dict[str, Any] = {}  # what it was loaded with (AutoTokenizer.from_pretrained fills it)
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = settings.split_special_tokens

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike, revision: str | None = None, **options: Any) -> "Tokenizer":
        return AutoTokenizer.from_pretrained(source, revision=revision, **options)

    # ---- settings, as transformers names them ---------------------------------------------------
    @property
    def model_max_length(self) -> int:
        return self.settings.model_max_length

    @property
    def model_input_names(self) -> list[str]:
        return list(self.settings.model_input_names)

    @property
    def padding_side(self) -> str:
        return self.settings.padding_side

    @property
    def truncation_side(self) -> str:
        return self.settings.truncation_side

    @property
    def pad_token_type_id(self) -> int:
        return self.settings.pad_token_type_id

    @property
    def is_fast(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        # bos_token ... mask_token and their *_id, extra_special_tokens and its *_ids, from the settings.
        if name in SPECIAL_TOKEN_NAMES:
            return self.settings.special_tokens.get(name)
        if name.endswith("_id") and name[:-3] in SPECIAL_TOKEN_NAMES:
            token = self.settings.special_tokens.get(name[:-3])
            return None if token is None else self.convert_tokens_to_ids(token)
        if name == "extra_special_tokens":
            return list(self.settings.extra_special_tokens)
        if name == "extra_special_tokens_ids":
            return self.convert_tokens_to_ids(list(self.settings.extra_special_tokens))
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        """transformers' assignments take effect: ``tok.pad_token = tok.eos_token``, ``tok.pad_token_id = 0``,
        ``tok.extra_special_tokens = [...]`` set the special tokens padding and decoding read; ``tok.padding_side``,
        ``tok.truncation_side`` and ``tok.model_max_length`` set the settings. A token set this way is not added to
        the vocabulary (``add_special_tokens`` adds), as in transformers."""
        base = name.removesuffix("_ids").removesuffix("_id") if name.endswith(("_id", "_ids")) else name
        if base in SPECIAL_TOKEN_NAMES:
            if name != base and value is not None:
                value = self._token_of(value, name)
            if value is not None and not isinstance(value, (str, AddedToken)):
                raise InputError(f"tokenizer.{name} = {value!r}: a special token is a string (or None to unset)")
            self.settings.special_tokens[base] = None if value is None else str(value)
        elif base == "extra_special_tokens":
            if value is not None and (not isinstance(value, (list, tuple))
                                      or (name == base and not all(isinstance(t, (str, AddedToken)) for t in value))):
                raise InputError(f"tokenizer.{name} = {value!r}: expected a list of "
                                 + ("token ids" if name != base else "token strings"))
            tokens = [self._token_of(v, name) if name != base else str(v) for v in value or []]
            self.settings.extra_special_tokens = tokens
        elif name in ("padding_side", "truncation_side"):
            if value not in ("left", "right"):
                raise InputError(f"tokenizer.{name} = {value!r}: expected 'left' or 'right'")
            setattr(self.settings, name, value)
        elif name == "model_max_length":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"tokenizer.model_max_length = {value!r}: expected a positive integer")
            self.settings.model_max_length = value
        else:
            object.__setattr__(self, name, value)

    def _token_of(self, token_id: Any, name: str) -> str:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < len(self):
            raise InputError(f"tokenizer.{name} = {token_id!r}: not a token id of this tokenizer "
                             f"(0 to {len(self) - 1})")
        return self.backend_tokenizer.id_to_token(token_id)

    def add_tokens(self, new_tokens: str | AddedToken | Sequence[str | AddedToken], special_tokens: bool = False) -> int:
        """transformers' ``add_tokens``: tokens not in the vocabulary are added at its end; returns how many were
        added (then ``model.resize_token_embeddings(len(tokenizer))``)."""
        if not new_tokens:
            return 0
        tokens = list(new_tokens) if isinstance(new_tokens, (list, tuple)) else [new_tokens]
        bad = [t for t in tokens if not isinstance(t, (str, AddedToken))]
        if bad:
            raise InputError(f"add_tokens: {bad[0]!r} is not a string or tokenizers.AddedToken")
        backend = self.backend_tokenizer
        return backend.add_special_tokens(tokens) if special_tokens else backend.add_tokens(tokens)

    def add_special_tokens(self, special_tokens_dict: dict[str, Any], replace_extra_special_tokens: bool = True) -> int:
        """transformers' ``add_special_tokens``: ``{"pad_token": "[PAD]", "extra_special_tokens": [...]}`` names the
        tokens and adds those not in the vocabulary; returns how many were added."""
        if not special_tokens_dict:
            return 0
        if not isinstance(special_tokens_dict, dict):
            raise InputError(f"add_special_tokens takes a dict such as {{'pad_token': '[PAD]'}}, "
                             f"got {type(special_tokens_dict).__name__}")
        wanted = dict(special_tokens_dict)
        if "additional_special_tokens" in wanted and not wanted.get("extra_special_tokens"):
            wanted["extra_special_tokens"] = wanted.pop("additional_special_tokens")
        allowed = (*SPECIAL_TOKEN_NAMES, "extra_special_tokens")
        for key, value in wanted.items():  # every entry checked before anything changes
            if key not in allowed:
                raise InputError(f"add_special_tokens: {key!r} is not a special token name; use one of "
                                 + ", ".join(allowed))
            values = value if key == "extra_special_tokens" and isinstance(value, (list, tuple)) else [value]
            if key == "extra_special_tokens" and not isinstance(value, (list, tuple)):
                raise InputError(f"add_special_tokens: extra_special_tokens={value!r} must be a list of tokens")
            if not all(isinstance(v, (str, AddedToken)) for v in values):
                raise InputError(f"add_special_tokens: {key}={value!r} must be a string or tokenizers.AddedToken")
        to_add = []
        for key, value in wanted.items():
            if key == "extra_special_tokens":
                new = [_special(t) for t in value if replace_extra_special_tokens
                       or str(t) not in self.settings.extra_special_tokens]
                extras = [str(t) for t in new]
                self.settings.extra_special_tokens = (extras if replace_extra_special_tokens and new
                                                      else self.settings.extra_special_tokens + extras)
                to_add += new
            else:
                token = _special(value)
                self.settings.special_tokens[key] = str(token)
                to_add.append(token)
        return self.add_tokens(to_add, special_tokens=True)

    @property
    def all_special_tokens(self) -> list[str]:
        tokens = [t for n in SPECIAL_TOKEN_NAMES if (t := self.settings.special_tokens.get(n)) is not None]
        return list(dict.fromkeys(tokens + list(self.settings.extra_special_tokens)))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.settings.class_name}, vocab={len(self)}, model_max_length="
                f"{self.model_max_length}, source={self.name_or_path!r})")

    # ---- what transformers' data collators call -------------------------------------------------------
    def pad(self, encoded_inputs: Any, padding: bool | str = True, max_length: int | None = None,
            pad_to_multiple_of: int | None = None, padding_side: str | None = None,
            return_attention_mask: bool | None = None, return_tensors: str | None = None) -> BatchEncoding:
        """transformers' ``tokenizer.pad`` (``flodl_hf.tokenization.padding``), which ``DataCollatorWithPadding`` and
        its sisters call."""
        return BatchEncoding(collation.pad(self, encoded_inputs, padding, max_length, pad_to_multiple_of,
                                           padding_side, return_attention_mask, return_tensors))

    def get_special_tokens_mask(self, token_ids_0: list[int], token_ids_1: list[int] | None = None,
                                already_has_special_tokens: bool = False) -> list[int]:
        """1 for each special token in ids the tokenizer made (``DataCollatorForLanguageModeling`` asks it)."""
        return collation.get_special_tokens_mask(self, token_ids_0, token_ids_1, already_has_special_tokens)

    # ---- saving --------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, legacy_format: bool | None = None,
                        filename_prefix: str | None = None, push_to_hub: bool = False,
                        save_jinja_files: bool = True, **kwargs: Any) -> tuple[str, ...]:
        """tokenizer_config.json, the chat template files and tokenizer.json, as transformers 5 writes them
        (``flodl_hf.tokenization.saving``): both transformers and flodl-hf reload them and tokenize as before.
        ``push_to_hub=True`` (with its ``repo_id``...) is an UnsupportedFeatureError, before anything is written."""
        if push_to_hub:
            raise push_to_hub_refused("tokenizer")
        if kwargs:
            raise TypeError(f"save_pretrained() got unexpected keyword arguments: {', '.join(sorted(kwargs))}")
        return saving.save_pretrained(self, save_directory, legacy_format, filename_prefix, push_to_hub,
                                      save_jinja_files)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        """Refused: flodl-hf makes no network access (``save_pretrained``, then upload with huggingface_hub)."""
        raise push_to_hub_refused("tokenizer")

    # ---- chat templates (transformers' apply_chat_template) -----------------------------------------
    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return self.settings.chat_template

    @chat_template.setter
    def chat_template(self, value: str | dict[str, str] | list | None) -> None:
        self.settings.chat_template = _chat_template_value(value, "tokenizer.chat_template", InputError)
        self.settings.chat_template_origin = "tokenizer.chat_template"

    @property
    def response_template(self) -> Any:
        return self.settings.response_template

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (and model-specific ones, such as image_token), as transformers' property."""
        named = {n: t for n in SPECIAL_TOKEN_NAMES if (t := self.settings.special_tokens.get(n)) is not None}
        return {**named, **self.settings.model_specific_tokens}

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template apply_chat_template uses: ``chat_template`` (a template, or the name of one of the
        tokenizer's), else the tokenizer's (its "tool_use" one when tools are given, else "default")."""
        return self._chat_template(chat_template, tools)[0]

    def _chat_template(self, chat_template: Any, tools: Any) -> tuple[str, str, type]:
        """(template, where it came from, the error type for a bad one): transformers' get_chat_template."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise InputError(f"chat_template is a {type(chat_template).__name__}: expected a Jinja template "
                             "string or the name of one of the tokenizer's templates")
        own, origin = self.settings.chat_template, self.settings.chat_template_origin
        error = InputError if origin == "tokenizer.chat_template" else ConfigError
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template], _named_origin(origin, chat_template), error
            if chat_template is None:
                name = "tool_use" if tools is not None and "tool_use" in own else "default" if "default" in own \
                    else None
                if name is None:
                    raise InputError(f"{origin}: the tokenizer has several chat templates and none is named "
                                     f"'default': pass chat_template= one of {sorted(own)} (or a template)")
                return own[name], _named_origin(origin, name), error
        elif chat_template is None:
            if own is None:
                root = Path(self.settings.directory) if self.settings.directory else None
                where = f"{root / TOKENIZER_CONFIG} has no chat_template and there is no {root / CHAT_TEMPLATE_FILE}" \
                    if root is not None else "the tokenizer has no chat_template"
                raise InputError(f"cannot apply a chat template: {where}; pass chat_template= a Jinja template or "
                                 "set tokenizer.chat_template (as transformers' apply_chat_template)")
            return own, origin, error
        return chat_template, "the chat_template argument", InputError

    def apply_chat_template(self, conversation: Any, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True,
                            sanitize_control_tokens: bool = False, padding: bool | str = False,
                            truncation: bool = False, max_length: int | None = None,
                            return_tensors: str | None = None, return_dict: bool = True,
                            return_assistant_tokens_mask: bool = False,
                            tokenizer_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """transformers 5.24's ``apply_chat_template``: render ``conversation`` (a list of ``{"role", "content"}``
        dicts, or a list of such lists) with the chat template, in a sandboxed Jinja environment with
        transformers' settings and variables (``messages``, ``add_generation_prompt``, ``tools``,
        ``documents``, the special tokens, ``**kwargs``). ``tokenize=False``: the text (a list for a batch);
        else the text encoded without added special tokens: a ``BatchEncoding`` (``return_dict=True``, the
        default, as 5.24) or the ``input_ids`` alone."""
        if not tokenize:
            return_dict = False
        if return_assistant_tokens_mask and not (return_dict and tokenize):
            raise InputError("return_assistant_tokens_mask=True needs return_dict=True and tokenize=True")
        if sanitize_control_tokens:
            raise InputError("sanitize_control_tokens=True: flodl-hf's apply_chat_template does not implement it")
        tokenizer_kwargs = dict(tokenizer_kwargs or {})
        allowed = _CALL_KEYWORDS - {"text", "text_pair", "add_special_tokens", "return_tensors", "padding",
                                    "truncation", "max_length"}
        for key in tokenizer_kwargs:
            if key not in allowed:
                raise InputError(f"tokenizer_kwargs[{key!r}]: not a keyword of the tokenizer call "
                                 f"(expected one of {sorted(allowed)})")
        template, origin, error = self._chat_template(chat_template, tools)
        conversations, batched = _conversations(conversation)
        if continue_final_message:
            if add_generation_prompt:
                raise InputError("continue_final_message and add_generation_prompt cannot be used together: "
                                 "continue the final message, or prompt a new assistant message")
            if return_assistant_tokens_mask:
                raise InputError("continue_final_message cannot be used with return_assistant_tokens_mask")
        if return_assistant_tokens_mask and not re.search(r"\{%-?\s*generation\s*-?%\}", template):
            warnings.warn("return_assistant_tokens_mask=True but the chat template has no {% generation %} block",
                          stacklevel=2)
        rendered, spans = render_chat(conversations, template, origin, error, tools=tools, documents=documents,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      track=return_assistant_tokens_mask,
                                      variables={**self.special_tokens_map, **kwargs})
        text = rendered if batched else rendered[0]
        if not tokenize:
            return text
        out = self(text, padding=padding, truncation=truncation, max_length=max_length, add_special_tokens=False,
                   return_tensors=return_tensors, **tokenizer_kwargs)
        if not return_dict:
            return out["input_ids"]
        if return_assistant_tokens_mask:
            masks = []
            for i, encoding in enumerate(out.encodings[:len(rendered)]):
                mask, chat_spans, k = [0] * len(encoding.ids), spans[i], 0
                # every token overlapping a {% generation %} span, as transformers (offsets and spans in order)
                for t, (start, end) in enumerate(encoding.offsets):
                    while k < len(chat_spans) and start >= chat_spans[k][1]:
                        k += 1
                    if k == len(chat_spans):
                        break
                    if end > chat_spans[k][0]:
                        mask[t] = 1
                masks.append(mask)
            if return_tensors is not None:
                out["assistant_masks"] = as_tensor("assistant_masks", masks, return_tensors)
            else:
                out["assistant_masks"] = masks if batched else masks[0]
        return out

    # ---- ids and tokens --------------------------------------------------------------------------
    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        if isinstance(tokens, str):
            index = self.backend_tokenizer.token_to_id(tokens)
            if index is None:
                unk = self.settings.special_tokens.get("unk_token")
                return None if unk is None else self.backend_tokenizer.token_to_id(unk)
            return index
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend_tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False) -> list[str]:
        return self(text, pair, add_special_tokens=add_special_tokens, return_tensors=None).encodings[0].tokens

    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True,
               **kwargs: Any) -> list[int]:
        return self(text, text_pair, add_special_tokens=add_special_tokens, return_tensors=None, **kwargs)["input_ids"]

    def decode(self, token_ids: int | Sequence[int] | torch.Tensor, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str | list[str]:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        token_ids = [int(i) if not isinstance(i, (list, tuple)) else i for i in token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in token_ids]
        text = self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        clean = self.settings.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        # transformers skips the clean-up for BPE models: it was written for WordPiece and corrupts BPE output.
        if clean and type(self.backend_tokenizer.model).__name__ != "BPE":
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    # ---- encoding ----------------------------------------------------------------------------------
    def _strategies(self, padding: Any, truncation: Any, max_length: int | None) -> tuple[str, str, int | None]:
        """transformers' _get_padding_truncation_strategies."""
        if max_length is not None and padding is False and truncation is None:
            truncation = "longest_first"
        if padding is True:
            pad = "longest"
        elif padding is False or padding is None:
            pad = "do_not_pad"
        else:
            pad = str(getattr(padding, "value", padding))
            if pad not in ("longest", "max_length", "do_not_pad"):
                raise ValueError(f"padding={padding!r}: expected True, False, 'longest', 'max_length' or 'do_not_pad'")
        if truncation is True:
            trunc = "longest_first"
        elif truncation is False or truncation is None:
            trunc = "do_not_truncate"
        else:
            trunc = str(getattr(truncation, "value", truncation))
            if trunc not in ("longest_first", "only_first", "only_second", "do_not_truncate"):
                raise ValueError(f"truncation={truncation!r}: expected True, False, 'longest_first', 'only_first', "
                                 "'only_second' or 'do_not_truncate'")
        if max_length is None:
            if pad == "max_length":
                if self.model_max_length > LARGE_INTEGER:
                    pad = "do_not_pad"
                else:
                    max_length = self.model_max_length
            if trunc != "do_not_truncate":
                if self.model_max_length > LARGE_INTEGER:
                    trunc = "do_not_truncate"
                else:
                    max_length = self.model_max_length
        if pad != "do_not_pad" and (self.pad_token is None or self.pad_token_id is None or self.pad_token_id < 0):
            raise InputError("padding was asked for, but this tokenizer has no pad token")
        return pad, trunc, max_length

    def __call__(self, text: str | Sequence[str], text_pair: str | Sequence[str] | None = None, *,
                 add_special_tokens: bool = True, padding: bool | str = False, truncation: bool | str | None = None,
                 max_length: int | None = None, stride: int = 0, pad_to_multiple_of: int | None = None,
                 padding_side: str | None = None, return_tensors: str | None = "pt",
                 return_token_type_ids: bool | None = None, return_attention_mask: bool | None = None,
                 return_overflowing_tokens: bool = False, return_special_tokens_mask: bool = False,
                 return_offsets_mapping: bool = False, return_length: bool = False,
                 is_split_into_words: bool = False) -> BatchEncoding:
        """``is_split_into_words=True``: ``text`` is one list of words, or a batch of them (token classification's
        ``tokenizer(examples["tokens"], truncation=True, is_split_into_words=True)``), as transformers."""
        pad, trunc, max_length = self._strategies(padding, truncation, max_length)
        batched = isinstance(text, (list, tuple))
        if is_split_into_words:
            inputs, batched = _words(text, text_pair)
        elif batched:
            if isinstance(text_pair, str):
                raise InputError("when text is a batch, text_pair must be a batch of the same length")
            if text_pair is not None and len(text) != len(text_pair):
                raise InputError(f"batch length of text ({len(text)}) does not match text_pair ({len(text_pair)})")
            if text_pair is not None:
                inputs = list(zip(text, text_pair))
            elif all(isinstance(t, (list, tuple)) and len(t) == 2 for t in text) and text:
                inputs = [tuple(t) for t in text]  # a batch of (text, pair) tuples
            else:
                inputs = list(text)
        elif isinstance(text, str):
            if text_pair is not None and not isinstance(text_pair, str):
                raise InputError(f"text_pair is a {type(text_pair).__name__}: with a single text it must be a string")
            inputs = [(text, text_pair)] if text_pair else [text]
        else:
            raise InputError(f"text must be a string or a list of strings, not {type(text).__name__}")
        if not is_split_into_words:
            _check_inputs(inputs)

        backend = self.backend_tokenizer
        if trunc == "do_not_truncate":
            backend.no_truncation()
        else:
            backend.enable_truncation(max_length, stride=stride, strategy=trunc, direction=self.truncation_side)
        if pad == "do_not_pad":
            backend.no_padding()
        else:
            backend.enable_padding(direction=padding_side or self.padding_side, pad_id=self.pad_token_id,
                                   pad_type_id=self.settings.pad_token_type_id, pad_token=self.pad_token,
                                   length=max_length if pad == "max_length" else None,
                                   pad_to_multiple_of=pad_to_multiple_of)
        try:
            encodings = backend.encode_batch(inputs, add_special_tokens=add_special_tokens,
                                             is_pretokenized=is_split_into_words)
        finally:
            backend.no_truncation()
            backend.no_padding()

        if return_token_type_ids is None:
            return_token_type_ids = "token_type_ids" in self.settings.model_input_names
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.settings.model_input_names
        fields: dict[str, list] = {"input_ids": []}
        if return_token_type_ids:
            fields["token_type_ids"] = []
        if return_attention_mask:
            fields["attention_mask"] = []
        if return_special_tokens_mask:
            fields["special_tokens_mask"] = []
        if return_offsets_mapping:
            fields["offset_mapping"] = []
        if return_length:
            fields["length"] = []
        flat: list[Encoding] = []
        sample_of: list[int] = []
        for i, encoding in enumerate(encodings):
            windows = [encoding] + list(encoding.overflowing) if return_overflowing_tokens else [encoding]
            for e in windows:
                flat.append(e)
                sample_of.append(i)
                fields["input_ids"].append(e.ids)
                if return_token_type_ids:
                    fields["token_type_ids"].append(e.type_ids)
                if return_attention_mask:
                    fields["attention_mask"].append(e.attention_mask)
                if return_special_tokens_mask:
                    fields["special_tokens_mask"].append(e.special_tokens_mask)
                if return_offsets_mapping:
                    fields["offset_mapping"].append(e.offsets)
                if return_length:
                    fields["length"].append(len(e.ids))
        if return_overflowing_tokens:
            fields["overflow_to_sample_mapping"] = sample_of

        if return_tensors is not None:
            if return_tensors not in ("pt", "np"):
                raise ValueError(f"return_tensors={return_tensors!r}: expected 'pt', 'np' or None")
            return BatchEncoding({k: as_tensor(k, v, return_tensors) for k, v in fields.items()}, flat)
        if not batched and not return_overflowing_tokens:
            return BatchEncoding({k: (v[0] if v and isinstance(v[0], list) else v) for k, v in fields.items()}, flat)
        return BatchEncoding(fields, flat)


# ---- chat templates ------------------------------------------------------------------------------
# Written from transformers 5.24's tokenization_utils_base.py (apply_chat_template, get_chat_template) and
# utils/chat_template_utils.py (the Jinja environment, render_jinja_template).

_CALL_KEYWORDS = frozenset(inspect.signature(Tokenizer.__call__).parameters) - {"self"}


# ---- input checks --------------------------------------------------------------------------------

def _special(token: str | AddedToken) -> AddedToken:
    """A special token as transformers adds one: no stripping, not normalised."""
    if isinstance(token, AddedToken):
        return token
    return AddedToken(token, rstrip=False, lstrip=False, normalized=False, special=True)


def check_text(value, where: str) -> None:
    """InputError naming ``where`` unless ``value`` is a string of valid Unicode (no lone surrogates)."""
    if not isinstance(value, str):
        raise InputError(f"{where} is a {type(value).__name__}: expected a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{where} is not valid Unicode text (a lone surrogate at {exc.start})") from None


def _check_inputs(inputs: list) -> None:
    """Each input is a string or a (string, string) pair of valid Unicode (no lone surrogates)."""
    for i, item in enumerate(inputs):
        for part, name in ((item, "text"),) if not isinstance(item, tuple) else zip(item, ("text", "text_pair")):
            check_text(part, f"{name}[{i}]")


def _words(text: Any, text_pair: Any) -> tuple[list, bool]:
    """(the backend's pre-tokenized inputs, batched) for ``is_split_into_words=True``: a list of words, or a batch
    (a list of such lists), with an optional ``text_pair`` of the same shape; each word a valid string."""
    batched = isinstance(text, (list, tuple)) and bool(text) and isinstance(text[0], (list, tuple))
    if batched and text_pair is not None and (not isinstance(text_pair, (list, tuple)) or len(text_pair) != len(text)):
        raise InputError("is_split_into_words=True with a batch: text_pair must be a batch of word lists of the same "
                         f"length ({len(text)})")
    items = (list(zip(text, text_pair)) if text_pair is not None else list(text)) if batched \
        else ([(text, text_pair)] if text_pair else [text])
    inputs = []
    for i, item in enumerate(items):
        parts = item if isinstance(item, tuple) and text_pair is not None else (item,)
        for part, name in zip(parts, ("text", "text_pair")):
            if not isinstance(part, (list, tuple)):
                raise InputError(f"is_split_into_words=True: {name}[{i}] is a {type(part).__name__}; expected a list "
                                 "of words (strings)")
            for j, word in enumerate(part):
                check_text(word, f"{name}[{i}][{j}]")
        inputs.append(tuple(list(p) for p in parts) if len(parts) == 2 else list(parts[0]))
    return inputs, batched


# ---- loading -----------------------------------------------------------------------------------

class AutoTokenizer:
    """``AutoTokenizer.from_pretrained(source)``: a directory, ``samples/<name>``, or a hub id."""

    @staticmethod
    def from_pretrained(source: str | os.PathLike, revision: str | None = None, **options: Any) -> Tokenizer:
        """Load the tokenizer of ``source``; ``options`` override tokenizer_config.json, as in transformers."""
        if options.get("gguf_file") is not None:  # the file's embedded tokenizer (flodl_hf.gguf, through a slot)
            backend, settings = slots.READ_GGUF_TOKENIZER(source, options.pop("gguf_file"), options)
        else:
            backend, settings = read_tokenizer(source, revision, options)
        tokenizer = Tokenizer(backend, settings, str(source))
        root = Path(settings.directory) if settings.directory else None
        tokenizer.init_kwargs = saving.init_kwargs(root, settings.class_name, options)
        return tokenizer
