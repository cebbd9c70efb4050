"""Assisted generation with an assistant model: ``generate_ids(..., assistant_model=small)``, transformers 5.25's
``AssistedCandidateGenerator`` (generation/candidate_generator.py:73) feeding ``_assisted_decoding``
(generation/utils.py:3925), one prompt at a time, the assistant sharing the main model's vocabulary; or, greedy,
over another tokenizer, its drafts going through text (``TranslatedDrafts``, universal assisted decoding).

Each step the assistant drafts up to ``num_assistant_tokens`` candidates with its own cache, the main model checks
them in one forward, and the candidates up to the first it disagrees with are kept, with its own next token after
them. Greedy: the main model's argmax at each position; sampled: speculative sampling (``speculative_sampling``,
algorithm 1 of arXiv 2211.17192) on the assistant's and the main model's probabilities. What transformers does
along the way is done here in the same order, so the ids are transformers':
- the assistant's scores go through the main model's whole list of processors, then through the sampling
  warpers, the watermark and renormalization once more (the main list is its caller's list there, and its own
  generate appends those after it);
- it stops at its round's maximum length, at an eos id, or (``ConfidenceCriteria``) once its last token's
  probability is under ``assistant_confidence_threshold``;
- where scikit-learn is installed (transformers' ``is_sklearn_available``), that threshold moves after every step
  to the one that minimizes false positives + 3 x false negatives on the drafts so far (``roc_curve``);
- ``num_assistant_tokens_schedule`` ``"heuristic"`` / ``"heuristic_transient"``: two more candidates after a step
  that kept all of them, one fewer (at least 1) otherwise; ``"heuristic"`` writes the count back to the
  assistant's ``generation_config`` when the call ends, so the next call starts from it.
The three settings come from the assistant's ``generation_config`` (its ``generation_config.json``, else
transformers' defaults 20, ``"constant"``, 0.4), as transformers reads them from ``assistant_model.
generation_config``, not from the call's keywords.

The decoding loop that checks the candidates, ``_assisted`` (``_assisted_decoding``), is here too, with what an
assistant may be (``_check_assistant``) and its start (``_assistant_drafts``); it runs prompt lookup's candidates
(``flodl_hf.generation.lookup``) and early exit's alike.
"""

from __future__ import annotations

from typing import Any

import torch

from flodl_hf.core.errors import InputError
from flodl_hf.generation.decoding import _Decoder, _DraftCache, _finish, _Seen, draw, infer_attention_mask
from flodl_hf.generation.processors import Confidence, apply, final_steps, stop_hits, stopping_criteria_list
from flodl_hf.generation.settings import ASSISTANT_DEFAULTS, GenerateDecoderOnlyOutput, GenerationSettings

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


def check_assistant_config(config: Any) -> None:
    """The assistant's three settings, where its generation config sets them: a positive count of candidates, a
    known schedule, a threshold in [0, 1] (0: no confidence stop)."""
    checks = {"num_assistant_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                                       "a positive integer"),
              "num_assistant_tokens_schedule": (lambda v: v in SCHEDULES, f"one of {SCHEDULES}"),
              "assistant_confidence_threshold": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 and 0 <= v <= 1, "a number in [0, 1]")}
    for name, (ok, expected) in checks.items():
        value = getattr(config, name, None)
        if value is not None and not ok(value):
            raise InputError(f"assistant_model.generation_config: {name}={value!r}: expected {expected}")


def _sklearn() -> bool:
    from transformers.utils import is_sklearn_available
    return is_sklearn_available()


class AssistantDrafts:
    """The candidates of an assistant model, round after round, with its cache kept between rounds; or, with
    ``exit_after`` (``assistant_early_exit``, transformers' ``EarlyExitCandidateGenerator``), of the model itself
    through its first ``exit_after`` layers (where its family's transformers forward honours the count:
    ``exits_early``), with a cache of its own.

    ``decoder``: the assistant's side of the decoding loop (generate's ``_Decoder`` over a croppable cache, started
    on the prompt's mask); ``config``: the assistant's ``generation_config`` (read for the three settings above, and
    written back under the heuristic schedule); ``settings`` and ``processors``: the main call's settings and its
    list of processors; ``max_length``: the main call's."""

    def __init__(self, decoder: Any, config: Any, settings: Any, processors: list, max_length: int,
                 generator: torch.Generator | None, vocab_size: int, exit_after: int | None = None) -> None:
        self.decoder, self.config, self.settings, self.max_length = decoder, config, settings, max_length
        self.generator, self.exit_after = generator, exit_after

        def read(name: str) -> Any:
            value = getattr(config, name, None)
            return ASSISTANT_DEFAULTS[name] if value is None else value
        self.tokens = read("num_assistant_tokens")
        self.schedule = read("num_assistant_tokens_schedule")
        self.threshold = read("assistant_confidence_threshold")
        self.processors = processors + final_steps(settings, decoder.attention_mask.device, vocab_size)
        self.roc = _sklearn()
        self.probs: list[float] = []
        self.matches: list[int] = []
        self.last_length = 0  # the length of the last draft's ids, to crop the cache back from

    def candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """AssistedCandidateGenerator.get_candidates: the assistant's new tokens after ``input_ids`` (1-D) and their
        processed scores (1, n, V); none (and None) one token short of the maximum length."""
        length = input_ids.shape[1]
        most = min(int(self.tokens), self.max_length - length - 1)
        if most == 0:
            return input_ids[0, :0], None
        ids, seen = self._draft(input_ids, most, self.last_length)
        self.last_length = ids.shape[1]
        drafted = ids[0, length:]
        if self.roc and self.threshold:
            picked = torch.cat(seen, dim=0).softmax(dim=-1)[range(drafted.shape[0]), drafted]
            self.probs.extend(picked.tolist())
        return drafted, torch.stack(seen, dim=1)

    def _draft(self, input_ids: torch.Tensor, most: int, last_length: int) -> tuple[torch.Tensor, tuple]:
        """The assistant's generate on ``input_ids`` (its cache cropped back from ``last_length`` ids first): up to
        ``most`` new tokens; returns the ids with them and each step's processed scores."""
        length = input_ids.shape[1]
        s, device = self.settings, input_ids.device
        criteria = stopping_criteria_list(s, length + most, None, device)
        if self.threshold is not None and self.threshold > 0:
            criteria.append(Confidence(self.threshold))
        backbone = self.decoder.model.backbone
        if self.exit_after is not None:  # EarlyExitCandidateGenerator: config.num_hidden_layers lowered meanwhile
            backbone.__dict__["exit_after"] = self.exit_after
        try:
            logits = self.decoder.catch_up(input_ids, last_length)
            ids, seen = input_ids, ()
            while True:  # the assistant's _sample, one prompt
                scores = apply(self.processors, ids, logits)
                seen += (scores,)
                if s.do_sample:
                    token = draw(scores.softmax(dim=-1), self.generator, f"the assistant's draft at position "
                                                                         f"{ids.shape[1]}")
                else:
                    token = scores.argmax(dim=-1, keepdim=True)
                ids = torch.cat([ids, token], dim=-1)
                if stop_hits(criteria, ids, seen).all():
                    break
                logits = self.decoder.next_logits(ids)
        finally:
            backbone.__dict__.pop("exit_after", None)
        return ids, seen

    def update(self, scores: torch.Tensor, matches: int) -> None:
        """AssistedCandidateGenerator.update_candidate_strategy, after a step that kept ``matches`` candidates of
        the ``scores.shape[1] - 1`` drafted."""
        if self.schedule in ("heuristic", "heuristic_transient"):
            self.tokens = self.tokens + 2 if matches == scores.shape[1] - 1 else max(1, self.tokens - 1)
        if not (self.roc and self.threshold):
            return
        self.matches.extend([1] * matches)
        if len(self.probs) > len(self.matches):
            self.matches.append(0)
        excess = len(self.probs) - len(self.matches)
        if excess > 0:
            del self.probs[-excess:]
        if len(self.probs) > 5 and {0, 1} <= set(self.matches):
            import numpy as np
            from sklearn.metrics import roc_curve
            fpr, tpr, thresholds = roc_curve(self.matches, self.probs)
            self.threshold = thresholds[np.argmin(fpr + 3 * (1 - tpr))]

    def finish(self) -> None:
        """The end of ``_assisted_decoding``: under the ``"heuristic"`` schedule the count goes back to the
        assistant's generation config, where its next call starts."""
        if self.schedule == "heuristic":
            self.config.num_assistant_tokens = self.tokens


class TranslatedDrafts(AssistantDrafts):
    """An assistant with another tokenizer, greedy: transformers 5.25's
    ``AssistedCandidateGeneratorDifferentTokenizers`` (universal assisted decoding). Each round the model's ids
    since ``target_lookbehind`` ids before the last round are decoded to text and encoded with the assistant's
    tokenizer, and the longest run they share with the assistant's last ids (``_diagonal``) tells which of its
    tokens to replace and which to add; the assistant drafts
    ``num_assistant_tokens`` after them (its mask inferred from the main call's pad id, as its generate infers it
    there; the new ids are cut to the maximum length), and its ids from ``assistant_lookbehind`` before the round go
    back to the model's tokenizer the same way. No candidate scores; the confidence threshold stays where the
    assistant's config put it.

    One departure: the assistant's cache keeps the states of the ids its new ids begin with and drops the rest.
    transformers 5.25 crops it by the model's id count less the assistant's (``_last_ids_length`` counts the
    model's ids), which leaves it holding states of replaced tokens, and once it holds as many as the new ids it is
    fed nothing and fails (tests/test_generate_assisted_tokenizers.py shows both). The drafts only propose: the ids
    are the model's greedy ones either way."""

    def __init__(self, decoder: Any, config: Any, settings: Any, max_length: int, vocab_size: int, tokenizer: Any,
                 assistant_tokenizer: Any) -> None:
        super().__init__(decoder, config, settings, [], max_length, None, vocab_size)
        self.roc = False  # transformers moves the threshold for AssistedCandidateGenerator itself only
        self.tokenizer, self.assistant_tokenizer = tokenizer, assistant_tokenizer
        self.target_lookbehind = _lookbehind(config, "target_lookbehind")
        self.assistant_lookbehind = _lookbehind(config, "assistant_lookbehind")
        self.target_length: int | None = None  # prev_target_ids_len
        self.previous: torch.Tensor | None = None  # prev_assistant_ids
        self.cached: torch.Tensor | None = None  # the ids whose states the assistant's cache holds

    def candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = self._assistant_ids(input_ids)
        self.previous = ids
        s, decoder = self.settings, self.decoder
        decoder.set_mask(infer_attention_mask(ids, s.pad, s.eos))  # the assistant's generate gets no mask
        keep = 0
        if self.cached is not None:  # the shared start, short of the last id (at least one is fed)
            n = min(self.cached.shape[1], ids.shape[1] - 1)
            differ = (self.cached[0, :n] != ids[0, :n]).nonzero()
            keep = differ[0].item() if differ.numel() else n
        held = 0 if self.cached is None else self.cached.shape[1]
        sequences, _ = self._draft(ids, int(self.tokens), ids.shape[1] + held - keep)
        self.cached = sequences[:, :-1]
        new = self._target_ids(input_ids, sequences)
        self.target_length, self.previous = input_ids.shape[1], sequences
        return new[0, input_ids.shape[1]:], None

    def _convert(self, ids: torch.Tensor, to_assistant: bool) -> torch.Tensor:
        """``convert_source_tokens_to_target_tokens``: decoded without special tokens, encoded with them."""
        source, destination = ((self.tokenizer, self.assistant_tokenizer) if to_assistant else
                               (self.assistant_tokenizer, self.tokenizer))
        text = source.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)
        return torch.as_tensor(destination(text, add_special_tokens=True, return_tensors="pt")["input_ids"],
                               dtype=torch.long).to(ids.device)

    def _assistant_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``_prepare_assistant_input_ids``: the assistant's ids for the model's ``input_ids``: its last ones with
        the tokens after the shared run replaced, and the new ones added; or, early on, all of them converted."""
        if self.previous is None or self.target_length <= self.target_lookbehind:
            self.target_length = input_ids.shape[1]
            return self._convert(input_ids, True)
        fresh = self._convert(input_ids[:, self.target_length - self.target_lookbehind:], True)
        ids = self.previous.clone()
        found = _diagonal(ids[:, -fresh.shape[1]:], fresh)
        if found is None:  # nothing in common: the whole window goes on
            return torch.cat([ids, fresh], dim=-1)
        replace, new, replacement = found
        if replace > 0 and replacement.shape[1] > 0:
            if replace > replacement.shape[1]:
                ids = ids[:, :replacement.shape[1] - replace]
            ids[:, -replacement.shape[1]:] = replacement
        return torch.cat([ids, new], dim=-1) if new.shape[1] > 0 else ids

    def _target_ids(self, input_ids: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        """``_process_assistant_outputs``: the model's ids with the drafted ones after them, cut to the maximum
        length."""
        window = self._convert(sequences[:, self.previous.shape[1] - self.assistant_lookbehind:], False)
        found = _diagonal(input_ids[:, -window.shape[1]:], window)
        tail = window if found is None else found[1]
        return torch.cat([input_ids, tail], dim=-1)[:, :self.max_length]


def _lookbehind(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if value is None:
        return 10  # GenerationConfig._get_default_generation_params
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"assistant_model.generation_config: {name}={value!r}: expected a non-negative integer")
    return value


def _diagonal(old: torch.Tensor, new: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """``_get_tokens_diag``: the longest run of ``new`` (1, N) ids that ``old`` (1, P) holds too, the first found
    in row-major order of its start among the equal pairs; None without a common id. Returns how many of ``old``'s
    ids follow the run (to be replaced), ``new``'s ids past those, and ``new``'s that replace them."""
    match = (old == new.T).tolist()  # [i][j]: new[i] == old[j]
    rows, columns = len(match), len(match[0]) if match else 0
    best, seen = None, set()
    for i in range(rows):
        for j in range(columns):
            if not match[i][j] or (i, j) in seen:
                continue
            run, a, b = 1, i + 1, j + 1
            while a < rows and b < columns:
                seen.add((a, b))
                if not match[a][b]:
                    break
                run, a, b = run + 1, a + 1, b + 1
            if best is None or run > best[2]:
                best = (i, j, run)
    if best is None:
        return None
    i, j, run = best
    start, replace = i + run, columns - (j + run)
    return replace, new[:, start + replace:], new[:, start:start + replace]


def speculative_sampling(drafted: torch.Tensor, drafted_scores: torch.Tensor, scores: torch.Tensor,
                         generator: torch.Generator | None, step: int = 1) -> torch.Tensor:
    """``_speculative_sampling`` (generation/utils.py:4457): each candidate is kept with probability min(1, p / q)
    (p the main model's, q the assistant's, from the processed scores) until the first rejection, drawn at once;
    then one token from the main model's distribution after the kept ones, or at a rejection from max(p - q, 0)
    renormalized. ``drafted`` (n,), ``drafted_scores`` (1, n, V), ``scores`` (1, n + 1, V); returns the kept
    candidates and that token (1, k). ``step``: the new token the first candidate would be (named in an error)."""
    n = drafted.shape[0]
    new = drafted[None, :]
    q = drafted_scores.softmax(dim=-1)
    q_i = q[:, torch.arange(n), new].squeeze(0, 1)
    p = scores.softmax(dim=-1)
    p_i = p[:, torch.arange(n), new].squeeze(0, 1)
    ratio = p_i / q_i
    draws = torch.rand(ratio.shape, generator=generator, dtype=ratio.dtype, device=ratio.device)
    kept = ((~(draws < ratio)).cumsum(dim=-1) < 1).sum()
    after = p[:, kept, :]
    if kept < n:
        after = torch.clamp(after - q[:, kept, :], min=0)
        after.div_(after.sum())
    token = draw(after, generator, step + int(kept)).squeeze(1)[None, :]
    return torch.cat((new[:, :kept], token), dim=-1) if kept > 0 else token


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
    prompt = input_ids.shape[1]
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
            kept = speculative_sampling(chosen, drafted_scores, scores, generator, length - prompt + 1)
        else:
            if s.do_sample:
                probs = scores.softmax(dim=-1)
                picked = draw(probs[0, :, :], generator, length - prompt + 1)  # a row per position
                picked = picked.squeeze(1)[None, :]
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
