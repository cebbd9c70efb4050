"""GPT-2's own checks against transformers (and its tokenizer) in the same run: the Conv1D layout and op, a hub-style
checkpoint (keys without ``transformer.``, the old ``attn.bias`` / ``attn.masked_bias`` buffers) loading and
exporting as transformers', the config's names, generation (beam search and sampling; greedy with left padding is in
tests/test_decoder.py), the byte-level BPE tokenizer, and GPT2DoubleHeadsModel (the double_heads task: its summary
options, both losses and gradients in train mode, records, loading by architectures, LoRA against PEFT). The forwards, heads, losses, caches, export round trips and
LoRA are in the shared tables (tests/cases/gpt2.py)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from flodl_hf import AutoTokenizer
from flodl_hf.auto import AutoConfig, load_model
from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers

from decoder_checks import assert_left_padded_generate_equal, case_fields, generate_settings
from helpers import (  # noqa: F401  (one_thread: a fixture)
    assert_same_output, export_as_save_pretrained, left_padded, make_checkpoint, model_pair, one_thread,
    transformers_loaded)
from test_tokenizer_dirs import _done, assert_byte_level_tokenizer_equal, _write_config, byte_level_bpe, saved_dir

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = case_fields("gpt2-hd24")


# ---- Conv1D ----------------------------------------------------------------------------------------------------

@torch.inference_mode()
def test_conv1d_keeps_transformers_layout_and_op():
    from transformers.pytorch_utils import Conv1D as TheirConv1D

    from flodl_hf.families.gpt2 import Conv1D
    ours, theirs = model_pair(make_checkpoint(SMALL, "causal_lm"))
    mine, hf = ours.state_dict(), theirs.state_dict()
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in hf.items()}
    assert mine["transformer.h.0.attn.c_attn.weight"].shape == (96, 3 * 96)  # (in, out), as transformers stores it
    assert mine["transformer.h.0.mlp.c_fc.weight"].shape == (96, 160)
    a, b = Conv1D(160, 96), TheirConv1D(160, 96)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 7, 96, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a(x), b(x))


# ---- a hub-style checkpoint ------------------------------------------------------------------------------------

def _hub_style(tmp_path):
    """The causal LM's checkpoint as the hub's gpt2 holds it: GPT2Model keys (no ``transformer.``, no lm_head) and
    every layer's old ``attn.bias`` (the causal tril) and ``attn.masked_bias`` buffers."""
    source = make_checkpoint(SMALL, "causal_lm")
    out = tmp_path / "hub-gpt2"
    shutil.copytree(source, out)
    tensors = load_file(str(source / "model.safetensors"))
    state = {k.removeprefix("transformer."): v for k, v in tensors.items() if k.startswith("transformer.")}
    n = SMALL["n_positions"]
    for i in range(SMALL["n_layer"]):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n).to(torch.uint8)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("task", ["causal_lm", "base"])
@torch.inference_mode()
def test_hub_checkpoint_without_prefix_and_with_old_buffers_loads_as_transformers(tmp_path, task):
    source = _hub_style(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strict: an unexpected key fails, a missing one would be a warning
        ours = load_model(source, task, dtype=torch.float32).eval()
    theirs, info = transformers_loaded(source, task)
    # transformers: nothing missing; attn.bias ignored (_keys_to_ignore_on_load_unexpected), masked_bias reported as
    # unexpected and dropped too (its pattern is "attn.bias")
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.endswith(".attn.masked_bias") for k in info["unexpected_keys"]), info
    assert_same_output(ours, theirs, task)


def test_export_of_a_hub_checkpoint_writes_transformers_keys(tmp_path):
    written, _ = export_as_save_pretrained(_hub_style(tmp_path), tmp_path)
    assert all(k.startswith("transformer.") and not k.endswith((".attn.bias", "masked_bias")) for k in written)


# ---- config ----------------------------------------------------------------------------------------------------

def test_config_takes_transformers_names_and_refuses_what_is_not_implemented(tmp_path):
    transformers = quiet_transformers()
    fields = {k: v for k, v in SMALL.items() if k not in ("n_embd", "n_layer", "n_head", "n_positions")}
    fields.update(hidden_size=96, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    theirs = transformers.GPT2Config(**{k: v for k, v in fields.items() if k != "model_type"})
    directory = tmp_path / "generic-names"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**fields, "model_type": "gpt2"}))
    ours = AutoConfig.from_pretrained(directory)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings", "n_embd",
                 "n_layer", "n_head", "n_positions", "n_inner", "layer_norm_epsilon", "pad_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for bad, field in ((dict(add_cross_attention=True), "add_cross_attention"), (dict(n_head=5), "n_head"),
                       (dict(attn_pdrop=1.5), "attn_pdrop"), (dict(activation_function="nope"), "activation_function")):
        (directory / "config.json").write_text(json.dumps({**SMALL, **bad}))
        with pytest.raises(ConfigError, match=field):
            AutoConfig.from_pretrained(directory)


@torch.inference_mode()
def test_token_types_go_through_wte_and_cross_attention_inputs_are_refused():
    ours, theirs = model_pair(make_checkpoint(SMALL, "causal_lm"), impl="eager")
    batch = make_batch(ours.config, "causal_lm")
    types = torch.randint(0, 5, batch["input_ids"].shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours(**batch, token_type_ids=types).logits, theirs(**batch, token_type_ids=types).logits)
    with pytest.raises(InputError, match="encoder_hidden_states"):
        ours(**batch, encoder_hidden_states=torch.zeros(2, 3, 96))


# ---- generation ------------------------------------------------------------------------------------------------

@generate_settings(penalties=dict(repetition_penalty=1.3, no_repeat_ngram_size=2))
def test_generate_equals_transformers_with_left_padding(settings):
    assert_left_padded_generate_equal(SMALL, "sdpa", settings)


@torch.inference_mode()
def test_generate_runs_to_the_end_of_the_position_table_as_transformers():
    """wpe has n_positions rows: transformers caps max_length there; so do we, and the last step is equal."""
    ours, theirs = model_pair(make_checkpoint(SMALL, "causal_lm"), impl="eager")
    ids, mask = left_padded(ours.config.vocab_size, lengths=(60, 58))
    reference = theirs.generate(input_ids=ids, attention_mask=mask, max_length=64, pad_token_id=0, eos_token_id=[])
    assert torch.equal(generate_ids(ours, ids, mask, max_length=64, pad_token_id=0, eos_token_id=[]), reference)


# ---- the tokenizer ---------------------------------------------------------------------------------------------

def _gpt2_vocab_dir():
    out, done = byte_level_bpe("gpt2-vocab-merges", ["<|endoftext|>"])
    if done:
        return out
    _write_config(out, "gpt2", pad_token_id=None)
    return _done(out)


def _tokenizer_dirs():
    plain = _gpt2_vocab_dir()
    return {"vocab+merges": plain, "tokenizer.json": saved_dir(plain, "gpt2-saved"),
            "pad+prefix-space": saved_dir(plain, "gpt2-pad-prefix", pad_token="<|endoftext|>", add_prefix_space=True),
            "bos": saved_dir(plain, "gpt2-bos", pad_token="<|endoftext|>", add_bos_token=True)}


@pytest.mark.parametrize("name", ["vocab+merges", "tokenizer.json", "pad+prefix-space", "bos"])
def test_tokenizer_equals_transformers(name):
    transformers = quiet_transformers()
    directory = _tokenizer_dirs()[name]
    ref = transformers.AutoTokenizer.from_pretrained(str(directory))
    ours = AutoTokenizer.from_pretrained(directory)
    assert type(ref).__name__ == "GPT2Tokenizer" and ours.settings.class_name == "GPT2Tokenizer"
    assert_byte_level_tokenizer_equal(ours, ref, name, (
        dict(padding=True), dict(padding=True, padding_side="left"), dict(truncation=True, max_length=6),
        dict(add_special_tokens=False, padding=True)))


def test_generate_texts_equal_the_text_generation_pipeline(tmp_path):
    """The GPT-2 tokenizer has no pad token: our prompts are left-padded by hand, and the records equal the
    pipeline's (which runs each prompt alone), greedy and with a pad token set."""
    from flodl_hf.tasks.generate import generate
    from flodl_hf.tasks.runtime import clear_cache
    root = tmp_path / "model"
    shutil.copytree(make_checkpoint(SMALL, "causal_lm"), root)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(_gpt2_vocab_dir() / name, root / name)
    transformers = quiet_transformers()
    prompts = ["It was the fourth day", "Paris is"]
    for config in ({}, {"pad_token": "<|endoftext|>"}):
        (root / "tokenizer_config.json").write_text(json.dumps(config))
        clear_cache()
        pipe = transformers.pipeline("text-generation", model=str(root), tokenizer=str(root))
        ours = generate(prompts, str(root), do_sample=False, max_new_tokens=5, eos_token_id=[])
        assert ours == pipe(prompts, do_sample=False, max_new_tokens=5, eos_token_id=[])


def test_a_fresh_model_initialises_its_conv1d_layers_as_transformers(tmp_path):
    """from_config (and a head the checkpoint lacks) draws Conv1D weights as transformers draws a Linear's (normal,
    std initializer_range; bias zero), not zeros: compared with transformers' fresh model, statistically."""
    from flodl_hf.auto import AutoModelForCausalLM
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(**{k: v for k, v in SMALL.items() if k != "model_type"})
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    theirs = GPT2LMHeadModel(config)
    for name, p in theirs.named_parameters():
        if ".c_attn." in name or ".c_fc." in name:
            mine = dict(ours.named_parameters())[name]
            if name.endswith("bias"):
                assert not mine.any() and not p.any(), name
            else:
                assert abs(mine.std().item() - p.std().item()) < 0.2 * p.std().item(), name


# ---- GPT2DoubleHeadsModel (the double_heads task) --------------------------------------------------------------

DOUBLE = case_fields("gpt2-hd24", "double_heads")
# the summary options GPT2SequenceSummary reads; the default projects to one score (num_labels forced to 1)
SUMMARIES = {
    "default": {},
    "real-width": case_fields("gpt2-768-1layer", "double_heads"),  # n_embd 768, 12 heads x 64, the default summary
    "no-proj": dict(summary_use_proj=False),
    "proj-hidden-tanh": dict(summary_proj_to_labels=False, summary_activation="tanh"),
    "mean-gelu-dropouts": dict(summary_type="mean", summary_activation="gelu", summary_first_dropout=0.3,
                               summary_last_dropout=0.2),
}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("summary", list(SUMMARIES))
def test_double_heads_train_step_equals_transformers(summary, impl):
    """In train mode (every dropout on, the same seed): logits, mc_logits, the LM loss and the choice loss
    torch.equal to transformers' GPT2DoubleHeadsModel, with mc_token_ids (each choice's last real token) and without
    (the last position), and the gradients of loss + mc_loss equal."""
    from flodl_hf.roundtrip.parity import reference_model
    fields = {**DOUBLE, **SUMMARIES[summary]} if summary != "real-width" else SUMMARIES[summary]
    source = make_checkpoint(fields, "double_heads")
    ours = load_model(source, "double_heads", dtype=torch.float32, attn_implementation=impl).train()
    theirs = reference_model(source, "double_heads", impl).train()
    batch = make_batch(ours.config, "double_heads", num_choices=3)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    gen = torch.Generator().manual_seed(1)
    scores = fields.get("summary_use_proj", True) and fields.get("summary_proj_to_labels", True)
    # mc_logits are (B, choices), or (B, choices, hidden) without the projection to one score: view(-1, last)
    mc_labels = (torch.randint(0, 3, (2,), generator=gen) if scores
                 else torch.randint(0, fields["n_embd"], (2, 3), generator=gen))
    labels = ids.masked_fill(mask == 0, -100)
    theirs_params = dict(theirs.named_parameters())
    for mc_token_ids in (mask.sum(-1) - 1, None):
        outs = []
        for model in (ours, theirs):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            out = model(**batch, mc_token_ids=mc_token_ids, labels=labels, mc_labels=mc_labels)
            (out.loss + out.mc_loss).backward()
            outs.append(out)
        mine, ref = outs
        assert mine.mc_logits.shape == ref.mc_logits.shape
        if "summary_type" not in fields:  # cls_index; "mean" (over dim 1: the choices, as transformers') is (B, S)
            assert mine.mc_logits.shape == ((2, 3) if scores else (2, 3, fields["n_embd"]))
        for name in ("logits", "mc_logits", "loss", "mc_loss"):
            assert torch.equal(getattr(mine, name), getattr(ref, name)), name
        assert (mine.cache is None) == (ref.cache is None)
        compared = 0
        for name, param in ours.named_parameters():
            other = theirs_params[name].grad
            assert (param.grad is None) == (other is None), name
            if param.grad is not None:
                assert torch.equal(param.grad, other), f"{name}: {(param.grad - other).abs().max().item()}"
                compared += 1
        assert compared > 10 and (not SUMMARIES[summary].get("summary_use_proj", True)
                                  or ours.multiple_choice_head.summary.weight.grad is not None)


@torch.inference_mode()
def test_double_heads_records_as_transformers():
    """The record's fields in transformers' order; with output_hidden_states / output_attentions the states (the
    last one viewed to (batch, choices, seq, hidden), as GPT2Model views it) and weights equal; the cache (the
    choices flattened into the batch) holds transformers' keys and values; none with use_cache=False."""
    from flodl_hf.roundtrip.parity import reference_model
    source = make_checkpoint(DOUBLE, "double_heads")
    ours = load_model(source, "double_heads", dtype=torch.float32, attn_implementation="eager")
    theirs = reference_model(source, "double_heads", "eager")
    batch = make_batch(ours.config, "double_heads")
    a = ours(**batch, output_hidden_states=True, output_attentions=True)
    b = theirs(**batch, output_hidden_states=True, output_attentions=True)
    assert list(a.keys()) == list(b.keys()) == ["logits", "mc_logits", "cache", "hidden_states", "attentions"]
    for name in ("hidden_states", "attentions"):
        mine, ref = getattr(a, name), getattr(b, name)
        assert len(mine) == len(ref) and all(torch.equal(x, y) for x, y in zip(mine, ref)), name
    for i, layer in enumerate(b.cache.layers):
        assert torch.equal(a.cache.keys[i], layer.keys) and torch.equal(a.cache.values[i], layer.values)
    assert list(ours(**batch, use_cache=False).keys()) == list(theirs(**batch, use_cache=False).keys())


def test_double_heads_architecture_picks_the_task(tmp_path):
    """A config.json whose architectures names GPT2DoubleHeadsModel loads as the double_heads task (auto), through
    the Auto class the registry makes for it, and exports under that name."""
    from flodl_hf.auto import auto_classes
    from flodl_hf.roundtrip.export import architecture_name
    source = make_checkpoint(DOUBLE, "double_heads")
    assert json.loads((source / "config.json").read_text())["architectures"] == ["GPT2DoubleHeadsModel"]
    model = load_model(source)
    assert model.task == "double_heads" and type(model).__name__ == "GPT2DoubleHeadsModel"
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    assert auto_classes()["double_heads"].from_pretrained(source).task == "double_heads"
    assert architecture_name("gpt2", "double_heads") == "GPT2DoubleHeadsModel"


@pytest.mark.parametrize("field,value", [("summary_type", "attn"), ("summary_activation", "swishy"),
                                         ("summary_first_dropout", 1.5), ("summary_last_dropout", -0.1)])
def test_double_heads_bad_summary_options_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        AutoConfig.for_model("gpt2", **{field: value})


def test_double_heads_positional_order_is_transformers():
    """GPT2DoubleHeadsModel.forward's positional parameters (input_ids, cache, ..., mc_token_ids, labels, mc_labels,
    use_cache), ours the same; past_key_values and num_items_in_batch keyword-only."""
    import inspect

    from transformers import GPT2DoubleHeadsModel as Theirs

    from flodl_hf.families.gpt2 import GPT2DoubleHeadsModel as Ours

    def positional(cls):
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        return [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]

    assert positional(Ours) == positional(Theirs)


def test_double_heads_lora_equals_peft(tmp_path):
    """PEFT's adapter (c_attn, c_fc; multiple_choice_head saved whole) loads here: outputs equal, a training step's
    LM + choice loss gradients equal; ours saved loads back into PEFT with the same outputs."""
    import peft

    from flodl_hf import lora
    from flodl_hf.roundtrip.parity import reference_model
    warnings.simplefilter("ignore")
    source = make_checkpoint(DOUBLE, "double_heads")
    batch = make_batch(AutoConfig.from_pretrained(source), "double_heads")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                             modules_to_save=["multiple_choice_head"])
    torch.manual_seed(11)
    theirs = peft.get_peft_model(reference_model(source, "double_heads", "eager"), config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, p in theirs.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    theirs.save_pretrained(str(tmp_path / "from-peft"))
    ours = load_model(source, "double_heads", adapter=tmp_path / "from-peft", attn_implementation="eager")
    labelled = {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100),
                "mc_labels": torch.tensor([1, 0])}
    ours.train(), theirs.train()
    outs = []
    for model in (ours, theirs):
        torch.manual_seed(5)
        out = model(**labelled)
        (out.loss + out.mc_loss).backward()
        outs.append(out)
    for name in ("logits", "mc_logits", "loss", "mc_loss"):
        assert torch.equal(getattr(outs[0], name), getattr(outs[1], name)), name
    name_of = lambda n: n.removeprefix("base_model.model.").replace(".default", "").replace(  # noqa: E731
        ".modules_to_save", "").replace(".base_layer", "")
    grads = {name_of(n): p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    mine = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert set(mine) == set(grads) and any("multiple_choice_head" in n for n in mine)
    assert all(torch.equal(g, grads[n]) for n, g in mine.items())
    out = lora.save_adapter(ours.eval(), tmp_path / "to-peft")
    back = peft.PeftModel.from_pretrained(reference_model(source, "double_heads", "eager"), str(out)).eval()
    with torch.no_grad():
        a, b = ours(**batch), back(**batch)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.mc_logits, b.mc_logits)
