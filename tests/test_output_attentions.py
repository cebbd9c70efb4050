"""``output_attentions=True``: every family's attention probabilities, torch.equal to transformers' eager path
in the same run, with the output record, its tuple and the other outputs as transformers gives them.

One case per family (head_dim 24, several heads and tasks), two at real width (768, 12 heads of 64),
ALBERT's shared layers (one weight per application), ELECTRA's own pretraining record, and a decoder step
on a KV cache. The sdpa path computes no weights: asking there is a typed error naming the way out.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.core.errors import InputError
from flodl_hf.core.layers import _ATTENTIONS, record_attention
from flodl_hf.core.modeling import _with_field
from flodl_hf.core.outputs import ModelOutput
from flodl_hf.roundtrip.parity import make_batch, reference_model
from flodl_hf.core.registry import get_family

from cases import CASES
from helpers import make_checkpoint, one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = {case_id: fields for case_id, _task, fields in CASES}


def _eager_pair(case: str, task: str):
    fields = FIELDS[f"{case}-{task}"]
    source = make_checkpoint(fields, task)
    family = get_family(fields["model_type"])
    ours = load_model(source, task, dtype=torch.float32, attn_implementation="eager").eval()
    theirs = reference_model(source, task, "eager" if len(family.attn_implementations) > 1 else None)
    return ours, theirs, make_batch(ours.config, task)


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert a.shape == b.shape and a.dtype == b.dtype, f"{where}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        assert torch.equal(a, b), f"{where}: max abs diff {(a - b).abs().max().item()}"
        return
    assert isinstance(a, tuple) and isinstance(b, tuple), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} entries"
    for i, (x, y) in enumerate(zip(a, b)):
        _assert_same(x, y, f"{where}[{i}]")


CASES_BY_FAMILY = [
    ("bert-768", "base"), ("bert-hd24", "mc"), ("roberta-hd24", "seqcls"), ("camembert-hd24", "tokcls"),
    ("xlm-roberta-hd24", "qa"), ("distilbert-sinusoidal-hd24", "qa"), ("albert-groups-hd24", "base"),
    ("roberta-prelayernorm-hd24", "mc"), ("xlm-roberta-xl-hd24", "tokcls"),
    ("deberta-v3-768", "seqcls"), ("deberta-v2xl-conv", "mlm"), ("deberta1-768", "seqcls"),
    ("deberta1-p2c-nonlegacy", "mlm"), ("electra-proj-hd24", "pretraining"),
    ("modernbert-bias-mean-hd24", "mlm"), ("mpnet-hd24", "base"),
    ("llama-hd24-bias-tied-llama3", "causal_lm"), ("mistral-hd24-window4", "seqcls"), ("qwen2-hd24-sliding", "base"),
    ("qwen3-hd24-qknorm-sliding", "qa"), ("phi3-hd24-partial-window4", "tokcls"),
    ("gemma-hd24-scaled-bias", "causal_lm"), ("gemma2-hd24-softcap-sliding", "causal_lm"),
    ("gemma3_text-hd24-qknorm-2rope", "seqcls"), ("gpt2-hd24", "tokcls"), ("gpt2-hd24-scalings", "causal_lm"),
    ("gpt_neox-hd24", "qa"), ("gpt_neox-hd24-sequential", "causal_lm"),
    ("olmo2-hd24-qknorm-postnorm", "seqcls"), ("granite-hd24-multipliers", "causal_lm"),
    ("starcoder2-hd24-bias-window4", "seqcls"), ("stablelm-hd24-qknorm-parallel", "causal_lm"),
    ("gptj-hd24", "qa"), ("gptj-hd24-fullrot-tied", "causal_lm"), ("opt-hd24-postln-project", "qa"),
    ("mixtral-hd24-4experts-top2", "causal_lm"), ("qwen2_moe-hd24-4experts-norm-dense1", "tokcls"),
    ("qwen3_moe-hd24-4experts-norm-bias-dense1", "qa"), ("olmoe-hd24-6experts-top3-clip", "causal_lm"),
    ("phi-hd24-qknorm", "tokcls"), ("olmo-hd24-clip-bias", "seqcls"), ("cohere-hd24-qknorm-bias", "causal_lm"),
    ("smollm3-hd24-nope-sliding-bias", "tokcls"), ("olmo3-hd24-sliding-2rope", "seqcls"),
    ("ministral-hd24-window4-layertypes", "causal_lm"),
]


@pytest.mark.parametrize("case,task", CASES_BY_FAMILY, ids=["-".join(c) for c in CASES_BY_FAMILY])
def test_attentions_equal_transformers_eager(case, task):
    ours, theirs, batch = _eager_pair(case, task)
    if "cache" in getattr(ours, "backbone", ours).input_names:  # a decoder: a cache object is no tensor to compare
        batch = {**batch, "use_cache": False}
    with torch.inference_mode():
        a = ours(**batch, output_attentions=True)
        b = theirs(**batch, output_attentions=True)
        assert len(a.attentions) > 0
        _assert_same(a.attentions, b.attentions, "attentions")
        backbone = ours if task == "base" else ours.backbone
        heads = ours.config.num_attention_heads
        width = batch.get("input_ids", batch.get("inputs_embeds")).shape[-1]
        for weights in a.attentions:
            assert weights.shape[-3:] == (heads, width, width)
        assert len(a.attentions) == len(b.attentions) >= backbone.num_layers()
        plain = ours(**batch)
        assert "attentions" not in plain.keys() and _ATTENTIONS.get() is None
        for name in plain.keys():  # recording changes no other output
            _assert_same(getattr(a, name), getattr(plain, name), name)
        both = ours(**batch, output_attentions=True, output_hidden_states=True)
        reference = theirs(**batch, output_attentions=True, output_hidden_states=True)
        assert list(both.keys()) == list(reference.keys())  # the BERT lineage's end with cross_attentions=()
        _assert_same(both.hidden_states, reference.hidden_states, "hidden_states")
        _assert_same(both.attentions, reference.attentions, "attentions with hidden states")
        _assert_same(ours(**batch, output_attentions=True, return_dict=False),
                     theirs(**batch, output_attentions=True, return_dict=False),
                     "return_dict=False")
    restored = pickle.loads(pickle.dumps(both))
    assert type(restored) is type(both) and torch.equal(restored.attentions[0], both.attentions[0])


def test_albert_records_one_weight_per_application_of_its_shared_layers():
    ours, _theirs, batch = _eager_pair("albert-groups-hd24", "base")
    config = ours.config
    with torch.inference_mode():
        out = ours(**batch, output_attentions=True)
    assert config.num_hidden_groups < config.num_hidden_layers * config.inner_group_num
    assert len(out.attentions) == config.num_hidden_layers * config.inner_group_num


def test_decoder_step_on_a_cache_equals_transformers():
    ours, theirs, batch = _eager_pair("llama-hd24-bias-tied-llama3", "causal_lm")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    step = torch.tensor([[5], [7]])
    with torch.inference_mode():
        a = ours(input_ids=ids, attention_mask=mask, use_cache=True)
        b = theirs(input_ids=ids, attention_mask=mask, use_cache=True)
        longer = torch.cat([mask, torch.ones_like(step)], dim=1)
        a = ours(input_ids=step, attention_mask=longer, cache=a.cache, output_attentions=True)
        b = theirs(input_ids=step, attention_mask=longer, cache=b.cache, output_attentions=True)
    assert a.attentions[0].shape[-2:] == (1, ids.shape[1] + 1)
    _assert_same(a.attentions, b.attentions, "attentions on the cache")
    _assert_same(a.logits, b.logits, "logits")


@pytest.mark.parametrize("case,task", [("bert-hd24", "base"), ("modernbert-bias-mean-hd24", "mlm"),
                                       ("llama-hd24-bias-tied-llama3", "causal_lm")])
def test_sdpa_path_is_a_typed_error_naming_the_way_out(case, task):
    fields = FIELDS[f"{case}-{task}"]
    ours = load_model(make_checkpoint(fields, task), task, dtype=torch.float32).eval()
    batch = make_batch(ours.config, task)
    with torch.inference_mode():
        with pytest.raises(InputError, match=r"output_attentions=True.*set_attn_implementation\('eager'\)"):
            ours(**batch, output_attentions=True)
        assert _ATTENTIONS.get() is None
        ours.set_attn_implementation("eager")
        eager = ours(**batch, output_attentions=True)
        assert len(eager.attentions) == (ours if task == "base" else ours.backbone).num_layers()


def test_attentions_flow_into_the_loss_gradient_in_training():
    ours, _theirs, batch = _eager_pair("bert-hd24", "seqcls")
    ours.train()
    out = ours(**batch, labels=torch.tensor([1, 0]), output_attentions=True)
    assert all(w.requires_grad for w in out.attentions)
    (out.loss + out.attentions[-1].sum()).backward()
    assert ours.backbone.encoder.layer[-1].attention.self.query.weight.grad is not None


def test_record_attention_outside_a_call_keeps_nothing():
    record_attention(torch.ones(1, 1, 2, 2))
    assert _ATTENTIONS.get() is None


def test_a_record_without_the_fields_is_extended_by_both_in_order():
    @dataclasses.dataclass
    class Scores(ModelOutput):
        loss: torch.Tensor | None = None
        scores: torch.Tensor | None = None

    out = Scores(scores=torch.ones(2))
    with_attentions = _with_field(out, "attentions", (torch.zeros(1),))
    both = _with_field(with_attentions, "hidden_states", (torch.ones(1),))
    assert type(both) is type(with_attentions) and isinstance(both, Scores)
    assert [f.name for f in dataclasses.fields(both)] == ["loss", "scores", "hidden_states", "attentions"]
    assert both.keys() == ["scores", "hidden_states", "attentions"]
    assert torch.equal(both.to_tuple()[1][0], torch.ones(1)) and torch.equal(both.to_tuple()[2][0], torch.zeros(1))
