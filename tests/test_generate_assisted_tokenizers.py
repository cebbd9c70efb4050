"""An assistant with another tokenizer (``generate_ids(..., assistant_model=small, tokenizer=t,
assistant_tokenizer=t2)``, greedy): transformers 5.25's universal assisted decoding
(``AssistedCandidateGeneratorDifferentTokenizers``), against transformers in the same run.

The model: a LLaMA over the botchan BPE tokenizer (1,000 ids), its final norm scaled up so that its choices are
firm. Two assistants: the same model with 24 more ids and noise on every weight, over the same tokenizer (so its
drafts often agree and go through text both ways), and a random LLaMA over botchan's unigram tokenizer (another
segmentation, 1,003 ids, so the runs both hold are short and tokens are replaced). Checked: the ids equal
transformers' greedy generate, and its assisted generate's wherever that one runs to the end; every round's
drafts equal transformers' greedy generate of the assistant on that round's ids (so the assistant's cache, kept
across rounds, holds the right states); the model's forwards, and the drafts that are kept."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from flodl_hf.core.errors import InputError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.core.samples import sample_path
from flodl_hf.tokenization import Tokenizer

from helpers import make_checkpoint, one_thread  # noqa: F401  (the fixture)
from test_decoder import SMALL, _fields
from test_generate_assisted import _variant
from test_generate_defaults import _both
from test_generate_lookup import Forwards

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "It was the fourth day of my stay in the country, and the"


def _with_tokenizer(root, kind: str):
    shutil.copy(sample_path("botchan") / f"botchan_en_{kind}_1000.model", root / "tokenizer.model")
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return root


def _resized(source, out, vocab: int):
    """``source`` with ``vocab`` ids (the new rows drawn by transformers' resize) and noise on every weight."""
    import transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    torch.manual_seed(0)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    model.save_pretrained(out)
    return _variant(out, out, 0.1, 1.0)


class Pair:
    """The model and an assistant, ours and transformers', with both tokenizers (transformers' and ours)."""

    def __init__(self, root, kind: str) -> None:
        fields = {**_fields(SMALL["llama"]), "vocab_size": 1000, "tie_word_embeddings": False, "pad_token_id": 0,
                  "bos_token_id": 1, "eos_token_id": 2}
        main = _with_tokenizer(_variant(make_checkpoint(fields, "causal_lm"), root / "main", 0.0, 10.0), "bpe")
        if kind == "bpe":
            assistant = _with_tokenizer(_resized(main, root / "assistant", 1024), "bpe")
        else:
            assistant = root / "assistant"
            shutil.copytree(make_checkpoint({**fields, "vocab_size": 1003}, "causal_lm", seed=7), assistant)
            _with_tokenizer(assistant, "unigram")
        import transformers
        self.paths = main, assistant
        self.main, self.assistant = _both(main), _both(assistant)
        self.theirs_tok = [transformers.AutoTokenizer.from_pretrained(str(p)) for p in (main, assistant)]
        self.ours_tok = [Tokenizer.from_pretrained(str(p)) for p in (main, assistant)]
        self.forwards = [Forwards(self.main[0].backbone), Forwards(self.main[1].base_model),
                         Forwards(self.assistant[0].backbone), Forwards(self.assistant[1].base_model)]

    def ids(self, text: str = TEXT) -> torch.Tensor:
        return self.theirs_tok[0](text, return_tensors="pt")["input_ids"]

    def same(self, ids, tokenizers: str = "ours", **kwargs):
        """Ours against transformers' plain greedy generate, and against its assisted generate where that runs;
        every round's drafts against the assistant's own greedy generate. Returns ours, the model's forward lengths
        and whether transformers' assisted generate failed."""
        from flodl_hf.generation import assisted
        rounds = []
        draft = assisted.TranslatedDrafts._draft

        def recorded(drafts, ids, most, last_length):
            out = draft(drafts, ids, most, last_length)
            rounds.append((ids, out[0]))
            return out
        tok, assistant_tok = self.ours_tok if tokenizers == "ours" else self.theirs_tok
        for f in self.forwards:
            f.lengths = []
        assisted.TranslatedDrafts._draft = recorded
        try:
            got = generate_ids(self.main[0], ids, assistant_model=self.assistant[0], tokenizer=tok,
                               assistant_tokenizer=assistant_tok, **kwargs)
        finally:
            assisted.TranslatedDrafts._draft = draft
        main = list(self.forwards[0].lengths)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = self.main[1].generate(input_ids=ids, **kwargs)
            assert torch.equal(got, plain), kwargs
            for before, after in rounds:  # eos ids stop the drafts; the tokens are the assistant's greedy ones
                own = self.assistant[1].generate(input_ids=before, max_new_tokens=after.shape[1] - before.shape[1],
                                                 eos_token_id=[], do_sample=False)
                assert torch.equal(after, own[:, :after.shape[1]])
            with _Rounds() as theirs:
                try:
                    reference = self.main[1].generate(input_ids=ids, assistant_model=self.assistant[1],
                                                      tokenizer=self.theirs_tok[0],
                                                      assistant_tokenizer=self.theirs_tok[1], **kwargs)
                except RuntimeError:  # its assistant's cache crop (see TranslatedDrafts)
                    reference = None
        # each round's ids for the assistant equal transformers' until its cache holds states of replaced tokens
        for (ours, _), (their_ids, sound) in zip(rounds, theirs.rounds):
            assert torch.equal(ours, their_ids), kwargs
            if not sound:
                break
        self.compared += 1 + sum(sound for _, sound in theirs.rounds[:len(rounds)])
        if reference is None:
            return got, main, True
        assert torch.equal(got, reference), kwargs
        return got, main, False

    compared = 0  # rounds whose ids were compared with transformers'

    def configure(self, **fields) -> None:
        for assistant in self.assistant:
            for name, value in fields.items():
                setattr(assistant.generation_config, name, value)


class _Rounds:
    """transformers' AssistedCandidateGeneratorDifferentTokenizers, watched: each round's ids for the assistant, and
    whether its cache, once cropped, holds only states of ids those start with ("sound")."""

    def __enter__(self):
        from transformers.generation.candidate_generator import AssistedCandidateGeneratorDifferentTokenizers as C
        self.cls, self.rounds, self.saved = C, [], (C._prepare_assistant_input_ids, C._update_past_and_masks)
        prepare, update = self.saved
        rounds = self.rounds

        def prepared(generator, input_ids):
            before = generator.prev_assistant_ids
            before = None if before is None else before.clone()
            ids, extra = prepare(generator, input_ids)
            generator._watched = (before, ids.clone())
            return ids, extra

        def updated(generator, ids, extra=0):
            out = update(generator, ids, extra)
            before, mine = generator._watched
            cache = generator.assistant_kwargs.get("cache")
            held = 0 if cache is None else cache.get_seq_length()
            n = 0 if before is None else min(before.shape[1] - 1, mine.shape[1])
            shared = n if before is None else next(
                (i for i in range(n) if before[0, i] != mine[0, i]), n)
            rounds.append((mine, held <= shared))
            return out
        C._prepare_assistant_input_ids, C._update_past_and_masks = prepared, updated
        return self

    def __exit__(self, *exc):
        self.cls._prepare_assistant_input_ids, self.cls._update_past_and_masks = self.saved


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def pair(request, tmp_path_factory):
    return Pair(tmp_path_factory.mktemp(f"uad-{request.param}"), request.param)


def test_greedy_equals_transformers(pair):
    """A prompt longer than the lookbehind of 10 and one shorter (re-converted whole every round), with our
    tokenizers and with transformers'; the schedules, other lookbehinds, an eos and a confidence threshold of 0.9.
    With the BPE assistant drafts are kept, and transformers' own assisted generate fails on the long prompt (its
    assistant fed nothing after the crop)."""
    kept, failed = 0, []
    for text in (TEXT, "It was the"):
        ids = pair.ids(text)
        for tokenizers in ("ours", "transformers"):
            got, main, broke = pair.same(ids, tokenizers, max_new_tokens=24, eos_token_id=[])
            kept += got.shape[1] - ids.shape[1] - len(main)
            failed.append(broke)
    if pair.assistant[0].config.vocab_size == 1024:
        assert kept > 0 and failed[0]
    for schedule in ("heuristic", "constant"):
        pair.configure(num_assistant_tokens_schedule=schedule, num_assistant_tokens=3)
        pair.same(pair.ids(), max_new_tokens=16, eos_token_id=[])
    pair.configure(num_assistant_tokens=20, target_lookbehind=4, assistant_lookbehind=3)
    pair.same(pair.ids(), max_new_tokens=12, eos_token_id=[])
    pair.configure(target_lookbehind=None, assistant_lookbehind=None, assistant_confidence_threshold=0.9)
    ids = pair.ids()
    free, _, _ = pair.same(ids, max_new_tokens=16, eos_token_id=[])
    pair.configure(assistant_confidence_threshold=None)
    stop = int(free[0, ids.shape[1] + 5])
    got, _, _ = pair.same(ids, max_new_tokens=16, eos_token_id=stop, pad_token_id=0)
    assert got.shape[1] <= ids.shape[1] + 6
    assert pair.compared >= 20


def test_refusals(pair):
    """What transformers refuses (no tokenizers for another vocabulary; an assistant tokenizer for the same one)
    and what is not implemented (sampling: universal speculative decoding; a minimum length; logits processors that
    would run over the assistant's vocabulary) are InputErrors, before any forward."""
    ours, assistant = pair.main[0], pair.assistant[0]
    ids = pair.ids()
    with warnings.catch_warnings(), pytest.raises(ValueError, match="different tokenizers"):
        warnings.simplefilter("ignore")
        pair.main[1].generate(input_ids=ids, assistant_model=pair.assistant[1], max_new_tokens=4)
    tokenizers = dict(tokenizer=pair.ours_tok[0], assistant_tokenizer=pair.ours_tok[1])
    cases = [(dict(assistant_model=assistant), "pass tokenizer= and assistant_tokenizer="),
             (dict(assistant_model=ours, **tokenizers), "no second tokenizer is needed"),
             (dict(assistant_model=assistant, do_sample=True, **tokenizers), "universal speculative decoding"),
             (dict(assistant_model=assistant, min_new_tokens=3, **tokenizers), "a minimum length"),
             (dict(assistant_model=assistant, repetition_penalty=1.2, **tokenizers), "logits processors"),
             (dict(assistant_tokenizer=pair.ours_tok[1]), "without assistant_model")]
    for kwargs, needle in cases:
        pair.forwards[0].lengths = []
        with pytest.raises(InputError, match=needle):
            generate_ids(ours, ids, max_new_tokens=4, **kwargs)
        assert pair.forwards[0].lengths == []


def test_the_pipeline_one_liner_takes_an_assistant_tokenizer(pair, capsys):
    """``generate(prompts, model, assistant_model=..., do_sample=False)`` with an assistant of another tokenizer: the
    pipeline's ``load_assistant_model`` (the source's own tokenizer, or ``assistant_tokenizer=`` with a model; a model
    without one is refused, as there). The records equal the pipeline's with the same assistant (or, where
    transformers' assisted generate fails, the pipeline's without one: greedy drafts change no id), and the assistant
    drafted; so do ``flodl-hf generate``'s with ``--assistant DIR --no-sample``."""
    from flodl_hf.tasks.generate import generate
    from flodl_hf.roundtrip.parity import quiet_transformers
    main, assistant = pair.paths
    prompts, settings = [TEXT, "It was the"], dict(max_new_tokens=12, do_sample=False)
    pipeline = quiet_transformers().pipeline
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            reference = pipeline("text-generation", model=str(main), assistant_model=str(assistant))(prompts,
                                                                                                       **settings)
        except RuntimeError:  # its assistant's cache crop (see TranslatedDrafts)
            reference = pipeline("text-generation", model=str(main))(prompts, **settings)
        with pytest.raises(ValueError, match="different tokenizer"):
            pipeline("text-generation", model=str(main), assistant_model=pair.assistant[1])
    from flodl_hf.generation import assisted
    start, used = assisted.TranslatedDrafts.__init__, []

    def recorded(drafts, *args):
        start(drafts, *args)
        used.append((drafts.tokenizer, drafts.assistant_tokenizer))
    assisted.TranslatedDrafts.__init__ = recorded
    try:
        for given in (dict(assistant_model=str(assistant)),
                      dict(assistant_model=pair.assistant[0], assistant_tokenizer=pair.ours_tok[1])):
            used.clear()
            assert generate(prompts, str(main), **given, **settings) == reference
            assert len(used) == len(prompts)  # one prompt at a time, each drafting through text
            for tokenizers in used:  # the model's tokenizer and the assistant's own
                for tok, own in zip(tokenizers, pair.ours_tok):
                    assert torch.equal(torch.as_tensor(tok(TEXT)["input_ids"]), own(TEXT)["input_ids"])
    finally:
        assisted.TranslatedDrafts.__init__ = start
    with pytest.raises(InputError, match="pass assistant_tokenizer="):
        generate(prompts, str(main), assistant_model=pair.assistant[0], **settings)
    with pytest.raises(InputError, match="pipeline's default.*pass do_sample=False"):
        generate(prompts, str(main), assistant_model=str(assistant), max_new_tokens=4)
    from flodl_hf.cli import main as cli  # flodl-hf generate --assistant DIR --no-sample: the same records
    capsys.readouterr()
    assert cli(["generate", *prompts, "-m", str(main), "--assistant", str(assistant), "--no-sample",
                "--max-new-tokens", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == reference
    with pytest.raises(InputError, match="without assistant_model"):
        generate(prompts, str(main), assistant_tokenizer=pair.ours_tok[1], **settings)
