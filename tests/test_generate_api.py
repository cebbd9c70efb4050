"""transformers' generate API on our causal LM, each case against transformers 5.24 in the same run: the attention
mask inferred from the pad id, ``model.generate`` and ``model.generation_config``, ``max_length``,
``min_new_tokens`` / ``min_length``, ``repetition_penalty``, ``num_return_sequences``, ``generation_config`` (a
GenerationConfig or a dict), ``use_cache=False``, ``return_dict_in_generate`` (scores, logits); keywords we do not
implement are InputErrors naming them; the forward's ``cache_position``, ``shift_labels`` and
``num_items_in_batch``."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from flodl_hf.core.decoder import KVCache
from flodl_hf.core.errors import InputError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.roundtrip.parity import quiet_transformers

from helpers import make_checkpoint, one_thread  # noqa: F401  (the fixture)
from test_decoder import SMALL, _fields, _left_padded
from test_generate_defaults import _both

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.range_end]

LLAMA = SMALL["llama"]



@pytest.fixture(scope="module")
def pair():
    return _both(make_checkpoint(_fields(LLAMA), "causal_lm"))


def _theirs(theirs, ids, mask=None, seed=None, **kwargs):
    if mask is not None:
        kwargs["attention_mask"] = mask
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return theirs.generate(input_ids=ids, **kwargs)


def _ours(ours, ids, mask=None, seed=None, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    return generate_ids(ours, ids, mask, **kwargs)


def _same(pair, ids, mask=None, seed=None, **kwargs):
    ours, theirs = pair
    reference = _theirs(theirs, ids, mask, seed, **kwargs)
    got = _ours(ours, ids, mask, seed, **kwargs)
    assert torch.equal(got, reference), kwargs
    return got


def test_without_a_mask_the_pad_id_is_masked_as_transformers_infers_it(pair):
    """_prepare_attention_mask_for_generation: pad set, not an eos, present in the input -> masked; else all ones."""
    ids, mask = _left_padded(pair[0].config.vocab_size)
    ids = ids.masked_fill(mask == 0, 5)
    inferred = _same(pair, ids, max_new_tokens=5, pad_token_id=5, eos_token_id=[])
    assert torch.equal(inferred, _same(pair, ids, mask, max_new_tokens=5, pad_token_id=5, eos_token_id=[]))
    ones = generate_ids(pair[0], ids, torch.ones_like(ids), max_new_tokens=5, pad_token_id=5, eos_token_id=[])
    assert not torch.equal(inferred, ones)  # the rule changes the tokens here
    _same(pair, ids, max_new_tokens=5, pad_token_id=5, eos_token_id=2)  # eos elsewhere: still inferred
    for kwargs in (dict(pad_token_id=5, eos_token_id=[7, 5]),  # the pad is an eos: all ones
                   dict(pad_token_id=None, eos_token_id=5),  # pad unset takes the eos: all ones
                   dict(pad_token_id=4, eos_token_id=[])):  # the pad id does not occur: all ones
        assert torch.equal(_same(pair, ids, max_new_tokens=5, **kwargs),
                           generate_ids(pair[0], ids, torch.ones_like(ids), max_new_tokens=5, **kwargs)), kwargs


def test_model_generate_and_generation_config_as_transformers(pair, tmp_path):
    ours, theirs = pair
    ids, mask = _left_padded(ours.config.vocab_size)
    reference = _theirs(theirs, ids, mask, max_new_tokens=5)
    assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5), reference)
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=5), reference)
    with pytest.raises(InputError, match="inputs or as input_ids"):
        ours.generate(ids, input_ids=ids)
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    root = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint(_fields(LLAMA), "causal_lm"), root)
    (root / "generation_config.json").unlink()  # from_model_config
    ours2, theirs2 = _both(root)
    assert ours2.generation_config.to_dict() == theirs2.generation_config.to_dict()
    assert torch.equal(ours2.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4),
                       _theirs(theirs2, ids, mask, max_new_tokens=4))


def test_an_edited_generation_config_is_what_generate_starts_from():
    """``model.generation_config`` is kept once read, as transformers': an edit to it (or a new one assigned) is what
    later calls start from, under the keywords; a wrong type assigned is refused."""
    ours, theirs = _both(make_checkpoint(_fields(LLAMA), "causal_lm"))
    ids, mask = _left_padded(ours.config.vocab_size)
    assert ours.generation_config is ours.generation_config
    for model in (ours, theirs):
        model.generation_config.max_new_tokens = 3
        model.generation_config.eos_token_id = []
    reference = _theirs(theirs, ids, mask)
    assert reference.shape[1] == ids.shape[1] + 3
    assert torch.equal(_ours(ours, ids, mask), reference)
    assert torch.equal(_ours(ours, ids, mask, max_new_tokens=5), _theirs(theirs, ids, mask, max_new_tokens=5))
    fresh = quiet_transformers().GenerationConfig(max_new_tokens=2, do_sample=True, top_k=5)
    ours.generation_config, theirs.generation_config = fresh, fresh
    assert torch.equal(_ours(ours, ids, mask, seed=1), _theirs(theirs, ids, mask, seed=1))
    with pytest.raises(InputError, match="generation_config=dict"):
        ours.generation_config = {"max_new_tokens": 2}


def test_generation_config_object_or_dict_sits_under_the_keywords(pair):
    GenerationConfig = quiet_transformers().GenerationConfig
    ours, theirs = pair
    ids, mask = _left_padded(ours.config.vocab_size)
    fields = dict(max_new_tokens=6, do_sample=True, top_k=10, temperature=0.8, eos_token_id=[])
    reference = _theirs(theirs, ids, mask, seed=3, generation_config=GenerationConfig(**fields))
    for given in (GenerationConfig(**fields), fields):
        assert torch.equal(_ours(ours, ids, mask, seed=3, generation_config=given), reference)
    # a keyword wins over the generation_config's field
    reference = _theirs(theirs, ids, mask, generation_config=GenerationConfig(**fields), do_sample=False)
    assert torch.equal(generate_ids(ours, ids, mask, generation_config=fields, do_sample=False), reference)
    with pytest.raises(InputError, match="generation_config: penalty_alpha=0.6"):  # contrastive search
        generate_ids(ours, ids, mask, generation_config=GenerationConfig(penalty_alpha=0.6, top_k=4))
    with pytest.raises(InputError, match="generation_config: top_k=-1"):
        generate_ids(ours, ids, mask, generation_config={"top_k": -1})


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_greedy_and_sampled(pair, penalty):
    ours, _ = pair
    ids, mask = _left_padded(ours.config.vocab_size)
    plain = _same(pair, ids, mask, max_new_tokens=10, eos_token_id=[])
    assert not torch.equal(plain, _same(pair, ids, mask, max_new_tokens=10, eos_token_id=[],
                                        repetition_penalty=penalty))
    _same(pair, ids, mask, seed=7, max_new_tokens=10, eos_token_id=[], repetition_penalty=penalty, do_sample=True,
          temperature=0.7, top_k=20, top_p=0.9)
    _same(pair, ids, max_new_tokens=6, eos_token_id=[], repetition_penalty=penalty)  # no padding: nothing skipped


def test_min_new_tokens_and_min_length_ban_the_eos(pair):
    ours, _ = pair
    ids, mask = _left_padded(ours.config.vocab_size)
    free = generate_ids(ours, ids, mask, max_new_tokens=6, eos_token_id=[])
    eos = [int(free[0, ids.shape[1]]), int(free[1, ids.shape[1] + 1])]  # row 0's 1st and row 1's 2nd new token
    stopped = _same(pair, ids, mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    banned = _same(pair, ids, mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0, min_new_tokens=3)
    assert not torch.equal(stopped, banned)
    _same(pair, ids, mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0, min_length=ids.shape[1] + 2)
    _same(pair, ids, mask, seed=2, max_new_tokens=6, eos_token_id=eos, pad_token_id=0, min_new_tokens=4,
          min_length=3, do_sample=True, repetition_penalty=1.2)


def test_lengths_several_sequences_no_cache_and_the_output_record(pair, tmp_path):
    ours, theirs = pair
    ids, mask = _left_padded(ours.config.vocab_size)
    assert _same(pair, ids, mask, max_length=13, eos_token_id=[]).shape[1] == 13
    assert _same(pair, ids, mask, max_length=13, max_new_tokens=2, eos_token_id=[]).shape[1] == ids.shape[1] + 2
    got = _same(pair, ids, mask, seed=4, do_sample=True, num_return_sequences=2, max_new_tokens=5, eos_token_id=[])
    assert got.shape[0] == 2 * ids.shape[0] and torch.equal(got[::2, :ids.shape[1]], got[1::2, :ids.shape[1]])
    with pytest.raises(InputError, match="num_return_sequences=2"):
        generate_ids(ours, ids, mask, num_return_sequences=2, max_new_tokens=2)
    for impl in ("sdpa", "eager"):
        pair_impl = pair if impl == "sdpa" else _both(make_checkpoint(_fields(LLAMA), "causal_lm"), impl)
        _same(pair_impl, ids, mask, use_cache=False, max_new_tokens=5, eos_token_id=[])
        _same(pair_impl, ids[:1, -3:], use_cache=False, max_new_tokens=5, eos_token_id=[])
    kwargs = dict(max_new_tokens=4, eos_token_id=[], return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.3)
    reference = _theirs(theirs, ids, mask, **kwargs)
    out = ours.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(out.sequences, reference.sequences) and isinstance(out.cache, KVCache)
    for name in ("scores", "logits"):
        assert len(out[name]) == len(reference[name]) == 4
        assert all(torch.equal(a, b) for a, b in zip(out[name], reference[name])), name
    plain = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True)
    assert plain.keys() == ["sequences", "cache"] and plain.scores is None
    # the file's fields are honoured as transformers honours them: max_new_tokens wins over a max_length keyword
    root = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint(_fields(LLAMA), "causal_lm"), root)
    data = json.loads((root / "generation_config.json").read_text())
    data.update(max_new_tokens=5, repetition_penalty=1.3, min_new_tokens=2, num_return_sequences=2, do_sample=True,
                use_cache=False)
    (root / "generation_config.json").write_text(json.dumps(data))
    file_pair = _both(root)
    assert _same(file_pair, ids, mask, seed=9, max_length=13).shape == (6, ids.shape[1] + 5)


def test_keywords_we_do_not_implement_are_input_errors_naming_them(pair):
    ours, _ = pair
    ids, mask = _left_padded(ours.config.vocab_size)
    for kwargs, name in ((dict(num_beams=0), "num_beams=0"), (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
                         (dict(output_attentions="yes"), "output_attentions"), (dict(foo=1), "foo=1"),
                         (dict(repetition_penalty=0), "repetition_penalty=0"), (dict(use_cache="no"), "use_cache"),
                         (dict(max_length=0), "max_length=0"), (dict(min_new_tokens=-1), "min_new_tokens=-1")):
        with pytest.raises(InputError, match=name):
            ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, **kwargs)
    # values that change nothing are taken, as transformers takes them
    _same(pair, ids, mask, max_new_tokens=2, num_beams=1, output_attentions=False, typical_p=1.0, eos_token_id=[])


@torch.inference_mode()
def test_causal_lm_loss_shift_labels_num_items_and_cache_position(pair):
    ours, theirs = pair
    ids, mask = _left_padded(ours.config.vocab_size)
    labels = ids.masked_fill(mask == 0, -100)
    shifted = torch.roll(labels, -2, dims=1)
    shifted[:, -2:] = -100
    for extra in ({}, dict(num_items_in_batch=torch.tensor(7)), dict(num_items_in_batch=5),
                  dict(shift_labels=shifted), dict(shift_labels=shifted, num_items_in_batch=torch.tensor(3))):
        a = ours(input_ids=ids, attention_mask=mask, labels=labels, **extra)
        b = theirs(input_ids=ids, attention_mask=mask, labels=labels, **extra)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.logits, b.logits), list(extra)
    plain = ours(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert not torch.equal(plain, ours(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shifted).loss)
    assert ours(input_ids=ids, attention_mask=mask, shift_labels=shifted).loss is None  # as transformers: no labels
    # cache_position: taken and unused by transformers 5.24's LLaMA (its positions come from position_ids / the cache)
    for position in (torch.arange(ids.shape[1]), torch.arange(5, 5 + ids.shape[1])):
        a = ours(input_ids=ids, attention_mask=mask, cache_position=position).logits
        assert torch.equal(a, theirs(input_ids=ids, attention_mask=mask, cache_position=position).logits)
        assert torch.equal(a, ours(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hidden_states_and_attentions_per_step(impl):
    """``output_hidden_states`` / ``output_attentions`` with ``return_dict_in_generate``: each step's forward records
    (the prefill's over the prompt, then one token's), every tensor torch.equal to transformers', greedy, sampled
    and with beams (3 beams: rows per beam), on a left-padded batch; attentions on the eager path (sdpa computes
    none: transformers fails with an IndexError, ours raises an InputError saying so). Assisted decoding's:
    tests/test_generate_lookup.py and tests/test_generate_assisted.py."""
    ours, theirs = _both(make_checkpoint(_fields(LLAMA), "causal_lm"), impl)
    ids, mask = _left_padded(ours.config.vocab_size)
    record = dict(return_dict_in_generate=True, output_hidden_states=True, output_attentions=impl == "eager")
    for extra in (dict(eos_token_id=[]), dict(eos_token_id=[], do_sample=True), dict(eos_token_id=1, num_beams=3)):
        reference = _theirs(theirs, ids, mask, 0, max_new_tokens=4, **record, **extra)
        got = _ours(ours, ids, mask, 0, max_new_tokens=4, **record, **extra)
        assert torch.equal(got.sequences, reference.sequences), extra
        fields = ("hidden_states", "attentions") if impl == "eager" else ("hidden_states",)
        for field in fields:
            mine, theirs_steps = getattr(got, field), getattr(reference, field)
            assert len(mine) == len(theirs_steps) == 4, (extra, field)
            for step, (a, b) in enumerate(zip(mine, theirs_steps)):
                assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), (extra, field, step)
        assert got.hidden_states[0][0].shape[1] == ids.shape[1] and got.hidden_states[1][0].shape[1] == 1
        if impl == "sdpa":
            assert got.attentions is None
            with pytest.raises(InputError, match="computes no attention weights"):
                generate_ids(ours, ids, mask, max_new_tokens=2, return_dict_in_generate=True, output_attentions=True)
