"""Text generation with a decoder and its KV cache: greedy or sampled, batched with left padding.

``generate_ids`` mirrors transformers 5.24's ``GenerationMixin._sample`` step for step, so greedy ids are
those of ``model.generate`` with the same settings, and so are sampled ids where the RNG use matches:
- the settings merge as ``_prepare_generation_config`` merges them: an argument given (not None) wins, else
  the checkpoint's ``generation_config.json`` (eos ids, often a list; pad; do_sample, temperature, top_k,
  top_p; max_new_tokens / max_length), else transformers' global defaults (greedy, temperature 1.0, top_k 50,
  top_p 1.0, 20 new tokens); without the file, eos and pad come from config.json (``from_model_config``).
  A ``generation_config`` passed in (a transformers GenerationConfig or a dict) sits between the keywords and the
  file. A field we do not implement (group beams, guidance, watermarking, top-h...) set to a value that changes
  decoding is a ConfigError naming the file and the field (an InputError for a keyword or a passed generation_config);
- without an attention mask, the pad id's positions are masked when the pad id is set, is no eos, and occurs
  (``_prepare_attention_mask_for_generation``); ``num_return_sequences`` repeats each row (``repeat_interleave``);
- the prompt runs once with ``logits_to_keep=1`` (the prefill), positions ``cumsum(mask) - 1`` (0 on pads);
- every later step feeds the last token alone, its position, the mask grown by one, and the cache;
- the next-token scores are the last logits copied to float32, then the logits processors of
  ``_get_logits_processor`` in its order, with their ops (``generation_processors``): sequence bias, repetition
  penalty (left padding skipped), n-gram ban, bad words, minimum length, forced bos / eos, invalid values,
  exponential decay, suppression; when sampling temperature, top-k, top-p, min-p, typical, epsilon, eta; then
  renormalization;
- ``use_cache=False`` runs the whole sequence at every step, as transformers does without a cache;
- greedy takes ``argmax`` of the scores; sampling ``torch.multinomial(softmax(scores), 1)`` drawn, as transformers, from
  torch's global generator (so ``torch.manual_seed(s)`` before either gives the same draws), or with
  ``seed=s`` from a generator of its own seeded with ``s`` (the same stream on CPU, the global one untouched);
- a row that produced eos, ended a stop string (``stop_strings`` with ``tokenizer=``, StopStringCriteria) gets
  the pad id from then on (when an eos id is set, as transformers); generation stops when every row has, at the
  maximum length, or past ``max_time`` seconds;
- ``num_beams > 1`` runs ``_beam_search`` instead (``_beam_search`` below), beam sampling with ``do_sample``;
- ``prompt_lookup_num_tokens`` and ``assistant_model`` run ``_assisted`` (transformers' assisted decoding, one
  prompt) on prompt lookup's candidates or on an assistant model's (``assisted.AssistantDrafts``, speculative
  sampling when sampling), the KV caches ``_DraftCache`` that crop the rejected candidates;
- ``inputs_embeds`` prompts as ``_prepare_model_inputs`` takes them on a decoder: the embeddings feed the first
  forward alone (``prepare_inputs_for_generation``), the ids (none: an empty (B, 0) tensor) carry on, so that
  without ``input_ids`` only the new tokens come back; the cache always on (``_embedded_prompt``);
- ``prefix_allowed_tokens_fn``: ``PrefixConstrained``, in its place among the processors;
- transformers' hooks: custom ``logits_processor`` / ``stopping_criteria`` merged into the built-in lists as
  ``_merge_criteria_processor_list`` merges them (``generation_processors.merge``), and a ``streamer`` handed the
  prompt, each step's new ids and ``end()`` as ``_sample`` hands them (not with beams: transformers raises, or with
  beam sampling never ends it).
``generate(prompts, model, ...)`` is the one-liner over texts, equal to transformers 5.24's text-generation
pipeline: its defaults where neither the call nor the file sets one (256 new tokens, sampling at temperature
0.7), its shapes (a list of records per prompt) and keys (``generated_text``, ``generated_token_ids``), with
greedy prompts batched by left padding and sampled ones run one at a time in the pipeline's RNG order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from flodl_hf.core import io
from flodl_hf.generation.assisted import (ASSISTANT_DEFAULTS, AssistantDrafts, TranslatedDrafts,
                                          check_assistant_config, speculative_sampling)
from flodl_hf.core.decoder import KVCache, StaticKVCache
from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.generation.processors import (Guidance, PrefixConstrained, StopStrings, apply, final_steps,
                                            logits_processors, stop_hits, stopping_criteria_list, watermark_fields)
from flodl_hf.core.modeling import PLAIN_RECORD, config_sets_forward_defaults
from flodl_hf.core.outputs import ModelOutput

Source = str | Path | torch.nn.Module


GENERATION_CONFIG = "generation_config.json"

# transformers' GenerationConfig._get_default_generation_params, for the fields generate_ids implements
GLOBAL_DEFAULTS: dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                                   "repetition_penalty": 1.0, "num_return_sequences": 1, "use_cache": True,
                                   "min_length": 0, "return_dict_in_generate": False, "output_scores": False,
                                   "output_logits": False, "output_hidden_states": False,
                                   "output_attentions": False, "num_beams": 1, "length_penalty": 1.0,
                                   "early_stopping": False}
DEFAULT_NEW_TOKENS = 20  # transformers' max_length=20 default, counted in new tokens (_prepare_generated_length)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _eos_list(eos_token_id: Any, name: str = "eos_token_id", error: type = InputError) -> list[int]:
    """An eos id, a list of them, or a tensor of them (0-d or 1-d, as transformers takes) -> a list of ids."""
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        if eos_token_id.dim() > 1 or eos_token_id.is_floating_point() or eos_token_id.is_complex() \
                or eos_token_id.dtype == torch.bool:
            raise error(f"{name}={eos_token_id!r}: expected an integer tensor of 0 or 1 dimensions")
        eos_token_id = eos_token_id.tolist()
    ids = [eos_token_id] if not isinstance(eos_token_id, (list, tuple)) else list(eos_token_id)
    if not all(_is_int(e) for e in ids):
        raise error(f"{name}={eos_token_id!r}: expected a token id or a list of them")
    return ids


def _pad_id(pad_token_id: Any, name: str = "pad_token_id", error: type = InputError) -> int | None:
    if isinstance(pad_token_id, torch.Tensor) and pad_token_id.dim() == 0 and not pad_token_id.is_floating_point():
        pad_token_id = pad_token_id.item()
    if pad_token_id is not None and not _is_int(pad_token_id):
        raise error(f"{name}={pad_token_id!r}: expected a token id or None")
    return pad_token_id


# Fields of generation_config.json (or of a generation_config passed in, or keywords) that generate_ids does not
# implement, with the test that their value changes nothing (transformers' _get_logits_processor /
# _get_stopping_criteria skip them then). A field set otherwise is refused rather than ignored. "sample": matters
# only when sampling.
def _off(*neutral: Any):
    return lambda v: v is None or any(v == n and type(v) is not bool or v is n for n in neutral)


# transformers 5.25's static cache implementations (ALL_STATIC_CACHE_IMPLEMENTATIONS) that generate implements: a
# StaticCache sized max_length - 1 (decoder.StaticKVCache), the deprecated names inferring the same layers
STATIC_CACHES = ("static", "sliding_window", "hybrid", "hybrid_chunked")
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "num_beam_groups": (_off(1), "group beam search"),
    "force_words_ids": (_off(), "constrained beam search"), "constraints": (_off(), "constrained beam search"),
    "penalty_alpha": (_off(), "contrastive search"), "dola_layers": (_off(), "DoLa decoding"),
    "token_healing": (_off(False), "token healing"),
    "use_mtp": (_off(False), "multi-token prediction"),
    "cache_implementation": (_off("dynamic", *STATIC_CACHES), "another cache"),
}
# keywords of transformers' generate that only shape what it records, accepted at these values
_NEUTRAL_KEYWORDS: dict[str, Any] = {}


def _count(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _positive(value: Any) -> bool:
    return _is_int(value) and value >= 1


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


def _ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(_count(i) for i in value)


def _id_lists(value: Any) -> bool:
    """NoBadWordsLogitsProcessor._validate_arguments: a non-empty list of non-empty lists of ids."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, list) and v and _ids(v) for v in value)


def _sequence_bias(value: Any) -> bool:
    """SequenceBiasLogitsProcessor._validate_arguments: ``[[ids, bias], ...]`` or ``{tuple(ids): bias}``, not empty,
    each ids a non-empty list of ids and each bias a float (an int is refused there too)."""
    if isinstance(value, dict):
        pairs = [(list(k), b) if isinstance(k, tuple) else (None, b) for k, b in value.items()]
    elif isinstance(value, list):
        pairs = [tuple(p) if isinstance(p, (list, tuple)) and len(p) == 2 else (None, None) for p in value]
    else:
        return False
    return bool(pairs) and all(isinstance(ids, list) and ids and _ids(ids) and isinstance(b, float)
                               for ids, b in pairs)


def _decay(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and _is_int(value[0]) and _is_number(value[1])


def _stop_strings(value: Any) -> bool:
    strings = [value] if isinstance(value, str) else value
    return isinstance(strings, (list, tuple)) and bool(strings) and all(isinstance(t, str) and t for t in strings)


# The fields generate_ids implements, checked alike in generation_config.json, a generation_config and keywords
_FIELDS: dict[str, tuple[Any, str]] = {
    "max_new_tokens": (_positive, "a positive integer"), "max_length": (_positive, "a positive integer"),
    "min_new_tokens": (_count, "a non-negative integer"), "min_length": (_count, "a non-negative integer"),
    "do_sample": (_flag, "true or false"), "temperature": (_is_number, "a number"),
    "top_k": (_count, "a non-negative integer"),
    "top_p": (lambda v: _is_number(v) and 0.0 <= v <= 1.0, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _is_number(v) and v > 0, "a positive number"),
    "num_return_sequences": (_positive, "a positive integer"), "use_cache": (_flag, "true or false"),
    "return_dict_in_generate": (_flag, "true or false"), "output_scores": (_flag, "true or false"),
    "output_hidden_states": (_flag, "true or false"), "output_attentions": (_flag, "true or false"),
    "output_logits": (_flag, "true or false"),
    # the logits processors and warpers (generation_processors); the ranges where their classes raise
    "min_p": (lambda v: _is_number(v) and 0.0 <= v <= 1.0, "a number in [0, 1]"),
    "top_h": (lambda v: _is_number(v) and 0.0 < v <= 1.0, "a number in (0, 1]"),
    "guidance_scale": (_is_number, "a number (1: no guidance)"),
    "watermarking_config": (lambda v: watermark_fields(v) is not None,
                            "WatermarkingConfig's fields (greenlist_ratio in (0, 1), bias, an integer hashing_key, "
                            "seeding_scheme 'lefthash' or 'selfhash', context_width >= 1; SynthID's is not "
                            "implemented)"),
    "typical_p": (lambda v: _is_number(v) and v > 0, "a positive number (1.0 or more: none)"),
    "epsilon_cutoff": (_is_number, "a number (applied in (0, 1))"),
    "eta_cutoff": (_is_number, "a number (applied in (0, 1))"),
    "no_repeat_ngram_size": (_count, "a non-negative integer"),
    "bad_words_ids": (_id_lists, "a non-empty list of non-empty lists of token ids"),
    "sequence_bias": (_sequence_bias, "a non-empty list of [token ids, float bias] pairs"),
    "forced_bos_token_id": (_count, "a token id"),
    "forced_eos_token_id": (lambda v: _count(v) or (_ids(v) and bool(v)), "a token id or a list of them"),
    "remove_invalid_values": (_flag, "true or false"), "renormalize_logits": (_flag, "true or false"),
    "exponential_decay_length_penalty": (_decay, "a pair [start index, decay factor]"),
    "suppress_tokens": (_ids, "a list of token ids"), "begin_suppress_tokens": (_ids, "a list of token ids"),
    # the stopping criteria (generation_processors.StopStrings, MaxTimeCriteria)
    "stop_strings": (_stop_strings, "a string or a non-empty list of non-empty strings"),
    "max_time": (lambda v: _is_number(v) and v >= 0, "a non-negative number of seconds"),
    # beam search (GenerationMixin._beam_search)
    "num_beams": (_positive, "a positive integer"), "length_penalty": (_is_number, "a number"),
    "early_stopping": (lambda v: v is True or v is False or v == "never", "true, false or \"never\""),
    # prompt lookup (transformers' assisted decoding with PromptLookupCandidateGenerator, _assisted below)
    "prompt_lookup_num_tokens": (_positive, "a positive integer"),
    # the cache: dynamic (the default) or static (decoder.StaticKVCache), sized at least max_cache_len
    "cache_implementation": (lambda v: isinstance(v, str), "a string (\"dynamic\" or \"static\")"),
    "max_cache_len": (_positive, "a positive integer"),
    # early exit (assisted decoding whose drafts come from the model's first layers, flodl_hf.generation.assisted)
    "assistant_early_exit": (_positive, "a positive integer (the layers the drafts run)"),
    "max_matching_ngram_size": (_count, "a non-negative integer (0 or unset: 2)"),
}
# the fields above that name token ids, checked against the vocabulary (the processors index the scores with them)
_ID_FIELDS = ("bad_words_ids", "sequence_bias", "forced_bos_token_id", "forced_eos_token_id")


def read_generation_config(root: str | Path | None) -> dict[str, Any] | None:
    """``generation_config.json`` beside the checkpoint as a dict, or None without one (or without a root)."""
    if root is None:
        return None
    path = Path(root) / GENERATION_CONFIG
    return io.read_json(path, GENERATION_CONFIG) if path.is_file() else None


@dataclass(frozen=True)
class GenerationSettings:
    """What ``generate_ids`` runs with, after transformers' merging (``_prepare_generation_config``)."""

    max_length: int | None  # total length, prompt included; max_new_tokens wins over it
    max_new_tokens: int | None
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    eos: list[int]
    pad: int | None
    min_length: int = 0  # total length, prompt included, below which an eos is banned
    min_new_tokens: int | None = None  # wins over min_length (_prepare_generated_length)
    repetition_penalty: float = 1.0
    num_return_sequences: int = 1
    use_cache: bool = True
    return_dict_in_generate: bool = False
    output_scores: bool = False
    output_logits: bool = False
    output_hidden_states: bool = False  # each forward's hidden states (and attentions) recorded per step
    output_attentions: bool = False
    # the logits processors (generation_processors.logits_processors), None / False / 0: not applied
    min_p: float | None = None
    top_h: float | None = None
    guidance_scale: float | None = None  # classifier-free guidance (generation_processors.Guidance) unless 1
    typical_p: float | None = None
    watermarking_config: Any = None  # a dict of WatermarkingConfig's fields, or one (generation_processors.Watermark)
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    no_repeat_ngram_size: int = 0
    bad_words_ids: list[list[int]] | None = None
    sequence_bias: Any = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | list[int] | None = None
    remove_invalid_values: bool = False
    exponential_decay_length_penalty: tuple[int, float] | None = None
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    renormalize_logits: bool = False
    stop_strings: str | list[str] | None = None
    max_time: float | None = None
    eos_set: bool = False  # an eos_token_id was given, [] included: transformers then pads finished rows
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    prompt_lookup_num_tokens: int | None = None  # candidates per step; None: no prompt lookup
    assistant_early_exit: int | None = None  # the model drafts with its first layers; None: no early exit
    cache_implementation: str | None = None  # None or "dynamic": DynamicCache; STATIC_CACHES: a static cache
    max_cache_len: int | None = None  # a static cache's least length
    max_matching_ngram_size: int | None = None  # the longest n-gram looked up (None or 0: 2, as transformers)

    def reads_history(self) -> bool:
        """Whether a processor reads the ids before the last (left padding included) or the sequence length."""
        return bool(self.no_repeat_ngram_size) or any(v is not None for v in (
            self.bad_words_ids, self.sequence_bias, self.forced_bos_token_id, self.watermarking_config))


_PROCESSOR_FIELDS = ("min_p", "top_h", "guidance_scale", "watermarking_config", "typical_p", "epsilon_cutoff",
                     "eta_cutoff", "no_repeat_ngram_size", "bad_words_ids",
                     "sequence_bias", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
                     "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
                     "renormalize_logits", "stop_strings", "max_time")
# the prompt lookup fields, copied like the processors' when set
_LOOKUP_FIELDS = ("prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit",
                  "cache_implementation", "max_cache_len")


@dataclass
class GenerateDecoderOnlyOutput(ModelOutput):
    """transformers' ``GenerateDecoderOnlyOutput`` (``return_dict_in_generate=True``): the ids, then per new token the
    processed scores (``output_scores``) and the raw float32 logits (``output_logits``), and the KV cache."""

    sequences: torch.Tensor
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[Any, ...] | None = None
    hidden_states: tuple[Any, ...] | None = None
    cache: Any = None


@dataclass
class GenerateBeamDecoderOnlyOutput(ModelOutput):
    """transformers' ``GenerateBeamDecoderOnlyOutput`` (beam search with ``return_dict_in_generate=True``): the ids,
    the returned hypotheses' scores (``output_scores``), per step the processed log-probabilities of every beam
    (``output_scores``) and the raw float32 logits (``output_logits``), each token's source beam, the KV cache."""

    sequences: torch.Tensor
    sequences_scores: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    beam_indices: torch.Tensor | None = None
    attentions: tuple[Any, ...] | None = None
    hidden_states: tuple[Any, ...] | None = None
    cache: Any = None


def _check_fields(data: dict[str, Any], where: str | None, error: type) -> None:
    """The implemented fields' types and ranges, in the file (ConfigError naming it), a generation_config or the
    keywords (InputError)."""
    prefix = f"{where}: " if where else ""
    for field, (ok, expected) in _FIELDS.items():
        if data.get(field) is not None and not ok(data[field]):
            raise error(f"{prefix}{field}={data[field]!r}: expected {expected}")
    _eos_list(data.get("eos_token_id"), f"{prefix}eos_token_id", error)
    _pad_id(data.get("pad_token_id"), f"{prefix}pad_token_id", error)


def _validate_generation_config(data: dict[str, Any], where: str) -> None:
    _check_fields(data, where, ConfigError)


def _generation_config_dict(generation_config: Any) -> dict[str, Any]:
    """A transformers ``GenerationConfig`` (its ``to_dict()``) or a dict -> the fields it sets (not None)."""
    if generation_config is None:
        return {}
    data = generation_config if isinstance(generation_config, dict) else None
    if data is None and callable(getattr(generation_config, "to_dict", None)):
        data = generation_config.to_dict()
    if not isinstance(data, dict):
        raise InputError(f"generation_config={type(generation_config).__name__}: expected a transformers "
                         "GenerationConfig or a dict of its fields")
    return {k: v for k, v in data.items()
            if v is not None and v != {} and not k.startswith("_") and k != "transformers_version"}


def model_generation_config(model: torch.nn.Module) -> Any:
    """transformers' ``model.generation_config``, a ``GenerationConfig``: the checkpoint's ``generation_config.json``
    (``read_generation_config``), else one made from config.json's special token ids (``from_model_config``); the one
    kept on the model once its ``generation_config`` was read (and maybe edited)."""
    kept = model.__dict__.get("_generation_config")
    if kept is not None:
        return kept
    from transformers import GenerationConfig
    data = read_generation_config(getattr(model, "source_root", None))
    if data is None:
        return GenerationConfig.from_model_config(model.config.to_dict())
    config = GenerationConfig.from_dict(data)
    config._original_object_hash = hash(config)  # as GenerationConfig.from_pretrained: an edit is then seen
    return config


def generation_settings(model: torch.nn.Module, max_new_tokens: int | None = None, do_sample: bool | None = None,
                        temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                        eos_token_id: Any = None, pad_token_id: Any = None, generation_config: Any = None,
                        **options: Any) -> GenerationSettings:
    """transformers' precedence, field by field: the keyword when given (not None), else ``generation_config``'s
    field (a transformers GenerationConfig or a dict), else the checkpoint's ``generation_config.json`` (read from
    ``model.source_root``), else transformers' global default (``do_sample`` False, ``temperature`` 1.0, ``top_k``
    50, ``top_p`` 1.0, 20 new tokens, ...). Without a ``generation_config.json`` transformers builds one from
    config.json (``from_model_config``): eos, pad and bos ids then come from the model's config; with one, they
    come from it alone (an eos it lacks is none). ``options``: the other fields of ``_FIELDS``; a keyword
    transformers takes that is not implemented here is an InputError naming it, unless its value changes nothing."""
    _check_arguments(max_new_tokens, do_sample, temperature, top_k, top_p)
    for name, value in options.items():
        if name in _FIELDS or value is None or _NEUTRAL_KEYWORDS.get(name, ...) is value:
            continue
        if name in _UNSUPPORTED:
            neutral, what = _UNSUPPORTED[name]
            if neutral(value):
                continue
            raise InputError(f"{name}={value!r} asks for {what}, which flodl-hf's generate does not implement")
        if name in ASSISTANT_DEFAULTS:
            raise InputError(f"{name}={value!r}: transformers reads it from assistant_model.generation_config, not "
                             "from generate's keywords (where it changes nothing); set it there")
        raise InputError(f"{name}={value!r}: flodl-hf's generate does not implement this keyword (transformers' "
                         "generate takes its generation settings and passes model inputs on to forward)")
    args = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "temperature": temperature, "top_k": top_k,
            "top_p": top_p, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
            **{k: v for k, v in options.items() if k in _FIELDS}}
    args = {k: v for k, v in args.items() if v is not None}
    _check_fields(args, None, InputError)
    given = _generation_config_dict(generation_config)
    _check_fields(given, "generation_config", InputError)
    root = getattr(model, "source_root", None)
    kept = model.__dict__.get("_generation_config")  # model.generation_config, once read (and maybe edited)
    data = read_generation_config(root) if kept is None else \
        {k: v for k, v in kept.to_diff_dict().items() if k != "transformers_version"}
    if kept is not None:
        where = "model.generation_config"
    elif data is None:  # GenerationConfig.from_model_config
        config = model.config
        data = {"eos_token_id": getattr(config, "eos_token_id", None),
                "pad_token_id": getattr(config, "pad_token_id", None)}
        where = "config.json"
    else:
        where = str(Path(root) / GENERATION_CONFIG)
    _validate_generation_config(data, where)
    merged = {**{k: v for k, v in data.items() if v is not None}, **given, **args}

    def refuse(field: str, why: str) -> Exception:
        if field in args:
            return InputError(f"{field}={merged[field]!r}: {why}")
        source = "generation_config" if field in given else where
        return (InputError if field in given else ConfigError)(f"{source}: {field}={merged[field]!r}: {why}")

    def pick(name: str) -> Any:
        return merged[name] if merged.get(name) is not None else GLOBAL_DEFAULTS[name]

    sample = pick("do_sample")
    eos = _eos_list(merged.get("eos_token_id"))
    pad = _pad_id(merged.get("pad_token_id"))
    if pad is None and eos:
        pad = eos[0]  # _prepare_special_tokens: "Setting pad_token_id to eos_token_id"
    settings = GenerationSettings(
        max_length=merged.get("max_length"), max_new_tokens=merged.get("max_new_tokens"), do_sample=sample,
        temperature=pick("temperature"), top_k=pick("top_k"), top_p=pick("top_p"), eos=eos, pad=pad,
        min_length=pick("min_length"), min_new_tokens=merged.get("min_new_tokens"),
        repetition_penalty=float(pick("repetition_penalty")), num_return_sequences=pick("num_return_sequences"),
        use_cache=pick("use_cache"), return_dict_in_generate=pick("return_dict_in_generate"),
        output_scores=pick("output_scores"), output_logits=pick("output_logits"),
        output_hidden_states=pick("output_hidden_states"), output_attentions=pick("output_attentions"),
        eos_set=merged.get("eos_token_id") is not None, num_beams=pick("num_beams"),
        length_penalty=pick("length_penalty"), early_stopping=pick("early_stopping"),
        **{k: merged[k] for k in (*_PROCESSOR_FIELDS, *_LOOKUP_FIELDS) if merged.get(k) is not None})
    if sample and not settings.temperature > 0:
        raise refuse("temperature", "sampling needs a positive temperature")
    if settings.num_return_sequences > 1 and not sample and settings.num_beams == 1:
        raise refuse("num_return_sequences", "several sequences per prompt need do_sample=True or num_beams > 1 "
                                             "(transformers: greedy decoding without beams does not support it)")
    if settings.num_return_sequences > settings.num_beams > 1:
        raise refuse("num_return_sequences", f"at most num_beams={settings.num_beams} sequences come out of a "
                                             "beam search (transformers refuses more)")
    if settings.prompt_lookup_num_tokens is not None and settings.num_beams == 1:  # with beams transformers ignores it
        if settings.num_return_sequences > 1:
            raise refuse("num_return_sequences", "prompt lookup (transformers' assisted generate) makes one sequence "
                                                 "per prompt (transformers raises)")
        if not settings.use_cache:
            raise refuse("use_cache", "prompt lookup checks its candidates against the KV cache and crops it "
                                      "(transformers raises: assisted decoding requires a cache)")
    if settings.num_beams > 1 and settings.eos_set and not eos and not settings.pad:
        raise refuse("eos_token_id", "beam search fills its sequences with the pad id, else the first eos id: "
                                     "with no eos and a pad id of 0 or none, transformers fails (eos_token_id[0])")
    vocab_size = getattr(model.config, "vocab_size", None)
    for field in _ID_FIELDS:  # the processors index the scores with these ids (transformers raises or fails)
        value = merged.get(field)
        if value is None or vocab_size is None:
            continue
        seqs = (list(value) if isinstance(value, dict) else [p[0] for p in value]) if field == "sequence_bias" \
            else value if field == "bad_words_ids" else [[value] if _is_int(value) else value]
        if any(i >= vocab_size for seq in seqs for i in seq):
            raise refuse(field, f"a token id beyond the vocabulary ({vocab_size} ids)")
    if settings.exponential_decay_length_penalty is not None:  # ExponentialDecayLengthPenalty indexes with the eos
        if not settings.eos_set:
            raise refuse("exponential_decay_length_penalty", "it raises the eos ids' scores, and no eos_token_id is "
                                                             "set (transformers fails on torch.tensor(None))")
        if any(e < 0 for e in eos):  # its ValueError; an id past the vocabulary fails only where it applies
            where_eos = "eos_token_id" if "eos_token_id" in args or "eos_token_id" in given else where
            raise refuse("exponential_decay_length_penalty", f"it indexes the scores with the eos ids {eos} "
                                                             f"({where_eos}), which need to be non-negative "
                                                             "(transformers raises)")
    for field in ("forced_bos_token_id", "forced_eos_token_id"):  # GenerationConfig.validate, 2.7
        forced = merged.get(field)
        if forced is not None and settings.suppress_tokens is not None:
            forced = {forced} if _is_int(forced) else set(forced)
            if forced <= set(settings.suppress_tokens):
                raise refuse(field, "every forced token is also in suppress_tokens: the scores would all be -inf "
                                    "(transformers refuses it)")
    for field, (neutral, what) in _UNSUPPORTED.items():
        if field not in merged or neutral(merged[field]):
            continue
        raise refuse(field, f"asks for {what}, which flodl-hf's generate does not implement (transformers would "
                            "apply it); remove the field or set it to its default")
    return settings


def _check_arguments(max_new_tokens: Any, do_sample: Any, temperature: Any, top_k: Any, top_p: Any) -> None:
    if max_new_tokens is not None and not (_is_int(max_new_tokens) and max_new_tokens >= 1):
        raise InputError(f"max_new_tokens={max_new_tokens!r}: expected a positive integer")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise InputError(f"do_sample={do_sample!r}: expected True, False or None")
    if temperature is not None and not (_is_number(temperature) and temperature > 0):
        raise InputError(f"temperature={temperature!r}: expected a positive number")
    if top_k is not None and not (_is_int(top_k) and top_k >= 0):
        raise InputError(f"top_k={top_k!r}: expected a non-negative integer (0: no top-k) or None (the default, 50)")
    if top_p is not None and not (_is_number(top_p) and 0.0 <= top_p <= 1.0):
        raise InputError(f"top_p={top_p!r}: expected a number in [0, 1] or None")


def _check_ids(input_ids: Any, attention_mask: Any) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
            or input_ids.dtype == torch.bool or input_ids.is_complex():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise InputError(f"input_ids {shape}: expected an integer tensor (batch, prompt length), or a prompt's "
                         "inputs_embeds; a single prompt is input_ids[None]")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise InputError(f"input_ids {tuple(input_ids.shape)}: expected at least one prompt of at least one token "
                         "(transformers cannot start from an empty prompt either without a bos)")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        shape = (tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                 else type(attention_mask).__name__)
        raise InputError(f"attention_mask {shape}: expected a tensor shaped like input_ids {tuple(input_ids.shape)}")


def _embedded_prompt(model: torch.nn.Module, input_ids: Any, inputs_embeds: Any, attention_mask: Any) -> torch.Tensor:
    """A prompt given as ``inputs_embeds`` (B, L, width of the input embeddings), as ``_prepare_model_inputs`` takes
    it on a decoder: the ids that carry on are ``input_ids`` when given (any length, the first forward never reads
    them), else an empty (B, 0) tensor (``_maybe_initialize_input_ids_for_generation``); returns them. The mask
    covers the embeddings, (B, L): one is needed when ids of another length are given (transformers would read the
    ids' length for it, and fail or misalign). Shapes and dtypes on which transformers' forward fails (another
    batch, width or dtype than the embedding's, no position) are InputErrors naming the field."""
    weight = model.get_input_embeddings().weight
    width = weight.shape[-1]
    if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 or inputs_embeds.shape[1] == 0 \
            or inputs_embeds.shape[0] == 0 or inputs_embeds.shape[2] != width:
        shape = tuple(inputs_embeds.shape) if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
        raise InputError(f"inputs_embeds {shape}: expected a tensor (batch, prompt length, {width}) of at least one "
                         "position, the width of the model's input embeddings; a single prompt is inputs_embeds[None]")
    if inputs_embeds.dtype != weight.dtype:
        raise InputError(f"inputs_embeds is {inputs_embeds.dtype}: expected the model's {weight.dtype} (transformers' "
                         "forward fails on, or mixes, another dtype); cast them with .to(model.dtype)")
    batch, length = inputs_embeds.shape[:2]
    if input_ids is None:
        input_ids = torch.ones((batch, 0), dtype=torch.long, device=inputs_embeds.device)
    elif not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != batch \
            or input_ids.is_floating_point() or input_ids.dtype == torch.bool or input_ids.is_complex():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise InputError(f"input_ids {shape} with inputs_embeds {tuple(inputs_embeds.shape)}: expected an integer "
                         f"tensor ({batch}, any length), the ids the new tokens follow (transformers fails on "
                         "another batch size), or none")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, length):
            shape = (tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                     else type(attention_mask).__name__)
            raise InputError(f"attention_mask {shape}: expected ({batch}, {length}), a column per position of "
                             f"inputs_embeds {tuple(inputs_embeds.shape)}")
    elif input_ids.shape[1] not in (0, length):
        raise InputError(f"input_ids {tuple(input_ids.shape)} with inputs_embeds {tuple(inputs_embeds.shape)} and no "
                         f"attention_mask: transformers infers the mask from the ids, {input_ids.shape[1]} columns "
                         f"where the embeddings have {length} positions; pass an attention_mask ({batch}, {length})")
    return input_ids


def infer_attention_mask(input_ids: torch.Tensor, pad: int | None, eos: Sequence[int]) -> torch.Tensor:
    """``_prepare_attention_mask_for_generation``, when no mask is given: the positions holding the pad id are masked
    out when the pad id is set, is not an eos id, occurs in the input, and the ids are int32 or int64; else all ones."""
    ones = torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)
    if pad is None or input_ids.dtype not in (torch.int, torch.long) or pad in eos or not (input_ids == pad).any():
        return ones
    return input_ids.ne(pad).long()


def _hooks(value: Any, name: str) -> list[Any]:
    """A ``logits_processor`` / ``stopping_criteria`` argument: None, or a list of callables (a transformers
    LogitsProcessorList / StoppingCriteriaList, or a plain list or tuple)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InputError(f"{name}={value!r}: expected a list of callables (a transformers "
                         f"{'LogitsProcessorList' if name == 'logits_processor' else 'StoppingCriteriaList'}, or a "
                         "plain list)")
    for i, hook in enumerate(value):
        if not callable(hook):
            raise InputError(f"{name}[{i}]={hook!r}: expected a callable taking (input_ids, scores)")
    return list(value)


def _check_streamer(streamer: Any, settings: GenerationSettings) -> None:
    """A streamer has transformers' BaseStreamer methods, ``put(value)`` and ``end()``. With beams transformers
    raises (``_validate_generation_mode``: beam search) or hands it the prompt and nothing after, no ``end()``
    (beam sampling: ``_beam_search`` takes no streamer; a TextIteratorStreamer then waits forever): refused."""
    if streamer is None:
        return
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise InputError(f"streamer={streamer!r}: expected a streamer with put(value) and end() (transformers' "
                         "BaseStreamer)")
    if settings.num_beams > 1:
        if not settings.do_sample:
            raise InputError(f"streamer with num_beams={settings.num_beams}: a streamer cannot be used with beam "
                             "search (transformers raises the same)")
        raise InputError(f"streamer with num_beams={settings.num_beams} and do_sample=True: transformers' beam "
                         "sampling hands the streamer the prompt and nothing after (no end()); use num_beams=1")


@torch.inference_mode()
def _on(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else torch.as_tensor(tensor).to(device)


def generate_ids(model: torch.nn.Module, input_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 eos_token_id: int | Sequence[int] | torch.Tensor | None = None,
                 pad_token_id: int | None = None, generation_config: Any = None, tokenizer: Any = None,
                 logits_processor: Sequence[Any] | None = None, stopping_criteria: Sequence[Any] | None = None,
                 streamer: Any = None, inputs_embeds: torch.Tensor | None = None,
                 prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], Any] | None = None,
                 negative_prompt_ids: torch.Tensor | None = None,
                 negative_prompt_attention_mask: torch.Tensor | None = None,
                 assistant_model: torch.nn.Module | None = None, assistant_tokenizer: Any = None,
                 **options: Any) -> torch.Tensor | GenerateDecoderOnlyOutput | GenerateBeamDecoderOnlyOutput:
    """Prompt ids (B, S), left-padded, -> (B, S + n) ids: the prompts and up to ``max_new_tokens`` new tokens
    each, as transformers' ``generate`` returns them (``GenerateDecoderOnlyOutput`` with
    ``return_dict_in_generate=True``). Every setting left None takes transformers' default: ``generation_config``'s
    field, else the checkpoint's ``generation_config.json``, else its global default (see ``generation_settings``).
    ``options``: ``max_length``, ``min_new_tokens``, ``min_length``, ``repetition_penalty``,
    ``num_return_sequences``, ``use_cache``, ``return_dict_in_generate``, ``output_scores``, ``output_logits``,
    ``output_hidden_states``, ``output_attentions`` (each step's forward records, split per kept token when
    assisted), ``cache_implementation`` (``"static"``: transformers' StaticCache, ``_static_cache``) and
    ``max_cache_len``, the
    logits processors (``guidance_scale`` with ``negative_prompt_ids`` / ``negative_prompt_attention_mask``,
    ``watermarking_config``, ``no_repeat_ngram_size``, ``bad_words_ids``, ``sequence_bias``, ``suppress_tokens``,
    ``begin_suppress_tokens``, ``forced_bos_token_id``, ``forced_eos_token_id``, ``exponential_decay_length_penalty``,
    ``remove_invalid_values``, ``renormalize_logits``; when sampling ``top_h``, ``min_p``, ``typical_p``,
    ``epsilon_cutoff``, ``eta_cutoff``), the stopping criteria (``stop_strings``, which needs ``tokenizer``, and
    ``max_time``), and beam
    search (``num_beams``, ``length_penalty``, ``early_stopping``; a ``GenerateBeamDecoderOnlyOutput`` record), and
    prompt lookup (``prompt_lookup_num_tokens``, ``max_matching_ngram_size``: one prompt, greedy or sampled; see
    ``_assisted``).
    ``assistant_model``: a smaller causal LM of ours over the same vocabulary drafts the candidates (one prompt,
    greedy or speculative sampling; its ``generation_config`` holds ``num_assistant_tokens``, its schedule and
    ``assistant_confidence_threshold``, as transformers reads them; see ``flodl_hf.generation.assisted``); ignored with beams,
    as transformers ignores it. ``assistant_tokenizer``: for an assistant over another vocabulary, with
    ``tokenizer`` (the model's): its drafts go through text, greedy (``assisted.TranslatedDrafts``).
    Without ``attention_mask``, the pad id's positions are masked as transformers infers them.
    ``seed``: sample from a generator seeded with it; None samples from torch's global generator.
    ``logits_processor`` / ``stopping_criteria``: the caller's own (a LogitsProcessorList / StoppingCriteriaList or a
    list of callables), each called as transformers calls it, ``(input_ids so far, scores)``: a processor gets the
    step's scores and returns new ones (after the built-in processors, before the sampling warpers), a criterion
    gets the recorded scores (a tuple with ``output_scores`` and ``return_dict_in_generate``, else None) and returns
    a bool per row; one of the class of a built-in takes its place (``_merge_criteria_processor_list``).
    ``streamer``: ``put(prompt ids)`` (CPU, after ``num_return_sequences``' repeat), then ``put(new ids)`` (B,)
    after each step, then ``end()``; not with beams.
    ``inputs_embeds`` (B, L, width): the prompt's embeddings, fed to the first forward in place of ids, as
    transformers' generate takes them on a decoder: without ``input_ids`` the result holds the new tokens alone
    (B, n); with them (the ids the new tokens follow, usually the same L tokens) (B, S + n). The attention mask, when
    given, covers the L positions; the cache is always used. ``prefix_allowed_tokens_fn(batch_id, ids)``: the ids
    allowed next for that row (``PrefixConstrainedLogitsProcessor``)."""
    if getattr(model, "task", None) != "causal_lm":
        raise InputError(f"generate needs a causal_lm model, not {type(model).__name__}")
    if inputs_embeds is None:
        _check_ids(input_ids, attention_mask)
    else:
        input_ids = _embedded_prompt(model, input_ids, inputs_embeds, attention_mask)
        # _prepare_model_inputs' decoder with inputs_embeds: the cache is always on, whatever the settings say
        _check_fields({"use_cache": options.get("use_cache")}, None, InputError)
        options = {**options, "use_cache": True}
    if seed is not None and not _is_int(seed):
        raise InputError(f"seed={seed!r}: expected an integer or None")
    if prefix_allowed_tokens_fn is not None and not callable(prefix_allowed_tokens_fn):
        raise InputError(f"prefix_allowed_tokens_fn={prefix_allowed_tokens_fn!r}: expected a callable taking "
                         "(batch_id, input_ids) and returning the allowed token ids")
    settings = generation_settings(model, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
                                   pad_token_id, generation_config, **options)
    custom_processors = _hooks(logits_processor, "logits_processor")
    custom_criteria = _hooks(stopping_criteria, "stopping_criteria")
    _check_streamer(streamer, settings)
    lookup = settings.prompt_lookup_num_tokens is not None and settings.num_beams == 1
    early = settings.assistant_early_exit is not None and settings.num_beams == 1
    # an assistant model, or the model's own first layers (early exit); with beams transformers ignores both
    assisted = (assistant_model is not None or early) and settings.num_beams == 1
    if early and settings.assistant_early_exit < model.config.num_hidden_layers and \
            getattr(model.backbone, "exits_early", None) is not True:
        raise InputError(f"assistant_early_exit={settings.assistant_early_exit}: transformers' "
                         f"{type(model.backbone).__name__} runs every layer whatever num_hidden_layers says, and its "
                         "early-exit drafts then fail (a cache of fewer layers: IndexError); early exit needs a model "
                         "that honours it, such as LLaMA's")
    if early and (lookup or assistant_model is not None):
        other = "prompt_lookup_num_tokens" if lookup else "assistant_model"
        raise InputError(f"assistant_early_exit={settings.assistant_early_exit} with {other}: two sources of "
                         "candidates (transformers takes early exit's and ignores the other); pass one")
    if (lookup or assisted) and input_ids.shape[0] > 1:
        what = (f"prompt_lookup_num_tokens={settings.prompt_lookup_num_tokens}" if lookup else
                f"assistant_early_exit={settings.assistant_early_exit}" if early else "assistant_model")
        raise InputError(f"input_ids {tuple(input_ids.shape)}: {what} decodes one prompt at a time (transformers' "
                         "assisted generate: batch size 1 only); pass input_ids[i:i + 1] per prompt")
    eos, pad = settings.eos, settings.pad
    if attention_mask is None:  # inferred from the ids, or without any from the embeddings (all ones)
        attention_mask = infer_attention_mask(input_ids if input_ids.shape[1] > 0 else inputs_embeds, pad, eos)
    device = model.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    if inputs_embeds is not None:
        inputs_embeds = inputs_embeds.to(device)
    expand = max(settings.num_beams, settings.num_return_sequences)
    if expand > 1:  # _expand_inputs_for_generation
        input_ids = input_ids.repeat_interleave(expand, dim=0)
        attention_mask = attention_mask.repeat_interleave(expand, dim=0)
        if inputs_embeds is not None:
            inputs_embeds = inputs_embeds.repeat_interleave(expand, dim=0)
    if streamer is not None:  # the prompt, before the lengths are checked (as transformers' generate)
        streamer.put(input_ids.cpu())
    generator = None
    if settings.do_sample and seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    # GenerationMixin._prepare_generated_length / _validate_generated_length; the lengths count the ids, and when
    # embeddings of another length are given, a total max_length / min_length is taken to count them instead
    prompt_length = input_ids.shape[1]
    embedded = 0 if inputs_embeds is None or inputs_embeds.shape[1] == prompt_length else inputs_embeds.shape[1]
    if settings.max_new_tokens is not None:
        max_length = prompt_length + settings.max_new_tokens
    elif settings.max_length is not None:
        max_length = settings.max_length - embedded
    else:
        max_length = prompt_length + DEFAULT_NEW_TOKENS
        max_positions = getattr(model.config, "max_position_embeddings", None)
        if max_positions is not None:
            max_length = min(max_length, max_positions)
    if prompt_length >= max_length:
        less = f", less the {embedded} positions of inputs_embeds" if embedded else ""
        raise InputError(f"input_ids: the prompt has {prompt_length} tokens but the maximum length is "
                         f"{max_length} (max_length, of the arguments or {GENERATION_CONFIG}, or "
                         f"max_position_embeddings{less}); pass max_new_tokens")
    if assisted:
        _check_assistant(model, model if early else assistant_model, settings, inputs_embeds, max_length,
                         f"assistant_early_exit={settings.assistant_early_exit}" if early else "assistant_model",
                         tokenizer, assistant_tokenizer)
    elif assistant_tokenizer is not None and assistant_model is None:
        raise InputError("assistant_tokenizer without assistant_model: it tokenizes an assistant's drafts; pass "
                         "assistant_model too")
    min_length = (prompt_length + settings.min_new_tokens if settings.min_new_tokens is not None
                  else max(settings.min_length - embedded, 0) if embedded else settings.min_length)
    # the repetition penalty skips the left padding, which transformers reads off the mask unless it is all ones
    ignore = None if (attention_mask == 1).all() else (attention_mask != 0).int().argmax(dim=1)
    prefix = None if prefix_allowed_tokens_fn is None else PrefixConstrained(prefix_allowed_tokens_fn, expand)
    guidance = None
    if settings.guidance_scale is not None and settings.guidance_scale != 1:
        if inputs_embeds is not None or lookup or assisted:
            with_what = "inputs_embeds" if inputs_embeds is not None else "prompt lookup" if lookup else "an assistant"
            raise InputError(f"guidance_scale={settings.guidance_scale}: classifier-free guidance with {with_what} "
                             "is not implemented")
        guidance = Guidance(settings.guidance_scale, model, _on(negative_prompt_ids, device),
                            _on(negative_prompt_attention_mask, device), settings.use_cache)
    processors = logits_processors(settings, prompt_length, max_length, min_length, ignore, device,
                                   custom_processors, prefix, model.config.vocab_size, guidance)
    stop_strings = None
    if settings.stop_strings is not None:  # _get_stopping_criteria
        if tokenizer is None:
            raise InputError(f"stop_strings={settings.stop_strings!r}: matching them needs the model's tokenizer; "
                             "pass tokenizer= (as transformers' generate)")
        stop_strings = StopStrings(tokenizer, settings.stop_strings)
    criteria = stopping_criteria_list(settings, max_length, stop_strings, device, custom_criteria)
    cache = model.backbone.new_cache() if settings.use_cache else None
    if settings.use_cache and settings.cache_implementation in STATIC_CACHES:
        drafted = lookup or assisted  # the rejected candidates cropped off: full layers only
        sliding = drafted and any(w is not None for w in cache.windows)
        cache = _static_cache(model, cache.windows, settings, max_length + embedded,
                              "assisted decoding on a model with sliding-window layers" if sliding else None)
    elif lookup or assisted:
        cache = _DraftCache(cache.windows)
    decoder = _Decoder(model, attention_mask, cache, settings.use_cache, inputs_embeds)
    if settings.output_hidden_states or settings.output_attentions:  # asked of every forward, as generate asks
        decoder.plain = {**PLAIN_RECORD, **{k: True for k in ("output_hidden_states", "output_attentions")
                                            if getattr(settings, k)}}

    if settings.num_beams > 1:
        return _beam_search(decoder, input_ids, settings, processors, criteria, max_length, generator)
    if lookup or assisted:
        drafts = (_LookupDrafts(settings, processors, max_length, model.config.vocab_size) if lookup else
                  _assistant_drafts(model, model if early else assistant_model, attention_mask, settings, processors,
                                    max_length, generator, tokenizer, assistant_tokenizer))
        return _assisted(decoder, input_ids, settings, processors, criteria, max_length, generator, streamer, drafts)
    # _sample: finished rows get the pad id when a criterion has an eos_token_id (EosTokenCriteria: an eos is set)
    fill = any(hasattr(c, "eos_token_id") for c in criteria)
    if fill and pad is None:
        if not settings.eos_set:  # a custom criterion's eos_token_id: transformers fails on the missing pad id
            raise InputError("stopping_criteria: a criterion has an eos_token_id, so finished rows get the pad id, "
                             "and no pad_token_id is set (transformers fails on None); pass pad_token_id")
        fill = False
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=device)
    record = settings.return_dict_in_generate
    scores_seen: tuple[torch.Tensor, ...] | None = () if record and settings.output_scores else None
    logits_seen: list[torch.Tensor] = []
    seen = _Seen(settings)
    while True:
        logits = decoder.next_logits(input_ids)
        seen.add(decoder.out)
        scores = apply(processors, input_ids, logits)
        if scores_seen is not None:
            scores_seen += (scores,)
        if record and settings.output_logits:
            logits_seen.append(logits)
        if settings.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            next_tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if fill:
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~stop_hits(criteria, input_ids, scores_seen)
        if streamer is not None:  # StopCheck: each step's new ids, after the stopping criteria
            streamer.put(next_tokens.cpu())
        if unfinished.max() == 0:
            break
    return _finish(input_ids, settings, scores_seen, logits_seen, decoder.cache, streamer, seen)


def _static_cache(model: torch.nn.Module, windows: list, settings: GenerationSettings, max_length: int,
                  refused: str | None) -> StaticKVCache:
    """GenerationMixin._prepare_static_cache: a static cache of ``max_length - 1`` positions (the last new token is
    never fed; ``max_length`` counts the positions of a prompt given as embeddings of another length than its ids,
    as ``max_cache_length`` does there), at least ``max_cache_len``, and at least the longest one this model made
    before (transformers keeps ``_previous_max_cache_length`` on the model, so that a compiled step is reused)."""
    if refused is not None:
        raise InputError(f"cache_implementation={settings.cache_implementation!r} with {refused} is not implemented "
                         "(the dynamic cache is)")
    length = max(max_length - 1, settings.max_cache_len or 0, model.__dict__.get("_previous_max_cache_length", -1))
    cache = StaticKVCache(windows, length)
    model.__dict__["_previous_max_cache_length"] = length
    return cache


class _Seen:
    """Each forward's ``attentions`` and ``hidden_states`` (tuples over the layers), one entry per step, where
    ``return_dict_in_generate`` asks for them, as ``_sample`` and ``_beam_search`` record them."""

    def __init__(self, settings: GenerationSettings) -> None:
        record = settings.return_dict_in_generate
        self.attentions: tuple | None = () if record and settings.output_attentions else None
        self.hidden_states: tuple | None = () if record and settings.output_hidden_states else None

    def add(self, out: Any) -> None:
        if self.attentions is not None:
            self.attentions += (out.attentions,)
        if self.hidden_states is not None:
            self.hidden_states += (out.hidden_states,)

    def split(self, out: Any, length: int, added: int) -> None:
        """``_split_model_outputs`` (generation/utils.py), after an assisted step that fed ``added`` tokens' worth
        (the whole new length at the first step) from a sequence of ``length``: the first record is the prompt's
        block, then one per kept token, each layer's rows ``i`` of the forward (``i`` counted from the forward's
        first position at the first step too, as there) and an attention's keys up to ``length + i``."""
        for name in ("attentions", "hidden_states"):
            records, layers = getattr(self, name), getattr(out, name)
            attention = name == "attentions"
            if records is None or (attention and not (layers and layers[0] is not None)):
                continue
            cur, count = length, added
            if len(records) == 0:
                records += (tuple(x[..., :cur, :cur] if attention else x.narrow(1, 0, cur) for x in layers),)
                cur += 1
                count -= cur
            for i in range(count):
                records += (tuple(x[..., i:i + 1, :cur + i] if attention else x.narrow(1, i, 1) for x in layers),)
            setattr(self, name, records)


def _check_assistant(model: torch.nn.Module, assistant: Any, settings: GenerationSettings,
                     inputs_embeds: torch.Tensor | None, max_length: int, name: str, tokenizer: Any = None,
                     assistant_tokenizer: Any = None) -> None:
    """What ``assistant_model`` takes (or early exit, the model itself): one of our causal LMs over the main model's
    vocabulary, with the cache, for greedy or sampled decoding of one prompt, or over another vocabulary with both
    tokenizers, greedy; what transformers refuses, and what is not implemented, raise, naming ``name``."""
    if getattr(assistant, "task", None) != "causal_lm" or not hasattr(assistant, "backbone"):
        raise InputError(f"assistant_model={type(assistant).__name__}: expected a flodl-hf causal_lm model "
                         "(load_model(source, 'causal_lm'))")
    s = settings
    ours, theirs = model.config.vocab_size, assistant.config.vocab_size
    if ours == theirs and assistant_tokenizer is not None:
        raise InputError(f"assistant_tokenizer with {name}: the model and the assistant share a vocabulary of {ours} "
                         "ids, so no second tokenizer is needed (transformers raises the same); omit it")
    if ours != theirs:
        if tokenizer is None or assistant_tokenizer is None:
            raise InputError(f"assistant_model: its vocabulary has {theirs} ids and the model's {ours}: another "
                             "tokenizer, whose drafts go through text (universal assisted decoding); pass tokenizer= "
                             "and assistant_tokenizer= (transformers raises the same)")
        for refused, what in ((s.do_sample, "do_sample=True (universal speculative decoding, which prunes the "
                                            "assistant's LM head to the shared tokens)"),
                              (bool(s.min_new_tokens) or bool(s.min_length), "a minimum length")):
            if refused:
                raise InputError(f"{what} with an assistant of another tokenizer is not implemented; greedy "
                                 "decoding without a minimum length is")
    drops = getattr(assistant.backbone, "drops_cache", None)
    refusals = [
        (s.prompt_lookup_num_tokens is not None, f"prompt_lookup_num_tokens={s.prompt_lookup_num_tokens}",
         "prompt lookup and an assistant model are two sources of candidates (transformers takes prompt lookup's and "
         "ignores the assistant); pass one"),
        (not s.use_cache, "use_cache=False", "assisted decoding checks the candidates against the KV cache and crops "
                                             "it (transformers raises: assisted decoding requires a cache)"),
        (s.num_return_sequences > 1, f"num_return_sequences={s.num_return_sequences}",
         "assisted generate makes one sequence per prompt (transformers raises)"),
        (s.stop_strings is not None, f"stop_strings={s.stop_strings!r}", "transformers hands the assistant's "
         "generate no tokenizer, and it raises there; stop on eos ids or a custom stopping criterion"),
        (inputs_embeds is not None, "inputs_embeds", "a prompt given as embeddings with an assistant model is not "
                                                     "implemented; pass input_ids"),
        (drops is not None and drops(max_length - 1, 0), f"assistant_model={type(assistant).__name__}",
         f"the assistant drafts up to {max_length - 1} tokens, where its generation drops its KV cache (Phi-3 past "
         "original_max_position_embeddings), which is not implemented for an assistant; generate fewer tokens"),
    ]
    for refused, what, why in refusals:
        if refused:
            raise InputError(f"{what} with {name}: {why}")


def _assistant_drafts(model: torch.nn.Module, assistant: torch.nn.Module, attention_mask: torch.Tensor,
                      settings: GenerationSettings, processors: list, max_length: int,
                      generator: torch.Generator | None, tokenizer: Any, assistant_tokenizer: Any) -> AssistantDrafts:
    """AssistedCandidateGenerator's start: the assistant's own decoder, begun on the prompt's mask with a cache that
    can be cropped, and its ``generation_config`` (kept on the model, as transformers' ``model.generation_config``:
    the heuristic schedule's count carries to the next call, and a caller sets the three settings there). An
    assistant of another vocabulary drafts through text (``TranslatedDrafts``)."""
    config = assistant.generation_config
    check_assistant_config(config)
    cache = _DraftCache(assistant.backbone.new_cache().windows)
    decoder = _Decoder(assistant, attention_mask.to(assistant.device), cache, True)
    if assistant.config.vocab_size != model.config.vocab_size:
        if processors or final_steps(settings, attention_mask.device, model.config.vocab_size):
            raise InputError("assistant_model with assistant_tokenizer: the model's logits processors (here "
                             f"{len(processors)} besides the final steps) would run on the assistant's scores over "
                             "another vocabulary, which is not implemented; pass settings that add none")
        return TranslatedDrafts(decoder, config, settings, max_length, assistant.config.vocab_size, tokenizer,
                                assistant_tokenizer)
    return AssistantDrafts(decoder, config, settings, processors, max_length, generator, assistant.config.vocab_size,
                           settings.assistant_early_exit)


def _finish(input_ids: torch.Tensor, settings: GenerationSettings, scores_seen: tuple | None, logits_seen: Sequence,
            cache: Any, streamer: Any, seen: _Seen | None = None) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """The end of ``_sample`` and ``_assisted_decoding``: the streamer's ``end()``, then the ids, or with
    ``return_dict_in_generate`` the record (scores and logits per new token where asked for, the cache)."""
    if streamer is not None:
        streamer.end()
    if not settings.return_dict_in_generate:
        return input_ids
    return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores_seen,
                                     logits=tuple(logits_seen) if settings.output_logits else None,
                                     attentions=None if seen is None else seen.attentions,
                                     hidden_states=None if seen is None else seen.hidden_states, cache=cache)


class _Decoder:
    """The model's side of transformers' decoding loops: the prompt once (the prefill, ``logits_to_keep=1``), then
    each step the last token alone with its position and the cache, or without a cache the whole sequence again;
    the mask and the positions grow by one after each step (_update_model_kwargs_for_generation). A prompt's
    ``inputs_embeds`` feed the first forward in place of its ids, and only it (``prepare_inputs_for_generation``'s
    ``is_first_iteration``)."""

    def __init__(self, model: torch.nn.Module, attention_mask: torch.Tensor, cache: Any, use_cache: bool,
                 inputs_embeds: torch.Tensor | None = None) -> None:
        self.model, self.cache, self.use_cache = model, cache, use_cache
        self.inputs_embeds = inputs_embeds  # None once fed
        self.set_mask(attention_mask)
        self.prefilled = False
        self.plain = PLAIN_RECORD if config_sets_forward_defaults(model.config) else {}  # whatever config.json says
        self.out: Any = None  # the last forward's output, for the hidden states and attentions a step records

    def set_mask(self, attention_mask: torch.Tensor) -> None:
        """The mask, and the positions from it (GenerationMixin._prepare_position_ids_for_generation: cumsum(mask) - 1,
        0 on pads): at the start, and where a generate call starts over on ids of its own (an assistant of another
        tokenizer, whose generate infers its mask each round)."""
        self.attention_mask = attention_mask
        self.position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)

    def _maybe_drop_cache(self, length: int) -> None:
        """A family's prepare_inputs_for_generation (Phi3) may drop the cache at ``length`` tokens: the whole
        sequences run again, into a new cache of the same kind."""
        drops = getattr(self.model.backbone, "drops_cache", None)
        if self.prefilled and self.use_cache and drops is not None and drops(length, self.cache.get_seq_length()):
            if length != self.attention_mask.shape[1]:
                raise InputError(f"inputs_embeds: the model drops its KV cache at {length} ids (Phi-3 at "
                                 "original_max_position_embeddings + 1) and runs the ids again, which here are not "
                                 "the prompt the embeddings were (transformers runs them against the whole mask); "
                                 "pass input_ids of the embedded prompt, or fewer new tokens")
            cache = self.model.backbone.new_cache()
            self.prefilled = False
            self.cache = _DraftCache(cache.windows, recording=False) if isinstance(self.cache, _DraftCache) else cache

    def _grow(self, tokens: int) -> None:
        """The positions and the mask run on over ``tokens`` new tokens (_update_model_kwargs_for_generation)."""
        steps = torch.arange(tokens, dtype=self.position_ids.dtype, device=self.position_ids.device)
        self.position_ids = torch.cat([self.position_ids, self.position_ids[..., -1:] + 1 + steps], dim=-1)
        mask = self.attention_mask
        self.attention_mask = torch.cat([mask, mask.new_ones((mask.shape[0], tokens))], dim=-1)

    def next_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The next-token logits of each row of ``input_ids`` (the sequences so far), float32 copies."""
        self._maybe_drop_cache(input_ids.shape[1])
        if not self.prefilled:
            step_ids, step_pos = input_ids.clone(), self.position_ids
        elif self.use_cache:
            step_ids, step_pos = input_ids[:, -1:].clone(), self.position_ids[..., -1:].clone()
        else:
            step_ids, step_pos = input_ids.clone(), self.position_ids.clone()
        self.prefilled = True
        out = self._forward(step_ids, self.attention_mask, step_pos, self.use_cache, 1)
        self._grow(1)
        return out.logits[:, -1].to(copy=True, dtype=torch.float32)

    def catch_up(self, input_ids: torch.Tensor, last_length: int) -> torch.Tensor:
        """An assistant's first forward of a round (AssistedCandidateGenerator._update_past_and_masks, then its
        generate's prefill): after an earlier round the cache drops what that round drafted past ``input_ids`` (its
        ``last_length`` ids), the mask and the positions are cut or run on to their length, and the tokens the cache
        lacks run at once; the first round runs the prompt. Returns the next-token logits, as ``next_logits``."""
        length = input_ids.shape[1]
        fed = length
        if self.prefilled:
            if last_length - length >= 0:
                self.cache.crop(last_length - length)
            grow = length - self.attention_mask.shape[1]
            if grow > 0:
                self._grow(grow)
            self.attention_mask, self.position_ids = self.attention_mask[:, :length], self.position_ids[..., :length]
            fed = length - self.cache.get_seq_length()
        self.prefilled = True
        out = self._forward(input_ids[:, -fed:].clone(), self.attention_mask, self.position_ids[..., -fed:].clone(),
                            True, 1)
        self._grow(1)
        return out.logits[:, -1].to(copy=True, dtype=torch.float32)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, use_cache: bool,
                 keep: int) -> Any:
        """One forward of ``ids``, or at the first one of a prompt given as embeddings of those instead (a contiguous
        copy, as ``prepare_inputs_for_generation`` makes)."""
        embeds, self.inputs_embeds = self.inputs_embeds, None
        if embeds is not None:
            embeds, ids = embeds.clone(memory_format=torch.contiguous_format), None
        self.out = self.model(input_ids=ids, inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                              cache=self.cache, use_cache=use_cache, logits_to_keep=keep, **self.plain)
        return self.out

    def draft_logits(self, input_ids: torch.Tensor, drafted: int) -> torch.Tensor:
        """The float32 logits (B, drafted + 1, V) of the last ``drafted + 1`` positions of ``input_ids`` (the
        sequence so far, then ``drafted`` candidates) in one forward, as ``_assisted_decoding`` runs it: the prefill
        feeds every token, a later step the ``drafted + 1`` the cache lacks; the mask and the positions run on over
        the candidates for this forward only (``_prepare_attention_mask`` / ``_prepare_position_ids``)."""
        self._maybe_drop_cache(input_ids.shape[1])
        steps = torch.arange(drafted, dtype=self.position_ids.dtype, device=self.position_ids.device)
        positions = torch.cat([self.position_ids, self.position_ids[..., -1:] + 1 + steps], dim=-1)
        mask = self.attention_mask
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], drafted))], dim=-1)
        fed = drafted + 1 if self.prefilled else input_ids.shape[1]
        if self.inputs_embeds is not None:  # the prefill of an embedded prompt: candidates found in the ids refused
            fed = self.inputs_embeds.shape[1]
        self.prefilled = True
        out = self._forward(input_ids[:, -fed:].clone(), mask, positions[..., -fed:].clone(), True, drafted + 1)
        return out.logits[:, -drafted - 1:].to(copy=True, dtype=torch.float32)

    def accept(self, kept: int, rejected: int) -> None:
        """After ``draft_logits``: the cache drops the ``rejected`` candidates (``Cache.crop``), the mask and the
        positions grow by the ``kept`` tokens."""
        self.cache.crop(rejected)
        self._grow(kept)

    def reorder(self, rows: torch.Tensor) -> None:
        """Cache.reorder_cache (DynamicLayer.reorder_cache): every layer's keys and values take ``rows``' order."""
        if self.cache is not None:
            self.cache.reorder_cache(rows)


def _gather_beams(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """GenerationMixin._gather_beams: the beams ``indices`` picks, along dim 1."""
    while indices.dim() < tensor.dim():
        indices = indices.unsqueeze(-1)
    return torch.take_along_dim(tensor, indices, dim=1)


def _beam_search(decoder: _Decoder, input_ids: torch.Tensor, settings: GenerationSettings, processors: list,
                 criteria: list, max_length: int,
                 generator: torch.Generator | None) -> torch.Tensor | GenerateBeamDecoderOnlyOutput:
    """GenerationMixin._beam_search (generation/utils.py:3578), with its helpers (:3343-3577) step for step: the
    log-softmax of the logits through the processors, added to each beam's score; the top ``max(2, 1 + n_eos) *
    num_beams`` continuations (sampled without replacement with ``do_sample``); those that hit a stopping criterion
    become finished hypotheses scored ``score / new_length ** length_penalty``, the best others run on; the early
    stop heuristic of ``early_stopping``; the best ``num_return_sequences`` hypotheses, cut to the longest (with
    ``return_dict_in_generate``, transformers' GenerateBeamDecoderOnlyOutput)."""
    s = settings
    num_beams, length_penalty, early_stopping = s.num_beams, s.length_penalty, s.early_stopping
    device = input_ids.device
    flat, cur_len = input_ids.shape
    batch, prompt_length = flat // num_beams, cur_len
    n_eos = len(s.eos) if s.eos_set else 0
    keep = max(2, 1 + n_eos) * num_beams
    top_num_beams = torch.cat((torch.ones(num_beams, dtype=torch.bool),
                               torch.zeros(keep - num_beams, dtype=torch.bool))).to(device)
    # `pad_token_id or eos_token_id[0] if eos_token_id is not None else -1`, as written there
    fill = (s.pad if s.pad else s.eos[0]) if s.eos_set else -1
    running = torch.full((batch, num_beams, max_length), fill, dtype=torch.int64, device=device)
    running[:, :, :cur_len] = input_ids.reshape(batch, num_beams, cur_len)
    sequences = running.detach().clone()
    running_scores = torch.zeros((batch, num_beams), dtype=torch.float, device=device)
    running_scores[:, 1:] = -1e9  # only the first beam's continuations at the first step
    beam_scores = torch.full((batch, num_beams), fill_value=-1e9, dtype=torch.float, device=device)
    finished = torch.zeros((batch, num_beams), dtype=torch.bool, device=device)
    improvable = torch.ones((batch, 1), dtype=torch.bool, device=device)
    running_indices = torch.full((batch, num_beams, max_length - cur_len), -1, dtype=torch.int32, device=device)
    beam_indices = running_indices.detach().clone()
    flat_running = input_ids
    scores_seen: list[torch.Tensor] = []
    logits_seen: list[torch.Tensor] = []
    record_scores = s.return_dict_in_generate and s.output_scores
    seen = _Seen(s)
    while True:
        if decoder.prefilled:
            flat_running = running[:, :, :cur_len].reshape(batch * num_beams, cur_len)
        logits = decoder.next_logits(flat_running)
        seen.add(decoder.out)
        log_probs = apply(processors, flat_running, torch.nn.functional.log_softmax(logits, dim=-1))
        if s.return_dict_in_generate and s.output_logits:
            logits_seen.append(logits.clone())
        if record_scores:
            scores_seen.append(log_probs.clone())
        log_probs = log_probs.reshape(batch, num_beams, -1) + running_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (batch, -1))
        # _get_top_k_continuations
        if s.do_sample:
            top_indices = torch.multinomial(torch.nn.functional.softmax(log_probs, dim=-1), num_samples=keep,
                                            generator=generator)
            top_log_probs = torch.gather(log_probs, 1, top_indices)
            top_log_probs, order = top_log_probs.sort(dim=-1, descending=True)
            top_indices = top_indices.gather(dim=-1, index=order)
        else:
            top_log_probs, top_indices = torch.topk(log_probs, k=keep)
        vocab_size = log_probs.shape[-1] // num_beams
        from_beam = top_indices // vocab_size
        top_running_indices = _gather_beams(running_indices, from_beam)
        top_sequences = _gather_beams(running, from_beam)
        top_sequences[:, :, cur_len] = top_indices % vocab_size
        offset = torch.arange(batch, device=device).view(-1, 1) * num_beams
        top_running_indices[:, :, cur_len - prompt_length] = from_beam + offset
        # the stopping criteria on each continuation (MaxLengthCriteria: all of them at the last position)
        candidates = top_sequences[:, :, :cur_len + 1].reshape(batch * keep, cur_len + 1)
        hits = stop_hits(criteria, candidates, tuple(scores_seen) if record_scores else None)
        hits = hits.reshape(batch, keep)
        # _get_running_beams_for_next_iteration
        running_log_probs = top_log_probs + hits.to(torch.float32) * -1.0e9
        next_beams = torch.topk(running_log_probs, k=num_beams)[1]
        running = _gather_beams(top_sequences, next_beams)
        running_scores = _gather_beams(running_log_probs, next_beams)
        running_indices = _gather_beams(top_running_indices, next_beams)
        # _update_finished_beams
        just_finished = hits & top_num_beams[None, :]
        finished_scores = top_log_probs / ((cur_len + 1 - prompt_length) ** length_penalty)
        full = torch.all(finished, dim=-1, keepdim=True) & (early_stopping is True)
        finished_scores += full.to(torch.float32) * -1.0e9
        finished_scores += (~improvable).to(torch.float32) * -1.0e9
        finished_scores += (~just_finished) * -1.0e9
        merged_scores = torch.cat((beam_scores, finished_scores), dim=1)
        best = torch.topk(merged_scores, k=num_beams)[1]
        sequences = _gather_beams(torch.cat((sequences, top_sequences), dim=1), best)
        beam_scores = _gather_beams(merged_scores, best)
        beam_indices = _gather_beams(torch.cat((beam_indices, top_running_indices), dim=1), best)
        finished = _gather_beams(torch.cat((finished, just_finished), dim=1), best)
        decoder.reorder(running_indices[..., cur_len - prompt_length].reshape(-1))
        cur_len += 1
        # _check_early_stop_heuristic
        if early_stopping == "never" and length_penalty > 0.0:
            best_length = max_length - prompt_length
        else:
            best_length = cur_len - prompt_length
        best_running = running_scores[:, :1] / (best_length ** length_penalty)
        worst_finished = torch.where(finished, torch.min(beam_scores, dim=1, keepdim=True)[0], -1.0e9)
        improvable = improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
        # _beam_search_has_unfinished_sequences
        go_on = torch.any(improvable) & ~(torch.all(finished) & (early_stopping is True)) & ~torch.all(hits)
        if not go_on:
            break
    n = s.num_return_sequences
    sequences = sequences[:, :n].reshape(batch * n, max_length)
    beam_indices = beam_indices[:, :n].reshape(batch * n, -1)
    generated = ((beam_indices + 1).bool()).sum(dim=1).max()
    sequences = sequences[:, :prompt_length + generated]
    if not s.return_dict_in_generate:
        return sequences
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences, sequences_scores=beam_scores[:, :n].reshape(-1) if s.output_scores else None,
        scores=tuple(scores_seen) if s.output_scores else None, logits=tuple(logits_seen) if s.output_logits else None,
        beam_indices=beam_indices[:, :generated], attentions=seen.attentions, hidden_states=seen.hidden_states,
        cache=decoder.cache)



class _DraftCache(KVCache):
    """The KV cache of assisted decoding (the model's and an assistant's): ``DynamicCache`` after
    ``activate_past_recording``, so that a forward's rejected candidates can be cropped off. A sliding layer keeps
    every state until ``crop`` restricts it to its window again (``DynamicSlidingWindowLayer`` with
    ``record_past``), and a forward sees the last ``window - 1`` of them before its own, as without recording (an
    assistant runs several forwards between crops). ``recording``
    False: the cache a family's dropped cache is replaced with (Phi3: transformers' forward makes a new one, which
    does not record), whose sliding layers cannot be cropped once past their window (transformers raises)."""

    def __init__(self, windows: Sequence[int | None], recording: bool = True) -> None:
        super().__init__(windows)
        self.recording = recording

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full_k, full_v = super().update(layer, key, value)
        window = self.windows[layer]
        if self.recording:
            self.keys[layer], self.values[layer] = full_k, full_v
            if window is not None:
                visible = window - 1 + key.shape[-2]
                return full_k[:, :, -visible:, :], full_v[:, :, -visible:, :]
        return full_k, full_v

    def crop(self, tokens: int) -> None:
        """``Cache.crop(-tokens)``: every layer forgets its last ``tokens`` states; a sliding layer that has seen
        its window keeps the ``window - 1`` before them (``crop(0)`` too restricts it to them)."""
        for layer, keys in enumerate(self.keys):
            if keys is None:
                continue
            window, end = self.windows[layer], keys.shape[-2] - tokens
            if window is not None and self.seen[layer] >= window:
                if not self.recording:
                    raise InputError(f"prompt lookup: the model dropped its KV cache (Phi-3 at "
                                     "original_max_position_embeddings + 1 tokens) and the new one's sliding-window "
                                     f"layer {layer} is past its window of {window}, so the rejected candidates "
                                     "cannot be cropped off (transformers raises the same); use plain decoding")
                start = max(end - window + 1, 0)
                self.seen[layer] -= tokens
            else:
                start = 0
                self.seen[layer] = end
            self.keys[layer] = keys[:, :, start:end, :]
            self.values[layer] = self.values[layer][:, :, start:end, :]


def _lookup_candidates(input_ids: torch.Tensor, settings: GenerationSettings, processors: list, max_length: int,
                       vocab_size: int) -> torch.Tensor:
    """PromptLookupCandidateGenerator.get_candidates (generation/candidate_generator.py): the ids that followed an
    earlier occurrence of the sequence's last n-gram (the longest n up to ``max_matching_ngram_size`` that occurs,
    its first occurrence, left to right, with a continuation), at most ``prompt_lookup_num_tokens``; cut before the
    first one the processors ban (each checked on scores of ones after the sequence and the candidates before it,
    a ban being -inf or the dtype's min), a match left with none looking further; cut before the first eos id. None
    at one token short of the maximum length (the model's next token fills it). Returns them 1-D, maybe empty."""
    length = input_ids.shape[1]
    none = input_ids[0, :0]
    if max_length == length + 1:
        return none
    banned = (-float("inf"), torch.finfo(torch.float32).min)
    for size in range(min(settings.max_matching_ngram_size or 2, length - 1), 0, -1):
        windows = input_ids.unfold(dimension=1, size=size, step=1)
        matches = (windows == input_ids[0, -size:]).all(dim=2)
        for index in matches.nonzero(as_tuple=True)[1].tolist():
            start = index + size
            end = min(start + settings.prompt_lookup_num_tokens, length, max_length)
            if start >= end:
                continue
            chosen = input_ids[0, start:end]
            sequence = input_ids
            ones = torch.ones((1, vocab_size), device=input_ids.device, dtype=torch.float32)
            for i, token in enumerate(chosen.tolist()):
                if apply(processors, sequence, ones)[0, token].item() in banned:
                    chosen = chosen[:i]
                    break
                sequence = torch.cat((input_ids, chosen[:i + 1].unsqueeze(0)), dim=1)
            if chosen.shape[0] == 0:
                continue
            if settings.eos:
                hits = torch.isin(chosen, torch.tensor(settings.eos, device=chosen.device)).nonzero()
                if hits.numel() > 0:
                    chosen = chosen[:hits[0].item()]
            return chosen
    return none


class _LookupDrafts:
    """Prompt lookup's candidates (PromptLookupCandidateGenerator): no scores with them, nothing learnt from a step.
    The number of candidates stays fixed: ``num_assistant_tokens`` and its heuristic schedule belong to an assistant
    model (transformers ignores them here; not taken)."""

    def __init__(self, settings: GenerationSettings, processors: list, max_length: int, vocab_size: int) -> None:
        self.settings, self.processors, self.max_length, self.vocab_size = settings, processors, max_length, vocab_size

    def candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _lookup_candidates(input_ids, self.settings, self.processors, self.max_length, self.vocab_size), None

    def update(self, scores: torch.Tensor, matches: int) -> None:
        pass

    def finish(self) -> None:
        pass


def _assisted(decoder: _Decoder, input_ids: torch.Tensor, settings: GenerationSettings, processors: list,
              criteria: list, max_length: int, generator: torch.Generator | None, streamer: Any,
              drafts: Any) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """GenerationMixin._assisted_decoding (generation/utils.py:3925), one prompt: each step takes the candidates
    of ``drafts`` (prompt lookup's, ``_LookupDrafts``, or an assistant model's, ``assisted.AssistantDrafts``), runs
    them through the model in one forward with the cache, passes each position's logits through the processors
    (the sequence up to it), and keeps the candidates up to the first that differs from the model's pick there, then
    the pick after them (argmax; sampling: one ``multinomial`` over all positions, or speculative sampling where
    the candidates come with the assistant's scores), cut to the maximum length and after an eos; the rest is
    cropped off the cache and ``drafts`` learns how many were kept. Scores and logits are recorded per kept token;
    the stopping criteria see each step's end; the streamer gets each step's kept ids (1, k)."""
    s = settings
    record = s.return_dict_in_generate
    scores_seen: tuple[torch.Tensor, ...] | None = () if record and s.output_scores else None
    logits_seen: tuple[torch.Tensor, ...] = ()
    unfinished = torch.ones(1, dtype=torch.long, device=input_ids.device)
    eos = torch.tensor(s.eos, device=input_ids.device, dtype=torch.long) if s.eos_set else None
    seen, first = _Seen(s), True
    while True:
        length = input_ids.shape[1]
        chosen, drafted_scores = drafts.candidates(input_ids)
        drafted = chosen.shape[0]
        if drafted and decoder.inputs_embeds is not None:
            raise InputError(f"inputs_embeds with input_ids and prompt_lookup_num_tokens: the ids offer "
                             f"{drafted} candidates at the first step, and transformers' first forward takes the "
                             "embeddings alone, its mask and positions running on over the candidates it drops (its "
                             "tokens are not the prompt's); pass inputs_embeds without input_ids")
        candidates = torch.cat((input_ids, chosen.unsqueeze(0)), dim=1)
        scores = decoder.draft_logits(candidates, drafted)
        logits = scores.clone()
        for i in range(drafted + 1):
            scores[:, i, :] = apply(processors, candidates[:, :length + i], scores[:, i, :])
        if s.do_sample and drafted_scores is not None:
            kept = speculative_sampling(chosen, drafted_scores, scores, generator)
        else:
            if s.do_sample:
                probs = scores.softmax(dim=-1)
                picked = torch.multinomial(probs[0, :, :], num_samples=1, generator=generator).squeeze(1)[None, :]
            else:
                picked = scores.argmax(dim=-1)
            matches = ((~(chosen.unsqueeze(0) == picked[:, :-1])).cumsum(dim=-1) < 1).sum()
            kept = picked[:, :matches + 1]
        kept = kept[:, :max_length - length]
        if eos is not None:  # cut after the first eos kept
            hits = torch.isin(kept[0], eos).nonzero()
            if hits.numel() > 0:
                kept = kept[:, :hits[0].item() + 1]
        n = kept.shape[1]
        seen.split(decoder.out, length, length + n if first else n)
        first = False
        input_ids = torch.cat((input_ids, kept), dim=-1)
        if streamer is not None:
            streamer.put(kept.cpu())
        decoder.accept(n, drafted + 1 - n)
        drafts.update(scores, n - 1)
        if scores_seen is not None:
            scores_seen += tuple(scores[:, i, :] for i in range(n))
        if record and s.output_logits:
            logits_seen += tuple(logits[:, i, :] for i in range(n))
        unfinished = unfinished & ~stop_hits(criteria, input_ids, scores_seen)
        if unfinished.max() == 0:
            break
    drafts.finish()
    return _finish(input_ids, s, scores_seen, logits_seen, decoder.cache, streamer, seen)


# TextGenerationPipeline._default_generation_config: added by the pipeline for what neither the call nor the
# model's generation config sets (the sampling ones only when sampling), as Pipeline._prepare_generate_kwargs does
PIPELINE_DEFAULTS: dict[str, Any] = {"max_new_tokens": 256, "do_sample": True, "temperature": 0.7}
_PIPELINE_SAMPLING = {"temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff"}
# keywords TextGenerationPipeline takes (its _sanitize_parameters, Pipeline.__call__) that generate() does not implement
_PIPELINE_NOT_IMPLEMENTED = ("return_type", "prefix", "handle_long_generation", "truncation",
                             "tokenizer_encode_kwargs", "add_special_tokens", "padding", "batch_size", "num_workers")
# generate_ids' hooks and model inputs the pipeline hands, as given, to each prompt's generate call
_HOOKS = ("logits_processor", "stopping_criteria", "streamer", "prefix_allowed_tokens_fn", "inputs_embeds")
# generate() keywords that would make the pipeline add records' fields (scores, logits) that generate() does not write
_RECORD_KEYWORDS = ("return_dict_in_generate", "output_scores", "output_logits", "output_hidden_states",
                    "output_attentions")


def _return_type(return_full_text: Any, return_tensors: Any, return_text: Any) -> str:
    """TextGenerationPipeline._sanitize_parameters: "full", "new" or "tensors", with its exclusions (an InputError
    where it raises a ValueError). As there, ``return_tensors`` given at all (False included) asks for the ids, and
    ``return_text`` alone changes nothing."""
    if return_full_text is not None:
        if return_text is not None:
            raise InputError("return_text is mutually exclusive with return_full_text (as in the pipeline)")
        if return_tensors is not None:
            raise InputError("return_full_text is mutually exclusive with return_tensors (as in the pipeline)")
        return "full" if return_full_text else "new"
    if return_tensors is not None:
        if return_text is not None:
            raise InputError("return_text is mutually exclusive with return_tensors (as in the pipeline)")
        return "tensors"
    return "full"


def _pipeline_settings(model: torch.nn.Module, tok: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The generate keywords the text-generation pipeline passes: the call's, plus its defaults (256 new tokens,
    sampling at temperature 0.7; the tokenizer's pad id) for each one the call and the model's generation config
    (``to_diff_dict``: a field at transformers' default counts as unset) leave unset."""
    set_params = model_generation_config(model).to_diff_dict()
    passed = given.get("generation_config")
    if passed is not None:
        set_params.update(passed.to_diff_dict() if callable(getattr(passed, "to_diff_dict", None))
                          else _generation_config_dict(passed))
    set_params.update(given)
    defaults = dict(PIPELINE_DEFAULTS)
    if tok.pad_token_id is not None:
        defaults["pad_token_id"] = tok.pad_token_id
    added = {k: v for k, v in defaults.items()
             if k not in set_params and not (k == "max_new_tokens" and "max_length" in set_params)}
    if not {**set_params, **added}.get("do_sample"):
        added = {k: v for k, v in added.items() if k not in _PIPELINE_SAMPLING}
    return {**given, **added}


def _pipeline_assistant(lm: torch.nn.Module, tok: Any, assistant: Any, assistant_tok: Any) -> dict[str, Any]:
    """The pipeline's ``load_assistant_model``: the assistant (a model, or a source to load it from), and, where its
    config differs from the model's in the vocabulary size or the bos, eos or pad id, the assistant's tokenizer with
    the model's, for universal assisted decoding (``generate_ids``' ``assistant_tokenizer=``, with ``tokenizer=``).
    Loaded from a source, the tokenizer is the source's unless one is given (the pipeline always takes the
    source's); a model of another vocabulary without one is an InputError, where the pipeline raises a ValueError.
    Where the configs agree, a given assistant tokenizer is dropped, as there."""
    from flodl_hf.tasks.runtime import load
    model = load(assistant, "causal_lm", tok).model
    if all(getattr(lm.config, f, None) == getattr(model.config, f, None)
           for f in ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")):
        return {"assistant_model": model}
    if assistant_tok is None:
        if isinstance(assistant, torch.nn.Module):
            raise InputError("assistant_model: its config's vocabulary size or special ids differ from the model's, "
                             "so it has another tokenizer: pass assistant_tokenizer= (the pipeline raises the same)")
        assistant_tok = load(assistant, "causal_lm").tokenizer
    return {"assistant_model": model, "assistant_tokenizer": assistant_tok}


def _is_message(value: Any) -> bool:
    """transformers' is_valid_message: a dict with "role" and "content"."""
    return isinstance(value, dict) and "role" in value and "content" in value


def _chats(prompts: Any) -> tuple[list[list[dict]], bool] | None:
    """The chats in ``prompts`` as Pipeline.__call__ detects them (a list whose first item is a message: one chat;
    a list of lists each starting with a message: several), with the check of Chat(...); None for texts."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        return None
    if _is_message(prompts[0]):
        chats, single = [list(prompts)], True
    elif isinstance(prompts[0], (list, tuple)) and all(c and _is_message(c[0]) for c in prompts
                                                       if isinstance(c, (list, tuple))) \
            and all(isinstance(c, (list, tuple)) for c in prompts):
        chats, single = [list(c) for c in prompts], False
    else:
        return None
    for c, chat in enumerate(chats):
        for i, message in enumerate(chat):
            if not _is_message(message):
                where = f"prompts[{i}]" if single else f"prompts[{c}][{i}]"
                raise InputError(f"{where} is {message!r}: in a chat each message is a dict with 'role' and "
                                 "'content'")
    return chats, single


def generate(prompts: str | Sequence[str] | list[dict] | list[list[dict]], model: Source,
             max_new_tokens: int | None = None,
             do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None,
             eos_token_id: int | Sequence[int] | None = None, tokenizer: Any = None,
             return_full_text: bool | None = None, return_tensors: bool | None = None,
             return_text: bool | None = None, clean_up_tokenization_spaces: bool | None = None,
             skip_special_tokens: bool | None = None, continue_final_message: bool | None = None,
             tools: list | None = None, documents: list | None = None,
             **options: Any) -> list[dict[str, Any]] | list[list[dict]]:
    """Continue each prompt, as ``transformers.pipeline("text-generation", model, tokenizer)(prompts, ...)`` returns
    it: for one string a list of ``num_return_sequences`` dicts, for a list of strings one such list per prompt.
    Each dict is ``{"generated_text": prompt + decode(new ids)}`` (``return_full_text=False``: the new text alone),
    or with ``return_tensors`` given ``{"generated_token_ids": prompt ids + new ids}``.

    The settings are the pipeline's: the keywords, else the model's generation config, else the pipeline's own
    defaults (256 new tokens, ``do_sample=True``, ``temperature=0.7``; the tokenizer's pad id), else
    transformers' (top-k 50). ``options``: ``generate_ids``' other settings (``num_return_sequences``,
    ``repetition_penalty``, ``min_new_tokens``, ``max_length``, ``generation_config``, the logits processors, ...);
    ``stop_sequence`` (a string or a list) stops at those strings, as the pipeline passes them to generate with the
    tokenizer (``stop_strings`` alone is an InputError, as the pipeline fails without a tokenizer). A keyword the
    pipeline takes that is not implemented here (``prefix``, ``truncation``, ...) is an InputError naming it. As
    in the pipeline, the call's ``max_length`` also cuts each text prompt to that many tokens (its tokenizer's
    truncation; a chat is not cut), so with ``max_new_tokens`` it bounds the prompt. Greedy prompts are batched
    with left padding (the pipeline runs them one by one: the ids are the same); sampling, a total ``max_length`` /
    ``min_length``, beams, stop strings, the time limit, or a processor reading the padded ids (n-gram ban, bad
    words, sequence bias, forced bos) runs them one by one in order, so that after ``torch.manual_seed(s)`` (or
    with ``seed=s``, which leaves the global generator alone) the draws and lengths are the pipeline's. A
    ``streamer``, ``logits_processor``, ``stopping_criteria``, ``prefix_allowed_tokens_fn`` or ``inputs_embeds``
    goes as given to each prompt's ``generate_ids`` (one prompt at a time, as the pipeline hands them to each
    prompt's generate, with its ids and mask), and so does ``assistant_model`` (one of our causal LMs, or a source
    to load one from: see ``generate_ids``). An assistant of another tokenizer (its config's vocabulary size or
    special ids differ, as the pipeline's ``load_assistant_model`` tells) drafts through text with
    ``assistant_tokenizer`` (or, loaded from a source, the source's own), greedy (``do_sample=False``).

    ``prompts`` may also be a chat (a list of ``{"role", "content"}`` dicts) or a list of chats, as the pipeline
    takes them: each is rendered with the tokenizer's chat template (``apply_chat_template``, a generation
    prompt unless ``continue_final_message``, which defaults to the last message being the assistant's;
    ``tools`` and ``documents`` go to the template), and each record's ``generated_text`` is the chat with the
    reply appended: a new ``{"role": "assistant", "content": reply}`` message, or the reply added to the final
    message's content when continuing it."""
    from flodl_hf.tasks.runtime import load
    for name in _PIPELINE_NOT_IMPLEMENTED:
        if options.get(name) is not None:
            raise InputError(f"{name}={options[name]!r}: the text-generation pipeline takes this keyword, but "
                             "flodl-hf's generate() does not implement it")
    for name in _RECORD_KEYWORDS:
        if options.get(name):
            raise InputError(f"{name}={options[name]!r}: generate() writes only the pipeline's generated_text or "
                             "generated_token_ids; use generate_ids for scores and logits")
    kind = _return_type(return_full_text, return_tensors, return_text)
    # the pipeline hands these to generate with each prompt: here too, one prompt at a time
    hooks = {name: options.pop(name) for name in _HOOKS if options.get(name) is not None}
    assistant = options.pop("assistant_model", None)
    stop_sequence = options.pop("stop_sequence", None)
    if stop_sequence is not None:  # TextGenerationPipeline._sanitize_parameters: stop strings, with the tokenizer
        options["stop_strings"] = [stop_sequence] if isinstance(stop_sequence, str) else stop_sequence
    chats = _chats(prompts)
    if chats is not None:
        texts, single = chats
    else:
        single = isinstance(prompts, str)
        texts = [prompts] if single else list(prompts) if isinstance(prompts, (list, tuple)) else None
        if not texts or not all(isinstance(t, str) for t in texts):
            raise InputError("prompts: expected a string, a non-empty list of strings, a chat (a list of "
                             "{'role', 'content'} dicts) or a list of chats")
    if seed is not None and not _is_int(seed):
        raise InputError(f"seed={seed!r}: expected an integer or None")
    loaded = load(model, "causal_lm", tokenizer)
    tok, lm = loaded.tokenizer, loaded.model
    if getattr(lm, "task", None) != "causal_lm":
        raise InputError(f"generate needs a causal_lm model, not {type(lm).__name__}")
    assistant_tok = options.pop("assistant_tokenizer", None)
    if assistant is not None:  # the pipeline's assistant_model: a model or where to load one from
        hooks.update(_pipeline_assistant(lm, tok, assistant, assistant_tok))
    elif assistant_tok is not None:
        raise InputError("assistant_tokenizer without assistant_model: it tokenizes an assistant's drafts; pass "
                         "assistant_model= as well")
    if getattr(lm.config, "prefix", None):
        raise ConfigError("config.json: prefix: the text-generation pipeline prepends it to each prompt; "
                          "flodl-hf's generate() does not implement it")
    given = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "temperature": temperature, "top_k": top_k,
             "top_p": top_p, "eos_token_id": eos_token_id, **options}
    given = {k: v for k, v in given.items() if v is not None}
    try:
        kwargs = _pipeline_settings(lm, tok, given)
    except Exception:  # transformers' GenerationConfig refused a field: our typed error names it, if we have one
        generation_settings(lm, **given)
        raise
    settings = generation_settings(lm, **kwargs)
    if settings.do_sample and "assistant_tokenizer" in hooks:
        raise InputError("assistant_model has another tokenizer, and the call samples (do_sample=True: the "
                         "pipeline's default, or the model's generation config): sampling with it (universal "
                         "speculative decoding) is not implemented; pass do_sample=False (flodl-hf generate: "
                         "--no-sample) for greedy drafts through text")
    if settings.stop_strings is not None and stop_sequence is None:
        raise InputError(f"stop_strings={settings.stop_strings!r}: the text-generation pipeline hands generate no "
                         "tokenizer for them (transformers raises); pass stop_sequence=, which it does hand one")
    if skip_special_tokens is None:
        skip_special_tokens = not getattr(tok, "response_template", None)

    # TextGenerationPipeline.preprocess hands the call's max_length to the tokenizer as well as to generate: a text
    # prompt is cut to it (truncation unset with a max_length is "longest_first", on the tokenizer's
    # truncation_side), while apply_chat_template keeps its truncation=False, so a chat is never cut.
    cut = options.get("max_length")
    if chats is None:
        rows = [list(r) for r in tok(texts, max_length=cut, return_tensors=None)["input_ids"]]
        if cut is not None and settings.max_new_tokens is None:
            for i, r in enumerate(rows):
                if len(r) >= cut:
                    where = "prompts" if single else f"prompts[{i}]"
                    raise InputError(f"{where}: the tokenizer cuts the prompt to max_length={cut} tokens, as the "
                                     "pipeline's does, which leaves no room for new tokens (transformers' generate "
                                     "refuses an input as long as max_length); pass max_new_tokens, and max_length "
                                     "then only cuts the prompt")
    else:
        if getattr(tok, "response_template", None) is not None:
            raise InputError("prompts is a chat, and the tokenizer has a response_template: the pipeline parses "
                             "the reply with it (parse_response), which flodl-hf's generate() does not implement")
        continuing = [chat[-1]["role"] == "assistant" if continue_final_message is None else continue_final_message
                      for chat in texts]
        rows = []
        for c, chat in enumerate(texts):
            try:
                rows.append(list(tok.apply_chat_template(chat, add_generation_prompt=not continuing[c],
                                                         continue_final_message=continuing[c], tools=tools,
                                                         documents=documents, return_tensors=None)["input_ids"]))
            except InputError as exc:
                raise type(exc)(f"prompts{'' if single else f'[{c}]'} is a chat: {exc}") from exc
    for i, r in enumerate(rows):
        if not r:
            raise InputError(f"prompts[{i}]={texts[i]!r}: no tokens (the tokenizer adds no bos); give a prompt")
    n = settings.num_return_sequences
    # a total length (prompt included) counts the padding in a batch: then one prompt at a time too
    totals = (settings.max_new_tokens is None and settings.max_length is not None) or \
        (settings.min_new_tokens is None and bool(settings.min_length))
    sequences: list[list[int]] = []  # per returned sequence: prompt ids + new ids, as the pipeline has them
    devices = [lm.device.index if lm.device.index is not None else torch.cuda.current_device()] \
        if lm.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None):  # seed=s: as after torch.manual_seed(s)
        if seed is not None:
            torch.manual_seed(seed)
        if not single:  # the pipeline runs a list through a DataLoader, whose iterator draws its base seed first
            torch.empty((), dtype=torch.int64).random_()
        # a processor reading the padded ids, a stop string, the time limit, beams, prompt lookup or a hook: one
        # prompt at a time
        alone = settings.reads_history() or settings.stop_strings is not None or settings.max_time is not None \
            or settings.num_beams > 1 or settings.prompt_lookup_num_tokens is not None or bool(hooks)
        # a family whose decoding changes with the padded length (Phi-3 at original_max_position_embeddings + 1
        # tokens: the cache dropped; longrope's long frequencies for every row): one at a time if a batch gets there
        drops = getattr(lm.backbone, "drops_cache", None)
        new_tokens = DEFAULT_NEW_TOKENS if settings.max_new_tokens is None else settings.max_new_tokens
        alone = alone or (drops is not None and drops(max(len(r) for r in rows) + new_tokens, 0))
        if settings.do_sample or totals or alone or len(rows) == 1:
            # one prompt at a time, as the pipeline: the draws come in its order, and lengths are per prompt
            for r in rows:
                ids = generate_ids(lm, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long),
                                   tokenizer=tok if stop_sequence is not None or "assistant_tokenizer" in hooks
                                   else None, **hooks, **kwargs)
                sequences.extend(ids.tolist())
        else:
            # Left padding by hand: LLaMA tokenizers often have no pad token. Padded positions are masked out of
            # every real token's attention, so the fill id changes no result.
            fill = next((p for p in (tok.pad_token_id, settings.pad, *settings.eos) if p is not None), 0)
            width = max(len(r) for r in rows)
            input_ids = torch.tensor([[fill] * (width - len(r)) + r for r in rows], dtype=torch.long)
            attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
            ids = generate_ids(lm, input_ids, attention_mask, **kwargs)
            stop = set(settings.eos)
            for r, row in zip(rows, ids.tolist()):  # greedy: one sequence per prompt
                new = row[width:]
                # the pipeline's generate for this prompt alone stops at its eos: cut the batch's longer pad fill
                end = next((j + 1 for j, t in enumerate(new) if t in stop), len(new))
                sequences.append(r + new[:end])

    results = []
    for g, text in enumerate(texts):
        records = []
        for seq in sequences[g * n:(g + 1) * n]:
            if kind == "tensors":
                records.append({"generated_token_ids": seq})
                continue
            new_text = tok.decode(seq[len(rows[g]):], skip_special_tokens=skip_special_tokens,
                                  clean_up_tokenization_spaces=clean_up_tokenization_spaces)
            if kind != "full":
                records.append({"generated_text": new_text})
            elif chats is None:
                records.append({"generated_text": text + new_text})
            elif continuing[g]:  # the reply continues the final message (a prefill)
                last = text[-1]
                records.append({"generated_text": list(text[:-1]) + [{"role": last["role"],
                                                                      "content": last["content"] + new_text}]})
            else:
                records.append({"generated_text": list(text) + [{"role": "assistant", "content": new_text}]})
        results.append(records)
    return results[0] if single else results
