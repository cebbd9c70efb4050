"""Padding-free batching (flodl_hf.tasks.batching) and the fast paths of the tasks.

The planner is checked on its own (every text once, longest first, equal lengths together, limits
kept, cuts optimal for its cost model). Then exactness: the batches the tasks form, padded or not,
are run through transformers' model, and our model and the tasks' outputs must equal its outputs
on exactly those batches (``torch.equal``; BERT-base width, since tiny widths hide float differences:
PARITY_NOTES.md). No timings here: speed is measured by scripts/bench.py.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys

import pytest
import torch

from flodl_hf import InputError, answer, classify, embed, fill_mask, tag
from flodl_hf.tasks import batching
from flodl_hf.tasks.batching import BatchPolicy, padded_tokens, plan
from flodl_hf.tasks.runtime import _encode
from flodl_hf.tasks import load
from cases import CASES
from helpers import make_checkpoint, quiet_transformers
from test_tasks import CONTEXT, LABELS, QUESTIONS, TOKENIZERS, task_dir

# BERT-base width (2 layers keep it fast): where a changed op order or kernel would show.
WIDE = dict(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072,
            max_position_embeddings=128)
# One token each in the test WordPiece vocabulary, so word counts set token counts.
WORDS = ("paris is the capital of france berlin germany quick brown fox jumps over lazy dog john smith new "
         "york google mary anne read a book morning").split()


def texts(n: int = 240, seed: int = 0) -> list[str]:
    """Short messages: most of three common lengths (batches without padding), and a tail of rare
    lengths (which the planner pads into shared batches), like SMS."""
    rng = random.Random(seed)
    lengths = [rng.choice((4, 9, 14)) if rng.random() < 0.8 else rng.randint(20, 60) for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(k)) for k in lengths]


# ---- the planner ------------------------------------------------------------------------------------

def cost(lengths, batches, policy):
    total = 0.0
    for b in batches:
        width = max(lengths[i] for i in b)
        total += len(b) * width * (1 + width / policy.attention_width) + policy.batch_cost
    return total


def test_plan_covers_every_text_once_longest_first():
    rng = random.Random(1)
    lengths = [rng.choice((7, 7, 7, 12, 12, 30)) if rng.random() < 0.7 else rng.randint(3, 200) for _ in range(500)]
    batches = plan(lengths)
    assert sorted(i for b in batches for i in b) == list(range(500))
    widths = [max(lengths[i] for i in b) for b in batches]
    assert widths == sorted(widths, reverse=True)
    for b in batches:  # ties keep input order inside the sorted run
        assert [(-lengths[i], i) for i in b] == sorted((-lengths[i], i) for i in b)
    # Most texts of a common length are not padded (a group over max_tokens may spill into a wider batch)
    width_of = {i: max(lengths[j] for j in b) for b in batches for i in b}
    for common in (7, 12, 30):
        rows = [i for i in range(500) if lengths[i] == common]
        assert sum(width_of[i] == common for i in rows) >= 0.7 * len(rows)
    assert padded_tokens(lengths, batches) <= 1.05 * sum(lengths)


def test_plan_respects_limits():
    lengths = [5] * 100 + [300] + [40] * 30
    for b in plan(lengths, BatchPolicy(max_tokens=128)):
        width = max(lengths[i] for i in b)
        assert len(b) * width <= 128 or len(b) == 1  # a text longer than the budget runs alone
    assert all(len(b) <= 7 for b in plan(lengths, BatchPolicy(max_rows=7)))
    assert plan(lengths, BatchPolicy(max_rows=1)) == [[i] for i in sorted(range(131), key=lambda i: (-lengths[i], i))]
    assert plan([]) == []
    with pytest.raises(InputError, match="batch_size=0"):
        BatchPolicy(max_rows=0)


def test_plan_is_optimal_for_its_cost_model():
    """Against every contiguous partition of the sorted order (exhaustive, small inputs)."""
    rng = random.Random(2)
    for trial in range(30):
        n = rng.randint(1, 9)
        lengths = [rng.choice((4, 4, 9, 16, 17, 40, 120)) for _ in range(n)]
        policy = BatchPolicy(max_tokens=rng.choice((64, 200, 4096)), batch_cost=rng.choice((0.0, 30.0, 300.0)),
                             max_rows=rng.choice((None, 2, 4)))
        order = sorted(range(n), key=lambda i: (-lengths[i], i))
        best = float("inf")
        for cuts in itertools.product((False, True), repeat=n - 1):
            batches, current = [], [order[0]]
            for cut, i in zip(cuts, order[1:]):
                if cut:
                    batches.append(current)
                    current = []
                current.append(i)
            batches.append(current)
            if all((len(b) * lengths[b[0]] <= policy.max_tokens or len(b) == 1)
                   and len(b) <= (policy.max_rows or n) for b in batches):
                best = min(best, cost(lengths, batches, policy))
        assert cost(lengths, plan(lengths, policy), policy) == pytest.approx(best), (lengths, policy)


def test_policy_follows_the_model_width():
    directory = task_dir(TOKENIZERS[0], "seqcls", problem_type="single_label_classification",
                         id2label=LABELS["seqcls"])
    model = load(directory, "seqcls").model
    assert BatchPolicy.for_model(model).attention_width == 2 * 32 + 64
    assert BatchPolicy.for_model(model, 4).max_rows == 4


# ---- exactness on the batches we form -------------------------------------------------------------------

def _ours_and_theirs(task: str, tokenizer: str = TOKENIZERS[0]):
    transformers = quiet_transformers()
    extra = {"problem_type": "single_label_classification", "id2label": LABELS["seqcls"]} if task == "seqcls" else {}
    directory = task_dir(tokenizer, task, **WIDE, **extra)
    cls = {"seqcls": transformers.AutoModelForSequenceClassification, "mlm": transformers.AutoModelForMaskedLM}[task]
    theirs = cls.from_pretrained(str(directory), dtype=torch.float32).eval()  # sdpa, the default of both
    return directory, load(directory, task), theirs


def _formed_batches(loaded, items):
    enc = _encode(loaded, items)  # as the tasks tokenise: truncated to the limit, where there is one
    rows = [{k: enc[k][i] for k in batching.MODEL_INPUTS if k in enc} for i in range(len(items))]
    policy = BatchPolicy.for_model(loaded.model)
    return list(batching.batches(rows, loaded.tokenizer, policy)), enc


@pytest.mark.parametrize("task", ["seqcls", "mlm"])
def test_every_formed_batch_equals_transformers_on_that_batch(task):
    directory, loaded, theirs = _ours_and_theirs(task)
    items = texts()
    if task == "mlm":
        items = [t.replace(" ", " [MASK] ", 1) if " " in t else t + " [MASK]" for t in items]
    formed, enc = _formed_batches(loaded, items)
    padded = [b for _, b in formed if not bool(b["attention_mask"].all())]
    assert padded and len(padded) < len(formed), "want both padded and padding-free batches in the plan"
    expected = {}
    with torch.inference_mode():
        for indices, batch in formed:
            a, b = loaded.model(**batch).logits, theirs(**batch).logits
            assert torch.equal(a, b), f"batch of {len(indices)} x {batch['input_ids'].shape[1]}"
            for j, i in enumerate(indices):
                expected[i] = b[j, :len(enc["input_ids"][i])]

    # The task, end to end, returns exactly those batch outputs, in input order.
    if task == "seqcls":
        ours = classify(items, directory, top_k=None, function_to_apply="none")
        for i, result in enumerate(ours):
            logits = expected[i].tolist()
            assert {r["label"]: r["score"] for r in result} == \
                {LABELS["seqcls"][k]: logits[k] for k in range(len(logits))}, i
    else:
        ours = fill_mask(items, directory, top_k=3)
        mask_id = loaded.tokenizer.mask_token_id
        for i, result in enumerate(ours):
            position = enc["input_ids"][i].index(mask_id)
            values, tokens = expected[i][position].softmax(-1).topk(3)
            assert [r["token"] for r in result] == tokens.tolist(), i
            assert [r["score"] for r in result] == values.tolist(), i


REFERENCE = {"tokcls": "AutoModelForTokenClassification", "qa": "AutoModelForQuestionAnswering",
             "base": "AutoModel"}


@pytest.mark.parametrize("task", list(REFERENCE))
def test_every_task_batch_equals_transformers_on_that_batch(task):
    """tag, answer (its context windows, batched across questions) and embed: every batch the task forms
    is recorded as our model receives it, and transformers' model on exactly that batch gives the same
    bits in every output field."""
    transformers = quiet_transformers()
    extra = {"id2label": LABELS["tokcls"]} if task == "tokcls" else {}
    directory = task_dir(TOKENIZERS[0], task, **WIDE, **extra)
    loaded = load(directory, task)
    theirs = getattr(transformers, REFERENCE[task]).from_pretrained(str(directory), dtype=torch.float32).eval()
    seen = []
    hook = loaded.model.register_forward_hook(lambda m, args, kwargs, out: seen.append((kwargs, out)),
                                              with_kwargs=True)
    try:
        if task == "tokcls":
            tag(texts(60, seed=5), directory)
        elif task == "qa":
            answer(QUESTIONS, CONTEXT, directory, max_seq_len=48, doc_stride=16)
        else:
            embed(texts(60, seed=6), directory)
    finally:
        hook.remove()
    assert seen, "the task ran no batch"
    assert any(not bool(kw["attention_mask"].all()) for kw, _ in seen), "want a padded batch among them"
    if task == "qa":
        assert max(kw["input_ids"].shape[0] for kw, _ in seen) > 1, "want windows batched together"
    with torch.inference_mode():
        for kwargs, ours in seen:
            reference = theirs(**kwargs)
            for name in ours.keys():
                assert torch.equal(ours[name], reference[name]), (name, tuple(kwargs["input_ids"].shape))


def test_batch_size_caps_rows_and_one_is_alone():
    directory = task_dir(TOKENIZERS[0], "seqcls", problem_type="single_label_classification",
                         id2label=LABELS["seqcls"])
    items = texts(40, seed=3)
    automatic = classify(items, directory, top_k=None)
    for size in (1, 4):
        capped = classify(items, directory, top_k=None, batch_size=size)
        assert [[r["label"] for r in x] for x in capped] == [[r["label"] for r in x] for x in automatic]
        assert max(abs(a["score"] - b["score"]) for x, y in zip(capped, automatic) for a, b in zip(x, y)) <= 1e-6


# ---- opt-in precisions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_fast_precisions_are_opt_in_and_close(precision):
    directory = task_dir(TOKENIZERS[0], "seqcls", problem_type="single_label_classification",
                         id2label=LABELS["seqcls"])
    items = texts(24, seed=4)
    exact = classify(items, directory, top_k=None)
    assert classify(items, directory, top_k=None, precision="exact") == exact
    fast = classify(items, directory, top_k=None, precision=precision)
    by_label = [{r["label"]: r["score"] for r in x} for x in fast]
    diff = max(abs(r["score"] - scores[r["label"]]) for x, scores in zip(exact, by_label) for r in x)
    assert 0 < diff < 0.1  # it does change scores (so it must stay opt-in), but not grossly
    if precision == "int8":  # a quantised copy; the exact model stays as it was
        assert load(directory, "seqcls", precision="int8").model is not load(directory, "seqcls").model
    with pytest.raises(InputError, match="precision='fp8'"):
        classify(items, directory, precision="fp8")


# ---- the load path -------------------------------------------------------------------------------------

def test_loading_and_tasks_do_not_import_transformers():
    directory = task_dir(TOKENIZERS[0], "seqcls", problem_type="single_label_classification",
                         id2label=LABELS["seqcls"])
    code = ("import sys, flodl_hf\n"
            f"flodl_hf.AutoModelForSequenceClassification.from_pretrained({str(directory)!r})\n"
            f"flodl_hf.classify(['a message', 'another one here'], {str(directory)!r})\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr


def test_meta_construction_skips_initialisers_only_on_meta():
    from flodl_hf.core.modeling import meta_device
    with meta_device():
        layer = torch.nn.Linear(4, 3)
        real = torch.zeros(5, device="cpu")
        torch.nn.init.normal_(real)
    assert layer.weight.is_meta and bool(real.ne(0).any())


# ---- the LM head on the masked tokens only ------------------------------------------------------------

MLM_CASES = [pytest.param(fields, id=case_id) for case_id, task, fields in CASES if task == "mlm"]


@pytest.mark.parametrize("fields", MLM_CASES)
def test_logits_at_equal_transformers_full_head(fields):
    """Every family's MLM variant: logits_at (the head on a few tokens) against transformers' logits of
    the whole batch at those tokens, on whatever CPU runs the test. Each batch shape is run four times,
    so every shape class is seen (full head, twice), proven (full head, checked against the gathered
    path) and then served from its verdict: the shortcut where this machine proved it equal, the full
    head where it did not. Both must give transformers' bits."""
    from flodl_hf.auto import load_model
    from flodl_hf.core.layers import PROVE_AT_SIGHTING, ROW_PROOFS
    from flodl_hf.roundtrip.parity import make_batch
    transformers = quiet_transformers()
    source = make_checkpoint(fields, "mlm")
    ours = load_model(source, "mlm").eval()
    theirs = transformers.AutoModelForMaskedLM.from_pretrained(str(source), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    ROW_PROOFS.clear()
    for lengths in ((16,), (24, 17), (9,) * 8, (5,), (5, 3, 5)):
        batch = make_batch(ours.config, "mlm", lengths=lengths)
        batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        with torch.inference_mode():
            full = theirs(**batch).logits
        for count in (1, 3, 9):
            for _ in range(PROVE_AT_SIGHTING + 1):  # seen, proven, served (new rows: the verdict is not per row)
                rows = torch.randint(0, len(lengths), (count,), generator=gen)
                columns = torch.tensor([int(torch.randint(0, lengths[r], (1,), generator=gen)) for r in rows])
                with torch.inference_mode():
                    got = ours.logits_at(rows, columns, **batch)
                assert torch.equal(got, full[rows, columns]), (lengths, count)
    summary = ROW_PROOFS.summary()
    assert summary["proven_equal"] + summary["proven_different"] >= 6, summary  # the proofs ran


def test_row_proofs_agree_with_a_direct_check_on_this_machine():
    """The verdicts come from this machine, not from a rule: for F.linear at BERT-base widths, the proof's
    verdict for each (full rows, gathered rows) class equals an independent check of every row at every
    block position."""
    from flodl_hf.core.layers import PROVE_AT_SIGHTING, RowProofs, gather_rows
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(30522, 768, generator=gen) * 0.02, torch.randn(30522, generator=gen)
    module = torch.nn.Linear(768, 30522)
    run = lambda x: torch.nn.functional.linear(x, weight, bias)  # noqa: E731
    proofs = RowProofs()
    verdicts = {}
    with torch.inference_mode():
        for full_rows, wanted in ((64, 1), (48, 17)):
            hidden = torch.randn(full_rows, 768, generator=gen)
            full = run(hidden)
            index = torch.arange(wanted)
            for _ in range(PROVE_AT_SIGHTING + 1):
                got = gather_rows(run, module, hidden, index, lambda: run(hidden), proofs=proofs)
                assert torch.equal(got, full[:wanted])
            m = -(-wanted // 8) * 8
            blocks = [(torch.arange(m) + s) % full_rows for s in range(full_rows)]
            direct = all(torch.equal(run(hidden[idx]), full[idx]) for idx in blocks)  # every row, as the proof
            verdict = [v for k, v in proofs.verdicts.items() if k[2] == full_rows and k[3] == m]
            assert len(verdict) == 1
            verdicts[(full_rows, m)] = verdict[0]
            assert verdict[0] == direct, (full_rows, m)
    print("row proofs on this machine:", verdicts)
