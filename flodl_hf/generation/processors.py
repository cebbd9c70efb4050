"""The logits processors and stopping criteria of transformers 5.24's generate, for ``generate_ids``.

``logits_processors`` builds the list ``GenerationMixin._get_logits_processor`` builds (generation/utils.py:1416),
in its order, for the settings ``generate_ids`` implements; each entry takes ``(input_ids, scores)`` and returns
the new scores with the ops of the transformers class named beside it (generation/logits_process.py), so that the
scores, and the ids drawn from them, are bitwise transformers'. ``stopping_criteria`` builds
``_get_stopping_criteria``'s list (maximum length, time, stop strings, eos; ``StopStrings`` is
``StopStringCriteria``: a row stops when a stop string ends in its last token). A caller's own processors and
criteria (``generate(logits_processor=..., stopping_criteria=...)``) join both lists as
``_merge_criteria_processor_list`` merges them: one of the class of a built-in takes its place, the others follow
the built-ins (the processors before the sampling warpers, as there).
"""

from __future__ import annotations

import inspect
import math
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from flodl_hf.core.errors import InputError

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---- processors (generation/logits_process.py), in _get_logits_processor's order -------------------------------

class SequenceBias:
    """SequenceBiasLogitsProcessor (:1242): each (ids, bias) adds ``bias`` to the score of its last id where the row
    ends with the ids before it. ``sequence_bias`` is transformers' list ``[[ids, bias], ...]`` or its older dict
    ``{tuple(ids): bias}``; a later duplicate overwrites an earlier one's bias, keeping its place (a dict)."""

    def __init__(self, sequence_bias: Any) -> None:
        if isinstance(sequence_bias, list):
            sequence_bias = {tuple(ids): bias for ids, bias in sequence_bias}
        self.sequence_bias: dict[tuple[int, ...], float] = dict(sequence_bias)
        self.single: torch.Tensor | None = None
        self.groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _prepare(self, scores: torch.Tensor) -> None:
        # _prepare_bias_variables: the one-token biases in one vector, longer sequences grouped by prefix length in
        # the order their lengths first occur (index_add_ sums in that order)
        device = scores.device
        self.single = torch.zeros((scores.shape[-1],), dtype=torch.float, device=device)
        singles = [(ids[0], bias) for ids, bias in self.sequence_bias.items() if len(ids) == 1]
        if singles:
            self.single[[i for i, _ in singles]] = torch.tensor([b for _, b in singles], device=device)
        by_length: dict[int, list[tuple[tuple[int, ...], float]]] = {}
        for ids, bias in self.sequence_bias.items():
            if len(ids) > 1:
                by_length.setdefault(len(ids) - 1, []).append((ids, bias))
        self.groups = [(torch.tensor([ids[:-1] for ids, _ in group], device=device),
                        torch.tensor([ids[-1] for ids, _ in group], device=device),
                        torch.tensor([bias for _, bias in group], dtype=torch.float, device=device))
                       for group in by_length.values()]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.single is None:
            self._prepare(scores)
        bias = torch.zeros_like(scores)
        bias += self.single
        for prefixes, last, biases in self.groups:
            if prefixes.shape[1] > input_ids.shape[1]:
                continue
            matching = (input_ids[:, None, -prefixes.shape[1]:] == prefixes).all(dim=-1)
            bias.index_add_(1, last, torch.where(matching, biases, 0.0).to(bias.dtype))
        return scores + bias


class PrefixConstrained:
    """PrefixConstrainedLogitsProcessor (generation/logits_process.py): each row's scores kept only at the ids
    ``prefix_allowed_tokens_fn(batch_id, row's ids so far)`` returns, the others -inf; a prompt none of whose rows
    keeps an id above -inf gets the mask itself (0 at the allowed ids), so the constraint holds. ``rows``: the rows
    per prompt, ``max(num_beams, num_return_sequences)``; the row's ids are those generate carries (none of the
    prompt after an ``inputs_embeds`` prompt alone)."""

    def __init__(self, prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], Any], rows: int) -> None:
        self.prefix_allowed_tokens_fn, self.rows = prefix_allowed_tokens_fn, rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(scores, -math.inf)
        batch_size = input_ids.shape[0] // self.rows
        for batch_id in range(batch_size):
            for beam_id in range(self.rows):
                row = batch_id * self.rows + beam_id
                allowed = self.prefix_allowed_tokens_fn(batch_id, input_ids[row])
                try:
                    empty = len(allowed) == 0
                    if not empty:
                        mask[row, allowed] = 0
                except (TypeError, IndexError, RuntimeError) as exc:  # where transformers fails too
                    raise InputError(f"prefix_allowed_tokens_fn returned {allowed!r} for batch id {batch_id}: "
                                     f"expected a list of token ids below {scores.shape[-1]}") from exc
                if empty:
                    raise InputError(f"prefix_allowed_tokens_fn returned no token for batch id {batch_id}: the "
                                     "constraint cannot be met (transformers raises)")
        processed = scores + mask
        unsatisfiable = processed.amax(dim=-1).isneginf().view(batch_size, -1).all(dim=-1, keepdim=True)
        return torch.where(unsatisfiable.repeat_interleave(self.rows, dim=0), mask, processed)


def bad_words(bad_words_ids: list[list[int]], eos: Sequence[int]) -> SequenceBias:
    """NoBadWordsLogitsProcessor (:1432): a sequence bias of -inf for each bad sequence, less the one-token sequences
    that are an eos id (all of them may be: then it changes nothing, as there)."""
    kept = [seq for seq in bad_words_ids if all(seq != [e] for e in eos)]
    return SequenceBias({tuple(seq): float("-inf") for seq in kept})


def repetition_penalty(input_ids: torch.Tensor, scores: torch.Tensor, penalty: float,
                       ignore: torch.Tensor | None = None) -> torch.Tensor:
    """RepetitionPenaltyLogitsProcessor (:306): every id of the sequence so far (the first ``ignore[row]`` positions
    excepted: a left-padded row's pads) has its score multiplied by ``penalty`` when negative, else divided by it."""
    vocab_size = scores.shape[-1]
    if ignore is not None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        input_ids = input_ids.masked_fill(positions[None, :] < ignore[:, None], vocab_size)
    input_ids = input_ids.clamp(max=vocab_size)
    scores = torch.nn.functional.pad(scores, (0, 1))
    score = torch.gather(scores, 1, input_ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return scores.scatter(1, input_ids, score)[..., :vocab_size]


def no_repeat_ngram(input_ids: torch.Tensor, scores: torch.Tensor, size: int) -> torch.Tensor:
    """NoRepeatNGramLogitsProcessor (:1102): ban each id that would complete an n-gram the row already holds (its
    left padding included, as there)."""
    length = input_ids.shape[-1]
    if length < size:
        return scores
    prefix = input_ids[:, length + 1 - size:]
    windows = input_ids.unfold(dimension=1, size=size, step=1)
    matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1)
    vocab_size = scores.shape[-1]
    banned = scores.new_zeros((scores.shape[0], vocab_size + 1), dtype=torch.bool)
    banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=vocab_size), vocab_size), True)
    return scores.masked_fill(banned[:, :vocab_size], -float("inf"))


def ban_ids(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """MinLength / MinNewTokensLength (:101, :164), SuppressTokens (:1913): the ids' scores to -inf."""
    return torch.where(torch.isin(torch.arange(scores.shape[-1], device=scores.device), ids), -math.inf, scores)


def force(scores: torch.Tensor, ids: Any) -> torch.Tensor:
    """ForcedBOSTokenLogitsProcessor / ForcedEOSTokenLogitsProcessor (:1599, :1644): every score -inf but the ids' 0."""
    forced = torch.full_like(scores, -math.inf)
    forced[:, ids] = 0
    return forced


def remove_invalid_values(scores: torch.Tensor) -> torch.Tensor:
    """InfNanRemoveLogitsProcessor (:1700): nan to 0, +-inf to the dtype's max / min."""
    processed = torch.where(scores != scores, 0.0, scores)
    processed = torch.where(scores == float("inf"), torch.finfo(scores.dtype).max, processed)
    return torch.where(scores == -float("inf"), torch.finfo(scores.dtype).min, processed)


def exponential_decay(input_ids: torch.Tensor, scores: torch.Tensor, start: int, factor: float,
                      eos: torch.Tensor) -> torch.Tensor:
    """ExponentialDecayLengthPenalty (:1721): past ``start`` (total length), the eos scores grow by
    ``|score| * (factor ** steps - 1)``."""
    length = input_ids.shape[-1]
    if length <= start:
        return scores
    penalties = torch.zeros_like(scores)
    penalty = torch.abs(scores[:, eos]) * (pow(factor, length - start) - 1)
    penalties[:, eos] = penalty.masked_fill(~torch.isfinite(scores[:, eos]), 0.0)
    return scores + penalties


# ---- warpers (sampling only); ``keep``: min_tokens_to_keep, 1 without beams -----------------------------------

def temperature(scores: torch.Tensor, t: float) -> torch.Tensor:
    """TemperatureLogitsWarper (:238)."""
    return scores / t


def top_k(scores: torch.Tensor, k: int, keep: int = 1) -> torch.Tensor:
    """TopKLogitsWarper (:571)."""
    k = min(max(int(k), keep), scores.size(-1))
    return scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))


def top_p(scores: torch.Tensor, p: float, keep: int = 1) -> torch.Tensor:
    """TopPLogitsWarper (:502)."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - p)
    remove[..., -keep:] = 0
    return scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))


def top_h(scores: torch.Tensor, h: float, top_n: int = 100) -> torch.Tensor:
    """TopHLogitsWarper (:627): of the ``top_n`` likeliest ids (a categorical over their logits), keep them in order
    while the running sum of ``-p log p`` stays within ``h`` times that distribution's entropy (the first always)."""
    top_logits, top_idx = torch.topk(scores, min(top_n, scores.shape[-1]), dim=-1, largest=True, sorted=True)
    dist = torch.distributions.Categorical(logits=top_logits)
    probs = dist.probs
    tau = (dist.entropy() * h).unsqueeze(-1)
    selection = torch.cumsum(-probs * torch.log(probs), dim=-1) <= tau
    selection[:, 0] = True
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, top_idx, selection)
    processed = scores.clone()
    processed[~keep] = -float("inf")
    return processed


def min_p(scores: torch.Tensor, p: float, keep: int = 1) -> torch.Tensor:
    """MinPLogitsWarper (:733): drop the ids less likely than ``p`` times the top id's probability."""
    probs = torch.softmax(scores, dim=-1)
    remove = probs < p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, torch.topk(probs, min(keep, probs.shape[-1]), dim=-1).indices, False)
    return scores.masked_fill(remove, -float("inf"))


def typical(scores: torch.Tensor, mass: float, keep: int = 1) -> torch.Tensor:
    """TypicalLogitsWarper (:809): keep the ids whose surprise is closest to the entropy, up to ``mass``."""
    normalized = torch.nn.functional.log_softmax(scores, dim=-1)
    p = torch.exp(normalized)
    entropy = -(normalized * p).nansum(-1, keepdim=True)
    shifted = torch.abs((-normalized) - entropy)
    sorted_scores, sorted_indices = torch.sort(shifted, descending=False)
    cumulative = scores.gather(-1, sorted_indices).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1)
    last.clamp_(max=sorted_scores.shape[-1] - 1)
    remove = sorted_scores > sorted_scores.gather(1, last.view(-1, 1))
    remove[..., :keep] = 0
    return scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))


def _cut_below(scores: torch.Tensor, remove: torch.Tensor, keep: int) -> torch.Tensor:
    # EpsilonLogitsWarper / EtaLogitsWarper: the top ``keep`` ids are always kept
    remove = remove & (scores < torch.topk(scores, min(keep, scores.size(-1)))[0][..., -1, None])
    return scores.masked_fill(remove, -float("inf"))


def epsilon(scores: torch.Tensor, cutoff: float, keep: int = 1) -> torch.Tensor:
    """EpsilonLogitsWarper (:897): drop the ids of probability under ``cutoff``."""
    return _cut_below(scores, scores.softmax(dim=-1) < cutoff, keep)


def eta(scores: torch.Tensor, cutoff: torch.Tensor, keep: int = 1) -> torch.Tensor:
    """EtaLogitsWarper (:966): drop the ids of probability under ``min(eta, sqrt(eta) * exp(-entropy))``; ``cutoff``
    a float32 0-d tensor, as there."""
    entropy = torch.distributions.Categorical(logits=scores).entropy()
    threshold = torch.min(cutoff, torch.sqrt(cutoff) * torch.exp(-entropy))[..., None]
    return _cut_below(scores, scores.softmax(dim=-1) < threshold, keep)


def renormalize(scores: torch.Tensor) -> torch.Tensor:
    """LogitNormalization (:1823): log-softmax, always last."""
    return scores.log_softmax(dim=-1)


class Guidance:
    """UnbatchedClassifierFreeGuidanceLogitsProcessor (:2276), transformers' ``guidance_scale``: the scores as
    log-probabilities, pulled away from the model's on an unconditional sequence by ``scale * (cond - uncond) +
    uncond``. The unconditional sequence is ``negative_prompt_ids`` (with its mask, ones by default), or the
    prompt's last id; each step appends the id just chosen and runs the model on it, with a cache of its own
    (``use_cache``) or on the whole sequence again. The model is called as transformers calls it there
    (``model(ids, attention_mask=, use_cache=, cache=)``, its positions its own default)."""

    def __init__(self, scale: float, model: Any, ids: torch.Tensor | None, mask: torch.Tensor | None,
                 use_cache: bool) -> None:
        self.scale, self.model, self.use_cache = scale, model, use_cache
        self.ids, self.mask, self.cache, self.first = ids, mask, None, True

    def _unconditional(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.first:
            if self.ids is None:
                self.ids = input_ids[:, -1:]
            if self.mask is None:
                self.mask = torch.ones_like(self.ids, dtype=torch.long)
            ids, mask = self.ids, self.mask
            self.first = False
        else:
            mask = torch.cat([self.mask, torch.ones_like(input_ids[:, -1:], dtype=torch.long)], dim=1)
            ids = input_ids[:, -1:] if self.use_cache else torch.cat([self.ids, input_ids[:, -1:]], dim=1)
            self.ids, self.mask = ids, mask
        out = self.model(ids, attention_mask=mask, use_cache=self.use_cache, cache=self.cache)
        self.cache = out.get("cache")
        return out.logits

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = F.log_softmax(scores, dim=-1)
        unconditional = F.log_softmax(self._unconditional(input_ids)[:, -1], dim=-1)
        return self.scale * (scores - unconditional) + unconditional


# WatermarkingConfig's fields and defaults (generation/configuration_utils.py)
WATERMARK_DEFAULTS = {"greenlist_ratio": 0.25, "bias": 2.0, "hashing_key": 15485863, "seeding_scheme": "lefthash",
                      "context_width": 1}


def watermark_fields(value: Any) -> dict[str, Any] | None:
    """A ``watermarking_config`` (a dict, or transformers' WatermarkingConfig) -> its fields with the defaults
    filled in; None where it is not one: SynthID's (``ngram_len``), an unknown field, or a value out of the range
    ``WatermarkingConfig.validate`` and ``WatermarkLogitsProcessor`` accept (``greenlist_ratio`` in (0, 1),
    ``seeding_scheme`` "lefthash" or "selfhash", ``context_width`` a positive integer, ``hashing_key`` an integer,
    ``bias`` a number)."""
    if not isinstance(value, dict) and callable(getattr(value, "to_dict", None)):
        value = value.to_dict()
    if not isinstance(value, dict) or set(value) - set(WATERMARK_DEFAULTS):
        return None
    fields = {**WATERMARK_DEFAULTS, **value}
    number = (int, float)
    ok = (isinstance(fields["greenlist_ratio"], number) and not isinstance(fields["greenlist_ratio"], bool)
          and 0.0 < fields["greenlist_ratio"] < 1.0
          and isinstance(fields["bias"], number) and not isinstance(fields["bias"], bool)
          and isinstance(fields["hashing_key"], int) and not isinstance(fields["hashing_key"], bool)
          and fields["seeding_scheme"] in ("lefthash", "selfhash")
          and isinstance(fields["context_width"], int) and not isinstance(fields["context_width"], bool)
          and fields["context_width"] >= 1)
    return fields if ok else None


class Watermark:
    """WatermarkLogitsProcessor (:2441; Kirchenbauer et al.'s green lists): for each row, a generator seeded from
    the last ``context_width`` ids (``lefthash``: the key times the last id; ``selfhash``: the smallest of the key
    times two entries of a fixed permutation of 1,000,003, with each of the 40 likeliest next ids appended in turn,
    keeping those in their own green list) draws a permutation of the vocabulary whose first ``greenlist_ratio``
    ids get ``bias`` added. A sequence shorter than ``context_width`` is left as it is. After every other
    processor and warper, before renormalization, as transformers orders it."""

    TABLE = 1_000_003

    def __init__(self, fields: dict[str, Any], vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.greenlist_size = int(vocab_size * fields["greenlist_ratio"])
        self.bias, self.key = fields["bias"], fields["hashing_key"]
        self.scheme, self.width = fields["seeding_scheme"], fields["context_width"]
        self.rng = torch.Generator(device=device)
        self.rng.manual_seed(self.key)
        # only selfhash reads the table (each step reseeds the generator, so drawing it changes no later draw)
        self.table = (torch.randperm(self.TABLE, generator=self.rng, device=device)
                      if self.scheme == "selfhash" else None)

    def _greenlist(self, seq: torch.Tensor) -> torch.Tensor:
        seq = seq[-self.width:]
        if self.scheme == "selfhash":
            a = self.table[seq % self.TABLE] + 1
            b = self.table[seq[-1] % self.TABLE] + 1
            seed = (self.key * a * b).min().item()
        else:
            seed = self.key * seq[-1].item()
        self.rng.manual_seed(seed % (2**64 - 1))
        return torch.randperm(self.vocab_size, device=seq.device, generator=self.rng)[: self.greenlist_size]

    def _self_hashed(self, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        kept = []
        _, likeliest = scores.sort(dim=-1, descending=True)
        for i in range(40):
            if likeliest[i] in self._greenlist(torch.cat([seq, likeliest[i, None]], dim=-1)):
                kept.append(likeliest[i])
        return torch.tensor(kept, device=seq.device)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if ids.shape[-1] < self.width:
            return scores
        out = scores.clone()
        for row, seq in enumerate(ids):
            green = self._self_hashed(seq, scores[row]) if self.scheme == "selfhash" else self._greenlist(seq)
            out[row, green] = out[row, green] + self.bias
        return out


def logits_processors(settings: Any, prompt_length: int, max_length: int, min_length: int,
                      ignore: torch.Tensor | None, device: torch.device, custom: Sequence[Any] = (),
                      prefix: Processor | None = None, vocab_size: int | None = None,
                      guidance: Processor | None = None) -> list[Processor]:
    """``_get_logits_processor``'s list (generation/utils.py:1416-1663) for ``settings`` (a GenerationSettings),
    in its order: ``guidance`` (:class:`Guidance`), sequence bias, repetition penalty, n-gram ban, bad words,
    minimum length (MinLength when the total ``min_length`` is positive, MinNewTokensLength when ``min_new_tokens``
    is: each bans the eos ids below ``min_length``), ``prefix`` (PrefixConstrained, for
    ``prefix_allowed_tokens_fn``), forced bos / eos, invalid values, exponential decay, suppression; then ``custom``
    (the caller's processors, merged as ``merge``); then ``final_steps``: when sampling temperature, top-h, top-k,
    top-p, min-p, typical, epsilon, eta; the watermark (over ``vocab_size``,
    the model config's); renormalization last. Each built-in
    exists where transformers creates its class, so that a custom one of that class takes its place."""
    s = settings
    named: list[tuple[str, Processor]] = []  # (the transformers class, our step)
    eos = torch.tensor(s.eos, device=device, dtype=torch.long)
    if guidance is not None:
        named.append(("UnbatchedClassifierFreeGuidanceLogitsProcessor", guidance))
    if s.sequence_bias is not None:
        named.append(("SequenceBiasLogitsProcessor", SequenceBias(s.sequence_bias)))
    if s.repetition_penalty != 1.0:
        named.append(("RepetitionPenaltyLogitsProcessor",
                      lambda ids, x: repetition_penalty(ids, x, s.repetition_penalty, ignore)))
    if s.no_repeat_ngram_size:
        named.append(("NoRepeatNGramLogitsProcessor", lambda ids, x: no_repeat_ngram(ids, x, s.no_repeat_ngram_size)))
    if s.bad_words_ids is not None:
        named.append(("NoBadWordsLogitsProcessor", bad_words(s.bad_words_ids, s.eos)))

    def below_min_length(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return ban_ids(x, eos) if ids.shape[-1] < min_length else x
    if s.eos_set and min_length > 0:
        named.append(("MinLengthLogitsProcessor", below_min_length))
    if s.eos_set and s.min_new_tokens:
        named.append(("MinNewTokensLengthLogitsProcessor", below_min_length))
    if prefix is not None:
        named.append(("PrefixConstrainedLogitsProcessor", prefix))
    if s.forced_bos_token_id is not None:
        named.append(("ForcedBOSTokenLogitsProcessor",
                      lambda ids, x: force(x, s.forced_bos_token_id) if ids.shape[-1] == 1 else x))
    if s.forced_eos_token_id is not None:
        forced = torch.tensor(s.forced_eos_token_id, device=device).reshape(-1)
        named.append(("ForcedEOSTokenLogitsProcessor",
                      lambda ids, x: force(x, forced) if ids.shape[-1] == max_length - 1 else x))
    if s.remove_invalid_values:
        named.append(("InfNanRemoveLogitsProcessor", lambda ids, x: remove_invalid_values(x)))
    if s.exponential_decay_length_penalty is not None:
        start, factor = s.exponential_decay_length_penalty
        top = max(s.eos, default=-1)

        def decay(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            if ids.shape[-1] > start + prompt_length and top >= x.shape[-1]:  # where transformers' indexing fails
                raise InputError(f"exponential_decay_length_penalty={s.exponential_decay_length_penalty!r}: it "
                                 f"indexes the scores with the eos ids {s.eos}, and {top} is beyond the vocabulary "
                                 f"({x.shape[-1]} ids; transformers raises an IndexError)")
            return exponential_decay(ids, x, start + prompt_length, factor, eos)
        named.append(("ExponentialDecayLengthPenalty", decay))
    if s.suppress_tokens is not None:
        suppressed = torch.tensor(list(s.suppress_tokens), device=device)
        named.append(("SuppressTokensLogitsProcessor", lambda ids, x: ban_ids(x, suppressed)))
    if s.begin_suppress_tokens is not None:
        begin = prompt_length + (1 if prompt_length == 1 and s.forced_bos_token_id is not None else 0)
        at_begin = torch.tensor(list(s.begin_suppress_tokens), device=device)
        named.append(("SuppressTokensAtBeginLogitsProcessor",
                      lambda ids, x: ban_ids(x, at_begin) if ids.shape[-1] == begin else x))
    return [_listed(p) for p in merge(named, custom, "logits_process")] + final_steps(s, device, vocab_size)


def final_steps(settings: Any, device: torch.device, vocab_size: int | None) -> list[Processor]:
    """The end of ``_get_logits_processor``'s list, added after the merge with the caller's processors: when
    sampling the warpers (temperature, top-h, top-k, top-p, min-p, typical, epsilon, eta), then the watermark,
    then renormalization. An assistant model's generate adds them again after the main model's whole list, which
    it takes as its caller's processors (``AssistedCandidateGenerator``)."""
    s = settings
    steps: list[Processor] = []
    if s.do_sample:
        # with beams, keep one more id than there are eos ids (two without an eos), so a beam can go on
        keep = 1 if s.num_beams == 1 else len(s.eos) + 1 if s.eos_set else 2
        if s.temperature is not None and s.temperature != 1.0:
            steps.append(lambda ids, x: temperature(x, s.temperature))
        if s.top_h is not None:
            steps.append(lambda ids, x: top_h(x, float(s.top_h)))
        if s.top_k:
            steps.append(lambda ids, x: top_k(x, s.top_k, keep))
        if s.top_p is not None and s.top_p < 1.0:
            steps.append(lambda ids, x: top_p(x, s.top_p, keep))
        if s.min_p is not None:
            steps.append(lambda ids, x: min_p(x, s.min_p, keep))
        if s.typical_p is not None and s.typical_p < 1.0:
            steps.append(lambda ids, x: typical(x, float(s.typical_p), keep))
        if s.epsilon_cutoff is not None and 0.0 < s.epsilon_cutoff < 1.0:
            steps.append(lambda ids, x: epsilon(x, float(s.epsilon_cutoff), keep))
        if s.eta_cutoff is not None and 0.0 < s.eta_cutoff < 1.0:
            cutoff = torch.tensor(float(s.eta_cutoff), device=device)
            steps.append(lambda ids, x: eta(x, cutoff, keep))
    if s.watermarking_config is not None:
        steps.append(Watermark(watermark_fields(s.watermarking_config), vocab_size, device))
    if s.renormalize_logits:
        steps.append(lambda ids, x: renormalize(x))
    return steps


def merge(named: Sequence[tuple[str, Any]], custom: Sequence[Any], module: str) -> list[Any]:
    """GenerationMixin._merge_criteria_processor_list (generation/utils.py:1707): each built-in (named by its
    transformers class in ``generation.<module>``) is replaced, in its place, by the first custom entry of exactly
    that class (transformers warns and uses the custom one); the other custom entries follow in their order, each
    once (``custom not in final``)."""
    if len(custom) == 0:
        return [step for _, step in named]
    import importlib
    classes = importlib.import_module(f"transformers.generation.{module}")
    final: list[Any] = []
    for name, step in named:
        final.append(next((c for c in custom if type(c) is getattr(classes, name)), step))
    for c in custom:
        if c not in final:
            final.append(c)
    return final


def _listed(processor: Any) -> Processor:
    """LogitsProcessorList.__call__: a processor whose ``__call__`` takes more than ``(input_ids, scores)`` wants
    keyword arguments, which generate never passes: transformers raises at its first call, and so does this."""
    try:
        params = list(inspect.signature(processor.__call__).parameters)
    except (TypeError, ValueError):  # no signature to read (a builtin): called with the two arguments
        return processor
    if len(params) <= 2:
        return processor

    def refused(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        raise InputError(f"logits_processor: {processor.__class__} takes the parameters {params}; generate passes "
                         "it input_ids and scores alone (transformers raises: \"Make sure that all the required "
                         "parameters ... are passed to the logits processor\")")
    return refused


def apply(steps: Sequence[Processor], input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    for step in steps:
        scores = step(input_ids, scores)
    return scores


# ---- stopping criteria (generation/stopping_criteria.py) -----------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (transformers' convert_slow_tokenizer.bytes_to_unicode)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, (chr(c) for c in chars)))


def _decoder_has(config: Any, kind: str) -> bool:
    if isinstance(config, dict):
        return config.get("type") == kind or any(_decoder_has(v, kind) for v in config.values())
    return isinstance(config, list) and any(_decoder_has(v, kind) for v in config)


def matching_mode(tokenizer: Any) -> str | None:
    """StopStringCriteria._get_stop_string_matching_mode (:293): "byte_level" (GPT-2 byte tokens), "byte_fallback"
    (``<0x..>`` byte tokens) or None, read off the backend tokenizer's decoder."""
    import json
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return None
    if decoder.__class__.__name__ == "ByteLevel":
        return "byte_level"
    state = getattr(decoder, "__getstate__", lambda: None)()
    try:
        config = json.loads(state.encode() if isinstance(state, str) else state) \
            if isinstance(state, (str, bytes)) else None
    except json.JSONDecodeError:
        config = None
    if config is not None:
        if _decoder_has(config, "ByteFallback"):
            return "byte_fallback"
        if _decoder_has(config, "ByteLevel"):
            return "byte_level"
    return None


def _token_bytes(token: str, mode: str | None, byte_decoder: dict[str, int] | None) -> bytes | None:
    if mode == "byte_level":
        return bytes(byte_decoder[c] for c in token) if all(c in byte_decoder for c in token) else None
    if mode == "byte_fallback" and len(token) == 6 and token.startswith("<0x") and token.endswith(">") \
            and all(c in "0123456789abcdefABCDEF" for c in token[3:5]):
        return bytes([int(token[3:5], 16)])
    return None


def token_texts(tokenizer: Any, mode: str | None, prefix: str = "abcdef") -> dict[int, str | bytes]:
    """StopStringCriteria.clean_tokenizer_vocab (:358): each id's text as it reads inside a text (no "Ġ" or "▁"),
    found by decoding it after a fixed prefix and cutting the prefix off; bytes in the byte modes."""
    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()} if mode == "byte_level" else None
    base_ids = tokenizer(prefix, add_special_tokens=False, return_tensors=None)["input_ids"]
    base = tokenizer.convert_ids_to_tokens([int(i) for i in base_ids])
    texts: dict[int, str | bytes] = {}
    for token, index in tokenizer.get_vocab().items():
        text = _token_bytes(token, mode, byte_decoder)
        if text is None:
            decoded = tokenizer.convert_tokens_to_string(base + [token])
            text = decoded[decoded.index(prefix) + len(prefix):]
            if mode is not None:
                text = text.encode("utf-8")
        texts[index] = text
    return texts


_TEXTS_CACHE: OrderedDict = OrderedDict()  # (vocab, mode) -> token_texts, the last 8 (as STOP_STRING_EMBEDDING_CACHE)


class StopStrings:
    """StopStringCriteria (:112, its __call__ :483): a row is done when one of the strings ends inside its last
    token, the tokens before it spelling the rest (running off the string's start is allowed), within the last
    ``max(len(string))`` tokens. Per token and string, as there (_stop_string_get_matching_positions, :385): the
    overlaps of the token's start with the string's end ("end lengths"), the positions (counted from the string's
    end, 1 on) where the token may sit, and the token's length. The match walks these per row in Python where
    transformers gathers them from a precomputed table; the answer is the same (tested on three vocabularies)."""

    def __init__(self, tokenizer: Any, stop_strings: str | Sequence[str]) -> None:
        strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
        mode = matching_mode(tokenizer)
        self.targets = strings if mode is None else tuple(s.encode("utf-8") for s in strings)
        key = (tuple(sorted(tokenizer.get_vocab().items())), mode)
        if key not in _TEXTS_CACHE:
            _TEXTS_CACHE[key] = token_texts(tokenizer, mode)
            if len(_TEXTS_CACHE) > 8:
                _TEXTS_CACHE.popitem(last=False)
        _TEXTS_CACHE.move_to_end(key)
        texts = _TEXTS_CACHE[key]
        self.lengths = {i: len(t) for i, t in texts.items()}
        self.positions: list[dict[int, set[int]]] = []
        self.ends: list[dict[int, list[int]]] = []
        for target in self.targets:
            positions, ends = {}, {}
            rev_target = target[::-1]
            for index, text in texts.items():
                # _stop_string_get_matching_positions: where the reversed token starts the rest of the reversed string
                rev = text[::-1]
                found = [i for i in range(1, len(target)) if rev_target.startswith(rev[:1], i)
                         and rev.startswith(rev_target[i:i + len(text)])]
                if found:
                    positions[index] = set(found)
                # the token's start overlapping the string's end (the whole string inside the token included)
                overlaps = [n for i in range(len(text)) if text[i:i + 1] == target[-1:]
                            for n in [min(i + 1, len(target))] if text[i + 1 - n:i + 1] == target[-n:]]
                if overlaps:
                    ends[index] = overlaps
            self.positions.append(positions)
            self.ends.append(ends)
        if not any(self.ends):
            raise InputError(f"stop_strings={stop_strings!r}: no token of the vocabulary can end them (transformers "
                             "refuses them too: a character the vocabulary lacks?)")
        self.window = max(len(t) for t in self.targets)

    def _ends_row(self, ids: list[int]) -> bool:
        last, before = ids[-1], ids[-self.window:-1][::-1]
        for target, positions, ends in zip(self.targets, self.positions, self.ends):
            for matched in ends.get(last, ()):
                if matched >= len(target):
                    return True
                for token in before:
                    if matched not in positions.get(token, ()):
                        break
                    matched += self.lengths[token]
                    if matched >= len(target):
                        return True
        return False

    def __call__(self, input_ids: torch.Tensor, scores: Any = None) -> torch.Tensor:
        rows = input_ids[:, -self.window:].tolist()
        return torch.tensor([self._ends_row(r) for r in rows], dtype=torch.bool, device=input_ids.device)


class MaxLength:
    """MaxLengthCriteria (:60): every row is done at ``max_length`` tokens."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length

    def __call__(self, input_ids: torch.Tensor, scores: Any = None) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.max_length, device=input_ids.device,
                          dtype=torch.bool)


class MaxTime:
    """MaxTimeCriteria (:89): every row is done ``max_time`` seconds after its creation."""

    def __init__(self, max_time: float) -> None:
        self.max_time, self.started = max_time, time.time()

    def __call__(self, input_ids: torch.Tensor, scores: Any = None) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), time.time() - self.started > self.max_time, device=input_ids.device,
                          dtype=torch.bool)


class EosToken:
    """EosTokenCriteria (:544): a row is done when its last id is an eos id. Its ``eos_token_id`` attribute is what
    ``_sample`` looks for (``has_eos_stopping_criteria``) to give finished rows the pad id."""

    def __init__(self, eos: Sequence[int], device: torch.device) -> None:
        self.eos_token_id = torch.tensor(list(eos), device=device, dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: Any = None) -> torch.Tensor:
        return torch.isin(input_ids[:, -1], self.eos_token_id)


class Confidence:
    """ConfidenceCriteria (:596): an assistant model's generate stops once the probability of its last token, under
    the step's processed scores, is below ``threshold`` (one prompt)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def __call__(self, input_ids: torch.Tensor, scores: tuple) -> torch.Tensor:
        p = scores[-1].softmax(-1)[0, input_ids[0, -1]].item()
        return torch.full((input_ids.shape[0],), p < self.threshold, device=input_ids.device, dtype=torch.bool)


def stopping_criteria_list(settings: Any, max_length: int, stop_strings: StopStrings | None, device: torch.device,
                      custom: Sequence[Any] = ()) -> list[Callable]:
    """``_get_stopping_criteria``'s list (generation/utils.py:1669), in its order: the maximum length, the time
    (counted from here, as MaxTimeCriteria from its creation), the stop strings, the eos ids (when an eos id is set,
    ``[]`` included); then ``custom`` (the caller's criteria, merged as ``merge``)."""
    named: list[tuple[str, Callable]] = [("MaxLengthCriteria", MaxLength(max_length))]
    if settings.max_time is not None:
        named.append(("MaxTimeCriteria", MaxTime(settings.max_time)))
    if stop_strings is not None:
        named.append(("StopStringCriteria", stop_strings))
    if settings.eos_set:
        named.append(("EosTokenCriteria", EosToken(settings.eos, device)))
    return merge(named, custom, "stopping_criteria")


def stop_hits(criteria: Sequence[Callable], input_ids: torch.Tensor, scores: tuple | None) -> torch.Tensor:
    """StoppingCriteriaList.__call__: each criterion called with the ids so far and the recorded scores (a tuple
    when ``output_scores`` records them, else None), their answers or-ed into one bool per row."""
    done = torch.full((input_ids.shape[0],), False, device=input_ids.device, dtype=torch.bool)
    for criterion in criteria:
        done = done | criterion(input_ids, scores)
    return done
