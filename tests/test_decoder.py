"""The decoder families against transformers in the same run: left-padded forwards, logits at every step of
incremental decoding with the KV cache, ``logits_to_keep``, greedy and seeded sampled ``generate``, eos
stopping, the LLaMA tokenizers (a SentencePiece model and a BPE-with-byte-fallback tokenizer.json), the
``generate`` command, and a short causal-LM fine-tune with the trainer.

Right padding, every head and the losses are in the shared tables (tests/cases/llama.py, mistral.py,
qwen2.py, qwen3.py, phi3.py, gemma.py, gemma2.py, gemma3_text.py, gpt2.py, gpt_neox.py, olmo2.py, granite.py,
gptj.py, starcoder2.py, stablelm.py, phi.py, olmo.py, cohere.py, opt.py, mixtral.py, qwen2_moe.py,
qwen3_moe.py, olmoe.py
through test_parity.py, test_losses.py, test_export.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.core.decoder import KVCache
from flodl_hf.generation.generate import generate_ids
from flodl_hf.tasks.generate import generate
from flodl_hf.roundtrip.parity import check_parity, quiet_transformers, reference_model
from flodl_hf.core.samples import sample_path

from cases import CASES
from decoder_checks import NARROW
from helpers import left_padded, make_checkpoint, model_pair

# NARROW, but the mixtures of experts' variants of 6 experts, top 3 (NARROW's route 2 of 4)
SMALL = {**NARROW, "mixtral": "mixtral-hd24-6experts-top3-window4",
         "qwen2_moe": "qwen2_moe-hd24-6experts-top3-step2-window4",
         "qwen3_moe": "qwen3_moe-hd24-6experts-top3-step2-window4", "olmoe": "olmoe-hd24-6experts-top3-clip"}


def _fields(variant: str) -> dict:
    return next(f for case_id, t, f in CASES if case_id.startswith(variant + "-") and t == "causal_lm")


def _left_padded(vocab: int, lengths=(9, 6, 3), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded(vocab, lengths, seed, low=3)


def _pair(variant: str, impl: str):
    source = make_checkpoint(_fields(variant), "causal_lm")
    return (source, *model_pair(source, "causal_lm", impl))


# the real-width model on both paths, the windowed families on one each (both paths are in the parity table)
CELLS = [("llama-1024-gqa", "sdpa"), ("llama-1024-gqa", "eager"), (SMALL["llama"], "sdpa"),
         (SMALL["mistral"], "eager"), (SMALL["qwen2"], "sdpa"), (SMALL["qwen3"], "eager"),
         (SMALL["phi3"], "sdpa"), (SMALL["gemma"], "eager"), (SMALL["gemma2"], "eager"),
         (SMALL["gemma3_text"], "sdpa"), (SMALL["gpt2"], "sdpa"), ("gpt2-768-1layer", "eager"),
         ("gpt2-hd24-scalings", "eager"), (SMALL["gpt_neox"], "eager"), ("gpt_neox-hd24-sequential", "sdpa"),
         (SMALL["olmo2"], "sdpa"), (SMALL["olmo2"], "eager"), (SMALL["granite"], "sdpa"), (SMALL["granite"], "eager"),
         (SMALL["starcoder2"], "sdpa"), (SMALL["starcoder2"], "eager"), (SMALL["stablelm"], "sdpa"),
         (SMALL["stablelm"], "eager"), ("stablelm-hd24-sequential", "sdpa"), (SMALL["gptj"], "eager"),
         ("gptj-hd24-fullrot-tied", "sdpa"), (SMALL["opt"], "sdpa"), ("opt-hd24-postln-project", "eager"),
         ("opt-768-1layer", "sdpa"), (SMALL["mixtral"], "sdpa"), ("mixtral-hd24-4experts-top2", "eager"),
         (SMALL["qwen2_moe"], "eager"), ("qwen2_moe-hd24-4experts-norm-dense1", "sdpa"),
         (SMALL["qwen3_moe"], "sdpa"), ("qwen3_moe-hd24-4experts-norm-bias-dense1", "eager"),
         ("qwen3_moe-768-1layer", "sdpa"), (SMALL["olmoe"], "eager"), ("olmoe-hd24-4experts-norm-bias", "sdpa"),
         ("olmoe-768-1layer", "eager"),
         (SMALL["phi"], "sdpa"), ("phi-hd24-plain-tied", "eager"), (SMALL["olmo"], "eager"),
         ("olmo-768-1layer", "sdpa"), (SMALL["cohere"], "sdpa"), ("cohere-hd24-plain-untied", "eager"),
         (SMALL["smollm3"], "sdpa"), (SMALL["olmo3"], "eager"), (SMALL["ministral"], "sdpa")]


@pytest.mark.parametrize("variant,impl", CELLS, ids=[f"{v}-{i}" for v, i in CELLS])
def test_left_padded_forward_is_exact(variant, impl):
    fields = _fields(variant)
    source = make_checkpoint(fields, "causal_lm")
    ids, mask = _left_padded(fields["vocab_size"])
    result = check_parity(source, "causal_lm", impl, batch={"input_ids": ids, "attention_mask": mask})
    assert result.exact, result.diffs


@pytest.mark.parametrize("variant,impl", CELLS, ids=[f"{v}-{i}" for v, i in CELLS])
@torch.inference_mode()
def test_every_decoding_step_equals_transformers_with_its_cache(variant, impl):
    """Prefill a left-padded batch, then feed one token at a time (the reference's greedy pick, to both):
    logits torch.equal at every step, the caches' keys and values too."""
    _, ours, theirs = _pair(variant, impl)
    from transformers import DynamicCache
    ids, mask = _left_padded(ours.config.vocab_size)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache_ours, cache_theirs = ours.backbone.new_cache(), DynamicCache(config=theirs.config)
    step_ids, step_pos = ids, pos
    windows = [w for w in cache_ours.windows if w is not None]
    steps = 6 + (max(windows) if windows else 0)  # past the window, so the sliding cache drops tokens
    for step in range(steps):
        a = ours(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, cache=cache_ours,
                 use_cache=True)
        b = theirs(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, cache=cache_theirs,
                   use_cache=True)
        assert torch.equal(a.logits, b.logits), (step, (a.logits - b.logits).abs().max().item())
        assert a.cache is cache_ours
        nxt = b.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        step_pos = step_pos[:, -1:] + 1
        step_ids = nxt
    for i, layer in enumerate(cache_theirs.layers):
        assert torch.equal(cache_ours.keys[i], layer.keys) and torch.equal(cache_ours.values[i], layer.values)
    assert cache_ours.get_seq_length() == cache_theirs.get_seq_length()


@torch.inference_mode()
def test_cache_is_transformers_5_24s_name_and_past_key_values_its_older_one():
    """transformers 5.24 renamed the keyword and the output field ``past_key_values`` to ``cache`` and keeps the
    old name as an alias: both names work here too, together they are an error, and the records' keys and
    tuples are in transformers' order."""
    _, ours, theirs = _pair(SMALL["llama"], "sdpa")
    ids, mask = _left_padded(ours.config.vocab_size)
    a, b = ours(input_ids=ids, attention_mask=mask, use_cache=True), theirs(input_ids=ids, attention_mask=mask,
                                                                             use_cache=True)
    assert list(a.keys()) == list(b.keys()) == ["logits", "cache"]
    assert a.past_key_values is a.cache and isinstance(a.cache, KVCache)
    as_tuple = ours(input_ids=ids, attention_mask=mask, use_cache=True, return_dict=False)
    assert len(as_tuple) == len(theirs(input_ids=ids, attention_mask=mask, use_cache=True, return_dict=False)) == 2
    assert torch.equal(as_tuple[0], b.logits) and isinstance(as_tuple[1], KVCache)
    base = ours.backbone(input_ids=ids, attention_mask=mask, use_cache=True)
    assert list(base.keys()) == list(theirs.model(input_ids=ids, attention_mask=mask, use_cache=True).keys())
    nxt = b.logits[:, -1].argmax(-1, keepdim=True)
    mask2 = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
    old = ours(input_ids=nxt, attention_mask=mask2, past_key_values=a.cache.to_legacy())
    new = ours(input_ids=nxt, attention_mask=mask2, cache=a.cache.to_legacy())
    assert torch.equal(old.logits, new.logits)
    from flodl_hf.core.errors import InputError
    for model in (ours, ours.backbone):
        with pytest.raises(InputError, match="cache and past_key_values"):
            model(input_ids=nxt, attention_mask=mask2, cache=a.cache, past_key_values=a.cache)
    with pytest.raises(InputError, match="cache: expected a KVCache"):
        ours(input_ids=nxt, attention_mask=mask2, cache="a cache")
    from flodl_hf.core.outputs import SequenceClassifierOutput
    assert not hasattr(SequenceClassifierOutput(logits=b.logits), "past_key_values")  # a record with no cache


@torch.inference_mode()
def test_decoder_sequence_classification_returns_its_cache_as_transformers():
    fields = next(f for case_id, t, f in CASES if case_id.startswith(SMALL["mistral"] + "-") and t == "seqcls")
    source = make_checkpoint(fields, "seqcls")
    ours = load_model(source, "seqcls", dtype=torch.float32).eval()
    theirs = reference_model(source, "seqcls", "sdpa")
    ids, mask = _left_padded(ours.config.vocab_size)
    a, b = ours(input_ids=ids, attention_mask=mask), theirs(input_ids=ids, attention_mask=mask)
    assert list(a.keys()) == list(b.keys()) == ["logits", "cache"] and torch.equal(a.logits, b.logits)
    assert a.cache.get_seq_length() == b.cache.get_seq_length() == ids.shape[1]
    as_tuple = ours(input_ids=ids, attention_mask=mask, return_dict=False)
    assert len(as_tuple) == len(theirs(input_ids=ids, attention_mask=mask, return_dict=False))
    assert list(ours(input_ids=ids, attention_mask=mask, use_cache=False).keys()) == ["logits"]


@torch.inference_mode()
def test_past_key_values_in_as_per_layer_tuples_and_logits_to_keep():
    source, ours, theirs = _pair(SMALL["llama"], "sdpa")
    ids, mask = _left_padded(ours.config.vocab_size)
    first = ours(input_ids=ids, attention_mask=mask, use_cache=True)
    legacy = first.past_key_values.to_legacy()
    nxt = first.logits[:, -1].argmax(-1, keepdim=True)
    mask2 = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
    via_cache = ours(input_ids=nxt, attention_mask=mask2, past_key_values=first.past_key_values)
    via_tuples = ours(input_ids=nxt, attention_mask=mask2, past_key_values=legacy)
    assert torch.equal(via_cache.logits, via_tuples.logits)
    assert isinstance(via_tuples.past_key_values, KVCache)
    assert ours(input_ids=ids, attention_mask=mask, use_cache=False).past_key_values is None
    from flodl_hf.core.errors import InputError
    with pytest.raises(InputError, match="cached tokens"):  # the mask must cover the past and the step
        ours(input_ids=nxt, attention_mask=mask, past_key_values=first.past_key_values.to_legacy())
    from flodl_hf import AutoModelForCausalLM
    assert type(AutoModelForCausalLM.from_pretrained(source)) is type(ours)
    for keep in (1, 3, torch.tensor([[0, 4], [2, 8], [7, 8]])):
        a = ours(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
        b = theirs(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
        assert a.shape == b.shape and torch.equal(a, b), keep


@pytest.mark.parametrize("variant,impl", [("llama-1024-gqa", "sdpa"), (SMALL["mistral"], "sdpa"),
                                          (SMALL["qwen2"], "eager"), (SMALL["qwen3"], "sdpa"),
                                          (SMALL["phi3"], "eager"), (SMALL["gemma"], "sdpa"),
                                          (SMALL["gemma2"], "eager"), (SMALL["gemma3_text"], "eager"),
                                          (SMALL["gpt2"], "sdpa"), ("gpt2-hd24-scalings", "eager"),
                                          (SMALL["gpt_neox"], "sdpa"), ("gpt_neox-hd24-sequential", "eager"),
                                          (SMALL["olmo2"], "eager"), (SMALL["granite"], "sdpa"),
                                          (SMALL["starcoder2"], "sdpa"), ("starcoder2-hd24-nobias-untied", "eager"),
                                          (SMALL["stablelm"], "eager"), ("stablelm-hd24-sequential", "sdpa"),
                                          (SMALL["gptj"], "sdpa"), ("gptj-hd24-fullrot-tied", "eager"),
                                          (SMALL["opt"], "eager"), ("opt-hd24-postln-project", "sdpa"),
                                          (SMALL["mixtral"], "eager"), (SMALL["qwen2_moe"], "sdpa"), (SMALL["phi"], "eager"),
                                          (SMALL["qwen3_moe"], "eager"), (SMALL["olmoe"], "sdpa"),
                                          (SMALL["olmo"], "sdpa"), (SMALL["cohere"], "eager"),
                                          (SMALL["smollm3"], "eager"), (SMALL["olmo3"], "sdpa"),
                                          (SMALL["ministral"], "eager")])
def test_greedy_generate_equals_transformers_and_stops_at_eos(variant, impl):
    _, ours, theirs = _pair(variant, impl)
    ids, mask = _left_padded(ours.config.vocab_size)
    with torch.inference_mode():
        reference = theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    eos_token_id=[], pad_token_id=0)
    ours_ids = generate_ids(ours, ids, mask, max_new_tokens=6, eos_token_id=[], pad_token_id=0)
    assert torch.equal(ours_ids, reference)
    # eos: the 4th new token of row 0; that row is padded from there, the others run on
    eos = int(reference[0, ids.shape[1] + 3])
    with torch.inference_mode():
        reference = theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    eos_token_id=eos, pad_token_id=0)
    ours_ids = generate_ids(ours, ids, mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours_ids, reference)
    assert (ours_ids[0, ids.shape[1] + 4:] == 0).all()
    # every row stops: eos is each row's first new token, so generation ends after one step
    firsts = reference[:, ids.shape[1]].tolist()
    with torch.inference_mode():
        reference = theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    eos_token_id=firsts, pad_token_id=0)
    ours_ids = generate_ids(ours, ids, mask, max_new_tokens=6, eos_token_id=firsts, pad_token_id=0)
    assert torch.equal(ours_ids, reference) and ours_ids.shape[1] == ids.shape[1] + 1


def test_generate_reads_its_record_whatever_the_configs_forward_defaults(tmp_path):
    """A config.json asking every forward for tuples and hidden states (transformers honours it) changes
    neither model.generate's ids nor transformers'."""
    source, _, _ = _pair(SMALL["llama"], "sdpa")
    edited = tmp_path / "edited"
    shutil.copytree(source, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "return_dict": False, "output_hidden_states": True}))
    _, ours, theirs = _pair(SMALL["llama"], "sdpa")
    ours_edited = load_model(edited, "causal_lm", dtype=torch.float32).eval()
    assert isinstance(ours_edited(input_ids=torch.tensor([[5, 6]]), use_cache=False), tuple)
    ids, mask = _left_padded(ours.config.vocab_size)
    with torch.inference_mode():
        reference = theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                    eos_token_id=[], pad_token_id=0)
    got = ours_edited.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                               eos_token_id=[], pad_token_id=0)
    assert torch.equal(got, reference)


@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_k=20, top_p=0.9), dict(top_k=0, top_p=None)],
                         ids=["t0.7-k20-p0.9", "plain"])
def test_sampling_with_a_seed_equals_transformers_seeded_the_same(settings):
    """transformers draws from torch's global generator; seeded with the same number, the draws match ours."""
    _, ours, theirs = _pair(SMALL["llama"], "sdpa")
    ids, mask = _left_padded(ours.config.vocab_size)
    torch.manual_seed(123)
    with torch.inference_mode():
        reference = theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                                    eos_token_id=[], pad_token_id=0, **settings)
    ours_ids = generate_ids(ours, ids, mask, max_new_tokens=12, do_sample=True, seed=123, eos_token_id=[],
                            pad_token_id=0, **settings)
    assert torch.equal(ours_ids, reference)
    other = generate_ids(ours, ids, mask, max_new_tokens=12, do_sample=True, seed=124, eos_token_id=[],
                         pad_token_id=0, **settings)
    assert not torch.equal(other, ours_ids)


# ---- tokenizers, the text one-liner, the command ------------------------------------------------------

TEXTS = ["It was the fourth day of the month.", "  Botchan's ruffian ways, said he.", "naïve café — 😀 ü ß",
         "Hello\nworld\ttabs  and  spaces", ""]


def _spm_llama_dir(tmp_path):
    """The real botchan SentencePiece BPE model as a LLaMA tokenizer (tokenizer.model)."""
    root = tmp_path / "spm"
    root.mkdir()
    shutil.copy(sample_path("botchan") / "botchan_en_bpe_1000.model", root / "tokenizer.model")
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return root


def _assert_same_tokens(ours_dir, reference_dir=None):
    transformers = quiet_transformers()
    from flodl_hf.tokenization import AutoTokenizer
    ours = AutoTokenizer.from_pretrained(ours_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(reference_dir or ours_dir))
    a = ours(TEXTS, return_offsets_mapping=True, return_tensors=None)
    b = theirs(TEXTS, return_offsets_mapping=True)
    assert a["input_ids"] == b["input_ids"]
    assert [list(map(tuple, o)) for o in a["offset_mapping"]] == [list(map(tuple, o)) for o in b["offset_mapping"]]
    assert ours.padding_side == theirs.padding_side == "left"
    return ours, theirs


def test_llama_tokenizers_equal_transformers(tmp_path):
    """A SentencePiece model, and the tokenizer.json transformers writes from it (BPE with byte fallback)."""
    spm = _spm_llama_dir(tmp_path)
    _assert_same_tokens(spm)
    transformers = quiet_transformers()
    fast = tmp_path / "json"
    transformers.AutoTokenizer.from_pretrained(str(spm)).save_pretrained(str(fast))
    model = json.loads((fast / "tokenizer.json").read_text())["model"]
    assert model["type"] == "BPE" and model["byte_fallback"] is True
    ours, _ = _assert_same_tokens(fast)
    assert ours("😀", add_special_tokens=False, return_tensors=None)["input_ids"][0]  # bytes, not <unk>


def _text_model(tmp_path):
    """A small LLaMA causal LM with the botchan SentencePiece tokenizer (vocab 1000) beside it."""
    fields = {**_fields(SMALL["llama"]), "vocab_size": 1000, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    root = tmp_path / "model"
    shutil.copytree(make_checkpoint(fields, "causal_lm"), root)
    shutil.copy(sample_path("botchan") / "botchan_en_bpe_1000.model", root / "tokenizer.model")
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer",
                                                            "pad_token": "<unk>"}))
    return root


def test_generate_texts_without_a_pad_token(tmp_path):
    """LLaMA tokenizers often have no pad token: the prompts are left-padded by hand, and the records equal the
    text-generation pipeline's with and without one."""
    root = _text_model(tmp_path)
    prompts = ["It was the fourth day", "Botchan said"]
    transformers = quiet_transformers()
    from flodl_hf.tasks.runtime import clear_cache
    outputs = []
    for config in ({"tokenizer_class": "LlamaTokenizer", "pad_token": "<unk>"}, {"tokenizer_class": "LlamaTokenizer"}):
        (root / "tokenizer_config.json").write_text(json.dumps(config))
        clear_cache()
        pipe = transformers.pipeline("text-generation", model=str(root), tokenizer=str(root))
        assert (pipe.tokenizer.pad_token_id is None) == ("pad_token" not in config)
        ours = generate(prompts, str(root), do_sample=False, max_new_tokens=4, eos_token_id=[])
        assert ours == pipe(prompts, do_sample=False, max_new_tokens=4, eos_token_id=[])
        outputs.append(ours)
    assert outputs[0] == outputs[1]


def test_generate_texts_and_the_command(tmp_path, capsys):
    """generate() equals the pipeline (its records, and its ids are model.generate's on the padded batch);
    the command prints the texts, and with --json the pipeline's records, one list per prompt."""
    root = _text_model(tmp_path)
    prompts = ["It was the fourth day", "Botchan said"]
    transformers = quiet_transformers()
    pipe = transformers.pipeline("text-generation", model=str(root), tokenizer=str(root))
    greedy = {"do_sample": False, "max_new_tokens": 6, "eos_token_id": []}
    results = generate(prompts, str(root), **greedy)
    assert results == pipe(prompts, **greedy)
    assert generate(prompts[0], str(root), **greedy) == pipe(prompts[0], **greedy) == results[0]
    ids = generate(prompts, str(root), return_tensors=True, **greedy)
    assert ids == pipe(prompts, return_tensors=True, **greedy)
    tok = transformers.AutoTokenizer.from_pretrained(str(root))
    enc = tok(prompts, padding=True, return_tensors="pt")
    theirs = reference_model(root, "causal_lm", "sdpa")
    with torch.inference_mode():
        reference = theirs.generate(**enc, max_new_tokens=6, do_sample=False, eos_token_id=[], pad_token_id=0)
    width = enc["input_ids"].shape[1]
    assert [r[0]["generated_token_ids"][-6:] for r in ids] == reference[:, width:].tolist()
    from flodl_hf.cli import main
    args = ["--model", str(root), "--max-new-tokens", "6", "--no-sample", "--eos-token-id", ""]
    assert main(["generate", *prompts, *args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == results
    assert main(["generate", *prompts, *args]) == 0
    assert capsys.readouterr().out == "".join(r[0]["generated_text"] + "\n\n" for r in results)
    assert main(["generate", prompts[0], *args, "--no-full-text", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [pipe(prompts[0], return_full_text=False, **greedy)]
    assert main(["generate", prompts[0], *args, "--return-tensors"]) == 0
    assert capsys.readouterr().out == " ".join(map(str, ids[0][0]["generated_token_ids"])) + "\n\n"
    assert main(["generate", prompts[0], "--model", str(root), "--max-new-tokens", "0"]) == 2


def test_generate_refuses_a_model_that_is_not_a_causal_lm():
    from flodl_hf.core.errors import InputError
    source = make_checkpoint(_fields(SMALL["llama"]), "causal_lm")
    base = load_model(source, "base")
    with pytest.raises(InputError, match="causal_lm"):
        generate_ids(base, torch.ones(1, 3, dtype=torch.long))


def test_trainer_fine_tunes_a_decoder_with_the_causal_lm_loss(tmp_path):
    """A few AdamW steps on one repeated batch with the causal-LM loss: the loss falls, and the loss the
    trainer minimises is transformers' on the same weights."""
    from flodl_hf.training.trainer import Trainer
    source = make_checkpoint(_fields(SMALL["llama"]), "causal_lm")
    model = load_model(source, "causal_lm", dtype=torch.float32)
    ids, mask = _left_padded(model.config.vocab_size)
    labels = ids.masked_fill(mask == 0, -100)
    data = [{"input_ids": i, "attention_mask": m, "labels": lab} for i, m, lab in zip(ids, mask, labels)] * 4

    def step(m, batch):
        return m(**batch, use_cache=False).loss

    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
        theirs = reference_model(source, "causal_lm", "sdpa")
        assert before == theirs(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    Trainer(model, step, lambda ps: torch.optim.AdamW(ps, lr=1e-3), data, batch_size=3, max_steps=4, sync="none",
            progress=False, report=False, shuffle=False).fit()
    model.eval()
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    assert after < before


def test_export_and_verify_a_decoder_whose_tokenizer_has_no_pad_token(tmp_path):
    """LLaMA tokenizers often have no pad token: verify-export pads its prompts with EOS, on both sides."""
    from flodl_hf.roundtrip.export import export
    from flodl_hf.roundtrip.verify import verify_export
    root = _text_model(tmp_path)
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert quiet_transformers().AutoTokenizer.from_pretrained(str(root)).pad_token is None
    export(str(root), tmp_path / "out")
    report = verify_export(tmp_path / "out")
    assert report.ok, report
    assert "padded" in report.inputs and "random" not in report.inputs


def test_gemma3_text_reads_the_older_rope_and_pattern_spelling(tmp_path):
    """``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` and ``sliding_window_pattern`` (older Hub configs)
    read as transformers reads them: the same model as the nested ``rope_parameters`` and ``layer_types``."""
    root = tmp_path / "old"
    shutil.copytree(make_checkpoint(_fields(SMALL["gemma3_text"]), "causal_lm"), root)
    config = json.loads((root / "config.json").read_text())
    for name in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        config.pop(name, None)
    config.update(rope_theta=50000.0, rope_local_base_freq=500.0, sliding_window_pattern=2,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    (root / "config.json").write_text(json.dumps(config))
    theirs = quiet_transformers().AutoConfig.from_pretrained(str(root))
    ours = load_model(root, "causal_lm").config
    assert ours.layer_kinds() == theirs.layer_types == ["sliding_attention", "full_attention"]
    for kind in ("full_attention", "sliding_attention"):
        rope, params = ours.rope(kind), theirs.rope_parameters[kind]
        assert (rope.rope_type, rope.theta, rope.factor) == (params["rope_type"], params["rope_theta"],
                                                             params.get("factor"))
    for impl in ("sdpa", "eager"):
        result = check_parity(root, "causal_lm", impl)
        assert result.exact, (impl, result.diffs)
    from flodl_hf.core.errors import ConfigError
    for bad in ({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}},
                {"use_bidirectional_attention": True}):
        (root / "config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(ConfigError, match=next(iter(bad))):
            load_model(root, "causal_lm")


def test_gemma2_asked_for_sdpa_runs_its_eager_path():
    """transformers 5.24 has no sdpa path for Gemma2 (it refuses one: softcapping); as for the other one-path
    families, a model asked for sdpa here runs its own path, masks included: the same bits as eager."""
    source = make_checkpoint(_fields(SMALL["gemma2"]), "causal_lm")
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        reference_model(source, "causal_lm", "sdpa")
    theirs = reference_model(source, "causal_lm", None)
    assert load_model(source, "causal_lm").attn_implementation == theirs.config._attn_implementation == "eager"
    ours = load_model(source, "causal_lm", attn_implementation="sdpa").eval()
    ids, mask = _left_padded(ours.config.vocab_size)
    with torch.inference_mode():
        assert torch.equal(ours(input_ids=ids, attention_mask=mask).logits,
                           theirs(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("model_type", list(SMALL))
def test_a_given_cache_with_use_cache_false_is_returned_as_transformers_returns_it(model_type):
    """A cached step with ``use_cache=False``: LLaMA, Gemma2/3, GPT-NeoX, OLMo 1/2, Granite, StableLM, GPT-J, OPT,
    Mixtral, Phi and Cohere return the given cache, updated; Mistral, Qwen2/3, Phi-3, Gemma, GPT-2, StarCoder2 and
    Qwen2-MoE return none (``config.returns_given_cache``, as each transformers ``*Model.forward``). On a left-padded
    batch: the logits, and the returned cache's length, keys and values equal transformers'; with no cache given,
    none comes back."""
    _, ours, theirs = _pair(SMALL[model_type], "eager")
    ids, mask = _left_padded(ours.config.vocab_size, lengths=(6, 4, 3))
    with torch.no_grad():
        first_ours = ours(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
        first_theirs = theirs(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
        step_ours = ours(input_ids=ids[:, 4:], attention_mask=mask, cache=first_ours.cache, use_cache=False)
        step_theirs = theirs(input_ids=ids[:, 4:], attention_mask=mask, past_key_values=first_theirs.past_key_values,
                             use_cache=False)
        assert ours(input_ids=ids, attention_mask=mask, use_cache=False).cache is None
    assert torch.equal(step_ours.logits, step_theirs.logits)
    returned = step_theirs.past_key_values
    assert (step_ours.cache is None) == (returned is None)
    if returned is not None:
        assert step_ours.cache.get_seq_length() == returned.get_seq_length() == 6
        for layer, theirs_layer in enumerate(returned.layers):
            assert torch.equal(step_ours.cache.keys[layer], theirs_layer.keys), layer
            assert torch.equal(step_ours.cache.values[layer], theirs_layer.values), layer
