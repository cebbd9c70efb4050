"""``cache_implementation="static"`` (and transformers 5.25's deprecated names for it, such as ``"hybrid"``):
transformers' ``StaticCache`` (``StaticLayer`` for full layers, ``StaticSlidingWindowLayer`` for sliding ones),
``decoder.StaticKVCache`` here, against transformers' generate in the same run: the ids, each step's raw logits
(which differ from the dynamic cache's at real width: every forward attends over the whole preallocated length),
the cache it returns, the length transformers keeps on the model between calls, and the refusals."""

from __future__ import annotations

import warnings

import pytest
import torch

from flodl_hf.core.errors import InputError
from flodl_hf.generation.generate import generate_ids

from helpers import make_checkpoint, one_thread  # noqa: F401  (the fixture)
from test_decoder import SMALL, _fields, _left_padded
from test_generate_defaults import _both

pytestmark = pytest.mark.usefixtures("one_thread")

# real width on both paths; a window of 4 under 9-token prompts (sliding layers full from the prefill); Gemma 3's
# sliding and full layers; GPT-2's learned positions
CELLS = [("llama-1024-gqa", "sdpa"), ("llama-1024-gqa", "eager"), (SMALL["mistral"], "sdpa"),
         (SMALL["mistral"], "eager"), (SMALL["gemma3_text"], "sdpa"), (SMALL["gpt2"], "sdpa")]
RECORD = dict(return_dict_in_generate=True, output_logits=True)


def _generate(pair, ids, mask, seed=0, **kwargs):
    ours, theirs = pair
    torch.manual_seed(seed)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = theirs.generate(input_ids=ids, attention_mask=mask, **kwargs)
    torch.manual_seed(seed)
    return generate_ids(ours, ids, mask, **kwargs), reference


def _equal(got, reference) -> None:
    assert torch.equal(got.sequences, reference.sequences)
    assert len(got.logits) == len(reference.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, reference.logits))


@pytest.mark.parametrize("variant,impl", CELLS, ids=[f"{v}-{i}" for v, i in CELLS])
def test_static_cache_equals_transformers(variant, impl):
    """Greedy (8 tokens), sampled and beam search on a left-padded batch: ids and every step's logits equal; the
    cache returned holds transformers' tensors, shapes included (max_length - 1 positions for a full layer)."""
    pair = _both(make_checkpoint(_fields(variant), "causal_lm"), impl)
    ids, mask = _left_padded(pair[0].config.vocab_size)
    got, reference = _generate(pair, ids, mask, max_new_tokens=8, eos_token_id=[], cache_implementation="static",
                               **RECORD)
    _equal(got, reference)
    for layer, theirs in enumerate(reference.cache.layers):
        assert torch.equal(got.cache.keys[layer], theirs.keys) and torch.equal(got.cache.values[layer], theirs.values)
    for extra in (dict(do_sample=True, max_new_tokens=4), dict(num_beams=2, eos_token_id=1, max_new_tokens=5)):
        got, reference = _generate(pair, ids, mask, **{"eos_token_id": [], "cache_implementation": "static",
                                                       **RECORD, **extra})
        _equal(got, reference)
    # one unpadded prompt: its last step fills the cache, and a one-token step still builds its mask there
    assert bool(mask[0].all())
    got, reference = _generate(pair, ids[:1], mask[:1], max_new_tokens=4, eos_token_id=[],
                               cache_implementation="static", **RECORD)
    _equal(got, reference)


def test_static_differs_from_dynamic_at_real_width_and_the_names_transformers_takes():
    """At hidden 1024 the static cache's logits are not the dynamic cache's (the test above can tell them apart);
    "hybrid" (deprecated in transformers 5.25, the same StaticCache) and ``max_cache_len`` as transformers; the
    longest length made before is kept on the model (``_previous_max_cache_length``), so a shorter call after a
    longer one attends over the longer length, as there."""
    pair = _both(make_checkpoint(_fields("llama-1024-gqa"), "causal_lm"))
    ids, mask = _left_padded(pair[0].config.vocab_size)
    static = generate_ids(pair[0], ids, mask, max_new_tokens=4, eos_token_id=[], cache_implementation="static",
                          max_cache_len=30, **RECORD)
    dynamic = generate_ids(pair[0], ids, mask, max_new_tokens=4, eos_token_id=[], **RECORD)
    # The static cache attends over its whole length, the dynamic one over the tokens so far. On an AMD EPYC their
    # logits differ at this width; on an Intel Xeon (AVX-512) they are the same bits, so what shows on every CPU
    # that the static path ran is its cache, as long as max_cache_len, where the dynamic one holds the tokens.
    assert static.cache.keys[0].shape[-2] == 30 > dynamic.cache.keys[0].shape[-2]
    fresh = _both(make_checkpoint(_fields("llama-1024-gqa"), "causal_lm"))
    for kwargs in (dict(max_new_tokens=3, cache_implementation="hybrid"), dict(max_new_tokens=8),
                   dict(max_new_tokens=3), dict(max_new_tokens=3, max_cache_len=30)):
        got, reference = _generate(fresh, ids, mask, **{"eos_token_id": [], "cache_implementation": "static",
                                                        **RECORD, **kwargs})
        _equal(got, reference)
        assert got.cache.keys[0].shape == reference.cache.layers[0].keys.shape, kwargs
    assert fresh[0]._previous_max_cache_length == fresh[1]._previous_max_cache_length == 30


def test_assisted_decoding_over_a_static_cache(tmp_path):
    """Prompt lookup, an assistant model and early exit over the model's static cache (the rejected candidates
    cropped by moving its count back, StaticLayer.crop): ids and every forward equal, greedy and sampled; where
    transformers' last draft writes past the static length (a sampled lookup here: its IndexError), ours raises an
    InputError naming the positions."""
    from test_generate_assisted import Assisted
    from test_generate_lookup import Lookup
    lookup, static = Lookup("llama"), dict(max_new_tokens=12, eos_token_id=[], cache_implementation="static")
    _, _, lengths = lookup.same(prompt_lookup_num_tokens=3, **static)
    assert len(lengths) < 12  # candidates kept
    with warnings.catch_warnings(), pytest.raises(IndexError):
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        lookup.theirs.generate(input_ids=lookup.ids, prompt_lookup_num_tokens=3, do_sample=True, **static)
    torch.manual_seed(0)
    with pytest.raises(InputError, match="writes positions .* of a static cache of"):
        generate_ids(lookup.ours, lookup.ids, prompt_lookup_num_tokens=3, do_sample=True, **static)
    pair = Assisted("llama", tmp_path)
    for extra in ({}, dict(do_sample=True), dict(assistant_early_exit=1)):
        if "assistant_early_exit" in extra:
            got, reference = _generate(pair.main, pair.ids, None, **static, **extra)
            assert torch.equal(got, reference)
        else:
            pair.same(seed=0, **static, **extra)


@pytest.mark.parametrize("variant", ["llama-1024-gqa", SMALL["mistral"]])
def test_static_cache_with_a_prompt_as_embeddings(variant):
    """``inputs_embeds`` into a static cache: without ids the cache also holds the embedded positions (transformers'
    ``max_cache_length += inputs_tensor.shape[1]``), with ids of the same length it does not; ids, every step's
    logits and the cache (torch.equal: shapes included) equal, greedy and sampled, at real width and with a window
    of 4."""
    pair = _both(make_checkpoint(_fields(variant), "causal_lm"))
    ids, mask = _left_padded(pair[0].config.vocab_size)
    other = _left_padded(pair[0].config.vocab_size, seed=1)[0]
    with torch.inference_mode():
        embeds = pair[1].get_input_embeddings()(other).clone()
    for prompt in (None, ids):
        for extra in (dict(max_new_tokens=5), dict(max_new_tokens=4, do_sample=True), dict(max_length=16)):
            if prompt is None and "max_length" in extra:
                extra = dict(max_length=16 + embeds.shape[1])
            got, reference = _generate(pair, prompt, mask, inputs_embeds=embeds, eos_token_id=[],
                                       cache_implementation="static", **RECORD, **extra)
            _equal(got, reference)
            for layer, theirs in enumerate(reference.cache.layers):
                assert torch.equal(got.cache.keys[layer], theirs.keys), (prompt is None, extra)
                assert torch.equal(got.cache.values[layer], theirs.values)


def test_refusals():
    """Assisted decoding over a static cache on a model with sliding-window layers is not implemented;
    "offloaded_static" and names transformers does not know are refused as other caches."""
    ours, _ = _both(make_checkpoint(_fields(SMALL["llama"]), "causal_lm"))
    ids = torch.randint(3, ours.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    mistral, _ = _both(make_checkpoint(_fields(SMALL["mistral"]), "causal_lm"))
    with pytest.raises(InputError, match="sliding-window layers"):
        generate_ids(mistral, ids, max_new_tokens=3, cache_implementation="static", prompt_lookup_num_tokens=2)
    cases = [(dict(input_ids=ids, cache_implementation="offloaded_static"), "another cache"),
             (dict(input_ids=ids, cache_implementation="dynamic_full"), "another cache")]
    for kwargs, needle in cases:
        with pytest.raises(InputError, match=needle):
            generate_ids(ours, **{"max_new_tokens": 3, "eos_token_id": [], "cache_implementation": "static", **kwargs})
