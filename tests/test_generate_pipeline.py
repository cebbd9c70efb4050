"""``generate(prompts, model, ...)`` against ``transformers.pipeline("text-generation", ...)`` in the same run,
compared with ``==``: a single prompt (a list of records) and a list (a list per prompt), ``return_full_text``,
``return_tensors`` (the pipeline's ``generated_token_ids``: prompt and new ids), an eos stopping one prompt of
a greedy batch early, the pipeline's defaults (sampling at temperature 0.7) and its RNG use, and the keywords
it takes that generate() refuses. The model is a small LLaMA with the botchan SentencePiece tokenizer."""

from __future__ import annotations

import pytest
import torch

from flodl_hf.core.errors import InputError
from flodl_hf.tasks.generate import generate
from flodl_hf.roundtrip.parity import quiet_transformers

from test_decoder import _text_model

PROMPTS = ["It was the fourth day", "Botchan said", "Hello"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = _text_model(tmp_path_factory.mktemp("generate_pipeline"))
    pipe = quiet_transformers().pipeline("text-generation", model=str(root), tokenizer=str(root))
    return str(root), pipe


GREEDY = [{}, {"return_full_text": False}, {"return_full_text": True}, {"return_tensors": True},
          {"return_tensors": False},  # as the pipeline: return_tensors given at all asks for the ids
          {"return_text": True}, {"clean_up_tokenization_spaces": True, "skip_special_tokens": False}]


@pytest.mark.parametrize("options", GREEDY, ids=[",".join(o) or "default" for o in GREEDY])
def test_greedy_equals_the_pipeline(model, options):
    root, pipe = model
    for prompts in (PROMPTS[0], PROMPTS):
        ours = generate(prompts, root, do_sample=False, max_new_tokens=4, **options)
        assert ours == pipe(prompts, do_sample=False, max_new_tokens=4, **options), (prompts, options)
        assert isinstance(ours[0], dict if isinstance(prompts, str) else list)


def test_an_eos_stops_one_prompt_of_the_batch(model):
    """Batched with left padding, one row stops at its eos: the pipeline, one prompt at a time, stops there."""
    root, pipe = model
    ids = generate(PROMPTS[0], root, do_sample=False, max_new_tokens=6, eos_token_id=[], return_tensors=True)
    eos = ids[0]["generated_token_ids"][-5]  # the second new token of the first prompt
    for options in ({}, {"return_tensors": True}, {"skip_special_tokens": False}):
        ours = generate(PROMPTS, root, do_sample=False, max_new_tokens=6, eos_token_id=eos, **options)
        assert ours == pipe(PROMPTS, do_sample=False, max_new_tokens=6, eos_token_id=eos, **options), options
    lengths = [len(r[0]["generated_token_ids"]) for r in
               generate(PROMPTS, root, do_sample=False, max_new_tokens=6, eos_token_id=eos, return_tensors=True)]
    assert lengths[0] < max(lengths)


def test_sampling_draws_as_the_pipeline(model):
    """Unset, do_sample and temperature take the pipeline's defaults (sampling at 0.7); the prompts run one at a
    time in its order, after the one draw its DataLoader makes for a list, so the tokens equal the pipeline's
    after the same torch.manual_seed; seed=s gives them without touching the global generator."""
    root, pipe = model
    for prompts in (PROMPTS[0], PROMPTS):
        torch.manual_seed(3)
        theirs = pipe(prompts, max_new_tokens=4, num_return_sequences=2)
        after = torch.get_rng_state()
        torch.manual_seed(3)
        assert generate(prompts, root, max_new_tokens=4, num_return_sequences=2) == theirs
        assert torch.equal(torch.get_rng_state(), after)
        torch.manual_seed(11)
        before = torch.get_rng_state()
        assert generate(prompts, root, max_new_tokens=4, num_return_sequences=2, seed=3) == theirs
        assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(5)
    theirs = pipe(PROMPTS, max_new_tokens=3, do_sample=True, temperature=1.3, top_k=20, top_p=0.9)
    assert generate(PROMPTS, root, max_new_tokens=3, temperature=1.3, top_k=20, top_p=0.9, seed=5) == theirs


@pytest.mark.parametrize("options,name", [
    ({"stop_strings": "day"}, "stop_sequence"), ({"prefix": "Once "}, "prefix"),
    ({"handle_long_generation": "hole"}, "handle_long_generation"), ({"truncation": True}, "truncation"),
    ({"return_full_text": False, "return_tensors": True}, "return_tensors"),
    ({"return_full_text": True, "return_text": True}, "return_text"),
    ({"return_tensors": True, "return_text": True}, "return_text"),
    ({"num_beams": 0}, "num_beams"), ({"output_scores": True, "return_dict_in_generate": True}, "return_dict"),
    ({"num_return_sequences": 2, "do_sample": False}, "num_return_sequences")])
def test_keywords_not_implemented_are_named(model, options, name):
    root, _ = model
    with pytest.raises(InputError, match=name):
        generate(PROMPTS[0], root, max_new_tokens=2, **options)


def test_prompts_must_be_texts_or_chats(model):
    root, _ = model
    for prompts in ([], [PROMPTS[0], 3], [PROMPTS[0], [{"role": "user", "content": "hi"}]]):
        with pytest.raises(InputError, match="prompts"):
            generate(prompts, root, max_new_tokens=2)
    # a chat is a prompt (tests/test_chat_template.py); this model's tokenizer has no template to render it
    with pytest.raises(InputError, match="chat_template"):
        generate([{"role": "user", "content": "hi"}], root, max_new_tokens=2)
