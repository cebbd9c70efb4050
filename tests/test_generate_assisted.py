"""Assisted generation with an assistant model (``generate_ids(..., assistant_model=...)``: transformers'
``AssistedCandidateGenerator`` and ``_assisted_decoding``) against transformers 5.25 in the same run.

The pair: a checkpoint with an untied output layer whose final norm is scaled up (so that its next-token
probabilities spread over 0.1 to 0.9, around the assistant's confidence threshold of 0.4), and an assistant made
from it with noise on every weight (so that it agrees with the model often, not always). Both are loaded by us and
by transformers from the same files. Every case checks the ids, and the length of every forward of both the model
and the assistant: each round's drafts, the confidence stop, the threshold that scikit-learn's ROC curve moves,
the cache crops."""

from __future__ import annotations

import warnings

import pytest
import torch

from flodl_hf.core.errors import InputError
from flodl_hf.generation.generate import generate_ids

from helpers import make_checkpoint, one_thread  # noqa: F401  (the fixture)
from test_decoder import SMALL, _fields
from test_generate_defaults import _both
from test_generate_lookup import Forwards

pytestmark = pytest.mark.usefixtures("one_thread")

# LLaMA, GPT-2, and Mistral with a window of 4, whose sliding layers are cropped past their window in both models
FAMILIES = ["llama", "gpt2", "mistral"]
NORMS = ("model.norm.weight", "transformer.ln_f.weight")


def _variant(source, out, noise: float, scale: float):
    """``source`` saved to ``out`` by transformers with relative noise on every weight and the final norm scaled."""
    import transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if noise:
                p.add_(torch.randn(p.shape, generator=generator) * noise * p.std().clamp(min=1e-2))
            if name in NORMS:
                p.mul_(scale)
    model.save_pretrained(out)
    return out


class Assisted:
    """Our model and assistant, and transformers', each backbone's forwards counted, and a prompt."""

    def __init__(self, family: str, root, **fields) -> None:
        base = make_checkpoint({**_fields(SMALL[family]), "tie_word_embeddings": False, **fields}, "causal_lm")
        main = _variant(base, root / "main", 0.0, 10.0)
        self.main, self.assistant = _both(main), _both(_variant(main, root / "assistant", 0.1, 1.0))
        self.forwards = [Forwards(self.main[0].backbone), Forwards(self.main[1].base_model),
                         Forwards(self.assistant[0].backbone), Forwards(self.assistant[1].base_model)]
        self.ids = torch.randint(3, self.main[0].config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))

    def run(self, which: int, call):
        for f in self.forwards:
            f.lengths = []
        result = call()
        return result, self.forwards[which].lengths, self.forwards[which + 2].lengths

    def same(self, ids=None, seed=None, **kwargs):
        """Ours and transformers' generate with the assistant: the result and every forward's length equal."""
        ids = self.ids if ids is None else ids

        def theirs():
            if seed is not None:
                torch.manual_seed(seed)
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return self.main[1].generate(input_ids=ids, assistant_model=self.assistant[1], **kwargs)

        def ours():
            if seed is not None:
                torch.manual_seed(seed)
            return generate_ids(self.main[0], ids, assistant_model=self.assistant[0], **kwargs)
        reference, their_main, their_drafts = self.run(1, theirs)
        got, our_main, our_drafts = self.run(0, ours)
        sequences = got if isinstance(got, torch.Tensor) else got.sequences
        assert torch.equal(sequences, reference if isinstance(reference, torch.Tensor) else reference.sequences), \
            kwargs
        assert our_main == their_main and our_drafts == their_drafts, kwargs
        return got, reference, our_main, our_drafts

    def configure(self, **fields) -> None:
        """The assistant's generation config on both sides (transformers reads the assistant's settings there)."""
        for assistant in self.assistant:
            for name, value in fields.items():
                setattr(assistant.generation_config, name, value)


@pytest.fixture(scope="module", params=FAMILIES)
def assisted(request, tmp_path_factory):
    return Assisted(request.param, tmp_path_factory.mktemp(f"assisted-{request.param}"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Assisted("llama", tmp_path_factory.mktemp("assisted-llama"))


def _kept(main_lengths: list[int], new: int) -> int:
    """Candidates kept: new tokens beyond one per forward of the model."""
    return new - len(main_lengths)


def test_greedy_equals_transformers_and_plain_greedy(assisted):
    """The ids of transformers' assisted greedy search, which are those of its plain greedy search here, and so
    ours; the model's forwards (the prompt and the first draft, then each draft and the token before it) and the
    assistant's (the prompt, then per round the tokens its cache lacks and one per drafted token) as transformers',
    with drafts kept and rejected."""
    got, _, main, drafts = assisted.same(max_new_tokens=24, eos_token_id=[])
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = assisted.main[1].generate(input_ids=assisted.ids, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(got, plain)
    assert 0 < _kept(main, 24) and len(main) > 3  # some drafts kept, some rejected
    assert max(drafts) >= 2 and len(drafts) > len(main)  # rounds that fed 2 tokens, and drafts of several tokens


@pytest.mark.parametrize("settings", [{}, dict(temperature=0.7, top_k=10), dict(top_p=0.9, repetition_penalty=1.3)])
def test_speculative_sampling_equals_transformers(assisted, settings):
    """Sampling: the assistant samples its drafts through the model's processors and then the warpers once more,
    the model keeps each with probability p / q and draws the next token from (p - q)+ at a rejection, every draw
    from the same generator as transformers' global one: the same ids and forwards for 3 seeds."""
    kept = 0
    for seed in range(3):
        _, _, main, _ = assisted.same(seed=seed, max_new_tokens=20, eos_token_id=[], do_sample=True, **settings)
        kept += _kept(main, 20)
    assert kept > 0


@pytest.mark.parametrize("family", ["gemma3_text", "qwen2_moe", "phi3", "olmo2", "starcoder2"])
def test_more_families(family, tmp_path):
    """Other layouts: Gemma 3's sliding and full layers, an MoE, Phi-3 (whose cache drop lies past these lengths),
    OLMo 2's norms after attention, StarCoder 2's biases: greedy and sampled, ids and forwards equal."""
    pair = Assisted(family, tmp_path)
    pair.same(max_new_tokens=16, eos_token_id=[])
    pair.same(seed=1, max_new_tokens=16, eos_token_id=[], do_sample=True, temperature=0.7, top_k=10)
    if family == "phi3":  # drafting past original_max_position_embeddings, where Phi-3 drops its cache: refused
        short = Assisted(family, tmp_path / "short", original_max_position_embeddings=16)
        generate_ids(short.main[0], short.ids, max_new_tokens=10, eos_token_id=[], assistant_model=short.assistant[0])
        with pytest.raises(InputError, match="drops its KV cache"):
            generate_ids(short.main[0], short.ids, max_new_tokens=11, eos_token_id=[],
                         assistant_model=short.assistant[0])


def test_sampling_with_seed_draws_from_its_own_generator(llama):
    """``seed=`` gives transformers' ids under ``torch.manual_seed(seed)``, leaving the global generator as it was."""
    torch.manual_seed(5)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = llama.main[1].generate(input_ids=llama.ids, assistant_model=llama.assistant[1], max_new_tokens=16,
                                           eos_token_id=[], do_sample=True)
    state = torch.random.get_rng_state()
    got = generate_ids(llama.main[0], llama.ids, assistant_model=llama.assistant[0], max_new_tokens=16,
                       eos_token_id=[], do_sample=True, seed=5)
    assert torch.equal(got, reference)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_scores_and_logits_per_kept_token(llama):
    """With ``return_dict_in_generate``: the processed scores and the raw logits of each new token, equal."""
    record = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    for extra in ({}, dict(do_sample=True, temperature=0.8)):
        got, reference, _, _ = llama.same(seed=2, max_new_tokens=12, eos_token_id=[], **record, **extra)
        for field in ("scores", "logits"):
            ours, theirs = getattr(got, field), getattr(reference, field)
            assert len(ours) == len(theirs) == 12
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), field


def test_the_assistants_settings_and_the_heuristic_schedule(llama):
    """The assistant's generation config: a constant 3 drafts without the confidence stop; the heuristic schedule
    (+2 after a round kept whole, -1 otherwise), whose count transformers writes back to the assistant's config
    and the next call starts from; its transient form, which it does not write back."""
    try:
        llama.configure(num_assistant_tokens=3, assistant_confidence_threshold=0.0)
        _, _, main, drafts = llama.same(max_new_tokens=16, eos_token_id=[])
        assert main[0] == llama.ids.shape[1] + 3 and max(main[1:]) == 4  # 3 drafts and the token before them
        for schedule in ("heuristic", "heuristic_transient"):
            llama.configure(num_assistant_tokens=3, num_assistant_tokens_schedule=schedule,
                            assistant_confidence_threshold=0.0)
            llama.same(max_new_tokens=12, eos_token_id=[])  # heuristic: ends at 5 here
            ours, theirs = (a.generation_config.num_assistant_tokens for a in llama.assistant)
            assert ours == theirs and (ours != 3) == (schedule == "heuristic"), (schedule, ours)
            llama.same(max_new_tokens=16, eos_token_id=[], do_sample=True, seed=0)  # from the count written back
    finally:
        llama.configure(num_assistant_tokens=20, num_assistant_tokens_schedule="constant",
                        assistant_confidence_threshold=0.4)


def test_an_eos_in_the_drafts_ends_the_sequence(llama):
    """An eos id the model produces: the assistant stops its draft at it and the sequence ends there, as in
    transformers (the eos the greedy continuation reaches after a few tokens)."""
    plain = generate_ids(llama.main[0], llama.ids, max_new_tokens=16, eos_token_id=[])
    eos = plain[0, llama.ids.shape[1] + 5].item()
    got, _, _, _ = llama.same(max_new_tokens=16, eos_token_id=eos, pad_token_id=0)
    assert got.shape[1] <= llama.ids.shape[1] + 6 and got[0, -1].item() == eos


def test_a_minimum_length_bans_the_eos_in_drafts_and_checks(llama):
    """``min_new_tokens`` / ``min_length`` with an eos the model reaches early: transformers drops the model's
    MinLength processor from the assistant's list and gives it a MinNewTokens one for the round (or the model's, in
    the adjacent place), which bans the eos below the same length; ids and forwards equal, greedy and sampled, and
    the eos comes no earlier than the minimum."""
    length = llama.ids.shape[1]
    plain = generate_ids(llama.main[0], llama.ids, max_new_tokens=16, eos_token_id=[])
    eos = plain[0, length + 1].item()
    for kwargs in (dict(min_new_tokens=8), dict(min_length=length + 10), dict(min_new_tokens=12, min_length=length + 4),
                   dict(min_new_tokens=8, do_sample=True, temperature=0.7)):
        seed = 0 if kwargs.get("do_sample") else None
        got, _, _, _ = llama.same(seed=seed, max_new_tokens=16, eos_token_id=eos, pad_token_id=0, **kwargs)
        hits = (got[0, length:] == eos).nonzero().flatten().tolist()
        least = max(kwargs.get("min_new_tokens", 0), kwargs.get("min_length", 0) - length)
        assert all(h >= least for h in hits), (kwargs, hits)


def test_with_beams_the_assistant_is_ignored(llama):
    """transformers takes beam search over an assistant (its generation mode); so does this."""
    beams = dict(max_new_tokens=8, eos_token_id=1, num_beams=3)
    got, _, _, drafts = llama.same(**beams)
    assert drafts == [] and torch.equal(got, generate_ids(llama.main[0], llama.ids, **beams))


def test_refusals(llama):
    """What transformers refuses, and what is not implemented here, raise an InputError naming it, before any
    forward."""
    ours, assistant = llama.main[0], llama.assistant[0]
    ids = llama.ids
    cases = [(dict(input_ids=ids.repeat(2, 1)), "batch size 1"),
             (dict(num_return_sequences=2, do_sample=True), "num_return_sequences=2"),
             (dict(use_cache=False), "use_cache=False"),
             (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens=3"),
             (dict(stop_strings="x"), "stop_strings"),
             (dict(num_assistant_tokens=5), "assistant_model.generation_config"),
             (dict(assistant_model=llama.assistant[1]), "expected a flodl-hf causal_lm model")]
    for kwargs, needle in cases:
        settings = {"input_ids": ids, "max_new_tokens": 4, "eos_token_id": [], "assistant_model": assistant,
                    **kwargs}
        with pytest.raises(InputError, match=needle.replace("(", r"\(")):
            generate_ids(ours, **settings)
    try:
        llama.configure(num_assistant_tokens_schedule="fast")
        with pytest.raises(InputError, match="num_assistant_tokens_schedule='fast'"):
            generate_ids(ours, ids, max_new_tokens=4, assistant_model=assistant)
    finally:
        llama.configure(num_assistant_tokens_schedule="constant")
    with warnings.catch_warnings():  # transformers refuses the batch and several sequences too
        warnings.simplefilter("ignore")
        for kwargs in (dict(input_ids=ids.repeat(2, 1)), dict(input_ids=ids, num_return_sequences=2, do_sample=True)):
            with pytest.raises(ValueError):
                llama.main[1].generate(assistant_model=llama.assistant[1], max_new_tokens=4, **kwargs)


def test_an_assistant_over_another_vocabulary_is_refused(llama, tmp_path):
    """An assistant with another vocabulary (transformers needs both tokenizers then): refused, naming both sizes."""
    other = make_checkpoint({**_fields(SMALL["gpt2"]), "vocab_size": 1000}, "causal_lm")
    smaller, _ = _both(other)
    with pytest.raises(InputError, match=f"1000 ids and the model's {llama.main[0].config.vocab_size}"):
        generate_ids(llama.main[0], llama.ids, max_new_tokens=4, assistant_model=smaller)


def test_the_pipeline_one_liner_takes_an_assistant(tmp_path):
    """``generate(prompts, model, assistant_model=...)``: the text-generation pipeline's ``assistant_model`` (our
    model, or a directory to load it from), each prompt alone: the records equal the pipeline's, greedy and sampled
    (its defaults)."""
    from flodl_hf.tasks.generate import generate
    from flodl_hf.roundtrip.parity import quiet_transformers
    from test_decoder import _text_model
    from test_generate_pipeline import PROMPTS
    root = _text_model(tmp_path / "model")
    helper = _variant(root, tmp_path / "assistant", 0.1, 1.0)
    pipe = quiet_transformers().pipeline("text-generation", model=str(root), tokenizer=str(root))
    theirs_assistant = _both(helper)[1]
    for options in (dict(do_sample=False), dict(seed=4)):
        torch.manual_seed(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = pipe(PROMPTS, max_new_tokens=8, assistant_model=theirs_assistant,
                             **{k: v for k, v in options.items() if k != "seed"})
        for given in (str(helper), _both(helper)[0]):
            assert generate(PROMPTS, str(root), max_new_tokens=8, assistant_model=given, **options) == reference


def test_the_cli_takes_an_assistant(tmp_path, capsys):
    """``flodl-hf generate ... --assistant DIR --sample --seed 2``: the pipeline's records with that assistant after
    ``torch.manual_seed(2)``."""
    import json

    from flodl_hf.cli import main
    from flodl_hf.roundtrip.parity import quiet_transformers
    from test_decoder import _text_model
    from test_generate_pipeline import PROMPTS
    root = _text_model(tmp_path / "model")
    helper = _variant(root, tmp_path / "assistant", 0.1, 1.0)
    pipe = quiet_transformers().pipeline("text-generation", model=str(root), tokenizer=str(root))
    torch.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = pipe(PROMPTS[:2], max_new_tokens=6, do_sample=True, assistant_model=_both(helper)[1])
    capsys.readouterr()
    assert main(["generate", *PROMPTS[:2], "-m", str(root), "--assistant", str(helper), "--max-new-tokens", "6",
                 "--sample", "--seed", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == reference


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_early_exit_drafts_with_the_model_s_first_layers(family, tmp_path):
    """``assistant_early_exit=1`` (transformers' EarlyExitCandidateGenerator): the model drafts through its first
    layer with a cache of its own and checks with all of them: ids and every forward of the backbone (drafts and
    checks alike) equal to transformers', greedy and sampled; the model's generation config holds the assistant's
    settings (3 drafts a round here, no confidence stop)."""
    pair = Assisted(family, tmp_path)
    ours, theirs = pair.main

    def same(**kwargs):
        torch.manual_seed(0)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference, their_lengths, _ = pair.run(1, lambda: theirs.generate(input_ids=pair.ids, **kwargs))
        torch.manual_seed(0)
        got, lengths, _ = pair.run(0, lambda: generate_ids(ours, pair.ids, **kwargs))
        assert torch.equal(got, reference) and lengths == their_lengths, kwargs
        return lengths
    settings = dict(assistant_early_exit=1, max_new_tokens=16, eos_token_id=[])
    lengths = same(**settings)
    assert len(lengths) > 16  # drafts and checks through the one backbone
    same(do_sample=True, temperature=0.7, **settings)
    for model in pair.main:
        model.generation_config.num_assistant_tokens = 3
        model.generation_config.assistant_confidence_threshold = 0.0
    same(**settings)


def test_early_exit_refusals(llama, tmp_path):
    """Early exit with an assistant model or prompt lookup (two sources of drafts), and on GPT-2, whose
    transformers forward runs every layer whatever the count (its early-exit drafts fail there): InputErrors."""
    ours = llama.main[0]
    for kwargs, needle in ((dict(assistant_model=llama.assistant[0]), "with assistant_model"),
                           (dict(prompt_lookup_num_tokens=2), "with prompt_lookup_num_tokens"),
                           (dict(assistant_early_exit=0), "assistant_early_exit=0"),
                           (dict(input_ids=llama.ids.repeat(2, 1)), "assistant_early_exit=1 decodes one prompt")):
        with pytest.raises(InputError, match=needle):
            generate_ids(ours, **{"input_ids": llama.ids, "max_new_tokens": 4, "assistant_early_exit": 1, **kwargs})
    gpt2 = Assisted("gpt2", tmp_path)
    with pytest.raises(InputError, match="runs every layer"):
        generate_ids(gpt2.main[0], gpt2.ids, max_new_tokens=4, assistant_early_exit=1)
    with warnings.catch_warnings(), pytest.raises(IndexError):
        warnings.simplefilter("ignore")
        gpt2.main[1].generate(input_ids=gpt2.ids, max_new_tokens=4, assistant_early_exit=1)


def _same_records(got, reference, field: str) -> None:
    mine, theirs = getattr(got, field), getattr(reference, field)
    assert mine is not None and len(mine) == len(theirs), field
    for step, (a, b) in enumerate(zip(mine, theirs)):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), (field, step)


def test_hidden_states_per_kept_token(llama):
    """``output_hidden_states`` with an assistant: each forward's records split per kept token as transformers'
    ``_split_model_outputs`` splits them (the prompt's block first), every tensor equal, greedy and sampled."""
    record = dict(return_dict_in_generate=True, output_hidden_states=True)
    for extra in ({}, dict(do_sample=True)):
        got, reference, main, _ = llama.same(seed=0, max_new_tokens=10, eos_token_id=[], **record, **extra)
        _same_records(got, reference, "hidden_states")
        assert len(got.hidden_states) == 10 and len(main) < 10  # one record per new token, fewer forwards
