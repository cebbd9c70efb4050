"""``zero_shot`` against transformers' zero-shot-classification pipeline, on NLI-style checkpoints built here.

As for ``classify`` (tests/test_tasks.py, tests/test_batching.py): with ``batch_size=1`` every (sequence,
hypothesis) pair is forwarded alone, as the pipeline forwards it, and the output is equal (``==``). With the
automatic, padding-free batches, every batch formed is run through transformers' model too: the logits are
``torch.equal`` and the pipeline's own ``postprocess`` on them gives our output exactly; against the pipeline's
one-pair passes, labels keep their order and scores move by batch-shape noise only (<= 1e-6, the bound the
batching tests measured and allow). Label orders are those of real MNLI checkpoints: lowercase
contradiction/neutral/entailment (bart-large-mnli), uppercase (roberta-large-mnli) and entailment first
(MoritzLaurer's DeBERTa-v3 NLI models), which takes the pipeline's other contradiction column.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flodl_hf import InputError, zero_shot
from flodl_hf.tasks import batching
from flodl_hf.tasks.batching import BatchPolicy
from flodl_hf.tasks import load
from flodl_hf.tasks.runtime import _MODEL_KEYS, _accepted, _encode, _rows
from helpers import one_thread, quiet_transformers  # noqa: F401  (the fixture)
from test_batching import WIDE, texts
from test_tasks import TEXTS, TOKENIZERS, flodl_hf_command, pipeline, short_copy, task_dir

pytestmark = pytest.mark.usefixtures("one_thread")

BART_MNLI = {0: "contradiction", 1: "neutral", 2: "entailment"}
ROBERTA_MNLI = {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}
DEBERTA_V3_NLI = {0: "entailment", 1: "neutral", 2: "contradiction"}
LABELS = ["sport", "politics", "cooking", "travel"]


def nli_dir(id2label: dict, tokenizer: str = TOKENIZERS[0], **config):
    """A seqcls checkpoint with these labels; label2id written too, as real NLI checkpoints ship it
    (transformers 5.24 reads no label2id from id2label, and its pipeline then fails: see
    test_config_without_label2id_reads_id2label)."""
    return task_dir(tokenizer, "seqcls", id2label=id2label, label2id={v: k for k, v in id2label.items()}, **config)


CASES = {"bert": (BART_MNLI, TOKENIZERS[0], {}),
         "roberta": (ROBERTA_MNLI, TOKENIZERS[1], dict(model_type="roberta", max_position_embeddings=130))}


@pytest.mark.parametrize("case", list(CASES))
def test_zero_shot_matches_pipeline(case):
    id2label, tokenizer, config = CASES[case]
    directory = nli_dir(id2label, tokenizer, **config)
    pipe = pipeline("zero-shot-classification", directory)
    one = dict(batch_size=1)
    assert zero_shot(TEXTS[0], LABELS, directory, **one) == pipe(TEXTS[0], candidate_labels=LABELS)
    assert zero_shot(TEXTS, LABELS, directory, **one) == pipe(TEXTS, candidate_labels=LABELS)
    assert zero_shot(TEXTS, LABELS, directory, multi_label=True, **one) == \
        pipe(TEXTS, candidate_labels=LABELS, multi_label=True)
    # a comma-separated string, stripped; one label (scored as multi-label, as there); a template of one's own
    assert zero_shot(TEXTS[1], "sport, politics ,, cooking", directory, **one) == \
        pipe(TEXTS[1], candidate_labels="sport, politics ,, cooking")
    assert zero_shot(TEXTS[:2], ["sport"], directory, **one) == pipe(TEXTS[:2], candidate_labels=["sport"])
    template = "The topic of this text is {}."
    assert zero_shot(TEXTS[2], LABELS, directory, hypothesis_template=template, **one) == \
        pipe(TEXTS[2], candidate_labels=LABELS, hypothesis_template=template)
    assert zero_shot([TEXTS[3]], LABELS, directory, **one) == pipe([TEXTS[3]], candidate_labels=LABELS)  # a list of one


def test_batched_pairs_equal_transformers_on_those_batches():
    """BERT-base width (where a changed op order would show), entailment first. Every batch the planner forms
    (padded or not) goes through transformers' model too; the pipeline's postprocess on those logits is our
    output, and the pipeline's own one-pair passes differ by batch-shape noise only."""
    transformers = quiet_transformers()
    directory = nli_dir(DEBERTA_V3_NLI, **WIDE)
    loaded = load(directory, "seqcls")
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(str(directory), dtype=torch.float32).eval()
    pipe = transformers.pipeline("zero-shot-classification", model=theirs,
                                 tokenizer=transformers.AutoTokenizer.from_pretrained(str(directory)), device="cpu")
    items, labels = texts(24, seed=7), LABELS[:3]
    seen = []
    hook = loaded.model.register_forward_hook(lambda m, args, kwargs, out: seen.append((kwargs, out.logits)),
                                              with_kwargs=True)
    try:
        ours = {multi: zero_shot(items, labels, directory, multi_label=multi) for multi in (False, True)}
    finally:
        hook.remove()
    # The planner's batches, in the order they ran (the same for both calls): pair k*3 + j is text k, label j
    enc = _encode(loaded, [t for t in items for _ in labels], [f"This example is {x}." for x in labels] * len(items),
                  truncation="only_first")
    keys = [k for k in batching.MODEL_INPUTS if k in _accepted(loaded.model)]
    formed = list(batching.batches(_rows(enc, _MODEL_KEYS), loaded.tokenizer, BatchPolicy.for_model(loaded.model),
                                   keys))
    assert len(seen) == 2 * len(formed)
    for (kwargs, got), (again, second) in zip(seen, seen[len(formed):]):  # the multi_label call: the same passes
        assert all(torch.equal(kwargs[k], again[k]) for k in kwargs) and torch.equal(got, second)
    assert any(not bool(b["attention_mask"].all()) for _, b in formed) and any(len(i) > 1 for i, _ in formed)
    logits = {}
    with torch.inference_mode():
        for (indices, batch), (kwargs, got) in zip(formed, seen):
            assert all(torch.equal(batch[k], kwargs[k]) for k in batch)
            reference = theirs(**batch).logits
            assert torch.equal(got, reference), f"batch of {len(indices)} x {batch['input_ids'].shape[1]}"
            logits.update({i: reference[j:j + 1] for j, i in enumerate(indices)})
    for multi, results in ours.items():
        expected = [pipe.postprocess([{"candidate_label": label, "sequence": text, "logits": logits[k * 3 + j]}
                                      for j, label in enumerate(labels)], multi_label=multi)
                    for k, text in enumerate(items)]
        assert results == expected, multi
        piped = pipe(items, candidate_labels=labels, multi_label=multi)  # one pair per pass
        assert [r["labels"] for r in results] == [r["labels"] for r in piped]
        assert max(abs(a - b) for x, y in zip(results, piped) for a, b in zip(x["scores"], y["scores"])) <= 1e-6
    assert zero_shot(items[:6], labels, directory, batch_size=1) == pipe(items[:6], candidate_labels=labels)


def test_zero_shot_refuses_what_the_pipeline_refuses():
    directory = nli_dir(BART_MNLI)
    pipe = pipeline("zero-shot-classification", directory)
    with pytest.raises(ValueError, match="was not able to be formatted"):
        pipe(TEXTS[0], candidate_labels=LABELS, hypothesis_template="No place for a label.")
    with pytest.raises(InputError, match=r'^hypothesis_template="No place for a label\." was not able to be formatted'):
        zero_shot(TEXTS[0], LABELS, directory, hypothesis_template="No place for a label.")
    for template in ("About {label}.", "About {1}.", "About {.", 42):  # the pipeline: KeyError, IndexError...
        with pytest.raises(InputError, match=r"^hypothesis_template="):
            zero_shot(TEXTS[0], LABELS, directory, hypothesis_template=template)
    with pytest.raises(ValueError, match="at least one label"):
        pipe(TEXTS[0], candidate_labels=" , ")
    for empty in ([], " , ", ""):
        with pytest.raises(InputError, match="^candidate_labels is empty"):
            zero_shot(TEXTS[0], empty, directory)
    with pytest.raises(InputError, match="^candidate_labels=None"):
        zero_shot(TEXTS[0], None, directory)
    with pytest.raises(InputError, match=r"^sequences\[1\] is empty"):
        zero_shot([TEXTS[0], ""], LABELS, directory)
    assert zero_shot([], LABELS, directory) == []  # (the pipeline: IndexError)


def test_no_entailment_label_warns_and_reads_the_last_logit():
    """As the pipeline: a warning, then id -1 (the last logit) as entailment and column 0 as contradiction."""
    directory = nli_dir({0: "NEG", 1: "POS", 2: "NEU"})
    pipe = pipeline("zero-shot-classification", directory)
    for multi in (False, True):
        with pytest.warns(UserWarning, match="Failed to determine 'entailment' label id"):
            ours = zero_shot(TEXTS, LABELS, directory, multi_label=multi, batch_size=1)
        assert ours == pipe(TEXTS, candidate_labels=LABELS, multi_label=multi)


def test_config_without_label2id_reads_id2label(tmp_path):
    """A config.json with id2label only (label2id absent or null): transformers 5.24 leaves label2id None and
    its pipeline fails (AttributeError); we derive label2id from id2label, as transformers 4 did."""
    directory = nli_dir(BART_MNLI)
    edited = tmp_path / "no-label2id"
    shutil.copytree(directory, edited)
    config = json.loads((edited / "config.json").read_text())
    config.pop("label2id")
    (edited / "config.json").write_text(json.dumps(config))
    assert zero_shot(TEXTS, LABELS, edited) == zero_shot(TEXTS, LABELS, directory)


def test_long_sequences_are_cut_never_the_hypothesis():
    directory = short_copy(nli_dir(BART_MNLI), 24)
    pipe = pipeline("zero-shot-classification", directory)
    long = " ".join(TEXTS * 3)
    assert zero_shot([long, TEXTS[0]], LABELS, directory, batch_size=1) == \
        pipe([long, TEXTS[0]], candidate_labels=LABELS)
    # a hypothesis that fills the model alone: the pipeline retries untruncated and fails in the model
    template = "This example, which is a long hypothesis about many things and more words, is {}."
    with pytest.raises(InputError, match=r"^hypothesis_template=.*leaves no room for the sequence"):
        zero_shot(long, LABELS, directory, hypothesis_template=template)


def test_cli_zero_shot_json_matches_library(capsys):
    directory = str(nli_dir(BART_MNLI))
    done = flodl_hf_command("zero-shot", *TEXTS[:2], "--labels", "sport, politics,cooking", "--multi-label",
                            "--template", "It is about {}.", "--model", directory, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == zero_shot(TEXTS[:2], "sport, politics,cooking", directory, multi_label=True,
                                                hypothesis_template="It is about {}.")
    from flodl_hf.cli import main
    assert main(["zero-shot", TEXTS[0], "--labels", "sport,politics", "--template", "no slot",
                 "--model", directory]) == 2
    assert "error: hypothesis_template=" in capsys.readouterr().err
