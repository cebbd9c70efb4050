"""GPT-J's own checks against transformers in the same run: the sinusoid table and the interleaved rotation on the
first ``rotary_dim`` dimensions (not LLaMA's rotate_half), the ``rotary_dim`` values transformers refuses or
cannot run refused, token types through ``wte``, a load in bfloat16 (eager's float32 scores), a
hub-style checkpoint (the old ``attn.bias`` / ``attn.masked_bias`` buffers) loading and exporting as transformers',
training with every dropout on, generation with beams and sampling, the tokenizer class and PEFT's default LoRA
targets. The forwards, heads, losses, caches, greedy generation with left padding, export round trips and LoRA are
in the shared tables (tests/cases/gptj.py)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from flodl_hf.auto import AutoConfig, load_model
from flodl_hf.core.errors import ConfigError
from flodl_hf.roundtrip.export import export
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers
from flodl_hf.roundtrip.verify import verify_export

from decoder_checks import (assert_left_padded_generate_equal, assert_training_with_dropouts_equal, case_fields,
                            generate_settings)
from helpers import left_padded, make_checkpoint, model_pair, one_thread  # noqa: F401  (one_thread: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = case_fields("gptj-hd24")
FULLROT = case_fields("gptj-hd24-fullrot-tied")


# ---- the rotation ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [SMALL, FULLROT], ids=["partial", "whole-heads"])
@torch.inference_mode()
def test_rotation_is_gptjs_interleaved_form(fields):
    """The sinusoid table, sin and cos, and q and k after RoPE equal transformers' GPTJRotaryEmbedding and
    GPTJAttention's slices turned with rotate_every_two; LLaMA's rotate_half on the same dimensions differs."""
    from transformers.models.gptj import modeling_gptj as theirs_module

    from flodl_hf.core.decoder import apply_rotary_pos_emb as rotate_half_form
    ours, theirs = model_pair(make_checkpoint(fields, "causal_lm"))
    rotary = theirs.transformer.rotary_emb
    assert torch.equal(ours.backbone.embed_positions(None, None), rotary.embed_positions)
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    hidden = torch.zeros(2, 5, 96)
    cos, sin = ours.backbone.rotary(None, positions, hidden)
    their_sin, their_cos = rotary(hidden, positions)
    assert torch.equal(cos, their_cos) and torch.equal(sin, their_sin)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 5, 4, 24, generator=gen) for _ in range(2))  # (B, S, heads, d), as transformers turns
    mine = [t.transpose(1, 2) for t in ours.backbone.h[0].attn.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)]
    n = fields["rotary_dim"]
    reference = [torch.cat([theirs_module.apply_rotary_pos_emb(t[..., :n], their_sin, their_cos), t[..., n:]], dim=-1)
                 for t in (q, k)]
    assert all(torch.equal(a, b) for a, b in zip(mine, reference, strict=True))
    assert torch.equal(mine[0][..., n:], q[..., n:])  # the rest pass as they are
    llama = rotate_half_form(q.transpose(1, 2), k.transpose(1, 2), torch.cat([their_cos, their_cos], -1),
                             torch.cat([their_sin, their_sin], -1))
    assert not torch.equal(llama[0].transpose(1, 2), mine[0])


@pytest.mark.parametrize("bad,field", [
    (dict(rotary_dim=7), "rotary_dim"),      # odd: the doubled table is one short
    (dict(rotary_dim=32), "rotary_dim"),     # wider than the heads of 24
    (dict(rotary_dim=None), "rotary_dim"),   # GPTJConfig's strict int (its model would turn n_embd wide)
    (dict(rotary_dim="8"), "rotary_dim"),
    (dict(rotary_dim=0), "rotary_dim"),
    (dict(n_head=5), "n_head"),
    (dict(resid_pdrop=1.5), "resid_pdrop"),
    (dict(activation_function="nope"), "activation_function"),
])
def test_config_refuses_what_transformers_cannot_run(tmp_path, bad, field):
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, **bad}))
    with pytest.raises(ConfigError, match=field):
        AutoConfig.from_pretrained(tmp_path)


# ---- inputs and dtypes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", ["causal_lm", "seqcls"])
@torch.inference_mode()
def test_token_types_go_through_wte_as_transformers(task):
    ours, theirs = model_pair(make_checkpoint(SMALL, task), task, "eager")
    batch = make_batch(ours.config, task)
    batch["token_type_ids"] = (torch.arange(batch["input_ids"].shape[1]) % 3).expand_as(batch["input_ids"])
    a, b = ours(**batch, use_cache=False), theirs(**batch, use_cache=False)
    assert torch.equal(a.logits, b.logits)
    assert not torch.equal(a.logits, ours(**{**batch, "token_type_ids": None}, use_cache=False).logits)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@torch.inference_mode()
def test_bfloat16_load_equals_transformers(impl):
    """dtype=bfloat16 at load: the eager path's float32 q k^T, the softmax cast back, the table's rows cast."""
    ours, theirs = model_pair(make_checkpoint(SMALL, "causal_lm"), impl=impl, dtype=torch.bfloat16)
    ids, mask = left_padded(ours.config.vocab_size)
    a = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits
    b = theirs(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)


# ---- a hub-style checkpoint -------------------------------------------------------------------------------------

def _hub_style(tmp_path):
    """The causal LM as EleutherAI/gpt-j-6b holds it: every layer's old ``attn.bias`` (the causal tril) and
    ``attn.masked_bias`` buffers beside the weights."""
    source = make_checkpoint(SMALL, "causal_lm")
    out = tmp_path / "hub-gptj"
    shutil.copytree(source, out)
    state = load_file(str(source / "model.safetensors"))
    n = SMALL["n_positions"]
    for i in range(SMALL["n_layer"]):
        state[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e9)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@torch.inference_mode()
def test_hub_checkpoint_loads_and_exports_as_transformers(tmp_path):
    source = _hub_style(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = load_model(source, "causal_lm", dtype=torch.float32).eval()
    assert not caught  # the buffers go without a word
    transformers = quiet_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    batch = make_batch(ours.config, "causal_lm")
    assert torch.equal(ours(**batch).logits, theirs(**batch).logits)
    result = export(source, tmp_path / "out")
    saved = tmp_path / "theirs"
    theirs.save_pretrained(str(saved))
    assert set(load_file(str(result.out / "model.safetensors"))) == set(load_file(str(saved / "model.safetensors")))
    report = verify_export(result.out)
    assert report.ok and report.max_abs_diff == 0.0, report.format_table()


# ---- training with every dropout on -----------------------------------------------------------------------------

@pytest.mark.parametrize("fields,impl", [(SMALL, "eager"), (FULLROT, "sdpa")], ids=["untied-eager", "tied-sdpa"])
def test_training_with_dropouts_equals_transformers(fields, impl):
    """embd_pdrop, attn_pdrop and resid_pdrop (attention output and MLP) on: the same seed draws the same masks in
    the same order on both sides, so the loss and every gradient (the lm_head bias, a tied wte's two
    contributions) are torch.equal."""
    assert_training_with_dropouts_equal({**fields, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "resid_pdrop": 0.1},
                                        impl=impl)


# ---- generation -------------------------------------------------------------------------------------------------

@generate_settings()
def test_generate_equals_transformers_with_left_padding(settings):
    assert_left_padded_generate_equal(SMALL, "eager", settings)


# ---- the tokenizer class and the LoRA default -------------------------------------------------------------------

def test_tokenizer_class_and_lora_default_are_transformers_and_pefts():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    from flodl_hf import lora
    from flodl_hf.core.registry import get_family
    from flodl_hf.tokenization import CLASS_FOR_MODEL_TYPE
    assert CLASS_FOR_MODEL_TYPE["gptj"] == TOKENIZER_MAPPING_NAMES["gptj"] == "GPT2Tokenizer"
    assert lora.default_targets("gptj") == list(PEFT["gptj"]) == ["q_proj", "v_proj"]
    transformers = quiet_transformers()
    family = get_family("gptj")
    assert all(hasattr(transformers, family.architecture(task)) for task in family.tasks)
    assert not family.supports("tokcls") and not hasattr(transformers, "GPTJForTokenClassification")
