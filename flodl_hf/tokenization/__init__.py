"""Tokenizers that give exactly transformers' ids, masks, type ids and offsets for the same directory.

How transformers 5 builds a tokenizer decides how we build ours:

- For the classes of our families (BertTokenizer, RobertaTokenizer, XLMRobertaTokenizer, AlbertTokenizer,
  DebertaV2Tokenizer, ...) transformers takes only the vocabulary (and merges) from ``tokenizer.json`` and
  rebuilds the normaliser, pre-tokeniser, decoder and post-processor from the class's own recipe and the
  options in ``tokenizer_config.json`` (``do_lower_case``, ``add_prefix_space``, special tokens...). So a
  ``tokenizer.json`` is not the whole truth. We load it directly with ``tokenizers`` and apply the same
  recipe: one entry per class in ``RECIPES`` (``recipes``), each written from
  ``transformers/models/<family>/tokenization_<family>.py`` (5.24) and cited there.
- Everything else (a directory with only ``vocab.txt`` or a SentencePiece model, or a class we have no
  recipe for) is converted by transformers itself, so the conversion cannot differ from it.

Either way the result (``loading``) is a ``tokenizers.Tokenizer`` plus the few settings transformers keeps beside
it (``settings``: special tokens, ``model_max_length``, ``model_input_names``, padding side...), and
``Tokenizer.__call__`` (``tokenizer``) drives it exactly as transformers' ``TokenizersBackend`` does. Chat
templates render in ``chat``.
"""

from __future__ import annotations

from flodl_hf.tokenization.chat import ChatTemplateError, render_chat
from flodl_hf.tokenization.sandbox import LIMITS, ChatLimits, ChatTemplateLimitError
from flodl_hf.tokenization.loading import CLASS_FOR_MODEL_TYPE, class_name_for, read_tokenizer, tokenizer_directory
from flodl_hf.tokenization.recipes import RECIPES, Recipe
from flodl_hf.tokenization.settings import LARGE_INTEGER, SPECIAL_TOKEN_NAMES, VERY_LARGE_INTEGER, TokenizerSettings
from flodl_hf.tokenization.tokenizer import AutoTokenizer, BatchEncoding, Tokenizer, check_text

__all__ = ["AutoTokenizer", "BatchEncoding", "CLASS_FOR_MODEL_TYPE", "ChatLimits", "ChatTemplateError",
           "ChatTemplateLimitError", "LIMITS", "LARGE_INTEGER", "RECIPES", "Recipe", "SPECIAL_TOKEN_NAMES",
           "Tokenizer", "TokenizerSettings", "VERY_LARGE_INTEGER", "check_text", "class_name_for", "read_tokenizer",
           "render_chat", "tokenizer_directory"]
