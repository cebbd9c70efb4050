"""Prompt lookup (``prompt_lookup_num_tokens``): transformers' ``PromptLookupCandidateGenerator``, the ids that
followed an earlier occurrence of the sequence's last n-gram, as candidates for assisted decoding
(``flodl_hf.generation.assisted._assisted``)."""

from __future__ import annotations

import torch

from flodl_hf.generation.processors import apply
from flodl_hf.generation.settings import GenerationSettings


def _lookup_candidates(input_ids: torch.Tensor, settings: GenerationSettings, processors: list, max_length: int,
                       vocab_size: int, positions: int | None = None) -> torch.Tensor:
    """PromptLookupCandidateGenerator.get_candidates (generation/candidate_generator.py): the ids that followed an
    earlier occurrence of the sequence's last n-gram (the longest n up to ``max_matching_ngram_size`` that occurs,
    its first occurrence, left to right, with a continuation), at most ``prompt_lookup_num_tokens``; cut before the
    first one the processors ban (each checked on scores of ones after the sequence and the candidates before it,
    a ban being -inf or the dtype's min), a match left with none looking further; cut before the first eos id. None
    at one token short of the maximum length (the model's next token fills it). Returns them 1-D, maybe empty.
    Candidates can run past ``max_length - 1`` there; with ``positions`` (a position table's size: GPT-2's, OPT's)
    they stop where the forward would run past the table (transformers' fails there with an IndexError)."""
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
            if positions is not None:
                end = min(end, start + positions - length)
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

    def __init__(self, settings: GenerationSettings, processors: list, max_length: int, vocab_size: int,
                 positions: int | None = None) -> None:
        self.settings, self.processors, self.max_length, self.vocab_size = settings, processors, max_length, vocab_size
        self.positions = positions  # the position table's size (None: no table)

    def candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _lookup_candidates(input_ids, self.settings, self.processors, self.max_length, self.vocab_size,
                                  self.positions), None

    def update(self, scores: torch.Tensor, matches: int) -> None:
        pass

    def finish(self) -> None:
        pass
