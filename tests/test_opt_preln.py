"""OPT's and the pre-LayerNorm encoders' (RoBERTa-PreLayerNorm, XLM-RoBERTa-XL) own checks against transformers 5.25
in the same run.

OPT: the config defaults, the positions counted along the attention mask (left padding, no mask, incremental steps
on a cache without ``position_ids``), each computation-changing option shown to change the logits (so the parity
tables would catch its loss), a backbone file (``decoder.*``, as the hub's opt checkpoints hold it) loading into the
causal LM, training with every dropout and ``layerdrop`` on, generation with beams and sampling, LoRA both ways with
PEFT, the tokenizer class read from the model type, and the typed refusals.

The encoders: the config defaults, given ``inputs_embeds``, training with every dropout on (XLM-RoBERTa-XL's MLP
output has none), the causal LM refused, the tokenizer classes read from the model types.

The forwards on both paths, every head, the losses, dtype casts, gradients, export round trips and the encoders'
LoRA are in the shared tables (tests/cases/opt.py, roberta_prelayernorm.py, xlm_roberta_xl.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flodl_hf.auto import AutoConfig, load_model
from flodl_hf.core.errors import ConfigError
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers
from flodl_hf.core.registry import get_family

from decoder_checks import (assert_left_padded_generate_equal, assert_tokenizer_class_from_the_model_type,
                            assert_training_with_dropouts_equal, case_fields)
from helpers import (  # noqa: F401  (one_thread: a fixture)
    assert_config_defaults_equal, assert_training_step_equal, dropout_acted, left_padded, make_checkpoint,
    model_pair, one_thread, transformers_loaded)

pytestmark = pytest.mark.usefixtures("one_thread")

PRE = case_fields("opt-hd24")
POST = case_fields("opt-hd24-postln-project")
BARE = case_fields("opt-hd24-nobias-noaffine")


# ---- the config -----------------------------------------------------------------------------------------------

def test_config_defaults_are_transformers():
    """Every field both configs have, at its default; ``word_embed_proj_dim`` as transformers fills it in."""
    ours, theirs, _ = assert_config_defaults_equal("opt", {"word_embed_proj_dim"}, {
        "ffn_dim", "do_layer_norm_before", "_remove_final_layer_norm", "enable_bias", "layerdrop",
        "layer_norm_elementwise_affine", "activation_function", "pad_token_id", "dropout"})
    assert ours.word_embed_proj_dim is None and ours.embed_dim == theirs.word_embed_proj_dim == 768


@pytest.mark.parametrize("bad,field", [
    (dict(layerdrop=1.5), "layerdrop"), (dict(dropout=-0.1), "dropout"), (dict(word_embed_proj_dim=0),
                                                                          "word_embed_proj_dim"),
    (dict(ffn_dim=0), "ffn_dim"), (dict(activation_function="nope"), "activation_function"),
    (dict(num_attention_heads=5), "num_attention_heads"), (dict(enable_bias="yes"), "enable_bias"),
])
def test_config_refuses_bad_fields_naming_them(tmp_path, bad, field):
    (tmp_path / "config.json").write_text(json.dumps({**PRE, **bad}))
    with pytest.raises(ConfigError, match=field):
        AutoConfig.from_pretrained(tmp_path)


# ---- the positions: counted along the attention mask ------------------------------------------------------------

@pytest.mark.parametrize("fields,impl", [(PRE, "sdpa"), (POST, "eager")], ids=["pre-ln", "post-ln-project"])
@torch.inference_mode()
def test_cache_steps_without_position_ids_equal_transformers(fields, impl):
    """A left-padded prefill, then one token a step with the grown mask and no ``position_ids``: both sides count
    the positions along the mask (OPTDecoder.forward's cumsum), so a pad-shifted row keeps its own positions; a
    step with no mask at all counts from the cache's length. Logits torch.equal at every step."""
    ours, theirs = model_pair(make_checkpoint(fields, "causal_lm"), impl=impl)
    from transformers import DynamicCache
    ids, mask = left_padded(ours.config.vocab_size, low=3)
    caches = ours.backbone.new_cache(), DynamicCache(config=theirs.config)
    step = ids
    for _ in range(4):
        a = ours(input_ids=step, attention_mask=mask, cache=caches[0], use_cache=True)
        b = theirs(input_ids=step, attention_mask=mask, cache=caches[1], use_cache=True)
        assert torch.equal(a.logits, b.logits)
        step = b.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(step)], dim=-1)
    one = ids[:1, -3:]
    a = ours(input_ids=one, use_cache=True)
    b = theirs(input_ids=one, use_cache=True)
    nxt = b.logits[:, -1:].argmax(-1)
    assert torch.equal(ours(input_ids=nxt, cache=a.cache).logits, theirs(input_ids=nxt, cache=b.cache).logits)


@torch.inference_mode()
def test_positions_are_read_at_an_offset_of_two_and_pads_at_minus_one():
    """The positions our backbone computes are transformers' (a pad at -1, so table row 1), and given position_ids
    are read at ``+ 2``: shifting the given positions by one changes the output."""
    ours, theirs = model_pair(make_checkpoint(PRE, "causal_lm"))
    ids, mask = left_padded(ours.config.vocab_size, low=3)
    positions = ours.backbone.default_positions(ids, mask, 0)
    assert positions[2].tolist() == [-1] * 6 + [0, 1, 2]
    assert torch.equal(ours(input_ids=ids, attention_mask=mask, position_ids=positions).logits,
                       theirs(input_ids=ids, attention_mask=mask).logits)
    given = positions.clamp(min=0)
    a = ours(input_ids=ids, attention_mask=mask, position_ids=given).logits
    assert torch.equal(a, theirs(input_ids=ids, attention_mask=mask, position_ids=given).logits)
    assert not torch.equal(a[0], ours(input_ids=ids, attention_mask=mask, position_ids=given + 1).logits[0])


@pytest.mark.parametrize("fields,impl", [(PRE, "eager"), (POST, "sdpa")], ids=["pre-ln", "post-ln-project"])
@torch.inference_mode()
def test_given_inputs_embeds_are_projected_in_as_transformers(fields, impl):
    """Embeddings of the ``word_embed_proj_dim`` width go through ``project_in`` as looked-up ones do; the positions
    still come from the mask."""
    ours, theirs = model_pair(make_checkpoint(fields, "causal_lm"), impl=impl)
    ids, mask = left_padded(ours.config.vocab_size, low=3)
    embeds = torch.randn(*ids.shape, ours.config.embed_dim, generator=torch.Generator().manual_seed(3))
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, use_cache=False, output_hidden_states=True)
    a, b = ours(**kwargs), theirs(**kwargs)
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states, strict=True))


# ---- each option changes the computation -----------------------------------------------------------------------

@pytest.mark.parametrize("name,value", [("do_layer_norm_before", False), ("_remove_final_layer_norm", True),
                                        ("activation_function", "gelu")])
@torch.inference_mode()
def test_each_option_changes_the_logits_as_in_transformers(tmp_path, name, value):
    """The option flipped in config.json: ours equals transformers' on the new config and differs from the
    unflipped model, so the parity tables' cases would catch an option read wrong."""
    source = make_checkpoint(PRE, "causal_lm")
    root = tmp_path / "flipped"
    shutil.copytree(source, root)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, name: value}))
    batch = {**make_batch(AutoConfig.from_pretrained(source), "causal_lm"), "use_cache": False}
    plain, _ = model_pair(source)
    ours, theirs = model_pair(root)
    a = ours(**batch).logits
    assert torch.equal(a, theirs(**batch).logits)
    assert not torch.equal(a, plain(**batch).logits)


# ---- a hub-style backbone file ----------------------------------------------------------------------------------

@torch.inference_mode()
def test_a_backbone_file_loads_into_the_causal_lm_as_transformers(tmp_path):
    """OPTModel's file (``decoder.*`` keys, no head) loaded as OPTForCausalLM: the head tied to embed_tokens on both
    sides, the logits torch.equal."""
    source = make_checkpoint(POST, "base")
    ours = load_model(source, "causal_lm", dtype=torch.float32).eval()
    theirs, info = transformers_loaded(source, "causal_lm")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert ours.lm_head.weight is ours.backbone.decoder.embed_tokens.weight
    batch = {**make_batch(ours.config, "causal_lm"), "use_cache": False}
    assert torch.equal(ours(**batch).logits, theirs(**batch).logits)


# ---- training, generation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,impl", [(PRE, "eager"), (POST, "sdpa")], ids=["pre-ln", "post-ln-project"])
def test_training_with_dropouts_and_layerdrop_equals_transformers(fields, impl):
    """``dropout`` (each branch), ``attention_dropout`` and ``layerdrop`` (a ``torch.rand([])`` before each layer):
    the same seed draws the same masks and skips in the same order on both sides, so the loss and every gradient
    are torch.equal."""
    assert_training_with_dropouts_equal({**fields, "dropout": 0.1, "attention_dropout": 0.1, "layerdrop": 0.4},
                                        impl=impl, low=3)


def test_layerdrop_records_no_hidden_state_for_a_skipped_layer():
    """In training, a layer LayerDrop skips is never called, so transformers' hooks record no hidden state for it:
    the tuple is shorter by the skipped layers, and ours is the same tuple, tensor for tensor."""
    ours, theirs = model_pair(make_checkpoint({**PRE, "layerdrop": 0.5}, "causal_lm"), "causal_lm", "eager")
    ours.train(), theirs.train()
    batch = {**make_batch(ours.config, "causal_lm"), "use_cache": False, "output_hidden_states": True}
    layers, lengths = ours.config.num_hidden_layers, set()
    for seed in range(4):
        torch.manual_seed(seed)
        got = ours(**batch).hidden_states
        torch.manual_seed(seed)
        want = theirs(**batch).hidden_states
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), seed
        lengths.add(len(want))
    assert min(lengths) < layers + 1 and len(lengths) > 1  # some layer was skipped, and not always the same number


@pytest.mark.parametrize("fields,settings", [(POST, dict(num_beams=3, early_stopping=True)),
                                             (BARE, dict(do_sample=True, top_k=20, temperature=0.7))],
                         ids=["post-ln-beams", "bare-sampled"])
def test_generate_equals_transformers_with_left_padding(fields, settings):
    assert_left_padded_generate_equal(fields, "sdpa", settings, low=3, model_generate=True)


# ---- LoRA, the tokenizer ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [POST], ids=["post-ln-project"])
def test_lora_on_the_causal_lm_both_ways_with_peft(fields, tmp_path):
    """test_lora's round trip (PEFT's adapter in, a training step, ours out to PEFT, merged) on the causal LM, every
    projection targeted; PEFT's default targets are ours."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT
    from test_lora import TARGETS, test_peft_round_trip_and_training_step as peft_round_trip

    from flodl_hf import lora
    peft_round_trip("causal_lm", fields, TARGETS["opt"][1], 8, True, tmp_path)
    assert lora.default_targets("opt") == list(PEFT["opt"]) == ["q_proj", "v_proj"]


def test_tokenizer_class_from_the_model_type(tmp_path):
    """A vocab.json + merges.txt whose directory names no tokenizer class: transformers picks GPT2Tokenizer from
    config.json's model_type, and so do we."""
    from test_tokenizer_dirs import _done, _write_config, assert_byte_level_tokenizer_equal, byte_level_bpe

    from flodl_hf import AutoTokenizer
    from flodl_hf.tokenization import CLASS_FOR_MODEL_TYPE
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    assert CLASS_FOR_MODEL_TYPE["opt"] == TOKENIZER_MAPPING_NAMES["opt"] == "GPT2Tokenizer"
    plain, done = byte_level_bpe("opt-vocab-merges", ["<s>", "<pad>", "</s>", "<unk>"])
    if not done:
        _write_config(plain, "opt", pad_token_id=1)
        plain = _done(plain)
    ref = quiet_transformers().AutoTokenizer.from_pretrained(str(plain))
    ours = AutoTokenizer.from_pretrained(plain)
    assert type(ref).__name__ == "GPT2Tokenizer" and ours.settings.class_name == "GPT2Tokenizer"
    assert_byte_level_tokenizer_equal(ours, ref, "opt", (dict(padding=True), dict(truncation=True, max_length=6)))


# ---- the pre-LayerNorm encoders ---------------------------------------------------------------------------------

ENCODERS = {"roberta-prelayernorm": "roberta-prelayernorm-hd24", "xlm-roberta-xl": "xlm-roberta-xl-hd24"}


@pytest.mark.parametrize("model_type", list(ENCODERS))
def test_encoder_config_defaults_are_transformers(model_type):
    assert_config_defaults_equal(
        model_type, present={"vocab_size", "hidden_size", "layer_norm_eps", "max_position_embeddings", "pad_token_id"})


@pytest.mark.parametrize("model_type", list(ENCODERS))
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@torch.inference_mode()
def test_encoder_inputs_embeds_equal_transformers(model_type, impl):
    """Given embeddings (positions then sequential from padding_idx + 1): the masked LM's logits and the hidden
    states, the last one after the final LayerNorm, torch.equal."""
    ours, theirs = model_pair(make_checkpoint(case_fields(ENCODERS[model_type], "mlm"), "mlm"), "mlm", impl)
    batch = make_batch(ours.config, "mlm")
    embeds = ours.get_input_embeddings()(batch.pop("input_ids"))
    a = ours(inputs_embeds=embeds, output_hidden_states=True, **batch)
    b = theirs(inputs_embeds=embeds, output_hidden_states=True, **batch)
    assert torch.equal(a.logits, b.logits)
    assert len(a.hidden_states) == len(b.hidden_states) == ours.config.num_hidden_layers + 1
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states))


@pytest.mark.parametrize("model_type,task", [("roberta-prelayernorm", "mlm"), ("xlm-roberta-xl", "seqcls")])
def test_encoder_training_with_dropouts_equals_transformers(model_type, task):
    """hidden_dropout_prob (embeddings, each branch where transformers has it) and attention dropout on: the same
    seed draws the same masks in the same order, so the loss and every gradient are torch.equal."""
    fields = {**case_fields(ENCODERS[model_type], task), "hidden_dropout_prob": 0.1,
              "attention_probs_dropout_prob": 0.1}
    ours, theirs = model_pair(make_checkpoint(fields, task), task, "eager")
    batch = make_batch(ours.config, task)
    batch["labels"] = batch["input_ids"] if task == "mlm" else torch.tensor([1, 4])
    loss = assert_training_step_equal(ours, theirs, batch)
    assert dropout_acted(ours, batch, loss)


@pytest.mark.parametrize("model_type", list(ENCODERS))
def test_encoder_causal_lm_is_refused(tmp_path, model_type):
    """transformers' ``*ForCausalLM`` runs these encoders with ``is_decoder``: not implemented, a typed error."""
    (tmp_path / "config.json").write_text(json.dumps({**case_fields(ENCODERS[model_type], "base"), "is_decoder": True}))
    with pytest.raises(ConfigError, match="is_decoder"):
        AutoConfig.from_pretrained(tmp_path)
    assert not get_family(model_type).supports("causal_lm")


@pytest.mark.parametrize("model_type,class_name", [("roberta-prelayernorm", "RobertaTokenizer"),
                                                   ("xlm-roberta-xl", "TokenizersBackend")])
def test_encoder_tokenizer_class_from_the_model_type(tmp_path, model_type, class_name):
    """A RoBERTa tokenizer.json whose tokenizer_config.json names no class: transformers picks the class from
    config.json's model_type (TOKENIZER_MAPPING_NAMES), and so do we, token for token."""
    from test_tokenizer_dirs import _write_config, bpe_vocab_dir, saved_dir
    root = tmp_path / model_type
    shutil.copytree(saved_dir(bpe_vocab_dir(), "roberta-no-class", tokenizer_class=None), root)
    _write_config(root, model_type, pad_token_id=1)
    assert_tokenizer_class_from_the_model_type(root, model_type, class_name)
