"""Prompt lookup decoding (``prompt_lookup_num_tokens``: transformers' assisted generate with
``PromptLookupCandidateGenerator``) against transformers 5.25 in the same run, on prompts that repeat themselves (a
random prompt, the model's greedy continuation of it, the prompt again), so that candidates are found, some kept
and some rejected: the ids equal transformers' and plain greedy's, and so does every forward's length (each one's
candidates), with fewer forwards than new tokens; scores, logits and the cropped cache; sampling; the logits
processors on the candidates; eos, the maximum length, streamers and custom hooks; transformers' refusals."""

from __future__ import annotations

import warnings

import pytest
import torch

from flodl_hf.core.errors import InputError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.tasks.generate import generate

from helpers import make_checkpoint, one_thread  # noqa: F401  (the fixture)
from test_decoder import SMALL, _fields
from test_generate_api import _ours, _same, _theirs
from test_generate_defaults import _both
from test_generate_hooks import Calls, Recorder, _same_calls, _same_events, boost, no_immediate_repeat
from test_generate_pipeline import PROMPTS, model  # noqa: F401  (the fixture)
from test_phi3_longrope import OLD, _load, _prompt, _source
from test_phi3_longrope import _fields as _phi3_fields

pytestmark = pytest.mark.usefixtures("one_thread")

# LLaMA and GPT-2, and Mistral with a window of 4, whose sliding layers are cropped past their window
FAMILIES = ["llama", "gpt2", "mistral"]


class Forwards:
    """The length of each forward of a backbone (a forward hook): the prompt and the candidates, then per step
    the candidates and the token before them."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        self.lengths: list[int] = []
        backbone.register_forward_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs, out) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]  # GPT-2's passes them by position
        self.lengths.append(ids.shape[1])

    def run(self, call):
        self.lengths = []
        result = call()
        return result, list(self.lengths)


class Lookup:
    """Our model and transformers', each backbone's forwards counted, and a prompt that repeats itself."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.ours, self.theirs = _both(make_checkpoint(_fields(SMALL[family]), "causal_lm"))
        self.pair = (self.ours, self.theirs)
        self.our_forwards, self.their_forwards = Forwards(self.ours.backbone), Forwards(self.theirs.base_model)
        start = torch.randint(3, self.ours.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
        continued = generate_ids(self.ours, start, max_new_tokens=12, eos_token_id=[])
        self.ids = torch.cat([continued, start], dim=1)

    def same(self, ids=None, seed=None, **kwargs):
        """Ours and transformers' generate: the result (ids, or the record) and each forward's length equal."""
        ids = self.ids if ids is None else ids
        reference, their_lengths = self.their_forwards.run(lambda: _theirs(self.theirs, ids, None, seed, **kwargs))
        got, lengths = self.our_forwards.run(lambda: _ours(self.ours, ids, None, seed, **kwargs))
        sequences = got if isinstance(got, torch.Tensor) else got.sequences
        assert torch.equal(sequences, reference if isinstance(reference, torch.Tensor) else reference.sequences), \
            kwargs
        assert lengths == their_lengths, kwargs
        return got, reference, lengths


@pytest.fixture(scope="module", params=FAMILIES)
def lookup(request):
    return Lookup(request.param)


@pytest.fixture(scope="module")
def llama():
    return Lookup("llama")


def _drafted(prompt_length: int, lengths: list[int]) -> int:
    """The candidates run: the prefill's tokens past the prompt, then each step's tokens but the one before them."""
    return lengths[0] - prompt_length + sum(n - 1 for n in lengths[1:])


@pytest.mark.parametrize("tokens,new", [(3, 16), (5, 16), (5, 9)])
def test_greedy_lookup_equals_transformers_and_plain_greedy(lookup, tokens, new):
    """The ids of transformers' prompt lookup, which are those of its plain greedy here, and so ours: in fewer
    forwards than new tokens (candidates kept), with candidates rejected too, each forward as long as transformers'
    (9 new tokens: the last step's kept candidates are cut to the maximum length)."""
    settings = dict(max_new_tokens=new, eos_token_id=[])
    got, reference, lengths = lookup.same(prompt_lookup_num_tokens=tokens, **settings)
    greedy = _same(lookup.pair, lookup.ids, **settings)
    assert torch.equal(reference, greedy) and torch.equal(got, greedy)
    produced = got.shape[1] - lookup.ids.shape[1]
    assert produced == new
    assert len(lengths) < produced  # candidates kept: fewer forwards than tokens
    assert _drafted(lookup.ids.shape[1], lengths) > produced - len(lengths)  # and some rejected


def test_scores_logits_and_the_cropped_cache_equal_transformers(lookup):
    """With return_dict_in_generate: one processed score and one raw logit row per kept token, equal to
    transformers', and the returned cache holds every token but the last, as transformers' after its crops."""
    got, reference, _ = lookup.same(prompt_lookup_num_tokens=4, max_new_tokens=14, eos_token_id=[],
                                    return_dict_in_generate=True, output_scores=True, output_logits=True,
                                    repetition_penalty=1.2)
    assert len(got.scores) == len(reference.scores) == len(got.logits) == len(reference.logits) == 14
    assert all(torch.equal(a, b) for a, b in zip(got.scores, reference.scores))
    assert all(torch.equal(a, b) for a, b in zip(got.logits, reference.logits))
    assert not all(torch.equal(a, b) for a, b in zip(got.scores, got.logits))  # the penalty changed the scores
    assert got.cache.get_seq_length() == reference.cache.get_seq_length() == got.sequences.shape[1] - 1
    for layer, keys in enumerate(got.cache.keys):
        assert torch.equal(keys, reference.cache.layers[layer].keys), layer


@pytest.mark.parametrize("settings", [dict(temperature=0.3), dict(top_k=5, top_p=0.9)], ids=["cold", "top-k-p"])
def test_sampled_lookup_draws_as_transformers(lookup, settings):
    """Sampling: one multinomial draw per position of the step (the candidates' and the next), from torch's global
    generator after the same seed, or with seed= from a generator of its own (the same stream)."""
    kwargs = dict(prompt_lookup_num_tokens=3, max_new_tokens=14, eos_token_id=[], do_sample=True, **settings)
    got, _, lengths = lookup.same(seed=4, **kwargs)
    assert torch.equal(generate_ids(lookup.ours, lookup.ids, seed=4, **kwargs), got)
    if lookup.family == "llama":
        assert len(lengths) < got.shape[1] - lookup.ids.shape[1]  # candidates kept while sampling


@pytest.mark.parametrize("processor", [dict(no_repeat_ngram_size=3), dict(suppress_tokens="repeated"),
                                       dict(repetition_penalty=1.5), dict(min_new_tokens=6, eos_token_id="repeated")],
                         ids=["ngram", "suppress", "penalty", "min-new-tokens"])
def test_processors_run_on_each_position_and_ban_candidates(llama, processor):
    """The processors run on every position of the step (the ids up to it), and ban candidates: a candidate whose
    score the processors set to -inf on scores of ones is cut, with those after it."""
    repeated = int(llama.ids[0, 7])
    processor = {k: [repeated] if v == "repeated" else v for k, v in processor.items()}
    settings = {"max_new_tokens": 12, "eos_token_id": [], **processor}
    got, _, lengths = llama.same(prompt_lookup_num_tokens=4, **settings)
    assert torch.equal(got, _same(llama.pair, llama.ids, **settings))
    plain = llama.our_forwards.run(lambda: generate_ids(llama.ours, llama.ids, prompt_lookup_num_tokens=4,
                                                        max_new_tokens=12, eos_token_id=[]))[1]
    assert lengths != plain  # the processors changed what was drafted or kept


def test_a_left_padded_prompt(lookup):
    """One prompt with left padding: the positions count the real tokens, the penalty skips the pads, as there."""
    ids = torch.cat([torch.full((1, 3), 5), lookup.ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(lookup.ids)], dim=1)
    _same(lookup.pair, ids, mask, max_new_tokens=12, eos_token_id=[], prompt_lookup_num_tokens=3,
          repetition_penalty=1.1)


def test_max_matching_ngram_size(llama):
    """0 (or unset) looks up 2-grams, as transformers reads it; 1 and 3 are looked up as given."""
    for size in (0, 1, 3):
        llama.same(prompt_lookup_num_tokens=3, max_matching_ngram_size=size, max_new_tokens=10, eos_token_id=[])


def test_an_eos_in_the_candidates_and_the_kept_tokens_stops_as_transformers(lookup):
    """An eos id among the prompt's candidates cuts them before it; one kept stops the sequence there."""
    free = generate_ids(lookup.ours, lookup.ids, max_new_tokens=16, eos_token_id=[])[0, lookup.ids.shape[1]:]
    for eos in {int(free[3]), int(free[-1]), int(lookup.ids[0, 8])}:
        got, _, _ = lookup.same(prompt_lookup_num_tokens=4, max_new_tokens=16, eos_token_id=eos)
        assert torch.equal(got, _same(lookup.pair, lookup.ids, max_new_tokens=16, eos_token_id=eos))


def test_streamer_and_custom_hooks_see_what_transformers_shows_them(llama):
    """The streamer gets the prompt, then each step's kept ids (1, k), then end(); a custom processor is called on
    the candidates' scores of ones and on each position; a custom criterion once per step."""
    theirs_streamer, ours_streamer = Recorder(), Recorder()
    their_hooks = [Calls(boost(int(llama.ids[0, 9]), 2.0)), Calls(no_immediate_repeat)]
    our_hooks = [Calls(boost(int(llama.ids[0, 9]), 2.0)), Calls(no_immediate_repeat)]
    their_stop, our_stop = Calls(lambda ids, scores: ids[:, -1] == -1), Calls(lambda ids, scores: ids[:, -1] == -1)
    settings = dict(prompt_lookup_num_tokens=4, max_new_tokens=12, eos_token_id=[])
    reference = _theirs(llama.theirs, llama.ids, streamer=theirs_streamer, logits_processor=their_hooks,
                        stopping_criteria=[their_stop], **settings)
    got = _ours(llama.ours, llama.ids, streamer=ours_streamer, logits_processor=our_hooks,
                stopping_criteria=[our_stop], **settings)
    assert torch.equal(got, reference)
    _same_events(ours_streamer, theirs_streamer)
    assert any(put.shape[-1] > 1 for put in ours_streamer.puts[1:])  # a step kept several tokens
    for a, b in zip(our_hooks + [our_stop], their_hooks + [their_stop]):
        _same_calls(a, b)


def test_refusals_as_transformers(llama):
    """What transformers refuses is an InputError naming the setting; with beams transformers ignores prompt lookup
    (and warns), and so do we."""
    ids = llama.ids
    cases = [(dict(input_ids=ids.repeat(2, 1)), "prompt_lookup_num_tokens=3", ValueError),
             (dict(use_cache=False), "use_cache", RuntimeError),
             (dict(do_sample=True, num_return_sequences=2), "num_return_sequences", ValueError),
             (dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens=0", ValueError),
             (dict(prompt_lookup_num_tokens=2.5), "prompt_lookup_num_tokens=2.5", TypeError),
             (dict(max_matching_ngram_size=-1), "max_matching_ngram_size=-1", ValueError)]
    for kwargs, name, theirs_raise in cases:
        settings = {"input_ids": ids, "prompt_lookup_num_tokens": 3, "max_new_tokens": 5, **kwargs}
        with pytest.raises(theirs_raise), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llama.theirs.generate(**settings)
        with pytest.raises(InputError, match=name):
            llama.ours.generate(**settings)
    beams = dict(num_beams=2, max_new_tokens=6, eos_token_id=[], pad_token_id=1)
    got, _, _ = llama.same(prompt_lookup_num_tokens=3, **beams)
    assert torch.equal(got, generate_ids(llama.ours, ids, **beams))


def test_phi3_drops_its_cache_mid_lookup_as_transformers():
    """Phi-3 at original_max_position_embeddings + 1 tokens: transformers drops the cache and runs the whole
    candidate sequence into a new one, as we do (ids, logits and forwards equal); with a sliding layer past its
    window, that new cache cannot be cropped: transformers raises, and we refuse."""
    settings = dict(max_new_tokens=12, eos_token_id=[], pad_token_id=0, prompt_lookup_num_tokens=3,
                    return_dict_in_generate=True, output_logits=True)
    windowed = {**_phi3_fields("phi3-hd24-partial-window4"), "original_max_position_embeddings": OLD}
    for source, dropped in ((_source(), True), (make_checkpoint(windowed, "causal_lm"), False)):
        ours, theirs = _load(source, "causal_lm", "sdpa")
        start = _prompt()[0][1:, -3:]
        ids = torch.cat([generate_ids(ours, start, max_new_tokens=2, eos_token_id=[]), start], dim=1)
        assert ids.shape[1] == OLD  # the sequence reaches OLD + 1 tokens in the second forward
        our_forwards, their_forwards = Forwards(ours.backbone), Forwards(theirs.base_model)
        if not dropped:
            with pytest.raises(RuntimeError, match="crop"):
                _theirs(theirs, ids, **settings)
            with pytest.raises(InputError, match="dropped its KV cache"):
                _ours(ours, ids, **settings)
            continue
        reference, their_lengths = their_forwards.run(lambda: _theirs(theirs, ids, **settings))
        got, lengths = our_forwards.run(lambda: _ours(ours, ids, **settings))
        assert torch.equal(got.sequences, reference.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.logits, reference.logits))
        assert lengths == their_lengths and lengths[1] == OLD + 1  # the whole sequence again, once


def test_generate_runs_lookup_prompt_by_prompt_as_the_pipeline(model):
    """generate() over a list of prompts runs prompt lookup one prompt at a time, as the pipeline does."""
    root, pipe = model
    settings = dict(do_sample=False, max_new_tokens=8, prompt_lookup_num_tokens=3, return_tensors=True)
    assert generate(PROMPTS, root, **settings) == pipe(PROMPTS, **settings)


def test_hidden_states_and_attentions_per_kept_token(llama):
    """``output_hidden_states`` / ``output_attentions`` (eager) with prompt lookup: each forward's records split per
    kept token as transformers' ``_split_model_outputs`` splits them (the prompt's block first, attention keys up to
    each token), every tensor equal."""
    from test_generate_assisted import _same_records
    ours, theirs = _both(make_checkpoint(_fields(SMALL["llama"]), "causal_lm"), "eager")
    kwargs = dict(prompt_lookup_num_tokens=3, max_new_tokens=10, eos_token_id=[], return_dict_in_generate=True,
                  output_hidden_states=True, output_attentions=True)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = theirs.generate(input_ids=llama.ids, **kwargs)
    got = generate_ids(ours, llama.ids, **kwargs)
    assert torch.equal(got.sequences, reference.sequences)
    for field in ("hidden_states", "attentions"):
        _same_records(got, reference, field)
