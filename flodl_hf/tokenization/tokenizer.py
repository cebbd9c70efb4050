"""Tokenizers that give exactly transformers' ids, masks, type ids and offsets for the same directory.

How transformers 5 builds a tokenizer decides how we build ours:

- For the classes of our families (BertTokenizer, RobertaTokenizer, XLMRobertaTokenizer, AlbertTokenizer,
  DebertaV2Tokenizer, ...) transformers takes only the vocabulary (and merges) from ``tokenizer.json`` and
  rebuilds the normaliser, pre-tokeniser, decoder and post-processor from the class's own recipe and the
  options in ``tokenizer_config.json`` (``do_lower_case``, ``add_prefix_space``, special tokens...). So a
  ``tokenizer.json`` is not the whole truth. We load it directly with ``tokenizers`` and apply the same
  recipe: one entry per class in ``RECIPES``, each written from
  ``transformers/models/<family>/tokenization_<family>.py`` (5.24) and cited there.
- Everything else (a directory with only ``vocab.txt`` or a SentencePiece model, or a class we have no
  recipe for) is converted by transformers itself, so the conversion cannot differ from it.

Either way the result is a ``tokenizers.Tokenizer`` plus the few settings transformers keeps beside it
(special tokens, ``model_max_length``, ``model_input_names``, padding side...), and ``Tokenizer.__call__``
drives it exactly as transformers' ``TokenizersBackend`` does.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import inspect
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tokenizers import AddedToken, Encoding, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from flodl_hf.core import io
from flodl_hf.tokenization.chat import (_chat_template_value, _conversations, _named_origin, _read_template_file,
                                        render_chat)
from flodl_hf.core.errors import ConfigError, FlodlHFError, InputError, SourceNotFoundError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"            # beside tokenizer_config.json; wins over its chat_template
CHAT_TEMPLATE_DIR = "additional_chat_templates"       # <name>.jinja: more named templates
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
VERY_LARGE_INTEGER = int(1e30)  # transformers' "no limit" model_max_length
LARGE_INTEGER = int(1e20)
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


# ---- recipes: how transformers 5 rebuilds the pipeline of each class ----------------------------------

@dataclass(frozen=True)
class Recipe:
    """One tokenizer class as transformers 5.24 builds it from a tokenizer.json vocabulary and its options."""

    model_type: str                       # the tokenizers model the class builds ("WordPiece", "BPE", "Unigram")
    model_input_names: tuple[str, ...]
    defaults: dict[str, Any]              # __init__ defaults: special tokens and options
    model: Callable[[dict, dict], dict]   # (tokenizer.json "model" section, options) -> the model transformers builds
    pipeline: Callable[[BackendTokenizer, dict, Callable[[str], int | None]], None]
    # ALBERT sets its post-processor before TokenizersBackend.__init__, which then puts tokenizer.json's back.
    file_post_processor_wins: bool = False


BERT_SPECIALS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                 "mask_token": "[MASK]"}
ROBERTA_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>",
                    "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>"}


def _cls_sep_template(cls: str, sep: str, cls_id: int | None, sep_id: int | None) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)])


def _metaspace(prepend_scheme: str) -> tuple[pre_tokenizers.Metaspace, decoders.Metaspace]:
    return (pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme),
            decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme))


def _precompiled(options: dict) -> list:
    charsmap = options.get("_spm_precompiled_charsmap")
    return [normalizers.Precompiled(charsmap)] if charsmap is not None else []


# models/bert/tokenization_bert.py: BertTokenizer.__init__
def _wordpiece_model(section: dict, o: dict) -> dict:
    return {"type": "WordPiece", "unk_token": o["unk_token"], "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100, "vocab": section["vocab"]}


def _bert_pipeline(t: BackendTokenizer, o: dict, token_id: Callable) -> None:
    t.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=o["tokenize_chinese_chars"],
                                              strip_accents=o["strip_accents"], lowercase=o["do_lower_case"])
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece(prefix="##")
    cls_id, sep_id = token_id(o["cls_token"]), token_id(o["sep_token"])
    t.post_processor = _cls_sep_template(o["cls_token"], o["sep_token"], 2 if cls_id is None else cls_id,
                                         3 if sep_id is None else sep_id)


# models/roberta/tokenization_roberta.py: RobertaTokenizer.__init__
def _bpe_model(section: dict, o: dict) -> dict:
    return {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": section["vocab"], "merges": section.get("merges", [])}


def _roberta_pipeline(t: BackendTokenizer, o: dict, token_id: Callable) -> None:
    t.normalizer = None
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=o["add_prefix_space"])
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.RobertaProcessing((o["sep_token"], token_id(o["sep_token"])),
                                                    (o["cls_token"], token_id(o["cls_token"])),
                                                    o["trim_offsets"], o["add_prefix_space"])


def _unigram_model(unk_id: Callable[[list, dict], int]) -> Callable[[dict, dict], dict]:
    def build(section: dict, o: dict) -> dict:
        vocab = [[piece, score] for piece, score in section["vocab"]]
        return {"type": "Unigram", "unk_id": unk_id(vocab, o), "vocab": vocab, "byte_fallback": False}
    return build


# models/xlm_roberta/tokenization_xlm_roberta.py: XLMRobertaTokenizer.__init__ (unk_id is fixed at 3 there)
def _xlm_roberta_pipeline(t: BackendTokenizer, o: dict, token_id: Callable) -> None:
    charsmap = _precompiled(o)
    t.normalizer = charsmap[0] if charsmap else None
    scheme = "always" if o["add_prefix_space"] else "never"
    metaspace, t.decoder = _metaspace(scheme)
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace])
    bos, eos = o["bos_token"], o["eos_token"]
    t.post_processor = processors.TemplateProcessing(
        single=[bos, "$A", eos], pair=[bos, "$A", eos, eos, "$B", eos],
        special_tokens=[(bos, token_id(bos)), (eos, token_id(eos))])


# models/albert/tokenization_albert.py: AlbertTokenizer.__init__ (unk_id is fixed at 1 there)
def _albert_pipeline(t: BackendTokenizer, o: dict, token_id: Callable) -> None:
    steps = [normalizers.Replace("``", '"'), normalizers.Replace("''", '"')]
    if not o["keep_accents"]:
        steps += [normalizers.NFKD(), normalizers.StripAccents()]
    if o["do_lower_case"]:
        steps.append(normalizers.Lowercase())
    t.normalizer = normalizers.Sequence(steps + _precompiled(o))
    scheme = "always" if o["add_prefix_space"] else "never"
    metaspace, t.decoder = _metaspace(scheme)
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), metaspace])
    t.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", token_id(o["cls_token"])), ("[SEP]", token_id(o["sep_token"]))])


# models/deberta_v2/tokenization_deberta_v2.py: DebertaV2Tokenizer.__init__
def _deberta_unk_id(vocab: list, o: dict) -> int:
    entry = [o["unk_token"], 0.0]
    return vocab.index(entry) if entry in vocab else o["unk_id"]


def _deberta_v2_pipeline(t: BackendTokenizer, o: dict, token_id: Callable) -> None:
    steps = [normalizers.Lowercase()] if o["do_lower_case"] else []
    steps += [normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " "), normalizers.NFC(),
              normalizers.Strip(left=False, right=True)]
    t.normalizer = normalizers.Sequence(steps)
    scheme = "always" if o["add_prefix_space"] else "first"
    metaspace, t.decoder = _metaspace(scheme)
    t.pre_tokenizer = pre_tokenizers.Sequence(
        ([pre_tokenizers.Punctuation(behavior="isolated")] if o["split_by_punct"] else []) + [metaspace])
    cls_id, sep_id = token_id(o["cls_token"]), token_id(o["sep_token"])
    t.post_processor = _cls_sep_template(o["cls_token"], o["sep_token"], 0 if cls_id is None else cls_id,
                                         0 if sep_id is None else sep_id)


# models/deberta/tokenization_deberta.py: DebertaTokenizer.__init__ (byte-level BPE; pairs [CLS] a [SEP] [SEP] b [SEP])
def _deberta_pipeline(t: BackendTokenizer, o: dict, token_id: Callable) -> None:
    t.normalizer = None
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=o["add_prefix_space"])
    t.decoder = decoders.ByteLevel()
    cls, sep = o["cls_token"], o["sep_token"]
    t.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} {sep} $B {sep}",
                                                    special_tokens=[(cls, token_id(cls)), (sep, token_id(sep))])


_BERT = Recipe("WordPiece", ("input_ids", "token_type_ids", "attention_mask"),
               {**BERT_SPECIALS, "do_lower_case": True, "tokenize_chinese_chars": True, "strip_accents": None},
               _wordpiece_model, _bert_pipeline)
RECIPES: dict[str, Recipe] = {
    "BertTokenizer": _BERT,
    "DistilBertTokenizer": dataclasses.replace(_BERT, model_input_names=("input_ids", "attention_mask")),
    "RobertaTokenizer": Recipe("BPE", ("input_ids", "attention_mask"),
                               {**ROBERTA_SPECIALS, "add_prefix_space": False, "trim_offsets": True},
                               _bpe_model, _roberta_pipeline),
    "XLMRobertaTokenizer": Recipe("Unigram", ("input_ids", "attention_mask"),
                                  {**ROBERTA_SPECIALS, "add_prefix_space": True},
                                  _unigram_model(lambda vocab, o: 3), _xlm_roberta_pipeline),
    "AlbertTokenizer": Recipe("Unigram", ("input_ids", "attention_mask"),
                              {"bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "<unk>", "sep_token": "[SEP]",
                               "pad_token": "<pad>", "cls_token": "[CLS]", "mask_token": "[MASK]",
                               "do_lower_case": True, "keep_accents": False, "add_prefix_space": True},
                              _unigram_model(lambda vocab, o: 1), _albert_pipeline, file_post_processor_wins=True),
    "DebertaTokenizer": Recipe("BPE", ("input_ids", "attention_mask", "token_type_ids"),
                               {"bos_token": "[CLS]", "eos_token": "[SEP]", "sep_token": "[SEP]", "cls_token": "[CLS]",
                                "unk_token": "[UNK]", "pad_token": "[PAD]", "mask_token": "[MASK]",
                                "add_prefix_space": False}, _bpe_model, _deberta_pipeline),
    "DebertaV2Tokenizer": Recipe("Unigram", ("input_ids", "attention_mask", "token_type_ids"),
                                 {"bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "[UNK]",
                                  "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                                  "mask_token": "[MASK]", "do_lower_case": False, "split_by_punct": False,
                                  "add_prefix_space": True, "unk_id": 1},
                                 _unigram_model(_deberta_unk_id), _deberta_v2_pipeline),
}


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

    def word_ids(self, index: int = 0) -> list[int | None]:
        return self.encodings[index].word_ids

    def sequence_ids(self, index: int = 0) -> list[int | None]:
        return self.encodings[index].sequence_ids

    def tokens(self, index: int = 0) -> list[str]:
        return self.encodings[index].tokens

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
        # bos_token ... mask_token and their *_id, from the settings.
        if name in SPECIAL_TOKEN_NAMES:
            return self.settings.special_tokens.get(name)
        if name.endswith("_id") and name[:-3] in SPECIAL_TOKEN_NAMES:
            token = self.settings.special_tokens.get(name[:-3])
            return None if token is None else self.convert_tokens_to_ids(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

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
                out["assistant_masks"] = _as_tensor("assistant_masks", masks, return_tensors)
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
                 return_offsets_mapping: bool = False, return_length: bool = False) -> BatchEncoding:
        pad, trunc, max_length = self._strategies(padding, truncation, max_length)
        batched = isinstance(text, (list, tuple))
        if batched:
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
            encodings = backend.encode_batch(inputs, add_special_tokens=add_special_tokens)
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
            return BatchEncoding({k: _as_tensor(k, v, return_tensors) for k, v in fields.items()}, flat)
        if not batched and not return_overflowing_tokens:
            return BatchEncoding({k: (v[0] if v and isinstance(v[0], list) else v) for k, v in fields.items()}, flat)
        return BatchEncoding(fields, flat)


# ---- chat templates ------------------------------------------------------------------------------
# Written from transformers 5.24's tokenization_utils_base.py (apply_chat_template, get_chat_template,
# _from_pretrained's template files) and utils/chat_template_utils.py (the Jinja environment, render_jinja_template).

_CALL_KEYWORDS = frozenset(inspect.signature(Tokenizer.__call__).parameters) - {"self"}


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


def _as_tensor(key: str, value: list, kind: str) -> Any:
    lengths = {len(v) for v in value if isinstance(v, list)}
    if len(lengths) > 1:
        raise InputError(f"cannot make one tensor of '{key}': sequences have different lengths {sorted(lengths)}; "
                         "pass padding=True (and truncation=True for long texts)")
    tensor = torch.tensor(value, dtype=torch.long)
    return tensor.numpy() if kind == "np" else tensor


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


def class_name_for(root: Path, config: dict | None = None) -> str | None:
    """The tokenizer class transformers would pick for this directory (None: unknown)."""
    tok_config = _read_json(root / TOKENIZER_CONFIG) if config is None else config
    name = tok_config.get("tokenizer_class")
    model_config = _read_json(root / "config.json")
    if not name:
        name = model_config.get("tokenizer_class") or CLASS_FOR_MODEL_TYPE.get(model_config.get("model_type", ""))
    return name.removesuffix("Fast") if name else None


class AutoTokenizer:
    """``AutoTokenizer.from_pretrained(source)``: a directory, ``samples/<name>``, or a hub id."""

    @staticmethod
    def from_pretrained(source: str | os.PathLike, revision: str | None = None, **options: Any) -> Tokenizer:
        """Load the tokenizer of ``source``; ``options`` override tokenizer_config.json, as in transformers."""
        root = tokenizer_directory(source, revision)
        file_config = _read_json(root / TOKENIZER_CONFIG)
        chat = _chat_settings(root, file_config, options)
        tokenizer = AutoTokenizer._load(root, source, {**file_config, **options}, options)
        for key, value in chat.items():
            setattr(tokenizer.settings, key, value)
        return tokenizer

    @staticmethod
    def _load(root: Path, source: str | os.PathLike, tok_config: dict, options: dict) -> Tokenizer:
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
                return _from_recipe(root, data, tok_config, class_name, recipe, str(source))
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


def _from_recipe(root: Path, data: dict, tok_config: dict, class_name: str, recipe: Recipe, source: str) -> Tokenizer:
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
    return Tokenizer(backend, settings, source)


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


def _from_transformers(root: Path, source: str, options: dict) -> Tokenizer:
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
    settings = TokenizerSettings(
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
    return Tokenizer(copy.deepcopy(backend), settings, source)
