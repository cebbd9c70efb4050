"""``generate``'s hooks, each against transformers 5.25's ``generate`` in the same run, the same hook objects (or
fresh ones of the same kind) handed to both: a ``streamer`` (every ``put`` tensor ``torch.equal``, ``end`` once;
transformers' TextStreamer and TextIteratorStreamer give the same text), custom ``logits_processor`` and
``stopping_criteria`` (LogitsProcessorList / StoppingCriteriaList or plain lists of callables) in greedy
decoding, sampling and beam search: ids and processed scores ``torch.equal``, the processors and criteria called
with the same arguments; a custom one of a built-in's class takes its place (``_merge_criteria_processor_list``);
what transformers refuses or cannot do is an InputError."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from flodl_hf.core.errors import InputError
from flodl_hf.roundtrip.parity import quiet_transformers

from helpers import one_thread  # noqa: F401  (the fixture)
from test_decoder import _left_padded
from test_generate_api import LLAMA, _ours, _same, _theirs, pair  # noqa: F401  (the fixture)
from test_generate_defaults import _both, _copy
from test_generate_pipeline import PROMPTS, model  # noqa: F401  (the fixture)
from test_generate_processors import FREE, _free, _same_scores

pytestmark = pytest.mark.usefixtures("one_thread")

T = quiet_transformers()
NEG = -float("inf")


class Recorder(T.generation.streamers.BaseStreamer):
    """A streamer that keeps what it is handed, in order: each put() value, and "end" for each end()."""

    def __init__(self):
        self.events = []

    def put(self, value):
        self.events.append(value)

    def end(self):
        self.events.append("end")

    @property
    def puts(self):
        return [e for e in self.events if not isinstance(e, str)]

    @property
    def ends(self):
        return sum(isinstance(e, str) for e in self.events)


def _same_events(ours: Recorder, theirs: Recorder):
    assert len(ours.events) == len(theirs.events)
    for a, b in zip(ours.events, theirs.events):
        assert isinstance(a, str) == isinstance(b, str)
        assert isinstance(a, str) or (a.device.type == "cpu" and a.dtype == b.dtype and torch.equal(a, b))


def _streamed(pair, ids, mask=None, seed=None, **kwargs):
    """Ours and transformers' generate with a Recorder each: the ids and every put() equal, end() once."""
    theirs, ours = Recorder(), Recorder()
    reference = _theirs(pair[1], ids, mask, seed, streamer=theirs, **kwargs)
    got = _ours(pair[0], ids, mask, seed, streamer=ours, **kwargs)
    assert torch.equal(got, reference), kwargs
    _same_events(ours, theirs)
    assert ours.events[-1] == "end" and ours.ends == 1 and len(ours.puts) == 1 + got.shape[1] - ids.shape[1]
    return ours


def test_a_streamer_gets_the_prompt_then_each_step_then_end(pair):
    ids, mask, new = _free(pair)
    puts = _streamed(pair, ids, mask, **FREE).puts
    assert torch.equal(puts[0], ids) and all(p.shape == (ids.shape[0],) for p in puts[1:])
    assert torch.equal(torch.stack(puts[1:], dim=1), new)
    # an eos ends row 0 early (its later puts carry the pad id), then every row (fewer steps)
    eos = int(new[0, 1])
    _streamed(pair, ids, mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    short = _streamed(pair, ids[:1], mask[:1], max_new_tokens=6, eos_token_id=eos)
    assert len(short.puts) == 2 + int((new[0] == eos).nonzero()[0, 0]) < 7  # the prompt, up to the eos
    # sampling, several sequences per prompt: the prompt as repeated, one id per sequence each step
    sampled = _streamed(pair, ids, mask, seed=3, do_sample=True, num_return_sequences=2, **FREE)
    assert sampled.puts[0].shape == (2 * ids.shape[0], ids.shape[1])
    _streamed(pair, ids, mask, use_cache=False, **FREE)


def test_streamer_refusals_as_transformers(pair):
    ids, mask = _left_padded(pair[0].config.vocab_size)
    with pytest.raises(ValueError, match="beam search"):
        _theirs(pair[1], ids, mask, streamer=Recorder(), num_beams=2, max_new_tokens=3)
    with pytest.raises(InputError, match="cannot be used with beam search"):
        _ours(pair[0], ids, mask, streamer=Recorder(), num_beams=2, max_new_tokens=3)
    # beam sampling: transformers hands the streamer the prompt and nothing more, never end(): refused here
    theirs = Recorder()
    _theirs(pair[1], ids, mask, seed=1, streamer=theirs, num_beams=2, do_sample=True, max_new_tokens=3)
    assert len(theirs.puts) == 1 and theirs.ends == 0
    with pytest.raises(InputError, match="beam sampling hands the streamer the prompt"):
        _ours(pair[0], ids, mask, streamer=Recorder(), num_beams=2, do_sample=True, max_new_tokens=3)
    with pytest.raises(InputError, match=r"put\(value\) and end\(\)"):
        _ours(pair[0], ids, mask, streamer=print, max_new_tokens=3)
    # a prompt as long as max_length: both hand the streamer the prompt, then raise
    theirs, ours = Recorder(), Recorder()
    with pytest.raises(ValueError, match="max_length"):
        _theirs(pair[1], ids, mask, streamer=theirs, max_length=ids.shape[1])
    with pytest.raises(InputError, match="max_length"):
        _ours(pair[0], ids, mask, streamer=ours, max_length=ids.shape[1])
    assert len(ours.puts) == len(theirs.puts) == 1 and torch.equal(ours.puts[0], theirs.puts[0])


def test_text_streamers_print_transformers_text(model, capsys):
    """TextStreamer (printed, with and without the prompt) and TextIteratorStreamer (read in another thread, as
    its documentation runs it) on ours give transformers' text; one prompt, as TextStreamer takes (a batch is its
    ValueError, on ours too)."""
    root, pipe = model
    tok = pipe.tokenizer
    ours, theirs = _both(root)
    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    settings = dict(max_new_tokens=8, do_sample=False)
    for skip_prompt in (False, True):
        texts = []
        for lm in (theirs, ours):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lm.generate(input_ids=ids, streamer=T.TextStreamer(tok, skip_prompt=skip_prompt), **settings)
            texts.append(capsys.readouterr().out)
        assert texts[0] == texts[1] and len(texts[0]) > (0 if skip_prompt else len(PROMPTS[0])), texts
    texts = []
    for lm in (theirs, ours):
        streamer = T.TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
        worker = threading.Thread(target=lm.generate, kwargs=dict(input_ids=ids, streamer=streamer, **settings))
        worker.start()
        texts.append(list(streamer))
        worker.join()
    assert texts[0] == texts[1] and "".join(texts[0]).strip()
    batch = tok(PROMPTS[:2], return_tensors="pt", padding=True)  # TextStreamer's own restriction, at the prompt
    for lm in (theirs, ours):
        with pytest.raises(ValueError, match="only supports batch size 1"):
            lm.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        streamer=T.TextStreamer(tok), **settings)


class BanToken(T.LogitsProcessor):
    """A LogitsProcessor that bans one id."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.token] = NEG
        return scores


def no_immediate_repeat(input_ids, scores):
    """A plain function reading the ids: the last id may not come again."""
    return scores.scatter(1, input_ids[:, -1:], NEG)


def boost(token: int, by: float):
    """Adds ``by`` to one id's score: its effect depends on what runs before and after it."""
    def processor(input_ids, scores):
        out = scores.clone()
        out[:, token] += by
        return out
    return processor


class Calls:
    """Wraps a processor or a criterion and records the arguments of each call."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, input_ids, scores):
        self.seen.append((input_ids.clone(), None if scores is None else
                          scores.clone() if isinstance(scores, torch.Tensor) else len(scores)))
        return self.inner(input_ids, scores)


def _same_calls(a: Calls, b: Calls):
    assert len(a.seen) == len(b.seen) > 0
    for (ids_a, s_a), (ids_b, s_b) in zip(a.seen, b.seen):
        assert torch.equal(ids_a, ids_b)
        assert s_a == s_b if not isinstance(s_a, torch.Tensor) else torch.equal(s_a, s_b)


# beams fill with `pad_token_id or eos_token_id[0]`: without an eos, a pad id other than 0 (transformers fails)
MODES = {"greedy": {}, "sampled": dict(seed=5, do_sample=True, temperature=0.7, top_k=30),
         "beams": dict(num_beams=3, pad_token_id=1),
         "beam sampling": dict(seed=2, num_beams=2, do_sample=True, top_k=20, pad_token_id=1)}


@pytest.mark.parametrize("mode", list(MODES))
def test_custom_logits_processors_equal_transformers(pair, mode):
    """A LogitsProcessor class and a plain function reading the ids, as a LogitsProcessorList and as a plain list,
    over the built-in processors (a repetition penalty, a suppressed id) and, when sampling, before the warpers:
    the ids and the processed scores equal transformers', and the processors saw the same ids and scores."""
    ids, mask, new = _free(pair)
    kwargs = dict(MODES[mode])
    seed = kwargs.pop("seed", None)
    base = dict(FREE, repetition_penalty=1.3, suppress_tokens=[int(new[1, 0])], **kwargs)
    plain = _same_scores(pair, ids, mask, seed, **base)
    hooks = [BanToken(int(new[0, 1])), no_immediate_repeat, boost(int(new[2, 3]), 2.5)]
    got = _same_scores(pair, ids, mask, seed, logits_processor=T.LogitsProcessorList(hooks), **base)
    assert not torch.equal(got.scores[1], plain.scores[1])
    _same_scores(pair, ids, mask, seed, logits_processor=hooks[::-1], **base)
    if mode in ("beams", "beam sampling"):
        reference = _theirs(pair[1], ids, mask, seed, logits_processor=hooks, return_dict_in_generate=True,
                            output_scores=True, **base)
        assert torch.equal(_ours(pair[0], ids, mask, seed, logits_processor=hooks, return_dict_in_generate=True,
                                 output_scores=True, **base).sequences_scores, reference.sequences_scores)
    theirs, ours = Calls(no_immediate_repeat), Calls(no_immediate_repeat)
    assert torch.equal(_theirs(pair[1], ids, mask, seed, logits_processor=[theirs], **base),
                       _ours(pair[0], ids, mask, seed, logits_processor=[ours], **base))
    _same_calls(ours, theirs)


def test_custom_processors_merge_as_transformers(pair):
    """_merge_criteria_processor_list: a custom processor of a built-in's class takes its place (a repetition
    penalty here, its own 1.6 over the setting's 1.3, before the n-gram ban and the suppression); the same object
    twice runs once; a custom warper is no built-in (the built-in warpers come after the merge) and runs twice; a
    custom MinNewTokensLength takes the built-in's place though the total MinLength stays."""
    ids, mask, new = _free(pair)
    base = dict(FREE, repetition_penalty=1.3, no_repeat_ngram_size=2, suppress_tokens=[int(new[1, 0])])
    penalty = T.RepetitionPenaltyLogitsProcessor(1.6)
    replaced = _same_scores(pair, ids, mask, logits_processor=[penalty], **base)
    assert not torch.equal(replaced.scores[0], _same_scores(pair, ids, mask, **base).scores[0])
    ban = BanToken(int(new[0, 0]))
    twice = _same_scores(pair, ids, mask, logits_processor=[ban, ban, boost(int(new[0, 1]), -1.0)], **base)
    assert (twice.scores[0][:, int(new[0, 0])] == NEG).all()
    _same_scores(pair, ids, mask, seed=4, do_sample=True, temperature=0.7, top_k=0,
                 logits_processor=[T.TemperatureLogitsWarper(0.5)], **FREE)
    # MinNewTokensLength (3) in the built-in's place, before InfNanRemove, which turns its -inf into the float32
    # minimum at the third step (the total MinLength, from min_new_tokens=2, bans two)
    eos = int(new[0, 0])
    got = _same_scores(pair, ids, mask, logits_processor=[T.MinNewTokensLengthLogitsProcessor(ids.shape[1], 3, [eos])],
                       min_new_tokens=2, remove_invalid_values=True, eos_token_id=[eos], max_new_tokens=6)
    assert (got.scores[2][:, eos] == torch.finfo(torch.float32).min).all()


def test_custom_processor_refusals(pair):
    ids, mask = _left_padded(pair[0].config.vocab_size)

    class WantsMore(T.LogitsProcessor):
        def __call__(self, input_ids, scores, cur_len):
            return scores
    with pytest.raises(ValueError, match="required parameters"):
        _theirs(pair[1], ids, mask, logits_processor=[WantsMore()], **FREE)
    with pytest.raises(InputError, match="WantsMore"):
        _ours(pair[0], ids, mask, logits_processor=[WantsMore()], **FREE)
    with pytest.raises(InputError, match=r"logits_processor\[1\]"):
        _ours(pair[0], ids, mask, logits_processor=[no_immediate_repeat, 3], **FREE)
    with pytest.raises(InputError, match="expected a list of callables"):
        _ours(pair[0], ids, mask, stopping_criteria=no_immediate_repeat, **FREE)


class StopOnToken(T.StoppingCriteria):
    """A StoppingCriteria: a row is done when its last id is ``token``."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def stop_at(length: int):
    """A plain function: every row is done at ``length`` ids (a Python bool, or-ed as transformers or-s it)."""
    return lambda input_ids, scores: input_ids.shape[1] >= length


@pytest.mark.parametrize("mode", list(MODES))
def test_custom_stopping_criteria_equal_transformers(pair, mode):
    """A StoppingCriteria stopping one row at an id, and a plain function stopping every row at a length: the ids,
    scores and beam scores equal transformers'; the criteria saw the same ids and the same recorded scores (a
    tuple with output_scores, else None)."""
    ids, mask, new = _free(pair)
    kwargs = dict(MODES[mode])
    seed = kwargs.pop("seed", None)
    base = dict(max_new_tokens=8, eos_token_id=[], **{"pad_token_id": 0, **kwargs})
    token = int(new[0, 1])
    one_row = _same_scores(pair, ids, mask, seed, stopping_criteria=T.StoppingCriteriaList([StopOnToken(token)]),
                           **base)
    if mode == "greedy":
        assert one_row.sequences.shape[1] == ids.shape[1] + 8 and (one_row.sequences[0, ids.shape[1] + 2:] == 0).all()
    short = _same_scores(pair, ids, mask, seed, stopping_criteria=[stop_at(ids.shape[1] + 3)], **base)
    assert short.sequences.shape[1] <= ids.shape[1] + 3
    for recorded in (dict(return_dict_in_generate=True, output_scores=True), {}):
        theirs, ours = Calls(StopOnToken(token)), Calls(StopOnToken(token))
        reference = _theirs(pair[1], ids, mask, seed, stopping_criteria=[theirs], **recorded, **base)
        got = _ours(pair[0], ids, mask, seed, stopping_criteria=[ours], **recorded, **base)
        if recorded:
            assert torch.equal(got.sequences, reference.sequences)
            if mode in ("beams", "beam sampling"):
                assert torch.equal(got.sequences_scores, reference.sequences_scores)
        else:
            assert torch.equal(got, reference)
        _same_calls(ours, theirs)


def test_custom_criteria_merge_as_transformers(pair):
    """A custom MaxLengthCriteria takes the built-in's place (its length wins over max_new_tokens), a custom
    EosTokenCriteria the eos one's (finished rows padded as by an eos), in greedy decoding and beam search."""
    ids, mask, new = _free(pair)
    for kwargs in ({}, dict(num_beams=2)):
        cut = _same_scores(pair, ids, mask, stopping_criteria=[T.MaxLengthCriteria(ids.shape[1] + 3)],
                           pad_token_id=1, **FREE, **kwargs)
        assert cut.sequences.shape[1] == ids.shape[1] + 3
        _same_scores(pair, ids, mask, stopping_criteria=[T.EosTokenCriteria(int(new[0, 1]))], pad_token_id=1,
                     **FREE, **kwargs)


def test_a_custom_criterion_with_an_eos_id_pads_finished_rows(pair, tmp_path):
    """_sample pads the rows a criterion ended when any criterion has an ``eos_token_id`` (has_eos_stopping_criteria),
    a custom one included, with no eos id set; without a pad id transformers fails, and we refuse."""
    ids, mask, new = _free(pair)
    root = _copy(LLAMA, tmp_path)
    (root / "generation_config.json").write_text('{"pad_token_id": 5}')
    file_pair = _both(root)
    got = _same_scores(file_pair, ids, mask, stopping_criteria=[T.EosTokenCriteria(int(new[0, 1]))], max_new_tokens=6)
    assert (got.sequences[0, -1] == 5).all()
    (root / "generation_config.json").write_text('{}')
    file_pair = _both(root)
    with pytest.raises(TypeError):
        _theirs(file_pair[1], ids, mask, stopping_criteria=[T.EosTokenCriteria(int(new[0, 1]))], max_new_tokens=6)
    with pytest.raises(InputError, match="no pad_token_id"):
        _ours(file_pair[0], ids, mask, stopping_criteria=[T.EosTokenCriteria(int(new[0, 1]))], max_new_tokens=6)
    _same(file_pair, ids, mask, stopping_criteria=[StopOnToken(int(new[0, 1]))], max_new_tokens=6)  # no eos: no pad


def test_the_pipeline_hands_the_hooks_to_each_prompt(model):
    """generate(prompts, ...) as pipeline(prompts, ...) with a streamer, a processor and a criterion: the
    records, and the streamer's puts (each prompt, its steps, an end() per prompt)."""
    from flodl_hf.tasks.generate import generate
    root, pipe = model
    records, streamers = [], []
    for run in (lambda **kw: pipe(PROMPTS, **kw), lambda **kw: generate(PROMPTS, root, **kw)):
        streamers.append(Recorder())
        records.append(run(do_sample=False, max_new_tokens=5, streamer=streamers[-1],
                           logits_processor=[no_immediate_repeat], stopping_criteria=[StopOnToken(7)]))
    assert records[0] == records[1]
    _same_events(streamers[1], streamers[0])
    assert streamers[1].ends == len(PROMPTS) and len(streamers[1].puts) > len(PROMPTS)
