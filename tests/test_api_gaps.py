"""Three places where flodl-hf's API meets PEFT's and transformers', each compared with the real library in the
same run:

1. an adapter_config.json asking for ``init_lora_weights="orthogonal"`` with an odd ``r``, which PEFT refuses
   (its orthogonal initialisation, rerun at every load, splits a QR basis in halves); an even ``r`` loads and
   equals PEFT's reload;
2. ``generate()``'s ``max_length``, which the text-generation pipeline also hands to its tokenizer: a text
   prompt is cut to it (a chat is not), then continued by ``max_new_tokens``;
3. ``cross_attentions`` in the output records, exactly where transformers' records have it (the BERT-lineage
   backbones), ``()`` with ``output_attentions=True`` and None otherwise, in the same keys and tuple order.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")

from flodl_hf import lora
from flodl_hf.auto import AutoModel
from flodl_hf.core.errors import AdapterError, InputError
from flodl_hf.tasks.generate import generate
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers, reference_model

from cases import CASES
from helpers import make_checkpoint, one_thread  # noqa: F401  (fixture)
from test_chat_template import CHAT, SHORT, chat_model  # noqa: F401  (fixture)
from test_generate_pipeline import PROMPTS, model  # noqa: F401  (fixture)
from test_lora_peft_edges import BERT, _edit_config, _equal, _ours, _peft_adapter, _peft_reload, _source
from test_output_attentions import _eager_pair


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---- 1. init_lora_weights="orthogonal" needs an even r ----------------------------------------------------

def test_orthogonal_init_with_an_odd_r_is_refused_as_peft_refuses_it(tmp_path):
    source, task = _source(BERT)
    # PEFT refuses it when creating the adapter ...
    with pytest.raises(ValueError, match="rank to be even, got 3"):
        peft.get_peft_model(reference_model(source, task, "eager"),
                            peft.LoraConfig(target_modules=["query"], r=3, init_lora_weights="orthogonal",
                                            task_type="SEQ_CLS"))
    # ... and when reloading one whose config asks for it (the init reruns at load)
    adapter = tmp_path / "odd"
    _peft_adapter(BERT, adapter, target_modules=["query", "value"], r=3)
    _edit_config(adapter, init_lora_weights="orthogonal")
    with pytest.raises(ValueError, match="rank to be even, got 3"):
        _peft_reload(BERT, adapter)
    with pytest.raises(AdapterError) as info:
        _ours(BERT, adapter)
    message = str(info.value)
    assert str(adapter / lora.ADAPTER_CONFIG) in message
    assert "init_lora_weights='orthogonal'" in message and "'r' is 3" in message
    assert "setting init_lora_weights to true" in message
    # which loads in both, equal (the file's A and B replace the init)
    _edit_config(adapter, init_lora_weights=True)
    ours, theirs = _ours(BERT, adapter), _peft_reload(BERT, adapter)
    batch = make_batch(ours.config, task)
    with torch.no_grad():
        _equal(ours(**batch), theirs(**batch))


@pytest.mark.parametrize("r", [2, 6])
def test_orthogonal_init_with_an_even_r_loads_as_peft_reloads_it(r, tmp_path):
    adapter = tmp_path / "even"
    _peft_adapter(BERT, adapter, target_modules=["query", "value"], r=r, init_lora_weights="orthogonal")
    assert json.loads((adapter / lora.ADAPTER_CONFIG).read_text())["init_lora_weights"] == "orthogonal"
    ours, theirs = _ours(BERT, adapter), _peft_reload(BERT, adapter)
    batch = make_batch(ours.config, "seqcls")
    with torch.no_grad():
        _equal(ours(**batch), theirs(**batch))


# ---- 2. generate(): the call's max_length also cuts text prompts -------------------------------------------

CUT = [{"max_length": 4, "max_new_tokens": 3}, {"max_length": 4, "max_new_tokens": 3, "return_tensors": True},
       {"max_length": 2, "max_new_tokens": 2, "return_full_text": False}, {"max_length": 9, "return_tensors": True}]


@pytest.mark.parametrize("options", CUT, ids=[",".join(f"{k}={v}" for k, v in o.items()) for o in CUT])
def test_max_length_cuts_text_prompts_as_the_pipeline(model, options):
    root, pipe = model
    lengths = [len(pipe.tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert max(lengths) > 4 > min(lengths)  # one prompt is cut, one is not
    for prompts in (PROMPTS[0], PROMPTS):
        ours = generate(prompts, root, do_sample=False, eos_token_id=[], **options)
        assert ours == pipe(prompts, do_sample=False, eos_token_id=[], **options), (prompts, options)
    if options.get("return_tensors") and "max_new_tokens" in options:
        ids = generate(PROMPTS, root, do_sample=False, eos_token_id=[], **options)
        assert [len(r[0]["generated_token_ids"]) for r in ids] == \
            [min(n, options["max_length"]) + options["max_new_tokens"] for n in lengths]


def test_max_length_cuts_the_prompts_before_sampling_as_the_pipeline(model):
    root, pipe = model
    torch.manual_seed(4)
    theirs = pipe(PROMPTS, max_length=4, max_new_tokens=3, num_return_sequences=2)
    assert generate(PROMPTS, root, max_length=4, max_new_tokens=3, num_return_sequences=2, seed=4) == theirs


def test_a_prompt_cut_to_max_length_without_new_tokens_is_refused_as_in_the_pipeline(model):
    root, pipe = model
    for prompts, where in ((PROMPTS[0], "prompts"), (PROMPTS, r"prompts\[0\]")):
        with pytest.raises(ValueError, match="Input length of input_ids is 5, but `max_length` is set to 5"):
            pipe(prompts, do_sample=False, max_length=5)
        with pytest.raises(InputError, match=rf"{where}: the tokenizer cuts the prompt to max_length=5 tokens"):
            generate(prompts, root, do_sample=False, max_length=5)


def test_a_max_length_in_a_generation_config_cuts_nothing(model):
    """Only the call's max_length reaches the pipeline's tokenizer; a generation config's bounds the length only."""
    root, pipe = model
    config = quiet_transformers().GenerationConfig(max_length=4, max_new_tokens=3, do_sample=False)
    options = dict(generation_config=config, eos_token_id=[], return_tensors=True)
    ours = generate(PROMPTS, root, **options)
    assert ours == pipe(PROMPTS, **options)
    assert len(ours[0][0]["generated_token_ids"]) == len(pipe.tokenizer(PROMPTS[0])["input_ids"]) + 3


def test_max_length_cuts_on_the_tokenizers_truncation_side(model, tmp_path):
    root, _ = model
    left = tmp_path / "left"
    shutil.copytree(root, left)
    config = json.loads((left / "tokenizer_config.json").read_text())
    (left / "tokenizer_config.json").write_text(json.dumps({**config, "truncation_side": "left"}))
    pipe = quiet_transformers().pipeline("text-generation", model=str(left), tokenizer=str(left))
    assert pipe.tokenizer.truncation_side == "left"
    options = dict(do_sample=False, max_length=3, max_new_tokens=2, eos_token_id=[], return_tensors=True)
    ours = generate(PROMPTS, str(left), **options)
    assert ours == pipe(PROMPTS, **options)
    assert ours[0][0]["generated_token_ids"][:3] == pipe.tokenizer(PROMPTS[0])["input_ids"][-3:]


@pytest.mark.parametrize("options", [{"max_length": 80}, {"max_length": 10, "max_new_tokens": 3},
                                     {"max_length": 10, "max_new_tokens": 3, "return_tensors": True}], ids=str)
def test_a_chat_is_not_cut_by_max_length_as_in_the_pipeline(chat_model, options):
    root, pipe = chat_model
    for prompts in (CHAT, [CHAT, SHORT]):
        ours = generate(prompts, root, do_sample=False, **options)
        assert ours == pipe(prompts, do_sample=False, **options), (prompts, options)
    if options.get("return_tensors"):
        rendered = pipe.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
        assert len(rendered) > options["max_length"]
        assert len(ours[0][0]["generated_token_ids"]) == len(rendered) + options["max_new_tokens"]


# ---- 3. cross_attentions where transformers' records have it ------------------------------------------------

def _smallest_case_per_family_and_task() -> list[tuple[str, str]]:
    """(case prefix, task): for each family and task, the variant of the narrowest width."""
    chosen: dict[tuple[str, str], tuple[int, str]] = {}
    for case_id, task, fields in CASES:
        key = (fields["model_type"], task)
        width = fields.get("hidden_size", 0) * max(1, fields.get("num_hidden_layers", 1))
        if key not in chosen or width < chosen[key][0]:
            chosen[key] = (width, case_id[: -len(task) - 1])
    return [(prefix, task) for (_, task), (_, prefix) in sorted(chosen.items())]


EVERY_FAMILY_AND_TASK = _smallest_case_per_family_and_task()
_MISSING = object()


def _field(out, name):
    """The field's type and value (None, (), or the marker of a missing field)."""
    value = getattr(out, name, _MISSING)
    return type(value), (value if value is None or value is _MISSING or value == () else "set")


def _type(value):
    """A field's type; a nested record (CLIP's towers' records) counts as a record whatever its class."""
    return "record" if hasattr(value, "to_tuple") else type(value)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case,task", EVERY_FAMILY_AND_TASK, ids=["-".join(c) for c in EVERY_FAMILY_AND_TASK])
def test_cross_attentions_where_transformers_records_have_them(case, task):
    ours, theirs, batch = _eager_pair(case, task)
    if "use_cache" in getattr(ours, "backbone", ours).input_names:  # a decoder: its cache is ours
        batch = {**batch, "use_cache": False}
    with torch.inference_mode():
        for options in ({}, {"output_attentions": True}, {"output_hidden_states": True},
                        {"output_attentions": True, "output_hidden_states": True}):
            a, b = ours(**batch, **options), theirs(**batch, **options)
            assert list(a.keys()) == list(b.keys()), options
            assert _field(a, "cross_attentions") == _field(b, "cross_attentions"), options
            for i, name in enumerate(b.keys()):  # indexing by position and by name
                assert type(a[i]) is type(b[i]) and _type(a[name]) == _type(b[name]), (options, name)
            ta = ours(**batch, **options, return_dict=False)
            tb = theirs(**batch, **options, return_dict=False)
            assert [type(x) for x in ta] == [type(x) for x in tb], options
            assert [len(x) for x in ta if isinstance(x, tuple)] == [len(x) for x in tb if isinstance(x, tuple)]


def test_cross_attentions_follow_output_attentions_set_at_load():
    """from_pretrained(output_attentions=True) records both by default, as transformers' config does; a call's
    output_attentions=False records neither."""
    task, fields = next((t, f) for c, t, f in CASES if f["model_type"] == "roberta" and t == "base")
    source = make_checkpoint(fields, task)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = AutoModel.from_pretrained(source, output_attentions=True).eval()
    theirs = quiet_transformers().AutoModel.from_pretrained(str(source), output_attentions=True).eval()
    batch = make_batch(ours.config, task)
    with torch.inference_mode():
        for kw in ({}, {"output_attentions": False}, {"return_dict": False}):
            a, b = ours(**batch, **kw), theirs(**batch, **kw)
            if isinstance(b, tuple):
                assert [type(x) for x in a] == [type(x) for x in b] and a[-1] == b[-1] == ()
                continue
            assert list(a.keys()) == list(b.keys()), kw
            assert _field(a, "cross_attentions") == _field(b, "cross_attentions"), kw


# ---- 4. output_hidden_states=None / output_attentions=None passed explicitly --------------------------------

NONE_CASES = [(c, t) for c, t in EVERY_FAMILY_AND_TASK if t in ("base", "seqcls")]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case,task", NONE_CASES, ids=["-".join(c) for c in NONE_CASES])
def test_an_explicit_none_means_what_it_means_in_transformers(case, task):
    """With a config that asks for hidden states and attentions, a keyword passed as None is False in the models
    transformers 5 records with hooks, and the config's value in DeBERTa-v2 and MPNet: the same fields, the same
    tensors."""
    ours, theirs, batch = _eager_pair(case, task)
    if "use_cache" in getattr(ours, "backbone", ours).input_names:
        batch = {**batch, "use_cache": False}
    for name in ("output_hidden_states", "output_attentions"):
        ours.config.raw[name] = True
        setattr(theirs.config, name, True)
    with torch.inference_mode():
        for options in ({}, {"output_hidden_states": None}, {"output_attentions": None},
                        {"output_hidden_states": None, "output_attentions": None},
                        {"output_hidden_states": False, "output_attentions": None}):
            a, b = ours(**batch, **options), theirs(**batch, **options)
            assert list(a.keys()) == list(b.keys()), options
            for key in ("hidden_states", "attentions"):
                if b.get(key) is not None:
                    assert len(a[key]) == len(b[key]) and all(torch.equal(x, y) for x, y in zip(a[key], b[key]))
