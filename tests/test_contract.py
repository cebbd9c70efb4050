"""The contract every family honours, checked over the whole registry: tasks, keys, family resolution,
backbone inputs, and the gates (parity variants per declared task; verify-matrix n/a only where
transformers has no class)."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flodl_hf import InputError, UnsupportedModelError, load_model
from flodl_hf.auto import AutoConfig, auto_classes
from flodl_hf.roundtrip.export import export
from flodl_hf.families.bert import Bert
from flodl_hf.core.keys import KeyMap, expected
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers
from flodl_hf.core.registry import get_family, parse_architecture, supported_model_types
from flodl_hf.core.registry import get_task, hf_mapping, task_names
from flodl_hf.roundtrip.matrix import cell_gate, matrix_pairs
from flodl_hf.roundtrip.verify import verify_export

from cases import CASES
from helpers import make_checkpoint


def test_every_family_has_parity_variants_for_every_task_it_declares():
    """The gate: a family registered without a parity case for one of its tasks fails here."""
    covered: dict[str, set[str]] = {}
    for _, task, fields in CASES:
        covered.setdefault(fields["model_type"], set()).add(task)
    missing = {mt: sorted(set(get_family(mt).tasks) - covered.get(mt, set())) for mt in supported_model_types()}
    assert not {mt: m for mt, m in missing.items() if m}, missing
    undeclared = {mt: sorted(t - set(get_family(mt).tasks)) for mt, t in covered.items()}
    assert not {mt: u for mt, u in undeclared.items() if u}, undeclared


def test_task_registry_names_are_transformers_names():
    """Every registered task's Auto class exists in transformers and here; every family's class names
    parse back to (family, task), and transformers maps the model_type to that very class."""
    transformers = quiet_transformers()
    ours = auto_classes()
    for name in task_names():
        task = get_task(name)
        assert hasattr(transformers, task.auto_class), task.auto_class
        assert ours[name].__name__ == task.auto_class and ours[name].task == name
    for mt in supported_model_types():
        family = get_family(mt)
        for task in family.tasks:
            arch = family.architecture(task)
            assert parse_architecture(arch) == (family, task)
            theirs = hf_mapping(task).get(family.model_type)
            assert theirs == arch, (mt, task, theirs, arch)


def test_family_is_resolved_once_and_an_unregistered_family_builds():
    class Mine(Bert):  # not registered: reachable only by being passed
        model_type = "not-registered"

        @classmethod
        def sequence_loss(cls, logits, labels, config):
            return logits.sum() * 0 + 42.0

    config = AutoConfig.for_model("bert", hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                  intermediate_size=37, vocab_size=99)
    model = Mine.build(config, "seqcls")
    assert model.family is Mine and model.backbone.family is Mine
    batch = make_batch(config, "seqcls")
    out = model(**batch, labels=torch.tensor([0, 1]))
    assert out.loss.item() == 42.0  # the passed family's loss hook ran, with no registry look-up
    with pytest.raises(UnsupportedModelError):
        get_family("not-registered")


def test_task_models_pass_only_the_inputs_the_backbone_takes():
    fields = next(f for _, t, f in CASES if t == "seqcls" and f["model_type"] == "modernbert")
    model = load_model(make_checkpoint(fields, "seqcls"), "seqcls", dtype=torch.float32)
    batch = make_batch(model.config, "seqcls")
    assert "token_type_ids" not in model.backbone.input_names
    model(**batch, token_type_ids=None)  # absent: dropped
    with pytest.raises(InputError, match="token_type_ids"):
        model(**batch, token_type_ids=torch.zeros_like(batch["input_ids"]))


def test_unknown_task_and_undeclared_task_are_typed_errors():
    with pytest.raises(UnsupportedModelError, match="not known"):
        get_task("summarise")
    config = AutoConfig.for_model("bert", hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                  intermediate_size=37, vocab_size=99)
    with pytest.raises(UnsupportedModelError, match="pretraining"):
        get_family("bert").build(config, "pretraining")  # ELECTRA's task, not BERT's


# ---- keys ------------------------------------------------------------------------------------------

def test_key_map_renames_invert_and_legacy_is_one_way():
    key_map = KeyMap("bert", renames=(("encoder.layer.{}.attention.self.query.weight", "encoder.layer.{}.attn.q.weight"),),
                     legacy=((".gamma", ".weight"), (".beta", ".bias")))
    native = key_map.to_native("encoder.layer.3.attention.self.query.weight")
    assert native == "encoder.layer.3.attn.q.weight"
    assert key_map.to_hf(native) == "encoder.layer.3.attention.self.query.weight"
    assert key_map.to_native("embeddings.LayerNorm.gamma") == "embeddings.LayerNorm.weight"
    assert key_map.to_hf("embeddings.LayerNorm.weight") == "embeddings.LayerNorm.weight"  # today's name out


@pytest.mark.parametrize("model_type", ["bert", "electra"])
def test_legacy_gamma_beta_checkpoint_loads_and_exports_canonical(model_type, tmp_path):
    """BERT's table (inherited by ELECTRA) reads TF-era LayerNorm.gamma/beta; the export writes
    LayerNorm.weight/bias, transformers loads it with nothing missing, and every output is equal."""
    fields = next(f for _, t, f in CASES if t == "mlm" and f["model_type"] == model_type
                  and f.get("hidden_size") == 96)
    src = make_checkpoint(fields, "mlm")
    legacy = tmp_path / "legacy"
    shutil.copytree(src, legacy)
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in tensors.items()}
    assert any(k.endswith(".gamma") for k in renamed)
    save_file(renamed, str(legacy / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(legacy, "mlm", dtype=torch.float32)
    canonical = load_model(src, "mlm", dtype=torch.float32)
    for (name, a), (_, b) in zip(ours.state_dict().items(), canonical.state_dict().items()):
        assert torch.equal(a, b), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export(legacy, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    assert written == set(tensors) and not any(k.endswith((".gamma", ".beta")) for k in written)
    report = verify_export(tmp_path / "out", source=str(src))
    assert report.ok, report.format_table()


def test_expected_finds_tied_weights_by_identity():
    fields = next(f for _, t, f in CASES if t == "mlm" and f["model_type"] == "modernbert")
    model = load_model(make_checkpoint(fields, "mlm"), "mlm", dtype=torch.float32)
    shapes, aliases = expected(model)
    assert aliases == {"decoder.weight": "model.embeddings.tok_embeddings.weight"}


# ---- the verify-matrix gate -----------------------------------------------------------------------

def test_matrix_counts_na_only_where_transformers_has_no_class(monkeypatch):
    """A family that forgets a head it could have fails; n/a needs transformers to lack the class."""
    assert cell_gate("electra", "mlm", {}) == (None, "")
    monkeypatch.setattr(get_family("electra"), "tasks", ("base", "seqcls", "tokcls", "qa", "mc", "pretraining"))
    status, why = cell_gate("electra", "mlm", {})
    assert status == "FAIL" and "ElectraForMaskedLM" in why
    monkeypatch.setitem(hf_mapping("mlm"), "electra", None)
    assert cell_gate("electra", "mlm", {})[0] == "n/a"


def test_matrix_asks_a_family_added_task_only_of_its_families():
    pairs = matrix_pairs(["bert", "electra"], ["mlm", "pretraining"])
    assert pairs == [("bert", "mlm"), ("electra", "mlm"), ("electra", "pretraining")]


def test_parity_cli_head_choices_read_the_registry(capsys):
    from flodl_hf.cli import build_parser
    text = build_parser().format_help()
    sub = build_parser()._subparsers._group_actions[0].choices["parity"].format_help()
    assert "pretraining" in sub and "mlm" in sub and "parity" in text


# ---- the trainer checkpoint schema ----------------------------------------------------------------

@pytest.mark.parametrize("data", [
    {"model": {"w": torch.zeros(1)}, "config": {"model_type": "bert"}},            # no format
    {"format": "someone-else", "model": {"w": torch.zeros(1)}, "config": {}},       # another format
    {"format": "flodl-hf/trainer-checkpoint", "version": 99, "model": {}, "config": {}},  # newer
], ids=["no-format", "other-format", "newer-version"])
def test_trainer_and_export_read_checkpoints_by_one_schema(data, tmp_path):
    from flodl_hf.core.errors import CheckpointFormatError
    from flodl_hf.roundtrip.export import export_checkpoint
    from flodl_hf.training.checkpoints import load_checkpoint
    path = tmp_path / "step-00000001.pt"
    torch.save(data, path)
    with pytest.raises(CheckpointFormatError) as by_trainer:
        load_checkpoint(path)
    with pytest.raises(CheckpointFormatError) as by_export:
        export_checkpoint(path, tmp_path / "out")
    assert str(by_trainer.value) == str(by_export.value)
    assert not (tmp_path / "out").exists()


def test_a_load_looks_the_family_up_once(monkeypatch):
    """Loading resolves the family once; the forward (with a sequence loss) never looks it up again."""
    import flodl_hf.auto as auto
    import flodl_hf.core.registry as registry
    calls = []
    real = registry.get_family

    def counting(model_type):
        calls.append(model_type)
        return real(model_type)
    monkeypatch.setattr(auto, "get_family", counting)
    monkeypatch.setattr(registry, "get_family", counting)
    fields = next(f for _, t, f in CASES if t == "seqcls" and f["model_type"] == "electra")
    model = load_model(make_checkpoint(fields, "seqcls"), "auto", dtype=torch.float32)
    assert calls == ["electra"]
    model(**make_batch(model.config, "seqcls"), labels=torch.tensor([0, 1]))
    assert calls == ["electra"]
