"""Text generation in one line: ``generate(prompts, model, ...)``, equal to transformers 5.24's text-generation
pipeline: its defaults where neither the call nor the file sets one (256 new tokens, sampling at temperature
0.7), its shapes (a list of records per prompt) and keys (``generated_text``, ``generated_token_ids``), with
greedy prompts batched by left padding and sampled ones run one at a time in the pipeline's RNG order. Prompts may
be texts or chats; the decoding underneath is ``flodl_hf.generation.generate.generate_ids``, the command
``flodl_hf.commands.generate``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.generation.settings import (DEFAULT_NEW_TOKENS, _generation_config_dict, _is_int, generation_settings,
                                          model_generation_config)
from flodl_hf.tasks.runtime import Source, load


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
