"""LoRA adapters at PEFT's edges: options PEFT applies at load, tied embeddings saved twice, a bfloat16 base,
heads behind TaskModel's unregistered part, adapters without a task_type, nested heads with bias="all", and
the refusals. Every exactness check is against the real peft in the same run (torch.equal)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")

from safetensors.torch import load_file

from flodl_hf import lora
from flodl_hf.lora.targets import _peft_converts
from flodl_hf.auto import load_model
from flodl_hf.core.errors import AdapterBaseMismatchError, AdapterError, UnsupportedAdapterError
from flodl_hf.roundtrip.adapters import export_adapter
from flodl_hf.roundtrip.parity import make_batch, reference_model

from cases import CASES
from helpers import make_checkpoint

BERT = "bert-hd24-seqcls"
LLAMA_TIED = "llama-hd24-bias-tied-llama3-causal_lm"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _source(case_id: str):
    task, fields = next((t, f) for c, t, f in CASES if c == case_id)
    return make_checkpoint(fields, task), task


def _perturb(model, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda t: t[0]):
            if p.requires_grad:
                p.add_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))


def _equal(ours, theirs) -> None:
    fields = [k for k, v in theirs.items() if isinstance(v, torch.Tensor)]
    assert fields
    for f in fields:
        a, b = getattr(ours, f), getattr(theirs, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{f}: max abs diff {(a.float() - b.float()).abs().max()}"


def _peft_adapter(case_id: str, path, dtype=None, **cfg):
    """PEFT writes an adapter (get_peft_model, perturbed, save_pretrained); returns it in eval mode."""
    source, task = _source(case_id)
    cfg.setdefault("task_type", lora.PEFT_TASK_TYPES.get(task, "CAUSAL_LM" if task == "causal_lm" else None))
    base = reference_model(source, task, "eager")
    if dtype is not None:
        base = base.to(dtype)
    torch.manual_seed(0)
    model = peft.get_peft_model(base, peft.LoraConfig(**cfg))
    _perturb(model)
    model.save_pretrained(str(path))
    return model.eval()


def _ours(case_id: str, adapter, dtype=None):
    source, task = _source(case_id)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = load_model(source, task, adapter=str(adapter), **kwargs).eval()
    model.set_attn_implementation("eager")
    return model


def _peft_reload(case_id: str, adapter, dtype=None):
    source, task = _source(case_id)
    base = reference_model(source, task, "eager")
    if dtype is not None:
        base = base.to(dtype)
    return peft.PeftModel.from_pretrained(base, str(adapter)).eval()


def _both_ways(case_id: str, tmp_path, theirs, adapter, dtype=None):
    """Ours loads PEFT's adapter (outputs equal), saves it back (the same keys and bits as PEFT's file), and
    PEFT reloads ours (outputs equal)."""
    ours = _ours(case_id, adapter, dtype)
    batch = make_batch(ours.config, _source(case_id)[1])
    with torch.no_grad():
        _equal(ours(**batch), theirs(**batch))
    out = lora.save_adapter(ours, tmp_path / "ours")
    mine, peft_file = load_file(str(out / lora.ADAPTER_WEIGHTS)), load_file(str(adapter / lora.ADAPTER_WEIGHTS))
    assert sorted(mine) == sorted(peft_file)
    for k in peft_file:
        assert mine[k].dtype == peft_file[k].dtype and torch.equal(mine[k], peft_file[k]), k
    back = _peft_reload(case_id, out, dtype)
    with torch.no_grad():
        _equal(ours(**batch), back(**batch))
    return ours, out


def _edit_config(adapter, **changes) -> None:
    path = adapter / lora.ADAPTER_CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# ---- 1. init_lora_weights ---------------------------------------------------------------------------------

@pytest.mark.parametrize("init", [False, "gaussian", "orthogonal", "eva", "lora_ga"])
def test_init_lora_weights_that_reload_as_plain_lora(init, tmp_path):
    adapter = tmp_path / "peft"
    _peft_adapter(BERT, adapter, target_modules=["query", "value"], r=4)
    _edit_config(adapter, init_lora_weights=init)
    theirs = _peft_reload(BERT, adapter)
    ours = _ours(BERT, adapter)
    batch = make_batch(ours.config, "seqcls")
    with torch.no_grad():
        _equal(ours(**batch), theirs(**batch))


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora", "corda", "loftq", "mica", "kaiming"])
def test_init_lora_weights_peft_applies_at_load_are_refused(init, tmp_path):
    adapter = tmp_path / "peft"
    _peft_adapter(BERT, adapter, target_modules=["query", "value"], r=4)
    _edit_config(adapter, init_lora_weights=init)
    with pytest.raises(UnsupportedAdapterError, match=f"init_lora_weights='{init}' is not supported"):
        _ours(BERT, adapter)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_pissa_and_olora_change_the_base_at_load_in_peft_and_are_refused(init, tmp_path):
    """Why they are refused: PEFT's reload of the same A and B differs from plain LoRA's (the base changes)."""
    source, task = _source(BERT)
    torch.manual_seed(0)
    model = peft.get_peft_model(reference_model(source, task, "eager"),
                                peft.LoraConfig(target_modules=["query", "value"], r=4, init_lora_weights=init,
                                                task_type="SEQ_CLS"))
    model.save_pretrained(str(tmp_path / init))
    theirs = _peft_reload(BERT, tmp_path / init)
    _edit_config(tmp_path / init, init_lora_weights=True)
    plain = _peft_reload(BERT, tmp_path / init)
    batch = make_batch(theirs.config, task)
    with torch.no_grad():
        assert not torch.equal(theirs(**batch).logits, plain(**batch).logits)
    _edit_config(tmp_path / init, init_lora_weights=init)
    with pytest.raises(UnsupportedAdapterError, match="init_lora_weights"):
        _ours(BERT, tmp_path / init)


def test_init_lora_weights_of_another_type_is_a_typed_error(tmp_path):
    adapter = tmp_path / "peft"
    _peft_adapter(BERT, adapter, target_modules=["query"], r=4)
    _edit_config(adapter, init_lora_weights=1)
    with pytest.raises(AdapterError, match="init_lora_weights"):
        _ours(BERT, adapter)


# ---- 2. tied embeddings and modules_to_save --------------------------------------------------------------

@pytest.mark.parametrize("to_save", [["embed_tokens", "lm_head"], ["lm_head"], ["embed_tokens"]])
def test_tied_embeddings_saved_as_modules_to_save(to_save, tmp_path):
    adapter = tmp_path / "peft"
    theirs = _peft_adapter(LLAMA_TIED, adapter, target_modules=["q_proj", "v_proj"], r=4, modules_to_save=to_save)
    ours, _ = _both_ways(LLAMA_TIED, tmp_path, theirs, adapter)
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight  # PEFT's wrapper trains a copy


def test_add_lora_unties_a_module_to_save_and_leaves_the_other_as_it_was():
    source, task = _source(LLAMA_TIED)
    ours = load_model(source, task)
    embed = ours.model.embed_tokens.weight
    assert ours.lm_head.weight is embed
    torch.manual_seed(0)
    lora.add_lora(ours, r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    torch.manual_seed(0)
    theirs = peft.get_peft_model(reference_model(source, task, "eager"),
                                 peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                                 task_type="CAUSAL_LM"))
    assert ours.model.embed_tokens.weight is embed and not embed.requires_grad
    assert ours.lm_head.weight is not embed and ours.lm_head.weight.requires_grad
    assert torch.equal(ours.lm_head.weight, embed)
    trainable = sorted(n.removeprefix("base_model.model.").replace(".modules_to_save.default", "")
                       for n, p in theirs.named_parameters() if p.requires_grad and "lora_" not in n)
    assert trainable == sorted(k for k in lora.adapter_state(ours) if "lora_" not in k) == ["lm_head.weight"]


def test_a_tied_decoder_in_target_modules_is_refused_saying_why(tmp_path):
    adapter = tmp_path / "peft"
    _peft_adapter(LLAMA_TIED, adapter, target_modules=["q_proj", "lm_head"], r=4)
    with pytest.raises(UnsupportedAdapterError, match="lm_head, which is tied to the input embeddings"):
        _ours(LLAMA_TIED, adapter)


# ---- 3. a bfloat16 base: float32 adapter weights, PEFT's dtype handling -------------------------------------

def test_bf16_base_keeps_float32_adapter_weights_as_peft(tmp_path):
    source, task = _source(BERT)
    torch.manual_seed(0)
    theirs = peft.get_peft_model(reference_model(source, task, "eager").to(torch.bfloat16),
                                 peft.LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))
    ours = load_model(source, task, dtype=torch.bfloat16)
    torch.manual_seed(0)
    lora.add_lora(ours, r=4, target_modules=["query", "value"])
    peft_a = {n.removeprefix("base_model.model.").replace(".default", ""): p
              for n, p in theirs.named_parameters() if "lora_A" in n}
    ours_a = {n: p for n, p in ours.named_parameters() if "lora_A" in n}
    assert set(peft_a) == set(ours_a)
    for k in ours_a:  # float32(bfloat16(init)), as PEFT's
        assert ours_a[k].dtype == peft_a[k].dtype == torch.float32 and torch.equal(ours_a[k], peft_a[k]), k


def test_bf16_base_round_trip(tmp_path):
    adapter = tmp_path / "peft"
    theirs = _peft_adapter(BERT, adapter, dtype=torch.bfloat16, target_modules=["query", "value", "dense"], r=4)
    ours, _ = _both_ways(BERT, tmp_path, theirs, adapter, dtype=torch.bfloat16)
    layer = next(iter(lora.lora_layers(ours).values()))
    assert layer.weight.dtype == torch.bfloat16 and layer.lora_A.weight.dtype == torch.float32


def test_bf16_lora_linear_forward_merge_unmerge_are_peft_s():
    torch.manual_seed(0)
    base = torch.nn.Linear(24, 40).to(torch.bfloat16)
    torch.manual_seed(1)
    theirs = peft.tuners.lora.Linear(base, "default", r=4, lora_alpha=16,
                                     config=peft.LoraConfig(r=4, lora_alpha=16))
    peft.tuners.tuners_utils.cast_adapter_dtype(theirs, "default")
    plain = torch.nn.Linear(24, 40).to(torch.bfloat16)
    plain.load_state_dict(base.state_dict())
    torch.manual_seed(1)
    ours = lora.LoraLinear(plain, r=4, alpha=16, dropout=0.0, use_rslora=False)
    assert ours.lora_A.weight.dtype == theirs.lora_A["default"].weight.dtype == torch.float32
    assert torch.equal(ours.lora_A.weight, theirs.lora_A["default"].weight)
    with torch.no_grad():
        b = torch.randn(40, 4) * 0.1
        ours.lora_B.weight.copy_(b)
        theirs.lora_B["default"].weight.copy_(b)
        x = torch.randn(3, 5, 24).to(torch.bfloat16)
        y_ours, y_theirs = ours(x), theirs(x)
        assert y_ours.dtype == y_theirs.dtype == torch.bfloat16 and torch.equal(y_ours, y_theirs)
        ours.merge()
        theirs.merge()
        assert torch.equal(ours.weight, theirs.base_layer.weight)
        ours.unmerge()
        theirs.unmerge()
        assert torch.equal(ours.weight, theirs.base_layer.weight)


# ---- 4. ModernBERT's head.dense (TaskModel's unregistered head part) --------------------------------------

@pytest.mark.parametrize("targets", [["Wqkv", "Wo", "Wi", "dense"], r".*(Wqkv|head\.dense)"],
                         ids=["all-linear-set", "regex"])
def test_modernbert_head_dense_target(targets, tmp_path):
    case = "modernbert-bias-mean-hd24-seqcls"
    adapter = tmp_path / "peft"
    theirs = _peft_adapter(case, adapter, target_modules=targets, r=4)
    ours, _ = _both_ways(case, tmp_path, theirs, adapter)
    assert "head.dense" in lora.lora_layers(ours)
    assert lora.lora_layers(ours)["head.dense"] is ours.head.head.dense  # the part's forward sees the adapter


# ---- 5. no task_type: only what the adapter lists ----------------------------------------------------------

@pytest.mark.parametrize("case,targets,to_save", [
    (BERT, ["query", "value"], None),
    (BERT, ["query", "value"], ["classifier"]),
    ("llama-hd24-bias-tied-llama3-seqcls", ["q_proj"], None),
    ("bert-hd24-tokcls", ["query"], None),
])
def test_adapter_without_task_type(case, targets, to_save, tmp_path):
    adapter = tmp_path / "peft"
    theirs = _peft_adapter(case, adapter, target_modules=targets, r=4, modules_to_save=to_save, task_type=None)
    ours, out = _both_ways(case, tmp_path, theirs, adapter)
    assert lora.read_adapter_config(out)["task_type"] is None
    assert ours.lora_config.modules_to_save == to_save


# ---- 6. bias="all" with a nested head ---------------------------------------------------------------------

def test_bias_all_with_a_nested_head(tmp_path):
    case = "roberta-hd24-seqcls"
    adapter = tmp_path / "peft"
    theirs = _peft_adapter(case, adapter, target_modules=["query"], r=4, bias="all")
    assert any(".modules_to_save.default.dense.bias" in k for k in load_file(str(adapter / lora.ADAPTER_WEIGHTS)))
    ours = _ours(case, adapter)
    batch = make_batch(ours.config, "seqcls")
    with torch.no_grad():
        _equal(ours(**batch), theirs(**batch))


# ---- 7. task_type against the model's task -----------------------------------------------------------------

def test_task_type_of_another_head_is_refused(tmp_path):
    adapter = tmp_path / "peft"
    _peft_adapter(BERT, adapter, target_modules=["query"], r=4)
    source, _ = _source("bert-hd24-tokcls")
    with pytest.raises(AdapterBaseMismatchError, match="task_type 'SEQ_CLS'.*tokcls"):
        load_model(source, "tokcls", adapter=str(adapter))
    tok = tmp_path / "tok"
    _peft_adapter("bert-hd24-tokcls", tok, target_modules=["query"], r=4)
    with pytest.raises(AdapterBaseMismatchError, match="task_type 'TOKEN_CLS'"):
        _ours(BERT, tok)


# ---- 8. PEFT's selection: exclude_modules, layers_to_transform / layers_pattern, rank_pattern / alpha_pattern ----

_SELECTIONS = [
    ("layer-0", BERT, dict(target_modules=["query", "value"], layers_to_transform=0)),
    ("layer-1-pattern", BERT, dict(target_modules=["query", "value"], layers_to_transform=[1], layers_pattern="layer")),
    ("exclude-list", BERT, dict(target_modules=["query", "key", "value", "dense"], exclude_modules=["key", "output.dense"])),
    ("exclude-regex", BERT, dict(target_modules=["query", "value"], exclude_modules=r".*layer\.1\..*")),
    ("rank-alpha-patterns", BERT, dict(target_modules=["query", "key", "value"], r=4,
                                       rank_pattern={"value": 2, r"layer.1.attention.self.query": 6},
                                       alpha_pattern={"key": 16, "query": 3})),
    ("llama-layers", LLAMA_TIED, dict(target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[1],
                                      layers_pattern=["layers"], rank_pattern={"down_proj": 2})),
]


@pytest.mark.parametrize("case_id,cfg", [pytest.param(c, cfg, id=i) for i, c, cfg in _SELECTIONS])
def test_peft_selection_fields_both_ways(case_id, cfg, tmp_path):
    """PEFT's adapter with the field loads here onto the same modules with the same ranks (outputs equal), saves
    back to PEFT's keys and bits, and reloads in PEFT; add_lora with the same fields and seed draws PEFT's init."""
    cfg = {"r": 4, "lora_alpha": 8, **cfg}
    theirs = _peft_adapter(case_id, tmp_path / "peft", **cfg)
    ours = _ours(case_id, tmp_path / "peft")
    shapes = {_key(n): tuple(p.shape) for n, p in theirs.named_parameters() if "lora_" in n}
    assert shapes == {n: tuple(p.shape) for n, p in ours.named_parameters() if "lora_" in n}
    assert len({s for s in shapes.values()}) > 1 or "pattern" not in str(cfg)  # the patterns gave several ranks
    scalings = {_key(n): m.scaling["default"] for n, m in theirs.named_modules() if hasattr(m, "lora_A")
                and isinstance(getattr(m, "scaling", None), dict)}
    assert scalings == {n: m.scaling for n, m in lora.lora_layers(ours).items()}
    _both_ways(case_id, tmp_path, theirs, tmp_path / "peft")
    saved = json.loads((tmp_path / "ours" / lora.ADAPTER_CONFIG).read_text())
    for name, default in (("rank_pattern", {}), ("alpha_pattern", {}), ("layers_to_transform", None),
                          ("layers_pattern", None), ("exclude_modules", None)):
        expected = cfg.get(name, default)
        assert saved[name] == (sorted(expected) if name == "exclude_modules" and isinstance(expected, list)
                               else expected), name  # PEFT keeps exclude_modules as a set: written sorted
    source, task = _source(case_id)
    torch.manual_seed(0)
    fresh = load_model(source, task)
    torch.manual_seed(0)  # _peft_adapter's seed before get_peft_model
    theirs_fresh = peft.get_peft_model(reference_model(source, task, "eager"),
                                       peft.LoraConfig(**cfg, task_type=lora.PEFT_TASK_TYPES.get(task, "CAUSAL_LM")))
    torch.manual_seed(0)
    lora.add_lora(fresh, r=cfg["r"], alpha=cfg["lora_alpha"], target_modules=cfg["target_modules"],
                  **{k: v for k, v in cfg.items() if k in ("rank_pattern", "alpha_pattern", "exclude_modules",
                                                           "layers_to_transform", "layers_pattern")})
    inits = {_key(n): p for n, p in theirs_fresh.named_parameters() if "lora_A" in n}
    assert inits and inits.keys() == {n for n, _ in fresh.named_parameters() if "lora_A" in n}
    assert all(torch.equal(p, inits[n]) for n, p in fresh.named_parameters() if "lora_A" in n)


def _key(name: str) -> str:
    """A PeftModel parameter name -> ours (DoRA's magnitude is a Parameter of the layer itself here)."""
    return name.removeprefix("base_model.model.").replace(".default", "").replace("magnitude_vector.weight",
                                                                                   "magnitude_vector")


_BAD_SELECTIONS = [
    ({"rank_pattern": {"query": 0}}, "rank_pattern"),
    ({"rank_pattern": {"query": "2"}}, "rank_pattern"),
    ({"alpha_pattern": ["query"]}, "alpha_pattern"),
    ({"exclude_modules": 5}, "exclude_modules"),
    ({"exclude_modules": "("}, "exclude_modules.*not a valid regular expression"),
    ({"rank_pattern": {"[": 2}}, "rank_pattern.*not a valid regular expression"),
    ({"layers_to_transform": "0"}, "layers_to_transform"),
    ({"layers_to_transform": [0, True]}, "layers_to_transform"),
    ({"layers_pattern": "layer", "layers_to_transform": None}, "layers_pattern.*without layers_to_transform"),
    ({"target_modules": ".*query", "layers_to_transform": [0]}, "layers_to_transform.*target_modules is a string"),
]


@pytest.mark.parametrize("change,expected", _BAD_SELECTIONS)
def test_bad_selection_fields_are_typed_errors_naming_them(change, expected, tmp_path):
    _peft_adapter(BERT, tmp_path / "peft", target_modules=["query"], r=4)
    config_path = tmp_path / "peft" / lora.ADAPTER_CONFIG
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **change}))
    with pytest.raises(AdapterError, match=expected) as info:
        _ours(BERT, tmp_path / "peft")
    assert str(config_path) in str(info.value)
    source, task = _source(BERT)
    kwargs = {k: v for k, v in change.items() if k != "target_modules"}
    with pytest.raises(AdapterError, match=expected):  # add_lora's keywords, the same rules
        lora.add_lora(load_model(source, task), target_modules=change.get("target_modules", ["query"]), **kwargs)


def test_selection_fields_survive_a_trainer_checkpoint(tmp_path):
    """A LoRA trainer checkpoint records the selection fields and DoRA: export --checkpoint --adapter rebuilds the same
    modules and ranks, and PEFT loads the adapter it writes (outputs equal). An entry written before the
    fields existed still reads, with PEFT's defaults."""
    from flodl_hf.core import checkpoint_schema
    source, task = _source(BERT)
    model = lora.add_lora(load_model(source, task), r=4, alpha=8, target_modules=["query", "value"],
                          rank_pattern={"value": 2}, exclude_modules=r".*layer\.0\.attention\.self\.query",
                          use_dora=True)
    _perturb(model)
    entry = lora.trainer_entry(model)
    data = {**checkpoint_schema.header(), "model": lora.trainer_model_state(model), "config": model.config.to_dict(),
            "lora": entry}
    path = tmp_path / "step-1.pt"
    torch.save(data, str(path))
    out = export_adapter(path, tmp_path / "adapter")
    back = _peft_reload(BERT, out)
    assert {_key(n): tuple(p.shape) for n, p in back.named_parameters() if "lora_" in n} == \
        {n: tuple(p.shape) for n, p in model.named_parameters() if "lora_" in n}
    model.eval().set_attn_implementation("eager")
    batch = make_batch(model.config, task)
    with torch.no_grad():
        _equal(model(**batch), back(**batch))
    older = {**entry, "config": {k: v for k, v in entry["config"].items() if k not in
                                 ("rank_pattern", "alpha_pattern", "exclude_modules", "layers_to_transform",
                                  "layers_pattern", "use_dora")}}
    settings = lora.checkpoint_entry({**data, "lora": older}, path)["config"]
    assert lora.lora_settings(settings, "x", defaults=False)["rank_pattern"] == {}


# ---- 9. DoRA (use_dora) and lora_bias ---------------------------------------------------------------------

@pytest.mark.parametrize("case_id,cfg", [
    pytest.param(BERT, dict(target_modules=["query", "value", "output.dense"], lora_dropout=0.0, use_dora=True),
                 id="dora-bert"),
    pytest.param(BERT, dict(target_modules=["query", "value"], lora_dropout=0.2, rank_pattern={"value": 2},
                            use_dora=True), id="dora-bert-dropout"),
    pytest.param(LLAMA_TIED, dict(target_modules=["q_proj", "o_proj", "up_proj"], lora_dropout=0.0, use_dora=True),
                 id="dora-llama"),
    pytest.param(BERT, dict(target_modules=["query", "value", "output.dense"], lora_dropout=0.2, lora_bias=True),
                 id="lora_bias-bert-dropout"),
    pytest.param(LLAMA_TIED, dict(target_modules=["q_proj", "o_proj"], lora_dropout=0.0, lora_bias=True),
                 id="lora_bias-llama"),  # this case's q_proj and o_proj have biases (attention_bias)
    pytest.param("gpt2-hd24-causal_lm", dict(target_modules=["c_attn", "c_proj"], lora_dropout=0.0, lora_bias=True),
                 id="lora_bias-gpt2-conv1d"),
])
def test_lora_variant_both_ways_training_step_and_merge(case_id, cfg, tmp_path):
    """PEFT's DoRA and lora_bias adapters: our init (A with the same seed; DoRA's magnitude; lora_B's zero bias
    after its own init draws), outputs in eval and, with the same seed, the loss and every adapter gradient in train
    mode (DoRA: dropout recomputes the base product), our save back to PEFT's keys and bits and PEFT's reload, and
    the merged weights and biases, all torch.equal to peft."""
    variant = "use_dora" if cfg.get("use_dora") else "lora_bias"
    marker = ".lora_magnitude_vector" if variant == "use_dora" else ".lora_B.bias"
    cfg = {"r": 4, "lora_alpha": 8, **cfg}
    source, task = _source(case_id)
    torch.manual_seed(0)
    fresh = load_model(source, task)
    torch.manual_seed(0)
    lora.add_lora(fresh, r=4, alpha=8, dropout=cfg["lora_dropout"], target_modules=cfg["target_modules"],
                  rank_pattern=cfg.get("rank_pattern"), **{variant: True})
    theirs = _peft_adapter(case_id, tmp_path / "peft", **cfg)  # seeds 0 before get_peft_model, then perturbs
    torch.manual_seed(0)
    reference = peft.get_peft_model(reference_model(source, task, "eager"),
                                    peft.LoraConfig(**cfg, task_type=lora.PEFT_TASK_TYPES.get(task, "CAUSAL_LM")))
    init = {_key(n): p for n, p in reference.named_parameters() if "lora_" in n}
    mine = {n: p for n, p in fresh.named_parameters() if "lora_" in n}
    assert init.keys() == mine.keys() and any(k.endswith(marker) for k in mine)
    assert all(torch.equal(mine[k], init[k]) for k in mine), [k for k in mine if not torch.equal(mine[k], init[k])]
    ours, out = _both_ways(case_id, tmp_path, theirs, tmp_path / "peft")
    assert json.loads((out / lora.ADAPTER_CONFIG).read_text())[variant] is True
    assert any(k.endswith(marker) for k in load_file(str(out / lora.ADAPTER_WEIGHTS)))
    # a training step: loss and every trainable gradient
    batch = make_batch(ours.config, task)
    labels = batch["input_ids"] if task == "causal_lm" else torch.tensor([0, 1])
    ours.train(), theirs.train()
    torch.manual_seed(7)
    loss_ours = ours(**batch, labels=labels).loss
    torch.manual_seed(7)
    loss_theirs = theirs(**batch, labels=labels).loss
    assert torch.equal(loss_ours, loss_theirs), (loss_ours.item(), loss_theirs.item())
    loss_ours.backward(), loss_theirs.backward()
    grads = {_key(n).replace(".modules_to_save", "").replace(".base_layer", ""): p.grad
             for n, p in theirs.named_parameters() if p.requires_grad}
    trained = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert trained.keys() == grads.keys()
    for name, p in trained.items():
        assert torch.equal(p.grad, grads[name]), f"{name}: {(p.grad - grads[name]).abs().max().item()}"
    # merged: PEFT's merge_and_unload bits
    ours.eval(), theirs.eval()
    merged_theirs = theirs.merge_and_unload()
    merged_ours = lora.merge_and_unload(ours)
    hf = dict(merged_theirs.state_dict())
    for key, tensor in merged_ours.state_dict().items():
        assert torch.equal(tensor, hf[key]), key


@pytest.mark.parametrize("change,expected", [
    ({"lora_bias": "yes"}, "'lora_bias'.*JSON true or false"),
    ({"lora_bias": True, "use_dora": True}, "'lora_bias' and 'use_dora' are both true"),
    ({"lora_bias": True, "init_lora_weights": "gaussian"}, "lora_bias=true with init_lora_weights='gaussian'"),
])
def test_bad_lora_bias_settings_are_typed_where_peft_refuses_them(change, expected, tmp_path):
    """What PEFT's LoraConfig refuses with lora_bias, refused in adapter_config.json (naming the file) and, for the
    DoRA pair, by add_lora; PEFT itself raises on the last two."""
    _peft_adapter(BERT, tmp_path / "peft", target_modules=["query"], r=4, lora_bias=True)
    _edit_config(tmp_path / "peft", **change)
    with pytest.raises(AdapterError, match=expected) as info:
        _ours(BERT, tmp_path / "peft")
    assert str(tmp_path / "peft") in str(info.value)
    if len(change) == 2 and "use_dora" in change:
        with pytest.raises(ValueError, match="lora_bias"):
            peft.LoraConfig(target_modules=["query"], **change)
        source, task = _source(BERT)
        with pytest.raises(AdapterError, match="both true"):
            lora.add_lora(load_model(source, task), target_modules=["query"], **change)


def test_lora_bias_on_a_layer_without_bias_cannot_merge_and_survives_a_checkpoint(tmp_path):
    """A trainer checkpoint records lora_bias and export --checkpoint --adapter writes an adapter PEFT reloads equal
    (an entry written before the field reads as false); a lora_B bias on a bias-free layer cannot merge, typed
    (PEFT: a RuntimeError)."""
    from flodl_hf.core import checkpoint_schema
    source, task = _source(LLAMA_TIED)
    model = lora.add_lora(load_model(source, task), r=4, alpha=8, target_modules=["q_proj", "gate_proj"],
                          lora_bias=True)
    _perturb(model)
    entry = lora.trainer_entry(model)
    assert entry["config"]["lora_bias"] is True
    data = {**checkpoint_schema.header(), "model": lora.trainer_model_state(model), "config": model.config.to_dict(),
            "lora": entry}
    path = tmp_path / "step-1.pt"
    torch.save(data, str(path))
    out = export_adapter(path, tmp_path / "adapter")
    assert json.loads((out / lora.ADAPTER_CONFIG).read_text())["lora_bias"] is True
    back = _peft_reload(LLAMA_TIED, out)
    model.eval().set_attn_implementation("eager")
    batch = make_batch(model.config, task)
    with torch.no_grad():
        _equal(model(**batch), back(**batch))
    older = {**entry, "config": {k: v for k, v in entry["config"].items() if k != "lora_bias"}}
    assert lora.lora_settings(lora.checkpoint_entry({**data, "lora": older}, path)["config"], "x",
                              defaults=False)["lora_bias"] is False
    fields = next(f for c, _, f in CASES if c == LLAMA_TIED)
    bare = lora.add_lora(load_model(make_checkpoint({**fields, "mlp_bias": False}, task), task), r=4,
                         target_modules=["gate_proj"], lora_bias=True)
    with pytest.raises(AdapterError, match="lora_bias=True on a layer without a bias"):
        lora.merge_and_unload(bare)


# ---- 10. target_modules="all-linear" ----------------------------------------------------------------------

def _first_cases(tasks):
    seen, out = set(), []
    for case_id, task, fields in CASES:
        key = (fields["model_type"], task)
        if task in tasks and key not in seen:
            seen.add(key)
            out.append(pytest.param(case_id, task, fields, id=case_id))
    return out


@pytest.mark.parametrize("case_id,task,fields", _first_cases(("mlm", "causal_lm", "seqcls", "tokcls")))
def test_all_linear_expands_to_peft_s_modules(case_id, task, fields):
    """PEFT's 'all-linear' on transformers' model and ours on the same checkpoint name the same layers (the
    output embeddings, or a SEQ_CLS head, left out), with the model's task type and without one."""
    source = make_checkpoint(fields, task)
    for task_type in {lora.PEFT_TASK_TYPES.get(task, "CAUSAL_LM" if task == "causal_lm" else None), None}:
        config = peft.LoraConfig(r=2, target_modules="all-linear", task_type=task_type)
        try:
            theirs = peft.get_peft_model(reference_model(source, task, "eager"), config)
        except TypeError as exc:  # a layer both adapted and saved (TOKEN_CLS's classifier, DistilBERT's
            assert "modules_to_save cannot be applied" in str(exc)  # pre_classifier): PEFT refuses, and so do we
            with pytest.raises(AdapterError, match="also a module to save"):
                lora.add_lora(load_model(source, task), r=2, target_modules="all-linear", task_type=task_type)
            continue
        expected = sorted(theirs.peft_config["default"].target_modules)
        if _peft_converts(load_model(source, task)):
            # PEFT's MoE conversion resolves all-linear to leaf names and moves the experts' and router's into
            # target_parameters (the adapters themselves: tests/test_lora_target_parameters.py)
            ours = lora.add_lora(load_model(source, task), r=2, target_modules="all-linear", task_type=task_type)
            assert sorted(ours.lora_config.target_modules) == expected
            assert sorted(ours.lora_config.target_parameters) == sorted(theirs.peft_config["default"].target_parameters)
            continue
        assert lora.all_linear_targets(load_model(source, task), task_type) == expected
        adapted = sorted(_key(n)[:-len(".lora_A.weight")] for n, _ in theirs.named_parameters() if "lora_A" in n)
        ours = lora.add_lora(load_model(source, task), r=2, target_modules="ALL-LINEAR", task_type=task_type)
        assert sorted(lora.lora_layers(ours)) == adapted and ours.lora_config.target_modules == expected


@pytest.mark.parametrize("given", ["all-linear", "full names"])
def test_twenty_targets_or_more_are_condensed_as_peft_condenses_them(given, tmp_path):
    """A target list of 20 names or more (all-linear on a 3-layer LLaMA: 21 layers, or the same 21 full names):
    PEFT's inject_adapter keeps the shortest suffixes that tell them apart; ours records the same list, adapts the
    same layers, writes it to adapter_config.json, and both sides reload the file onto those layers."""
    fields = {**next(f for c, _, f in CASES if c == LLAMA_TIED), "num_hidden_layers": 3}
    source = make_checkpoint(fields, "causal_lm")
    full = sorted(n for n, m in load_model(source, "causal_lm").named_modules()
                  if isinstance(m, torch.nn.Linear) and n != "lm_head")
    assert len(full) >= lora.MIN_TARGET_MODULES_FOR_OPTIMIZATION
    targets = "all-linear" if given == "all-linear" else full
    theirs = peft.get_peft_model(reference_model(source, "causal_lm", "eager"),
                                 peft.LoraConfig(r=2, target_modules=targets, task_type="CAUSAL_LM"))
    expected = sorted(theirs.peft_config["default"].target_modules)
    assert len(expected) < len(full)  # PEFT condensed them
    ours = lora.add_lora(load_model(source, "causal_lm"), r=2, target_modules=targets)
    assert ours.lora_config.target_modules == expected
    adapted = sorted(_key(n)[:-len(".lora_A.weight")] for n, _ in theirs.named_parameters() if "lora_A" in n)
    assert sorted(lora.lora_layers(ours)) == adapted == full
    out = lora.save_adapter(ours, tmp_path / "ours")
    assert sorted(json.loads((out / lora.ADAPTER_CONFIG).read_text())["target_modules"]) == expected
    back = peft.PeftModel.from_pretrained(reference_model(source, "causal_lm", "eager"), str(out))
    assert sorted(_key(n)[:-len(".lora_A.weight")] for n, _ in back.named_parameters() if "lora_A" in n) == full
    assert sorted(lora.lora_layers(load_model(source, "causal_lm", adapter=str(out)))) == full


def test_all_linear_adapter_both_ways(tmp_path):
    theirs = _peft_adapter(LLAMA_TIED, tmp_path / "peft", target_modules="all-linear", r=4)
    ours, out = _both_ways(LLAMA_TIED, tmp_path, theirs, tmp_path / "peft")
    assert "lm_head" not in lora.lora_layers(ours) and len(lora.lora_layers(ours)) > 7
    # a hand-written adapter_config.json that still says all-linear is expanded at load, as PEFT does
    _edit_config(tmp_path / "peft", target_modules="all-linear")
    assert sorted(lora.lora_layers(_ours(LLAMA_TIED, tmp_path / "peft"))) == sorted(lora.lora_layers(ours))
