"""Beam search: transformers' ``GenerationMixin._beam_search`` and its helpers, step for step, on the model's
``_Decoder`` (beam sampling with ``do_sample``)."""

from __future__ import annotations

import torch

from flodl_hf.generation.decoding import _Decoder, _Seen, draw
from flodl_hf.generation.processors import apply, stop_hits
from flodl_hf.generation.settings import GenerateBeamDecoderOnlyOutput, GenerationSettings


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
            top_indices = draw(torch.nn.functional.softmax(log_probs, dim=-1), generator,
                               f"beam step {cur_len - prompt_length + 1}", keep)
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
