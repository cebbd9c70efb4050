"""Nomic BERT and GTE beyond the shared tables (tests/cases/nomic_bert.py, gte.py run there: parity on every head and
path, losses, export, LoRA with PEFT, parameter order, fresh init).

Here: config defaults equal transformers' config defaults; options transformers fails on (or computes otherwise) are
typed errors naming the field; every RoPE type both take (dynamic across growing and shrinking forwards); the file
layouts (the original one save_pretrained writes, the module layout, GTE's remote-code ``new.`` prefix, a fused tensor
that does not split); the bare backbone without a pooler; GTE's token types ignored without an embedding and its
``head_dim`` read from config.json; the shared hidden-state, attention, positional-order and cast checks on both
families; and mutations the parity check catches.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import test_dtype_casts
import test_forward_kwargs
import test_output_attentions
import test_positional_order
from cases import CASES
from flodl_hf.auto import load_model
from flodl_hf.core.errors import CheckpointFormatError, ConfigError
from flodl_hf.families.gte import Gte
from flodl_hf.families.nomic_bert import NomicBertLayer
from flodl_hf.core.keys import FileLayout
from flodl_hf.roundtrip.parity import check_parity, make_batch, quiet_transformers, reference_model
from flodl_hf.core.registry import get_family
from helpers import make_checkpoint, model_pair, one_thread  # noqa: F401  (fixture)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

FIELDS = {case_id: fields for case_id, _task, fields in CASES}
HD24 = {"nomic_bert": "nomic_bert-hd24-linear-untied", "gte": "gte-hd24-notypes-dynamic-untied"}
SMALL = dict(hidden_size=96, num_attention_heads=4, num_hidden_layers=2, intermediate_size=160, vocab_size=1000,
             max_position_embeddings=8, num_labels=3)


def _same_outputs(a, b, where: str) -> None:
    fields = [k for k, v in b.items() if isinstance(v, torch.Tensor)]
    assert fields, where
    for name in fields:
        x, y = getattr(a, name), getattr(b, name)
        assert x is not None and x.shape == y.shape and torch.equal(x, y), f"{where} {name}"


# ---- config -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["nomic_bert", "gte"])
def test_config_defaults_equal_transformers(model_type):
    config = quiet_transformers().AutoConfig.for_model(model_type)
    theirs = {**{k: getattr(config, k, None) for k in dir(config) if not k.startswith("_")}, **config.to_dict()}
    ours = get_family(model_type).config_class()
    compared = 0
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
                 "type_vocab_size", "initializer_range", "layer_norm_eps", "pad_token_id", "classifier_dropout",
                 "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        mine = getattr(ours, name)
        assert getattr(mine, "value", mine) == theirs[name], name
        compared += 1
    assert ours.head_dim == theirs.get("head_dim")  # nomic: hidden / heads written; GTE: no such field
    rope = ours.rope()
    want = theirs["rope_parameters"]
    assert (rope.rope_type, rope.theta) == (want["rope_type"], want["rope_theta"])
    assert compared == 17


@pytest.mark.parametrize("model_type,changes,named", [
    ("nomic_bert", {"rope_scaling": {"type": "ntk", "factor": 2.0}}, "rope_scaling.rope_type"),  # gte-*-en-v1.5's
    ("gte", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "rope_parameters.rope_type"),
    ("gte", {"rope_parameters": {"rope_type": "linear"}}, "factor"),
    ("nomic_bert", {"rope_parameters": {"rope_type": "yarn", "factor": "2"}}, "rope_parameters.factor"),
    ("nomic_bert", {"head_dim": 23}, "head_dim"),
    ("gte", {"head_dim": 0}, "head_dim"),
    ("nomic_bert", {"type_vocab_size": 0}, "type_vocab_size"),
    ("nomic_bert", {"hidden_act": "swiglu"}, "hidden_act"),  # the remote-code config's activation_function value
    ("gte", {"hidden_size": 98}, "hidden_size"),  # transformers floors hidden / heads; ours refuses it
])
def test_options_are_typed_errors_naming_the_field(model_type, changes, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        get_family(model_type).config_class.from_dict({"model_type": model_type, **SMALL, **changes})


# ---- RoPE -------------------------------------------------------------------------------------------------

ROPES = {
    "theta": dict(rope_theta=5000.0),
    "linear-old": dict(rope_scaling={"type": "linear", "factor": 4.0}),
    "dynamic": dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 300.0}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                                  "beta_fast": 8.0, "beta_slow": 2.0}),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 4}),
}


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("model_type", ["nomic_bert", "gte"])
def test_every_rope_type_equals_transformers(model_type, rope):
    """Each RoPE type on batches past max_position_embeddings (8) and within it, in turn: dynamic NTK recomputes
    its frequencies on the longer forward and returns to the first ones on the shorter, in both models."""
    task = "mlm" if model_type == "gte" else "seqcls"
    source = make_checkpoint({"model_type": model_type, **SMALL, **ROPES[rope]}, task)
    ours, theirs = model_pair(source, task, "sdpa")
    with torch.inference_mode():
        for lengths in ((13, 8), (6, 3), (17, 12), (13, 8)):
            batch = make_batch(ours.config, task, lengths=lengths)
            _same_outputs(ours(**batch), theirs(**batch), f"{model_type} {rope} {lengths}")


# ---- file layouts ------------------------------------------------------------------------------------------

def _copy_with(source, out, tensors: dict[str, torch.Tensor]):
    out.mkdir()
    shutil.copy(source / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("model_type,fused", [("nomic_bert", "attn.Wqkv.weight"),
                                              ("gte", "mlp.up_gate_proj.weight")])
def test_files_in_the_original_layout_and_the_module_layout_load_alike(tmp_path, model_type, fused):
    source = make_checkpoint(FIELDS[f"{HD24[model_type]}-mlm"], "mlm")
    written = load_file(str(source / "model.safetensors"))
    assert any(k.endswith(fused) for k in written)  # transformers' save_pretrained writes the original layout
    ours, theirs = model_pair(source, "mlm", "eager")
    # the module layout (transformers' parameter names): loads as it is, here and in transformers
    modules = _copy_with(source, tmp_path / "modules", {k: v for k, v in theirs.state_dict().items()
                                                       if not k.endswith("inv_freq")})
    again = load_model(modules, "mlm", dtype=torch.float32, attn_implementation="eager").eval()
    batch = make_batch(ours.config, "mlm")
    with torch.inference_mode():
        want = theirs(**batch)
        _same_outputs(ours(**batch), want, "original layout")
        _same_outputs(again(**batch), want, "module layout")
    # the export writes what save_pretrained writes (the fused tensors concatenated again, bit for bit)
    ours.save_pretrained(tmp_path / "saved")
    resaved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert resaved.keys() == written.keys()
    assert all(torch.equal(resaved[k], written[k]) for k in written)


def test_gte_remote_code_prefix_new_is_dropped_as_transformers_drops_it(tmp_path):
    source = make_checkpoint(FIELDS["gte-768-mlm"], "mlm")
    tensors = load_file(str(source / "model.safetensors"))
    assert any(k.startswith("gte.") for k in tensors)
    renamed = _copy_with(source, tmp_path / "new", {("new." + k[4:] if k.startswith("gte.") else k): v
                                                    for k, v in tensors.items()})
    ours = load_model(renamed, "mlm", dtype=torch.float32).eval()
    theirs = reference_model(renamed, "mlm", "sdpa")
    batch = make_batch(ours.config, "mlm")
    with torch.inference_mode():
        _same_outputs(ours(**batch), theirs(**batch), "new. prefix")


@pytest.mark.parametrize("model_type,norm", [("nomic_bert", "emb_ln"), ("gte", "embeddings.LayerNorm")])
def test_tf_era_layernorm_names_load_as_transformers_loads_them(tmp_path, model_type, norm):
    source = make_checkpoint(FIELDS[f"{HD24[model_type]}-base"], "base")
    tensors = load_file(str(source / "model.safetensors"))
    old = {k.replace(f"{norm}.weight", f"{norm}.gamma").replace(f"{norm}.bias", f"{norm}.beta"): v
           for k, v in tensors.items()}
    assert f"{norm}.gamma" in old
    legacy = _copy_with(source, tmp_path / "legacy", old)
    ours = load_model(legacy, "base", dtype=torch.float32).eval()
    theirs = reference_model(legacy, "base", "sdpa")
    batch = make_batch(ours.config, "base")
    with torch.inference_mode():
        _same_outputs(ours(**batch), theirs(**batch), "gamma/beta")
    ours.save_pretrained(tmp_path / "saved")  # written under today's names, as save_pretrained writes them
    assert load_file(str(tmp_path / "saved" / "model.safetensors")).keys() == tensors.keys()


def test_a_fused_tensor_that_does_not_split_is_a_typed_error_naming_it(tmp_path):
    source = make_checkpoint(FIELDS["nomic_bert-hd24-linear-untied-base"], "base")
    tensors = load_file(str(source / "model.safetensors"))
    key = "encoder.layers.0.attn.Wqkv.weight"
    tensors[key] = tensors[key][:-1]
    broken = _copy_with(source, tmp_path / "broken", tensors)
    with pytest.raises(CheckpointFormatError, match=key.replace(".", r"\.")):
        load_model(broken, "base")


# ---- the backbone, token types, head_dim -------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["nomic_bert", "gte"])
def test_bare_backbone_has_no_pooler_as_automodel(model_type):
    source = make_checkpoint(FIELDS[f"{HD24[model_type]}-seqcls"], "seqcls")  # the file holds a pooler
    ours, theirs = model_pair(source, "base", "sdpa")
    assert ours.pooler is None and theirs.pooler is None
    assert not any(k.startswith("pooler.") for k in ours.state_dict())
    batch = make_batch(ours.config, "base")
    with torch.inference_mode():
        a, b = ours(**batch), theirs(**batch)
    assert a.pooler_output is None and b.pooler_output is None
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)


def test_gte_without_token_types_ignores_them_as_transformers():
    source = make_checkpoint(FIELDS["gte-hd24-notypes-dynamic-untied-tokcls"], "tokcls")
    ours, theirs = model_pair(source, "tokcls", "sdpa")
    assert ours.backbone.embeddings.token_type_embeddings is None
    batch = make_batch(ours.config, "tokcls")
    batch["token_type_ids"] = torch.ones_like(batch["input_ids"])
    with torch.inference_mode():
        _same_outputs(ours(**batch), theirs(**batch), "token types given")


@pytest.mark.parametrize("model_type", ["nomic_bert", "gte"])
def test_head_dim_other_than_hidden_over_heads(model_type):
    fields = {"model_type": model_type, **SMALL, "head_dim": 32}  # q/k/v 4 x 32 = 128 wide, hidden 96
    source = make_checkpoint(fields, "mlm")
    if model_type == "gte":  # no config field: config.json carries it only as given
        assert json.loads((source / "config.json").read_text())["head_dim"] == 32
    for impl in ("sdpa", "eager"):
        assert check_parity(source, "mlm", impl).exact
    assert load_model(source, "mlm").backbone.layers[0].self_attn.q_proj.weight.shape == (128, 96)


# ---- the shared checks, on these families ---------------------------------------------------------------------

SHARED = [(HD24["nomic_bert"], "mlm"), (HD24["gte"], "seqcls"), ("gte-768", "base"), ("nomic_bert-768", "tokcls")]


@pytest.mark.parametrize("case,task", SHARED, ids=["-".join(c) for c in SHARED])
def test_attentions_and_hidden_states_equal_transformers(case, task):
    test_output_attentions.test_attentions_equal_transformers_eager(case, task)
    test_forward_kwargs.test_hidden_states_and_tuples_equal_transformers(case, task, "sdpa")


@pytest.mark.parametrize("model_type", ["nomic_bert", "gte"])
def test_positional_order_and_calls_equal_transformers(monkeypatch, model_type):
    monkeypatch.setitem(test_positional_order.VARIANTS, model_type, HD24[model_type])
    for task in get_family(model_type).tasks:
        if task in test_positional_order.TASKS:
            test_positional_order.test_positional_order_is_transformers(model_type, task)
            test_positional_order.test_positional_call_equals_transformers_and_keywords(model_type, task)


@pytest.mark.parametrize("case,task", [(HD24["nomic_bert"], "seqcls"), (HD24["gte"], "mlm")])
def test_casts_and_rope_frequencies_equal_transformers(case, task):
    test_dtype_casts.test_casts_after_load_equal_transformers(case, task)
    test_dtype_casts.test_rope_frequencies_round_on_a_cast_and_not_on_a_load(case, task)


# ---- mutations the parity check catches --------------------------------------------------------------------

def _post_norm_swapped(self, hidden_states, rope, mask):
    # the mutation: the MLP's residual added after its norm instead of before
    attended = hidden_states + self.post_attention_dropout(self.self_attn(hidden_states, rope, mask, None))
    hidden_states = self.post_attention_layernorm(attended)
    return self.post_mlp_layernorm(self.post_mlp_dropout(self.mlp(hidden_states))) + hidden_states


@pytest.mark.parametrize("mutation", ["up_gate_order", "post_norm", "rope_theta"])
def test_parity_catches_a_mutation(monkeypatch, tmp_path, mutation):
    task = "mlm"
    source = make_checkpoint(FIELDS[f"{HD24['gte']}-{task}"], task)
    assert check_parity(source, task, "eager").exact
    if mutation == "up_gate_order":  # the fused file tensor read gate first (transformers: up_gate_proj, up first)
        layout = Gte.file_layout
        fused = tuple((f, tuple(reversed(p)) if f == "mlp.up_gate_proj" else p) for f, p in layout.fused)
        monkeypatch.setattr(Gte, "file_layout", FileLayout(layout.renames, fused, layout.strip_prefix))
    elif mutation == "post_norm":
        monkeypatch.setattr(NomicBertLayer, "forward", _post_norm_swapped)
    else:  # a config.json without RoPE fields (the remote-code ones) read with Nomic BERT's theta, not GTE's 160000
        source = _copy_with(source, tmp_path / "no-rope", load_file(str(source / "model.safetensors")))
        config = json.loads((source / "config.json").read_text())
        for name in ("rope_parameters", "rope_scaling", "rope_theta"):
            config.pop(name, None)
        (source / "config.json").write_text(json.dumps(config))
        assert check_parity(source, task, "eager").exact
        monkeypatch.setattr(get_family("gte").config_class, "default_theta", 1000.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not check_parity(source, task, "eager").exact


# ---- the tasks embedding users run, with real tokenizers ------------------------------------------------------

TOKENIZERS = {"nomic_bert": "bert/tokenizer.json", "gte": "xlm-roberta/unigram/tokenizer.json"}


def test_tokenizer_class_is_transformers():
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    from flodl_hf.tokenization import CLASS_FOR_MODEL_TYPE
    for model_type in TOKENIZERS:
        assert CLASS_FOR_MODEL_TYPE[model_type] == TOKENIZER_MAPPING_NAMES[model_type]


@pytest.mark.parametrize("model_type", list(TOKENIZERS))
def test_embed_equals_mean_pooled_transformers(model_type):
    import test_tasks
    from flodl_hf import embed
    directory = test_tasks.task_dir(TOKENIZERS[model_type], "base", model_type=model_type)
    transformers = quiet_transformers()
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModel.from_pretrained(str(directory)).eval()
    expected = []
    for text in test_tasks.TEXTS:  # sentence_transformers' mean Pooling, then Normalize
        features = tok(text, return_tensors="pt", truncation="longest_first")
        with torch.no_grad():
            tokens = model(**features).last_hidden_state
        mask = features["attention_mask"].unsqueeze(-1).expand(tokens.size()).to(tokens.dtype)
        vector = torch.sum(tokens * mask, 1) / torch.clamp(mask.sum(1), min=1e-9)
        expected.append(torch.nn.functional.normalize(vector, p=2, dim=1))
    assert torch.equal(embed(test_tasks.TEXTS, directory, batch_size=1), torch.cat(expected))


@pytest.mark.parametrize("model_type", list(TOKENIZERS))
def test_fill_mask_equals_the_pipeline(monkeypatch, model_type):
    import test_tasks
    monkeypatch.setitem(test_tasks.FAMILY_CASES, model_type, (TOKENIZERS[model_type], {}))
    test_tasks.test_every_family_fills_masks_as_the_pipeline(model_type)


def test_verify_matrix_passes_on_every_head(tmp_path):
    """export then verify-export (diff 0 against transformers) for both families and every head they have."""
    from flodl_hf.roundtrip.matrix import verify_matrix
    result = verify_matrix(families=["nomic_bert", "gte"], out_dir=tmp_path / "m", progress=False)
    assert result.ok, result.format_table()
    ran = sorted((c.model_type, c.head) for c in result.cells if c.status != "n/a")
    assert ran == sorted((m, t) for m in ("nomic_bert", "gte") for t in get_family(m).tasks), ran
