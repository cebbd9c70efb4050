"""PEFT's target_parameters (LoRA on Parameters: the stacked experts' gate_up_proj and down_proj of Mixtral,
Qwen2-MoE and Qwen3-MoE, a router's 2-D weight) against PEFT's get_peft_model on transformers' model, at head_dim 24
and at real width (hidden 768, head_dim 64, one layer): the init (same seed), PEFT's adapter loaded here, a training
step (loss, gradients, updated weights), our adapter loaded by PEFT (the same file bits, PEFT's nested
base_layer keys), merge / unmerge / merge_and_unload and a trainer checkpoint exported as an adapter, all
torch.equal to PEFT in the same run; and the options PEFT refuses with target_parameters, refused here too."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")

from safetensors.torch import load_file

from flodl_hf.core import checkpoint_schema
from flodl_hf import lora
from flodl_hf.lora.peft_format import _to_hf
from flodl_hf.lora.targets import _peft_converts
from flodl_hf.auto import load_model
from flodl_hf.core.errors import AdapterError, UnsupportedAdapterError
from flodl_hf.roundtrip.adapters import export_adapter
from flodl_hf.roundtrip.parity import make_batch, reference_model

from cases import CASES
from helpers import make_checkpoint
from test_lora import _equal_fields, _peft_trainable, _perturb
from test_losses import _labels

TASK = "causal_lm"
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _source(case_id: str):
    return make_checkpoint(next(f for c, t, f in CASES if c == f"{case_id}-{TASK}"), TASK)


def _ours_by_peft_key(model) -> dict[str, torch.nn.Parameter]:
    """Our trainable Parameters under the keys PEFT's file uses (``base_model.model.<...>.base_layer.lora_A.weight``)."""
    return {lora.PEFT_PREFIX + _to_hf(model, n): p for n, p in model.named_parameters() if p.requires_grad}


def _theirs_by_peft_key(peft_model) -> dict[str, torch.nn.Parameter]:
    return {n.replace(".default", ""): p for n, p in _peft_trainable(peft_model)}


def _assert_adapters_equal(ours, theirs) -> None:
    mine, peft_side = _ours_by_peft_key(ours), _theirs_by_peft_key(theirs)
    assert mine.keys() == peft_side.keys(), sorted(mine.keys() ^ peft_side.keys())
    differ = [k for k in mine if not torch.equal(mine[k], peft_side[k])]
    assert not differ, differ


def _assert_bases_equal(ours, theirs) -> None:
    """Every base tensor (the merged experts included) torch.equal to PEFT's, under our keys."""
    peft_side = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v
                 for k, v in theirs.state_dict().items() if ".lora_" not in k}
    mine = {k: v for k, v in ours.state_dict().items() if ".lora_" not in k}
    assert mine.keys() == peft_side.keys(), sorted(mine.keys() ^ peft_side.keys())
    differ = [k for k in mine if not torch.equal(mine[k], peft_side[k])]
    assert not differ, differ


def _step(ours, theirs, batch) -> None:
    """One training step of both from the same weights and batch: loss and every gradient torch.equal (by PEFT's
    file key); then SGD on both, and the updated adapters and the outputs after it equal (in eval mode)."""
    ours.train(), theirs.train()
    labelled = {**batch, **_labels(TASK, ours.config, batch, "single")}
    loss_ours, loss_theirs = ours(**labelled).loss, theirs(**labelled).loss
    assert torch.equal(loss_ours, loss_theirs), (loss_ours.item(), loss_theirs.item())
    loss_ours.backward(), loss_theirs.backward()
    mine, peft_side = _ours_by_peft_key(ours), _theirs_by_peft_key(theirs)
    assert mine.keys() == peft_side.keys()
    for k, p in mine.items():
        assert torch.equal(p.grad, peft_side[k].grad), f"{k}: {(p.grad - peft_side[k].grad).abs().max().item()}"
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)
    with torch.no_grad():
        for p in [*mine.values(), *peft_side.values()]:
            p.sub_(0.5 * p.grad)
        _assert_adapters_equal(ours, theirs)
        ours.eval(), theirs.eval()
        _equal_fields(ours(**batch), theirs(**batch))


@pytest.mark.parametrize("case_id,targets,parameters,extra", [
    # attention and experts together; the experts of both layers nested (two wrappers per module in PEFT)
    pytest.param("mixtral-hd24-4experts-top2", ["q_proj"], ["experts.gate_up_proj", "mlp.experts.down_proj"],
                 dict(r=4, lora_alpha=7), id="mixtral-hd24"),
    # no default targets for qwen2_moe: target_modules None adapts no module; the router's 2-D weight too
    pytest.param("qwen2_moe-hd24-4experts-norm-dense1", None, [*EXPERTS, "mlp.gate.weight"],
                 dict(r=3, lora_alpha=5, use_rslora=True, rank_pattern={"down_proj": 2}), id="qwen2_moe-hd24"),
    # real width, experts only, one Parameter per module
    pytest.param("qwen3_moe-768-1layer", [], ["down_proj"], dict(r=4, lora_alpha=6), id="qwen3_moe-768"),
])
def test_target_parameters_are_peft_s_both_ways(case_id, targets, parameters, extra, tmp_path):
    warnings.simplefilter("ignore")
    source = _source(case_id)
    config = peft.LoraConfig(target_modules=targets, target_parameters=parameters, task_type="CAUSAL_LM", **extra)

    # init, the same seed: PEFT's draws, its nesting and shapes ([r * experts, in], [out, r * experts])
    torch.manual_seed(0)
    theirs = peft.get_peft_model(reference_model(source, TASK, "eager"), config)
    fresh = load_model(source, TASK)
    torch.manual_seed(0)
    lora.add_lora(fresh, r=extra["r"], alpha=extra["lora_alpha"], target_modules=targets, target_parameters=parameters,
                  use_rslora=extra.get("use_rslora", False), rank_pattern=extra.get("rank_pattern"))
    layers = lora.parameter_layers(fresh)
    assert layers and all(isinstance(m, lora.LoraParameters) for m in layers.values())
    assert not targets or lora.lora_layers(fresh)
    _assert_adapters_equal(fresh, theirs)
    assert all(not torch.equal(p, torch.zeros_like(p)) for k, p in _ours_by_peft_key(fresh).items() if "lora_A" in k)

    # In: PEFT's adapter (perturbed: B non-zero) loads here, outputs equal
    _perturb(_peft_trainable(theirs), 1)
    theirs.save_pretrained(str(tmp_path / "from-peft"))
    ours = load_model(source, TASK, adapter=tmp_path / "from-peft")
    ours.set_attn_implementation("eager")
    assert sorted(ours.lora_config.target_parameters) == sorted(parameters)
    assert sorted(ours.lora_config.targeted_parameters) == sorted(theirs.base_model.targeted_parameter_names)
    _assert_adapters_equal(ours, theirs)
    batch = make_batch(ours.config, TASK)
    ours.eval(), theirs.eval()
    with torch.no_grad():
        plain = load_model(source, TASK)(**batch).logits
        _equal_fields(ours(**batch), theirs(**batch))
        assert not torch.equal(ours(**batch).logits, plain)  # the adapted Parameters change the outputs

    _step(ours, theirs, batch)  # a training step: loss, gradients, updated weights, outputs after it

    # Out: our adapter directory, PEFT's keys, shapes and bits; PEFT loads it
    out = lora.save_adapter(ours, tmp_path / "to-peft")
    theirs.save_pretrained(str(tmp_path / "peft-after"))
    mine, peft_file = (load_file(str(d / lora.ADAPTER_WEIGHTS)) for d in (out, tmp_path / "peft-after"))
    assert sorted(mine) == sorted(peft_file)
    assert all(torch.equal(mine[k], peft_file[k]) for k in mine), [k for k in mine
                                                                   if not torch.equal(mine[k], peft_file[k])]
    written = json.loads((out / lora.ADAPTER_CONFIG).read_text())
    peft_written = json.loads((tmp_path / "peft-after" / lora.ADAPTER_CONFIG).read_text())
    assert sorted(written["target_parameters"]) == sorted(peft_written["target_parameters"])
    assert written["target_modules"] == (sorted(peft_written["target_modules"])
                                         if peft_written["target_modules"] is not None else None)
    back = peft.PeftModel.from_pretrained(reference_model(source, TASK, "eager"), str(out)).eval()
    with torch.no_grad():
        _equal_fields(ours(**batch), back(**batch))

    # merge, then unmerge: PEFT's bits in every base tensor, outputs equal
    for ours_step, peft_step, merged in ((lora.merge, theirs.merge_adapter, True),
                                         (lora.unmerge, theirs.unmerge_adapter, False)):
        with torch.no_grad():
            ours_step(ours), peft_step()
            assert all(layer.merged is merged for layer in lora.parameter_layers(ours).values())
            _assert_bases_equal(ours, theirs)
            _equal_fields(ours(**batch), theirs(**batch))

    # a trainer checkpoint (its "lora" entry carries target_parameters) exports the same adapter
    torch.save({**checkpoint_schema.header(), "model": lora.trainer_model_state(ours),
                "config": ours.config.to_dict(), "lora": lora.trainer_entry(ours)}, str(tmp_path / "step-1.pt"))
    exported = export_adapter(tmp_path / "step-1.pt", tmp_path / "exported")
    assert json.loads((exported / lora.ADAPTER_CONFIG).read_text())["target_parameters"] == sorted(parameters)
    exported = load_file(str(exported / lora.ADAPTER_WEIGHTS))
    assert sorted(exported) == sorted(peft_file) and all(torch.equal(exported[k], peft_file[k]) for k in exported)

    # merge_and_unload: the plain model again, PEFT's merged bits under the base keys
    merged_theirs = theirs.merge_and_unload()
    plain_ours = lora.merge_and_unload(ours)
    assert not lora.is_lora(plain_ours) and not lora.parameter_layers(plain_ours)
    mine, peft_side = plain_ours.state_dict(), merged_theirs.state_dict()
    assert mine.keys() == peft_side.keys()
    assert all(torch.equal(mine[k], peft_side[k]) for k in mine), [k for k in mine
                                                                   if not torch.equal(mine[k], peft_side[k])]
    with torch.no_grad():
        _equal_fields(plain_ours(**batch), merged_theirs(**batch))


MIXTRAL = "mixtral-hd24-4experts-top2"


@pytest.mark.parametrize("options,peft_error", [
    pytest.param(dict(dropout=0.1), ValueError, id="dropout"),
    pytest.param(dict(use_dora=True), ValueError, id="dora"),
    pytest.param(dict(lora_bias=True), ValueError, id="lora_bias"),
])
def test_options_peft_refuses_with_target_parameters_are_refused(options, peft_error, tmp_path):
    warnings.simplefilter("ignore")
    source = _source(MIXTRAL)
    peft_names = {"dropout": "lora_dropout"}
    with pytest.raises(peft_error):  # PEFT refuses them (ParamWrapper)
        peft.get_peft_model(reference_model(source, TASK, "eager"), peft.LoraConfig(
            r=2, target_modules=["q_proj"], target_parameters=EXPERTS,
            **{peft_names.get(k, k): v for k, v in options.items()}))
    with pytest.raises(AdapterError, match="target_parameters"):
        lora.add_lora(load_model(source, TASK), r=2, target_modules=["q_proj"], target_parameters=EXPERTS, **options)
    # the same in an adapter_config.json: a typed error naming the file
    model = load_model(source, TASK)
    lora.add_lora(model, r=2, target_modules=["q_proj"], target_parameters=EXPERTS)
    out = lora.save_adapter(model, tmp_path / "adapter")
    path = out / lora.ADAPTER_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                **{peft_names.get(k, k): v for k, v in options.items()}}))
    with pytest.raises(AdapterError, match="target_parameters"):
        load_model(source, TASK, adapter=out)


def test_target_parameters_peft_refuses_or_that_match_nothing_are_typed_errors(tmp_path):
    warnings.simplefilter("ignore")
    source = _source(MIXTRAL)
    with pytest.raises(AdapterError, match="matches no Parameter.*gate_up_proj"):
        lora.add_lora(load_model(source, TASK), target_modules=[], target_parameters=["experts.up_proj"])
    with pytest.raises(ValueError):  # PEFT: a layer targeted both ways
        peft.get_peft_model(reference_model(source, TASK, "eager"),
                            peft.LoraConfig(target_modules=["q_proj"], target_parameters=["q_proj.weight"]))
    with pytest.raises(AdapterError, match="adapts too"):
        lora.add_lora(load_model(source, TASK), target_modules=["q_proj"], target_parameters=["q_proj.weight"])
    with pytest.raises(TypeError):  # PEFT: a string is not a list of names
        peft.LoraConfig(target_modules=["q_proj"], target_parameters="mlp.experts.down_proj")
    with pytest.raises(AdapterError, match="target_parameters"):
        lora.add_lora(load_model(source, TASK), target_modules=["q_proj"], target_parameters="mlp.experts.down_proj")
    # an adapter_config.json: fan_in_fan_out with target_parameters (PEFT's ValueError), layer_replication (ours)
    model = load_model(source, TASK)
    lora.add_lora(model, r=2, target_modules=["q_proj"], target_parameters=EXPERTS)
    out = lora.save_adapter(model, tmp_path / "adapter")
    path = out / lora.ADAPTER_CONFIG
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "fan_in_fan_out": True}))
    with pytest.raises(AdapterError, match="fan_in_fan_out"):
        load_model(source, TASK, adapter=out)
    path.write_text(json.dumps({**saved, "layer_replication": [[0, 1]]}))
    with pytest.raises(UnsupportedAdapterError, match="layer_replication"):
        load_model(source, TASK, adapter=out)


@pytest.mark.parametrize("case_id", [MIXTRAL, "olmoe-hd24-4experts-norm-bias", "qwen2_moe-hd24-4experts-norm-dense1"])
def test_target_modules_none_with_target_parameters_targets_what_peft_does(case_id, tmp_path):
    """``target_modules=None`` beside ``target_parameters``: PEFT's transformers-5 MoE conversion (Mixtral, OLMoE,
    Qwen3-MoE) turns None into an empty set before its model-type default applies, so only the Parameters are
    adapted and adapter_config.json says ``[]``; Qwen2-MoE, which PEFT does not convert and has no default for,
    keeps None. The same adapted names and the same written field here."""
    warnings.simplefilter("ignore")
    source = _source(case_id)
    theirs = peft.get_peft_model(reference_model(source, TASK, "eager"),
                                 peft.LoraConfig(r=2, target_parameters=EXPERTS, task_type="CAUSAL_LM"))
    ours = lora.add_lora(load_model(source, TASK), r=2, target_parameters=EXPERTS)
    assert sorted(_ours_by_peft_key(ours)) == sorted(_theirs_by_peft_key(theirs))
    assert not lora.lora_layers(ours) and lora.parameter_layers(ours)
    theirs.save_pretrained(str(tmp_path / "peft"))
    written = json.loads((lora.save_adapter(ours, tmp_path / "ours") / lora.ADAPTER_CONFIG).read_text())
    assert written["target_modules"] == json.loads((tmp_path / "peft" / lora.ADAPTER_CONFIG).read_text())["target_modules"]


def test_a_regex_is_resolved_without_the_excluded_modules_as_peft_resolves_it():
    """exclude_modules applies while PEFT resolves a regex on a converting model (check_target_module_exists), a
    tuple as a list: o_proj excluded leaves q_proj alone, in every layer, as PEFT's adapted names."""
    warnings.simplefilter("ignore")
    source = _source(MIXTRAL)
    theirs = peft.get_peft_model(reference_model(source, TASK, "eager"), peft.LoraConfig(
        r=2, target_modules=r".*\.(q_proj|o_proj)", exclude_modules=["o_proj"], task_type="CAUSAL_LM"))
    ours = lora.add_lora(load_model(source, TASK), r=2, target_modules=r".*\.(q_proj|o_proj)",
                         exclude_modules=("o_proj",))
    assert sorted(_ours_by_peft_key(ours)) == sorted(_theirs_by_peft_key(theirs))
    assert sorted(ours.lora_config.target_modules) == sorted(theirs.peft_config["default"].target_modules)


@pytest.mark.parametrize("case_id,targets", [
    pytest.param(MIXTRAL, ["q_proj", "w1", "w3", "w2", "gate"], id="mixtral"),
    # the dense first layer's gate/up/down_proj linear layers are not adapted: PEFT moves the names away from them
    pytest.param("qwen2_moe-hd24-4experts-norm-dense1", ["v_proj", "gate_proj", "up_proj", "down_proj"],
                 id="qwen2_moe-no-conversion"),
    pytest.param("olmoe-hd24-4experts-norm-bias", ["q_proj", "gate_proj", "up_proj", "down_proj", "gate"], id="olmoe"),
    # a string is resolved to leaf names first (_resolve_string_target_modules): all-linear adds every expert and
    # router name; a regex naming layer 0's q_proj adapts q_proj in every layer; a regex naming transformers 4's
    # experts matches them after the stacked Parameter's module (experts.gate_proj for experts.gate_up_proj)
    pytest.param(MIXTRAL, "all-linear", id="mixtral-all-linear"),
    pytest.param(MIXTRAL, r"model\.layers\.0\.self_attn\.q_proj", id="mixtral-regex-one-layer"),
    # transformers' module names: the router is mlp.gate there (block_sparse_moe.gate in the file)
    pytest.param(MIXTRAL, r".*\.(mlp\.gate|k_proj)", id="mixtral-regex-router"),
    pytest.param("olmoe-hd24-4experts-norm-bias", r".*\.(v_proj|gate_proj|up_proj)", id="olmoe-regex-experts"),
    pytest.param("qwen3_moe-hd24-4experts-norm-bias-dense1", "all-linear", id="qwen3_moe-all-linear-dense"),
])
def test_expert_names_in_target_modules_are_converted_as_peft_converts_them(case_id, targets, tmp_path):
    """PEFT's transformers-5 MoE conversion (``_convert_peft_config_moe``): transformers 4's expert names in
    target_modules become target_parameters (w1 + w3 or gate_proj + up_proj -> gate_up_proj at twice the rank and
    alpha, w2 / down_proj -> down_proj, gate -> gate.weight). The same adapted names, init (same seed), outputs,
    training step, file bits and config fields as PEFT's; one of a fused pair alone is refused as PEFT refuses it.
    A string (all-linear, a regex) is resolved to leaf names first, as PEFT resolves it."""
    warnings.simplefilter("ignore")
    source = _source(case_id)
    torch.manual_seed(0)
    theirs = peft.get_peft_model(reference_model(source, TASK, "eager"),
                                 peft.LoraConfig(r=2, lora_alpha=3, target_modules=targets, task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    ours = lora.add_lora(load_model(source, TASK), r=2, alpha=3, target_modules=targets)
    ours.set_attn_implementation("eager")
    _assert_adapters_equal(ours, theirs)
    _perturb(_peft_trainable(theirs), 1)  # B non-zero; the same values here, by PEFT's file key
    peft_side = _theirs_by_peft_key(theirs)
    with torch.no_grad():
        for k, p in _ours_by_peft_key(ours).items():
            p.copy_(peft_side[k])
    batch = make_batch(ours.config, TASK)
    ours.eval(), theirs.eval()
    with torch.no_grad():
        _equal_fields(ours(**batch), theirs(**batch))
    _step(ours, theirs, batch)
    theirs.save_pretrained(str(tmp_path / "peft"))
    out = lora.save_adapter(ours, tmp_path / "ours")
    mine, peft_file = (load_file(str(d / lora.ADAPTER_WEIGHTS)) for d in (out, tmp_path / "peft"))
    assert sorted(mine) == sorted(peft_file) and all(torch.equal(mine[k], peft_file[k]) for k in mine)
    written, peft_written = (json.loads((d / lora.ADAPTER_CONFIG).read_text()) for d in (out, tmp_path / "peft"))
    for name in ("target_modules", "target_parameters"):
        assert sorted(written[name] or []) == sorted(peft_written[name] or []), name
    for name in ("rank_pattern", "alpha_pattern"):
        assert written[name] == peft_written[name], name
    back = load_model(source, TASK, adapter=tmp_path / "peft").eval()  # PEFT's converted adapter loads here
    back.set_attn_implementation("eager")
    _assert_adapters_equal(back, theirs)
    with torch.no_grad():
        _equal_fields(back(**batch), theirs(**batch))
    if case_id == MIXTRAL and isinstance(targets, list):
        with pytest.raises(ValueError, match="without also targeting"):
            peft.get_peft_model(reference_model(source, TASK, "eager"), peft.LoraConfig(r=2, target_modules=["w1"]))
        with pytest.raises(AdapterError, match="w1 without w3"):
            lora.add_lora(load_model(source, TASK), r=2, target_modules=["w1"])


@pytest.mark.parametrize("case_id", [MIXTRAL, "olmoe-hd24-4experts-norm-bias",
                                     "qwen3_moe-hd24-4experts-norm-bias-dense1"])
def test_no_target_modules_on_a_converted_moe_model_is_refused_as_peft_refuses_it(case_id):
    """A LoraConfig without target_modules or target_parameters on the MoE models PEFT 0.21 converts: the
    conversion empties PEFT's default target_modules (q_proj, v_proj for Mixtral), so PEFT raises
    NoMatchingPeftModuleError; ours refuses with an AdapterError saying what to pass."""
    source = _source(case_id)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="No `target_modules` passed"):
        warnings.simplefilter("ignore")
        peft.get_peft_model(reference_model(source, TASK, "eager"), peft.LoraConfig(r=2, task_type="CAUSAL_LM"))
    model = load_model(source, TASK)
    assert _peft_converts(model)
    with pytest.raises(AdapterError, match="target_modules=None.*pass target_modules"):
        lora.add_lora(model, r=2)
    assert not lora.is_lora(model)
