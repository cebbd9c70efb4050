"""Generation settings: ``generation_config.json`` read and checked, merged with a ``generation_config`` passed in and
the keywords as transformers' ``_prepare_generation_config`` merges them (``generation_settings``, giving a
``GenerationSettings``), and the records ``generate_ids`` returns with ``return_dict_in_generate``
(``GenerateDecoderOnlyOutput``, ``GenerateBeamDecoderOnlyOutput``).

A field that ``generate_ids`` does not implement, set to a value that changes decoding, is refused rather than
ignored: a ConfigError naming the file and the field, an InputError for a keyword or a passed generation_config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flodl_hf.core import io
from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.core.outputs import ModelOutput
from flodl_hf.generation.processors import watermark_fields


GENERATION_CONFIG = "generation_config.json"

# transformers' GenerationConfig._get_default_generation_params, for the fields generate_ids implements
GLOBAL_DEFAULTS: dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                                   "repetition_penalty": 1.0, "num_return_sequences": 1, "use_cache": True,
                                   "min_length": 0, "return_dict_in_generate": False, "output_scores": False,
                                   "output_logits": False, "output_hidden_states": False,
                                   "output_attentions": False, "num_beams": 1, "length_penalty": 1.0,
                                   "early_stopping": False}
DEFAULT_NEW_TOKENS = 20  # transformers' max_length=20 default, counted in new tokens (_prepare_generated_length)
# GenerationConfig._get_default_generation_params, for the fields an assistant reads
ASSISTANT_DEFAULTS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                      "assistant_confidence_threshold": 0.4}


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
