"""transformers' logits processors, warpers and stopping criteria in ``generate_ids``, each against transformers
5.24's ``generate`` in the same run (``torch.equal`` on the ids, and on the processed scores where they are
recorded): greedy and seeded sampling on a left-padded batch; the settings through keywords, a
``generation_config`` (object or dict) and ``generation_config.json``; ``stop_strings`` with a tokenizer, and the
pipeline's ``stop_sequence`` through ``generate()``; beam search (``num_beams``, ``length_penalty``,
``early_stopping``, ``num_return_sequences``) and beam sampling; bad values are typed errors naming the setting."""

from __future__ import annotations

import shutil

import pytest
import torch

from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.tasks.generate import generate
from flodl_hf.roundtrip.parity import quiet_transformers

from helpers import make_checkpoint, one_thread  # noqa: F401  (the fixture)
from test_decoder import SMALL, _fields, _left_padded
from test_generate_api import LLAMA, _ours, _same, _theirs, pair  # noqa: F401  (the fixture)
from test_generate_defaults import _both, _edit
from test_generate_pipeline import PROMPTS, model  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

FREE = dict(max_new_tokens=6, eos_token_id=[])


def _same_scores(pair, ids, mask=None, seed=None, **kwargs):
    """The ids and every step's processed scores equal transformers'; returns ours."""
    kwargs = dict(return_dict_in_generate=True, output_scores=True, **kwargs)
    reference = _theirs(pair[1], ids, mask, seed, **kwargs)
    got = _ours(pair[0], ids, mask, seed, **kwargs)
    assert torch.equal(got.sequences, reference.sequences), kwargs
    assert len(got.scores) == len(reference.scores) and all(
        torch.equal(a, b) for a, b in zip(got.scores, reference.scores)), kwargs
    return got


def _removed(out) -> int:
    return sum(int(torch.isinf(s).sum()) for s in out.scores)


@pytest.mark.parametrize("warper", [dict(min_p=0.5), dict(min_p=0.2, temperature=0.5), dict(typical_p=0.5),
                                    dict(epsilon_cutoff=3.2e-5), dict(eta_cutoff=0.5),
                                    dict(min_p=0.1, typical_p=0.9, epsilon_cutoff=3e-5, eta_cutoff=3e-4, top_k=40,
                                         top_p=0.95),
                                    # top-h: after temperature, before top-k (transformers' order)
                                    dict(top_h=0.4), dict(top_h=0.3, temperature=0.7, top_k=40)],
                         ids=lambda w: ",".join(w))
def test_sampling_warpers_equal_transformers(pair, warper):
    """min-p, top-h, typical, epsilon and eta sampling, after temperature / top-k / top-p, with the same draws."""
    ids, mask = _left_padded(pair[0].config.vocab_size)
    settings = {"do_sample": True, "max_new_tokens": 5, "eos_token_id": [], "top_k": 0, **warper}
    cuts = ("min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")
    plain = _same_scores(pair, ids, mask, seed=4, **{k: v for k, v in settings.items() if k not in cuts})
    assert _removed(_same_scores(pair, ids, mask, seed=4, **settings)) > _removed(plain)  # the warper cut tokens
    _same(pair, ids, mask, max_new_tokens=3, eos_token_id=[], **warper)  # greedy: not applied, as transformers


@pytest.mark.parametrize("fields,sample", [
    (dict(), False), (dict(bias=6.0, greenlist_ratio=0.4, context_width=2), True),
    (dict(seeding_scheme="selfhash", bias=4.0, hashing_key=7, context_width=3), False)],
    ids=["lefthash-greedy", "lefthash-width2-sampled", "selfhash-greedy"])
def test_watermarking_equals_transformers(pair, fields, sample):
    """watermarking_config (transformers' WatermarkingConfig, or a dict of its fields): the green-list bias after
    every other processor, ids and every step's scores as transformers', and the tokens moved by it."""
    from transformers import WatermarkingConfig
    ids, mask = _left_padded(pair[0].config.vocab_size)
    settings = dict(max_new_tokens=4, eos_token_id=[], do_sample=sample, top_k=0, no_repeat_ngram_size=2)
    marked = _same_scores(pair, ids, mask, seed=3, watermarking_config=WatermarkingConfig(**fields), **settings)
    plain = _ours(pair[0], ids, mask, seed=3, return_dict_in_generate=True, output_scores=True, **settings)
    assert not torch.equal(marked.scores[0], plain.scores[0])
    as_dict = _ours(pair[0], ids, mask, seed=3, watermarking_config=dict(fields), **settings)
    assert torch.equal(as_dict, marked.sequences)


@pytest.mark.parametrize("negative,options", [
    (False, dict()), (True, dict()), (True, dict(use_cache=False)), (False, dict(do_sample=True, top_k=20))],
    ids=["last-id", "negative-prompt", "negative-prompt-no-cache", "sampled"])
def test_guidance_equals_transformers(pair, negative, options):
    """guidance_scale (classifier-free guidance): the unconditional branch run by the model itself (the prompt's
    last id, or negative_prompt_ids left-padded with their mask), ids and every step's scores as transformers'."""
    ids, mask = _left_padded(pair[0].config.vocab_size)
    extra = {}
    if negative:
        neg = torch.tensor([[0, 0, 11, 12], [21, 22, 23, 24], [0, 31, 32, 33]])
        extra = dict(negative_prompt_ids=neg, negative_prompt_attention_mask=(neg != 0).long())
    settings = dict(max_new_tokens=4, eos_token_id=[], guidance_scale=1.5, **options)
    guided = _same_scores(pair, ids, mask, seed=2, **settings, **extra)
    plain = _ours(pair[0], ids, mask, seed=2, return_dict_in_generate=True, output_scores=True,
                  **{**settings, "guidance_scale": 1.0})
    assert not torch.equal(guided.scores[0], plain.scores[0])
    if not negative and not options:  # not implemented with prompt lookup: typed, naming both
        with pytest.raises(InputError, match="guidance_scale=1.5.*prompt lookup"):
            _ours(pair[0], ids[1:2], mask[1:2], prompt_lookup_num_tokens=2, **settings)


def _free(pair):
    ids, mask = _left_padded(pair[0].config.vocab_size)
    new = generate_ids(pair[0], ids, mask, **FREE)[:, ids.shape[1]:]
    return ids, mask, new


PROCESSORS = {  # name -> settings from the free greedy run's new tokens (B, 6), chosen to change them
    "no_repeat_ngram_size=1": lambda new: dict(no_repeat_ngram_size=1),
    "no_repeat_ngram_size=2": lambda new: dict(no_repeat_ngram_size=2),
    "suppress_tokens": lambda new: dict(suppress_tokens=[int(new[0, 0]), int(new[1, 1])]),
    "begin_suppress_tokens": lambda new: dict(begin_suppress_tokens=[int(new[0, 0]), int(new[2, 0])]),
    "bad_words_ids": lambda new: dict(bad_words_ids=[[int(new[0, 0])], [int(new[1, 0]), int(new[1, 1])]]),
    "sequence_bias": lambda new: dict(sequence_bias=[[[int(new[0, 0])], -3.0], [[int(new[1, 0]), int(new[1, 1])], 2.5],
                                                     [[int(new[2, 2])], -1.5], [[7, int(new[2, 2])], 0.5]]),
    "forced_eos_token_id": lambda new: dict(forced_eos_token_id=[3, 4]),
    "exponential_decay_length_penalty": lambda new: dict(exponential_decay_length_penalty=(1, 1.8),
                                                         eos_token_id=[int(new[0, 4]), 9], pad_token_id=0),
    "renormalize_logits": lambda new: dict(renormalize_logits=True, suppress_tokens=[int(new[0, 0])]),
    "remove_invalid_values": lambda new: dict(remove_invalid_values=True, bad_words_ids=[[int(new[0, 0])]]),
}


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_logits_processors_greedy_and_sampled_equal_transformers(pair, name):
    ids, mask, new = _free(pair)
    settings = {**FREE, **PROCESSORS[name](new)}
    greedy = _same_scores(pair, ids, mask, **settings)
    if name not in ("renormalize_logits", "exponential_decay_length_penalty"):  # these keep the argmax here
        assert not torch.equal(greedy.sequences[:, ids.shape[1]:], new), name
    else:
        assert not torch.equal(greedy.scores[-1], _same_scores(pair, ids, mask, **FREE).scores[-1]), name
    _same_scores(pair, ids, mask, seed=5, do_sample=True, top_k=30, **settings)
    if name == "forced_eos_token_id":
        assert set(greedy.sequences[:, -1].tolist()) <= {3, 4}
    if name == "remove_invalid_values":
        assert (greedy.scores[0] == torch.finfo(torch.float32).min).any() and not greedy.scores[0].isinf().any()


def test_forced_bos_and_begin_suppression_on_one_token_prompts(pair):
    """ForcedBOS applies at length 1; with it, begin_suppress_tokens starts one token later (_get_logits_processor)."""
    ids, mask = _left_padded(pair[0].config.vocab_size)
    one = ids[:, -1:]
    forced = _same(pair, one, max_new_tokens=4, eos_token_id=[], forced_bos_token_id=11)
    assert (forced[:, 1] == 11).all()
    second = int(generate_ids(pair[0], one, max_new_tokens=3, eos_token_id=[], forced_bos_token_id=11)[0, 2])
    got = _same(pair, one, max_new_tokens=3, eos_token_id=[], forced_bos_token_id=11, begin_suppress_tokens=[second])
    assert got[0, 2] != second
    _same(pair, ids, mask, max_new_tokens=3, eos_token_id=[], forced_bos_token_id=11)  # longer prompts: nothing


def test_settings_through_generation_config_and_the_file(pair, tmp_path):
    GenerationConfig = quiet_transformers().GenerationConfig
    ids, mask, new = _free(pair)
    fields = dict(no_repeat_ngram_size=2, suppress_tokens=[int(new[0, 0])], min_p=0.3, do_sample=True, top_k=0,
                  sequence_bias=[[[int(new[1, 0])], -2.0]], **FREE)
    reference = _theirs(pair[1], ids, mask, seed=6, generation_config=GenerationConfig(**fields))
    for given in (GenerationConfig(**fields), fields):
        assert torch.equal(_ours(pair[0], ids, mask, seed=6, generation_config=given), reference)
    # a keyword wins over the generation_config's field: 0 turns the n-gram ban off
    reference = _theirs(pair[1], ids, mask, generation_config=GenerationConfig(**fields), do_sample=False,
                        no_repeat_ngram_size=0)
    assert torch.equal(_ours(pair[0], ids, mask, generation_config=fields, do_sample=False, no_repeat_ngram_size=0),
                       reference)
    root = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint(_fields(LLAMA), "causal_lm"), root)
    _edit(root / "generation_config.json", no_repeat_ngram_size=1, bad_words_ids=[[int(new[2, 0])]], typical_p=0.6,
          renormalize_logits=True)
    file_pair = _both(root)
    _same_scores(file_pair, ids, mask, **FREE)
    _same_scores(file_pair, ids, mask, seed=8, do_sample=True, top_k=0, **FREE)
    _same_scores(file_pair, ids, mask, no_repeat_ngram_size=0, **FREE)
    _edit(root / "generation_config.json", sequence_bias=[[[5], 1]])  # an int bias: SequenceBias refuses it
    with pytest.raises(ConfigError, match=r"generation_config\.json: sequence_bias="):
        generate_ids(_both(root)[0], ids, mask, **FREE)


@pytest.mark.parametrize("kwargs,name", [
    (dict(min_p=1.5), "min_p=1.5"), (dict(top_h=0), "top_h=0"), (dict(top_h=1.5), "top_h=1.5"),
    (dict(typical_p=0), "typical_p=0"), (dict(epsilon_cutoff="x"), "epsilon_cutoff"),
    (dict(no_repeat_ngram_size=1.5), "no_repeat_ngram_size"), (dict(bad_words_ids=[5]), "bad_words_ids"),
    (dict(bad_words_ids=[[40000]]), "bad_words_ids"),
    (dict(sequence_bias={(5,): 1}), "sequence_bias"), (dict(sequence_bias=[[[5], 1.0, 2]]), "sequence_bias"),
    (dict(forced_bos_token_id=-1), "forced_bos_token_id"), (dict(forced_eos_token_id=[40000]), "forced_eos_token_id"),
    (dict(forced_eos_token_id=[3], suppress_tokens=[3, 4]), "forced_eos_token_id"),
    (dict(exponential_decay_length_penalty=(1,)), "exponential_decay_length_penalty"),
    (dict(suppress_tokens=["a"]), "suppress_tokens"), (dict(renormalize_logits=1), "renormalize_logits"),
    (dict(stop_strings=[""]), "stop_strings"), (dict(stop_strings="x"), "tokenizer"),
    (dict(max_time=-1), "max_time"),
    (dict(watermarking_config={"greenlist_ratio": 1.0}), "watermarking_config"),
    (dict(watermarking_config={"seeding_scheme": "hash"}), "watermarking_config"),
    (dict(watermarking_config={"ngram_len": 5, "keys": [1, 2]}), "watermarking_config")])
def test_bad_values_are_input_errors_naming_the_setting(pair, kwargs, name):
    ids, mask = _left_padded(pair[0].config.vocab_size)
    with pytest.raises(InputError, match=name):
        pair[0].generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, **kwargs)


def test_bad_words_that_are_all_eos_ids_change_nothing(pair):
    """NoBadWordsLogitsProcessor validates the bad words before leaving out the one-token eos ones: when that leaves
    none, transformers runs with an empty bias (found by a randomized comparison; we refused it)."""
    ids, mask = _left_padded(pair[0].config.vocab_size)
    for settings in (dict(bad_words_ids=[[2]], eos_token_id=2), dict(bad_words_ids=[[7], [5]], eos_token_id=[5, 7])):
        got = _same_scores(pair, ids, mask, max_new_tokens=3, **settings)
        assert torch.equal(got.sequences, generate_ids(pair[0], ids, mask, max_new_tokens=3,
                                                       eos_token_id=settings["eos_token_id"]))
        _same(pair, ids, mask, seed=3, do_sample=True, max_new_tokens=3, num_beams=2, **settings)


def test_exponential_decay_needs_valid_eos_ids(pair):
    """ExponentialDecayLengthPenalty indexes the scores with the eos ids: without one transformers fails
    (torch.tensor(None)), a negative one is its ValueError, one past the vocabulary an IndexError once the penalty
    applies (before, nothing); ours are InputErrors naming the setting (found by a randomized comparison: we decoded
    on, or raised an IndexError). An empty eos list changes nothing on either side."""
    from flodl_hf.auto import load_model
    ids, mask = _left_padded(pair[0].config.vocab_size)
    qwen2 = make_checkpoint(_fields(SMALL["qwen2"]), "causal_lm")  # no eos id in its config
    ours = load_model(qwen2, "causal_lm", dtype=torch.float32)
    vocab = ours.config.vocab_size
    decay = dict(max_new_tokens=3, exponential_decay_length_penalty=(0, 1.5))
    for model, extra in ((ours, {}), (pair[0], dict(eos_token_id=-1)), (pair[0], dict(eos_token_id=[5, vocab]))):
        with pytest.raises(InputError, match="exponential_decay_length_penalty"):
            generate_ids(model, ids, mask, **decay, **extra)
    with pytest.raises(Exception) as theirs:  # transformers raises too, untyped
        _theirs(pair[1], ids, mask, **decay, eos_token_id=-1)
    assert not isinstance(theirs.value, InputError)
    _same_scores(pair, ids, mask, **decay, eos_token_id=[])
    _same(pair, ids, mask, max_new_tokens=3, exponential_decay_length_penalty=(3, 1.5), eos_token_id=[5, vocab])


@pytest.fixture(scope="module")
def text_pair(model):
    """The pipeline test's LLaMA with the botchan tokenizer: ours and transformers' models and tokenizers."""
    from flodl_hf.tasks.runtime import load
    root = model[0]
    ours, theirs = _both(root)
    return ours, theirs, load(root, "causal_lm", None).tokenizer, model[1].tokenizer


def test_stop_strings_equal_transformers(text_pair):
    """StopStringCriteria: a string ending in the last token, spelled by the tokens before it; a left-padded batch
    where rows stop at different steps (padded after when an eos is set), greedy and sampled; max_time."""
    ours, theirs, tok, their_tok = text_pair
    enc = their_tok(PROMPTS, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    new = generate_ids(ours, ids, mask, max_new_tokens=8, eos_token_id=[])[:, ids.shape[1]:]
    first = their_tok.decode(new[0, :3])  # a string row 0 writes over its first tokens, across token edges
    cases = [dict(stop_strings=first[-3:]), dict(stop_strings=[first[-3:], "zq"], eos_token_id=5, pad_token_id=0),
             dict(stop_strings=[their_tok.decode(new[1, 1:2])[-1:], first[1:4]], eos_token_id=5, pad_token_id=0)]
    for extra in cases:
        settings = {"max_new_tokens": 8, "eos_token_id": [], **extra}
        reference = _theirs(theirs, ids, mask, tokenizer=their_tok, **settings)
        assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, tokenizer=tok, **settings), reference)
        assert torch.equal(generate_ids(ours, ids, mask, tokenizer=their_tok, **settings), reference)
        assert reference.shape[1] < ids.shape[1] + 8 or (reference[:, -1] == 0).any(), extra  # someone stopped
        settings.update(do_sample=True, temperature=1.5)
        assert torch.equal(_ours(ours, ids, mask, seed=2, tokenizer=tok, **settings),
                           _theirs(theirs, ids, mask, seed=2, tokenizer=their_tok, **settings))
    assert _theirs(theirs, ids, mask, max_time=0.0, **FREE).shape[1] == ids.shape[1] + 1
    assert generate_ids(ours, ids, mask, max_time=0.0, **FREE).shape[1] == ids.shape[1] + 1
    assert torch.equal(generate_ids(ours, ids, mask, max_time=60.0, **FREE), generate_ids(ours, ids, mask, **FREE))
    with pytest.raises(InputError, match="stop_strings"):
        generate_ids(ours, ids, mask, stop_strings="\u2603\u2603", tokenizer=tok, **FREE)  # no token ends it


def test_generate_equals_the_pipeline_with_processors_and_stop_sequence(model):
    root, pipe = model
    new = generate(PROMPTS[0], root, do_sample=False, max_new_tokens=6, eos_token_id=[], return_tensors=True)
    stop = pipe.tokenizer.decode(new[0]["generated_token_ids"][-4:-2])[-2:]
    greedy = dict(do_sample=False, max_new_tokens=6, eos_token_id=[])
    for options in (dict(no_repeat_ngram_size=1), dict(suppress_tokens=[new[0]["generated_token_ids"][-6]]),
                    dict(stop_sequence=stop), dict(stop_sequence=[stop, "zq"], eos_token_id=2, return_tensors=True)):
        options = {**greedy, **options}
        assert generate(PROMPTS, root, **options) == pipe(PROMPTS, **options), options
    torch.manual_seed(3)
    theirs = pipe(PROMPTS, max_new_tokens=4, min_p=0.2, typical_p=0.8, no_repeat_ngram_size=1)
    assert generate(PROMPTS, root, max_new_tokens=4, min_p=0.2, typical_p=0.8, no_repeat_ngram_size=1,
                    seed=3) == theirs
    with pytest.raises(InputError, match="stop_sequence"):
        generate(PROMPTS[0], root, max_new_tokens=2, stop_strings="day")


def _likely(pair, ids, mask, k: int) -> list[int]:
    """The ``k`` likeliest ids of each row at the second step: as eos ids, they end hypotheses at various lengths."""
    out = generate_ids(pair[0], ids, mask, max_new_tokens=2, eos_token_id=[], return_dict_in_generate=True,
                       output_scores=True)
    return out.scores[1].topk(k, dim=-1).indices.flatten().tolist()


BEAMS = [dict(num_beams=2), dict(num_beams=3, num_return_sequences=3, early_stopping=True),
         dict(num_beams=3, num_return_sequences=2, early_stopping="never", length_penalty=-2.0),
         dict(num_beams=2, length_penalty=0.0, num_return_sequences=2, use_cache=False),
         dict(num_beams=3, no_repeat_ngram_size=2, repetition_penalty=1.3, min_new_tokens=2)]


@pytest.mark.parametrize("beams", BEAMS, ids=lambda b: ",".join(f"{k}={v}" for k, v in b.items()))
def test_beam_search_equals_transformers(pair, beams):
    """GenerationMixin._beam_search: finished hypotheses of several lengths (eos ids the beams meet), the fill
    after them (the pad id, else the first eos), the length penalty and early stopping; and beam sampling."""
    ids, mask = _left_padded(pair[0].config.vocab_size)
    eos = _likely(pair, ids, mask, 10)
    got = _same(pair, ids, mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=1, **beams)
    assert got.shape[0] == 3 * beams.get("num_return_sequences", 1)
    if beams.get("min_new_tokens") is None:
        assert (got == 1).any()  # some hypothesis ended early and was filled
    _same(pair, ids, mask, max_new_tokens=5, eos_token_id=eos[0], **beams)  # pad 0: filled with the eos
    record = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    reference = _theirs(pair[1], ids, mask, max_new_tokens=4, eos_token_id=eos, **record, **beams)
    out = pair[0].generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, eos_token_id=eos, **record, **beams)
    for name in ("sequences", "sequences_scores", "beam_indices"):
        assert torch.equal(out[name], reference[name]), name
    for name in ("scores", "logits"):
        assert len(out[name]) == len(reference[name]) and all(
            torch.equal(a, b) for a, b in zip(out[name], reference[name])), name
    _same(pair, ids, mask, seed=3, do_sample=True, top_k=20, max_new_tokens=5, eos_token_id=eos, **beams)


def test_beam_search_reorders_a_sliding_window_cache():
    """Mistral (window 4): each step the kept beams take their cache rows (Cache.reorder_cache), the sliding layer
    included, past the window."""
    mistral = _both(make_checkpoint(_fields(SMALL["mistral"]), "causal_lm"))
    ids, mask = _left_padded(mistral[0].config.vocab_size)
    _same(mistral, ids, mask, max_new_tokens=7, eos_token_id=_likely(mistral, ids, mask, 10), num_beams=3,
          num_return_sequences=2)


def test_beam_search_through_the_config_file_and_the_pipeline(model, tmp_path):
    root, pipe = model
    for options in (dict(do_sample=False, num_beams=3, num_return_sequences=2, eos_token_id=[5, 9]),
                    dict(num_beams=2, length_penalty=0.5)):  # the pipeline's default: beam sampling at 0.7
        torch.manual_seed(4)
        theirs = pipe(PROMPTS, max_new_tokens=4, **options)
        assert generate(PROMPTS, root, max_new_tokens=4, seed=4, **options) == theirs, options
    ckpt = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint(_fields(LLAMA), "causal_lm"), ckpt)
    _edit(ckpt / "generation_config.json", num_beams=3, early_stopping=True, eos_token_id=[2, 7])
    file_pair = _both(ckpt)
    ids, mask = _left_padded(file_pair[0].config.vocab_size)
    _same(file_pair, ids, mask, max_new_tokens=4)
    _same(file_pair, ids, mask, max_new_tokens=4, num_beams=1)  # a keyword wins: greedy
    for kwargs, name in ((dict(num_return_sequences=4), "num_return_sequences=4"),
                         (dict(early_stopping="soon"), "early_stopping"),
                         (dict(eos_token_id=[], pad_token_id=0), "eos_token_id")):
        with pytest.raises(InputError, match=name):
            generate_ids(file_pair[0], ids, mask, max_new_tokens=2, **kwargs)


TEXT = "Unbelievable! Transformers tokenizer café, the capital of France is Paris.\nHello world"
STOPS = [["Paris"], ["is P"], ["café"], ["é,"], ["\n"], ["tok"], ["capital of", "ld"], ["!", "zz", "s P"]]


@pytest.mark.parametrize("kind", ["byte-level BPE", "WordPiece", "SentencePiece byte fallback"])
def test_stop_string_matching_equals_stop_string_criteria(kind, request):
    """StopStrings against transformers' StopStringCriteria on every prefix of a text, for a byte-level, a plain
    and a byte-fallback vocabulary, with our tokenizer and with transformers'; where it refuses the strings (no
    token can end them), an InputError."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    from flodl_hf.generation.processors import StopStrings
    from flodl_hf.tokenization import AutoTokenizer
    from test_tokenizer_dirs import bpe_vocab_dir, saved_dir, wordpiece_vocab_dir
    root = {"byte-level BPE": lambda: saved_dir(bpe_vocab_dir()), "WordPiece": lambda: saved_dir(wordpiece_vocab_dir()),
            "SentencePiece byte fallback": lambda: request.getfixturevalue("model")[0]}[kind]()
    theirs = quiet_transformers().AutoTokenizer.from_pretrained(str(root))
    ours = AutoTokenizer.from_pretrained(str(root))
    ids = theirs(TEXT, add_special_tokens=False)["input_ids"]
    prefixes = [torch.tensor([ids[:n]]) for n in range(1, len(ids) + 1)]
    matched = 0
    for stops in STOPS:
        try:
            reference = StopStringCriteria(theirs, stops)
        except ValueError:
            with pytest.raises(InputError, match="stop_strings"):
                StopStrings(ours, stops)
            continue
        expected = [bool(reference(p, None)) for p in prefixes]
        for tok in (ours, theirs):
            assert [bool(StopStrings(tok, stops)(p)) for p in prefixes] == expected, (stops, type(tok))
        matched += sum(expected)
    assert matched >= 3


def test_the_generate_command_takes_beams_penalties_and_a_stop_text(model, capsys):
    """`flodl-hf generate --num-beams --repetition-penalty --no-repeat-ngram-size --stop --json` prints the
    pipeline's records for the same settings."""
    import json

    from flodl_hf.cli import main as cli

    root, pipe = model
    settings = dict(do_sample=False, max_new_tokens=5, num_beams=2, repetition_penalty=1.3, no_repeat_ngram_size=2)
    theirs = pipe([PROMPTS[0]], **settings)
    assert cli(["generate", PROMPTS[0], "--model", root, "--no-sample", "--max-new-tokens", "5", "--num-beams", "2",
                "--repetition-penalty", "1.3", "--no-repeat-ngram-size", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == theirs
    stop = theirs[0][0]["generated_text"][len(PROMPTS[0]):][-2:]
    assert cli(["generate", PROMPTS[0], "--model", root, "--no-sample", "--max-new-tokens", "5", "--stop", stop,
                "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == pipe([PROMPTS[0]], do_sample=False, max_new_tokens=5,
                                                       stop_sequence=stop)
