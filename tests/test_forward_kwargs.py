"""transformers' forward keywords and the forward inputs an audit found mishandled, against transformers in the run.

``output_hidden_states=True`` and ``return_dict=False`` are torch.equal to transformers' (every family's layer
loop, DeBERTa's ConvLayer, ALBERT's shared layers, ModernBERT's final norm); a ``head_mask`` and non-bool
options are typed errors naming the keyword (``output_attentions``: tests/test_output_attentions.py); ``position_ids`` are checked (type, dtype, shape, table);
DeBERTa-v2's regression logits and ModernBERT past ``max_position_embeddings`` equal transformers'.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.core.errors import InputError
from flodl_hf.roundtrip.parity import make_batch, reference_model
from flodl_hf.core.registry import get_family

from cases import CASES
from helpers import make_checkpoint, one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = {case_id: fields for case_id, _task, fields in CASES}


def _pair(variant: str, task: str, impl: str = "sdpa", **overrides):
    fields = {**FIELDS[f"{variant}-{task}"], **overrides}
    source = make_checkpoint(fields, task)
    family = get_family(fields["model_type"])
    impl = impl if impl in family.attn_implementations else family.attn_implementations[0]
    ours = load_model(source, task, dtype=torch.float32, attn_implementation=impl).eval()
    theirs = reference_model(source, task, impl if len(family.attn_implementations) > 1 else None)
    return ours, theirs, make_batch(ours.config, task)


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), where
        return
    assert isinstance(a, tuple) and isinstance(b, tuple), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} entries"
    for i, (x, y) in enumerate(zip(a, b)):
        _assert_same(x, y, f"{where}[{i}]")


HIDDEN_CASES = [
    ("bert-hd24", "base", "sdpa"), ("bert-hd24", "mc", "eager"), ("roberta-hd24", "seqcls", "sdpa"),
    ("deberta-v3-hd24", "base", "eager"), ("deberta-v2xl-conv", "seqcls", "eager"),
    ("deberta1-hd24", "base", "eager"), ("deberta1-c2p-embproj", "tokcls", "eager"),
    ("modernbert-bias-mean-hd24", "base", "sdpa"), ("modernbert-bias-mean-hd24", "mlm", "sdpa"),
    ("distilbert-sinusoidal-hd24", "qa", "sdpa"), ("electra-proj-hd24", "tokcls", "sdpa"),
    ("albert-groups-hd24", "base", "sdpa"), ("mpnet-hd24", "base", "eager"),
    ("roberta-prelayernorm-hd24", "mlm", "eager"), ("xlm-roberta-xl-hd24", "base", "sdpa"),
    # the decoders, through the same contract hook (use_cache=False: the tuple then holds no cache object)
    ("llama-hd24-bias-tied-llama3", "causal_lm", "sdpa"), ("mistral-hd24-window4", "causal_lm", "eager"),
    ("qwen2-hd24-sliding", "causal_lm", "sdpa"), ("qwen3-hd24-qknorm-sliding", "causal_lm", "eager"),
    ("phi3-hd24-partial-window4", "causal_lm", "sdpa"), ("gemma-hd24-scaled-bias", "causal_lm", "eager"),
    ("gemma2-hd24-softcap-sliding", "causal_lm", "eager"), ("gemma3_text-hd24-qknorm-2rope", "causal_lm", "sdpa"),
    ("gpt2-hd24", "causal_lm", "eager"), ("gpt2-hd24", "tokcls", "sdpa"),
    ("gpt_neox-hd24", "causal_lm", "sdpa"), ("gpt_neox-hd24-sequential", "tokcls", "eager"),
    ("olmo2-hd24-qknorm-postnorm", "causal_lm", "eager"), ("granite-hd24-multipliers", "causal_lm", "sdpa"),
    ("starcoder2-hd24-bias-window4", "causal_lm", "eager"), ("stablelm-hd24-qknorm-parallel", "tokcls", "sdpa"),
    ("gptj-hd24", "causal_lm", "eager"), ("gptj-hd24", "qa", "sdpa"),
    ("opt-hd24-postln-project", "causal_lm", "eager"), ("opt-hd24", "qa", "sdpa"),
    ("mixtral-hd24-4experts-top2", "causal_lm", "sdpa"), ("mixtral-hd24-4experts-top2", "tokcls", "eager"),
    ("qwen2_moe-hd24-4experts-norm-dense1", "causal_lm", "eager"), ("qwen2_moe-hd24-4experts-norm-dense1", "qa", "sdpa"),
    ("qwen3_moe-hd24-4experts-norm-bias-dense1", "causal_lm", "sdpa"),
    ("qwen3_moe-hd24-4experts-norm-bias-dense1", "tokcls", "eager"),
    ("olmoe-hd24-6experts-top3-clip", "causal_lm", "eager"), ("olmoe-hd24-4experts-norm-bias", "causal_lm", "sdpa"),
    ("phi-hd24-qknorm", "causal_lm", "eager"), ("olmo-hd24-clip-bias", "causal_lm", "sdpa"),
    ("cohere-hd24-qknorm-bias", "causal_lm", "eager"),
    ("smollm3-hd24-nope-sliding-bias", "causal_lm", "sdpa"), ("olmo3-hd24-sliding-2rope", "causal_lm", "eager"),
    ("ministral-hd24-window4-layertypes", "qa", "sdpa"),
]


@pytest.mark.parametrize("variant,task,impl", HIDDEN_CASES, ids=["-".join(c) for c in HIDDEN_CASES])
def test_hidden_states_and_tuples_equal_transformers(variant, task, impl):
    ours, theirs, batch = _pair(variant, task, impl)
    if task == "causal_lm":
        batch = {**batch, "use_cache": False}
    with torch.inference_mode():
        a, b = ours(**batch, output_hidden_states=True), theirs(**batch, output_hidden_states=True)
        layers = ours.backbone.num_layers() if task != "base" else ours.num_layers()
        assert len(a.hidden_states) == len(b.hidden_states) >= layers + 1
        _assert_same(a.hidden_states, b.hidden_states, "hidden_states")
        for name in a.keys():
            _assert_same(getattr(a, name), getattr(b, name), name)
        plain = ours(**batch)
        assert "hidden_states" not in plain.keys()
        for name in plain.keys():  # recording changes no other output
            _assert_same(getattr(a, name), getattr(plain, name), name)
        _assert_same(ours(**batch, return_dict=False), theirs(**batch, return_dict=False), "return_dict=False")
        _assert_same(ours(**batch, return_dict=False, output_hidden_states=True),
                     theirs(**batch, return_dict=False, output_hidden_states=True), "tuple with hidden states")
    assert type(pickle.loads(pickle.dumps(a))).__name__ == type(a).__name__


def test_false_and_none_options_change_nothing():
    ours, _theirs, batch = _pair("bert-hd24", "seqcls")
    labels = torch.tensor([1, 0])
    with torch.inference_mode():
        plain = ours(**batch, labels=labels)
        for options in ({"output_hidden_states": False}, {"output_hidden_states": None}, {"return_dict": True},
                        {"return_dict": None}, {"output_attentions": False}, {"head_mask": None}):
            out = ours(**batch, labels=labels, **options)
            assert type(out) is type(plain) and out.keys() == plain.keys(), options
            for name in plain.keys():
                assert torch.equal(getattr(out, name), getattr(plain, name)), options
        loss, logits = ours(**batch, labels=labels, return_dict=False)
        assert torch.equal(loss, plain.loss) and torch.equal(logits, plain.logits)


@pytest.mark.parametrize("options,named", [
    ({"output_attentions": 1}, "output_attentions"), ({"head_mask": torch.ones(2, 4)}, "head_mask"),
    ({"output_hidden_states": 1}, "output_hidden_states"), ({"output_hidden_states": [0, -1]}, "output_hidden_states"),
    ({"return_dict": "no"}, "return_dict"),
], ids=["attentions_index", "head_mask", "hidden_index", "hidden_list", "return_dict_str"])
def test_unimplemented_options_are_typed_errors(options, named):
    for variant, task in (("bert-hd24", "base"), ("deberta-v3-hd24", "seqcls"), ("modernbert-bias-mean-hd24", "mlm")):
        ours, _theirs, batch = _pair(variant, task)
        with pytest.raises(InputError, match=named):
            ours(**batch, **options)


def test_deberta_regression_returns_the_logits_its_loss_read():
    ours, theirs, batch = _pair("deberta-v3-hd24", "seqcls", num_labels=1)
    with torch.inference_mode():
        for labels in (torch.tensor([0.3, -1.2]), torch.tensor([0.3, -1.2], dtype=torch.float64)):
            a, b = ours(**batch, labels=labels), theirs(**batch, labels=labels)
            assert a.logits.shape == b.logits.shape == (2,) and a.logits.dtype == b.logits.dtype == labels.dtype
            assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
        a, b = ours(**batch), theirs(**batch)
        assert a.logits.shape == (2, 1) and torch.equal(a.logits, b.logits)


def test_modernbert_runs_past_max_position_embeddings_as_transformers():
    ours, theirs, _batch = _pair("modernbert-bias-mean-hd24", "base")
    batch = make_batch(ours.config, "base", lengths=(ours.config.max_position_embeddings + 16, 20))
    with torch.inference_mode():
        assert torch.equal(ours(**batch).last_hidden_state, theirs(**batch).last_hidden_state)


@pytest.mark.parametrize("variant", ["bert-hd24", "roberta-hd24", "deberta-types", "distilbert-sinusoidal-hd24"])
def test_position_ids_are_checked(variant):
    ours, theirs, batch = _pair(variant, "base")
    table = ours.embeddings.position_embeddings.num_embeddings
    bad = {"past the table": (torch.full_like(batch["input_ids"], table), "outside the position table"),
           "negative": (torch.full_like(batch["input_ids"], -1), "outside the position table"),
           "wrong shape": (torch.arange(5).expand(2, -1), "shape"),
           "3-d": (torch.arange(13).expand(1, 2, -1), "shape"),
           "bool": (torch.ones(2, 13, dtype=torch.bool), "dtype"),
           "list": (list(range(13)), "list")}
    if ours.family.model_type != "deberta-v2":
        bad["float"] = (torch.arange(13.0).expand(2, -1), "dtype")
    with torch.inference_mode():
        for name, (value, words) in bad.items():
            with pytest.raises(InputError, match=f"position_ids.*{words}"):
                ours(**batch, position_ids=value)
        offset = 2 if ours.family.model_type == "roberta" else 0
        for good in (torch.arange(13).expand(2, -1) + offset, (torch.arange(13) + offset)[None],
                     torch.arange(13) + offset):
            assert torch.equal(ours(**batch, position_ids=good).last_hidden_state,
                               theirs(**batch, position_ids=good).last_hidden_state)


@pytest.mark.parametrize("variant", ["deberta-types", "modernbert-bias-mean-hd24"])
def test_float_position_ids_where_transformers_takes_them(variant):
    ours, theirs, batch = _pair(variant, "base")
    positions = torch.arange(13.0).expand(2, -1) + 0.25
    with torch.inference_mode():
        assert torch.equal(ours(**batch, position_ids=positions).last_hidden_state,
                           theirs(**batch, position_ids=positions).last_hidden_state)
    with torch.inference_mode():
        if variant.startswith("modernbert"):  # RoPE: no table, any position, any length (transformers runs them)
            n = ours.config.max_position_embeddings + 3
            batch = make_batch(ours.config, "base", lengths=(n, 9))
            far = torch.arange(n).expand(2, -1) + 10_000.5
            assert torch.equal(ours(**batch, position_ids=far).last_hidden_state,
                               theirs(**batch, position_ids=far).last_hidden_state)
        else:  # a float past the table after .long() is refused, naming position_ids
            table = ours.embeddings.position_embeddings.num_embeddings
            with pytest.raises(InputError, match="position_ids holds position"):
                ours(**batch, position_ids=torch.full((2, 13), table + 0.5))
