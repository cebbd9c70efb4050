"""The task heads' keywords and positional order against transformers 5.24 in the same run.

- ``num_items_in_batch`` (transformers' gradient-accumulation count, taken through ``**kwargs``): every head
  takes it; the loss with and without it is ``torch.equal`` to transformers' for one case per family and head
  (it divides a summed loss where the family's transformers head hands it to ``self.loss_function``, the
  family's ``num_items_tasks``, and is ignored elsewhere, as there).
- The decoders' sequence, token and span heads take ``cache`` / ``past_key_values`` / ``use_cache`` as
  transformers' generic heads do, and return the same keys (the token and span records carry no cache).
- The decoders' forwards take transformers' positional order (input_ids, attention_mask, position_ids, cache,
  inputs_embeds, ...; GPT-2's classes: input_ids, cache, attention_mask, token_type_ids, position_ids, ...): the
  signatures agree, and ids, mask and positions passed positionally in that order are ``torch.equal`` to
  transformers'.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from flodl_hf.core.errors import InputError
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers
from flodl_hf.core.registry import get_family
from flodl_hf.core.registry import get_task

from decoder_checks import NARROW as DECODERS, case_fields
from helpers import make_checkpoint, model_pair
from test_losses import _labels, _one_case_per_family_and_head

DECODER_TASKS = ("base", "causal_lm", "seqcls", "tokcls", "qa")


def _decoder_pairs(tasks: tuple[str, ...] = DECODER_TASKS) -> list:
    """(model_type, task) for each decoder and each of ``tasks`` it declares (no qa: Phi3, the Gemmas; no tokcls:
    Gemma3)."""
    return [pytest.param(m, t, id=f"{t}-{m}") for m in DECODERS for t in tasks if get_family(m).supports(t)]


def _load(fields: dict, task: str, impl: str = "eager"):
    impls = get_family(fields["model_type"]).attn_implementations
    impl = impl if impl in impls else impls[0]  # Gemma2: eager only (transformers refuses sdpa)
    return model_pair(make_checkpoint(fields, task), task, impl)


def _decoder_fields(model_type: str, task: str) -> dict:
    return case_fields(DECODERS[model_type], task)


# ---- num_items_in_batch ----------------------------------------------------------------------------------

def _num_items_cases():
    for param in _one_case_per_family_and_head():
        task, fields, variant = param.values
        if task == "causal_lm" or variant not in ("default", "single"):
            continue  # the causal LM is heads/causal_lm.py's; the label variants are test_losses.py's
        yield pytest.param(task, fields, id=param.id)
        if fields["model_type"] == "modernbert" and task == "mlm":  # the labelled rows only: its own forward
            yield pytest.param(task, {**fields, "sparse_prediction": True}, id=param.id + "-sparse")


@pytest.mark.parametrize("task,fields", list(_num_items_cases()))
def test_num_items_in_batch_loss_equals_transformers(task, fields):
    ours, theirs = _load(fields, task)
    batch = make_batch(ours.config, task)
    batch.update(_labels(task, ours.config, batch, "default"))
    counts = []
    for n in (None, torch.tensor(7), 3):
        extra = {} if n is None else {"num_items_in_batch": n}
        a, b = ours(**batch, **extra), theirs(**batch, **extra)
        assert torch.equal(a.loss, b.loss), (n, a.loss.item(), b.loss.item())
        for name, value in b.items():  # the other outputs do not move
            if isinstance(value, torch.Tensor) and name != "loss":
                assert torch.equal(getattr(a, name), value), name
        counts.append(a.loss)
    counted = task in ours.family.num_items_tasks
    assert torch.equal(counts[0], counts[1]) is not counted  # the declaration says what transformers does


# ---- the decoders' positional order ----------------------------------------------------------------------

def _positional(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]


@pytest.mark.parametrize("model_type", list(DECODERS))
def test_decoder_forwards_take_transformers_positional_order(model_type):
    transformers = quiet_transformers()
    family = get_family(model_type)
    for task in filter(family.supports, DECODER_TASKS):
        ours = family.model_class(task)
        theirs = getattr(transformers, family.architecture(task))  # Gemma3's text classes: two stems
        mine, hf = _positional(ours.forward), _positional(theirs.forward)
        assert mine == hf, (task, mine, hf)  # everything else is keyword-only, as transformers' **kwargs


def _in_order(model, **named) -> tuple:
    """``named`` as positional arguments in the order of transformers' class of ``model`` (None in the gaps)."""
    names = _positional(type(model).forward)
    return tuple(named.get(n) for n in names[:max(names.index(n) for n in named) + 1])


def _tensors(out) -> dict[str, torch.Tensor]:
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("model_type,task", _decoder_pairs())
@torch.inference_mode()
def test_positional_call_equals_transformers(model_type, task):
    ours, theirs = _load(_decoder_fields(model_type, task), task, "sdpa")
    batch = make_batch(ours.config, task)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (torch.arange(ids.shape[1]) + 3).expand_as(ids)  # not the default, so a misplaced argument shows
    args = _in_order(theirs, input_ids=ids, attention_mask=mask, position_ids=pos)
    a, b = ours(*args), theirs(*args)
    assert list(a.keys()) == list(b.keys())
    assert _tensors(a).keys() == _tensors(b).keys()
    assert all(torch.equal(v, getattr(b, k)) for k, v in _tensors(a).items())
    plain = ours(input_ids=ids, attention_mask=mask)
    assert not torch.equal(next(iter(_tensors(a).values())), next(iter(_tensors(plain).values())))
    labels = _labels(task, ours.config, batch, "default") if task != "base" else {}
    if labels:  # labels in their positional place too: (ids, mask, pos, cache, embeds, labels...) for LLaMA's
        args = _in_order(theirs, input_ids=ids, attention_mask=mask, position_ids=pos, **labels)
        assert torch.equal(ours(*args).loss, theirs(*args).loss)


# ---- the decoders' caches on the classification heads -----------------------------------------------------

@pytest.mark.parametrize("model_type,task", _decoder_pairs(("seqcls", "tokcls", "qa")))
@torch.inference_mode()
def test_decoder_heads_take_a_cache_and_return_transformers_keys(model_type, task):
    from transformers import DynamicCache
    ours, theirs = _load(_decoder_fields(model_type, task), task, "sdpa")
    batch = make_batch(ours.config, task, lengths=(9, 9))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for use_cache in (None, True, False):
        kw = {} if use_cache is None else {"use_cache": use_cache}
        a, b = ours(ids, attention_mask=mask, **kw), theirs(ids, attention_mask=mask, **kw)
        assert list(a.keys()) == list(b.keys()), (use_cache, list(a.keys()), list(b.keys()))
        assert len(ours(ids, attention_mask=mask, return_dict=False, **kw)) == \
            len(theirs(ids, attention_mask=mask, return_dict=False, **kw))
    # a step on a cache: the prefix fills both caches in place, then the last tokens run on them
    cut = 6
    cache_ours, cache_theirs = ours.backbone.new_cache(), DynamicCache(config=theirs.config)
    ours(ids[:, :cut], attention_mask=mask[:, :cut], cache=cache_ours, use_cache=True)
    theirs(ids[:, :cut], attention_mask=mask[:, :cut], cache=cache_theirs, use_cache=True)
    a = ours(ids[:, cut:], attention_mask=mask, cache=cache_ours, use_cache=True)
    b = theirs(ids[:, cut:], attention_mask=mask, cache=cache_theirs, use_cache=True)
    assert list(a.keys()) == list(b.keys())
    assert all(torch.equal(v, getattr(b, k)) for k, v in _tensors(a).items())
    assert cache_ours.get_seq_length() == cache_theirs.get_seq_length() == ids.shape[1]
    if task == "seqcls":
        assert a.cache is cache_ours
    # past_key_values, the older name, is the same argument (transformers maps it to cache, with a warning)
    old = ours.backbone.new_cache()
    ours(ids[:, :cut], attention_mask=mask[:, :cut], past_key_values=old)
    assert old.get_seq_length() == cut
    types = torch.ones_like(ids)
    if "token_type_ids" in ours.backbone.input_names:  # GPT-2: token types through wte, as transformers
        a = ours(ids, attention_mask=mask, token_type_ids=types)
        b = theirs(ids, attention_mask=mask, token_type_ids=types)
        assert all(torch.equal(v, getattr(b, k)) for k, v in _tensors(a).items())
    else:
        with pytest.raises(InputError, match="token_type_ids"):
            ours(ids, attention_mask=mask, token_type_ids=types)
