"""How transformers 5 rebuilds the pipeline of each tokenizer class of our families from a tokenizer.json.

For these classes transformers takes only the vocabulary (and merges) from ``tokenizer.json`` and rebuilds the
normaliser, pre-tokeniser, decoder and post-processor from the class's own recipe and the options in
``tokenizer_config.json``: one ``Recipe`` per class in ``RECIPES``, each written from
``transformers/models/<family>/tokenization_<family>.py`` (5.24) and cited there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer


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
