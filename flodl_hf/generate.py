"""Text generation with a decoder and its KV cache: greedy or sampled, batched with left padding.

``generate_ids`` mirrors transformers 5.24's ``GenerationMixin._sample`` step for step, so greedy ids are
those of ``model.generate`` with the same settings, and so are sampled ids where the RNG use matches:
- the prompt runs once with ``logits_to_keep=1`` (the prefill), positions ``cumsum(mask) - 1`` (0 on pads);
- every later step feeds the last token alone, its position, the mask grown by one, and the cache;
- the next-token scores are the last logits copied to float32, then temperature (``/ t``, when t != 1),
  top-k, top-p, in that order (``_get_logits_processor``), as the logits warpers compute them;
- greedy takes ``argmax``; sampling ``torch.multinomial(softmax(scores), 1)`` drawn from a generator seeded
  with ``seed``: transformers draws from torch's global generator, so seeding it with the same number
  (``torch.manual_seed(seed)``) before ``generate`` gives the same draws;
- a row that produced eos gets the pad id from then on; generation stops when every row has, or after
  ``max_new_tokens``.
``generate(prompts, model, ...)`` is the one-liner over texts: it tokenizes with left padding and decodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from .errors import InputError

Source = str | Path | torch.nn.Module


def _eos_list(eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


def next_token_scores(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None) -> torch.Tensor:
    """The sampling warpers in transformers' order (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)."""
    scores = logits
    if temperature is not None and temperature != 1.0:
        scores = scores / temperature
    if top_k is not None and top_k != 0:
        k = min(max(int(top_k), 1), scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = 0
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return scores


def _check(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens!r}: expected a positive integer")
    if not temperature or temperature <= 0:
        raise InputError(f"temperature={temperature!r}: expected a positive number")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise InputError(f"top_k={top_k!r}: expected a non-negative integer or None")
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise InputError(f"top_p={top_p!r}: expected a number in [0, 1] or None")


@torch.inference_mode()
def generate_ids(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None) -> torch.Tensor:
    """Prompt ids (B, S), left-padded, -> (B, S + n) ids: the prompts and up to ``max_new_tokens`` new tokens
    each, as transformers' ``generate`` returns them. ``eos_token_id`` None: the config's (transformers'
    default); ``pad_token_id`` None: the config's, else the first eos."""
    _check(max_new_tokens, temperature, top_k, top_p)
    if getattr(model, "task", None) != "causal_lm":
        raise InputError(f"generate needs a causal_lm model, not {type(model).__name__}")
    config = model.config
    eos = _eos_list(config.eos_token_id if eos_token_id is None else eos_token_id)
    pad = pad_token_id if pad_token_id is not None else config.pad_token_id
    if pad is None and eos:
        pad = eos[0]  # transformers: "Setting pad_token_id to eos_token_id"
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    device = model.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    generator = None
    if do_sample:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else torch.seed())
    # GenerationMixin._prepare_position_ids_for_generation
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    max_length = input_ids.shape[1] + max_new_tokens
    eos_tensor = torch.tensor(eos, device=device, dtype=torch.long) if eos else None
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=device)
    cache = model.backbone.new_cache()
    step_ids, step_pos = input_ids.clone(), position_ids
    while True:
        out = model(input_ids=step_ids, attention_mask=attention_mask, position_ids=step_pos,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        # _update_model_kwargs_for_generation: positions and mask grow by one
        position_ids = torch.cat([position_ids, position_ids[..., -1:] + 1], dim=-1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        if do_sample:
            scores = next_token_scores(logits, temperature, top_k, top_p)
            probs = torch.nn.functional.softmax(scores, dim=-1)
            next_tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
        else:
            next_tokens = torch.argmax(logits, dim=-1)
        if eos_tensor is not None:
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        done = input_ids.shape[-1] >= max_length
        if eos_tensor is not None:
            unfinished = unfinished & ~torch.isin(input_ids[:, -1], eos_tensor).long()
        if done or unfinished.max() == 0:
            return input_ids
        step_ids, step_pos = input_ids[:, -1:].clone(), position_ids[..., -1:].clone()


def generate(prompts: str | Sequence[str], model: Source, max_new_tokens: int = 20, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
             tokenizer: Any = None) -> list[dict[str, Any]]:
    """Continue each prompt: ``[{"generated_text", "token_ids"}]`` per prompt (the prompt's text plus the new
    text, as transformers' text-generation pipeline writes it, and the new ids). Prompts are batched with
    left padding; see ``generate_ids`` for the decoding rule."""
    from .tasks.runtime import load
    single = isinstance(prompts, str)
    texts = [prompts] if single else list(prompts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InputError("prompts: expected a string or a list of strings")
    loaded = load(model, "causal_lm", tokenizer)
    tok, config = loaded.tokenizer, loaded.model.config
    # Left padding by hand: LLaMA tokenizers often have no pad token. Padded positions are masked out of
    # every real token's attention, so the pad id (the tokenizer's, the config's, an eos) changes no result.
    eos = _eos_list(config.eos_token_id)
    pad = next((p for p in (tok.pad_token_id, config.pad_token_id, *eos) if p is not None), 0)
    rows = tok(texts, return_tensors=None, return_attention_mask=True)["input_ids"]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    ids = generate_ids(loaded.model, input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k,
                       top_p, seed, eos_token_id, config.pad_token_id if config.pad_token_id is not None else pad)
    results = []
    for row, text in zip(ids, texts):
        new = row[width:].tolist()
        stop = _eos_list(loaded.model.config.eos_token_id if eos_token_id is None else eos_token_id)
        if stop and any(t in stop for t in new):  # drop what follows the first eos (the pad fill)
            new = new[: next(i for i, t in enumerate(new) if t in stop) + 1]
        results.append({"generated_text": text + tok.decode(new, skip_special_tokens=True), "token_ids": new})
    return results
