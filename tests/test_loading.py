"""The loader: sources, formats, key handling, strictness, and clear errors on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flodl_hf import (AutoConfig, AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification,
                      CheckpointFormatError, ConfigError, SourceNotFoundError, UnsupportedModelError,
                      WeightsMismatchError)
from flodl_hf.roundtrip.parity import check_parity, make_batch, reference_model

from helpers import make_checkpoint

TINY = dict(model_type="bert", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96,
            vocab_size=200, max_position_embeddings=32, num_labels=3)


@pytest.fixture
def mlm_dir(tmp_path) -> Path:
    src = make_checkpoint(TINY, "mlm")
    dst = tmp_path / "mlm"
    shutil.copytree(src, dst)
    return dst


def _rewrite(directory: Path, fn) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    tensors = fn(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _logits(model, config):
    batch = make_batch(config, "mlm")
    with torch.no_grad():
        return model(**batch).logits


def _assert_same_as_hf(directory: Path, task: str = "mlm"):
    result = check_parity(directory, task, "sdpa")
    assert result.exact, result.diffs


# ---- formats -----------------------------------------------------------------------------

def test_single_weights_file_and_bin_and_sharded(mlm_dir, tmp_path):
    reference = AutoModelForMaskedLM.from_pretrained(mlm_dir)
    expected = _logits(reference, reference.config)
    tensors = load_file(str(mlm_dir / "model.safetensors"))

    # a single weights file next to its config
    single = AutoModelForMaskedLM.from_pretrained(mlm_dir / "model.safetensors")
    assert torch.equal(_logits(single, single.config), expected)

    # pytorch_model.bin
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(mlm_dir / "config.json", bin_dir)
    torch.save(tensors, bin_dir / "pytorch_model.bin")
    from_bin = AutoModelForMaskedLM.from_pretrained(bin_dir)
    assert torch.equal(_logits(from_bin, from_bin.config), expected)

    # sharded safetensors written by our own writer, and sharded .bin
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(mlm_dir / "config.json", sharded)
    from flodl_hf.core.io import save_safetensors
    paths = save_safetensors(tensors, sharded, max_shard_size=20_000)
    assert len(paths) > 1 and (sharded / "model.safetensors.index.json").is_file()
    from_shards = AutoModelForMaskedLM.from_pretrained(sharded)
    assert torch.equal(_logits(from_shards, from_shards.config), expected)

    bin_sharded = tmp_path / "bin_sharded"
    bin_sharded.mkdir()
    shutil.copy(mlm_dir / "config.json", bin_sharded)
    keys = sorted(tensors)
    halves = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
              "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
    weight_map = {}
    for name, part in halves.items():
        torch.save({k: tensors[k] for k in part}, bin_sharded / name)
        weight_map.update({k: name for k in part})
    (bin_sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    from_bin_shards = AutoModelForMaskedLM.from_pretrained(bin_sharded)
    assert torch.equal(_logits(from_bin_shards, from_bin_shards.config), expected)


def test_dtype_kept_as_stored_unless_cast(mlm_dir):
    _rewrite(mlm_dir, lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})
    kept = AutoModelForMaskedLM.from_pretrained(mlm_dir)
    assert {p.dtype for p in kept.parameters()} == {torch.bfloat16}
    cast = AutoModelForMaskedLM.from_pretrained(mlm_dir, dtype=torch.float32)
    assert {p.dtype for p in cast.parameters()} == {torch.float32}


# ---- keys --------------------------------------------------------------------------------

def test_legacy_gamma_beta_names(mlm_dir):
    _rewrite(mlm_dir, lambda t: {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
                                 for k, v in t.items()})
    assert any(k.endswith(".gamma") for k in load_file(str(mlm_dir / "model.safetensors")))
    model = AutoModelForMaskedLM.from_pretrained(mlm_dir)
    hf = reference_model(mlm_dir, "mlm", "sdpa")  # transformers renames gamma/beta too
    batch = make_batch(model.config, "mlm")
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, hf(**batch).logits)


def test_decoder_bias_spelling_and_tied_copy_in_file(mlm_dir):
    def old_style(t):
        t = dict(t)
        t["cls.predictions.decoder.bias"] = t.pop("cls.predictions.bias")
        t["cls.predictions.decoder.weight"] = t["bert.embeddings.word_embeddings.weight"].clone()
        t["bert.embeddings.position_ids"] = torch.arange(32)[None]
        return t
    _rewrite(mlm_dir, old_style)
    model = AutoModelForMaskedLM.from_pretrained(mlm_dir)
    decoder = model.cls.predictions.decoder
    assert decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert decoder.bias is model.cls.predictions.bias
    _assert_same_as_hf(mlm_dir)


def test_untied_decoder_kept_separate(tmp_path):
    src = make_checkpoint({**TINY, "tie_word_embeddings": False}, "mlm")
    model = AutoModelForMaskedLM.from_pretrained(src)
    assert model.cls.predictions.decoder.weight is not model.bert.embeddings.word_embeddings.weight
    assert not torch.equal(model.cls.predictions.decoder.weight, model.bert.embeddings.word_embeddings.weight)
    _assert_same_as_hf(src)


def test_backbone_without_prefix_into_head_model(tmp_path):
    base = make_checkpoint(TINY, "base")
    tensors = load_file(str(base / "model.safetensors"))
    assert not any(k.startswith("bert.") for k in tensors)
    with pytest.warns(UserWarning, match="newly initialised: classifier.weight, classifier.bias"):
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=4)
    assert model.classifier.out_features == 4 and model.config.num_labels == 4
    assert torch.equal(model.bert.pooler.dense.weight, tensors["pooler.dense.weight"])
    assert model.classifier.bias.abs().sum() == 0  # transformers' init: zero bias, normal weight


def test_head_checkpoint_into_backbone_reports_unused(mlm_dir):
    with pytest.warns(UserWarning, match="not used by BertModel: cls.predictions"):
        model = AutoModel.from_pretrained(mlm_dir)
    assert model.pooler is None  # an MLM checkpoint has no pooler: none is invented
    hf = reference_model(mlm_dir, "base", "sdpa")
    batch = make_batch(model.config, "base")
    with torch.no_grad():
        assert torch.equal(model(**batch).last_hidden_state, hf(**batch).last_hidden_state)


def test_state_dict_keys_are_hf_keys():
    src = make_checkpoint(TINY, "seqcls")
    model = AutoModelForSequenceClassification.from_pretrained(src)
    hf = reference_model(src, "seqcls", "sdpa")
    assert set(model.state_dict()) == set(hf.state_dict())


# ---- strictness and bad input ------------------------------------------------------------

def test_missing_key_raises_listing_it_and_touches_nothing(mlm_dir):
    _rewrite(mlm_dir, lambda t: {k: v for k, v in t.items() if "layer.1.output.dense" not in k})
    with pytest.raises(WeightsMismatchError) as err:
        AutoModelForMaskedLM.from_pretrained(mlm_dir)
    assert "bert.encoder.layer.1.output.dense.weight" in str(err.value)
    assert "bert.encoder.layer.1.output.dense.bias" in str(err.value)
    assert set(err.value.missing) == {"bert.encoder.layer.1.output.dense.weight",
                                      "bert.encoder.layer.1.output.dense.bias"}


def test_wrong_shape_raises_naming_key(mlm_dir):
    _rewrite(mlm_dir, lambda t: {**t, "bert.encoder.layer.0.attention.self.query.weight":
                                 torch.zeros(64, 63)})
    with pytest.raises(WeightsMismatchError, match=r"query.weight: model expects \(64, 64\), checkpoint has \(64, 63\)"):
        AutoModelForMaskedLM.from_pretrained(mlm_dir)


def test_truncated_safetensors(mlm_dir):
    path = mlm_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError, match="model.safetensors"):
        AutoModelForMaskedLM.from_pretrained(mlm_dir)


def test_garbage_safetensors_header(mlm_dir):
    path = mlm_dir / "model.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\0" * 64)
    with pytest.raises(CheckpointFormatError, match="corrupt or truncated"):
        AutoModelForMaskedLM.from_pretrained(mlm_dir)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_bin_with_non_tensor_pickle_is_refused(mlm_dir, capsys):
    (mlm_dir / "model.safetensors").unlink()
    torch.save({"bert.embeddings.word_embeddings.weight": torch.zeros(2), "x": _Evil()}, mlm_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match="refused to unpickle"):
        AutoModelForMaskedLM.from_pretrained(mlm_dir)
    assert "this must never run" not in capsys.readouterr().out


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(SourceNotFoundError, match="no weights in"):
        AutoModel.from_pretrained(tmp_path)


def test_index_naming_missing_shard(mlm_dir):
    (mlm_dir / "model.safetensors").rename(mlm_dir / "model-00001-of-00002.safetensors")
    (mlm_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="model-00002-of-00002.safetensors"):
        AutoModelForMaskedLM.from_pretrained(mlm_dir)


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_unknown_model_type_lists_supported(mlm_dir):
    _edit_config(mlm_dir, model_type="funnel", architectures=["FunnelForMaskedLM"])
    with pytest.raises(UnsupportedModelError, match=r"'funnel' is not supported; supported families: .*bert"):
        AutoModelForMaskedLM.from_pretrained(mlm_dir)


def test_auto_map_is_refused(mlm_dir):
    _edit_config(mlm_dir, auto_map={"AutoModel": "modeling_custom.CustomModel"})
    with pytest.raises(ConfigError, match="auto_map"):
        AutoModelForMaskedLM.from_pretrained(mlm_dir)


def test_model_type_inferred_from_architectures_or_refused(mlm_dir):
    _edit_config(mlm_dir, model_type=None)
    assert AutoConfig.from_pretrained(mlm_dir).model_type == "bert"
    _edit_config(mlm_dir, architectures=None)
    with pytest.raises(ConfigError, match="neither model_type nor architectures"):
        AutoConfig.from_pretrained(mlm_dir)


def test_bad_config_field_is_named(mlm_dir):
    _edit_config(mlm_dir, hidden_act="sparkle")
    with pytest.raises(ConfigError, match="hidden_act='sparkle'"):
        AutoConfig.from_pretrained(mlm_dir)


def test_config_round_trips_unknown_fields(mlm_dir):
    _edit_config(mlm_dir, my_custom_field={"nested": [1, 2]}, id2label={"0": "neg", "1": "pos"})
    config = AutoConfig.from_pretrained(mlm_dir)
    out = config.to_dict()
    original = json.loads((mlm_dir / "config.json").read_text())
    assert out["my_custom_field"] == {"nested": [1, 2]}
    assert config.id2label == {0: "neg", 1: "pos"} and config.num_labels == 2
    for key, value in original.items():
        if key != "label2id":
            assert out[key] == value, key


def test_unresolvable_hub_id_says_how_to_pass_local(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(SourceNotFoundError, match="Pass a local directory"):
        AutoModel.from_pretrained("nobody-here/no-such-model")


def test_missing_path_is_not_sent_to_hub(tmp_path):
    with pytest.raises(SourceNotFoundError, match="no such file or directory"):
        AutoModel.from_pretrained(str(tmp_path / "nope"))


def test_save_pretrained_loads_in_transformers_without_missing_keys(tmp_path):
    src = make_checkpoint(TINY, "mlm")
    ours = AutoModelForMaskedLM.from_pretrained(src)
    out = ours.save_pretrained(tmp_path / "saved")
    import transformers
    hf, info = transformers.AutoModelForMaskedLM.from_pretrained(out, dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    batch = make_batch(ours.config, "mlm")
    with torch.no_grad():
        assert torch.equal(ours(**batch).logits, hf.eval()(**batch).logits)
