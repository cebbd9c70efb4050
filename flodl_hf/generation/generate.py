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
- ``num_beams > 1`` runs ``_beam_search`` instead (``flodl_hf.generation.beam``), beam sampling with ``do_sample``;
- ``prompt_lookup_num_tokens`` and ``assistant_model`` run ``assisted._assisted`` (transformers' assisted decoding,
  one prompt) on prompt lookup's candidates (``lookup``) or on an assistant model's (``assisted.AssistantDrafts``,
  speculative sampling when sampling), the KV caches ``decoding._DraftCache`` that crop the rejected candidates;
- ``inputs_embeds`` prompts as ``_prepare_model_inputs`` takes them on a decoder: the embeddings feed the first
  forward alone (``prepare_inputs_for_generation``), the ids (none: an empty (B, 0) tensor) carry on, so that
  without ``input_ids`` only the new tokens come back; the cache always on (``_embedded_prompt``);
- ``prefix_allowed_tokens_fn``: ``PrefixConstrained``, in its place among the processors;
- transformers' hooks: custom ``logits_processor`` / ``stopping_criteria`` merged into the built-in lists as
  ``_merge_criteria_processor_list`` merges them (``generation_processors.merge``), and a ``streamer`` handed the
  prompt, each step's new ids and ``end()`` as ``_sample`` hands them (not with beams: transformers raises, or with
  beam sampling never ends it).
The settings are read and merged in ``flodl_hf.generation.settings``, the model's side of the loop (the decoder, its
caches, the records) is ``flodl_hf.generation.decoding``; the one-liner over texts, ``generate(prompts, model)``, is
``flodl_hf.tasks.generate``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from flodl_hf.core.errors import InputError
from flodl_hf.core.modeling import PLAIN_RECORD
from flodl_hf.generation.assisted import _assisted, _assistant_drafts, _check_assistant
from flodl_hf.generation.beam import _beam_search
from flodl_hf.generation.decoding import (_Decoder, _DraftCache, _finish, _Seen, _static_cache, draw,
                                          infer_attention_mask)
from flodl_hf.generation.lookup import _LookupDrafts
from flodl_hf.generation.processors import (Guidance, PrefixConstrained, StopStrings, apply, logits_processors,
                                            stop_hits, stopping_criteria_list)
from flodl_hf.generation.settings import (DEFAULT_NEW_TOKENS, GENERATION_CONFIG, STATIC_CACHES,
                                          GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput,
                                          GenerationSettings, _check_fields, _is_int, generation_settings)


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


def _position_table(model: torch.nn.Module) -> int | None:
    """The positions the model's table holds (``Family.max_sequence_length``; None: RoPE, no table to run past)."""
    family = getattr(model, "family", None)
    return family.max_sequence_length(model.config) if family is not None else None


def _check_position_table(model: torch.nn.Module, settings: GenerationSettings, prompt: int, total: int) -> None:
    """A family with a learned or fixed position table (GPT-2's wpe, OPT's embed_positions, GPT-J's sinusoids:
    ``Family.max_sequence_length``) takes no position past its rows. Generating up to ``total`` positions feeds all
    but the last new token back (positions 0 to ``total - 2``), so ``total - 1`` must fit the table: checked before
    decoding, where transformers' generate fails midway with an IndexError (a bare one here too, before)."""
    limit = _position_table(model)
    if limit is None or total - 1 <= limit:
        return
    asked = (f"max_new_tokens={settings.max_new_tokens}" if settings.max_new_tokens is not None
             else f"max_length={settings.max_length} (of the arguments or {GENERATION_CONFIG})")
    table = f"the position table of {limit} positions ({model.config.model_type}'s max_position_embeddings)"
    if prompt > limit:
        raise InputError(f"input_ids: the prompt of {prompt} positions is longer than {table}: truncate it")
    raise InputError(f"{asked}: a prompt of {prompt} positions and {total - prompt} new tokens feed {total - 1} "
                     f"positions to the model (all but the last new token), past {table}; pass max_new_tokens="
                     f"{limit + 1 - prompt} or fewer (transformers fails midway with an IndexError)")


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
    ``assistant_confidence_threshold``, as transformers reads them; see ``flodl_hf.generation.assisted``); ignored
    with beams, as transformers ignores it. ``assistant_tokenizer``: for an assistant over another vocabulary, with
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
    _check_position_table(model, settings, prompt_length + embedded, max_length + embedded)
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
        drafts = (_LookupDrafts(settings, processors, max_length, model.config.vocab_size,
                                _position_table(model)) if lookup else
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
            step = input_ids.shape[1] - prompt_length + 1
            next_tokens = draw(probs, generator, f"step {step} (new token {step} of at most "
                                                 f"{max_length - prompt_length})").squeeze(1)
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
