"""The model's side of the decoding loops: ``_Decoder`` (the prompt once, then each step the last token with the
cache, or the whole sequence without one), the caches it runs over beside the plain KV cache (the static cache of
``cache_implementation="static"``, ``_DraftCache`` for assisted decoding), each step's recorded attentions and
hidden states (``_Seen``), the end of a loop (``_finish``), and the attention mask inferred from the pad id."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from flodl_hf.core.decoder import KVCache, StaticKVCache
from flodl_hf.core.errors import InputError, NonFiniteScoresError
from flodl_hf.core.modeling import PLAIN_RECORD, config_sets_forward_defaults
from flodl_hf.generation.settings import GenerateDecoderOnlyOutput, GenerationSettings


def infer_attention_mask(input_ids: torch.Tensor, pad: int | None, eos: Sequence[int]) -> torch.Tensor:
    """``_prepare_attention_mask_for_generation``, when no mask is given: the positions holding the pad id are masked
    out when the pad id is set, is not an eos id, occurs in the input, and the ids are int32 or int64; else all ones."""
    ones = torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)
    if pad is None or input_ids.dtype not in (torch.int, torch.long) or pad in eos or not (input_ids == pad).any():
        return ones
    return input_ids.ne(pad).long()


def draw(probs: torch.Tensor, generator: torch.Generator | None, step: str | int, num_samples: int = 1) -> torch.Tensor:
    """``torch.multinomial(probs, num_samples)`` once every row can be drawn from: a row holding NaN, an infinity or a
    negative value, or none above zero (the softmax of NaN or infinite logits, of scores all -inf) is a
    NonFiniteScoresError naming the step and the rows, where torch raises a bare RuntimeError (as under transformers'
    generate) or, on CUDA, may assert. ``step``: the step's name, or (an int) the step of the first row when the rows
    are consecutive steps (assisted decoding's positions). The check costs one reduction and one sync per draw."""
    bad = ~torch.isfinite(probs).all(dim=-1) | (probs < 0).any(dim=-1) | ~(probs.sum(dim=-1) > 0)
    if bool(bad.any()):
        rows = bad.reshape(-1).nonzero().flatten().tolist()
        shown = ", ".join(map(str, rows[:8])) + (f" (and {len(rows) - 8} more)" if len(rows) > 8 else "")
        where = f"step {step + rows[0]} (new token {step + rows[0]})" if isinstance(step, int) else step
        raise NonFiniteScoresError(f"sampling at {where}: the next-token scores of row(s) {shown} are NaN or infinite, "
                                   "or give no token a positive probability, so no token can be drawn; the model's "
                                   "logits are broken (NaN weights, float16 overflow) or a logits processor returned "
                                   "such scores. Check the model on a plain forward, or pass do_sample=False")
    return torch.multinomial(probs, num_samples=num_samples, generator=generator)


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
