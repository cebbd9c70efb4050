"""LoRA both ways with the real peft: one table of cases over the registry (every family x seqcls, mlm;
attention only at r 4, attention + MLP at r 16 with rsLoRA), each checked in both directions and
through one training step, all torch.equal to peft + transformers in the same run."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")

from flodl_hf import lora
from flodl_hf.auto import AutoConfig, load_model
from flodl_hf.core.errors import AdapterBaseMismatchError, AdapterError, UnsupportedAdapterError, WeightsMismatchError
from flodl_hf.roundtrip.adapters import export_adapter, merged_checkpoint_state, require_lora_checkpoint
from flodl_hf.roundtrip.parity import make_batch, reference_model
from flodl_hf.roundtrip.verify import verify_adapter
from flodl_hf.core.registry import supported_model_types

from cases import CASES
from helpers import make_checkpoint
from test_losses import _labels

pytestmark = pytest.mark.range_end  # also run at the other end of the supported range

# model_type -> (attention only, attention + MLP), in PEFT's target_modules spelling (module-name suffixes).
TARGETS: dict[str, tuple[list[str], list[str]]] = {
    "bert": (["query", "value"], ["query", "key", "value", "intermediate.dense", "output.dense"]),
    "roberta": (["query", "value"], ["query", "key", "value", "intermediate.dense", "output.dense"]),
    "camembert": (["query", "value"], ["query", "key", "value", "intermediate.dense", "output.dense"]),
    "xlm-roberta": (["query", "value"], ["query", "key", "value", "intermediate.dense", "output.dense"]),
    "roberta-prelayernorm": (["query", "value"], ["query", "key", "value", "intermediate.dense", "output.dense"]),
    "xlm-roberta-xl": (["query", "value"], ["query", "key", "value", "intermediate.dense", "output.dense"]),
    "electra": (["query", "value"], ["query", "key", "value", "intermediate.dense", "output.dense"]),
    "albert": (["query", "value"], ["query", "key", "value", "ffn", "ffn_output"]),
    "distilbert": (["q_lin", "v_lin"], ["q_lin", "k_lin", "v_lin", "lin1", "lin2"]),
    "deberta-v2": (["query_proj", "value_proj"], ["query_proj", "key_proj", "value_proj", "intermediate.dense",
                                                  "output.dense"]),
    "deberta": (["in_proj"], ["in_proj", "pos_proj", "pos_q_proj", "intermediate.dense", "output.dense"]),
    "mpnet": (["q", "v"], ["q", "k", "v", "o", "intermediate.dense", "output.dense"]),
    "modernbert": (["Wqkv"], ["Wqkv", "Wo", "Wi"]),
    **{decoder: (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
       for decoder in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite",
                       "stablelm", "olmo", "cohere", "smollm3", "olmo3", "ministral")},
    "starcoder2": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"]),
    "mixtral": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]),  # experts: 3-D, not linear
    "qwen2_moe": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    # PEFT moves gate/up/down_proj onto the stacked experts of these two (refused: tests/test_moe.py)
    "qwen3_moe": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "olmoe": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "phi3": (["qkv_proj"], ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "gpt2": (["c_attn"], ["c_attn", "c_proj", "c_fc"]),  # Conv1D layers: PEFT's fan_in_fan_out
    "gpt_neox": (["query_key_value"], ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
    "gptj": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"]),
    "opt": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
    "phi": (["q_proj", "v_proj", "fc1", "fc2"], ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"]),
    "nomic_bert": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "gte": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    # vision: PEFT has no default targets for these model types (transformers 5's module names)
    **{vision: (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"])
       for vision in ("vit", "deit", "dinov2_with_registers")},
    "dinov2": (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    # no seqcls or mlm head: their LoRA round trips are in tests/test_clip_siglip.py
    **{tower: (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"])
       for tower in ("clip", "clip_text_model", "clip_vision_model", "siglip", "siglip_text_model", "siglip_vision_model")},
}
TASKS = ("seqcls", "mlm", "image_classification")


def _width(fields: dict) -> int:
    return fields.get("hidden_size", fields.get("dim", 768))


def _table():
    """Per registered family: its narrowest variant for seqcls and mlm, attention-only r 4 and attention + MLP
    r 16 (rsLoRA); and BERT at real width (hidden 768)."""
    narrowest: dict[tuple[str, str], tuple[str, dict]] = {}
    for case_id, task, fields in CASES:
        key = (fields["model_type"], task)
        if task in TASKS and (key not in narrowest or _width(fields) < _width(narrowest[key][1])):
            narrowest[key] = (case_id, fields)
    rows = []
    for model_type in supported_model_types():
        attn, mlp = TARGETS.get(model_type) or (lora.default_targets(model_type), None)
        for task in TASKS:
            if (model_type, task) not in narrowest:
                continue
            case_id, fields = narrowest[(model_type, task)]
            if task != "image_classification":  # the vision families: attention + MLP only (test time)
                rows.append(pytest.param(task, fields, attn, 4, False, id=f"{case_id}-attn-r4"))
            if mlp is not None:
                rows.append(pytest.param(task, fields, mlp, 16, True, id=f"{case_id}-attn+mlp-r16-rslora"))
    wide = next(f for c, t, f in CASES if c == "bert-768-seqcls")
    rows.append(pytest.param("seqcls", wide, TARGETS["bert"][1], 16, False, id="bert-768-seqcls-attn+mlp-r16"))
    return rows


def test_every_registered_family_has_lora_targets_and_peft_defaults_are_peft_s():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults
    for model_type in supported_model_types():
        assert model_type in TARGETS or model_type in lora.PEFT_DEFAULT_TARGETS, model_type
        if model_type in peft_defaults:
            assert sorted(lora.default_targets(model_type)) == sorted(peft_defaults[model_type]), model_type
        else:
            with pytest.raises(AdapterError, match="target_modules"):
                lora.default_targets(model_type)
    for model_type, targets in lora.PEFT_DEFAULT_TARGETS.items():
        assert sorted(targets) == sorted(peft_defaults[model_type]), model_type


def _peft_config(task: str, targets, r: int, rslora: bool, dropout: float = 0.0):
    return peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=list(targets),
                           use_rslora=rslora, task_type=lora.PEFT_TASK_TYPES.get(task))


def _perturb(named, seed: int) -> None:
    """Give the adapter non-trivial values (B starts at zero, so a fresh adapter changes nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in named:
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _peft_trainable(model):
    return sorted(((n, p) for n, p in model.named_parameters() if p.requires_grad), key=lambda t: t[0])


def _peft_name(name: str) -> str:
    """A PeftModel parameter name -> our key (adapter name and wrappers dropped)."""
    name = name.removeprefix("base_model.model.").replace(".default", "").replace(".token_adapter.", ".")
    name = name.replace(".lora_magnitude_vector.weight", ".lora_magnitude_vector")  # DoRA's: a Parameter here
    return name.replace(".modules_to_save", "").replace(".base_layer", "")


def assert_step_equal_to_peft(ours, theirs, task: str, batch: dict) -> None:
    """One training step of ours and PEFT's model from the same weights, batch and seed: the loss and every
    trainable parameter's gradient torch.equal (our names, PEFT's mapped by ``_peft_name``); a frozen one gets
    none. Leaves both in train mode with their gradients."""
    ours.train(), theirs.train()
    labelled = {**batch, **_labels(task, ours.config, batch, "single")}
    torch.manual_seed(5)
    loss_ours = ours(**labelled).loss
    torch.manual_seed(5)
    loss_theirs = theirs(**labelled).loss
    assert torch.equal(loss_ours, loss_theirs), (loss_ours.item(), loss_theirs.item())
    loss_ours.backward(), loss_theirs.backward()
    grads = {_peft_name(n): p.grad for n, p in _peft_trainable(theirs)}
    for name, p in ours.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.grad, grads[name]), f"{name}: {(p.grad - grads[name]).abs().max().item()}"
        else:
            assert p.grad is None, name


def _equal_fields(ours, theirs) -> None:
    fields = [k for k, v in theirs.items() if isinstance(v, torch.Tensor)]
    assert fields
    for f in fields:
        a, b = getattr(ours, f), getattr(theirs, f)
        assert torch.equal(a, b), f"{f}: max abs diff {(a - b).abs().max().item()}"


@pytest.mark.parametrize("task,fields,targets,r,rslora", _table())
def test_peft_round_trip_and_training_step(task, fields, targets, r, rslora, tmp_path):
    warnings.simplefilter("ignore")
    source = make_checkpoint(fields, task)
    batch = make_batch(AutoConfig.from_pretrained(source), task)

    # In: peft writes an adapter (get_peft_model, then save_pretrained); ours loads it.
    torch.manual_seed(11)
    theirs = peft.get_peft_model(reference_model(source, task, "eager"), _peft_config(task, targets, r, rslora))
    fresh = load_model(source, task)
    torch.manual_seed(11)  # the same seed: add_lora draws PEFT's init (A kaiming-uniform, B zeros), in its order
    lora.add_lora(fresh, r=r, alpha=2 * r, target_modules=targets, use_rslora=rslora)
    inits = {_peft_name(n): p for n, p in theirs.named_parameters() if "lora_" in n}
    assert set(inits) == {n for n, _ in fresh.named_parameters() if "lora_" in n}
    assert all(torch.equal(p, inits[n]) for n, p in fresh.named_parameters() if "lora_" in n)
    _perturb(_peft_trainable(theirs), 1)
    theirs.save_pretrained(str(tmp_path / "from-peft"))
    ours = load_model(source, task, adapter=tmp_path / "from-peft")
    ours.set_attn_implementation("eager")
    assert sorted(ours.lora_config.targeted), "nothing adapted"
    mine_trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert mine_trainable == {_peft_name(n) for n, _ in _peft_trainable(theirs)}
    theirs.eval()
    with torch.no_grad():
        _equal_fields(ours(**batch), theirs(**batch))

    # One training step from the same weights, batch and seed: loss and every adapter gradient equal.
    assert_step_equal_to_peft(ours, theirs, task, batch)
    with torch.no_grad():  # the step itself (SGD), so the adapter that goes out is not the one that came in
        for p in ours.parameters():
            if p.requires_grad:
                p.sub_(0.5 * p.grad)

    # Out: our adapter directory loads into peft + transformers with no missing or unexpected keys.
    out = lora.save_adapter(ours.eval(), tmp_path / "to-peft")
    config = json.loads((out / lora.ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == r
    impl = "sdpa" if "sdpa" in ours.family.attn_implementations else "eager"  # each family's first path
    back = peft.PeftModel.from_pretrained(reference_model(source, task, impl), str(out)).eval()
    saved = set(peft.utils.load_peft_weights(str(out)))
    assert saved == set(peft.utils.get_peft_model_state_dict(back))
    ours.set_attn_implementation(impl)
    with torch.no_grad():
        _equal_fields(ours(**batch), back(**batch))
        # Merged: the same bits as peft's merge_and_unload.
        merged_theirs = back.merge_and_unload()
        merged_ours = lora.merge_and_unload(ours)
        hf = dict(merged_theirs.state_dict())
        for key, tensor in merged_ours.state_dict().items():
            assert torch.equal(tensor, hf[key]), key
        _equal_fields(merged_ours(**batch), merged_theirs(**batch))


def test_add_lora_matches_peft_init_scaling_and_freezing():
    fields = next(f for c, t, f in CASES if c == "bert-hd24-mlm")
    source = make_checkpoint(fields, "mlm")
    ours = load_model(source, "mlm")
    keys_before = list(ours.state_dict())
    torch.manual_seed(3)
    lora.add_lora(ours, r=4, alpha=16, use_rslora=True)  # PEFT's default targets for bert: query, value
    torch.manual_seed(3)
    theirs = peft.get_peft_model(reference_model(source, "mlm", "sdpa"),
                                 peft.LoraConfig(r=4, lora_alpha=16, use_rslora=True))
    peft_a = {_peft_name(n): p for n, p in theirs.named_parameters() if "lora_A" in n}
    ours_a = {n: p for n, p in ours.named_parameters() if "lora_A" in n}
    assert set(peft_a) == set(ours_a) and len(ours_a) == 2 * fields["num_hidden_layers"]
    assert all(torch.equal(ours_a[k], peft_a[k]) for k in ours_a)  # same RNG draws, same order
    layer = next(iter(lora.lora_layers(ours).values()))
    assert layer.scaling == 16 / math.sqrt(4) and layer.lora_A.weight.shape == (4, fields["hidden_size"])
    assert not layer.lora_B.weight.any()
    # Base keys unchanged and frozen; the tied decoder untouched.
    assert [k for k in ours.state_dict() if "lora_" not in k] == keys_before
    assert all(not p.requires_grad for n, p in ours.named_parameters() if "lora_" not in n)
    with pytest.raises(AdapterError, match="matches no linear layer"):
        lora.add_lora(load_model(source, "mlm"), target_modules=["decoder"])
    with pytest.raises(AdapterError, match="matches no linear layer.*query"):
        lora.add_lora(load_model(source, "mlm"), target_modules=["nothing_here"])
    # merge / unmerge: merged outputs through the base path, unmerged back within rounding.
    _perturb([(n, p) for n, p in ours.named_parameters() if p.requires_grad], 2)
    batch = make_batch(ours.config, "mlm")
    with torch.no_grad():
        before = ours(**batch).logits
        weight = layer.weight.clone()
        lora.merge(ours)
        assert layer.merged and not torch.equal(layer.weight, weight)
        torch.testing.assert_close(ours(**batch).logits, before)
        lora.unmerge(ours)
        torch.testing.assert_close(layer.weight, weight)


def test_lora_dropout_uses_peft_s_rng_draws(tmp_path):
    """With LoRA dropout > 0 (and the model's own dropout) in train mode, the same seed gives the same loss."""
    fields = next(f for c, t, f in CASES if c == "roberta-hd24-seqcls")
    source = make_checkpoint(fields, "seqcls")
    torch.manual_seed(0)
    theirs = peft.get_peft_model(reference_model(source, "seqcls", "eager"),
                                 _peft_config("seqcls", ["query", "value", "intermediate.dense"], 4, False, 0.3))
    _perturb(_peft_trainable(theirs), 4)
    theirs.save_pretrained(str(tmp_path / "a"))
    ours = load_model(source, "seqcls", adapter=tmp_path / "a")
    ours.set_attn_implementation("eager")
    assert isinstance(next(iter(lora.lora_layers(ours).values())).lora_dropout, torch.nn.Dropout)
    batch = {**make_batch(ours.config, "seqcls"), "labels": torch.tensor([0, 2])}
    ours.train(), theirs.train()
    for seed in (1, 2):
        torch.manual_seed(seed)
        a = ours(**batch).loss
        torch.manual_seed(seed)
        b = theirs(**batch).loss
        assert torch.equal(a, b), (seed, a.item(), b.item())


def _peft_adapter(tmp_path, case_id: str = "bert-hd24-seqcls", **config):
    task = case_id.rsplit("-", 1)[1]
    fields = next(f for c, t, f in CASES if c == case_id)
    source = make_checkpoint(fields, task)
    model = peft.get_peft_model(reference_model(source, task, "sdpa"),
                                peft.LoraConfig(r=4, lora_alpha=8, task_type=lora.PEFT_TASK_TYPES.get(task), **config))
    out = tmp_path / "adapter"
    model.save_pretrained(str(out))
    return source, task, out


def test_bad_adapters_get_typed_errors(tmp_path):
    from safetensors.torch import load_file, save_file
    source, task, out = _peft_adapter(tmp_path)
    # a base of another width: shapes differ
    other = make_checkpoint(next(f for c, t, f in CASES if c == "bert-768-seqcls"), "seqcls")
    with pytest.raises(AdapterBaseMismatchError, match="shapes differ"):
        load_model(other, task, adapter=out)
    # a missing and an extra key
    weights = out / lora.ADAPTER_WEIGHTS
    tensors = load_file(str(weights))
    first = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != first}, str(weights))
    with pytest.raises(WeightsMismatchError, match="missing keys") as info:
        load_model(source, task, adapter=out)
    assert str(weights) in str(info.value)
    save_file({**tensors, "base_model.model.bert.extra.lora_A.weight": torch.zeros(1)}, str(weights))
    with pytest.raises(WeightsMismatchError, match="unexpected keys.*extra"):
        load_model(source, task, adapter=out)
    save_file(tensors, str(weights))
    # an unsupported PEFT type, and an option we do not implement
    config_path = out / lora.ADAPTER_CONFIG
    good = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**good, "peft_type": "IA3"}))
    with pytest.raises(UnsupportedAdapterError, match="IA3.*LORA"):
        load_model(source, task, adapter=out)
    config_path.write_text(json.dumps({**good, "layer_replication": [[0, 1]]}))
    with pytest.raises(UnsupportedAdapterError, match="layer_replication"):
        load_model(source, task, adapter=out)
    # target_modules that match nothing
    config_path.write_text(json.dumps({**good, "target_modules": ["q_lin"]}))
    with pytest.raises(AdapterError, match="q_lin.*matches no linear layer"):
        load_model(source, task, adapter=out)
    # a recorded base sha256 that differs
    config_path.write_text(json.dumps(good))
    model = load_model(source, task)
    lora.add_lora(model)
    model.lora_base = {"source": str(source), "weights_sha256": {"model.safetensors": "0" * 64}}
    saved = lora.save_adapter(model, tmp_path / "ours")
    with pytest.raises(AdapterBaseMismatchError, match="sha256"):
        load_model(source, task, adapter=saved)


@pytest.mark.parametrize("bias", ["lora_only", "all"])
def test_bias_modes_round_trip(bias, tmp_path):
    """bias="lora_only" both ways; bias="all" in (PEFT also saves its wrapper's copies of the classifier's
    bias, which we read past and do not write: docs/lora.md)."""
    source, task, out = _peft_adapter(tmp_path, bias=bias, target_modules=["query", "value"])
    theirs = peft.PeftModel.from_pretrained(reference_model(source, task, "sdpa"), str(out))
    with torch.no_grad():
        _perturb(_peft_trainable(theirs), 6)
    theirs.save_pretrained(str(out))
    ours = load_model(source, task, adapter=out)
    assert ("bert.embeddings.LayerNorm.bias" in lora.adapter_state(ours)) == (bias == "all")
    batch = make_batch(ours.config, task)
    with torch.no_grad():
        _equal_fields(ours(**batch), theirs.eval()(**batch))
    back_dir = lora.save_adapter(ours, tmp_path / "back")
    back = peft.PeftModel.from_pretrained(reference_model(source, task, "sdpa"), str(back_dir)).eval()
    if bias == "lora_only":
        assert set(peft.utils.load_peft_weights(str(back_dir))) == set(peft.utils.get_peft_model_state_dict(back))
    with torch.no_grad():
        _equal_fields(ours(**batch), back(**batch))


# ---- malformed adapter files and trainer checkpoints: typed errors naming the file and the field --------

_BAD_ADAPTER_CONFIGS = [  # (change to adapter_config.json, field named, what the message must say)
    ({"r": None}, "r", "positive int"),                      # None: the field removed
    ({"r": "x"}, "r", "positive int"),
    ({"r": 2.5}, "r", "positive int"),
    ({"r": 0}, "r", "positive int"),
    ({"r": True}, "r", "positive int"),
    ({"lora_alpha": "x"}, "lora_alpha", "number"),
    ({"lora_alpha": True}, "lora_alpha", "number"),
    ({"lora_dropout": "x"}, "lora_dropout", r"\[0, 1\)"),
    ({"lora_dropout": 1.5}, "lora_dropout", r"\[0, 1\)"),
    ({"target_modules": 5}, "target_modules", "list of module names"),
    ({"target_modules": ["query", 5]}, "target_modules", "list of module names"),
    ({"target_modules": "(query"}, "target_modules", "regular expression"),
    ({"modules_to_save": "classifier"}, "modules_to_save", "list of module names or null"),
    ({"modules_to_save": [1]}, "modules_to_save", "list of module names or null"),
    ({"use_rslora": "no"}, "use_rslora", "JSON true or false"),
    ({"use_rslora": 1}, "use_rslora", "JSON true or false"),
    ({"bias": 3}, "bias", "none, all, lora_only"),
    ({"bias": "some"}, "bias", "none, all, lora_only"),
    ({"use_dora": "no"}, "use_dora", "JSON true or false"),
    ({"task_type": ["SEQ_CLS"]}, "task_type", "string or null"),
    ({"auto_mapping": "BertForSequenceClassification"}, "auto_mapping", "object or null"),
    ({"base_model_name_or_path": 5}, "base_model_name_or_path", "string or null"),
]


@pytest.mark.parametrize("change,name,expected", _BAD_ADAPTER_CONFIGS,
                         ids=[f"{n}={c[n]!r}" for c, n, _ in _BAD_ADAPTER_CONFIGS])
def test_malformed_adapter_config_is_a_typed_error_naming_the_field(change, name, expected, tmp_path):
    from flodl_hf.cli import main
    source, task, out = _peft_adapter(tmp_path)
    config_path = out / lora.ADAPTER_CONFIG
    data = json.loads(config_path.read_text())
    data.update(change)
    data = {k: v for k, v in data.items() if not (k == "r" and v is None)}
    config_path.write_text(json.dumps(data))
    with pytest.raises(AdapterError, match=expected) as info:
        load_model(source, task, adapter=out)
    message = str(info.value)
    assert str(config_path) in message and repr(name) in message, message
    with pytest.raises(AdapterError, match=expected):
        verify_adapter(out, base=str(source))
    assert main(["verify-export", str(out), "--source", str(source)]) == 2


def test_adapter_config_fields_peft_accepts_still_load(tmp_path):
    """Valid spellings are not refused: a regex target, alpha as a float, modules_to_save null, dropout 0."""
    source, task, out = _peft_adapter(tmp_path)
    config_path = out / lora.ADAPTER_CONFIG
    good = json.loads(config_path.read_text())
    for change in ({"target_modules": r".*\.(query|value)"}, {"lora_alpha": 8.0}, {"lora_dropout": 0},
                   {"use_rslora": False}, {"lora_alpha": None}):
        data = {**good, **change}
        if change == {"lora_alpha": None}:
            del data["lora_alpha"]  # absent: PEFT's default, 8
        config_path.write_text(json.dumps(data))
        model = load_model(source, task, adapter=out)
        assert sorted(model.lora_config.targeted), change


def test_garbage_adapter_weights_and_base_stamp_are_typed_errors(tmp_path):
    source, task, out = _peft_adapter(tmp_path)
    weights = out / lora.ADAPTER_WEIGHTS
    good_weights = weights.read_bytes()
    weights.write_bytes(b"not a safetensors file at all")
    with pytest.raises(AdapterError, match=lora.ADAPTER_WEIGHTS) as info:
        load_model(source, task, adapter=out)
    assert str(weights) in str(info.value)
    weights.write_bytes(good_weights)
    stamp = out / lora.BASE_STAMP
    for text, expected in (("{bad", "not valid JSON"), ("[1]", "JSON object"), ('{"base": "x"}', "'base'"),
                           ('{"task": 5}', "'task'"), ('{"task": "nonsense"}', "'task'"),
                           ('{"base": {"source": 1}}', "'source'"),
                           ('{"base": {"weights_sha256": "abc"}}', "'weights_sha256'")):
        stamp.write_text(text)
        with pytest.raises(AdapterError, match=expected) as info:
            load_model(source, task, adapter=out)
        assert str(stamp) in str(info.value), text
        with pytest.raises(AdapterError, match=expected):
            lora.adapter_task(json.loads((out / lora.ADAPTER_CONFIG).read_text()) | {"task_type": None}, out)
    stamp.write_text(json.dumps({"task": task, "base": None}))
    assert lora.adapter_state(load_model(source, task, adapter=out))


def _lora_checkpoint(tmp_path, lora_entry):
    """A trainer checkpoint file (the trainer's schema) of a LoRA model, with its 'lora' entry replaced."""
    from flodl_hf.core import checkpoint_schema
    source = make_checkpoint(next(f for c, t, f in CASES if c == "bert-hd24-seqcls"), "seqcls")
    model = lora.add_lora(load_model(source, "seqcls"), r=4, alpha=8, target_modules=["query", "value"])
    good = lora.trainer_entry(model)
    data = {**checkpoint_schema.header(), "model": lora.trainer_model_state(model), "config": model.config.to_dict(),
            "lora": lora_entry(good) if callable(lora_entry) else lora_entry}
    path = tmp_path / "step-1.pt"
    torch.save(data, str(path))
    return path, model, good


_BAD_LORA_ENTRIES = [
    ("config-missing", {"adapter_only": True}, "'config'"),
    ("string", "x", "'lora'"),
    ("list", [1], "'lora'"),
    ("adapter_only-str", lambda g: {**g, "adapter_only": "yes"}, "'adapter_only'"),
    ("config-str", lambda g: {**g, "config": "r=4"}, "'config'"),
    ("r-str", lambda g: {**g, "config": {**g["config"], "r": "4"}}, "'r'"),
    ("alpha-missing", lambda g: {**g, "config": {k: v for k, v in g["config"].items() if k != "lora_alpha"}},
     "'lora_alpha'"),
    ("task-list", lambda g: {**g, "config": {**g["config"], "task": ["seqcls"]}}, "'task'"),
    ("modules_to_save-str", lambda g: {**g, "config": {**g["config"], "modules_to_save": "classifier"}},
     "'modules_to_save'"),
    ("base-str", lambda g: {**g, "base": "somewhere"}, "'base'"),
    ("sha-list", lambda g: {**g, "base": {**g["base"], "weights_sha256": ["0" * 64]}}, "'weights_sha256'"),
]


@pytest.mark.parametrize("entry,expected", [pytest.param(e, x, id=i) for i, e, x in _BAD_LORA_ENTRIES])
def test_malformed_checkpoint_lora_entry_is_a_checkpoint_format_error(entry, expected, tmp_path):
    from flodl_hf.cli import main
    from flodl_hf.core.errors import CheckpointFormatError
    path, model, _ = _lora_checkpoint(tmp_path, entry)
    data = torch.load(str(path), weights_only=True)
    for call in (lambda: lora.checkpoint_entry(data, path),
                 lambda: export_adapter(path, tmp_path / "adapter"),
                 lambda: merged_checkpoint_state(data, path),
                 lambda: require_lora_checkpoint(path),
                 lambda: lora.load_trainer_state(model, data, str(path))):
        with pytest.raises(CheckpointFormatError, match=expected) as info:
            call()
        assert str(path) in str(info.value) and "'lora'" in str(info.value), str(info.value)
    assert main(["export", "--checkpoint", str(path), "--out", str(tmp_path / "cli"), "--adapter"]) == 2
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "cli").exists()


def test_checkpoint_lora_entry_well_formed(tmp_path):
    path, model, good = _lora_checkpoint(tmp_path, lambda g: g)
    data = torch.load(str(path), weights_only=True)
    assert lora.checkpoint_entry(data, path) == good
    assert lora.checkpoint_entry({"lora": None}, path) is None and lora.checkpoint_entry({}, path) is None
    out = export_adapter(path, tmp_path / "adapter")
    assert (out / lora.ADAPTER_WEIGHTS).is_file()
