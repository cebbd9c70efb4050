"""What the parity table does not show for RoBERTa / CamemBERT / XLM-R / DistilBERT / ALBERT:
the CLI, inputs_embeds positions, export back to HF's exact keys, and the alias registrations."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open

from flodl_hf import load_model
from flodl_hf.cli import main
from flodl_hf.roundtrip.parity import check_parity, make_batch, reference_model
from flodl_hf.core.registry import get_family, parse_architecture

from cases import CASES
from helpers import make_checkpoint

FAMILIES = ("roberta", "camembert", "xlm-roberta", "distilbert", "albert")
OURS = [pytest.param(task, fields, id=case_id) for case_id, task, fields in CASES
        if fields["model_type"] in FAMILIES]


def _case(case_id: str) -> tuple[str, dict]:
    return next((task, fields) for cid, task, fields in CASES if cid == case_id)


def _load(source, task, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(source, task, dtype=torch.float32, **kwargs)


@pytest.mark.parametrize("task", ["base", "seqcls", "tokcls", "qa", "mlm", "mc"])
def test_cli_parity_every_head(task, capsys):
    """``flodl-hf parity SOURCE`` finds the head from config.json and is exact on both attention paths."""
    source = make_checkpoint(_case(f"albert-groups-hd24-{task}")[1], task)
    assert main(["parity", str(source)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and " NO" not in out and "sdpa" in out and "eager" in out


def test_cli_parity_all_heads_json(capsys):
    """``--head all`` on a masked-LM checkpoint: heads without weights in it are skipped, the rest exact."""
    source = make_checkpoint(_case("distilbert-sinusoidal-hd24-mlm")[1], "mlm")
    assert main(["parity", str(source), "--head", "all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["task"] for r in rows} == {"base", "seqcls", "tokcls", "qa", "mlm", "mc"}
    assert all(r["exact"] or r["skipped"] for r in rows)
    assert {r["task"] for r in rows if r["exact"]} == {"base", "mlm"}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("case_id", ["roberta-untied-hd24-base", "xlm-roberta-768-base"])
@torch.inference_mode()
def test_roberta_inputs_embeds_positions(case_id, impl):
    """With inputs_embeds, HF numbers positions sequentially from padding_idx + 1 (padding unknown)."""
    task, fields = _case(case_id)
    source = make_checkpoint(fields, task)
    ours = _load(source, task, attn_implementation=impl)
    theirs = reference_model(source, task, impl)
    batch = make_batch(ours.config, task)
    embeds = ours.get_input_embeddings()(batch.pop("input_ids"))
    a = ours(inputs_embeds=embeds, **batch)
    b = theirs(inputs_embeds=embeds, **batch)
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)


@pytest.mark.parametrize("task,fields", OURS)
def test_export_is_what_transformers_writes(task, fields):
    """hf_state_dict: the same keys as transformers' save_pretrained (tied tensors once, under HF's name), same values."""
    source = make_checkpoint(fields, task)
    exported = _load(source, task).hf_state_dict()
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        assert sorted(exported) == sorted(f.keys())
        for key in f.keys():
            assert torch.equal(exported[key], f.get_tensor(key)), key


@pytest.mark.parametrize("case_id", ["roberta-untied-hd24-mlm", "albert-untied-hd24-mlm", "albert-groups-hd24-mlm",
                                     "distilbert-768-mlm", "camembert-hd24-seqcls"])
def test_save_pretrained_round_trip(case_id, tmp_path):
    """Our save_pretrained output loads in transformers and stays bit-exact."""
    task, fields = _case(case_id)
    _load(make_checkpoint(fields, task), task).save_pretrained(tmp_path)
    result = check_parity(tmp_path, task, "sdpa")
    assert result.exact, result.diffs


def test_distilbert_ignores_token_types():
    task, fields = _case("distilbert-768-base")
    model = _load(make_checkpoint(fields, task), task)
    batch = make_batch(model.config, task)
    with torch.inference_mode():
        plain = model(**batch).last_hidden_state
        typed = model(**batch, token_type_ids=torch.ones_like(batch["input_ids"])).last_hidden_state
    assert torch.equal(plain, typed)


def test_aliases_register_roberta():
    roberta = get_family("roberta")
    for model_type, arch in [("camembert", "Camembert"), ("xlm-roberta", "XLMRoberta")]:
        family = get_family(model_type)
        assert issubclass(family, roberta) and family.prefix == "roberta"
        assert family.config_class.model_type == model_type
        assert parse_architecture(f"{arch}ForMaskedLM") == (family, "mlm")
