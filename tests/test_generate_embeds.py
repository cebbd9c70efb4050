"""Prompts given as ``inputs_embeds``, and ``prefix_allowed_tokens_fn``, against transformers 5.25's ``generate``
in the same run: LLaMA, Gemma (its embedding scale, inside its embedding module), GPT-2 (learned positions),
Mistral (a window of 4, shorter than the prompts) and Granite (its embedding multiplier, on given embeddings too),
each with a left-padded batch of 3. Embeddings alone give the new
tokens only, embeddings with ids the ids and the new tokens; greedy, seeded sampling and beam search, the record's
scores, logits, beam fields and cache ``torch.equal``; the lengths, the processors reading the carried ids, prompt
lookup, Phi-3's cache drop, the pipeline; what transformers refuses (or misaligns) is an InputError naming the
field. ``prefix_allowed_tokens_fn``: the calls, the scores, its place among the processors, its refusals."""

from __future__ import annotations

import pytest
import torch

from flodl_hf.core.errors import InputError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.tasks.generate import generate
from flodl_hf.roundtrip.parity import quiet_transformers

from helpers import make_checkpoint, one_thread  # noqa: F401  (the fixture)
from test_decoder import SMALL, _fields, _left_padded
from test_generate_api import _ours, _theirs
from test_generate_defaults import _both
from test_generate_hooks import Recorder, _same_events
from test_generate_pipeline import PROMPTS, model  # noqa: F401  (the fixture)
from test_phi3_longrope import _load, _prompt, _source

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["llama", "gemma", "gpt2", "mistral", "granite"]
FREE = dict(max_new_tokens=6, eos_token_id=[])
RECORD = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


class Embedded:
    """Ours and transformers' model, a left-padded batch (ids and mask, rows of 9, 6 and 3 tokens), ``table``: the
    input embeddings' rows of those ids (transformers' embedding module), and ``embeds``: those of ``other`` ids
    under the same mask."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.ours, self.theirs = _both(make_checkpoint(_fields(SMALL[family]), "causal_lm"))
        vocab = self.ours.config.vocab_size
        self.ids, self.mask = _left_padded(vocab)
        self.other = _left_padded(vocab, seed=1)[0]
        with torch.inference_mode():
            self.table = self.theirs.get_input_embeddings()(self.ids).clone()
            self.embeds = self.theirs.get_input_embeddings()(self.other).clone()

    def same(self, ids=None, mask=None, seed=None, **kwargs):
        """transformers' generate and ours on the same inputs: the ids equal, or the records' every field."""
        reference = _theirs(self.theirs, ids, mask, seed, **kwargs)
        got = _ours(self.ours, ids, mask, seed, **kwargs)
        _same_record(got, reference)
        return got


def _same_record(got, reference) -> None:
    if isinstance(reference, torch.Tensor):
        assert torch.equal(got, reference)
        return
    assert torch.equal(got.sequences, reference.sequences)
    for name in ("scores", "logits", "sequences_scores", "beam_indices"):
        a, b = getattr(got, name, None), getattr(reference, name, None)
        assert (a is None) == (b is None), name
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b), name
        elif b is not None:
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), name
    for i, layer in enumerate(reference.cache.layers):
        assert torch.equal(got.cache.keys[i], layer.keys) and torch.equal(got.cache.values[i], layer.values), i


_LOADED: dict[str, Embedded] = {}


def _embedded(family: str) -> Embedded:
    if family not in _LOADED:
        _LOADED[family] = Embedded(family)
    return _LOADED[family]


@pytest.fixture(scope="module", params=FAMILIES)
def embedded(request):
    return _embedded(request.param)


def test_embeddings_alone_give_the_new_tokens(embedded):
    e = embedded
    got = e.same(None, e.mask, inputs_embeds=e.embeds, **FREE, **RECORD)
    assert got.sequences.shape == (3, 6) and len(got.scores) == 6
    e.same(inputs_embeds=e.embeds, **FREE)  # no mask: all ones (the embeddings give none to infer)
    padded = e.ids.masked_fill(e.mask == 0, 5)  # with ids and no mask, the mask is inferred from the ids' pads
    inferred = e.same(padded, inputs_embeds=e.table, pad_token_id=5, **FREE)
    assert torch.equal(inferred, e.same(padded, e.mask, inputs_embeds=e.table, pad_token_id=5, **FREE))
    sampled = e.same(None, e.mask, seed=5, inputs_embeds=e.embeds, do_sample=True, num_return_sequences=2,
                     top_k=20, temperature=0.8, **FREE, **RECORD)
    assert sampled.sequences.shape == (6, 6)
    beams = e.same(None, e.mask, inputs_embeds=e.embeds, num_beams=3, num_return_sequences=2, pad_token_id=1,
                   **FREE, **RECORD)
    assert beams.sequences.shape == (6, 6)
    e.same(None, e.mask, seed=6, inputs_embeds=e.embeds, num_beams=2, do_sample=True, pad_token_id=1, **FREE)


def test_ids_with_embeddings_give_the_ids_and_the_new_tokens(embedded):
    """The ids are carried, the embeddings feed the first forward. The input embeddings' own rows give the ids'
    continuation (Gemma's scale is inside its embedding module: given embeddings are not scaled again)."""
    e = embedded
    plain = e.same(e.ids, e.mask, **FREE)
    assert torch.equal(e.same(e.ids, e.mask, inputs_embeds=e.table, **FREE), plain)
    got = e.same(e.ids, e.mask, inputs_embeds=e.embeds, **FREE, **RECORD)
    other = e.same(e.other, e.mask, **FREE)  # the embedded ids' continuation, after the ids given
    assert torch.equal(got.sequences, torch.cat([e.ids, other[:, 9:]], dim=1)) and not torch.equal(other, plain)
    assert torch.equal(e.same(None, e.mask, inputs_embeds=e.embeds, **FREE), other[:, 9:])
    e.same(e.ids, e.mask, seed=2, inputs_embeds=e.embeds, do_sample=True, **FREE)


def test_lengths_count_the_embeddings_as_transformers():
    """A total max_length / min_length counts the embeddings when the ids are none or of another length
    (_prepare_generated_length); max_new_tokens / min_new_tokens count new tokens; the cache is always on."""
    e = _embedded("llama")
    assert e.same(None, e.mask, inputs_embeds=e.embeds, max_length=12, eos_token_id=[]).shape == (3, 3)
    with pytest.raises(ValueError, match="max_length"):
        _theirs(e.theirs, None, e.mask, inputs_embeds=e.embeds, max_length=9)
    with pytest.raises(InputError, match="less the 9 positions of inputs_embeds"):
        generate_ids(e.ours, None, e.mask, inputs_embeds=e.embeds, max_length=9)
    # ids of 4 tokens after 9 embedded positions: 17 - 9 - 4 = 4 new tokens; the mask covers the embeddings
    short = e.ids[:, 5:]
    assert e.same(short, e.mask, inputs_embeds=e.embeds, max_length=17, eos_token_id=[]).shape == (3, 8)
    free = e.same(None, e.mask, inputs_embeds=e.embeds, **FREE)
    eos = int(free[0, 1])
    for lengths in (dict(min_length=9 + 4), dict(min_new_tokens=4)):
        got = e.same(None, e.mask, inputs_embeds=e.embeds, max_new_tokens=6, eos_token_id=eos, pad_token_id=0,
                     **lengths)
        assert got[0, 1] != eos, lengths
    e.same(short, e.mask, inputs_embeds=e.embeds, max_new_tokens=6, eos_token_id=eos, pad_token_id=0,
           min_length=9 + 3)
    assert torch.equal(e.same(None, e.mask, inputs_embeds=e.embeds, use_cache=False, **FREE), free)


def test_processors_and_streamer_see_the_carried_ids():
    """With embeddings alone the processors see the new tokens only; the repetition penalty still skips as many
    leading ids as the mask has pads (transformers reads the padding off the mask); the streamer gets the empty
    prompt first."""
    e = _embedded("llama")
    for processor in (dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=1), dict(begin_suppress_tokens=[5]),
                      dict(sequence_bias={(7,): 2.0})):
        e.same(None, e.mask, inputs_embeds=e.embeds, **processor, **FREE, **RECORD)
    theirs, ours = Recorder(), Recorder()
    reference = _theirs(e.theirs, None, e.mask, inputs_embeds=e.embeds, streamer=theirs, **FREE)
    assert torch.equal(_ours(e.ours, None, e.mask, inputs_embeds=e.embeds, streamer=ours, **FREE), reference)
    _same_events(ours, theirs)
    assert ours.puts[0].shape == (3, 0)


def test_refusals_name_the_field():
    """Shapes and dtypes transformers fails on are InputErrors naming the field."""
    e = _embedded("llama")
    cases = [(dict(inputs_embeds=e.embeds[..., :5]), "inputs_embeds"),
             (dict(inputs_embeds=e.embeds[0]), "inputs_embeds"),
             (dict(inputs_embeds=e.embeds[:, :0]), "inputs_embeds"),
             (dict(inputs_embeds=e.embeds.double()), "inputs_embeds is torch.float64"),
             (dict(input_ids=e.ids[:2], inputs_embeds=e.embeds, attention_mask=e.mask), "input_ids"),
             (dict(inputs_embeds=e.embeds, attention_mask=e.mask[:, 1:]), "attention_mask"),
             (dict(input_ids=e.ids[:, 3:], inputs_embeds=e.embeds), "pass an attention_mask")]
    for kwargs, match in cases:
        with pytest.raises(Exception):
            e.theirs.generate(**kwargs, **FREE)
        with pytest.raises(InputError, match=match):
            e.ours.generate(**kwargs, **FREE)
    with pytest.raises(InputError, match="use_cache"):
        generate_ids(e.ours, None, e.mask, inputs_embeds=e.embeds, use_cache="no", **FREE)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_prompt_lookup_with_embeddings_alone(family):
    """Embeddings alone: no ids to look candidates up in at the first step, then the new tokens' own repeats, as
    transformers (plain greedy's tokens). With ids, their candidates at the first step are dropped by transformers'
    first forward (the embeddings alone) while its mask and positions count them: the tokens are not the prompt's
    continuation (GPT-2 shows it), refused."""
    e = _embedded(family)
    row = e.embeds[:1]
    plain = e.same(inputs_embeds=row, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(e.same(inputs_embeds=row, max_new_tokens=12, eos_token_id=[], prompt_lookup_num_tokens=3),
                       plain)
    e.same(inputs_embeds=row, max_new_tokens=12, eos_token_id=[], prompt_lookup_num_tokens=3, **RECORD)
    ids = torch.cat([e.ids[:1, 3:], e.ids[:1, 3:]], dim=1)  # candidates at the first step
    with torch.inference_mode():
        table = e.theirs.get_input_embeddings()(ids)
    lookup = dict(max_new_tokens=6, eos_token_id=[], prompt_lookup_num_tokens=3)
    if family == "gpt2":
        assert not torch.equal(_theirs(e.theirs, ids, inputs_embeds=table, **lookup),
                               _theirs(e.theirs, ids, **lookup))
    with pytest.raises(InputError, match="candidates at the first step"):
        generate_ids(e.ours, ids, inputs_embeds=table, **lookup)
    e.same(e.ids[:1], inputs_embeds=e.embeds[:1], **lookup)  # no repeat in the ids: nothing to drop


def test_phi3_drops_the_cache_and_runs_the_ids_again():
    """Phi-3 at original_max_position_embeddings + 1 tokens drops the cache and runs the ids (not the embeddings)
    again, as transformers; with embeddings alone the cache is past that length by then, and nothing drops."""
    ours, theirs = _load(_source(), "causal_lm")
    ids, mask = _prompt()
    with torch.inference_mode():
        embeds = theirs.get_input_embeddings()(ids) * 1.5
    pair = Embedded.__new__(Embedded)
    pair.ours, pair.theirs = ours, theirs
    settings = dict(max_new_tokens=12, eos_token_id=[], pad_token_id=0, **RECORD)
    pair.same(ids, mask, inputs_embeds=embeds, **settings)
    pair.same(None, mask, inputs_embeds=embeds, **settings)


def _recording(allowed):
    calls = []

    def fn(batch_id, ids):
        calls.append((batch_id, ids.clone()))
        return allowed(batch_id, ids)
    return fn, calls


def _same_prefix(e, allowed, ids=None, mask=None, seed=None, **kwargs):
    """Ours and transformers' generate with a recording prefix_allowed_tokens_fn each: results and calls equal."""
    fn, calls = _recording(allowed)
    reference = _theirs(e.theirs, ids, mask, seed, prefix_allowed_tokens_fn=fn, **kwargs)
    our_fn, our_calls = _recording(allowed)
    got = _ours(e.ours, ids, mask, seed, prefix_allowed_tokens_fn=our_fn, **kwargs)
    _same_record(got, reference)
    assert len(our_calls) == len(calls) > 0
    assert all(a == c and torch.equal(b, d) for (a, b), (c, d) in zip(our_calls, calls))
    return got


def _window(batch_id, ids):
    """Ids 3 to 40, moving with the batch id and the length: a constraint that changes the tokens."""
    return list(range(3 + 5 * batch_id + ids.shape[0], 40 + 5 * batch_id + ids.shape[0]))


def test_prefix_allowed_tokens_in_each_decoding():
    e = _embedded("llama")
    plain = e.same(e.ids, e.mask, **FREE)
    got = _same_prefix(e, _window, e.ids, e.mask, **FREE, **RECORD)
    assert not torch.equal(got.sequences, plain)
    new = got.sequences[:, 9:]
    assert all(3 + 5 * b + 9 + i <= new[b, i] < 40 + 5 * b + 9 + i for b in range(3) for i in range(6))
    _same_prefix(e, _window, e.ids, e.mask, seed=3, do_sample=True, num_return_sequences=2, **FREE, **RECORD)
    _same_prefix(e, _window, e.ids, e.mask, num_beams=2, pad_token_id=1, **FREE, **RECORD)
    _same_prefix(e, _window, None, e.mask, inputs_embeds=e.embeds, num_beams=2, pad_token_id=1, **FREE, **RECORD)
    _same_prefix(e, _window, e.ids[:1], max_new_tokens=6, eos_token_id=[], prompt_lookup_num_tokens=2)
    # a custom PrefixConstrainedLogitsProcessor takes its place (_merge_criteria_processor_list)
    custom = quiet_transformers().PrefixConstrainedLogitsProcessor(lambda b, ids: [7, 8], 1)
    e.same(e.ids, e.mask, prefix_allowed_tokens_fn=_window, logits_processor=[custom], **FREE)


def test_prefix_constraint_holds_where_the_scores_are_minus_infinity():
    """Only the eos allowed while min_new_tokens bans it: every allowed score -inf, so the mask is taken (the eos at
    0). After the minimum length processors and before the forced eos: the forced eos wins at the last step."""
    e = _embedded("llama")
    free = e.same(e.ids, e.mask, **FREE)
    eos = int(free[0, 9])
    got = _same_prefix(e, lambda b, ids: [eos], e.ids, e.mask, max_new_tokens=4, eos_token_id=eos, pad_token_id=0,
                       min_new_tokens=3, **RECORD)
    assert (got.sequences[:, 9] == eos).all()
    forced = _same_prefix(e, _window, e.ids, e.mask, max_new_tokens=4, eos_token_id=[], forced_eos_token_id=2)
    assert (forced[:, -1] == 2).all()


def test_prefix_refusals():
    e = _embedded("llama")
    with pytest.raises(ValueError, match="empty list"):
        _theirs(e.theirs, e.ids, e.mask, prefix_allowed_tokens_fn=lambda b, ids: [], **FREE)
    with pytest.raises(InputError, match="no token for batch id 0"):
        generate_ids(e.ours, e.ids, e.mask, prefix_allowed_tokens_fn=lambda b, ids: [], **FREE)
    with pytest.raises(IndexError):
        _theirs(e.theirs, e.ids, e.mask, prefix_allowed_tokens_fn=lambda b, ids: [10 ** 6], **FREE)
    with pytest.raises(InputError, match="token ids below"):
        generate_ids(e.ours, e.ids, e.mask, prefix_allowed_tokens_fn=lambda b, ids: [10 ** 6], **FREE)
    with pytest.raises(InputError, match="prefix_allowed_tokens_fn=.*callable"):
        generate_ids(e.ours, e.ids, e.mask, prefix_allowed_tokens_fn=[3, 4], **FREE)


def test_generate_hands_them_to_each_prompt_as_the_pipeline(model):
    root, pipe = model
    tok = pipe.tokenizer
    for prompts in (PROMPTS[0], PROMPTS):
        options = dict(do_sample=False, max_new_tokens=4, prefix_allowed_tokens_fn=lambda b, ids: list(range(3, 300)))
        assert generate(prompts, root, **options) == pipe(prompts, **options)
    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        embeds = pipe.model.get_input_embeddings()(ids.flip(1))  # the prompt's tokens reversed
    options = dict(do_sample=False, max_new_tokens=4, inputs_embeds=embeds)
    assert generate(PROMPTS[0], root, **options) == pipe(PROMPTS[0], **options)
    assert generate(PROMPTS[0], root, return_tensors=True, **options) != \
        generate(PROMPTS[0], root, return_tensors=True, do_sample=False, max_new_tokens=4)
