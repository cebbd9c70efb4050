"""A model loaded in float32 and then cast (``.bfloat16()``, ``.half()``, ``.to(dtype)``, and back with ``.float()``)
computes as transformers' model cast the same way, torch.equal in the same run.

RoPE families are the case that needed work: transformers keeps the inverse frequencies in non-persistent
buffers that the cast rounds (and ``.float()`` does not restore), where a load with ``dtype=`` keeps them
float32; ours follow the same two rules (``layers.LazyBuffers``, ``Backbone._apply``).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.roundtrip.parity import make_batch, reference_model

from cases import CASES
from helpers import make_checkpoint, one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = {case_id: fields for case_id, _task, fields in CASES}
MODELS = [("llama-hd24-bias-tied-llama3", "causal_lm"), ("qwen2-hd24-sliding", "causal_lm"),
          ("modernbert-bias-mean-hd24", "mlm"), ("bert-hd24", "seqcls"), ("deberta-v3-hd24", "base"), ("deberta1-hd24", "base"),
          ("distilbert-sinusoidal-hd24", "base"), ("mpnet-hd24", "base"), ("qwen3-hd24-qknorm-sliding", "causal_lm"),
          ("phi3-hd24-partial-window4", "causal_lm"), ("gemma-hd24-scaled-bias", "causal_lm"),
          ("gemma2-hd24-softcap-sliding", "causal_lm"), ("gemma3_text-hd24-qknorm-2rope", "causal_lm"),
          ("gpt2-hd24", "causal_lm"), ("gpt_neox-hd24", "causal_lm"),
          ("olmo2-hd24-qknorm-postnorm", "causal_lm"), ("olmo2-hd24-qknorm-postnorm", "seqcls"),
          ("granite-hd24-multipliers", "causal_lm"), ("starcoder2-hd24-bias-window4", "causal_lm"),
          ("stablelm-hd24-qknorm-parallel", "causal_lm"), ("gptj-hd24", "causal_lm"), ("gptj-hd24-fullrot-tied", "seqcls"),
          ("opt-hd24-postln-project", "causal_lm"), ("mixtral-hd24-6experts-top3-window4", "causal_lm"),
          ("qwen2_moe-hd24-4experts-norm-dense1", "causal_lm"),
          ("qwen3_moe-hd24-4experts-norm-bias-dense1", "causal_lm"), ("olmoe-hd24-6experts-top3-clip", "causal_lm"),
          ("phi-hd24-qknorm", "causal_lm"), ("olmo-hd24-clip-bias", "causal_lm"),
          ("cohere-hd24-qknorm-bias", "causal_lm"),
          ("smollm3-hd24-nope-sliding-bias", "causal_lm"), ("olmo3-hd24-sliding-2rope", "causal_lm")]
CASTS = {
    "bfloat16": lambda m: m.bfloat16(),
    "half": lambda m: m.half(),
    "to_dtype_then_float": lambda m: m.to(dtype=torch.bfloat16).float(),
}


def _outputs(model, batch) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        out = model(**batch)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("case,task", MODELS, ids=["-".join(m) for m in MODELS])
def test_casts_after_load_equal_transformers(case, task):
    source = make_checkpoint(FIELDS[f"{case}-{task}"], task)
    for name, cast in CASTS.items():
        ours = cast(load_model(source, task, dtype=torch.float32).eval())
        theirs = cast(reference_model(source, task, None))
        batch = make_batch(ours.config, task)
        if task == "causal_lm":
            batch["use_cache"] = False
        a, b = _outputs(ours, batch), _outputs(theirs, batch)
        assert a.keys() == b.keys() and a
        for key in a:
            assert a[key].dtype == b[key].dtype, (name, key)
            assert torch.equal(a[key], b[key]), (name, key, (a[key].float() - b[key].float()).abs().max().item())


@pytest.mark.parametrize("case,task", MODELS[:3], ids=["-".join(m) for m in MODELS[:3]])
def test_rope_frequencies_round_on_a_cast_and_not_on_a_load(case, task):
    source = make_checkpoint(FIELDS[f"{case}-{task}"], task)
    loaded = load_model(source, task, dtype=torch.bfloat16).eval()
    cast = load_model(source, task, dtype=torch.float32).eval().bfloat16()
    key = loaded.config.layer_kinds()[0] if loaded.family.model_type == "modernbert" else None
    assert loaded.backbone.inverse_frequencies(key).dtype == torch.float32  # as transformers' load with dtype=
    assert cast.backbone.inverse_frequencies(key).dtype == torch.bfloat16   # as its buffer after .bfloat16()
    restored = cast.float().backbone.inverse_frequencies(key)
    exact = load_model(source, task, dtype=torch.float32).backbone.inverse_frequencies(key)
    assert restored.dtype == torch.float32 and not torch.equal(restored, exact)  # the rounding stays
    batch = make_batch(loaded.config, task)
    if task == "causal_lm":
        batch["use_cache"] = False
    for twin in (pickle.loads(pickle.dumps(cast)), copy.deepcopy(cast)):
        assert twin.backbone.inverse_frequencies._make.__self__ is twin.backbone
        a, b = _outputs(twin, batch), _outputs(cast, batch)
        assert all(torch.equal(a[k], b[k]) for k in a)
