"""from_pretrained's keywords, each against transformers 5.24 in the same run: the config fields it leaves, and
the outputs (torch.equal) of a tiny checkpoint; a keyword flodl-hf does not implement is an InputError naming it."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from flodl_hf import (AutoModel, AutoModelForSequenceClassification, CheckpointFormatError, ConfigError, InputError,
                      SourceNotFoundError, WeightsMismatchError)
from flodl_hf.auto import AutoConfig
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers
from flodl_hf.core.registry import get_family

from cases.deberta_v2 import CONFIGS as DEBERTA
from helpers import make_checkpoint, one_thread  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(model_type="bert", hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=37,
            vocab_size=99, max_position_embeddings=64, num_labels=3)
LABELS = {0: "neg", 1: "neu", 2: "pos"}


def _ours(source, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForSequenceClassification.from_pretrained(source, **kw)


def _theirs(source, cls="AutoModelForSequenceClassification", **kw):
    return getattr(quiet_transformers(), cls).from_pretrained(str(source), **kw).eval()


def _same_outputs(ours, theirs, task="seqcls", labels=None):
    batch = make_batch(ours.config, task)
    if labels is not None:
        batch["labels"] = labels
    with torch.inference_mode():
        a, b = ours(**batch), theirs(**batch)
    first = "logits" if task != "base" else "last_hidden_state"
    assert torch.equal(getattr(a, first), getattr(b, first))
    if labels is not None:
        assert torch.equal(a.loss, b.loss)


def _same_config(ours, theirs):
    a, b = ours.config, theirs.config
    assert a.id2label == {int(k): v for k, v in b.id2label.items()} and a.label2id == b.label2id
    assert (a.problem_type.value if a.problem_type else None) == b.problem_type
    for name in ("classifier_dropout", "hidden_act", "layer_norm_eps", "hidden_dropout_prob"):
        assert str(getattr(a, name)) in (str(getattr(b, name)), f"Activation.{str(getattr(b, name)).upper()}"), name


@pytest.mark.parametrize("kw", [
    dict(num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()}),  # the usual fine-tune line
    dict(id2label=LABELS),                       # label2id left as it was, as transformers leaves it
    dict(id2label={str(k): v for k, v in LABELS.items()}),
    dict(num_labels=4, id2label=LABELS),         # in order: 4 labels, then these 3 (label2id keeps 4)
    dict(problem_type="multi_label_classification"),
    dict(classifier_dropout=0.3, hidden_dropout_prob=0.2),
    dict(hidden_act="relu", layer_norm_eps=1e-3),  # fields the forward reads
], ids=["fine_tune_line", "id2label", "id2label_str_keys", "num_then_id2label", "problem_type", "dropouts",
        "act_eps"])
def test_config_overrides_as_transformers_applies_them(kw):
    source = make_checkpoint(TINY, "seqcls")
    ours, theirs = _ours(source, **kw), _theirs(source, **kw)
    _same_config(ours, theirs)
    labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]) if "problem_type" in kw else torch.tensor([2, 0])
    _same_outputs(ours, theirs, labels=labels)
    # The concrete class takes the same keywords
    concrete = get_family("bert").model_class("seqcls")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert concrete.from_pretrained(source, **kw).config.id2label == ours.config.id2label


def test_bad_override_values_are_typed_errors():
    source = make_checkpoint(TINY, "seqcls")
    for kw, named in ((dict(num_labels=0), "num_labels"), (dict(hidden_dropout_prob=2.0), "hidden_dropout_prob"),
                      (dict(problem_type="bogus"), "problem_type"), (dict(foo_bar=1), "foo_bar")):
        with pytest.raises((InputError, ValueError), match=named):
            _ours(source, **kw)


def test_torch_dtype_is_dtypes_older_name():
    source = make_checkpoint(TINY, "seqcls")
    for kw in (dict(torch_dtype=torch.bfloat16), dict(torch_dtype="float16"),
               dict(torch_dtype=torch.float16, dtype=torch.bfloat16)):  # both: dtype wins, as in transformers
        ours, theirs = _ours(source, **kw), _theirs(source, **kw)
        assert ours.dtype == theirs.dtype
        theirs_state = theirs.state_dict()
        assert all(torch.equal(t, theirs_state[k]) for k, t in ours.state_dict().items())


@pytest.mark.parametrize("variant", ["bert", "deberta"])
def test_attn_implementation_none_is_transformers_default(variant):
    fields = TINY if variant == "bert" else DEBERTA["deberta-v3-hd24"]
    source = make_checkpoint(fields, "seqcls")
    ours, theirs = _ours(source, attn_implementation=None), _theirs(source, attn_implementation=None)
    assert ours.config.attn_implementation == theirs.config._attn_implementation
    _same_outputs(ours, theirs)


def test_config_as_a_path(tmp_path):
    """A config directory (no weights) or file: read, then the keywords laid over it, as transformers' concrete
    classes do (its Auto classes drop a config= path and read the checkpoint's own; ours read the path given)."""
    source = make_checkpoint(TINY, "seqcls")
    data = json.loads((source / "config.json").read_text())
    data.update(classifier_dropout=0.25, id2label={"0": "x", "1": "y", "2": "z"}, label2id={"x": 0, "y": 1, "z": 2},
                hidden_act="relu")
    (tmp_path / "config.json").write_text(json.dumps(data))
    for config in (tmp_path, str(tmp_path / "config.json")):
        ours = _ours(source, config=config, problem_type="regression")
        theirs = _theirs(source, "BertForSequenceClassification", config=str(config), problem_type="regression")
        _same_config(ours, theirs)
        _same_outputs(ours, theirs)
    with pytest.raises(InputError, match="config=int"):
        _ours(source, config=3)
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "config.json").symlink_to(tmp_path / "config.json")  # a link out, as a checkpoint's
    with pytest.raises(CheckpointFormatError, match="outside"):
        _ours(source, config=tmp_path / "linked")


def test_config_object_is_copied_and_takes_no_overrides():
    source = make_checkpoint(TINY, "seqcls")
    config = AutoConfig.from_pretrained(source)
    model = _ours(source, config=config, attn_implementation="eager")
    assert model.config.attn_implementation == "eager" and config.attn_implementation == "sdpa"
    with pytest.raises(TypeError):  # transformers hands num_labels to the model's __init__
        _theirs(source, config=quiet_transformers().AutoConfig.from_pretrained(str(source)), num_labels=3)
    with pytest.raises(InputError, match=r"num_labels.*config object"):
        _ours(source, config=config, num_labels=3)


def test_hub_options_reach_the_cache(tmp_path):
    """A hub id read from a given cache_dir with local_files_only (a cache laid out as huggingface_hub lays it
    out); subfolder on a local directory. Both load what transformers loads."""
    source = make_checkpoint(TINY, "seqcls")
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--someone--tiny"
    shutil.copytree(source, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    kw = dict(cache_dir=str(tmp_path / "cache"), local_files_only=True, token=None, force_download=False)
    ours, theirs = _ours("someone/tiny", **kw), _theirs("someone/tiny", **kw)
    _same_outputs(ours, theirs)
    with pytest.raises(SourceNotFoundError, match="someone/other"):
        _ours("someone/other", **kw)
    shutil.copytree(source, tmp_path / "outer" / "inner")
    ours, theirs = _ours(tmp_path / "outer", subfolder="inner"), _theirs(tmp_path / "outer", subfolder="inner")
    _same_outputs(ours, theirs)


def test_device_map_and_trust_remote_code(tmp_path):
    source = make_checkpoint(TINY, "seqcls")
    theirs = _theirs(source)
    for device_map in ("cpu", torch.device("cpu"), "auto" if not torch.cuda.is_available() else "cpu"):
        ours = _ours(source, device_map=device_map, trust_remote_code=False)
        assert ours.device == torch.device("cpu")
        _same_outputs(ours, theirs)
    with pytest.raises(InputError, match="device_map"):
        _ours(source, device_map={"": "cpu", "classifier": "cuda:0"})
    with pytest.raises(InputError, match="device_map"):
        _ours(source, device_map="balanced_low_0")
    # trust_remote_code=True loads a checkpoint without auto_map as it is, as transformers does ...
    _same_outputs(_ours(source, trust_remote_code=True), _theirs(source, trust_remote_code=True))
    # ... and a config declaring auto_map stays refused: flodl-hf runs no remote code
    config = json.loads((source / "config.json").read_text())
    remote = tmp_path / "remote"
    shutil.copytree(source, remote)
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling.Custom"}}))
    with pytest.raises(ConfigError, match="auto_map"):
        _ours(remote, trust_remote_code=True)


def test_ignore_mismatched_sizes():
    """Another label count than the checkpoint's head: refused without the keyword (transformers raises too);
    with it, the head is initialised afresh, drawn as transformers draws it (equal under the same seed)."""
    source = make_checkpoint(TINY, "seqcls")
    with pytest.raises(WeightsMismatchError, match="ignore_mismatched_sizes=True"):
        _ours(source, num_labels=4)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        _theirs(source, num_labels=4)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="classifier.weight, classifier.bias"):
        ours = AutoModelForSequenceClassification.from_pretrained(source, num_labels=4, ignore_mismatched_sizes=True)
    torch.manual_seed(0)
    theirs = _theirs(source, num_labels=4, ignore_mismatched_sizes=True)
    _same_config(ours, theirs)
    _same_outputs(ours, theirs)
    # A base checkpoint's head is fresh either way, drawn alike
    base = make_checkpoint(TINY, "base")
    torch.manual_seed(1)
    ours = _ours(base, num_labels=4)
    torch.manual_seed(1)
    _same_outputs(ours, _theirs(base, num_labels=4))


def test_add_pooling_layer_on_a_bare_backbone():
    source = make_checkpoint(TINY, "seqcls")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = AutoModel.from_pretrained(source, add_pooling_layer=False)
    theirs = _theirs(source, "AutoModel", add_pooling_layer=False)
    assert getattr(ours, "pooler", None) is None and theirs.pooler is None
    _same_outputs(ours, theirs, "base")
    with pytest.raises(InputError, match="add_pooling_layer"):
        _ours(source, add_pooling_layer=False)


@pytest.mark.parametrize("kw, named", [
    (dict(output_loading_info=True), "output_loading_info"), (dict(variant="fp16"), "variant"),
    (dict(quantization_config={"load_in_8bit": True}), "quantization_config"), (dict(use_safetensors=False),
    "use_safetensors"), (dict(weights_only=False), "weights_only"),
    (dict(chunk_size_feed_forward=4), "chunk_size_feed_forward"), (dict(tp_plan="auto"), "tp_plan"),
    (dict(task="mlm"), "task="), (dict(num_label=3), "num_label="),
])
def test_unimplemented_keywords_are_input_errors_naming_them(kw, named):
    source = make_checkpoint(TINY, "seqcls")
    with pytest.raises(InputError, match=named):
        _ours(source, **kw)


def test_defaults_and_dropped_keywords_are_taken():
    """transformers' defaults of what is not implemented ask for nothing; what transformers drops, we drop."""
    source = make_checkpoint(TINY, "seqcls")
    theirs = _theirs(source)
    _same_outputs(_ours(source, output_loading_info=False, weights_only=True, use_safetensors=None, variant=None,
                        output_hidden_states=False, return_dict=True, low_cpu_mem_usage=True, _commit_hash="x",
                        revision=None), theirs)
    with pytest.raises(InputError, match="positional"):
        AutoModelForSequenceClassification.from_pretrained(source, "extra")


def _same_records(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
        return
    a = a if isinstance(a, tuple) else a.to_tuple()
    b = b if isinstance(b, tuple) else b.to_tuple()
    assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        _same_records(x, y, f"{where}[{i}]")


def test_forward_defaults_from_the_config_and_from_pretrained(tmp_path):
    """config.json's output_hidden_states / return_dict, and from_pretrained(output_attentions=True), set the
    forward's defaults as in transformers (a call's own keyword wins; output_attentions switches a model loaded
    without attn_implementation to eager). The task one-liners with such a config: tests/test_tasks.py."""
    source = make_checkpoint(TINY, "seqcls")
    edited = tmp_path / "edited"
    shutil.copytree(source, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "output_hidden_states": True, "return_dict": False}))
    ours, theirs = _ours(edited), _theirs(edited)
    batch = make_batch(ours.config, "seqcls")
    with torch.inference_mode():
        for kw in ({}, {"return_dict": True}, {"output_hidden_states": False}):
            a, b = ours(**batch, **kw), theirs(**batch, **kw)
            assert type(a).__name__ == type(b).__name__, kw
            _same_records(a, b, str(kw))
        assert isinstance(ours(**batch), tuple) and len(ours(**batch)) == 2  # (logits, hidden_states)
        ours, theirs = _ours(source, output_attentions=True), _theirs(source, output_attentions=True)
        assert ours.config.attn_implementation == theirs.config._attn_implementation == "eager"
        a, b = ours(**batch), theirs(**batch)
        assert list(a.keys()) == list(b.keys()) == ["logits", "attentions"]
        _same_records(a, b, "attentions by default")
        assert list(ours(**batch, output_attentions=False).keys()) == ["logits"]
        with pytest.raises(InputError, match="output_attentions=True"):
            _ours(source, output_attentions=True, attn_implementation="sdpa")(**batch)

