"""Positional inputs mean what they mean to transformers.

For each BERT-lineage family (BERT, ALBERT, RoBERTa, CamemBERT, XLM-R, MPNet, DistilBERT, ModernBERT) and each
of its task models, the forward's positional parameters are a prefix of transformers' (the class its
``AutoModelFor*`` mapping names for that model_type), as long as that prefix runs over inputs we take; the
rest of our inputs are keyword-only, so one positional input past them is a TypeError, never another meaning.
A positional call in transformers' order is torch.equal to transformers' and to our keyword call.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.core.errors import InputError
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers, reference_model
from flodl_hf.core.registry import get_family
from flodl_hf.core.registry import get_task

from cases import CASES
from helpers import make_checkpoint, one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = {case_id: fields for case_id, _task, fields in CASES}
VARIANTS = {"bert": "bert-hd24", "albert": "albert-groups-hd24", "roberta": "roberta-hd24",
            "camembert": "camembert-hd24", "xlm-roberta": "xlm-roberta-hd24", "mpnet": "mpnet-hd24",
            "distilbert": "distilbert-sinusoidal-hd24", "modernbert": "modernbert-bias-mean-hd24",
            "electra": "electra-proj-hd24", "deberta-v2": "deberta-v3-hd24", "deberta": "deberta1-hd24",
            "roberta-prelayernorm": "roberta-prelayernorm-hd24", "xlm-roberta-xl": "xlm-roberta-xl-hd24"}
TASKS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")
PAIRS = [(model_type, task) for model_type in VARIANTS for task in TASKS if get_family(model_type).supports(task)]
IDS = [f"{model_type}-{task}" for model_type, task in PAIRS]
VAR = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _theirs_class(model_type: str, task: str) -> type:
    transformers = quiet_transformers()
    from transformers.models.auto import modeling_auto
    return getattr(transformers, getattr(modeling_auto, get_task(task).hf_mapping)[model_type])


def _orders(model_type: str, task: str) -> tuple[list[str], dict[str, inspect.Parameter], list[str]]:
    """(our positional names, all our parameters, transformers' named parameters in order)."""
    ours = inspect.signature(get_family(model_type).model_class(task).forward).parameters
    ours = dict(list(ours.items())[1:])
    theirs = inspect.signature(_theirs_class(model_type, task).forward).parameters
    theirs = [name for name, p in list(theirs.items())[1:] if p.kind not in VAR]
    positional = [name for name, p in ours.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    return positional, ours, theirs


@pytest.mark.parametrize("model_type,task", PAIRS, ids=IDS)
def test_positional_order_is_transformers(model_type, task):
    positional, ours, theirs = _orders(model_type, task)
    where = f"{model_type} {task}: ours {positional}, transformers {theirs}"
    assert not any(p.kind in VAR or p.kind is inspect.Parameter.POSITIONAL_ONLY for p in ours.values()), where
    assert positional == theirs[:len(positional)], where
    # as long as transformers' next input is one we take, it is positional too
    assert len(positional) == len(theirs) or theirs[len(positional)] not in ours, where
    # every input both take sits at transformers' index or is keyword-only here
    for name in set(ours) & set(theirs):
        assert name in positional or ours[name].kind is inspect.Parameter.KEYWORD_ONLY, where


def _inputs(model, task: str, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch plus explicit position ids (not the default ones) and the task's labels."""
    ids = batch["input_ids"]
    gen = torch.Generator().manual_seed(1)
    inputs = dict(batch)
    width = ids.shape[-1]
    # positions shifted by 2: inside every table here (RoBERTa's count from pad + 1 = 2), unlike the default
    positions = torch.arange(width) + 2
    # multiple choice: one row of positions for every choice (transformers' DistilBERT does not flatten
    # (batch, choices, sequence) position ids, and fails on them)
    inputs["position_ids"] = positions[None, :] if task == "mc" else positions.expand(ids.shape).contiguous()
    config = model.config
    rows = ids.shape[0]
    if task in ("seqcls", "tokcls"):
        shape = (rows,) if task == "seqcls" else tuple(ids.shape)
        labels = torch.randint(0, config.num_labels, shape, generator=gen)
        if task == "tokcls":
            labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
        inputs["labels"] = labels
    elif task == "mlm":
        labels = torch.full_like(ids, -100)
        labels[:, 1:4] = ids[:, 1:4]
        inputs["labels"] = labels
    elif task == "mc":
        inputs["labels"] = torch.randint(0, ids.shape[1], (rows,), generator=gen)
    elif task == "qa":
        inputs["start_positions"] = torch.tensor([1, 3][:rows])
        inputs["end_positions"] = torch.tensor([4, 5][:rows])
    return inputs


def _same(a, b, where: str) -> None:
    assert list(a.keys()) == list(b.keys()), where
    for name in a.keys():
        x, y = getattr(a, name), getattr(b, name)
        assert isinstance(x, torch.Tensor) and x.shape == y.shape and torch.equal(x, y), f"{where}: {name}"


@pytest.mark.parametrize("model_type,task", PAIRS, ids=IDS)
def test_positional_call_equals_transformers_and_keywords(model_type, task):
    fields = FIELDS[f"{VARIANTS[model_type]}-{task}"]
    source = make_checkpoint(fields, task)
    family = get_family(fields["model_type"])
    impl = family.attn_implementations[0]
    ours = load_model(source, task, dtype=torch.float32, attn_implementation=impl).eval()
    theirs = reference_model(source, task, impl if len(family.attn_implementations) > 1 else None)
    inputs = _inputs(ours, task, make_batch(ours.config, task))
    positional, _, _ = _orders(model_type, task)
    last = max(i for i, name in enumerate(positional) if name in inputs)
    args = [inputs.get(name) for name in positional[:last + 1]]
    rest = {name: value for name, value in inputs.items() if name not in positional}  # BERT's, RoBERTa's MLM labels
    with torch.inference_mode():
        a, b, c = ours(*args, **rest), theirs(*args, **rest), ours(**inputs)
    _same(a, b, f"{model_type} {task}: positional, ours vs transformers")
    _same(a, c, f"{model_type} {task}: positional vs keywords")
    with pytest.raises(TypeError):
        ours(*[inputs.get(name) for name in positional], None)  # one positional input past transformers' order


def test_backbone_input_check_reads_positional_inputs_in_the_new_order():
    """modeling's forward-input check maps positional inputs by the forward's signature: DistilBERT's third
    input is inputs_embeds, MPNet's and ModernBERT's position_ids, and a bad one is named as such."""
    for variant in ("mpnet-hd24", "modernbert-bias-mean-hd24"):
        fields = FIELDS[f"{variant}-base"]
        model = load_model(make_checkpoint(fields, "base"), "base", dtype=torch.float32)
        batch = make_batch(model.config, "base")
        with pytest.raises(InputError, match="position_ids has shape"):
            model(batch["input_ids"], batch["attention_mask"], torch.zeros((1, 99), dtype=torch.long))
    fields = FIELDS["distilbert-sinusoidal-hd24-base"]
    model = load_model(make_checkpoint(fields, "base"), "base", dtype=torch.float32)
    batch = make_batch(model.config, "base")
    with pytest.raises(InputError, match="position_ids"):
        model(batch["input_ids"], batch["attention_mask"], None, torch.full(batch["input_ids"].shape, 10_000))


@pytest.mark.parametrize("variant", ["mpnet-hd24", "modernbert-bias-mean-hd24"])
def test_token_types_stay_a_keyword_and_a_typed_error(variant):
    fields = FIELDS[f"{variant}-seqcls"]
    model = load_model(make_checkpoint(fields, "seqcls"), "seqcls", dtype=torch.float32)
    batch = make_batch(model.config, "seqcls")
    model(**batch, token_type_ids=None)
    with pytest.raises(InputError, match="token_type_ids"):
        model(**batch, token_type_ids=torch.zeros_like(batch["input_ids"]))
